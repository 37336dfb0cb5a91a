"""Instructions per call of tiny operators on the CPU and on openreg, counted with callgrind.

    python benchmarks/callgrind_ops.py [--out DIR]

Wall-clock ratios of tiny operators move with the machine's load; instruction counts do not.
This runs itself under `valgrind --tool=callgrind --collect-atstart=no` (valgrind must be
installed) with OMP_NUM_THREADS=1, and counts, for each device, a block of calls of each
workload with collection switched on around it only (torch's `_valgrind_toggle`), after 200
calls of warm-up: 2,000 chained adds `y = y + x` of 4 float32 elements (what
`benchmarks/run.py tiny_adds` times), 2,000 `torch.add(a, b)`, 100 `_foreach_add_` and 50
`_fused_adam_` over 100 tensors of 16 elements; and 3 steps each of two workloads with backward
(`benchmarks/fallback.py lbfgs`, two iterations of test_optim's sparse Rosenbrock with Adagrad from
`benchmarks/layouts.py`), after 10 of warm-up, with backward on the caller's thread so that it is
counted (`callgrind.py`). It prints the instructions per call and the ratio openreg / CPU. The
callgrind files stay in DIR (default: a temporary directory) for
`callgrind_annotate --inclusive=yes DIR/cg.out.<n>`. Takes a few minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callgrind import count_block, run_under_callgrind  # noqa: E402

# (name, calls, with backward: counted on the caller's thread, after 10 calls of warm-up)
WORKLOADS = [("chain `y = y + x`, 4 elements", 2000, False),
             ("`torch.add(a, b)`, 4 elements", 2000, False),
             ("`_foreach_add_`, 100 x 16", 100, False), ("`_fused_adam_`, 100 x 16", 50, False),
             ("LBFGS step, backward on the caller", 3, True),
             ("sparse Rosenbrock, Adagrad, 2 iterations, backward on the caller", 3, True)]
DEVICES = ("cpu", "openreg:0")


def blocks(torch, dev):
    x = torch.ones(4, device=dev)
    state = {"y": x}

    def chain():
        state["y"] = state["y"] + x

    a, b = torch.rand(4, device=dev), torch.rand(4, device=dev)
    lists = [[torch.rand(16, device=dev) for _ in range(100)] for _ in range(4)]
    m1, m2 = ([torch.zeros(16, device=dev) for _ in range(100)] for _ in range(2))
    steps = [torch.zeros((), device=dev) for _ in range(100)]

    def adam():
        torch._fused_adam_(lists[2], lists[3], m1, m2, [], steps, lr=1e-3, beta1=0.9,
                           beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                           maximize=False)

    import fallback
    import layouts
    return [chain, lambda: torch.add(a, b), lambda: torch._foreach_add_(lists[0], lists[1]), adam,
            fallback.lbfgs(dev), layouts.rosenbrock_sparse(dev)]


def child() -> None:
    import torch
    for dev in DEVICES:
        for (_, n, backward), f in zip(WORKLOADS, blocks(torch, dev)):
            if backward:
                count_block(f, n, dev, backward_on_caller=True, warmup=10)
            else:
                count_block(f, n, dev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="directory for the callgrind files")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child()
        return
    out = args.out or tempfile.mkdtemp(prefix="callgrind_ops.")
    counts = run_under_callgrind(__file__, ["--child"], out,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert len(counts) == len(DEVICES) * len(WORKLOADS), f"{len(counts)} dumps in {out}"
    import torch
    print(f"torch {torch.__version__}, OMP_NUM_THREADS=1, instructions per call (callgrind, {out})")
    print()
    print("| workload | cpu | openreg | ratio |")
    print("|---|---|---|---|")
    k = len(WORKLOADS)
    for i, (name, n, _) in enumerate(WORKLOADS):
        cpu, dev = counts[i] / n, counts[k + i] / n
        print(f"| {name} | {cpu:,.0f} | {dev:,.0f} | {dev / cpu:.3f}x |")


if __name__ == "__main__":
    main()
