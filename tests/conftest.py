import os

import pytest
import torch

# The backend must be registered by autoload, through `import torch` alone.
assert hasattr(torch, "openreg"), (
    "torch_openreg was not autoloaded: install it with `pip install --no-build-isolation -e .`"
)


@pytest.fixture(params=["openreg:0", "openreg:1"])
def device(request):
    """Both simulated devices: tests using it run once per device."""
    return torch.device(request.param)
