"""Sparse and nested tensors on openreg next to the same work on the CPU (docs/layouts.md), in one
process, rounds interleaved so that both see the same machine load.

    python benchmarks/layouts.py [--rounds R] [--steps N] [--threads T] [--device openreg:0]
                                 [workload ...]

Each line: the median time of a step on the CPU and on openreg, and the ratio openreg / CPU.
The last column, "CPU time ratio", divides the process's CPU time per step (all threads, the
autograd device threads included) on openreg by the CPU's: the work. A wall-time ratio above it
is waiting (a thread asleep until another wakes it: the backward handoff to the device thread).
Three kinds of workloads:
- loops of 100 calls of one operator on a small sparse COO tensor (what test suites and sparse
  optimizers are made of: the layout fallback's fixed cost per call shows there);
- optimizer steps with sparse gradients (Adagrad, SGD, SparseAdam), on a 2-element parameter
  with an uncoalesced gradient (as PyTorch's test_optim tortures them) and on the weight of an
  nn.Embedding(10000, 64, sparse=True) after a lookup of 64 rows;
- one step of test_optim's sparse Rosenbrock test (closure, backward, the sparse gradient built
  on the device, the step, a dense twin optimizer compared with it);
- single calls on large inputs, where the CPU kernel dominates.
Targets from issue 41: 1.3x for the loops and the optimizer steps.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import bench, fmt_time as _fmt  # noqa: E402

warnings.filterwarnings("ignore")  # sparse invariant checks, beta warnings

Step = Callable[[], object]
LOOP = 100  # calls per step of the operator loops


def _loop(fn: Callable[[], object]) -> Step:
    def step() -> None:
        for _ in range(LOOP):
            fn()

    return step


def _small_coo(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g).relu().to_sparse().to(device)


def _uncoalesced(device: str) -> torch.Tensor:
    """8x8, 24 entries over 12 distinct positions (each index twice)."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 8, (2, 12), generator=g)
    idx = torch.cat([idx, idx], dim=1)
    return torch.sparse_coo_tensor(idx, torch.randn(24, generator=g), (8, 8)).to(device)


# ---- loops of 100 calls on small COO tensors

def coalesce_loop(device: str) -> Step:
    s = _uncoalesced(device)
    return _loop(lambda: s.coalesce())


def add_dense_sparse_loop(device: str) -> Step:
    """dense + sparse (a new dense tensor) and dense.add_(sparse)."""
    s = _small_coo(device)
    d = torch.zeros(8, 8).to(device)
    return _loop(lambda: (d + s, d.add_(s, alpha=0.0)))


def index_select_loop(device: str) -> Step:
    s = _small_coo(device)
    index = torch.tensor([0, 2, 5, 7]).to(device)
    return _loop(lambda: s.index_select(0, index))


def to_dense_loop(device: str) -> Step:
    s = _small_coo(device)
    return _loop(lambda: s.to_dense())


def mul_scalar_loop(device: str) -> Step:
    s = _small_coo(device)
    return _loop(lambda: s * 2.0)


def sparse_mm_loop(device: str) -> Step:
    s = _small_coo(device)
    d = torch.randn(8, 4).to(device)
    return _loop(lambda: torch.sparse.mm(s, d))


def nested_relu_loop(device: str) -> Step:
    nt = torch.nested.nested_tensor([torch.randn(5, 8), torch.randn(3, 8)]).to(device)
    return _loop(lambda: nt.relu())


# ---- optimizer steps with sparse gradients

