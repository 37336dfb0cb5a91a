"""Kernels for aten operators written in Python with ``torch.library`` (docs/python_kernels.md).

``torch.library.Library("aten", "IMPL").impl(name, fn, "PrivateUse1")`` puts a Python function
in an aten operator's openreg slot. The dispatcher calls it boxed, through the Python
interpreter: about 10-15 µs per call on top of the work (the C++ fallback costs about 3 µs), so
this route suits operators that are rare, or large, or naturally written with other operators.

openreg uses it for the CUDA-only fused dropout pair, which has no CPU kernel the generic fallback
could run:

- ``_fused_dropout(self, p, generator)`` keeps each element with probability ``p`` (the *keep*
  probability) and scales kept ones by ``1/p``; returns the result and the ``uint8`` mask;
- ``_masked_scale(self, mask, scale)`` = ``self * mask * scale``: the backward of
  ``_fused_dropout`` (autograd calls it through ``_fused_dropout_backward``).

The mask is drawn from the openreg device generator (seedable with ``torch.openreg.manual_seed``
or an explicit ``torch.Generator(device="openreg")``), like every openreg random operator.
"""

from __future__ import annotations

import torch

# Kept alive for the life of the process: dropping the Library object unregisters the kernels.
_aten = torch.library.Library("aten", "IMPL")


# [docs:start FUSED_DROPOUT]
def _fused_dropout(self: torch.Tensor, p: float, generator: torch.Generator | None = None):
    torch._check(0 <= p <= 1, lambda: f"dropout probability has to be between 0 and 1, but got {p}")
    mask = torch.empty_like(self, dtype=torch.uint8).bernoulli_(p, generator=generator)
    scale = 1.0 / p if p > 0 else 0.0
    return self * mask * scale, mask


def _masked_scale(self: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(mask.dtype == torch.uint8, lambda: "mask should be torch.uint8 dtype")
    return self * mask * scale


_aten.impl("_fused_dropout", _fused_dropout, "PrivateUse1")
_aten.impl("_masked_scale", _masked_scale, "PrivateUse1")
# [docs:end FUSED_DROPOUT]
