"""The generic fallback's fixed costs, per call and per tensor in a list, side by side with the CPU.

    python benchmarks/fallback.py [--rounds R] [--steps N] [--device openreg:0] [--backward-on-caller] [workload ...]

People run test suites and optimizer steps on openreg: thousands of short calls on tiny tensors,
tensor-list operators (foreach, fused optimizers) over hundreds of small parameters, gradchecks.
There the fallback's fixed costs show (docs/fallback.md), not in the training steps of run.py.
Rounds alternate the CPU and openreg in one process so that both see the same machine load; the
reported time is the median over all measured calls, the ratio openreg / CPU. Targets from
issue 19 (they are targets, not all met: the table says which).
The last column, "CPU time ratio", divides the process's CPU time per step (all threads, the
autograd device threads included) on openreg by the CPU's: the work. A wall-time ratio above it
is waiting (a thread asleep until another wakes it: the backward handoff to the device thread).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import bench, fmt_time as _fmt  # noqa: E402

Step = Callable[[], object]


def _tensors(device: str, n: int, numel: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(numel, generator=g).to(device) for _ in range(n)]


# ---- tensor-list operators on 100 tensors of 16 elements

def _fused_adam(device: str, fn=torch._fused_adam_, n: int = 100) -> Step:
    params, grads, exp_avgs, exp_avg_sqs = (_tensors(device, n, seed=s) for s in range(4))
    steps = [torch.tensor(1.0).to(device) for _ in range(n)]

    def step() -> None:
        fn(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
           weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False)

    return step


def fused_adam(device: str) -> Step:
    return _fused_adam(device)


def fused_adamw(device: str) -> Step:
    return _fused_adam(device, torch._fused_adamw_)


def fused_sgd(device: str) -> Step:
    params, grads, bufs = (_tensors(device, 100, seed=s) for s in range(3))

    def step() -> None:
        torch._fused_sgd_(params, grads, bufs, weight_decay=0.0, momentum=0.9, lr=1e-3,
                          dampening=0.0, nesterov=False, maximize=False, is_first_step=False)

    return step


def foreach_add(device: str) -> Step:
    a, b = _tensors(device, 100, seed=0), _tensors(device, 100, seed=1)
    return lambda: torch._foreach_add_(a, b)


def foreach_mul(device: str) -> Step:
    a, b = _tensors(device, 100, seed=0), _tensors(device, 100, seed=1)
    return lambda: torch._foreach_mul_(a, b)


def foreach_lerp(device: str) -> Step:
    a, b = _tensors(device, 100, seed=0), _tensors(device, 100, seed=1)
    return lambda: torch._foreach_lerp_(a, b, 0.5)


def loop_add(device: str) -> Step:
    """The same adds as foreach_add, one operator call per tensor (for comparison)."""
    a, b = _tensors(device, 100, seed=0), _tensors(device, 100, seed=1)

    def step() -> None:
        for x, y in zip(a, b):
            x.add_(y)

    return step


# ---- AdamW over the 72 parameters of a 6-layer TransformerEncoder, d_model 128

def _adamw(device: str, **form) -> Step:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, nhead=4, dim_feedforward=256, dropout=0.0,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).to(device)
    params = list(model.parameters())
    assert len(params) == 72
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, **form)
    return opt.step


def adamw_for_loop(device: str) -> Step:
    return _adamw(device, foreach=False)


def adamw_foreach(device: str) -> Step:
    return _adamw(device, foreach=True)


def adamw_fused(device: str) -> Step:
    return _adamw(device, fused=True)


# ---- gradcheck

def gradcheck(device: str) -> Step:
    """gradcheck + gradgradcheck of tanh(Linear(4, 3)) and softmax(Linear(4, 3)), float64."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double().to(device)
    x = torch.randn(2, 4, dtype=torch.float64).to(device).requires_grad_()
    fns = [lambda t: torch.tanh(lin(t)), lambda t: torch.softmax(lin(t), dim=-1)]

    def step() -> None:
        for fn in fns:
            assert torch.autograd.gradcheck(fn, (x,))
            assert torch.autograd.gradgradcheck(fn, (x,))

    return step


# ---- LBFGS: many tiny operators and host reads per step