def _small_param(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-element float64 parameter and an uncoalesced sparse gradient for it (test_optim's
    Rosenbrock parameter and its torture gradient)."""
    param = torch.tensor([1.5, 1.5], dtype=torch.float64).to(device).requires_grad_()
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1]]), torch.tensor([0.25, 0.75, -0.5],
                                   dtype=torch.float64), (2,)).to(device)
    return param, grad


def _embedding_param(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of nn.Embedding(10000, 64, sparse=True) and its gradient after a lookup of 64
    rows (with repeats: uncoalesced)."""
    torch.manual_seed(0)
    emb = nn.Embedding(10000, 64, sparse=True).to(device)
    idx = torch.randint(0, 10000, (64,)).to(device)
    emb(idx).sum().backward()
    return emb.weight, emb.weight.grad


def _sparse_step(make: Callable[[str], tuple], opt_cls, device: str, **kwargs) -> Step:
    """One step of the optimizer, in its for-loop form on both devices (SGD and Adagrad support
    foreach): left to torch, openreg, like every accelerator, would take the foreach form, which
    with a sparse gradient groups the tensors in Python and then runs the for-loop anyway (9 us
    more per step of SGD on either device; the Rosenbrock workloads keep torch's choice)."""
    param, grad = make(device)
    param.grad = grad
    return torch.optim.__dict__[opt_cls]([param], **kwargs).step


WORKLOADS: dict[str, tuple[Callable[[str], Step], float | None, str]] = {
    "coalesce": (coalesce_loop, 1.3, "100 x `coalesce`, COO 8x8 with 24 entries (12 distinct)"),
    "add_sparse_dense": (add_dense_sparse_loop, 1.3,
                         "100 x (`dense + sparse`, `dense.add_(sparse)`), 8x8"),
    "index_select": (index_select_loop, 1.3, "100 x `index_select` of 4 rows, COO 8x8"),
    "to_dense": (to_dense_loop, 1.3, "100 x `to_dense`, COO 8x8"),
    "mul_scalar": (mul_scalar_loop, None, "100 x `sparse * 2.0`, COO 8x8"),
    "sparse_mm": (sparse_mm_loop, None, "100 x `torch.sparse.mm`, COO 8x8 @ dense 8x4"),
    "nested_relu": (nested_relu_loop, None, "100 x `relu`, strided nested 2x(n, 8)"),
}
for _opt, _kw in (("Adagrad", {"lr": 0.1, "foreach": False}), ("SGD", {"lr": 0.01, "foreach": False}),
                  ("SparseAdam", {"lr": 0.01})):
    WORKLOADS[f"{_opt.lower()}_small"] = (
        functools.partial(_sparse_step, _small_param, _opt, **_kw), 1.3,
        f"`{_opt}` step, sparse gradient, 2-element parameter")
    WORKLOADS[f"{_opt.lower()}_embedding"] = (
        functools.partial(_sparse_step, _embedding_param, _opt, **_kw), 1.3,
        f"`{_opt}` step, sparse gradient of `Embedding(10000, 64)`, 64 rows looked up")


# ---- test_optim's sparse Rosenbrock test, one iteration

def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def _drosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return torch.stack((-400 * x * (y - x**2) - 2 * (1 - x), 200 * (y - x**2)))


def rosenbrock_sparse(device: str, opt_cls: str = "Adagrad") -> Step:
    """Two iterations of test_optim's `test_rosenbrock_sparse` (cyclic coordinate descent): the
    closure computes the loss and its backward, builds an uncoalesced sparse gradient for one
    coordinate on the device, the optimizer steps, and a twin optimizer on the dense form of the
    same gradient steps too and is compared with it."""
    start = torch.tensor([1.5, 1.5], dtype=torch.float64).to(device)
    params = [start.clone().requires_grad_() for _ in range(2)]
    opts = [torch.optim.__dict__[opt_cls]([p], lr=1e-3) for p in params]

    def closure(param: torch.Tensor, opt, sparse: bool, w: int) -> torch.Tensor:
        opt.zero_grad()
        loss = _rosenbrock(param)
        loss.backward()
        grad = _drosenbrock(param.detach())
        i = torch.tensor([[w, w]], dtype=torch.int64, device=device)
        v = torch.stack((grad[w] / 4.0, grad[w] - grad[w] / 4.0))
        g = torch.sparse_coo_tensor(i, v, (2,))
        with torch.no_grad():
            param.grad = g if sparse else g.to_dense()
        return loss

    def step() -> None:
        with torch.no_grad():  # from the same point at every step (SGD would diverge)
            for p in params:
                p.copy_(start)
        for w in (0, 1):
            opts[0].step(functools.partial(closure, params[0], opts[0], True, w))
            opts[1].step(functools.partial(closure, params[1], opts[1], False, w))
            torch.testing.assert_close(params[0], params[1])

    return step


WORKLOADS["rosenbrock_adagrad"] = (rosenbrock_sparse, 1.3,
                                   "test_optim's sparse Rosenbrock, `Adagrad`, 2 iterations")
WORKLOADS["rosenbrock_sgd"] = (functools.partial(rosenbrock_sparse, opt_cls="SGD"), 1.3,
                               "test_optim's sparse Rosenbrock, `SGD`, 2 iterations")


# ---- single calls on large inputs (the CPU kernel dominates)

def _big(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1000, 1000, generator=g)
    big[big < 1.5] = 0  # ~7% non-zero
    return big, torch.randn(1000, 64, generator=g).to(device)


def coo_mm_big(device: str) -> Step:
    big, dense = _big(device)
    coo = big.to_sparse().to(device)
    return lambda: torch.sparse.mm(coo, dense)


def csr_mm_big(device: str) -> Step:
    big, dense = _big(device)
    csr = big.to_sparse_csr().to(device)
    return lambda: csr @ dense


WORKLOADS["coo_mm_big"] = (coo_mm_big, None, "`sparse.mm`, COO 1000x1000 7% @ dense 1000x64")
WORKLOADS["csr_mm_big"] = (csr_mm_big, None, "CSR 1000x1000 7% `@` dense 1000x64")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="openreg:0")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads(N) first (1 steadies numbers on a busy machine)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} cores, device {args.device}\n")
    print("| workload | cpu | openreg | ratio | target | CPU time ratio |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name in args.workloads:
        build, target, what = WORKLOADS[name]
        cpu, dev, cpu_work, dev_work = bench(build, args.device, args.rounds, args.steps,
                                             synchronize=True, work=True)
        ratio = dev / cpu
        verdict = "-" if target is None else f"<= {target}x {'ok' if ratio <= target else 'MISSED'}"
        failed |= target is not None and ratio > target
        print(f"| {what} | {_fmt(cpu)} | {_fmt(dev)} | {ratio:.2f}x | {verdict} | "
              f"{dev_work / cpu_work:.2f}x |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
