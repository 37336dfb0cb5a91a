"""A captured MLP training step replayed, against the same step run eagerly, on openreg
(docs/graphs.md). The CPU's eager step is printed as the reference.

    PYTHONPATH=. python benchmarks/graphs.py [--rounds R] [--steps N] [--batch B] [--threads T]

On a loaded machine run with --threads 1 (or OMP_NUM_THREADS=1): with several OpenMP threads per
kernel, contention for the cores makes every step time bimodal, for the CPU and openreg alike.

The model is the README's MLP (784-256-256-10, SGD with momentum, cross entropy). The graph is
captured once with PyTorch's "whole network capture" recipe (static input and target; forward,
backward and optimizer step). Rounds alternate eager CPU, eager openreg and replay so that all
see the same machine load; each time is the median over all measured steps; ratios are to the
eager openreg step. Replay is host-synchronous on openreg (kernels run on the calling thread), so
the measured time is the whole step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def make(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def eager_step(device, batch):
    model, opt = make(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def graphed_step(batch):
    device = "openreg"
    model, opt = make(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    static_x = torch.randn(batch, 784, device=device)
    static_y = torch.randint(0, 10, (batch,), device=device)
    s = torch.Stream(device=device)
    with s:  # warm-up (creates the optimizer state)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.accelerator.synchronize()
    g = torch.accelerator.Graph()
    opt.zero_grad(set_to_none=True)
    with s, g:
        loss_fn(model(static_x), static_y).backward()
        opt.step()
    return g.replay


def measure(step, n, sync):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sync = torch.openreg.synchronize
    cpu = eager_step("cpu", args.batch)
    eager = eager_step("openreg", args.batch)
    replay = graphed_step(args.batch)
    results = {"cpu eager": [], "openreg eager": [], "openreg replay": []}
    for fn in (cpu, eager, replay):  # warm-up
        measure(fn, 3, sync)
    for _ in range(args.rounds):
        results["cpu eager"] += measure(cpu, args.steps, lambda: None)
        results["openreg eager"] += measure(eager, args.steps, sync)
        results["openreg replay"] += measure(replay, args.steps, sync)
    base = statistics.median(results["openreg eager"])
    print(f"MLP 784-256-256-10 training step, batch {args.batch}, SGD momentum, "
          f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps, medians")
    for name, times in results.items():
        m = statistics.median(times)
        print(f"  {name:15s} {m * 1e3:7.3f} ms   {m / base:5.2f}x openreg eager")


if __name__ == "__main__":
    main()
