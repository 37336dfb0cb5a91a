"""The contract checks as pytest tests, for a backend's own CI.

In a test file of the backend (the backend registered, e.g. by autoload or an import)::

    from torch_openreg.check.testing import BackendContract

    class TestMyBackendContract(BackendContract):
        device = "mydev"            # default: the PrivateUse1 backend's name
        imports = ("my_backend",)   # what registers it, for the checks that start a subprocess
        optional_must_pass = False  # True: optional checks fail the test instead of skipping

One test per check (``test_streams_events`` ...). A required check that fails fails its test with
the reason and the fix; an optional one is skipped with its reason unless ``optional_must_pass``.
"""

from __future__ import annotations

import pytest

from .checks import CHECKS, Check, Context
from .runner import run_one


# [docs:start BACKEND_CONTRACT]
def _make_test(check: Check):
    def test(self):
        ctx = Context.for_device(self.device, tuple(self.imports))
        r = run_one(check, ctx, self.timeout)
        if r.passed:
            return
        message = f"{r.name}: {r.detail}\nfix: {r.fix}\nguide: {r.guide}"
        if not r.required and not self.optional_must_pass:
            pytest.skip(f"optional check failed: {r.detail}")
        pytest.fail(message, pytrace=False)
    test.__name__ = f"test_{check.name}"
    test.__doc__ = check.mechanism
    return test


class BackendContract:
    """Subclass it in a test module (the class name must start with ``Test`` to be collected)."""

    device: str | None = None
    imports: tuple[str, ...] = ()
    optional_must_pass = False
    timeout = 60.0


for _check in CHECKS:
    setattr(BackendContract, f"test_{_check.name}", _make_test(_check))
del _check
# [docs:end BACKEND_CONTRACT]
