"""The hand-written mse_loss kernel (csrc/routes/aten_kernel.cpp), compared with the CPU."""
import pytest
import torch
import torch.nn.functional as F

import torch_openreg


def calls(name="aten_kernel.mse_loss"):
    return torch_openreg._C._route_calls(name)


def test_registered_in_the_openreg_slot():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mse_loss", "PrivateUse1")
    dump = torch._C._dispatch_dump("aten::mse_loss")
    assert any("PrivateUse1" in line and "aten_kernel.cpp" in line for line in dump.splitlines())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_matches_cpu(device, reduction, dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(300, 257, generator=g, dtype=dtype)  # large enough to split across threads
    b = torch.randn(300, 257, generator=g, dtype=dtype)
    before, fused = calls(), calls("aten_kernel.mse_loss.fused")
    loss = F.mse_loss(a.to(device), b.to(device), reduction=reduction)
    assert calls() == before + 1 and calls("aten_kernel.mse_loss.fused") == fused + 1
    assert loss.device == device and loss.dtype == dtype and loss.shape == ()
    torch.testing.assert_close(loss.cpu(), F.mse_loss(a, b, reduction=reduction))


@pytest.mark.parametrize("case", ["none", "strided", "half", "broadcast"])
def test_unfused_cases_run_the_cpu_kernel(case):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    reduction = "mean"
    if case == "none":
        reduction = "none"
    elif case == "strided":
        a, b = a.t(), b.t()
    elif case == "half":
        a, b = a.half(), b.half()
    else:
        b = b[:1]
    fused = calls("aten_kernel.mse_loss.fused")
    with pytest.warns(UserWarning) if case == "broadcast" else _nothing():
        got = F.mse_loss(a.to("openreg"), b.to("openreg"), reduction=reduction)
    assert calls("aten_kernel.mse_loss.fused") == fused
    with pytest.warns(UserWarning) if case == "broadcast" else _nothing():
        expected = F.mse_loss(a, b, reduction=reduction)
    torch.testing.assert_close(got.cpu(), expected)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_empty_mean_is_nan_like_the_cpu():
    e = torch.empty(0)
    assert torch.isnan(F.mse_loss(e, e)) and torch.isnan(F.mse_loss(e.openreg(), e.openreg()).cpu())


def test_gradients_match_cpu(device):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, generator=g, requires_grad=True), torch.randn(40, generator=g)
    ad = a.detach().to(device).requires_grad_()
    F.mse_loss(a, b).backward()
    F.mse_loss(ad, b.to(device)).backward()
    torch.testing.assert_close(ad.grad.cpu(), a.grad)


def test_tensors_on_two_devices():
    a = torch.ones(3, device="openreg:0")
    with pytest.raises(RuntimeError, match="same device.*openreg:0 and openreg:1"):
        F.mse_loss(a, torch.ones(3, device="openreg:1"))
    with pytest.raises(RuntimeError, match="same device.*openreg:0 and cpu"):
        torch._C._nn.mse_loss(a, torch.ones(3))
