"""The asynchronous kernel mode of openreg (docs/async_mode.md).

By default an openreg kernel runs on the thread that calls the operator, in stream order, so a
program that forgets a synchronization still reads the right values. In the asynchronous mode
the operators served by the generic fallback return their device tensors at once and their CPU
kernels run later on the stream's worker thread, as GPU kernels do: results must be waited for
(``.item()``, ``.cpu()``, printing, ``synchronize``, events, ``wait_stream`` do), work on
different streams runs concurrently, and a missing synchronization shows.

Switch it on for the whole process with ``OPENREG_ASYNC=1`` (read at import), or::

    torch.openreg.set_async(True)           # from now on
    with torch.openreg.set_async(True):     # for a block, then back to the previous mode
        ...

The mode is process-wide, like ``CUDA_LAUNCH_BLOCKING``: backward runs on the device's autograd
thread, which must queue its kernels as the thread that called ``backward()`` does.
"""

from __future__ import annotations

import os

from torch_openreg import _C

__all__ = ["set_async", "is_async", "counts"]


# [docs:start SET_ASYNC]
class set_async:
    """Turns the asynchronous kernel mode on or off for the process.

    Takes effect at once. Used as a context manager, it restores the previous mode when the
    block ends (like ``torch.set_grad_enabled``). Switching does not wait for queued kernels:
    operators issued later on a stream still run after them (stream order).
    """

    def __init__(self, mode: bool) -> None:
        if not isinstance(mode, bool):
            raise TypeError(f"set_async expects a bool, got {type(mode).__name__}")
        self._previous = _C._is_async()
        _C._set_async(mode)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _C._set_async(self._previous)


def is_async() -> bool:
    """Whether operators are queued on their stream (the asynchronous kernel mode is on)."""
    return _C._is_async()
# [docs:end SET_ASYNC]


def counts() -> dict[str, int]:
    """How many operators the mode has queued, and how many it ran synchronously because they
    cannot be queued (data-dependent shapes, random numbers, no meta kernel, ...), since the
    process started. Operators with their own openreg kernel (copies, views, convolution) are
    not counted: they always run synchronously, in stream order."""
    queued, synchronous = _C._async_counts()
    return {"queued": queued, "synchronous": synchronous}


def _enable_from_environment() -> None:
    value = os.environ.get("OPENREG_ASYNC", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"OPENREG_ASYNC must be 0 or 1, got {value!r}")
    if value == "1":
        _C._set_async(True)
