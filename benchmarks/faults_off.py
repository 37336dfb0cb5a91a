"""What device profiles and fault injection cost when they are off: tiny operators, per call.

    python benchmarks/faults_off.py [--rounds R] [--calls N]
    python benchmarks/faults_off.py --instructions [--calls N]

The checks sit where every device tensor is born (empty_strided, a kernel's result), where every
allocation passes (the caching allocator) and where every kernel is launched (LaunchScope): one
never-taken branch each when no profile is set and no fault is armed. To compare two builds
(before and after a change), run this script with each checkout on PYTHONPATH, alternating, several
times (docs/fault_injection.md gives the commands and numbers). Each round alternates the CPU and
openreg in one process; the ratio openreg / CPU is what compares across processes under load.

--instructions counts instructions instead of time: the script runs itself under valgrind's
callgrind with collection off, switches it on around each workload's calls (after a warm-up) and
prints the instructions per call. Deterministic to a fraction of a percent, and unaffected by
the machine's load: what tells two builds apart when the timings cannot (needs valgrind).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callgrind import count_block, run_under_callgrind  # noqa: E402


def per_call_ns(step, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        step()
    return (time.perf_counter_ns() - start) / calls


def workloads(device: str) -> dict:
    a = torch.rand(4, device=device)
    b = torch.rand(4, device=device)
    return {
        "add (4 elements)": lambda: torch.add(a, b),
        "empty (4 elements)": lambda: torch.empty(4, device=device),
        "mul_ in place": lambda: a.mul_(1.0),
        "sum().item()": lambda: a.sum().item(),
    }


def count_under_callgrind(calls: int) -> None:
    """Inside valgrind: each workload's calls in a block of its own (benchmarks/callgrind.py)."""
    for device in ("cpu", "openreg:0"):
        for step in workloads(device).values():
            count_block(step, calls, device)


def instructions(calls: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        counts = run_under_callgrind(__file__, ["--under-callgrind", "--calls", str(calls)],
                                     folder)
    names = list(workloads("cpu"))
    assert len(counts) == 2 * len(names), f"{len(counts)} callgrind dumps"
    print(f"{'workload':22} {'cpu instr':>10} {'openreg instr':>14} {'ratio':>6}")
    for name, c, o in zip(names, counts, counts[len(names):]):
        c, o = c / calls, o / calls
        print(f"{name:22} {c:10.0f} {o:14.0f} {o / c:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--instructions", action="store_true",
                        help="instructions per call, counted by callgrind (needs valgrind)")
    parser.add_argument("--under-callgrind", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.under_callgrind:
        return count_under_callgrind(args.calls)
    if args.instructions:
        return instructions(min(args.calls, 2000))
    cpu, dev = workloads("cpu"), workloads("openreg:0")
    times: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "openreg": []} for k in cpu}
    for _ in range(args.rounds):
        for name in cpu:
            times[name]["cpu"].append(per_call_ns(cpu[name], args.calls))
            times[name]["openreg"].append(per_call_ns(dev[name], args.calls))
    print(f"{'workload':22} {'cpu ns':>8} {'openreg ns':>11} {'ratio':>6}")
    for name, t in times.items():
        c, o = statistics.median(t["cpu"]), statistics.median(t["openreg"])
        print(f"{name:22} {c:8.0f} {o:11.0f} {o / c:6.2f}")


if __name__ == "__main__":
    main()
