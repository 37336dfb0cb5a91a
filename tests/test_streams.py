"""Streams of the openreg device: pools and priorities, current streams, ordering of work, the
asynchronous (non_blocking) copies and their races, and asynchronous errors.

Races are made observable with a large simulated copy latency (``slow_copies``): a copy then
stays in flight for a quarter of a second, far longer than the few microseconds the host needs to read
the destination too early.
"""

import gc
import threading
import time

import pytest
import torch

from torch_openreg.openreg.streams import _inject_async_error
from torch_openreg.testing import hold_stream

N = 1000


def expected():
    return torch.arange(N, dtype=torch.float32)


# ---------------------------------------------------------------- pools, priorities, current stream


def test_priority_range_follows_cuda_convention():
    lowest, highest = torch.openreg.Stream.priority_range()
    assert (lowest, highest) == (0, -3)  # lower number = higher priority
    for p in range(lowest, highest - 1, -1):
        s = torch.openreg.Stream(priority=p)
        assert s.priority == p
        assert s.stream_id != 0  # pool streams, never the default stream


def test_out_of_range_priorities_are_clamped():
    assert torch.openreg.Stream(priority=7).priority == 0
    assert torch.openreg.Stream(priority=-50).priority == -3


def test_pool_streams_are_distinct_and_on_the_requested_device(device):
    streams = [torch.openreg.Stream(device) for _ in range(4)]
    assert len({s.stream_id for s in streams}) == 4
    assert all(s.device == device for s in streams)
    assert all(s.priority == 0 for s in streams)
    high = torch.Stream(device=device, priority=-1)  # the generic API reaches the same pool
    assert high.device == device
    assert torch.openreg.current_stream(device).stream_id == 0
    wrapped = torch.openreg.Stream(stream_id=high.stream_id, device_index=high.device_index,
                                   device_type=high.device_type)
    assert wrapped == high and wrapped.priority == -1


def test_stream_on_a_missing_device_raises():
    with pytest.raises(RuntimeError, match="device index is out of range"):
        torch.openreg.Stream(device=7)


def test_default_and_current_stream():
    for d in range(2):
        default = torch.openreg.default_stream(d)
        assert default.stream_id == 0 and default.device_index == d and default.priority == 0
        assert torch.openreg.current_stream(d) == default
        assert torch.accelerator.current_stream(d) == default


def test_set_stream_is_per_device_and_switches_the_device():
    s1 = torch.openreg.Stream(1)
    assert torch.openreg.current_device() == 0
    try:
        torch.openreg.set_stream(s1)
        assert torch.openreg.current_device() == 1
        assert torch.openreg.current_stream(1) == s1
        assert torch.openreg.current_stream(0).stream_id == 0  # device 0 keeps its stream
        torch.accelerator.set_stream(torch.openreg.default_stream(1))
        assert torch.accelerator.current_stream(1).stream_id == 0
        torch.openreg.set_stream(None)  # no-op, like torch.cuda.set_stream(None)
    finally:
        torch.accelerator.set_stream(torch.openreg.default_stream(1))
        torch.openreg.set_device(0)


def test_current_stream_is_per_thread():
    s = torch.openreg.Stream(0)
    seen = {}

    def other_thread():
        seen["before"] = torch.openreg.current_stream(0)
        torch.openreg.set_stream(torch.openreg.Stream(0, priority=-2))
        seen["after"] = torch.openreg.current_stream(0)

    with torch.openreg.stream(s):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert torch.openreg.current_stream(0) == s
    assert seen["before"].stream_id == 0  # a new thread starts on the default stream
    assert seen["after"].priority == -2
    assert torch.openreg.current_stream(0).stream_id == 0


def test_stream_context_manager_restores_stream_and_device_on_exception():
    s1 = torch.openreg.Stream(1)
    with pytest.raises(KeyError):
        with torch.openreg.stream(s1):
            assert torch.openreg.current_device() == 1
            assert torch.openreg.current_stream() == s1
            assert torch.empty(1, device="openreg").device == torch.device("openreg:1")
            raise KeyError("boom")
    assert torch.openreg.current_device() == 0
    assert torch.openreg.current_stream(1).stream_id == 0
    assert torch.openreg.current_stream(0).stream_id == 0


