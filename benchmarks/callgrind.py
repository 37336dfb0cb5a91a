"""Instruction counts of measured blocks of calls: a script that runs itself under callgrind.

The parent calls `run_under_callgrind(script, args)`: it starts `python script args` under
`valgrind --tool=callgrind --collect-atstart=no` (valgrind must be installed) and returns the
instructions of each dump, in order. The child calls `count_block(step, calls, device)` once per
block: 200 calls of warm-up, the device synchronized, then collection switched on around the
measured calls only (torch's `_valgrind_toggle`) and one dump. Deterministic to a fraction of a
percent and unaffected by the machine's load, where wall-clock ratios of tiny operators are not.

The switch counts the thread that turns it on only: backward of openreg tensors runs on the
autograd engine's device thread, whose instructions are left out. For a step with backward, pass
`backward_on_caller=True` (autograd multithreading off for the measured calls, so backward runs
on the caller and is counted; the handoffs themselves are then not part of the count).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from typing import Callable

import torch


def count_block(step: Callable[[], object], calls: int, device: str,
                backward_on_caller: bool = False, warmup: int = 200) -> None:
    """In the child: one dump holding the instructions of `calls` calls of `step` (see above for
    `backward_on_caller`)."""
    with torch.autograd.set_multithreading_enabled(not backward_on_caller):
        for _ in range(warmup):
            step()
        if device != "cpu":
            torch.openreg.synchronize()
        torch._C._valgrind_toggle()
        for _ in range(calls):
            step()
        torch._C._valgrind_toggle_and_dump_stats()


def run_under_callgrind(script: str, args: list[str], out_dir: str,
                        env: dict | None = None) -> list[int]:
    """In the parent: the instructions of each dump the child made, in the order it made them.
    The callgrind files stay in `out_dir` (`callgrind_annotate --inclusive=yes
    out_dir/cg.out.<n>`)."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "cg.out*")):
        os.remove(old)
    out = os.path.join(out_dir, "cg.out")
    subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no",
                    f"--callgrind-out-file={out}", sys.executable, os.path.abspath(script), *args],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dumps = sorted(glob.glob(f"{out}.*"), key=lambda f: int(f.rsplit(".", 1)[1]))
    counts = []
    for dump in dumps:  # callgrind numbers its dumps out.1, out.2, ...
        with open(dump) as f:
            counts.append(int(re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M).group(1)))
    return counts
