"""The PrivateUse1 contract check: what PyTorch expects of an accelerator backend, checked against
whichever backend is registered in the process.

    python -m torch_openreg.check [--device NAME] [--format table|json|junit] [--import MODULE]

This package imports nothing of torch_openreg: it talks to the backend only through torch (the
PrivateUse1 name, ``torch.get_device_module``, ``torch.accelerator``, tensors on the device), so it
runs against any PrivateUse1 backend. Each check is a function in ``checks.py``; ``run_checks``
runs them and returns one ``Result`` per check; ``testing.BackendContract`` exposes them as pytest
tests (docs/contract_check.md).
"""

from .checks import CHECKS, Check, CheckFailed, Context
from .runner import Result, run_checks

__all__ = ["CHECKS", "Check", "CheckFailed", "Context", "Result", "run_checks"]
