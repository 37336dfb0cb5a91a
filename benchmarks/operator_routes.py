"""Per-call cost of each operator route (docs/operator_routes.md), next to the generic fallback.

    python benchmarks/operator_routes.py [--rounds R]

Each line is the median time of one call (µs) over R rounds of interleaved measurements. Small
tensors show the route's own overhead; the mse_loss lines at 1M elements show the fused kernel
against the CPU's own mse_loss on CPU tensors (what the fallback would run, plus ~3 µs), and the
kernel's unfused path (transposed inputs: the CPU kernel on device memory, as in the fallback).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(n // 10):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def cases():
    d = "openreg"
    x, y = torch.randn(4, device=d), torch.randn(4, device=d)
    xc = x.cpu()
    mask = torch.ones(4, dtype=torch.uint8, device=d)
    x2, y2 = torch.randn(2, 2, device=d).t(), torch.randn(2, 2, device=d).t()
    big_a, big_b = torch.randn(1024, 1024, device=d), torch.randn(1024, 1024, device=d)
    big_ac, big_bc = big_a.cpu(), big_b.cpu()
    mse = torch._C._nn.mse_loss  # without F.mse_loss's Python argument handling
    return {
        "cpu: torch.neg (no backend)": lambda: torch.neg(xc),
        "fallback (C++ boxed): torch.neg": lambda: torch.neg(x),
        "fallback (C++ boxed): x.mul_(0)": lambda: x.mul_(0),
        "DispatchStub: torch.abs": lambda: torch.abs(x),
        "codegen kernel: x.zero_()": lambda: x.zero_(),
        "per-op boxed kernel: torch.equal": lambda: torch.equal(x, y),
        "fallback (C++ boxed): torch.eq": lambda: torch.eq(x, y),
        "hand-written kernel: mse_loss, 4 (fused)": lambda: mse(x, y),
        "hand-written kernel: mse_loss, 4 (unfused)": lambda: mse(x2, y2),
        "cpu: mse_loss, 1M": lambda: mse(big_ac, big_bc),
        "hand-written kernel: mse_loss, 1M (fused)": lambda: mse(big_a, big_b),
        "hand-written kernel: mse_loss, 1M (unfused)": lambda: mse(big_a.t(), big_b.t()),
        "Python aten kernel: _masked_scale": lambda: torch._masked_scale(x, mask, 2.0),
        "C++ custom op: openreg::custom_abs": lambda: torch.ops.openreg.custom_abs(x),
        "Python custom_op: openreg::custom_add": lambda: torch.ops.openreg.custom_add(x, y),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    with torch.no_grad():
        all_cases = cases()
        for _ in range(args.rounds):
            for name, fn in all_cases.items():
                n = 50 if "1M" in name else 2000
                results.setdefault(name, []).append(per_call_us(fn, n))
    for name, times in results.items():
        print(f"{name:45s} {statistics.median(times):9.1f} µs")


if __name__ == "__main__":
    main()
