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


# [docs:start HOST_MEMORY_STATS]
# Pinned host memory (csrc/adapters/host_allocator.cpp), named like torch.cuda's functions.
def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """Statistics of the pinned host memory allocator, as nested dictionaries."""
    return _C._host_memory_stats()


def host_memory_stats() -> OrderedDict[str, Any]:
    """Statistics of the pinned host memory allocator, flattened like ``torch.cuda``'s:
    ``"allocations.current"``, ``"allocated_bytes.peak"``, ``"active_requests.current"``,
    ``"active_bytes.current"``, ``"num_host_alloc"``, ``"num_host_free"``,
    ``"host_alloc_time.total"``..."""
    flat: list[tuple[str, Any]] = []

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat.append((prefix, value))

    add("", host_memory_stats_as_nested_dict())
    return OrderedDict(sorted(flat))


def reset_accumulated_host_memory_stats() -> None:
    """Resets the ``allocated``/``freed`` counters of the pinned host memory statistics."""
    _C._host_reset_accumulated_stats()


def reset_peak_host_memory_stats() -> None:
    """Resets the ``peak`` values of the pinned host memory statistics."""
    _C._host_reset_peak_stats()



# torch.accelerator.empty_host_cache() returns the cached free pinned blocks to the system.
# [docs:end HOST_MEMORY_STATS]
