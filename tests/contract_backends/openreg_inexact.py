"""openreg with an `exp` that is off by 0.1%, for tests/test_check.py: the opinfo_sample check must
name the operator, the sample, the tolerance and the largest difference."""
import torch
import torch_openreg  # noqa: F401  registers openreg (autoload is off in the check's worker)


def inexact_exp(x):
    return (torch.exp(x.cpu()) * 1.001).to(x.device)


library = torch.library.Library("aten", "IMPL")  # kept alive: dropping it unregisters the kernel
library.impl("exp", inexact_exp, "PrivateUse1")
