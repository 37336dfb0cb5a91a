"""aten kernels written in Python with torch.library (torch_openreg/python_kernels.py)."""
import pytest
import torch


def registered_in(op):
    line = next(l for l in torch._C._dispatch_dump(op).splitlines() if l.startswith("PrivateUse1:"))
    return line


def test_registered_from_python():
    for op in ["aten::_fused_dropout", "aten::_masked_scale"]:
        assert "torch_openreg/python_kernels.py" in registered_in(op)


def test_fused_dropout_matches_the_cpu_formula(device):
    x = torch.randn(64, 33)
    out, mask = torch._fused_dropout(x.to(device), 0.75)
    assert out.device == device and mask.device == device and mask.dtype == torch.uint8
    assert set(mask.unique().cpu().tolist()) <= {0, 1}
    torch.testing.assert_close(out.cpu(), x * mask.cpu() / 0.75)
    kept = mask.float().mean().item()
    assert 0.6 < kept < 0.9  # keep probability 0.75 over 2112 draws


def test_draws_from_the_device_generator(device):
    x = torch.ones(1000, device=device)
    torch.openreg.manual_seed_all(7)
    _, m1 = torch._fused_dropout(x, 0.5)
    torch.openreg.manual_seed_all(7)
    _, m2 = torch._fused_dropout(x, 0.5)
    g = torch.Generator(device=device).manual_seed(7)
    _, m3 = torch._fused_dropout(x, 0.5, g)
    assert torch.equal(m1.cpu(), m2.cpu())
    assert torch.equal(m1.cpu(), m3.cpu())
    with pytest.raises(RuntimeError, match="generator"):
        torch._fused_dropout(x, 0.5, torch.Generator())


def test_backward_runs_masked_scale_and_matches_cpu(device):
    x = torch.randn(50, dtype=torch.float64)
    xd = x.to(device).requires_grad_()
    out, mask = torch._fused_dropout(xd, 0.5)
    assert out.grad_fn.name() == "FusedDropoutBackward0"
    g = torch.randn(50, dtype=torch.float64)
    out.backward(g.to(device))
    torch.testing.assert_close(xd.grad.cpu(), g * mask.cpu() * 2.0)
    ms = torch._masked_scale(g.to(device), mask, 3.0)
    torch.testing.assert_close(ms.cpu(), g * mask.cpu() * 3.0)


def test_bad_input():
    x = torch.ones(4, device="openreg")
    with pytest.raises(RuntimeError, match="mask should be torch.uint8"):
        torch._masked_scale(x, torch.ones(4, device="openreg"), 2.0)
    with pytest.raises(RuntimeError, match="dropout probability has to be between 0 and 1"):
        torch._fused_dropout(x, 1.5)
    with pytest.raises(RuntimeError, match="same device"):
        torch._masked_scale(x, torch.ones(4, dtype=torch.uint8, device="openreg:1"), 2.0)
