"""The asynchronous kernel mode's cost: the same workloads in the default mode and in the
asynchronous mode (docs/async_mode.md), on the CPU for reference, in one process.

    python benchmarks/async_mode.py [--rounds R] [--steps N]

Per operator: the host time of one queued `add` (the host does not wait: what a program that
issues many kernels pays per launch), and the round trip of a loop of adds ending with .item().
Rounds alternate the modes so that all see the same machine load; times are medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import measure, mlp, tiny_adds  # noqa: E402


def launch_only(device: str, numel: int, n: int = 200):
    """Host time per `x + y` issued n times in a row (the queue absorbs them in async mode)."""
    x = torch.ones(numel, device=device)

    def step() -> float:
        if device != "cpu":
            torch.openreg.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x + x
        host = (time.perf_counter() - t0) / n
        if device != "cpu":
            torch.openreg.synchronize()
        return host

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    variants = [("cpu", "cpu", False), ("default", "openreg", False), ("async", "openreg", True)]
    workloads = {
        "add 4 elem, host time per launch": lambda d: launch_only(d, 4),
        "add 1M elem, host time per launch": lambda d: launch_only(d, 1 << 20, 20),
        "100 adds of 4 elem + item()": lambda d: tiny_adds(d),
        "MLP train step (784-256-256-10, b64)": lambda d: mlp(d),
    }
    for name, make in workloads.items():
        results = {v: [] for v, _, _ in variants}
        steps = {}
        for label, device, asynchronous in variants:
            with torch.openreg.set_async(asynchronous):
                steps[label] = make(device)
                measure(steps[label], 3)  # warm up
        for _ in range(args.rounds):
            for label, device, asynchronous in variants:
                with torch.openreg.set_async(asynchronous):
                    if "per launch" in name:
                        results[label] += [steps[label]() for _ in range(args.steps // 4 + 1)]
                    else:
                        results[label] += measure(steps[label], args.steps)
                    torch.openreg.synchronize()
        med = {k: statistics.median(v) * 1e6 for k, v in results.items()}
        print(f"{name}: " + ", ".join(f"{k} {med[k]:.1f} us" for k in med)
              + f"  (async/default {med['async'] / med['default']:.2f}x)")


if __name__ == "__main__":
    main()