def test_stream_context_managers_nest_and_accept_none():
    a, b = torch.openreg.Stream(0), torch.openreg.Stream(1, priority=-1)
    with torch.openreg.stream(a):
        with torch.openreg.stream(b):
            assert torch.openreg.current_stream() == b
            with torch.openreg.stream(None):
                assert torch.openreg.current_stream() == b
        assert torch.openreg.current_device() == 0
        assert torch.openreg.current_stream() == a
    assert torch.openreg.current_stream().stream_id == 0


def test_torch_stream_with_statement():
    s = torch.Stream(device="openreg:1")
    with s:
        assert torch.accelerator.current_stream() == s
        assert torch.accelerator.current_device_index() == 1
    assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_stream(1).stream_id == 0


# ---------------------------------------------------------------- ordering and asynchronous copies


def test_query_and_synchronize_follow_queued_work(device, slow_copies):
    s = torch.openreg.Stream(device)
    host = torch.zeros(N).pin_memory()
    x = torch.arange(N, dtype=torch.float32, device=device)
    assert s.query()
    with torch.openreg.stream(s):
        host.copy_(x, non_blocking=True)
    assert not s.query()
    assert torch.openreg.current_stream(device).query()  # other streams are not busy
    s.synchronize()
    assert s.query()
    assert torch.equal(host, expected())


def test_missing_synchronize_after_non_blocking_d2h_is_observable(device):
    x = torch.arange(N, dtype=torch.float32, device=device)
    host = torch.zeros(N).pin_memory()
    # hold_stream keeps the copy queued for the whole block, so the early read is deterministic.
    with hold_stream(torch.openreg.current_stream(device)):
        host.copy_(x, non_blocking=True)
        assert torch.count_nonzero(host) == 0  # read too early: the copy has not landed
        result = x.to("cpu", non_blocking=True)  # torch allocates a pinned destination
        assert result.is_pinned()
    torch.openreg.synchronize(device)
    assert torch.equal(host, expected())
    assert torch.equal(result, expected())


def test_missing_synchronize_is_observable_with_a_realistic_latency(device, slow_copies):
    # The same bug with nothing held: the simulated copy engine alone keeps the copy in flight.
    x = torch.arange(N, dtype=torch.float32, device=device)
    host = torch.zeros(N).pin_memory()
    host.copy_(x, non_blocking=True)
    assert torch.count_nonzero(host) == 0
    torch.openreg.synchronize(device)
    assert torch.equal(host, expected())


@pytest.mark.parametrize("how", ["stream", "device", "event", "accelerator"])
def test_synchronized_non_blocking_d2h_is_always_right(device, how):
    for i in range(30):
        x = torch.randn(4096, generator=torch.Generator().manual_seed(i))
        d = x.to(device)
        out = d.to("cpu", non_blocking=True)
        if how == "stream":
            torch.openreg.current_stream(device).synchronize()
        elif how == "device":
            torch.openreg.synchronize(device)
        elif how == "event":
            torch.openreg.current_stream(device).record_event().synchronize()
        else:
            torch.accelerator.synchronize(device)
        assert torch.equal(out, x)


def test_non_blocking_from_pageable_memory_is_synchronous(device, slow_copies):
    host = torch.zeros(N)  # not pinned: the copy cannot be asynchronous
    host.copy_(torch.arange(N, dtype=torch.float32, device=device), non_blocking=True)
    assert torch.equal(host, expected())


def test_h2d_source_is_kept_alive_until_the_copy_ran(device):
    dst = torch.empty(N, device=device)
    with hold_stream(torch.openreg.current_stream(device)):
        src = torch.full((N,), 7.0).pin_memory()
        address = src.data_ptr()
        dst.copy_(src, non_blocking=True)
        del src
        gc.collect()
        # Were the source freed, these allocations of the same size would reuse its memory.
        others = [torch.full((N,), -1.0).pin_memory() for _ in range(4)]
        assert all(o.data_ptr() != address for o in others)
    torch.openreg.synchronize(device)
    assert torch.equal(dst.cpu(), torch.full((N,), 7.0))


