"""Fault injection: accelerator failures on demand, deterministic and scoped
(docs/fault_injection.md).

Recovery code for out-of-memory errors and for asynchronous kernel failures rarely runs in a CI
without accelerators. openreg's runtime owns the allocator and the kernels' launch, so it can
make them fail where a test says::

    with torch.openreg.faults.oom(min_bytes=2**30):       # the first allocation of >= 1 GiB
        ...                                              # raises torch.OutOfMemoryError
    with torch.openreg.faults.kernel_error(op="aten::mm", device=0):
        y = a @ b                                        # returns; the device is now faulted
    torch.openreg.synchronize(0)                         # raises, naming aten::mm
    torch.openreg.faults.reset_device(0)

or for a whole process, ``OPENREG_FAULTS="oom:nth=3,device=0;kernel_error:op=mm"`` (read at
import). Faults that are not armed cost one never-taken branch where they would fire.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_openreg import _C

__all__ = [
    "oom", "kernel_error", "device_lost", "reset_device", "device_error", "collective_hang",
    "rank_exit",
]

_ENV = "OPENREG_FAULTS"


def _device(device: Any, any_ok: bool = True) -> int:
    if device is None:
        return -1 if any_ok else _C._current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "openreg":
        raise ValueError(f"expected an openreg device, got {device}")
    return device.index if device.index is not None else _C._current_device()


# [docs:start OOM_FAULT]
class _Fault:
    """A fault's context-manager form: armed on entry, disarmed on exit (each fault class has its
    own arm and disarm)."""

    def __enter__(self):
        return self.arm()

    def __exit__(self, *exc: object) -> None:
        self.disarm()


class oom(_Fault):
    """Among the allocations on ``device`` (None: any openreg device) of at least ``min_bytes``,
    the ``nth`` one from now raises ``torch.OutOfMemoryError``, then the next ``times - 1``
    matching ones too (``times=None``: all of them, as a smaller device would).

    The error takes the path of a real one: the caching allocator frees its cache and retries
    first, ``memory_stats()`` counts ``num_alloc_retries`` and ``num_ooms``, and the message is
    the allocator's own. Armed when the ``with`` block starts (or by ``arm()``), disarmed when it
    ends; ``fired`` tells how many errors it raised."""

    def __init__(self, nth: int = 1, min_bytes: int = 0, times: int | None = 1,
                 device: Any = None) -> None:
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times}")
        self.nth, self.min_bytes, self.times = int(nth), int(min_bytes), times
        self.device = _device(device)
        self.fired = 0

    def arm(self) -> "oom":
        _C._arm_oom(self.device, self.nth, self.min_bytes, -1 if self.times is None else self.times)
        return self

    def disarm(self) -> None:
        self.fired = _C._oom_fired()
        _C._disarm_oom()
# [docs:end OOM_FAULT]


# [docs:start KERNEL_ERROR_FAULT]
class kernel_error(_Fault):
    """The ``nth`` kernel launched from now on ``device`` (None: any openreg device) and
    ``stream`` (None: any of its streams) whose operator is ``op`` (None: any kernel; "mm" and
    "aten::mm" both name ``torch.mm``, and a kernel run inside a composite operator matches
    the composite's name too) fails after its launch, as a GPU kernel that makes an illegal
    memory access (``kind="illegal_address"``) or trips a device-side assert
    (``kind="assert"``).

    The launch returns normally. The next synchronizing call on that device (``synchronize``,
    ``Stream.synchronize``/``query``, ``Event.synchronize``/``query``, ``.item()``, a blocking
    ``.cpu()``) raises ``torch.AcceleratorError`` naming the kernel, and so does every later one
    on that device until ``reset_device``: the error is sticky, as on CUDA. Other devices keep
    working. The results of the failed kernel, and of what ran after it on the device, are not
    to be trusted (on openreg they are computed normally)."""

    def __init__(self, op: str | None = None, nth: int = 1, stream: Any = None,
                 device: Any = None, kind: str = "illegal_address") -> None:
        self.op, self.nth, self.kind = op or "", int(nth), kind
        self.device = _device(device)
        if isinstance(stream, torch.Stream):
            if self.device < 0:
                self.device = stream.device_index
            stream = stream.stream_id
        self.stream = -1 if stream is None else int(stream)

    def arm(self) -> "kernel_error":
        _C._arm_kernel_fault(self.device, self.stream, self.op, self.nth, self.kind)
        return self

    def disarm(self) -> None:
        _C._disarm_kernel_fault()
# [docs:end KERNEL_ERROR_FAULT]


# [docs:start COLLECTIVE_FAULTS]
class collective_hang(_Fault):
    """This process's ``nth`` occl collective from now never completes: the rank is stuck, as
    a rank in a deadlock or a hung data loader. Its peers get the process group's timeout error
    (gloo's "Timed out waiting ..."), within the timeout given to ``init_process_group``; the
    stuck rank stays stuck until its launcher (torchrun, ``multiprocessing.spawn``) ends it, as
    on a real cluster. Arm it in the rank that should hang (``OPENREG_FAULTS`` in that rank's
    environment, or ``if rank == 1: faults.collective_hang().arm()``)."""

    kind = "hang"

    def __init__(self, nth: int = 1) -> None:
        self.nth = int(nth)
        self.code = 0

    def arm(self):
        _C._arm_collective_fault(self.kind, self.nth, self.code)
        return self

    def disarm(self) -> None:
        _C._disarm_collective_fault()


class rank_exit(collective_hang):
    """This process ends, with exit code ``code`` and no cleanup, at its ``nth`` occl collective
    from now, as a rank that crashes or is killed: its peers' collective fails (the connection
    to it closes) or times out."""

    kind = "exit"

    def __init__(self, nth: int = 1, code: int = 1) -> None:
        super().__init__(nth)
        self.code = int(code)
# [docs:end COLLECTIVE_FAULTS]


def device_lost(device: Any = None) -> None:
    """Makes ``device`` (default: the current device) disappear, as a GPU that falls off the
    bus: from now on every allocation, kernel launch and synchronizing call on it raises
    ``torch.AcceleratorError`` naming the device, until ``reset_device``. Other devices keep
    working, and ``device_count()`` does not change (it does not on CUDA either)."""
    _C._lose_device(_device(device, any_ok=False))


def reset_device(device: Any = None) -> None:
    """Clears the sticky error of ``device`` (default: the current device), or brings a lost
    device back, as a process that recreates its CUDA context would; its memory and tensors
    stay as they were."""
    _C._reset_device_fault(_device(device, any_ok=False))


def device_error(device: Any = None) -> str | None:
    """The sticky error of ``device`` (default: the current device), or None."""
    return _C._device_fault(_device(device, any_ok=False)) or None


# [docs:start FAULTS_ENV]
def _parse_environment(text: str) -> list:
    """``OPENREG_FAULTS``: faults separated by ";", each ``kind:key=value,key=value`` with the
    arguments of ``oom``, ``kernel_error``, ``collective_hang`` or ``rank_exit``
    ("oom:min_bytes=1e9,times=none;kernel_error:op=mm"). ``rank=R`` keeps a fault for the process
    whose ``RANK`` environment variable (set by torchrun) is R: every rank of a job shares one
    environment ("collective_hang:nth=3,rank=1")."""
    faults: list = []
    for spec in (s.strip() for s in text.split(";")):
        if not spec:
            continue
        kind, _, args = spec.partition(":")
        factory = {"oom": oom, "kernel_error": kernel_error, "collective_hang": collective_hang,
                   "rank_exit": rank_exit}.get(kind.strip())
        if factory is None:
            raise ValueError(f"{_ENV}: unknown fault {kind!r} in {spec!r} (oom, kernel_error, "
                             "collective_hang or rank_exit)")
        kwargs: dict[str, Any] = {}
        rank = None
        for item in (a.strip() for a in args.split(",")):
            if not item:
                continue
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"{_ENV}: expected key=value, got {item!r} in {spec!r}")
            key = key.strip()
            value = value.strip()
            if key == "rank":  # only in the process of that rank (RANK, set by torchrun)
                rank = int(value)
            elif key in ("op", "kind"):
                kwargs[key] = value
            elif key == "device":
                kwargs[key] = value if ":" in value else int(value)
            elif key == "times" and value.lower() == "none":
                kwargs[key] = None
            else:
                kwargs[key] = int(float(value))
        try:
            fault = factory(**kwargs)
        except TypeError as e:
            raise ValueError(f"{_ENV}: {e} in {spec!r}") from None
        if rank is None or os.environ.get("RANK") == str(rank):
            faults.append(fault)
    return faults


def _enable_from_environment() -> None:
    for fault in _parse_environment(os.environ.get(_ENV, "")):
        fault.arm()  # for the whole process
# [docs:end FAULTS_ENV]
