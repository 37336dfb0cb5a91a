"""Cost of strict memory isolation (OPENREG_STRICT_MEMORY=1) on openreg:0.

    PYTHONPATH=. python benchmarks/memory_isolation.py [--rounds R] [--steps N]

Strict mode is chosen at process start, so every round runs one child process per mode,
alternating default and strict so that both see the same machine load. Each child measures the
step times of the MLP training step (784-256-256-10, batch 64) and of the tiny-op loop (100 adds
of 4 elements) from benchmarks/workloads.py; the report is the median over all measured steps per
mode, and the ratio strict / default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import json, sys, time
sys.path.insert(0, {here!r})
import torch
from workloads import mlp, tiny_adds
out = {{}}
for name, make in [("mlp", mlp), ("tiny_adds", tiny_adds)]:
    step = make("openreg:0")
    for _ in range(5):
        step()
    times = []
    for _ in range({steps}):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out[name] = times
print(json.dumps(out))
"""


def run_child(strict: bool, steps: int) -> dict[str, list[float]]:
    env = dict(os.environ, OPENREG_STRICT_MEMORY="1" if strict else "0")
    result = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE, steps=steps)],
                            capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    times: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for _ in range(args.rounds):
        for strict in (False, True):
            for name, t in run_child(strict, args.steps).items():
                times[strict].setdefault(name, []).extend(t)
    print(f"{'workload':<12}{'default':>12}{'strict':>12}{'strict/default':>16}")
    for name in times[False]:
        default = statistics.median(times[False][name]) * 1e3
        strict = statistics.median(times[True][name]) * 1e3
        print(f"{name:<12}{default:>10.3f}ms{strict:>10.3f}ms{strict / default:>15.2f}x")


if __name__ == "__main__":
    main()
