"""One check per integration point PyTorch offers a PrivateUse1 backend.

A check is a function of a ``Context`` that returns a short note on success and raises
``CheckFailed`` (with the reason and the names of the missing pieces) when the backend does not do
what PyTorch expects. Any other exception is a failure too; the runner reports it with its type.
Only torch's public entry points are used, never the backend's internals.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class CheckFailed(Exception):
    """The backend misses a piece of the contract: ``reason``, and ``missing`` names the pieces."""

    def __init__(self, reason: str, missing: list[str] | None = None):
        self.missing = list(missing or [])
        if self.missing:
            reason = f"{reason}: {', '.join(self.missing)}"
        super().__init__(reason)


@dataclass
class Context:
    """What every check needs: the device type name and its device module."""

    device: str
    module: Any = None
    count: int = 0
    imports: tuple[str, ...] = ()  # modules that register the backend (for subprocess checks)

    @classmethod
    def for_device(cls, device: str | None = None, imports: tuple[str, ...] = ()) -> "Context":
        device = device or torch._C._get_privateuse1_backend_name()
        module = getattr(torch, device, None)
        count = 0
        if module is not None and callable(getattr(module, "device_count", None)):
            try:
                count = int(module.device_count())
            except Exception:
                count = 0
        return cls(device, module, count, tuple(imports))

    def dev(self, index: int = 0) -> torch.device:
        return torch.device(self.device, index)

    def need_module(self) -> Any:
        if self.module is None:
            raise CheckFailed(f"no device module: torch.{self.device} is not registered "
                              f"(torch._register_device_module)", [f"torch.{self.device}"])
        return self.module

    def need_functions(self, *names: str) -> Any:
        module = self.need_module()
        missing = [n for n in names if not callable(getattr(module, n, None))]
        if missing:
            raise CheckFailed(f"torch.{self.device} lacks", missing)
        return module


@dataclass
class Check:
    name: str
    mechanism: str
    required: bool
    guide: str  # page of docs/ that explains the mechanism
    fix: str
    func: Callable[[Context], str | None] = field(repr=False)
    # Run on the calling thread, without the time limit, the checks whose mechanism keeps state
    # per thread from its first use: torch.compile's configuration is per thread in torch 2.13 (what
    # a backend configures while Inductor is first imported stays in the importing thread), and
    # Kineto wants its first profiling session on the thread that registered its client.
    main_thread: bool = False
    # The least time the check gets, whatever --timeout says: starting processes takes its time.
    min_timeout: float = 0.0


CHECKS: list[Check] = []


def check(name: str, mechanism: str, *, required: bool, guide: str, fix: str,
          main_thread: bool = False, min_timeout: float = 0.0):
    def register(func: Callable[[Context], str | None]):
        CHECKS.append(Check(name, mechanism, required, guide, fix, func, main_thread, min_timeout))
        return func
    return register


def expect(condition: bool, reason: str, missing: list[str] | None = None) -> None:
    if not condition:
        raise CheckFailed(reason, missing)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    expect(a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, equal_nan=True),
           f"{what}: got {a.flatten()[:4].tolist()} ({a.dtype}, {tuple(a.shape)}), expected "
           f"{b.flatten()[:4].tolist()} ({b.dtype}, {tuple(b.shape)})")


def in_thread(fn: Callable[[], Any]) -> Any:
    out: dict[str, Any] = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            out["error"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    expect(not t.is_alive(), "a call in a second thread did not return within 30 s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --- device module --------------------------------------------------------------------------------

DEVICE_FUNCTIONS = ("is_available", "device_count", "current_device", "set_device", "synchronize",
                    "device", "is_initialized", "get_device_name")


@check("device_module", "device module (torch.<name>): device functions and their types",
       required=True, guide="device.md",
       fix="register a module with torch._register_device_module(name, module) that defines "
           "is_available, device_count, current_device, set_device, device, synchronize, "
           "is_initialized, get_device_name")
def check_device_module(ctx: Context) -> str:
    m = ctx.need_functions(*DEVICE_FUNCTIONS)
    expect(isinstance(m.is_available(), bool) and m.is_available(), "is_available() is not True")
    n = m.device_count()
    expect(isinstance(n, int) and n >= 1, f"device_count() returned {n!r}, expected an int >= 1")
    cur = m.current_device()
    expect(isinstance(cur, int) and 0 <= cur < n, f"current_device() returned {cur!r}")
    last = n - 1
    with m.device(last):
        expect(m.current_device() == last, "device(i) does not make i the current device")
        expect(torch.empty(1, device=ctx.device).device == ctx.dev(last),
               "a tensor made under device(i) is not on device i (DeviceGuard getDevice)")
    expect(m.current_device() == cur, "device(i) does not restore the previous device on exit")
    try:
        torch.empty(1, device=ctx.dev(n + 7))
    except (RuntimeError, AssertionError, ValueError, IndexError):
        pass
    else:
        raise CheckFailed(f"{ctx.device}:{n + 7} was accepted with {n} device(s): "
                          "out-of-range device indices must raise")
    m.synchronize()
    return f"{n} device(s), {m.get_device_name(0)!r}"


# --- torch.accelerator ----------------------------------------------------------------------------

@check("accelerator", "torch.accelerator device-agnostic API", required=True, guide="accelerator.md",
       fix="implement the PrivateUse1 hooks (isAvailable, deviceCount) and a "
           "DeviceGuardImplInterface (device, stream and synchronize entry points) in C++, and "
           "make the device module's device_count() return the same count")
def check_accelerator(ctx: Context) -> str:
    acc = torch.accelerator
    expect(acc.is_available(), "torch.accelerator.is_available() is False")
    cur = acc.current_accelerator()
    expect(cur is not None and cur.type == ctx.device,
           f"current_accelerator() is {cur}, expected {ctx.device}")
    n = acc.device_count()
    expect(isinstance(n, int) and n >= 1, f"torch.accelerator.device_count() is {n!r}")
    # torch.accelerator asks the device module for the count (torch 2.15), the C++ side decides
    # which devices exist: both must agree.
    torch.empty(1, device=ctx.dev(n - 1))
    try:
        torch.empty(1, device=ctx.dev(n))
    except (RuntimeError, AssertionError, ValueError, IndexError):
        pass
    else:
        raise CheckFailed(f"torch.accelerator.device_count() is {n}, but {ctx.dev(n)} accepts "
                          f"tensors: torch.{ctx.device}.device_count() and the hooks' deviceCount "
                          "disagree", ["device_count"])
    before = acc.current_device_index()
    acc.set_device_index(n - 1)
    try:
        expect(acc.current_device_index() == n - 1, "set_device_index() is not seen by current_device_index()")
    finally:
        acc.set_device_index(before)
    s = acc.current_stream()
    expect(isinstance(s, torch.Stream) and s.device.type == ctx.device,
           f"current_stream() returned {s!r}")
    acc.synchronize()
    with acc.device_index(n - 1):
        expect(acc.current_device_index() == n - 1, "torch.accelerator.device_index(i) does not switch")
    return f"{n} device(s)"


# --- DeviceGuard ----------------------------------------------------------------------------------

@check("device_guard", "DeviceGuard: current device and current stream are per thread",
       required=True, guide="accelerator.md",
       fix="implement c10::impl::DeviceGuardImplInterface (getDevice/setDevice/exchangeDevice "
           "with a thread-local current device, getStream/exchangeStream with a thread-local "
           "current stream, getNewStream for "
           "torch.Stream(device=...)) and register it with "
           "C10_REGISTER_GUARD_IMPL(PrivateUse1, ...)")
def check_device_guard(ctx: Context) -> str:
    acc = torch.accelerator
    n = acc.device_count()
    main_stream = acc.current_stream()
    side = torch.Stream(device=ctx.dev(acc.current_device_index()))
    notes = []
    if n >= 2:
        acc.set_device_index(0)

        def other():
            acc.set_device_index(1)
            return acc.current_device_index()
        expect(in_thread(other) == 1, "set_device_index in a thread did not take effect there")
        expect(acc.current_device_index() == 0,
               "set_device_index in another thread changed this thread's current device")
        notes.append("device per thread")
    else:
        notes.append("one device: device per thread not checked")
    acc.set_stream(side)
    try:
        expect(acc.current_stream() == side, "set_stream() is not seen by current_stream()")
        seen = in_thread(lambda: acc.current_stream())
        expect(seen != side, "a stream set in one thread is current in another thread")
    finally:
        acc.set_stream(main_stream)
    expect(acc.current_stream() == main_stream, "set_stream() back to the previous stream failed")
    with side:
        expect(acc.current_stream() == side, "`with stream:` does not make it current")
    notes.append("stream per thread")
    return ", ".join(notes)


# --- streams and events ---------------------------------------------------------------------------

STREAM_FUNCTIONS = ("Stream", "Event", "current_stream", "default_stream", "set_stream", "stream")


@check("streams_events", "streams and events: ordering, query, timing", required=True,
       guide="streams.md",
       fix="implement the stream/event entry points of DeviceGuardImplInterface (getNewStream, "
           "record, block, queryEvent, elapsedTime, synchronizeEvent/Stream) and expose Stream, "
           "Event, current_stream, default_stream, set_stream, stream in the device module")
def check_streams_events(ctx: Context) -> str:
    m = ctx.need_functions(*STREAM_FUNCTIONS)
    dev = ctx.dev(0)
    s1, s2 = torch.Stream(device=dev), torch.Stream(device=dev)
    expect(s1 != s2, "torch.Stream(device=...) returned the same stream twice")
    expect(isinstance(m.current_stream(), torch.Stream), f"torch.{ctx.device}.current_stream() "
           "is not a torch.Stream")
    x = torch.randn(256, 256, device=dev)
    ref = x.cpu()
    host = torch.full((1 << 22,), 3.0)  # 16 MiB: an asynchronous copy that takes a while
    try:
        host = host.pin_memory()
    except Exception:
        pass  # pinned memory is checked on its own; a pageable copy still has to be ordered
    landing = torch.zeros(1 << 22, device=dev)
    torch.accelerator.synchronize()
    with s1:
        landing.copy_(host, non_blocking=True)
        y = x
        for _ in range(8):
            y = torch.tanh(y @ y) * 0.5
        done = torch.Event(device=dev)
    done.record(s1)
    s2.wait_event(done)
    with s2:
        z = y + 1
        doubled = landing * 2
    s2.synchronize()
    expect(s2.query() and done.query(), "query() is False after synchronize()")
    r = ref
    for _ in range(8):
        r = torch.tanh(r @ r) * 0.5
    same(z, r + 1, "work on stream 2 after wait_event(stream 1's event) saw stale data")
    expect(bool((doubled == 6).all()), "stream 2 read a non_blocking copy of stream 1 before it "
           "landed, despite wait_event")
    with m.stream(s1):
        expect(m.current_stream() == s1, f"torch.{ctx.device}.stream(s) does not make s current")
    s1.wait_stream(s2)
    s1.synchronize()
    a = torch.Event(device=dev, enable_timing=True)
    b = torch.Event(device=dev, enable_timing=True)
    a.record(s1)
    with s1:
        w = x @ x
    b.record(s1)
    b.synchronize()
    ms = a.elapsed_time(b)
    expect(isinstance(ms, float) and ms >= 0, f"elapsed_time returned {ms!r}")
    del w
    return f"ordering, query, timing ({ms:.3f} ms)"


# --- device allocator -----------------------------------------------------------------------------

MEMORY_FUNCTIONS = ("memory_allocated", "max_memory_allocated", "memory_reserved",
                    "max_memory_reserved", "memory_stats", "reset_peak_memory_stats", "empty_cache")


@check("allocator", "device allocator statistics and empty_cache", required=True,
       guide="device_allocator.md",
       fix="derive the allocator from c10::DeviceAllocator (getDeviceStats, resetPeakStats, "
           "emptyCache), register it with c10::SetAllocator(c10::DeviceType::PrivateUse1, ...) "
           "and expose memory_allocated ... empty_cache in the device module")
def check_allocator(ctx: Context) -> str:
    m = ctx.need_functions(*MEMORY_FUNCTIONS)
    dev = ctx.dev(0)
    torch.accelerator.synchronize()
    m.empty_cache()
    base = m.memory_allocated(dev)
    expect(isinstance(base, int), f"memory_allocated() returned {base!r}")
    m.reset_peak_memory_stats(dev)
    size = 16 << 20  # large enough for a segment of its own in a CUDA-like caching allocator
    t = torch.empty(size, dtype=torch.uint8, device=dev)
    grown = m.memory_allocated(dev)
    expect(grown >= base + size, f"memory_allocated grew by {grown - base} bytes for a 16 MiB tensor")
    live_reserved = m.memory_reserved(dev)
    expect(m.max_memory_allocated(dev) >= grown, "max_memory_allocated is below memory_allocated")
    expect(m.memory_reserved(dev) >= grown, "memory_reserved is below memory_allocated")
    acc_alloc = torch.accelerator.memory_allocated(dev)
    expect(acc_alloc == grown, f"torch.accelerator.memory_allocated {acc_alloc} != {grown}")
    stats = m.memory_stats(dev)
    expect(stats.get("allocated_bytes.all.current") == grown,
           "memory_stats()['allocated_bytes.all.current'] does not match memory_allocated()")
    del t
    torch.accelerator.synchronize()
    expect(m.memory_allocated(dev) == base, "memory_allocated did not return to its value after del")
    expect(m.max_memory_allocated(dev) >= grown, "max_memory_allocated forgot the peak")
    m.empty_cache()
    reserved = m.memory_reserved(dev)
    expect(reserved <= live_reserved - size, f"empty_cache() did not release the freed 16 MiB "
           f"(memory_reserved {live_reserved} before del, {reserved} after empty_cache)")
    return f"+{grown - base} bytes for 16 MiB, released by empty_cache"


# [docs:start CHECK_OUT_OF_MEMORY]
@check("out_of_memory", "out of memory raises torch.OutOfMemoryError", required=True,
       guide="device_allocator.md",
       fix="when the device cannot allocate, raise with TORCH_CHECK_WITH(OutOfMemoryError, ...) "
           "(C++) so Python sees torch.OutOfMemoryError, and keep the allocator usable afterwards")
def check_out_of_memory(ctx: Context) -> str:
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device=ctx.dev(0))  # 1 PiB
    except torch.OutOfMemoryError as e:
        msg = str(e).splitlines()[0][:60]
    except Exception as e:
        raise CheckFailed(f"a 1 PiB allocation raised {type(e).__name__}, not torch.OutOfMemoryError")
    else:
        raise CheckFailed("a 1 PiB allocation succeeded: the device has no capacity limit")
    t = torch.ones(4, device=ctx.dev(0))
    expect(t.sum().item() == 4, "the device is unusable after an out-of-memory error")
    return msg
# [docs:end CHECK_OUT_OF_MEMORY]


# --- pinned memory --------------------------------------------------------------------------------

@check("pinned_memory", "pinned host memory and non_blocking copies", required=False,
       guide="host_allocator.md",
       fix="implement the host allocator (an at::HostAllocator registered with "
           "at::setHostAllocator(c10::DeviceType::PrivateUse1, ...)) and the hooks isPinnedPtr / "
           "getPinnedMemoryAllocator")
def check_pinned_memory(ctx: Context) -> str:
    t = torch.arange(1024, dtype=torch.float32)
    p = t.pin_memory()
    expect(p.is_pinned(), "tensor.pin_memory() returned a tensor that is_pinned() denies")
    expect(not t.is_pinned(), "a pageable tensor reports is_pinned()")
    e = torch.empty(16, pin_memory=True)
    expect(e.is_pinned(), "torch.empty(pin_memory=True) is not pinned")
    d = p.to(ctx.dev(0), non_blocking=True)
    back = torch.empty_like(p).pin_memory()
    back.copy_(d * 2, non_blocking=True)
    torch.accelerator.synchronize()
    same(back, t * 2, "pinned round trip with non_blocking copies")
    return "pin_memory, is_pinned, non_blocking round trip"


# --- generators -----------------------------------------------------------------------------------

RANDOM_FUNCTIONS = ("manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state",
                    "set_rng_state")


@check("generators", "random generators: seeding, state round trip, per device", required=True,
       guide="generator.md",
       fix="implement a device generator (c10::GeneratorImpl) returned by the hooks' "
           "getDefaultGenerator/getNewGenerator, make random ops draw from it, and expose "
           "manual_seed, manual_seed_all, _is_in_bad_fork, get_rng_state, set_rng_state ... in the "
           "device module (torch.manual_seed calls manual_seed_all only if _is_in_bad_fork exists)")
def check_generators(ctx: Context) -> str:
    m = ctx.need_functions(*RANDOM_FUNCTIONS)
    dev = ctx.dev(0)
    m.manual_seed(1234)
    a = torch.randn(64, device=dev)
    m.manual_seed(1234)
    b = torch.randn(64, device=dev)
    same(a, b, "the same seed gave different numbers")
    state = m.get_rng_state()
    expect(isinstance(state, torch.Tensor) and state.device.type == "cpu",
           "get_rng_state() must return a CPU ByteTensor")
    c = torch.rand(64, device=dev)
    m.set_rng_state(state)
    same(torch.rand(64, device=dev), c, "set_rng_state(get_rng_state()) does not replay")
    g = torch.Generator(device=dev)
    g.manual_seed(7)
    x = torch.randn(16, device=dev, generator=g)
    g.manual_seed(7)
    same(torch.randn(16, device=dev, generator=g), x, "torch.Generator(device=...) does not replay")
    torch.manual_seed(99)
    y = torch.randn(16, device=dev)
    torch.manual_seed(99)
    if not callable(getattr(m, "_is_in_bad_fork", None)):
        expect(torch.equal(torch.randn(16, device=dev).cpu(), y.cpu()),
               f"torch.manual_seed does not seed the device: it calls torch.{ctx.device}."
               "manual_seed_all only if the module also defines", ["_is_in_bad_fork"])
    same(torch.randn(16, device=dev), y, "torch.manual_seed does not seed the device")
    torch.manual_seed(5)
    cpu_draw = torch.randn(16, device=dev)
    torch.manual_seed(5)
    torch.randn(1000)  # consumes the CPU generator only
    same(torch.randn(16, device=dev), cpu_draw, "random ops on the device draw from the CPU generator")
    if ctx.count >= 2:
        m.manual_seed_all(3)
        with torch.accelerator.device_index(1):
            m.manual_seed(4)  # only device 1
        d0 = torch.randn(8, device=ctx.dev(0))
        m.manual_seed_all(3)
        same(torch.randn(8, device=ctx.dev(0)), d0,
             "seeding device 1 changed what device 0 draws (generators are not per device)")
        return "seeding, state round trip, torch.Generator, per device"
    return "seeding, state round trip, torch.Generator; one device: per device not checked"


# --- autocast -------------------------------------------------------------------------------------

@check("autocast", "autocast (mixed precision): a policy casts down and promotes", required=False,
       guide="autocast.md",
       fix="for the AutocastPrivateUse1 dispatch key, register a fallthrough for every operator "
           "(m.fallback(torch::CppFunction::makeFallthrough())) and kernels that apply a policy "
           "(KERNEL_PRIVATEUSEONE: lower_precision_fp for mm, fp32_set_opt_dtype for softmax); "
           "expose get_amp_supported_dtype() in the device module")
def check_autocast(ctx: Context) -> str:
    expect(torch.amp.is_autocast_available(ctx.device), "torch.amp.is_autocast_available() is False")
    m = ctx.need_functions("get_amp_supported_dtype")
    dtypes = m.get_amp_supported_dtype()
    low = torch.bfloat16 if torch.bfloat16 in dtypes else (dtypes[0] if dtypes else None)
    expect(low is not None, "get_amp_supported_dtype() is empty")
    a = torch.randn(8, 8, device=ctx.dev(0))
    try:
        with torch.autocast(ctx.device, dtype=low):
            mm = a @ a  # float32 in: the policy casts it down
            sm = torch.softmax(a.to(low), 0)  # low precision in: the policy computes it in float32
    except NotImplementedError as e:
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise CheckFailed(f"an operator under autocast raised NotImplementedError ({first}): the "
                          "AutocastPrivateUse1 key has no kernel and no fallthrough",
                          ["AutocastPrivateUse1 fallthrough"])
    expect(mm.dtype == low, f"matmul of float32 tensors under autocast gave {mm.dtype}, expected "
           f"{low}: no AutocastPrivateUse1 kernel casts it down", ["lower_precision_fp mm"])
    expect(sm.dtype == torch.float32, f"softmax of a {low} tensor under autocast gave {sm.dtype}, "
           "expected float32: no AutocastPrivateUse1 kernel computes it in float32",
           ["fp32_set_opt_dtype softmax"])
    return (f"mm -> {str(low).replace('torch.', '')}, softmax({str(low).replace('torch.', '')}) -> "
            f"float32; supported {[str(d).replace('torch.', '') for d in dtypes]}")


# --- serialization --------------------------------------------------------------------------------

def need_set_(dev: torch.device, overload: str, why: str) -> None:
    """Raises CheckFailed naming the set_ overload when it fails or copies instead of sharing: a
    fallback that runs set_ on a CPU copy leaves the tensor with memory of its own."""
    t = torch.arange(4.0, device=dev)
    try:
        if overload == "set_.source_Storage":
            u = torch.empty(0, device=dev).set_(t.untyped_storage())
        else:
            u = torch.empty(0, device=dev).set_(t.untyped_storage(), 1, (3,), (1,))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise CheckFailed(f"{why}, and it raised {type(e).__name__}: {first}; the kernel missing is",
                          [overload])
    expect(u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(),
           f"{why}, but it did not make the tensor use the storage (a copying fallback ran it?); "
           "register a kernel for", [overload])


@check("serialization", "torch.save / torch.load with map_location", required=True,
       guide="serialization.md",
       fix="register the device module with a device(...) context manager that accepts a "
           "torch.device (torch.load moves storages inside it), implement "
           "set_.source_Storage_storage_offset (torch.load rebuilds every tensor with it) and, for "
           "backend metadata, the serialization hooks")
def check_serialization(ctx: Context) -> str:
    last = ctx.dev(max(ctx.count - 1, 0))
    m = ctx.need_functions("device")
    try:
        with m.device(last):
            pass
    except Exception as e:
        raise CheckFailed(f"torch.load moves each storage inside `with torch.{ctx.device}.device"
                          f"({last!r})`, which raised {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:100]}", ["device(torch.device)"])
    need_set_(last, "set_.source_Storage_storage_offset",
              "torch.load rebuilds every tensor with set_(storage, offset, size, stride)")
    t = torch.arange(6.0, device=last).view(2, 3)
    buf = io.BytesIO()
    torch.save({"t": t, "v": t[1]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    expect(loaded["t"].device == last, f"loaded on {loaded['t'].device}, saved on {last}")
    same(loaded["t"], t, "value after save/load")
    expect(loaded["v"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr(),
           "a view and its base no longer share storage after load")
    buf.seek(0)
    same(torch.load(buf, map_location="cpu")["t"], t.cpu(), "map_location='cpu'")
    cpu_buf = io.BytesIO()
    torch.save(t.cpu(), cpu_buf)
    cpu_buf.seek(0)
    moved = torch.load(cpu_buf, map_location=str(last))
    expect(moved.device == last, f"map_location={str(last)!r} loaded on {moved.device}")
    return "device, map_location to cpu and to the device"


# --- storage --------------------------------------------------------------------------------------

@check("storage", "storages: UntypedStorage methods and resize_", required=True, guide="storage.md",
       fix="implement resizePrivateUse1Bytes in the PrivateUse1 hooks (storage resize_), the "
           "resize_ kernel and set_.source_Storage (storage copy_, clone and cpu view storages as "
           "tensors with it)")
def check_storage(ctx: Context) -> str:
    dev = ctx.dev(0)
    need_set_(dev, "set_.source_Storage",
              "storage copy_, clone() and cpu() view each storage as a tensor with set_(storage)")
    t = torch.arange(4.0, device=dev)
    s = t.untyped_storage()
    expect(s.device == dev, f"untyped_storage().device is {s.device}")
    expect(s.nbytes() == 16, f"nbytes() is {s.nbytes()}")
    s2 = torch.UntypedStorage(32, device=dev)
    expect(s2.device == dev and s2.nbytes() == 32, "torch.UntypedStorage(n, device=...)")
    c = s.clone()
    expect(c.device == dev and c.data_ptr() != s.data_ptr(), "storage.clone()")
    expect(bytes(s.cpu().tolist()) == bytes(t.cpu().untyped_storage().tolist()), "storage.cpu()")
    s2.resize_(64)
    expect(s2.nbytes() == 64, "UntypedStorage.resize_() did not resize (resizePrivateUse1Bytes)")
    r = torch.arange(3.0, device=dev)
    r.resize_(10)
    expect(r.shape == (10,), "tensor.resize_ did not grow the tensor")
    same(r[:3], torch.arange(3.0), "tensor.resize_ lost the data it had")
    u = torch.empty(0, device=dev).set_(s)
    same(u, torch.arange(4.0), "tensor.set_(storage)")
    return "device, nbytes, clone, cpu, resize_, set_"


# --- generated methods ----------------------------------------------------------------------------

@check("generated_methods", "generated tensor/module/storage methods", required=True,
       guide="registration.md",
       fix="call torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, "
           "for_module=True, for_storage=True) after rename_privateuse1_backend")
def check_generated_methods(ctx: Context) -> str:
    name = ctx.device
    missing = [f"Tensor.{name}"] if not hasattr(torch.Tensor, name) else []
    missing += [f"Tensor.is_{name}"] if not hasattr(torch.Tensor, f"is_{name}") else []
    missing += [f"nn.Module.{name}"] if not hasattr(torch.nn.Module, name) else []
    missing += [f"UntypedStorage.{name}"] if not hasattr(torch.UntypedStorage, name) else []
    missing += [f"UntypedStorage.is_{name}"] if not hasattr(torch.UntypedStorage, f"is_{name}") else []
    expect(not missing, "methods not generated", missing)
    t = getattr(torch.ones(2), name)()
    expect(t.device.type == name and getattr(t, f"is_{name}"), f"Tensor.{name}() moved to {t.device}")
    lin = getattr(torch.nn.Linear(2, 2), name)()
    expect(lin.weight.device.type == name, f"Module.{name}() left the weights on {lin.weight.device}")
    return f"Tensor.{name}(), is_{name}, Module.{name}(), UntypedStorage.{name}()"


# --- copies ---------------------------------------------------------------------------------------

@check("copies", "copies: host<->device, across devices, non-contiguous, dtype change", required=True,
       guide="minimal_ops.md",
       fix="implement _copy_from (host to device, device to host, device to device across devices, "
           "strided and dtype-converting) and _copy_from_and_resize")
def check_copies(ctx: Context) -> str:
    cpu = torch.randn(4, 6)
    d0 = cpu.to(ctx.dev(0))
    same(d0, cpu, "host to device")
    same(d0.t().contiguous(), cpu.t().contiguous(), "non-contiguous device tensor")
    same(d0.to(torch.float64), cpu.to(torch.float64), "device copy with a dtype change")
    host = torch.empty(6, 4)
    host.copy_(d0.t())
    same(host, cpu.t(), "device to host into a strided source")
    notes = "h2d, d2h, strided, dtype"
    if ctx.count >= 2:
        d1 = d0.to(ctx.dev(1))
        expect(d1.device == ctx.dev(1), f"to({ctx.dev(1)}) gave {d1.device}")
        same(d1, cpu, "device 0 to device 1")
        dst = torch.zeros(6, 4, device=ctx.dev(1))
        dst.copy_(d0.t(), non_blocking=True)
        torch.accelerator.synchronize(1)
        same(dst, cpu.t(), "non_blocking strided copy across devices")
        notes += ", across devices"
    else:
        notes += "; one device: across devices not checked"
    return notes


# --- fork poisoning -------------------------------------------------------------------------------

FORK_SCRIPT = """
import os, sys, torch
{imports}
torch.ones(1, device="{dev}").sum().item()      # initialise in the parent
pid = os.fork()
if pid == 0:
    try:
        torch.ones(1, device="{dev}").sum().item()
    except RuntimeError as e:
        os.write(1, ("RAISED " + str(e).splitlines()[0] + "\\n").encode())
        os._exit(0)
    except BaseException as e:
        os.write(1, ("OTHER " + type(e).__name__ + "\\n").encode())
        os._exit(0)
    os.write(1, b"WORKED\\n")
    os._exit(0)
