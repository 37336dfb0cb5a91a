"""CPU and openreg side by side, in one process, with default autograd settings.

    python benchmarks/run.py [--rounds R] [--steps N] [--device openreg:0] [workload ...]

Rounds alternate CPU and openreg so that both see the same machine load; the reported time is
the median over all measured steps, the ratio is openreg / CPU. Targets (from the project's
issues): training steps within 1.2x of the CPU, the tiny-op loop within 3x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # noqa: E402


def measure(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def bench(name: str, device: str, rounds: int, steps: int) -> tuple[float, float]:
    build, _ = WORKLOADS[name]
    cpu_step, dev_step = build("cpu"), build(device)
    for step in (cpu_step, dev_step):  # warm-up: caches, allocator, autograd threads
        measure(step, max(3, steps // 4))
    cpu, dev = [], []
    for _ in range(rounds):
        cpu += measure(cpu_step, steps)
        dev += measure(dev_step, steps)
    return statistics.median(cpu), statistics.median(dev)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="openreg:0")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} cores, device {args.device}\n")
    print("| workload | cpu | openreg | ratio | target |")
    print("|---|---|---|---|---|")
    failed = False
    for name in args.workloads:
        target = WORKLOADS[name][1]
        try:
            cpu, dev = bench(name, args.device, args.rounds, args.steps)
        except Exception as e:  # report and go on with the other workloads
            print(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
            failed = True
            continue
        ratio = dev / cpu
        ok = ratio <= target
        failed |= not ok
        print(f"| {name} | {cpu * 1e3:.3f} ms | {dev * 1e3:.3f} ms | {ratio:.2f}x | "
              f"<= {target}x {'ok' if ok else 'MISSED'} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
