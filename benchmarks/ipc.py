"""Sending a device tensor to another process costs no copy of its data (docs/ipc.md).

    python benchmarks/ipc.py [--rounds R]

A spawned receiver takes each tensor from a torch.multiprocessing Queue, reads its last element
(so the memory is really mapped and usable) and answers on a second queue. The time of that round
trip is measured for openreg tensors of 1 MB and 64 MB: it should not depend on the size. For
scale, the same round trip with CPU tensors already in shared memory (torch's own IPC, no copy
either), and the time of copying 64 MB on the device (what a copying transport would at least
pay). Median over the rounds, in one process side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

SIZES = {"1 MB": 1 << 20, "64 MB": 64 << 20}


def receiver(inq, outq):
    while True:
        t = inq.get()
        if t is None:
            return
        outq.put((str(t.device), t.numel(), t[-1].item()))
        del t


def round_trip(inq, outq, t) -> float:
    start = time.perf_counter()
    inq.put(t)
    device, numel, last = outq.get(timeout=60)
    elapsed = time.perf_counter() - start
    assert device == str(t.device) and numel == t.numel() and last == t[-1].item()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(inq, outq), daemon=True)
    p.start()
    try:
        tensors = {}
        for name, nbytes in SIZES.items():
            tensors[f"openreg {name}"] = torch.full((nbytes // 4,), 2.0, device="openreg:0")
            tensors[f"cpu (shared memory) {name}"] = torch.full((nbytes // 4,), 2.0).share_memory_()
        for t in tensors.values():  # warm-up: the receiver's imports, first mappings
            round_trip(inq, outq, t)
        times = {name: [] for name in tensors}
        for _ in range(args.rounds):
            for name, t in tensors.items():  # interleaved: every case sees the same load
                times[name].append(round_trip(inq, outq, t))
        big = tensors["openreg 64 MB"]
        copies = []
        for _ in range(max(3, args.rounds // 4)):
            start = time.perf_counter()
            big.clone()
            torch.openreg.synchronize()
            copies.append(time.perf_counter() - start)
        print(f"{'send to another process and get an answer':<44} median ms")
        for name, values in times.items():
            print(f"  {name:<42} {statistics.median(values) * 1e3:8.3f}")
        ratio = statistics.median(times["openreg 64 MB"]) / statistics.median(times["openreg 1 MB"])
        print(f"openreg 64 MB / 1 MB: {ratio:.2f}x (a copy would make it ~64x)")
        print(f"{'copy of 64 MB on the device (clone)':<46} {statistics.median(copies) * 1e3:8.3f}")
    finally:
        inq.put(None)
        p.join(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
