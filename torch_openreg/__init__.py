"""torch_openreg: a simulated CUDA-like accelerator for PyTorch, integrated through PrivateUse1.

Importing this package (or only ``import torch``, through autoload) makes the ``openreg`` device
usable: ``torch.ones(2, device="openreg:1")``.
"""


# [docs:start AUTOLOAD]
def _autoload() -> None:
    """Entry point of the ``torch.backends`` group, called by ``import torch``.

    Importing this package registers everything, so there is nothing left to do here. It is
    defined before ``import torch`` on purpose: when a user imports torch_openreg first, torch's
    own import runs the autoload while this module is still half-initialised, and must find it.
    Set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to stop torch from importing this package.
    """
# [docs:end AUTOLOAD]


import atexit  # noqa: E402

import torch  # noqa: E402

# The native core registers, when loaded: the device allocator, the pinned-memory allocator, the
# DeviceGuard, the PrivateUse1 hooks, the generators, the minimal kernels and the fallback. It is
# the build made against the installed torch (one per release, side by side), or a clear
# ImportError saying how to rebuild (_native_build.py, docs/torch_releases.md).
from torch_openreg import _native_build  # noqa: E402

_C = _native_build.load()

# OPENREG_DEVICE_PROFILE: the devices refuse some dtypes, as MPS refuses float64 (before anything
# can create a device tensor; docs/device_profiles.md).
from torch_openreg import device_profiles as _device_profiles  # noqa: E402

_device_profiles._enable_from_environment()
from torch_openreg import openreg  # noqa: E402

__all__ = ["openreg"]


def _register() -> None:
    # [docs:start REGISTRATION]
    torch.utils.rename_privateuse1_backend("openreg")
    torch._register_device_module("openreg", openreg)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    # [docs:end REGISTRATION]
    openreg.random._register_graphsafe_rng()  # needs the device name: after the rename


if torch._C._get_privateuse1_backend_name() != "openreg":
    _register()

# The autograd worker threads of openreg finish what they hold of the last backward before the
# interpreter finalizes; otherwise a script may abort at exit (csrc/adapters/autograd.cpp).
atexit.register(_C._release_autograd_graphs)

# Operator routes written in Python (the C++ ones live in csrc/routes/): kernels for aten
# operators, and custom operators in the `openreg` namespace. Registered once, at import.
from torch_openreg import custom_ops, python_kernels  # noqa: E402,F401

# `model.to("openreg")` keeps every Parameter object and every tie (docs/module_conversion.md).
from torch_openreg import module_conversion  # noqa: E402,F401

# torch.compile: the Dynamo device interface, the `openreg` Dynamo backend and Inductor's code
# generation for the device, each registered when torch imports the module it extends.
from torch_openreg import compile as _compile  # noqa: E402

_compile.install()

# The `occl` c10d backend for openreg tensors (docs/distributed.md).
from torch_openreg import distributed  # noqa: E402,F401

# Device tensors across processes: torch.multiprocessing reductions of openreg storages (docs/ipc.md).
from torch_openreg import multiprocessing  # noqa: E402,F401

# OPENREG_SANITIZE=1: the stream sanitizer checks the whole program (docs/sanitizer.md).
from torch_openreg import sanitizer as _sanitizer  # noqa: E402

_sanitizer._enable_from_environment()

# OPENREG_ASYNC=1: kernels are queued on their stream and run by its worker (docs/async_mode.md).
from torch_openreg import async_mode as _async_mode  # noqa: E402

_async_mode._enable_from_environment()

# OPENREG_FAULTS: injected out-of-memory errors and kernel failures (docs/fault_injection.md).
from torch_openreg import faults as _faults  # noqa: E402

_faults._enable_from_environment()

# A test suite pointed at openreg (TRANSFORMERS_TEST_*, DIFFUSERS_TEST_*, TORCH_TEST_DEVICES) in a
# way that would not test openreg fails here, before the suite reads its variables: at
# `import torch`, naming the variable and the fix (docs/test_suites.md).
from torch_openreg import testing as _testing  # noqa: E402

_testing._check_suite_environment()
