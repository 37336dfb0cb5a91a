"""``torch.openreg``: the device module of the openreg backend.

It follows the device-agnostic part of ``torch.cuda``: devices, streams, events, memory, random
number generation and automatic mixed precision.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from torch_openreg import _C

from torch_openreg.async_mode import is_async, set_async  # noqa: F401
from torch_openreg import faults  # noqa: F401  (torch.openreg.faults)
from torch_openreg.device_profiles import (  # noqa: F401
    get_device_profile,
    is_dtype_supported,
    set_device_profile,
)

from .graphs import graph, graph_pool_handle, is_current_stream_capturing  # noqa: F401
from .memory import (  # noqa: F401
    empty_cache,
    host_memory_stats,
    host_memory_stats_as_nested_dict,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_accumulated_host_memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_host_memory_stats,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from .random import (  # noqa: F401
    _get_generator,
    default_generators,
    get_offset,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_offset,
    set_rng_state,
    set_rng_state_all,
)
from .streams import (  # noqa: F401
    CopyEngineConfig,
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    get_copy_engine_config,
    set_copy_engine_config,
    set_stream,
    stream,
)

_initialized = False
_init_lock = threading.Lock()


def is_available() -> bool:
    """Whether openreg devices can be used (there is at least one)."""
    return _C._device_count() > 0


def device_count() -> int:
    """Number of openreg devices (``OPENREG_DEVICE_COUNT``, default 2)."""
    return _C._device_count()


def _is_in_bad_fork() -> bool:
    return _C._is_in_bad_fork()


# [docs:start LAZY_INIT]
def _lazy_init() -> None:
    """Initialises the runtime on first use; called by torch for every openreg factory call."""
    global _initialized
    if _initialized and not _C._is_in_bad_fork():
        return
    with _init_lock:
        _C._init()  # raises in a child forked from an initialised process
        _initialized = True
# [docs:end LAZY_INIT]


def init() -> None:
    """Initialises the openreg runtime (done lazily by the first use otherwise)."""
    _lazy_init()


def is_initialized() -> bool:
    return _C._is_initialized()


def _device_index(device: Any, optional: bool = True) -> int:
    """Index of ``device`` (int, str, torch.device, or None for the current device)."""
    if device is None:
        if not optional:
            raise ValueError("Expected an openreg device, got None")
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "openreg":
            raise ValueError(f"Expected an openreg device, got {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int):
        return device
    raise TypeError(f"Expected an int, str or torch.device, got {type(device).__name__}")


def current_device() -> int:
    """Index of the calling thread's current openreg device."""
    return _C._current_device()


def set_device(device: Any) -> None:
    """Sets the calling thread's current openreg device."""
    index = _device_index(device)
    if index >= 0:
        _lazy_init()
        _C._set_device(index)


class device:
    """Context manager that changes the current device: ``with torch.openreg.device(1): ...``."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None else _device_index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        if self.idx >= 0 and self.idx != self.prev_idx:
            set_device(self.idx)
        return self

    def __exit__(self, *exc_info):
        if self.idx >= 0 and self.idx != self.prev_idx:
            _C._set_device(self.prev_idx)
        return False


class device_of(device):
    """Context manager that makes the device of a tensor current (no-op for CPU tensors)."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.device.type == "openreg" else -1)


def synchronize(device: Any = None) -> None:
    """Waits until all work queued on every stream of the device has run."""
    _lazy_init()
    _C._synchronize(_device_index(device))


def ipc_collect() -> int:
    """Frees the device memory of storages sent to other processes once those processes have
    released them (``torch.cuda.ipc_collect``); returns how many are still in use elsewhere."""
    return _C._ipc_collect()


class _DeviceProperties(NamedTuple):
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


def get_device_properties(device: Any = None) -> _DeviceProperties:
    return _DeviceProperties(*_C._get_device_properties(_device_index(device)))


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 runs natively (the device executes CPU kernels, which support it), unless the
    device profile refuses it (docs/device_profiles.md)."""
    return is_dtype_supported(torch.bfloat16)


# [docs:start SYNC_DEBUG_MODE]
_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Like ``torch.cuda.set_sync_debug_mode``: "default"/0 does nothing, "warn"/1 warns and
    "error"/2 raises when an operator makes the host wait for the device (``nonzero``,
    ``masked_select``, ``unique``, ``equal``, ``item()``...). See docs/op_fallback.md."""
    if isinstance(debug_mode, str):
        if debug_mode not in _SYNC_DEBUG_MODES:
            raise RuntimeError(
                "invalid value of debug_mode, expected one of `default`, `warn`, `error`"
            )
        debug_mode = _SYNC_DEBUG_MODES[debug_mode]
    _C._set_sync_debug_mode(debug_mode)


def get_sync_debug_mode() -> int:
    """The current sync debug mode (0, 1 or 2)."""
    return _C._get_sync_debug_mode()
# [docs:end SYNC_DEBUG_MODE]


from . import amp  # noqa: E402
from .storage import *  # noqa: E402,F401,F403
from .amp import get_amp_supported_dtype  # noqa: E402,F401