def test_writing_the_source_of_a_queued_h2d_copy_is_a_visible_race(device, slow_copies):
    src = torch.zeros(N).pin_memory()
    dst = torch.empty(N, device=device)
    dst.copy_(src, non_blocking=True)
    src.fill_(5.0)  # bug: the copy is still queued, it will read the new values
    torch.openreg.synchronize(device)
    assert torch.equal(dst.cpu(), torch.full((N,), 5.0))


def test_device_destination_is_kept_alive_until_the_copy_ran(device, slow_copies):
    before = torch.openreg.memory_allocated(device)
    dst = torch.empty(1 << 20, device=device)
    dst.copy_(torch.ones(1 << 20).pin_memory(), non_blocking=True)
    del dst
    assert torch.openreg.memory_allocated(device) > before  # still used by the queued copy
    torch.openreg.synchronize(device)
    assert torch.openreg.memory_allocated(device) == before


def test_kernel_after_a_non_blocking_copy_on_the_same_stream_sees_its_data(device, slow_copies):
    src = expected().pin_memory()
    d = torch.zeros(N, device=device)
    d.copy_(src, non_blocking=True)
    out = d * 2  # same stream: runs after the copy
    assert torch.equal(out.cpu(), expected() * 2)


def test_another_stream_races_with_a_non_blocking_copy_without_wait_stream(device, slow_copies):
    side = torch.openreg.Stream(device)
    src = expected().pin_memory()
    d = torch.zeros(N, device=device)
    side.wait_stream(torch.openreg.current_stream(device))  # zeroed on the current stream (queued there with OPENREG_ASYNC=1)
    with torch.openreg.stream(side):
        d.copy_(src, non_blocking=True)
    out = d * 2  # default stream: nothing orders it after the side stream's copy
    assert torch.count_nonzero(out.cpu()) == 0
    side.synchronize()
    assert torch.equal(d.cpu(), expected())


def test_wait_stream_orders_later_work_after_the_other_streams_copy(device, slow_copies):
    side = torch.openreg.Stream(device)
    src = expected().pin_memory()
    d = torch.zeros(N, device=device)
    side.wait_stream(torch.openreg.current_stream(device))  # zeroed on the current stream (queued there with OPENREG_ASYNC=1)
    with torch.openreg.stream(side):
        d.copy_(src, non_blocking=True)
    current = torch.openreg.current_stream(device)
    t0 = time.perf_counter()
    current.wait_stream(side)
    assert time.perf_counter() - t0 < slow_copies / 2  # the host does not wait, the stream does
    assert not current.query()
    out = d * 2
    assert torch.equal(out.cpu(), expected() * 2)


def test_non_blocking_d2h_waits_for_earlier_kernels_of_its_stream(device, slow_copies):
    side = torch.openreg.Stream(device)
    src = expected().pin_memory()
    host = torch.zeros(N).pin_memory()
    with torch.openreg.stream(side):
        d = src.to(device, non_blocking=True)  # in flight
        host.copy_(d, non_blocking=True)  # queued behind it on the same stream
    side.synchronize()
    assert torch.equal(host, expected())


def test_cross_device_copy_waits_for_the_source_devices_current_stream(slow_copies):
    src = expected().pin_memory()
    d0 = torch.zeros(N, device="openreg:0")
    d0.copy_(src, non_blocking=True)  # queued on openreg:0's current stream
    d1 = d0.to("openreg:1")  # ordered after the source device's current stream
    assert torch.equal(d1.cpu(), expected())


