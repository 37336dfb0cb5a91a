"""Testing helpers for code that runs on openreg.

``hold_stream`` makes an asynchronous window deterministic: while the block runs, nothing queued
on the stream after its start executes, so a test can show that a result read without
synchronizing is not there yet, whatever the machine load. (A simulated copy latency, see
``torch.openreg.set_copy_engine_config``, shows the same bugs with realistic timing, but a test
that relies on it depends on the host thread being scheduled within that latency.)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from torch_openreg import _C

__all__ = ["hold_stream"]


# [docs:start HOLD_STREAM]
@contextlib.contextmanager
def hold_stream(stream: torch.Stream | None = None, timeout: float = 10.0) -> Iterator[torch.Stream]:
    """Holds back the work queued on ``stream`` (default: the current stream of the current
    openreg device) from the start of the block until its end::

        with hold_stream():
            host.copy_(x, non_blocking=True)
            assert not torch.equal(host, x.cpu())   # the copy cannot have landed
        torch.openreg.synchronize()                  # now it has

    Inside the block, do not wait for the held stream (``synchronize``, a blocking copy or a
    kernel on it): that would wait for the end of the block. The hold opens by itself after
    ``timeout`` seconds so that such a mistake cannot hang; leaving the block then raises
    ``RuntimeError``.
    """
    if stream is None:
        stream = torch.openreg.current_stream()
    if stream.device.type != "openreg":
        raise ValueError(f"hold_stream expects an openreg stream, got one of {stream.device.type!r}")
    hold = _C._stream_hold(stream.device_index, stream.stream_id, float(timeout))
    expired = False
    try:
        yield stream
    finally:
        expired = not _C._stream_release(hold)
    if expired:
        raise RuntimeError(
            f"hold_stream: the hold of {stream} opened by itself after {timeout} s: the block "
            "waited for the held stream (synchronize, a blocking copy or a kernel on it)"
        )
# [docs:end HOLD_STREAM]
