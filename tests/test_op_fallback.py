"""A per-operator boxed kernel next to the global fallback (csrc/routes/op_fallback.cpp):
which one runs, and the sync debug mode it implements."""
import warnings

import pytest
import torch

import torch_openreg


def calls():
    return torch_openreg._C._route_calls("op_fallback.synchronizing")


@pytest.fixture
def sync_mode():
    yield torch.openreg.set_sync_debug_mode
    torch.openreg.set_sync_debug_mode("default")


def registered_in(op):
    """The source file of the operator's PrivateUse1 kernel, or None (then: the fallback)."""
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith("PrivateUse1: registered at "):
            return line.split("registered at ")[1].split(":")[0].rsplit("/", 1)[-1]
    return None


def test_which_kernel_is_registered():
    # The global fallback serves every operator without a kernel of its own...
    assert torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)
    assert registered_in("aten::nonzero_static") is None
    # ...the per-operator boxed kernel only the operators it was registered for.
    for op in ["nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "equal"]:
        assert registered_in(f"aten::{op}") == "op_fallback.cpp", op


def test_per_operator_kernel_runs_for_its_operators_only(device):
    x = torch.tensor([[0.0, 1.5], [-2.0, 0.0]])
    d = x.to(device)
    before = calls()
    torch.sin(d)  # global fallback
    assert calls() == before
    nz = torch.nonzero(d)
    assert calls() == before + 1
    assert nz.device == device
    torch.testing.assert_close(nz.cpu(), torch.nonzero(x))


def test_results_match_cpu(device):
    x = torch.tensor([3, 1, 3, 2, 2, 2, 5])
    d = x.to(device)
    before = calls()
    torch.testing.assert_close(torch.masked_select(d, d > 2).cpu(), torch.masked_select(x, x > 2))
    for got, expected in zip(torch.unique(d, return_inverse=True, return_counts=True),
                             torch.unique(x, return_inverse=True, return_counts=True)):
        torch.testing.assert_close(got.cpu(), expected)
    for got, expected in zip(torch.unique_consecutive(d, return_counts=True),
                             torch.unique_consecutive(x, return_counts=True)):
        torch.testing.assert_close(got.cpu(), expected)
    m = torch.tensor([[1, 2], [1, 2], [0, 1]])
    torch.testing.assert_close(torch.unique(m.to(device), dim=0).cpu(), torch.unique(m, dim=0))
    assert torch.equal(d, d.clone()) and not torch.equal(d, d + 1)
    assert calls() == before + 6


def test_default_mode_is_silent(sync_mode):
    d = torch.arange(4, device="openreg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nonzero(d)
        d.sum().item()
    assert torch.openreg.get_sync_debug_mode() == 0


def test_warn_mode(sync_mode):
    d = torch.arange(4, device="openreg")
    sync_mode("warn")
    assert torch.openreg.get_sync_debug_mode() == 1
    with pytest.warns(UserWarning, match=r"synchronizing openreg operation \(aten::nonzero\)"):
        torch.nonzero(d)
    with pytest.warns(UserWarning, match=r"aten::_local_scalar_dense"):
        d.sum().item()


def test_error_mode(sync_mode):
    d = torch.arange(4, device="openreg")
    sync_mode(2)
    with pytest.raises(RuntimeError, match=r"synchronizing openreg operation \(aten::masked_select\)"):
        torch.masked_select(d, d > 1)
    with pytest.raises(RuntimeError, match="aten::_local_scalar_dense"):
        bool(d[0])
    torch.sin(d.float())  # not synchronizing: allowed


def test_invalid_mode(sync_mode):
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        sync_mode("loud")
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        sync_mode(3)
    assert torch.openreg.get_sync_debug_mode() == 0
