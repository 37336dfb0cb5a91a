"""Streams and events of ``torch.openreg``.

An openreg stream is a ``torch.Stream`` of the openreg device and an openreg event a
``torch.Event``: the native runtime (csrc/runtime/stream.cpp) orders the work, reached through the
DeviceGuard (csrc/adapters/device_guard.cpp). This module only adds the ``torch.cuda``-style
conveniences on top (priorities, the ``stream`` context manager, copy-engine settings); it
re-implements none of that logic. See docs/streams.md.
"""

from __future__ import annotations

import atexit
from typing import Any, NamedTuple

import torch

from torch_openreg import _C


def _device(device: Any) -> torch.device:
    from . import _device_index

    if isinstance(device, int) and device < 0:
        device = None
    return torch.device("openreg", _device_index(device))


# [docs:start PY_STREAM]
class Stream(torch.Stream):
    """A stream of an openreg device: an ordered queue of work.

    ``priority``: lower number = higher priority, as on CUDA; values outside
    ``Stream.priority_range()`` are clamped. On openreg the priority decides which stream's
    asynchronous copy gets the device's copy engine first (docs/streams.md).
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs):
        if kwargs.get("stream_id") is not None:
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=_device(device), priority=priority)

    @property
    def priority(self) -> int:
        return _C._stream_priority(self.stream_id)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """``(lowest, highest)`` priority, like ``torch.cuda.Stream.priority_range()``."""
        return tuple(_C._stream_priority_range())

    def wait_event(self, event: torch.Event) -> None:
        """Work issued on this stream from now on waits until ``event`` completes."""
        event.wait(self)

    def wait_stream(self, stream: torch.Stream) -> None:
        """Work issued on this stream from now on waits for the work issued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return (f"<torch.openreg.Stream device=openreg:{self.device_index} "
                f"stream_id={self.stream_id} priority={self.priority}>")
# [docs:end PY_STREAM]


class _EventType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "openreg"


# [docs:start PY_EVENT]
class Event(metaclass=_EventType):
    """An event of an openreg device; ``enable_timing=True`` for ``elapsed_time``.

    It constructs a plain ``torch.Event`` of the openreg device (``torch.Event.elapsed_time``
    accepts nothing else as its argument, so a subclass could not be timed against events made by
    ``torch.Stream.record_event`` or by ``torch.Event`` itself). Its device index is set by the
    first stream it is recorded on. ``isinstance(e, torch.openreg.Event)`` is true for every
    openreg event.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> torch.Event:
        return torch.Event(device="openreg", enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)
# [docs:end PY_EVENT]


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    """The calling thread's current stream of ``device`` (default: the current device)."""
    return _wrap(torch.accelerator.current_stream(_device(device)))


def default_stream(device: Any = None) -> Stream:
    """The default stream (id 0) of ``device``."""
    current = torch.accelerator.current_stream(_device(device))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def set_stream(stream: torch.Stream | None) -> None:
    """Makes ``stream`` the current stream of its device, and its device the current device."""
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes ``stream`` current on its device, and its device current, until exit (also on an
    exception); ``None`` does nothing."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self._prev_stream = None
        self._prev_device = None

    def __enter__(self):
        if self.stream is None:
            return self.stream
        from . import current_device

        self._prev_device = current_device()
        self._prev_stream = torch.accelerator.current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)  # also makes its device current
        return self.stream

    def __exit__(self, *exc_info):
        if self.stream is None:
            return False
        torch.accelerator.set_stream(self._prev_stream)
        _C._set_device(self._prev_device)
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    """``with torch.openreg.stream(s):`` runs the block with ``s`` as the current stream."""
    return StreamContext(stream)


# [docs:start PY_COPY_ENGINE]
class CopyEngineConfig(NamedTuple):
    latency_us: float
    bandwidth_gbps: float  # 0 = as fast as the host copies memory


def get_copy_engine_config() -> CopyEngineConfig:
    """Timing of the simulated copy engines used by ``non_blocking`` copies."""
    return CopyEngineConfig(*_C._get_copy_timing())


def set_copy_engine_config(latency_us: float | None = None,
                           bandwidth_gbps: float | None = None) -> CopyEngineConfig:
    """Sets the timing of asynchronous copies (``None`` keeps a value); returns the old one.

    Every ``non_blocking`` copy between pinned memory and a device takes
    ``latency_us + bytes / bandwidth`` and its data lands at the end: a large latency makes a
    missing synchronize show up reliably. Startup values: ``OPENREG_COPY_LATENCY_US`` (10) and
    ``OPENREG_COPY_BANDWIDTH_GBPS`` (0).
    """
    old = get_copy_engine_config()
    _C._set_copy_timing(old.latency_us if latency_us is None else float(latency_us),
                        old.bandwidth_gbps if bandwidth_gbps is None else float(bandwidth_gbps))
    return old
# [docs:end PY_COPY_ENGINE]


def _inject_async_error(stream: torch.Stream, message: str) -> None:
    """Testing aid: queues work on ``stream`` that fails with ``message``; the error surfaces at
    the next synchronize or query of the stream or its device, like an asynchronous device
    error."""
    _C._stream_inject_error(stream.device_index, stream.stream_id, message)


# Work still queued at exit runs before the interpreter tears down the objects it uses.
atexit.register(_C._drain_at_exit)
