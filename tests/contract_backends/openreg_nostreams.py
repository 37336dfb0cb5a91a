"""openreg as a backend whose device module has no stream API, for tests/test_check.py.

A vendor's first device module often stops at devices and memory: this one re-exports torch.openreg
without Stream, Event, current_stream, default_stream, set_stream and stream, and is registered as
the device module in place of openreg's (openreg itself is not modified)."""
import types

import torch
import torch_openreg  # noqa: F401  registers openreg (autoload is off in the check's worker)

REMOVED = ("Stream", "Event", "current_stream", "default_stream", "set_stream", "stream")

full = torch.openreg
partial = types.ModuleType("openreg_nostreams")
for name in dir(full):
    if name not in REMOVED and not name.startswith("__"):
        setattr(partial, name, getattr(full, name))
delattr(torch, "openreg")
torch._register_device_module("openreg", partial)
