"""Stream sanitizer: finds the missing synchronizations of a program on openreg.

Enable it with ``OPENREG_SANITIZE=1`` in the environment (at import) or with
``torch_openreg.sanitizer.enable()``. While it is on, every operator on openreg tensors is checked
against what the streams really guarantee: it records, for each device allocation, which stream
last wrote it and which streams read it since, and knows what each stream (and the host) has
waited for, through events, ``wait_stream``, synchronizations and ``record_stream``. An access
that is not ordered after a conflicting earlier one raises :class:`StreamSanitizerError`, naming
the allocation, the two streams, the two operators and both Python stack traces (docs/sanitizer.md).

It covers read-after-write and write-after-read (and write-after-write) across streams, memory
freed while another stream still used it and handed out again by the caching allocator (unless
``record_stream`` said so), a host access to pinned memory that an in-flight ``non_blocking`` copy
reads or writes, and reading the result of a ``non_blocking`` device-to-host copy before
synchronizing.

Two sources feed it:

* a ``TorchDispatchMode`` that sees every operator with its schema: arguments marked as written
  (``Tensor(a!)``) and fresh outputs are writes, other tensor arguments reads, views and
  ``*_like`` factories read nothing;
* the runtime's trace hooks (csrc/adapters/gpu_trace.h through ``c10::impl::GPUTrace``, delivered
  by torch to ``torch.openreg._gpu_trace``): device allocations and frees, event record and wait,
  event, stream and device synchronization. They cost nothing while the sanitizer is off.

The model of time is a vector clock per stream: each operator issued on a stream takes the next
sequence number; a stream's clock says, for every other stream, up to which number it has waited;
the host has one too. An earlier access is ordered before a new one when it is on the same stream
or when its number is within the new access's clock. Like CUDA's sanitizer (``torch.cuda.
_sanitizer``), it tracks whole allocations (two streams writing disjoint halves of one tensor
are reported) and sees the operators that reach the Python dispatcher.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _push_mode

from torch_openreg import _C
from torch_openreg.openreg import _gpu_trace

__all__ = ["enable", "disable", "enabled", "StreamSanitizerError", "UnsynchronizedAccess"]

aten = torch.ops.aten
HOST = -1  # the host, as a pseudo-stream: it issues work and waits for streams
_COPIES = frozenset({"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "copy"})
# Operators that look at a tensor's metadata only, although the schema lists a plain argument.
_METADATA = frozenset({"is_pinned", "is_same_size", "is_set_to", "sym_size", "sym_stride",
                       "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim",
                       "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense",
                       "record_stream"})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_FILES = (__file__, torch.utils._python_dispatch.__file__)


def stream_name(handle: int) -> str:
    if handle == HOST:
        return "the host"
    device, sid = handle >> 16, handle & 0xFFFF
    if sid == 0:
        return f"the default stream of openreg:{device}"
    return f"stream {sid} of openreg:{device}"


def _handle(stream: torch.Stream) -> int:
    return (stream.device_index << 16) | stream.stream_id


def _stack() -> traceback.StackSummary:
    frames = [
        (f, lineno)
        for f, lineno in traceback.walk_stack(sys._getframe(1))
        if f.f_code.co_filename not in _OWN_FILES
    ]
    # innermost first: drop torch's own frames (dispatch, dynamo wrappers, trace callbacks)
    while frames and frames[0][0].f_code.co_filename.startswith(_TORCH_DIR):
        frames.pop(0)
    summary = traceback.StackSummary.extract(reversed(frames), lookup_lines=False)
    return summary


def _format_stack(stack: traceback.StackSummary | None) -> str:
    if not stack:
        return "    (not recorded: the sanitizer was enabled later)\n"
    for frame in stack:
        frame.line  # noqa: B018 - load the source lines only when reporting
    return "".join("  " + line for line in stack.format())


@dataclass
class Access:
    """One access to an allocation by an operator issued on a stream (or by the host)."""

    write: bool
    stream: int
    seq: int
    operator: str
    arguments: list[str]
    stack: traceback.StackSummary
    allocation: "Allocation"

    def describe(self) -> str:
        what = "writing to" if self.write else "reading from"
        names = [a for a in self.arguments if a != "(result)"]
        args = f" (argument {', '.join(names)})" if names else " (its result)" if self.arguments else ""
        return f"{self.operator} on {stream_name(self.stream)}, {what} it{args}"


@dataclass(eq=False)
class Allocation:
    ptr: int
    device: int  # -1: pinned host memory
    size: int
    pool_stream: int | None  # the stream whose pool the caching allocator took the block from
    stack: traceback.StackSummary | None
    last_write: Access | None = None
    reads: list[Access] = field(default_factory=list)  # since the last write
    record_streams: set[int] = field(default_factory=set)
    inherited: list[Access] = field(default_factory=list)  # of freed blocks at the same place
    free_stack: traceback.StackSummary | None = None

    def describe(self) -> str:
        where = "pinned host memory" if self.device < 0 else f"openreg:{self.device}"
        return f"allocation 0x{self.ptr:x} ({self.size} bytes, {where})"


@dataclass
class UnsynchronizedAccess:
    """Two accesses to the same memory from different streams with no synchronization between."""

    allocation: Allocation
    current: Access
    previous: Access

    @property
    def use_after_free(self) -> bool:
        return self.previous.allocation is not self.current.allocation

    def __str__(self) -> str:
        cur, prev = self.current, self.previous
        lines = []
        if self.use_after_free:
            old = prev.allocation
            lines.append(
                f"openreg stream sanitizer: use after free: {self.allocation.describe()} reuses "
                f"the memory of {old.describe()}, which was freed while {stream_name(prev.stream)}"
                f" could still be using it (no record_stream, no synchronization).\n"
                f"{cur.describe()}\n"
                f"is not ordered after the freed tensor's last use, {prev.describe()}."
            )
        else:
            lines.append(
                f"openreg stream sanitizer: unsynchronized access to {self.allocation.describe()}"
                f"\n{cur.describe()}\nis not ordered after {prev.describe()}\n(no event, "
                f"wait_stream or synchronize orders {stream_name(cur.stream)} after "
                f"{stream_name(prev.stream)})."
            )
        lines.append(f"\nThe new access ({cur.operator}) was issued at:\n{_format_stack(cur.stack)}")
        lines.append(f"The earlier access ({prev.operator}) was issued at:\n"
                     f"{_format_stack(prev.stack)}")
        if self.use_after_free:
            old = prev.allocation
            lines.append(f"The freed tensor was allocated at:\n{_format_stack(old.stack)}")
            lines.append(f"and freed at:\n{_format_stack(old.free_stack)}")
        lines.append(f"The memory was allocated at:\n{_format_stack(self.allocation.stack)}")
        return "\n".join(lines)


class StreamSanitizerError(RuntimeError):
    """Raised by the operator whose access is not synchronized with an earlier one."""

    def __init__(self, errors: list[UnsynchronizedAccess]):
        self.errors = errors
        super().__init__("\n\n".join(str(e) for e in errors))


# [docs:start SANITIZER_CLOCKS]
class _Timeline:
    """Vector clocks: what each stream, each recorded event and the host have waited for."""

    def __init__(self) -> None:
        self.seq = 0
        self.clocks: dict[int, dict[int, int]] = {}  # stream -> {stream: last seq waited for}
        self.host: dict[int, int] = {}
        self.events: dict[int, dict[int, int]] = {}

    def view(self, stream: int) -> dict[int, int]:
        """The clock of `stream` as of now: it also follows everything the host waited for
        before issuing to it."""
        if stream == HOST:
            return self.host
        clock = self.clocks.setdefault(stream, {})
        _join(clock, self.host)
        return clock

    def issue(self, stream: int) -> int:
        self.seq += 1
        self.view(stream)[stream] = self.seq
        return self.seq

    def ordered(self, earlier: Access, stream: int) -> bool:
        if earlier.stream == stream:
            return True
        return earlier.seq <= self.view(stream).get(earlier.stream, 0)

    def record(self, event: int, stream: int) -> None:
        self.events[event] = dict(self.view(stream))

    def wait(self, event: int, stream: int) -> None:
        _join(self.view(stream), self.events.get(event, {}))

    def host_waits_event(self, event: int) -> None:
        _join(self.host, self.events.get(event, {}))

    def host_waits_stream(self, stream: int) -> None:
        _join(self.host, self.view(stream))
# [docs:end SANITIZER_CLOCKS]


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.time = _Timeline()
        self.live: dict[int, Allocation] = {}  # device block address -> allocation
        self.host: dict[int, Allocation] = {}  # pinned host memory used by async copies
        self.freed: list[Allocation] = []  # freed while another stream could still use them

    # ---------------------------------------------------------------- runtime hooks
    def on_alloc(self, ptr: int) -> None:
        with self.lock:
            if ptr in self.live:  # its free came from a stream worker (not reported)
                self.on_free(ptr, report=False)
            self.live[ptr] = self._new_allocation(ptr, _stack())

    def _new_allocation(self, ptr: int, stack) -> Allocation:
        info = _C._device_block_info(ptr)
        device, pool, size = info if info is not None else (-1, None, 0)
        pool_stream = (device << 16) | pool if pool is not None and pool < 0x10000 else None
        alloc = Allocation(ptr, device, size, pool_stream, stack)
        if self.freed:
            end = ptr + max(size, 1)
            keep = []
            for old in self.freed:
                if old.device == device and old.ptr < end and ptr < old.ptr + max(old.size, 1):
                    alloc.inherited.extend(old.inherited)
                else:
                    keep.append(old)
            self.freed = keep
        return alloc

    def on_free(self, ptr: int, report: bool = True) -> None:
        with self.lock:
            alloc = self.live.pop(ptr, None)
            if alloc is None:
                return
            # [docs:start SANITIZER_FREE]
            # The caching allocator hands the block out again on the stream it belongs to, at
            # once; after record_stream(s), only once the work issued on s so far has run.
            released = {s: self.time.view(s).get(s, 0) for s in alloc.record_streams}
            accesses = ([alloc.last_write] if alloc.last_write else []) + alloc.reads
            pending = [
                a for a in accesses
                if not (alloc.pool_stream is not None and self.time.ordered(a, alloc.pool_stream))
                and not a.seq <= released.get(a.stream, 0)
            ]
            # [docs:end SANITIZER_FREE]
            if pending:
                alloc.free_stack = _stack() if report else None
                alloc.inherited = pending
                alloc.last_write, alloc.reads = None, []
                self.freed.append(alloc)

    def on_event_record(self, event: int, stream: int) -> None:
        with self.lock:
            self.time.record(event, stream)

    def on_event_wait(self, event: int, stream: int) -> None:
        with self.lock:
            self.time.wait(event, stream)

    def on_event_sync(self, event: int) -> None:
        with self.lock:
            self.time.host_waits_event(event)

    def on_event_delete(self, event: int) -> None:
        with self.lock:
            self.time.events.pop(event, None)

    def on_stream_sync(self, stream: int) -> None:
        with self.lock:
            self.time.host_waits_stream(stream)

    # ---------------------------------------------------------------- operators
    def access(self, table: dict[int, Allocation], ptr: int, nbytes: int, device: int,
               write: bool, stream: int, seq: int, operator: str, names: list[str],
               stack, errors: list[UnsynchronizedAccess]) -> None:
        alloc = table.get(ptr)
        if alloc is None:
            if device < 0 and stream == HOST:
                return  # host memory no stream has touched
            if device >= 0:
                alloc = self._new_allocation(ptr, None)  # allocated before enable()
            else:
                alloc = Allocation(ptr, -1, nbytes, None, None)
            table[ptr] = alloc
        access = Access(write, stream, seq, operator, names, stack, alloc)
        time = self.time
        earlier: Iterable[Access]
        if write:
            earlier = alloc.reads if alloc.reads else ([alloc.last_write] if alloc.last_write else [])
        else:
            earlier = [alloc.last_write] if alloc.last_write else []
        for prev in earlier:
            if not time.ordered(prev, stream):
                errors.append(UnsynchronizedAccess(alloc, access, prev))
        if alloc.inherited:
            for prev in list(alloc.inherited):
                if (write or prev.write) and not time.ordered(prev, stream):
                    errors.append(UnsynchronizedAccess(alloc, access, prev))
                    alloc.inherited.remove(prev)
        if write:
            alloc.last_write, alloc.reads = access, []
        else:
            alloc.reads.append(access)


def _zip_arguments(schema, args, kwargs):
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for argument, value in zip(positional, args):
        yield argument, value
    for argument in schema.arguments:
        if argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if t.layout != torch.strided or t.device.type not in ("openreg", "cpu"):
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = s.data_ptr()
    return (ptr, s.nbytes()) if ptr else None


class _SanitizerMode(TorchDispatchMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _sanitizer.mode is not self:  # a thread started while it was on, after disable()
            return func(*args, **kwargs)
        state = self.state
        if func is aten.record_stream.default:  # not a kernel: tells the allocator
            storage = _storage(args[0])
            if storage is not None and args[0].device.type == "openreg":
                with state.lock:
                    alloc = state.live.get(storage[0])
                    if alloc is not None:
                        alloc.record_streams.add(_handle(args[1]))
            return func(*args, **kwargs)

        # [docs:start SANITIZER_MODE]
        schema = func._schema
        # What the operator reads and writes, from its schema.
        base = schema.name.split("::")[-1]
        metadata_only = base.endswith("_like") or base.startswith("new_") or base in _METADATA
        accesses: list[tuple[torch.Tensor, bool, str]] = []
        for argument, value in _zip_arguments(schema, args, kwargs):
            alias = argument.alias_info
            write = alias is not None and alias.is_write
            if not write and (metadata_only or alias is not None):
                continue
            for t in _tensors(value):
                accesses.append((t, write, argument.name))
        # [docs:end SANITIZER_MODE]
        name = func.name().split("::")[-1]
        copy = name.split(".")[0] in _COPIES
        non_blocking = bool(kwargs.get("non_blocking", args[2] if copy and len(args) > 2
                                       and isinstance(args[2], bool) else False))
        outputs = func(*args, **kwargs)

        fresh: list[torch.Tensor] = []
        for ret, value in zip(schema.returns, outputs if isinstance(outputs, tuple) else (outputs,)):
            if ret.alias_info is None:  # a new tensor (written arguments are seen as arguments)
                fresh.extend(_tensors(value))
        devices = [t.device.index for t, _, _ in accesses if t.device.type == "openreg"]
        devices += [t.device.index for t in fresh if t.device.type == "openreg"]
        if not devices:
            if not state.host:  # host work while no stream touches host memory
                return outputs
            touched = [_storage(t) for t, _, _ in accesses]
            if not any(p is not None and p[0] in state.host for p in touched):
                with state.lock:  # fresh host memory at an address an async copy used
                    for t in fresh:
                        p = _storage(t)
                        if p is not None:
                            state.host.pop(p[0], None)
                return outputs

        returned_to_host = devices and not any(t.device.type == "openreg" for t in fresh) \
            and not any(w for _, w, _ in accesses) and not isinstance(outputs, torch.Tensor)

        with state.lock:
            time = state.time
            stack = _stack()
            errors: list[UnsynchronizedAccess] = []
            written = [t for t, w, _ in accesses if w and t.device.type == "openreg"]
            target = (written or fresh or [t for t, _, _ in accesses if t.device.type == "openreg"])
            target_devices = [t.device.index for t in target if t.device.type == "openreg"]
            stream = HOST
            others: list[int] = []
            if devices:
                device = target_devices[0] if target_devices else devices[0]
                stream = _handle(torch.accelerator.current_stream(device))
                # a copy between devices is ordered after the source device's current stream,
                # and that stream after the copy (as CUDA synchronizes both streams)
                others = [_handle(torch.accelerator.current_stream(d))
                          for d in set(devices) - {device}] if copy else []
                for other in others:
                    time.host_waits_stream(other)
            seq = time.issue(stream)
            host_seq = None
            host_waits = False
            for t, write, arg in [*accesses, *[(t, True, "(result)") for t in fresh]]:
                storage = _storage(t)
                if storage is None:
                    continue
                ptr, nbytes = storage
                if t.device.type == "openreg":
                    state.access(state.live, ptr, nbytes, t.device.index, write, stream, seq,
                                 func.name(), [arg], stack, errors)
                    continue
                if arg == "(result)":
                    state.host.pop(ptr, None)  # new host memory: no history
                if stream != HOST and copy:
                    # the copy runs on the stream (its copy engine, later, if asynchronous)
                    if not (non_blocking and t.is_pinned()):
                        host_waits = True  # a blocking copy: the host waits for it to end
                    state.access(state.host, ptr, nbytes, -1, write, stream, seq, func.name(),
                                 [arg], stack, errors)
                elif arg != "(result)":
                    if host_seq is None:
                        host_seq = seq if stream == HOST else time.issue(HOST)
                    state.access(state.host, ptr, nbytes, -1, write, HOST, host_seq,
                                 func.name(), [arg], stack, errors)
            for other in others:
                _join(time.view(other), time.view(stream))
            if stream != HOST and (host_waits or returned_to_host):
                time.host_waits_stream(stream)  # a blocking copy, item(): the host waited
        if errors:
            raise StreamSanitizerError(errors)
        return outputs


class _Sanitizer:
    def __init__(self) -> None:
        self.state: _State | None = None
        self.mode: _SanitizerMode | None = None

    def enable(self) -> None:
        if self.mode is not None:
            return
        state = _State()
        torch._C._activate_gpu_trace()
        hooks = {
            _gpu_trace.MemoryAllocationCallbacks: state.on_alloc,
            _gpu_trace.MemoryDeallocationCallbacks: state.on_free,
            _gpu_trace.EventRecordCallbacks: state.on_event_record,
            _gpu_trace.EventWaitCallbacks: state.on_event_wait,
            _gpu_trace.EventSynchronizationCallbacks: state.on_event_sync,
            _gpu_trace.EventDeletionCallbacks: state.on_event_delete,
            _gpu_trace.StreamSynchronizationCallbacks: state.on_stream_sync,
        }
        for registry, callback in hooks.items():
            registry.add_callback(callback)
        _C._set_gpu_trace(True)
        self.state, self.mode = state, _SanitizerMode(state)
        self.mode.__enter__()
        self._follow_new_threads()

    # [docs:start SANITIZER_THREADS]
    def _follow_new_threads(self) -> None:
        """Host threads the program starts from now on get the mode too (a dispatch mode is per
        thread): their operators are the host's, on the one host timeline, so a thread reading
        the result of another thread's non_blocking copy to the host before anyone synchronized
        is reported as a host read of memory the stream writes."""
        mode, previous = self.mode, threading.getprofile()

        def start(frame, event, arg):  # runs once, at the new thread's first call
            sys.setprofile(previous)
            if _sanitizer.mode is mode:
                _push_mode(mode)
            return previous(frame, event, arg) if previous is not None else None

        self._previous_profile = previous
        threading.setprofile(start)
    # [docs:end SANITIZER_THREADS]

    def disable(self) -> None:
        if self.mode is None:
            return
        _C._set_gpu_trace(False)
        threading.setprofile(getattr(self, "_previous_profile", None))
        for registry in _gpu_trace.ALL:
            registry.callback_list.clear()
        mode, self.mode, self.state = self.mode, None, None
        mode.__exit__(None, None, None)


_sanitizer = _Sanitizer()


def enable() -> None:
    """Turns the sanitizer on for the rest of the program (on this thread, the autograd threads
    its backward passes use and the threads started from now on). Enable it before the work to
    check: memory allocated before has no allocation trace."""
    _sanitizer.enable()


def disable() -> None:
    """Turns it off (it must be the innermost dispatch mode, as after enable())."""
    _sanitizer.disable()


def enabled() -> bool:
    return _sanitizer.mode is not None


def _enable_from_environment() -> None:
    if os.environ.get("OPENREG_SANITIZE", "") not in ("", "0"):
        enable()
