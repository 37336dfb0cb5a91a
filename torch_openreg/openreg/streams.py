"""Streams and events of ``torch.openreg``.

An openreg stream is a ``torch.Stream`` of the openreg device: the native runtime gives each one
a queue executed by its own worker thread (csrc/runtime/stream.cpp), reached through the
DeviceGuard (csrc/adapters/device_guard.cpp). Nothing here re-implements that logic.
"""

from __future__ import annotations

from typing import Any

import torch


def _device(device: Any) -> torch.device:
    from . import _device_index

    return torch.device("openreg", _device_index(device))


class Stream(torch.Stream):
    """A stream of an openreg device. ``priority`` < 0 takes a high-priority stream."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs):
        if kwargs.get("stream_id") is not None:
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=_device(device), priority=priority)

    def wait_event(self, event: torch.Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: torch.Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        if event is None:
            event = Event()
        event.record(self)
        return event


class Event(torch.Event):
    """An event of an openreg device (``enable_timing=True`` for ``elapsed_time``)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(
            cls, device=torch.device("openreg"), enable_timing=enable_timing,
            blocking=blocking, interprocess=interprocess,
        )


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_device(device)))


def default_stream(device: Any = None) -> Stream:
    current = torch.accelerator.current_stream(_device(device))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def set_stream(stream: torch.Stream) -> None:
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes ``stream`` current on its device, and its device current, until exit."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self._prev_stream = None
        self._prev_device = None

    def __enter__(self):
        if self.stream is None:
            return self
        from . import current_device, set_device

        self._prev_device = current_device()
        self._prev_stream = torch.accelerator.current_stream(self.stream.device)
        if self.stream.device_index != self._prev_device:
            set_device(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)
        return self

    def __exit__(self, *exc_info):
        if self.stream is None:
            return False
        from . import set_device

        torch.accelerator.set_stream(self._prev_stream)
        set_device(self._prev_device)
        return False


def stream(stream: torch.Stream | None) -> StreamContext:
    return StreamContext(stream)
