"""Automatic mixed precision for openreg: ``torch.openreg.amp``.

The cast policies themselves are native kernels of the AutocastPrivateUse1 dispatch key
(csrc/ops/autocast.cpp); ``torch.autocast("openreg")`` turns that key on. This module holds what
torch asks the device module for (``get_amp_supported_dtype``) and the device-bound shortcuts that
``torch.cuda.amp`` users expect.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autocast", "GradScaler", "get_amp_supported_dtype"]


# [docs:start AMP_SUPPORTED_DTYPE]
def get_amp_supported_dtype() -> list[torch.dtype]:
    """Low-precision dtypes ``torch.autocast("openreg", dtype=...)`` accepts (float16 is the
    default, see ``torch.get_autocast_dtype("openreg")``); any other dtype makes torch warn and
    disable autocast, as for CUDA."""
    from torch_openreg.device_profiles import is_dtype_supported

    return [d for d in (torch.float16, torch.bfloat16) if is_dtype_supported(d)]
# [docs:end AMP_SUPPORTED_DTYPE]


class autocast(torch.amp.autocast):
    """``torch.autocast`` bound to the openreg device: ``with torch.openreg.amp.autocast(): ...``"""

    def __init__(
        self,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        cache_enabled: bool | None = None,
    ) -> None:
        super().__init__("openreg", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` bound to the openreg device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("openreg", *args, **kwargs)