def lbfgs(device: str) -> Step:
    """A fresh LBFGS (max_iter 20, strong Wolfe line search) minimising the Rosenbrock function
    of a 2-element float64 parameter from (-1.5, 1.5), one step as test_optim's LBFGS tests
    take: each iteration is a closure with backward and a few dozen operators on 2-element
    tensors, several of them read on the host (dot products, norms, the line search's tests)."""
    start = torch.tensor([-1.5, 1.5], dtype=torch.float64).to(device)

    def step() -> None:
        p = start.clone().requires_grad_()
        opt = torch.optim.LBFGS([p], lr=1, max_iter=20, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            x, y = p
            loss = (1 - x) ** 2 + 100 * (y - x**2) ** 2
            loss.backward()
            return loss

        opt.step(closure)

    return step


# ---- a test-suite workload

_OPINFO_OPS = [
    "add", "sub", "mul", "div", "abs", "neg", "exp", "log", "sqrt", "sin", "cos", "tanh",
    "sigmoid", "pow", "clamp", "where", "sum", "mean", "amax", "cumsum", "matmul", "mm", "bmm",
    "addmm", "cat", "stack", "transpose", "reshape", "index_select", "gather", "masked_fill",
    "softmax", "log_softmax", "nn.functional.relu", "nn.functional.gelu", "nn.functional.linear",
    "nn.functional.layer_norm", "nn.functional.cross_entropy", "norm", "lerp",
]

_OPTIMIZERS = {  # name -> forms it supports
    "SGD": ("for-loop", "foreach", "fused"), "Adam": ("for-loop", "foreach", "fused"),
    "AdamW": ("for-loop", "foreach", "fused"), "Adagrad": ("for-loop", "foreach", "fused"),
    "RMSprop": ("for-loop", "foreach"), "Adadelta": ("for-loop", "foreach"),
    "Adamax": ("for-loop", "foreach"), "NAdam": ("for-loop", "foreach"),
    "RAdam": ("for-loop", "foreach"), "ASGD": ("for-loop", "foreach"),
    "Rprop": ("for-loop", "foreach"),
}


def test_suite(device: str) -> Step:
    """What a device-generic test suite does, in small: OpInfo sample inputs of 40 operators on
    tiny tensors, forward and backward of small modules, gradcheck and gradgradcheck of a few
    modules, and one step of every optimizer in each of its forms (built in the step, as tests
    do)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.name in _OPINFO_OPS and op.variant_test_name == ""]
    assert len(ops) >= 35, [op.name for op in ops]
    torch.manual_seed(0)
    modules = [nn.Linear(8, 4), nn.Conv2d(2, 3, 3), nn.LayerNorm(8), nn.BatchNorm1d(8),
               nn.LSTM(8, 8), nn.MultiheadAttention(8, 2),
               nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)]
    modules = [m.to(device) for m in modules]
    inputs = [torch.randn(3, 8), torch.randn(1, 2, 6, 6), torch.randn(3, 8), torch.randn(3, 8),
              torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)]
    inputs = [t.to(device) for t in inputs]
    checked = [nn.Linear(3, 2).double(), nn.Conv1d(1, 2, 2).double(), nn.LayerNorm(3).double()]
    checked = [m.to(device) for m in checked]
    checked_inputs = [torch.randn(2, 3, dtype=torch.float64), torch.randn(1, 1, 4, dtype=torch.float64),
                      torch.randn(2, 3, dtype=torch.float64)]
    checked_inputs = [t.to(device).requires_grad_() for t in checked_inputs]
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(device)

    def step() -> None:
        torch.manual_seed(0)
        for op in ops:
            for sample in op.sample_inputs(device, torch.float32):
                op(sample.input, *sample.args, **sample.kwargs)
        for m, x in zip(modules, inputs):
            out = m(x, x, x)[0] if isinstance(m, nn.MultiheadAttention) else m(x)
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
        for m, x in zip(checked, checked_inputs):
            assert torch.autograd.gradcheck(m, (x,))
            assert torch.autograd.gradgradcheck(m, (x,))
        for name, forms in _OPTIMIZERS.items():
            for form in forms:
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                kwargs = {"fused": True} if form == "fused" else {"foreach": form == "foreach"}
                getattr(torch.optim, name)(model.parameters(), lr=1e-3, **kwargs).step()
        model.zero_grad()

    return step


WORKLOADS = {  # name -> (builder, target ratio openreg / CPU, description)
    "fused_adam": (fused_adam, 1.3, "`_fused_adam_`, 100 tensors of 16"),
    "fused_adamw": (fused_adamw, 1.3, "`_fused_adamw_`, 100 tensors of 16"),
    "fused_sgd": (fused_sgd, 1.3, "`_fused_sgd_`, 100 tensors of 16"),
    "foreach_add": (foreach_add, 1.3, "`_foreach_add_`, 100 tensors of 16"),
    "foreach_mul": (foreach_mul, 1.3, "`_foreach_mul_`, 100 tensors of 16"),
    "foreach_lerp": (foreach_lerp, 1.3, "`_foreach_lerp_`, 100 tensors of 16"),
    "loop_add": (loop_add, None, "a Python loop of `add_` over the same 100 tensors"),
    "adamw_for_loop": (adamw_for_loop, 1.1, "`AdamW(foreach=False)`, 72 params of a 6-layer TransformerEncoder"),
    "adamw_foreach": (adamw_foreach, 1.1, "`AdamW(foreach=True)`, same parameters"),
    "adamw_fused": (adamw_fused, 1.1, "`AdamW(fused=True)`, same parameters"),
    "lbfgs": (lbfgs, 1.3, "`LBFGS` step (20 iterations, strong Wolfe), Rosenbrock of 2 float64"),
    "gradcheck": (gradcheck, 1.2, "gradcheck + gradgradcheck, tanh/softmax of Linear(4, 3)"),
    "test_suite": (test_suite, 1.2, "test-suite workload (OpInfo samples, modules, gradchecks, optimizers)"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="openreg:0")
    # How much of a workload's gap is backward's handoff to the device thread and back (LBFGS:
    # 25 tiny backwards per step): the same run with backward on the caller's thread for both
    # devices. Not openreg's configuration (docs/autograd.md, "LBFGS: many tiny backwards").
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="autograd multithreading off for both devices (not openreg's setup)")
    args = parser.parse_args()
    if args.backward_on_caller:
        torch.autograd.set_multithreading_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} cores, device {args.device}\n")
    if args.backward_on_caller:
        print("backward on the calling thread (autograd multithreading off): not openreg's "
              "configuration\n")
    print("| workload | cpu | openreg | ratio | target | CPU time ratio |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name in args.workloads:
        build, target, what = WORKLOADS[name]
        # Whole-suite workloads are long: fewer calls per round.
        steps = max(2, args.steps // 10) if name in ("test_suite", "gradcheck") else args.steps
        cpu, dev, cpu_work, dev_work = bench(build, args.device, args.rounds, steps,
                                             work=True)
        ratio = dev / cpu
        verdict = "-" if target is None else f"<= {target}x {'ok' if ratio <= target else 'MISSED'}"
        failed |= target is not None and ratio > target
        print(f"| {what} | {_fmt(cpu)} | {_fmt(dev)} | {ratio:.2f}x | {verdict} | "
              f"{dev_work / cpu_work:.2f}x |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
