"""The test base of openreg for PyTorch's device-generic tests (docs/test_suites.md).

Not a module to import: PyTorch's ``torch.testing._internal.common_device_type`` runs this file
(``runpy.run_path`` with its own globals) for each path in ``TORCH_TEST_DEVICES``, and adds the
class named ``TEST_CLASS`` to its device test bases. Get the path with
``python -m torch_openreg.testing spec pytorch``::

    TORCH_TEST_DEVICES=$(python -m torch_openreg.testing spec pytorch) \\
    PYTORCH_TESTING_DEVICE_ONLY_FOR=openreg python test_binary_ufuncs.py
"""
# [docs:start TEST_BASE]
if "PrivateUse1TestBase" not in globals():
    raise ImportError(
        "torch_openreg/testing/pytorch_test_base.py is run by PyTorch's common_device_type for "
        "TORCH_TEST_DEVICES, not imported: set TORCH_TEST_DEVICES=$(python -m "
        "torch_openreg.testing spec pytorch)")

import torch_openreg  # noqa: E402  registers openreg even with TORCH_DEVICE_BACKEND_AUTOLOAD=0
from torch_openreg.testing import TEST_EXCLUSIONS, exclusion_config  # noqa: E402


class OpenRegTestBase(PrivateUse1TestBase):  # noqa: F821  (PyTorch's globals)
    """PrivateUse1TestBase with openreg's exclusions (torch_openreg.testing.TEST_EXCLUSIONS:
    PyTorch test class -> test method -> the reason openreg does not run it)."""

    exclusion_reasons = TEST_EXCLUSIONS


OpenRegTestBase.set_test_configs(test_exclusions=exclusion_config())

# With openreg registered before common_device_type was imported (autoload), PrivateUse1TestBase
# is already one of the device test bases: this class replaces it, or every test would be
# generated twice for openreg, in two classes, once without these exclusions (docs/test_suites.md,
# the catalogue).
while PrivateUse1TestBase in device_type_test_bases:  # noqa: F821
    device_type_test_bases.remove(PrivateUse1TestBase)  # noqa: F821

TEST_CLASS = OpenRegTestBase
# [docs:end TEST_BASE]
