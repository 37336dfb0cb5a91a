"""A test-suite-like workload for benchmarks/loaded.py, run by pytest (``pytest -n 2`` there).

Not collected by the project's test run (``testpaths = tests``, and the file name does not start
with ``test_``): benchmarks/loaded.py passes ``-o python_files=loaded_suite.py``.

Each test does what a device-generic test suite does thousands of times: compute a CPU reference,
then the same on openreg, backward included, and compare. The CPU part and the openreg part are
timed separately; at the end of the session each pytest process writes its totals to
``$OPENREG_LOADED_SUITE_OUT/<pid>.json`` so that benchmarks/loaded.py can report openreg's time
over the CPU's. The sizes mix tiny tensors (the fallback's fixed cost) with tensors large enough
for the CPU kernels to run parallel regions on several OpenMP threads, as real suites do.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "openreg:0"
TOTALS = {"cpu": 0.0, "openreg": 0.0, "tests": 0}


@pytest.fixture(scope="session", autouse=True)
def _write_totals():
    yield
    out = os.environ.get("OPENREG_LOADED_SUITE_OUT")
    if out:
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump(TOTALS, f)


def _run(fn, device: str, inputs: list[torch.Tensor]):
    """fn on copies of `inputs` on `device` (leaves that require grad), backward of the sum of
    its outputs; returns the outputs and the gradients, on the CPU, and the time it took."""
    t0 = time.perf_counter()
    leaves = [x.detach().to(device, copy=True).requires_grad_(x.is_floating_point())
              for x in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    diff = [o for o in outs if o.requires_grad]
    if diff:
        torch.autograd.backward([o.sum() for o in diff])
    result = [o.detach().cpu() for o in outs] + [x.grad.cpu() for x in leaves if x.grad is not None]
    return result, time.perf_counter() - t0


def check(fn, *inputs: torch.Tensor) -> None:
    expected, t_cpu = _run(fn, "cpu", list(inputs))
    actual, t_dev = _run(fn, DEVICE, list(inputs))
    TOTALS["cpu"] += t_cpu
    TOTALS["openreg"] += t_dev
    TOTALS["tests"] += 1
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        # The device thread runs backward with one OpenMP thread: sums may round differently.
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


SIZES = {"tiny": (4, 4), "small": (32, 64), "large": (256, 512)}
UNARY = {
    "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin,
    "relu": F.relu, "gelu": F.gelu, "silu": F.silu, "softplus": F.softplus,
    "softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
    "square_sum": lambda x: (x * x).sum(-1), "mean": lambda x: x.mean(0),
    "norm": lambda x: x.norm(dim=-1), "cumsum": lambda x: x.cumsum(-1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "transpose_mul": lambda x: x.t() * 2, "clamp": lambda x: x.clamp(-0.5, 0.5),
}
BINARY = {
    "add": torch.add, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1),
    "pow": lambda a, b: a.abs().pow(b.tanh()), "where": lambda a, b: torch.where(a > 0, a, b),
    "maximum": torch.maximum, "lerp": lambda a, b: torch.lerp(a, b, 0.3),
    "mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss,
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", UNARY)
def test_unary(name, size):
    torch.manual_seed(0)
    check(UNARY[name], torch.randn(*SIZES[size]))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", BINARY)
def test_binary(name, size):
    torch.manual_seed(0)
    check(BINARY[name], torch.randn(*SIZES[size]), torch.randn(*SIZES[size]))


@pytest.mark.parametrize("n", [4, 64, 256])
def test_matmul(n):
    torch.manual_seed(0)
    check(torch.matmul, torch.randn(n, n), torch.randn(n, n))


@pytest.mark.parametrize("n", [4, 64, 256])
def test_linear(n):
    torch.manual_seed(0)
    check(F.linear, torch.randn(32, n), torch.randn(n // 2 + 1, n), torch.randn(n // 2 + 1))


@pytest.mark.parametrize("hw", [6, 32])
def test_conv2d(hw):
    torch.manual_seed(0)
    check(lambda x, w: F.conv2d(x, w, padding=1), torch.randn(2, 3, hw, hw), torch.randn(8, 3, 3, 3))


@pytest.mark.parametrize("batch", [4, 128])
def test_cross_entropy(batch):
    torch.manual_seed(0)
    logits, target = torch.randn(batch, 10), torch.randint(0, 10, (batch,))
    check(F.cross_entropy, logits, target)


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
    "conv_bn": lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()),
    "lstm": lambda: nn.LSTM(16, 16),
    "transformer": lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0),
}
MODULE_INPUTS = {"mlp": (64, 64), "conv_bn": (4, 3, 16, 16), "lstm": (5, 4, 16),
                 "transformer": (8, 4, 32)}


@pytest.mark.parametrize("name", MODULES)
def test_module(name):
    """Forward and backward of a small module, its parameters passed as the call's inputs."""
    torch.manual_seed(0)
    model = MODULES[name]()
    names = [n for n, _ in model.named_parameters()]

    def run(x, *params):
        model.to(x.device)  # the buffers (BatchNorm's running statistics) go with the call
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        return out[0] if isinstance(out, tuple) else out

    check(run, torch.randn(*MODULE_INPUTS[name]), *[p.detach() for p in model.parameters()])
