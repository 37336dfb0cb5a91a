"""Memory management of ``torch.openreg``.

The statistics come from the native caching allocator (csrc/adapters/device_allocator.cpp), a
``c10::DeviceAllocator``; this module only forwards to ``torch.accelerator``, which reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from torch_openreg import _C


def _index(device: Any) -> int:
    from . import _device_index

    return _device_index(device)


def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: Any = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: Any = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device: Any = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device: Any = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def empty_cache() -> None:
    """Returns the cached free device memory of every device to the (simulated) driver."""
    torch.accelerator.empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device: total is its capacity (OPENREG_DEVICE_MEMORY)."""
    return torch.accelerator.get_memory_info(_index(device))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limits the caching allocator of a device to ``fraction`` of its capacity."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    _C._set_memory_fraction(fraction, _index(device))