def test_copy_engine_latency_and_bandwidth_are_configurable(device):
    old = torch.openreg.set_copy_engine_config(latency_us=0, bandwidth_gbps=0.1)  # 100 MB/s
    try:
        assert torch.openreg.get_copy_engine_config() == (0.0, 0.1)
        host = torch.empty(5_000_000, dtype=torch.uint8).pin_memory()  # 5 MB -> 50 ms
        d = torch.ones(5_000_000, dtype=torch.uint8, device=device)
        t0 = time.perf_counter()
        host.copy_(d, non_blocking=True)
        issued = time.perf_counter() - t0
        torch.openreg.synchronize(device)
        total = time.perf_counter() - t0
        assert issued < 0.025 and total >= 0.05
        assert bool(host.all())
        with pytest.raises(ValueError, match="latency"):
            torch.openreg.set_copy_engine_config(latency_us=-1)
    finally:
        torch.openreg.set_copy_engine_config(*old)


def test_high_priority_stream_gets_the_copy_engine_first(device):
    """Priority on openreg: waiting copies of a device are served highest priority first."""
    old = torch.openreg.set_copy_engine_config(latency_us=100_000)
    try:
        src = expected().pin_memory()
        dsts = [torch.empty(N, device=device) for _ in range(4)]
        lows = [torch.openreg.Stream(device, priority=0) for _ in range(3)]
        high = torch.openreg.Stream(device, priority=-3)
        done = []
        for s, dst in zip(lows + [high], dsts):  # the high-priority copy is issued last
            with torch.openreg.stream(s):
                dst.copy_(src, non_blocking=True)
                done.append(s.record_event(torch.openreg.Event(enable_timing=True)))
        for e in done:
            e.synchronize()
        # One low-priority copy may have taken the engine before the others arrived; after it,
        # the high-priority copy goes before the remaining ones.
        finished_before_high = sum(e.elapsed_time(done[3]) > 0 for e in done[:3])
        assert finished_before_high <= 1
        assert all(torch.equal(dst.cpu(), expected()) for dst in dsts)
    finally:
        torch.openreg.set_copy_engine_config(*old)


# ---------------------------------------------------------------- asynchronous errors


def test_async_error_is_reported_at_the_next_stream_synchronize(device):
    s = torch.openreg.Stream(device)
    _inject_async_error(s, "simulated device fault")
    with pytest.raises(RuntimeError, match="asynchronous error on stream .*simulated device fault"):
        s.synchronize()
    s.synchronize()  # reported once
    x = torch.ones(3, device=device)
    s.wait_stream(torch.openreg.current_stream(device))  # x's fill may be queued (OPENREG_ASYNC=1)
    with torch.openreg.stream(s):
        assert torch.equal((x + x).cpu(), torch.full((3,), 2.0))  # the stream still works


def test_async_error_is_reported_by_query(device):
    s = torch.openreg.Stream(device)
    _inject_async_error(s, "fault seen by query")
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError, match="fault seen by query"):
        while time.monotonic() < deadline:
            s.query()  # False while the failing task is queued, raises once it ran
            time.sleep(0.001)
    assert s.query()


@pytest.mark.parametrize("sync", [torch.openreg.synchronize, torch.accelerator.synchronize])
def test_async_error_is_reported_by_device_synchronize(device, sync):
    _inject_async_error(torch.openreg.Stream(device), "fault on a side stream")
    with pytest.raises(RuntimeError, match="fault on a side stream"):
        sync(device)
    sync(device)


def test_async_error_after_a_queued_copy_does_not_lose_the_copy(device, slow_copies):
    s = torch.openreg.Stream(device)
    host = torch.zeros(N).pin_memory()
    with torch.openreg.stream(s):
        host.copy_(torch.arange(N, dtype=torch.float32, device=device), non_blocking=True)
    _inject_async_error(s, "late fault")
    with pytest.raises(RuntimeError, match="late fault"):
        s.synchronize()
    assert torch.equal(host, expected())


# ---------------------------------------------------------------- streams and the allocator


