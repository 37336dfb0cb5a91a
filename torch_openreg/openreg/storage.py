"""Legacy typed storages of openreg: ``torch.openreg.FloatStorage`` and friends.

``torch.UntypedStorage(n, device="openreg")`` and ``tensor.untyped_storage()`` need nothing from
the backend beyond its allocator and the ``resizePrivateUse1Bytes`` hook. The legacy per-dtype
classes (deprecated in PyTorch, still used by old checkpoints and code written for
``torch.cuda.FloatStorage``) are per device module: torch finds a class's device from the last
component of its ``__module__``, so they are declared here and published as ``torch.openreg.*``.
"""

from __future__ import annotations

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal


# [docs:start LEGACY_STORAGE]
class _OpenRegLegacyStorage(_LegacyStorage):
    """Base of the legacy storages on openreg (device memory: no file or shared-memory constructors)."""

    @classmethod
    def from_buffer(cls, *args, **kwargs):
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: not available for openreg storage (device memory)")

    @classmethod
    def _new_with_weak_ptr(cls, *args, **kwargs):
        raise RuntimeError("_new_with_weak_ptr: not available for openreg storage")

    @classmethod
    def _new_shared_filename(cls, manager, obj, size, *, device=None, dtype=None):
        raise RuntimeError("_new_shared_filename: not available for openreg storage")


def _legacy_storage(name: str, dtype: torch.dtype) -> type:
    def _dtype(cls):
        return dtype

    def public_dtype(cls):
        _warn_typed_storage_removal()
        return dtype

    # torch reads the device of a legacy storage class from its module name: "torch.openreg".
    return type(
        name,
        (_OpenRegLegacyStorage,),
        {"_dtype": classproperty(_dtype), "dtype": classproperty(public_dtype), "__module__": "torch.openreg"},
    )
# [docs:end LEGACY_STORAGE]


ByteStorage = _legacy_storage("ByteStorage", torch.uint8)
CharStorage = _legacy_storage("CharStorage", torch.int8)
ShortStorage = _legacy_storage("ShortStorage", torch.int16)
IntStorage = _legacy_storage("IntStorage", torch.int32)
LongStorage = _legacy_storage("LongStorage", torch.int64)
HalfStorage = _legacy_storage("HalfStorage", torch.float16)
FloatStorage = _legacy_storage("FloatStorage", torch.float32)
DoubleStorage = _legacy_storage("DoubleStorage", torch.float64)
BFloat16Storage = _legacy_storage("BFloat16Storage", torch.bfloat16)
BoolStorage = _legacy_storage("BoolStorage", torch.bool)
ComplexFloatStorage = _legacy_storage("ComplexFloatStorage", torch.complex64)
ComplexDoubleStorage = _legacy_storage("ComplexDoubleStorage", torch.complex128)

__all__ = [
    "ByteStorage", "CharStorage", "ShortStorage", "IntStorage", "LongStorage", "HalfStorage",
    "FloatStorage", "DoubleStorage", "BFloat16Storage", "BoolStorage", "ComplexFloatStorage",
    "ComplexDoubleStorage",
]
