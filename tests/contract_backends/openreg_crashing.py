"""openreg with a device module whose get_amp_supported_dtype crashes the process (a segfault), for
tests/test_check.py: the check must report that check as crashed and still run the others."""
import ctypes
import types

import torch
import torch_openreg  # noqa: F401

full = torch.openreg
crashing = types.ModuleType("openreg_crashing")
for name in dir(full):
    if not name.startswith("__"):
        setattr(crashing, name, getattr(full, name))


def get_amp_supported_dtype():
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a broken native binding would


crashing.get_amp_supported_dtype = get_amp_supported_dtype
delattr(torch, "openreg")
torch._register_device_module("openreg", crashing)
