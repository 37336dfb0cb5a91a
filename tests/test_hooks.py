"""PrivateUse1 hooks (csrc/adapters/hooks.cpp, docs/hooks.md): every virtual of
at::PrivateUse1HooksInterface, through the route PyTorch takes to it."""
import subprocess
import sys

import pytest
import torch

import torch_openreg  # noqa: F401
from torch_openreg import _C


def run_fresh(code):
    """Runs `code` in a new interpreter (openreg autoloaded, not initialised yet)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_is_built_available_and_lazy_init_with_primary_context():
    # torch.accelerator.is_available() asks isAvailable() without initialising the device;
    # init() (any first use) creates the "primary context" hasPrimaryContext() reports.
    out = run_fresh(
        "import torch\n"
        "from torch_openreg import _C\n"
        "print(torch.accelerator.is_available(), torch._C._get_accelerator(), _C._is_initialized(),"
        " _C._hooks_has_primary_context(0))\n"
        "torch.ones(1, device='openreg')\n"
        "print(_C._is_initialized(), _C._hooks_has_primary_context(0))\n")
    assert out.splitlines() == ["True openreg False False", "True True"]


def test_device_count_current_set_and_exchange():
    hooks = torch._C
    assert hooks._accelerator_hooks_device_count() == torch.openreg.device_count() == 2
    start = torch.openreg.current_device()
    try:
        hooks._accelerator_hooks_set_current_device(1)
        assert hooks._accelerator_hooks_get_current_device() == 1 == torch.openreg.current_device()
        assert hooks._accelerator_hooks_exchange_device(0) == 1
        assert torch.openreg.current_device() == 0
        assert hooks._accelerator_hooks_maybe_exchange_device(1) == 0
        assert torch.openreg.current_device() == 1
    finally:
        torch.openreg.set_device(start)
    with pytest.raises(RuntimeError, match="out of range"):
        hooks._accelerator_hooks_set_current_device(2)


def test_primary_context_of_a_bad_index_is_refused():
    with pytest.raises(RuntimeError, match="out of range"):
        _C._hooks_has_primary_context(5)


def test_device_from_pointer():
    x = torch.empty(16, device="openreg:1")
    assert _C._hooks_device_from_ptr(x.data_ptr()) == 1
    assert _C._hooks_device_from_ptr(x[3:].data_ptr()) == 1  # inside a block
    with pytest.raises(RuntimeError, match="is not openreg device memory"):
        _C._hooks_device_from_ptr(torch.empty(4).data_ptr())


def test_default_and_new_generators():
    # torch.Generator("openreg") -> getNewGenerator; torch.openreg.default_generators and the
    # device's seeding -> getDefaultGenerator (index -1: the current device).
    g = torch.Generator("openreg:1")
    assert g.device == torch.device("openreg", 1)
    torch.openreg.manual_seed_all(3)
    a = torch.randn(4, device="openreg:1")
    g.manual_seed(3)
    b = torch.randn(4, device="openreg:1", generator=g)
    assert torch.equal(a.cpu(), b.cpu())  # a new generator seeded as the default one


def test_pinned_memory_hooks():
    # pin_memory() allocates with getPinnedMemoryAllocator(); is_pinned() asks isPinnedPtr().
    t = torch.ones(8).pin_memory()
    assert t.is_pinned() and not torch.ones(8).is_pinned()
    assert t[2:].is_pinned()  # a pointer inside a pinned block


def test_resize_storage_bytes():
    # untyped_storage().resize_() on a device storage -> resizePrivateUse1Bytes, keeping data.
    x = torch.arange(4.0, device="openreg")
    s = x.untyped_storage()
    s.resize_(32)
    assert s.nbytes() == 32 and s.device == x.device
    assert torch.equal(torch.empty(0, device="openreg").set_(s, 0, (4,)).cpu(), torch.arange(4.0))
    s.resize_(0)
    assert s.nbytes() == 0
