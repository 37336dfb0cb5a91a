"""openreg as a backend without set_, for tests/test_check.py: each set_ overload raises what the
dispatcher raises for an operator with no kernel and no fallback. torch.load rebuilds tensors with
set_ and storage copies view storages through it: the checks must name set_, not the device module."""
import torch
import torch_openreg  # noqa: F401  registers openreg (autoload is off in the check's worker)

OVERLOADS = ("set_.source_Storage", "set_.source_Storage_storage_offset", "set_.source_Tensor", "set_")


def missing(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"Could not run 'aten::{name}' with arguments from the 'openreg' "
                                  "backend")
    return kernel


library = torch.library.Library("aten", "IMPL")  # kept alive: dropping it unregisters the kernels
for overload in OVERLOADS:
    library.impl(overload, missing(overload), "PrivateUse1")
