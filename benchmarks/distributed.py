"""all_reduce bus bandwidth: occl on openreg tensors vs gloo on CPU tensors, in one run.

    PYTHONPATH=. python benchmarks/distributed.py [--ranks 2] [--iters 400] [--max-mb 64]

Spawns the ranks once (a TCP store on 127.0.0.1); each rank joins one process group
"cpu:gloo,openreg:occl", so the two backends share the processes, the machine load and gloo's
transport. For each size from 1 KB to 64 MB, occl (openreg tensors, rank r on openreg:r % 2) and
gloo (CPU tensors) alternate call by call, `iters` all_reduce (SUM, float32) each (a tenth of
that from 1 MB), the order swapped every pair, so that both see the same machine load. Each call
is timed alone (it returns when the result is there). The report: per size, the median and
the 10th percentile of the call times on rank 0 (the latter is less disturbed by other load on a
shared machine), the bus bandwidth size * 2 (n - 1) / n / time at the median (the nccl-tests
convention), and occl/gloo for both. occl hands gloo CPU aliases of the device
memory, so the target is occl within 1.1x of gloo: a hidden copy to the host and back would show
at large sizes. occl compares each collective's shapes across ranks first (one small all-gather,
docs/distributed.md); "occl unchecked" is a second group created with OPENREG_OCCL_CHECK=0,
measured in the same alternation, so the report shows that comparison's cost apart from the
data path.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(x: torch.Tensor, group=None) -> float:
    """One all_reduce, timed until its result is there."""
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.openreg.set_device(rank % torch.openreg.device_count())
    dist.init_process_group("cpu:gloo,openreg:occl", rank=rank, world_size=world)
    os.environ["OPENREG_OCCL_CHECK"] = "0"
    unchecked = dist.new_group(backend="cpu:gloo,openreg:occl")
    del os.environ["OPENREG_OCCL_CHECK"]
    groups = {"gloo": None, "occl": None, "unchecked": unchecked}
    results = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        xs = {"gloo": torch.ones(n), "occl": torch.ones(n, device="openreg"),
              "unchecked": torch.ones(n, device="openreg")}
        for name, x in xs.items():  # warm up (connections, pages)
            _call(x, groups[name])
            _call(x, groups[name])
        times = {name: [] for name in xs}
        calls = max(10, iters // 10) if nbytes >= 1 << 20 else iters
        for i in range(calls):
            # call by call, alternating, the order reversed every other round: all variants
            # see the same machine load
            order = list(xs) if i % 2 == 0 else list(reversed(xs))
            for name in order:
                times[name].append(_call(xs[name], groups[name]))
        results[nbytes] = {k: (statistics.median(v), sorted(v)[len(v) // 10]) for k, v in
                           times.items()}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--max-mb", type=int, default=64)
    args = parser.parse_args()
    sizes = []
    s = 1024
    while s <= args.max_mb * 1024 * 1024:
        sizes.append(s)
        s *= 4
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = mp.start_processes(_rank, args=(args.ranks, port, sizes, args.iters, queue),
                               nprocs=args.ranks, join=False, start_method="spawn")
    results = queue.get(timeout=1800)
    procs.join()
    bus = 2 * (args.ranks - 1) / args.ranks
    print(f"all_reduce SUM float32, {args.ranks} ranks, {args.iters} calls per size and backend "
          f"({max(10, args.iters // 10)} from 1 MB), alternating call by call")
    print(f"{'size':>8} {'gloo CPU us':>18} {'occl us':>18} {'unchecked us':>18}"
          f" {'gloo GB/s':>10} {'occl GB/s':>10} {'occl/gloo':>10} {'occl/gloo':>10}"
          f" {'unch./gloo':>11} {'unch./gloo':>11}")
    print(f"{'':>8} {'median / p10':>18} {'median / p10':>18} {'median / p10':>18}"
          f" {'median':>10} {'median':>10} {'median':>10} {'p10':>10} {'median':>11} {'p10':>11}")
    for nbytes, r in results.items():
        label = f"{nbytes // 1024} KB" if nbytes < 1 << 20 else f"{nbytes >> 20} MB"
        (gm, gb), (om, ob), (um, ub) = r["gloo"], r["occl"], r["unchecked"]
        print(f"{label:>8} {f'{gm * 1e6:.1f} / {gb * 1e6:.1f}':>18}"
              f" {f'{om * 1e6:.1f} / {ob * 1e6:.1f}':>18} {f'{um * 1e6:.1f} / {ub * 1e6:.1f}':>18}"
              f" {nbytes * bus / gm / 1e9:>10.3f} {nbytes * bus / om / 1e9:>10.3f}"
              f" {om / gm:>10.2f} {ob / gb:>10.2f} {um / gm:>11.2f} {ub / gb:>11.2f}")

if __name__ == "__main__":
    main()
