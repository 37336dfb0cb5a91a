"""openreg with a device module that misbehaves the worst ways, for tests/test_check.py:
get_amp_supported_dtype crashes the process (a segfault) and get_device_name never returns. The
check must report the first as crashed and the second as a hang, and still run the others."""
import ctypes
import threading
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


def get_device_name(device=None):
    threading.Event().wait()  # a driver call that never returns


crashing.get_amp_supported_dtype = get_amp_supported_dtype
crashing.get_device_name = get_device_name
delattr(torch, "openreg")
torch._register_device_module("openreg", crashing)
