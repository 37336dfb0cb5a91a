"""Storages on openreg: UntypedStorage, legacy typed storages, DLPack."""

import io
import warnings

import numpy as np
import pytest
import torch
import torch.utils.dlpack


# --- UntypedStorage -----------------------------------------------------------------------------


def test_untyped_storage_lives_in_device_memory(device):
    before = torch.openreg.memory_allocated(device)
    s = torch.UntypedStorage(4096, device=device)
    assert s.device == device and s.nbytes() == 4096
    assert torch.openreg.memory_allocated(device) - before >= 4096
    del s
    assert torch.openreg.memory_allocated(device) == before


def test_untyped_storage_copy_between_host_and_devices(device):
    host = torch.UntypedStorage.from_buffer(bytes(range(16)), dtype=torch.uint8)
    s = torch.UntypedStorage(16, device=device)
    s.copy_(host)
    assert s.cpu().tolist() == list(range(16))
    other = torch.UntypedStorage(16, device="openreg:1" if device.index == 0 else "openreg:0")
    other.copy_(s)
    assert other.cpu().tolist() == list(range(16))
    assert host.openreg(device.index).device == device  # generated method UntypedStorage.openreg()


def test_untyped_storage_resize_keeps_the_prefix(device):
    t = torch.arange(4, dtype=torch.uint8).to(device)
    s = t.untyped_storage()
    s.resize_(8)
    assert s.nbytes() == 8 and s.device == device
    assert s.cpu().tolist()[:4] == [0, 1, 2, 3]
    s.resize_(2)
    assert s.cpu().tolist() == [0, 1]
    s.resize_(0)
    assert s.nbytes() == 0


def test_tensor_set_on_a_device_storage(device):
    s = torch.UntypedStorage(24, device=device)
    t = torch.empty(0, device=device).set_(s, 0, (2, 3), (3, 1))
    t.copy_(torch.arange(6.0).view(2, 3))
    assert t.untyped_storage().data_ptr() == s.data_ptr()
    assert torch.equal(torch.tensor([], dtype=torch.float32).set_(s.cpu()).view(2, 3), torch.arange(6.0).view(2, 3))


def test_share_memory_is_a_no_op_like_cuda(device):
    # torch treats accelerator storages as not backed by POSIX shared memory: share_memory_()
    # returns the storage unchanged and is_shared() is true, as for CUDA. The memory itself cannot
    # be passed to another process (the simulated device lives in this process).
    t = torch.arange(3.0).to(device)
    s = t.untyped_storage()
    assert s.share_memory_() is s
    assert s.is_shared()
    assert t.tolist() == [0.0, 1.0, 2.0]


def test_storage_fill_and_equality(device):
    s = torch.UntypedStorage(8, device=device)
    s.fill_(7)
    assert s.tolist() == [7] * 8


# --- legacy typed storages (torch.openreg.FloatStorage, ...) ------------------------------------

LEGACY = {
    "ByteStorage": torch.uint8,
    "CharStorage": torch.int8,
    "ShortStorage": torch.int16,
    "IntStorage": torch.int32,
    "LongStorage": torch.int64,
    "HalfStorage": torch.float16,
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "BFloat16Storage": torch.bfloat16,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


@pytest.fixture(autouse=True)
def _quiet_typed_storage_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_storage_classes(name):
    cls = getattr(torch.openreg, name)
    s = cls(5)
    assert s.device == torch.device("openreg:0") and s.dtype == LEGACY[name] and s.size() == 5
    assert isinstance(s, cls)
    assert not isinstance(s, getattr(torch, name))  # torch.FloatStorage is the CPU one
    assert s.type() == f"torch.openreg.{name}"


def test_legacy_storage_follows_the_current_device_and_takes_data():
    with torch.openreg.device(1):
        s = torch.openreg.FloatStorage([1.0, 2.0, 3.0])
    assert s.device == torch.device("openreg:1")
    assert s.tolist() == [1.0, 2.0, 3.0]


def test_tensor_storage_is_an_instance_of_the_legacy_class(device):
    t = torch.arange(4.0).to(device)
    assert isinstance(t.storage(), torch.openreg.FloatStorage)
    assert not isinstance(t.storage(), torch.openreg.LongStorage)
    assert t.type() == "torch.openreg.FloatTensor"
    assert t.storage().cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_typed_storage_save_load(device):
    t = torch.arange(4.0).to(device)
    buf = io.BytesIO()
    torch.save(t.storage(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.device == device and loaded.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_legacy_storage_host_only_constructors_raise():
    with pytest.raises(RuntimeError, match="from_buffer: not available for openreg"):
        torch.openreg.FloatStorage.from_buffer(b"\0" * 8)


# --- DLPack -------------------------------------------------------------------------------------


def test_dlpack_capsule_roundtrip_shares_memory(device):
    t = torch.arange(6.0).to(device).view(2, 3)
    capsule = torch.utils.dlpack.to_dlpack(t)
    back = torch.utils.dlpack.from_dlpack(capsule)
    assert back.device == device and back.shape == (2, 3)
    assert back.data_ptr() == t.data_ptr()  # zero-copy
    back[0, 0] = 42.0
    assert t[0, 0].item() == 42.0


def test_dlpack_protocol_is_a_clear_error_in_torch_2_13(device):
    # torch 2.13's Tensor.__dlpack_device__ recognises a PrivateUse1 tensor only while the backend
    # still has the name "privateuse1"; once renamed it raises ValueError (documented in
    # docs/storage.md). The capsule functions above are the supported route.
    t = torch.arange(3.0).to(device)
    with pytest.raises(ValueError, match="Unknown device type openreg for Dlpack"):
        torch.from_dlpack(t)


def test_numpy_cannot_import_a_device_tensor(device):
    t = torch.arange(3.0).to(device)
    with pytest.raises((TypeError, ValueError, RuntimeError, BufferError)):
        np.from_dlpack(t)
    cpu = np.from_dlpack(t.cpu())
    assert cpu.tolist() == [0.0, 1.0, 2.0]