os.waitpid(pid, 0)
"""


@check("fork_poisoning", "using the device in a forked child raises", required=False,
       guide="device.md",
       fix="at lazy init, register a fork handler (pthread_atfork in C++, os.register_at_fork in "
           "Python) that marks the child so its first device call raises 'Cannot re-initialize ... "
           "in forked subprocess'")
def check_fork_poisoning(ctx: Context) -> str:
    if not hasattr(os, "fork"):
        return "not applicable: no fork on this platform"
    imports = "\n".join(f"import {m}" for m in ctx.imports)
    script = FORK_SCRIPT.format(dev=ctx.device, imports=imports)
    try:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise CheckFailed("the forked child hung on its first device call (60 s)")
    out = r.stdout.strip()
    if out.startswith("RAISED"):
        expect("fork" in out.lower(), f"the child raised, without naming fork: {out[7:]}")
        return out[7:][:70]
    if r.returncode != 0 and not out:
        errors = [l for l in r.stderr.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", l)]
        raise CheckFailed("the parent could not use the device before forking: "
                          + (errors[-1][:160] if errors else f"exit {r.returncode}"))
    raise CheckFailed(f"the forked child {'could use the device' if out == 'WORKED' else out or 'crashed'}")


# --- minimal operator set -------------------------------------------------------------------------

def _minimal_cases(dev: torch.device) -> dict[str, Callable[[], None]]:
    def empty():
        t = torch.empty(2, 3, device=dev)
        expect(t.device == dev and t.shape == (2, 3), "empty")
        c = torch.empty(1, 2, 3, 4, device=dev, memory_format=torch.channels_last)
        expect(c.is_contiguous(memory_format=torch.channels_last), "empty(channels_last)")

    def empty_strided():
        t = torch.empty_strided((2, 3), (1, 2), device=dev)
        expect(t.stride() == (1, 2), f"strides {t.stride()}")

    def fill_and_item():
        expect(torch.empty(3, device=dev).fill_(2.5).sum().item() == 7.5, "fill_ / item")

    def view():
        t = torch.arange(6.0, device=dev)
        v = t.view(2, 3)
        v[1, 2] = 10
        expect(t[5].item() == 10, "view does not share storage")

    def as_strided():
        t = torch.arange(6.0, device=dev)
        v = t.as_strided((2, 2), (1, 2), 1)
        same(v, torch.arange(6.0).as_strided((2, 2), (1, 2), 1), "as_strided")
        v[1, 1] = 10
        expect(t[4].item() == 10, "as_strided does not share storage (it ran on a copy)")

    def resize_():
        t = torch.empty(0, device=dev)
        t.resize_(5)
        expect(t.numel() == 5, "resize_")

    def set_():
        t = torch.arange(4.0, device=dev)
        u = torch.empty(0, device=dev).set_(t.untyped_storage(), 1, (3,), (1,))
        same(u, torch.arange(1.0, 4.0), "set_(storage, offset, size, stride)")
        expect(u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(),
               "set_ did not make the tensor use the storage")

    def local_scalar_dense():
        expect(torch.tensor(3, device=dev).item() == 3, "_local_scalar_dense")

    def copy_():
        same(torch.zeros(3, device=dev).copy_(torch.ones(3)), torch.ones(3), "copy_")

    def arithmetic():
        a = torch.arange(6.0, device=dev).view(2, 3)
        c = torch.arange(6.0).view(2, 3)
        same(a @ a.t() + a.sum(), c @ c.t() + c.sum(), "matmul, add, sum")
    return {"empty.memory_format": empty, "empty_strided": empty_strided, "fill_/item": fill_and_item,
            "view": view, "as_strided": as_strided, "resize_": resize_, "set_": set_,
            "_local_scalar_dense": local_scalar_dense, "copy_": copy_, "matmul/add/sum": arithmetic}


@check("minimal_ops", "minimal operator set (allocation, views, set_/resize_, copy, scalars)",
       required=True, guide="minimal_ops.md",
       fix="register PrivateUse1 kernels for empty.memory_format, empty_strided, as_strided, view, "
           "_reshape_alias, set_ (4 overloads), resize_, _copy_from, _copy_from_and_resize, and a "
           "fallback for the rest (at::native::cpu_fallback to start with)")
def check_minimal_ops(ctx: Context) -> str:
    failed = []
    cases = _minimal_cases(ctx.dev(0))
    for name, case in cases.items():
        try:
            case()
        except Exception as e:
            failed.append(f"{name} ({type(e).__name__})")
    expect(not failed, "operators failing", failed)
    return f"{len(cases)} operators"


OPINFO_SAMPLE = ("add", "mul", "true_divide", "exp", "sigmoid", "sum", "mean", "amax", "matmul", "cat",
                 "where", "index_select", "gather", "softmax", "nn.functional.relu",
                 "nn.functional.layer_norm", "cumsum", "sort", "masked_fill", "clamp")


@check("opinfo_sample", "a sample of OpInfo operators against the CPU", required=False,
       guide="fallback.md",
       fix="implement the failing operators (or a fallback that runs them) for PrivateUse1; an "
           "operator with a CompositeExplicitAutograd kernel (native_layer_norm) never reaches "
           "the fallback: register the fallback for it by name, or a kernel of its own, to match "
           "the CPU")
def check_opinfo_sample(ctx: Context) -> str:
    from torch.testing._internal.common_methods_invocations import op_db

    ops = {op.name: op for op in op_db if op.name in OPINFO_SAMPLE and not op.variant_test_name}
    absent = [name for name in OPINFO_SAMPLE if name not in ops]
    expect(not absent, f"this torch's OpInfo database has no entry (without a variant) for",
           absent)  # a renamed OpInfo is the check's own bug: never compare fewer ops silently
    dev, failed, details, compared = ctx.dev(0), [], [], 0
    for name in OPINFO_SAMPLE:
        op = ops.get(name)
        if op is None:
            continue
        for i, sample in enumerate(op.sample_inputs("cpu", torch.float32)):
            if i == 3:
                break
            try:
                expected = op(sample.input, *sample.args, **sample.kwargs)
                moved = sample.transform(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t)
                problem = None
                for g, e in zip(_flat(op(moved.input, *moved.args, **moved.kwargs)), _flat(expected)):
                    problem = problem or _difference(g.cpu(), e)
            except Exception as e:
                problem = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
            if problem:
                failed.append(name)
                details.append(f"{name} sample {i} {_describe(sample)}: {problem}")
                break
            compared += 1
    if failed:
        err = CheckFailed("operators that differ from the CPU or fail: " + "; ".join(details))
        err.missing = failed
        raise err
    return f"{len(ops)} ops, {compared} samples equal to the CPU"


# torch.testing.assert_close's default tolerances for float32, the dtype of the samples.
OPINFO_RTOL, OPINFO_ATOL = 1.3e-6, 1e-5


def _difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``got`` is close to ``expected``, otherwise what differs and by how much."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} "
                f"{tuple(expected.shape)}")
    if torch.allclose(got, expected, rtol=OPINFO_RTOL, atol=OPINFO_ATOL, equal_nan=True):
        return None
    g, e = got.double(), expected.double()
    diff = (g - e).abs().masked_fill(g.isnan() & e.isnan(), 0).nan_to_num(nan=float("inf"))
    return (f"largest difference {diff.max().item():.3g} (at tolerance rtol={OPINFO_RTOL:g}, "
            f"atol={OPINFO_ATOL:g})")


def _describe(sample: Any) -> str:
    """The sample's arguments in short: tensors by shape and dtype, the rest by value."""
    def short(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            inner = ", ".join(short(v) for v in x[:3]) + (", ..." if len(x) > 3 else "")
            return f"[{inner}]"
        return repr(x)[:24]
    args = [short(sample.input)] + [short(a) for a in sample.args]
    args += [f"{k}={short(v)}" for k, v in sample.kwargs.items()]
    return f"({', '.join(args)})"


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    return []


# --- autograd -------------------------------------------------------------------------------------

@check("autograd", "autograd: gradients like the CPU, backward on the device thread", required=True,
       guide="autograd.md",
       fix="the autograd engine starts one worker thread per device reported by "
           "DeviceGuardImplInterface::deviceCount(); backward kernels must exist for the device (or "
           "the fallback must run them)")
def check_autograd(ctx: Context) -> str:
    threads = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(c, x):
            return x.clone()

        @staticmethod
        def backward(c, g):
            threads.append(threading.get_ident())
            return g

    w_cpu = torch.randn(5, 3, requires_grad=True)
    x_cpu = torch.randn(4, 5)
    w = w_cpu.detach().to(ctx.dev(0)).requires_grad_()
    x = x_cpu.to(ctx.dev(0))
    (torch.tanh(x_cpu @ w_cpu) ** 2).sum().backward()
    (torch.tanh(Probe.apply(x @ w)) ** 2).sum().backward()
    expect(w.grad is not None and w.grad.device == ctx.dev(0), "no gradient on the device")
    same(w.grad, w_cpu.grad, "gradient")
    if torch.autograd.is_multithreading_enabled():
        expect(threads and threads[0] != threading.get_ident(),
               "backward ran on the calling thread: the autograd engine started no device thread "
               "(DeviceGuardImpl deviceCount() or the device type)")
        return "gradients equal, backward on a device thread"
    return "gradients equal (autograd multithreading is off)"


# --- distributed ----------------------------------------------------------------------------------

# One rank of a two-process group: every collective gets inputs that differ by rank, so only real
# communication gives the expected results (on one rank, all_reduce is the identity).
DISTRIBUTED_SCRIPT = """
import datetime, json, sys, torch
{imports}
import torch.distributed as dist
rank, store_path = int(sys.argv[1]), sys.argv[2]
step = "init_process_group"
out = {{}}
try:
    dist.init_process_group(store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds={timeout}))
    index = rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    dev = torch.device("{dev}", index)
    step = "all_reduce"
    t = torch.arange(4.0, device=dev) + 10 * rank
    dist.all_reduce(t)
    out[step] = t.cpu().tolist()
    step = "broadcast"
    b = torch.full((3,), rank + 1.0, device=dev)
    dist.broadcast(b, src=1)
    out[step] = b.cpu().tolist()
    step = "all_gather"
    parts = [torch.zeros(2, device=dev) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([rank, rank + 0.5], device=dev))
    out[step] = [p.cpu().tolist() for p in parts]
    step = "send/recv"
    if rank == 0:
        dist.send(torch.tensor([7.0, 8.0], device=dev), dst=1)
    else:
        r = torch.zeros(2, device=dev)
        dist.recv(r, src=0)
        out[step] = r.cpu().tolist()
    torch.accelerator.synchronize()
    step = "destroy_process_group"
    dist.destroy_process_group()
    print("@@RESULT " + json.dumps(out), flush=True)
except BaseException as e:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    print("@@ERROR " + json.dumps([step, type(e).__name__ + ": " + first, out]), flush=True)
    sys.exit(1)
"""

DISTRIBUTED_LIMIT = 120  # seconds for the two ranks, imports included (a loaded machine is slow)
DISTRIBUTED_EXPECTED = {
    "all_reduce": [[10.0, 12.0, 14.0, 16.0]] * 2,
    "broadcast": [[2.0, 2.0, 2.0]] * 2,
    "all_gather": [[[0.0, 0.5], [1.0, 1.5]]] * 2,
    "send/recv": [None, [7.0, 8.0]],
}


@check("distributed", "torch.distributed: collectives between two processes on the device",
       required=False, guide="distributed.md",
       fix="implement a c10d::Backend for the device (allreduce, broadcast, allgather, send, recv "
           "that communicate between processes) and register its creator with "
           "torch.distributed.Backend.register_backend(name, creator, devices=[device]) so "
           "init_process_group() picks it for device tensors", min_timeout=DISTRIBUTED_LIMIT + 30)
def check_distributed(ctx: Context) -> str:
    import json
    import tempfile

    import torch.distributed as dist
    expect(dist.is_available(), "torch.distributed is not available in this build")
    name = dist.Backend.default_device_backend_map.get(ctx.device)
    expect(name is not None, f"no c10d backend registered for device {ctx.device!r}",
           [f"Backend.default_device_backend_map[{ctx.device!r}]"])
    imports = "\n".join(f"import {m}" for m in ctx.imports)
    limit = DISTRIBUTED_LIMIT
    script = DISTRIBUTED_SCRIPT.format(dev=ctx.device, imports=imports, timeout=limit // 2)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        # Both ranks end, or one fails (the other then waits for it forever) or the time is up.
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        outputs = [proc.communicate() for proc in procs]
    if len(hung) == 2:
        raise CheckFailed(f"neither rank finished within {limit} s: a collective that never "
                          "completes (no communication between the processes?)")
    results = []
    for rank, (stdout, stderr) in enumerate(outputs):
        lines = [l for l in stdout.splitlines() if l.startswith("@@")]
        if lines and lines[-1].startswith("@@RESULT "):
            results.append(json.loads(lines[-1][len("@@RESULT "):]))
            continue
        if lines and lines[-1].startswith("@@ERROR "):
            step, error, _ = json.loads(lines[-1][len("@@ERROR "):])
            raise CheckFailed(f"rank {rank} of 2: {step} on {ctx.device} tensors raised {error}",
                              [step])
        if rank in hung:
            continue  # waited for the other rank, which failed: that one is the finding
        errors = [l for l in stderr.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", l)]
        raise CheckFailed(f"rank {rank} of 2 died (exit {procs[rank].returncode}): "
                          + (errors[-1][:160] if errors else "no error message"))
    if hung:
        raise CheckFailed(f"rank {hung[0]} of 2 did not finish within {limit} s, the other did: "
                          "a collective that never completes")
    for step, expected in DISTRIBUTED_EXPECTED.items():
        for rank, want in enumerate(expected):
            got = results[rank].get(step)
            expect(got == want, f"{step} between two processes: rank {rank} got {got}, expected "
                   f"{want} (inputs differ by rank: only communication gives it)", [step])
    devices = "one device, both ranks on it" if ctx.count < 2 else "rank i on device i"
    return (f"backend {name!r}, 2 processes ({devices}): all_reduce, broadcast, all_gather, "
            "send/recv")


# --- compile --------------------------------------------------------------------------------------

def _compiled_function(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (torch.sin(a) * b + 1).sum(dim=1)


@check("compile", "torch.compile with Inductor on the device: forward and backward", required=False,
       guide="compile.md",
       fix="register a torch._dynamo.device_interface.DeviceInterface with "
           "register_interface_for_device, and Inductor's scheduling and wrapper code generation "
           "for the device with torch._inductor.codegen.common.register_backend_for_device (and "
           "register_device_op_overrides for the device lines of generated code)", main_thread=True)
def check_compile(ctx: Context) -> str:
    from torch._dynamo import device_interface as di
    try:
        iface = di.get_interface_for_device(ctx.device)
    except NotImplementedError:
        raise CheckFailed("no Dynamo device interface", ["register_interface_for_device"])
    missing = [f for f in ("device_count", "current_device", "is_available", "synchronize")
               if not callable(getattr(iface, f, None))]
    expect(not missing, "the Dynamo device interface lacks", missing)
    expect(iface.device_count() == torch.accelerator.device_count(), "interface device_count differs")
    import importlib
    common = importlib.import_module("torch._inductor.codegen.common")
    importlib.import_module("torch._inductor.codegen.cpp")  # backends register as Inductor loads
    importlib.import_module("torch._inductor.codegen.wrapper")
    expect(common.get_scheduling_for_device(ctx.device) is not None,
           "Inductor has no scheduling for the device", ["register_backend_for_device"])
    # What a user writes: torch.compile with its default backend, Inductor, forward and backward.
    torch._dynamo.reset()
    compiled = torch.compile(_compiled_function, fullgraph=True)
    a_cpu, b_cpu = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    a = a_cpu.detach().to(ctx.dev(0)).requires_grad_()
    from torch._inductor.utils import fresh_cache, run_and_get_code
    try:
        # Fresh caches: code that another backend's registration generated for this device name
        # and function earlier on this machine (Inductor's on-disk caches) must not pass for this
        # backend's own code generation.
        with fresh_cache():
            out, codes = run_and_get_code(compiled, a, b_cpu.to(ctx.dev(0)))
            out.sum().backward()
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckFailed(f"torch.compile (Inductor) of a function on {ctx.device} tensors raised "
                          f"{type(e).__name__}: {first}", ["register_backend_for_device"])
    finally:
        torch._dynamo.reset()
    expect(bool(codes), "torch.compile ran, but Inductor generated no code for the device (did "
           "Dynamo fall back to eager?)", ["register_backend_for_device"])
    expect(out.device == ctx.dev(0), f"the compiled function's output is on {out.device}")
    ref = _compiled_function(a_cpu, b_cpu)
    ref.sum().backward()
    same(out, ref, "compiled forward")
    expect(a.grad is not None and a.grad.device == ctx.dev(0), "no gradient on the device after "
           "backward through the compiled function")
    same(a.grad, a_cpu.grad, "compiled backward (gradient)")
    return (f"{getattr(iface, '__name__', type(iface).__name__)}; Inductor forward and backward "
            "equal to the CPU")


# --- profiler -------------------------------------------------------------------------------------

@check("profiler", "profiler: device kernels on the device timeline (ProfilerActivity.PrivateUse1)",
       required=False, guide="profiler.md",
       fix="implement a Kineto activity-profiler plugin (a libkineto::IActivityProfiler whose "
           "session reports each device kernel as a CONCURRENT_KERNEL activity linked to the "
           "operator that launched it) and register it with "
           "torch::profiler::impl::PrivateUse1ProfilerRegistry (REGISTER_PRIVATEUSE1_PROFILER)",
       main_thread=True)
def check_profiler(ctx: Context) -> str:
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(64, 64, device=ctx.dev(0))
    torch.accelerator.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        y = x @ x
        torch.accelerator.synchronize()
    del y
    events = prof.events()
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    expect(bool(on_device), "no kernel events on the device timeline: the profile holds CPU "
           "operators only", ["libkineto::IActivityProfiler"])
    mm = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
          and e.name in ("aten::mm", "aten::matmul")]
    device_time = sum(e.device_time_total for e in mm)
    expect(device_time > 0, f"{len(on_device)} device events, but the matmul's operator has no "
           "device time: its kernel is not linked to the operator that launched it (correlation "
           "id)", ["CONCURRENT_KERNEL"])
    return f"{len(on_device)} device events, the matmul's kernel {device_time:.0f} us"
