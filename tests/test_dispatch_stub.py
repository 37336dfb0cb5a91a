"""abs through abs_stub (csrc/routes/dispatch_stub.cpp): every dtype the CPU's abs accepts,
functional, out= (with resize), in-place, contiguous and strided, compared with the CPU."""
import pytest
import torch

import torch_openreg


def stub_calls():
    return torch_openreg._C._route_calls("abs_stub")


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2]


def sample(dtype, shape=(5, 7)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 40
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1)).to(dtype)
    x = x.to(dtype)
    if not dtype.is_floating_point and dtype != torch.uint8:
        x.view(-1)[0] = torch.iinfo(dtype).min  # abs(min) wraps around, as on the CPU
    return x


def same(a, b, strides=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert not strides or a.stride() == b.stride()
    if a.element_size() == 1:  # float8: compare the bits
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_registered_for_openreg():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::abs.out", "PrivateUse1")
    # abs and abs_ stay ATen's composites: they reach the stub through abs.out.
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::abs", "PrivateUse1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_matches_cpu_and_runs_the_stub(device, dtype):
    x = sample(dtype)
    before = stub_calls()
    y = torch.abs(x.to(device))
    assert stub_calls() == before + 1
    assert y.device == device
    same(y.cpu(), torch.abs(x))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.complex64], ids=str)
def test_out_resized(device, dtype):
    x = sample(dtype)
    expected = torch.abs(x)
    out = torch.empty(0, dtype=expected.dtype, device=device)
    result = torch.abs(x.to(device), out=out)
    assert result is out
    same(out.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.complex128], ids=str)
def test_strided_input_and_output(device, dtype):
    x = sample(dtype, (6, 8))
    expected = torch.abs(x[:, ::2].t())
    buf = torch.full((8, 6), 7, dtype=expected.dtype, device=device)
    out = buf[::2]  # a non-contiguous out= of the right size: written through its strides
    torch.abs(x.to(device)[:, ::2].t(), out=out)
    same(out.cpu(), expected, strides=False)
    assert (buf[1::2].cpu() == 7).all()  # the rows in between are untouched


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.float64], ids=str)
def test_in_place(device, dtype):
    x = sample(dtype)
    d = x.to(device)
    view = d[:, 1::2]
    before = stub_calls()
    view.abs_()
    assert stub_calls() > before
    expected = x.clone()
    expected[:, 1::2].abs_()
    same(d.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint16, torch.uint32], ids=str)
def test_unsupported_dtypes_raise_like_the_cpu(dtype):
    x = torch.zeros(3, dtype=dtype)
    with pytest.raises(NotImplementedError) as cpu:
        torch.abs(x)
    with pytest.raises(NotImplementedError) as dev:
        torch.abs(x.to("openreg"))
    assert str(dev.value) == str(cpu.value)  # '"abs_cpu" not implemented for 'Bool'', as on the CPU


def test_in_place_complex_raises_like_the_cpu():
    with pytest.raises(RuntimeError, match="In-place abs is not supported for complex"):
        torch.ones(3, dtype=torch.complex64).abs_()
    with pytest.raises(RuntimeError, match="In-place abs is not supported for complex"):
        torch.ones(3, dtype=torch.complex64, device="openreg").abs_()


def test_out_wrong_dtype_raises_like_the_cpu():
    x = sample(torch.complex64)
    with pytest.raises(RuntimeError) as cpu:
        torch.abs(x, out=torch.empty(0, dtype=torch.int32))
    with pytest.raises(type(cpu.value)):
        torch.abs(x.to("openreg"), out=torch.empty(0, dtype=torch.int32, device="openreg"))


def test_gradient_matches_cpu(device):
    x = sample(torch.float64).requires_grad_()
    xd = x.detach().to(device).requires_grad_()
    torch.abs(x).sum().backward()
    torch.abs(xd).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
