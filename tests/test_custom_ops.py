"""Custom operators in namespace openreg: C++ (csrc/routes/custom_ops.cpp) and Python
(torch_openreg/custom_ops.py): values against the CPU, FakeTensor shapes, gradients against an
autograd reference, opcheck, torch.compile, bad input."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_openreg

ops = torch.ops.openreg
# opcheck's autograd-registration check only knows CPU/CUDA/XPU tensors ("NYI devices other than
# CPU/CUDA/XPU"); the other checks run on openreg.
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def sample(shape=(4, 5), dtype=torch.float64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---- openreg::custom_abs (C++: openreg kernel, Meta kernel, autograd)

def test_custom_abs_matches_cpu_and_runs_its_kernel(device):
    x = sample()
    before = torch_openreg._C._route_calls("custom_ops.custom_abs")
    y = ops.custom_abs(x.to(device))
    assert torch_openreg._C._route_calls("custom_ops.custom_abs") == before + 1
    assert y.device == device
    torch.testing.assert_close(y.cpu(), torch.abs(x))


def test_custom_abs_gradient_matches_autograd_reference(device):
    x = sample()
    reference = x.clone().requires_grad_()
    torch.abs(reference).mul(reference).sum().backward()
    xd = x.to(device).requires_grad_()
    ops.custom_abs(xd).mul(xd).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), reference.grad)


def test_custom_abs_meta_and_fake():
    m = ops.custom_abs(torch.empty(2, 3, dtype=torch.float16, device="meta"))
    assert m.shape == (2, 3) and m.dtype == torch.float16 and m.device.type == "meta"
    with FakeTensorMode():
        f = ops.custom_abs(torch.empty(7, 2, device="openreg:1"))
        assert f.shape == (7, 2) and f.device == torch.device("openreg:1")


def test_custom_abs_opcheck():
    torch.library.opcheck(ops.custom_abs, (sample().to("openreg").requires_grad_(),),
                          test_utils=OPCHECK)


def test_custom_abs_wrong_dtype():
    with pytest.raises(NotImplementedError, match="\"custom_abs\" not implemented for 'Long'"):
        ops.custom_abs(torch.ones(3, dtype=torch.long, device="openreg"))
    with FakeTensorMode(), pytest.raises(RuntimeError, match="not implemented for 'Bool'"):
        ops.custom_abs(torch.ones(3, dtype=torch.bool, device="openreg"))
    with pytest.raises(NotImplementedError, match="openreg::custom_abs.*'CPU' backend"):
        ops.custom_abs(torch.ones(3))  # a device-only operator, as CUDA-only aten operators


# ---- the aliasing examples (C++): identity-like results, gradient scaled by 0.5

@pytest.mark.parametrize("name", ["custom_autograd_fn_returns_self", "custom_autograd_fn_aliasing"])
def test_aliasing_ops_eager(device, name):
    x = sample().to(device)
    y = getattr(ops, name)(x)
    assert y.data_ptr() == x.data_ptr() and torch.equal(y.cpu(), x.cpu())
    y.add_(1)  # the same memory: visible through x
    torch.testing.assert_close(x.cpu(), y.cpu())
    xg = x.clone().requires_grad_()
    getattr(ops, name)(xg).mul(3).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), torch.full_like(x.cpu(), 1.5))


@pytest.mark.parametrize("name", ["custom_autograd_fn_returns_self", "custom_autograd_fn_aliasing"])
def test_aliasing_ops_compile_aot_eager(name):
    op = getattr(ops, name)

    def f(x):
        return op(x).sin() * 2

    x = sample().to("openreg")
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = f(eager_x)
    expected.sum().backward()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(compiled_x)
    got.sum().backward()
    torch.testing.assert_close(got.cpu(), expected.detach().cpu())
    torch.testing.assert_close(compiled_x.grad.cpu(), eager_x.grad.cpu())
    torch.testing.assert_close(compiled_x.grad.cpu(), (x.cos() * 2 * 0.5).cpu())


@pytest.mark.parametrize("name", ["custom_autograd_fn_returns_self", "custom_autograd_fn_aliasing"])
def test_aliasing_ops_fake_and_opcheck(name):
    op = getattr(ops, name)
    with FakeTensorMode():
        x = torch.empty(3, 2, device="openreg")
        assert op(x).shape == (3, 2)
    torch.library.opcheck(op, (sample().to("openreg").requires_grad_(),), test_utils=OPCHECK)


# ---- openreg::custom_add (Python: torch.library.custom_op)

def test_custom_add_matches_cpu_with_gradients(device):
    a, b = sample(seed=1), sample(seed=2)
    ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
    (torch.add(ra, rb) * rb).sum().backward()
    da, db = a.to(device).requires_grad_(), b.to(device).requires_grad_()
    out = ops.custom_add(da, db)
    (out * db).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), a + b)
    torch.testing.assert_close(da.grad.cpu(), ra.grad)
    torch.testing.assert_close(db.grad.cpu(), rb.grad)


def test_custom_add_fake_opcheck_compile():
    with FakeTensorMode():
        f = ops.custom_add(torch.empty(2, 6, device="openreg:1"), torch.empty(2, 6, device="openreg:1"))
        assert f.shape == (2, 6) and f.device == torch.device("openreg:1")
    a, b = sample(seed=1).to("openreg"), sample(seed=2).to("openreg")
    torch.library.opcheck(ops.custom_add, (a.requires_grad_(), b), test_utils=OPCHECK)
    compiled = torch.compile(lambda x, y: ops.custom_add(x, y).relu(), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(a, b).detach().cpu(), (a + b).relu().detach().cpu())


def test_custom_add_bad_input():
    a = torch.ones(3, device="openreg:0")
    with pytest.raises(RuntimeError, match="same device.*openreg:0 and openreg:1"):
        ops.custom_add(a, torch.ones(3, device="openreg:1"))
    with pytest.raises(RuntimeError, match="same device.*openreg:0 and cpu"):
        ops.custom_add(a, torch.ones(3))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.custom_add(a, a.double())
    with pytest.raises(NotImplementedError, match="\"custom_add\" not implemented for 'int64'"):
        ops.custom_add(a.long(), a.long())
    with pytest.raises(RuntimeError, match="same shape"):
        ops.custom_add(a, torch.ones(2, device="openreg"))
    with FakeTensorMode(), pytest.raises(RuntimeError, match="not implemented for 'int64'"):
        x = torch.ones(3, dtype=torch.long, device="openreg")
        ops.custom_add(x, x)
