"""Custom operators written in Python: ``torch.library.custom_op`` (docs/custom_ops.md).

The C++ route for custom operators is ``csrc/routes/custom_ops.cpp`` (``openreg::custom_abs``
and the two aliasing examples). This module adds, in the same ``openreg`` namespace, an operator
defined entirely from Python, with the three pieces PyTorch asks for:

- the kernel for openreg tensors (``device_types="openreg"``);
- a fake implementation (``register_fake``): the result's metadata, for FakeTensor,
  ``torch.compile`` and ``torch.export``;
- the backward (``register_autograd``).

``torch.ops.openreg.custom_add(x, y)`` adds two openreg tensors of the same shape and floating
dtype. It is deliberately simple: the point is the registration, which a vendor copies for its own
operators.
"""

from __future__ import annotations

import torch


# [docs:start CHECK]
def _check(x: torch.Tensor, y: torch.Tensor, *, fake: bool) -> None:
    """Bad input raises what aten raises in the same case, the same way in eager and fake mode.

    A dtype the kernel does not support is a NotImplementedError in eager mode (as in aten
    kernels) and a RuntimeError in fake mode (FakeTensor would report a NotImplementedError as an
    unsupported operator); NotImplementedError is a RuntimeError, so callers can catch either.
    """
    if x.device != y.device:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{x.device} and {y.device}! (in openreg::custom_add)"
        )
    if x.dtype != y.dtype:
        raise RuntimeError(f"custom_add: expected both tensors to have the same dtype, "
                           f"but got {x.dtype} and {y.dtype}")
    if not x.dtype.is_floating_point:
        message = f"\"custom_add\" not implemented for '{str(x.dtype).removeprefix('torch.')}'"
        raise RuntimeError(message) if fake else NotImplementedError(message)
    if x.shape != y.shape:
        raise RuntimeError(f"custom_add: expected tensors of the same shape, "
                           f"but got {list(x.shape)} and {list(y.shape)}")
# [docs:end CHECK]


# [docs:start CUSTOM_ADD]
@torch.library.custom_op("openreg::custom_add", mutates_args=(), device_types="openreg")
def custom_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The openreg kernel: runs on the device (here through openreg's own aten kernels)."""
    _check(x, y, fake=False)
    return torch.add(x, y)


@custom_add.register_fake
def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Metadata only: no data is read or written."""
    _check(x, y, fake=True)
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad, grad


custom_add.register_autograd(_backward)
# [docs:end CUSTOM_ADD]