def test_allocation_retry_waits_for_stream_work_without_deadlock():
    """Out of memory, the allocator waits for the streams a freed block was recorded on; the work
    it waits for (a queued copy) frees memory when it ends, which needs the allocator too."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        torch.openreg.set_copy_engine_config(latency_us=300_000)
        side = torch.openreg.Stream(0)
        a = torch.empty(5 << 20, device="openreg:0")  # 20 MB
        a.record_stream(side)
        b = torch.empty(5 << 20, device="openreg:0")
        with torch.openreg.stream(side):
            b.copy_(torch.ones(5 << 20).pin_memory(), non_blocking=True)  # queued, holds b
        del a, b
        c = torch.empty(12 << 20, device="openreg:0")  # 48 MB of 64: needs both blocks back
        print("allocated", flush=True)
    """)
    env = dict(os.environ, OPENREG_DEVICE_MEMORY="64MB")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert "allocated" in result.stdout


# ---------------------------------------------------------------- hold_stream (torch_openreg.testing)


def test_hold_stream_keeps_queued_work_pending_until_the_block_ends(device):
    stream = torch.openreg.current_stream(device)
    x = torch.arange(N, dtype=torch.float32, device=device)
    host = torch.zeros(N).pin_memory()
    with hold_stream(stream):
        host.copy_(x, non_blocking=True)
        time.sleep(0.05)  # however long the host waits, the copy stays queued
        assert not stream.query()
        assert torch.count_nonzero(host) == 0
    stream.synchronize()
    assert stream.query()
    assert torch.equal(host, expected())


def test_hold_stream_does_not_hold_other_streams(device):
    side = torch.openreg.Stream(device)
    x = torch.arange(N, dtype=torch.float32, device=device)
    host = torch.zeros(N).pin_memory()
    with hold_stream(torch.openreg.current_stream(device)):
        with torch.openreg.stream(side):
            host.copy_(x, non_blocking=True)
        side.synchronize()
        assert torch.equal(host, expected())


def test_waiting_for_a_held_stream_inside_the_block_times_out_with_an_error(device):
    stream = torch.openreg.current_stream(device)
    with pytest.raises(RuntimeError, match="opened by itself after 0.2 s"):
        with hold_stream(stream, timeout=0.2):
            stream.synchronize()  # a mistake: waits for the end of the block; the timeout ends it
    assert stream.query()


def test_hold_stream_rejects_bad_arguments():
    with pytest.raises(ValueError, match="openreg stream"):
        with hold_stream(torch.Stream("cpu")):
            pass
    with pytest.raises(ValueError, match="timeout must be positive"):
        with hold_stream(timeout=0):
            pass


def test_query_is_true_as_soon_as_synchronize_returns(device):
    # The event behind which synchronize waits completes only after the stream counts the work
    # before it as done, so no window remains where synchronize returned but query() is False.
    x = torch.arange(N, dtype=torch.float32, device=device)
    host = torch.empty(N).pin_memory()
    stream = torch.openreg.current_stream(device)
    for _ in range(200):
        host.copy_(x, non_blocking=True)
        stream.synchronize()
        assert stream.query()


# ---------------------------------------------------------------- a device without an index


@pytest.mark.parametrize("make", [
    lambda: torch.Stream(device="openreg"),
    lambda: torch.Stream(torch.device("openreg")),
    lambda: torch.Stream(device=torch.accelerator.current_accelerator()),
    lambda: torch.Stream(device="openreg", priority=-1),
    lambda: torch.Stream(),
], ids=["str", "device", "current_accelerator", "priority", "no-device"])
def test_stream_without_index_is_on_the_current_device(make):
    # A device without an index means the current device, as everywhere in PyTorch.
    with torch.accelerator.device_index(1):
        s = make()
        assert s.device.type == "openreg"
        assert s.device_index == 1 and s.stream_id != 0
        x = torch.ones(4, device="openreg:1")
        # x is made on the current stream: s must wait for it (with OPENREG_ASYNC=1 the fill may
        # still be queued there).
        s.wait_stream(torch.accelerator.current_stream())
        with s:
            y = x + 1
        s.synchronize()
        assert torch.equal(y.cpu(), torch.full((4,), 2.0))
    assert make().device_index == 0


def test_current_and_default_stream_of_a_device_without_index():
    with torch.accelerator.device_index(1):
        assert torch.accelerator.current_stream(torch.device("openreg")).device_index == 1
        assert torch.openreg.default_stream("openreg").device_index == 1
