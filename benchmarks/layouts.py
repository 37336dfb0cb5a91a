"""Per-call cost of sparse and nested operators on openreg next to the same call on the CPU
(docs/layouts.md), in one process, rounds interleaved so that both see the same machine load.

    python benchmarks/layouts.py [--rounds R] [--threads N]

Each line: median µs per call on the CPU, on openreg, and the ratio. The fixed cost on openreg is
the layout fallback (a CPU twin per sparse/nested argument, one CPU alias per dense part, the
result's parts adopted as device memory); on large inputs the CPU kernel dominates.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def per_call_us(fn, n: int) -> float:
    for _ in range(max(1, n // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def cases(device: str):
    g = torch.Generator().manual_seed(0)
    small = torch.randn(8, 8, generator=g).relu()
    big = torch.randn(1000, 1000, generator=g)
    big[big < 1.5] = 0  # ~7% non-zero
    dense_small, dense_big = torch.randn(8, 4), torch.randn(1000, 64)
    coo_s, coo_b = small.to_sparse().to(device), big.to_sparse().to(device)
    csr_b = big.to_sparse_csr().to(device)
    ds, db = dense_small.to(device), dense_big.to(device)
    nt = torch.nested.nested_tensor([torch.randn(5, 8), torch.randn(3, 8)]).to(device)
    return {
        "coo 8x8: to_dense": (lambda: coo_s.to_dense(), 2000),
        "coo 8x8: coalesce (uncoalesced copy)": (lambda: (coo_s + coo_s).coalesce(), 1000),
        "coo 8x8: mul scalar": (lambda: coo_s * 2.0, 2000),
        "coo 8x8: sparse.mm dense 8x4": (lambda: torch.sparse.mm(coo_s, ds), 2000),
        "coo 1000x1000 7%: sparse.mm dense 1000x64": (lambda: torch.sparse.mm(coo_b, db), 20),
        "csr 1000x1000 7%: @ dense 1000x64": (lambda: csr_b @ db, 20),
        "nested 2x(n,8): relu": (lambda: nt.relu(), 2000),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads(N) first (1 steadies numbers on a busy machine)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    times: dict[str, dict[str, list[float]]] = {}
    with torch.no_grad():
        all_cases = {d: cases(d) for d in ("cpu", "openreg")}
        for _ in range(args.rounds):
            for name in all_cases["cpu"]:
                for d in ("cpu", "openreg"):
                    fn, n = all_cases[d][name]
                    times.setdefault(name, {}).setdefault(d, []).append(per_call_us(fn, n))
            torch.openreg.synchronize()
    print(f"{'operator':45s} {'cpu µs':>9s} {'openreg µs':>11s} {'ratio':>6s}")
    for name, by_device in times.items():
        c, o = (statistics.median(by_device[d]) for d in ("cpu", "openreg"))
        print(f"{name:45s} {c:9.1f} {o:11.1f} {o / c:6.2f}")


if __name__ == "__main__":
    main()
