"""Events of the openreg device: record, query, synchronize, wait, elapsed_time; ordering across
streams and devices through events; autograd's cross-stream backward, which uses them."""

import time

import pytest
import torch

N = 1000


def expected():
    return torch.arange(N, dtype=torch.float32)


def test_openreg_event_is_a_torch_event():
    e = torch.openreg.Event(enable_timing=True)
    assert type(e) is torch.Event and isinstance(e, torch.openreg.Event)
    assert e.device.type == "openreg"
    assert not isinstance(torch.Event(device="cpu"), torch.openreg.Event)
    e.record(torch.openreg.Stream(1))
    assert e.device == torch.device("openreg:1")  # set by the first record


def test_record_on_an_idle_stream_completes_at_once(device):
    e = torch.Event(device=device)
    assert e.query()  # never recorded: nothing to wait for
    e.record(torch.openreg.current_stream(device))
    assert e.query()
    e.synchronize()


def test_event_tracks_the_work_queued_before_its_record(device, slow_copies):
    s = torch.openreg.Stream(device)
    host = torch.zeros(N).pin_memory()
    with torch.openreg.stream(s):
        host.copy_(torch.arange(N, dtype=torch.float32, device=device), non_blocking=True)
        e = torch.openreg.Event()
        e.record()  # on the current stream, s
    assert not e.query()
    assert torch.count_nonzero(host) == 0
    e.synchronize()
    assert e.query()
    assert torch.equal(host, expected())


def test_re_recording_an_event_tracks_the_last_record(device, slow_copies):
    busy, idle = torch.openreg.Stream(device), torch.openreg.Stream(device)
    with torch.openreg.stream(busy):
        torch.zeros(N).pin_memory().copy_(torch.ones(N, device=device), non_blocking=True)
    e = torch.openreg.Event()
    e.record(busy)
    assert not e.query()
    e.record(idle)
    assert e.query()


def test_elapsed_time_measures_a_host_sleep(device):
    start, end = torch.openreg.Event(enable_timing=True), torch.openreg.Event(enable_timing=True)
    stream = torch.openreg.current_stream(device)
    start.record(stream)
    time.sleep(0.05)
    end.record(stream)
    end.synchronize()
    assert 49.0 <= start.elapsed_time(end) < 500.0


def test_elapsed_time_measures_the_copy_latency(device, slow_copies):
    s = torch.openreg.Stream(device)
    start, end = torch.Event(enable_timing=True), torch.openreg.Event(enable_timing=True)
    with torch.openreg.stream(s):
        start.record()
        torch.zeros(N).pin_memory().copy_(torch.ones(N, device=device), non_blocking=True)
        end.record()
    end.synchronize()
    ms = start.elapsed_time(end)  # a torch.Event and an openreg event mix freely
    assert slow_copies * 1e3 <= ms < slow_copies * 1e3 + 300


def test_elapsed_time_requires_enable_timing(device):
    a, b = torch.openreg.Event(), torch.openreg.Event(enable_timing=True)
    a.record(torch.openreg.current_stream(device))
    b.record(torch.openreg.current_stream(device))
    with pytest.raises(ValueError, match="enable_timing"):
        a.elapsed_time(b)
    with pytest.raises(ValueError, match="enable_timing"):
        b.elapsed_time(a)


def test_elapsed_time_of_unfinished_events_raises(device, slow_copies):
    s = torch.openreg.Stream(device)
    start, end = torch.openreg.Event(enable_timing=True), torch.openreg.Event(enable_timing=True)
    with torch.openreg.stream(s):
        start.record()
        torch.zeros(N).pin_memory().copy_(torch.ones(N, device=device), non_blocking=True)
        end.record()
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) > 0


def test_event_cannot_be_recorded_on_another_devices_stream():
    e = torch.openreg.Event()
    e.record(torch.openreg.Stream(0))
    with pytest.raises(RuntimeError, match="device index"):
        e.record(torch.openreg.Stream(1))


def test_stream_wait_event_orders_work_across_streams(device, slow_copies):
    side = torch.openreg.Stream(device)
    src = expected().pin_memory()
    racy, ordered = torch.zeros(N, device=device), torch.zeros(N, device=device)
    side.wait_stream(torch.openreg.current_stream(device))  # zeroed on the current stream (queued there with OPENREG_ASYNC=1)
    with torch.openreg.stream(side):
        racy.copy_(src, non_blocking=True)
        ordered.copy_(src, non_blocking=True)
        copied = side.record_event()
    early = racy + 1  # nothing orders the default stream after the copies yet
    current = torch.openreg.current_stream(device)
    t0 = time.perf_counter()
    current.wait_event(copied)
    assert time.perf_counter() - t0 < slow_copies / 2  # the host does not wait, the stream does
    late = ordered + 1
    assert torch.equal(early.cpu(), torch.ones(N))
    assert torch.equal(late.cpu(), expected() + 1)


def test_event_wait_with_torch_event_api(device, slow_copies):
    side = torch.Stream(device=device)
    d = torch.zeros(N, device=device)
    side.wait_stream(torch.accelerator.current_stream(device))  # zeroed on the current stream (queued there with OPENREG_ASYNC=1)
    with side:
        d.copy_(expected().pin_memory(), non_blocking=True)
    e = torch.Event(device=device)
    e.record(side)
    e.wait(torch.accelerator.current_stream(device))
    assert torch.equal((d * 3).cpu(), expected() * 3)


def test_cross_device_ordering_through_an_event(slow_copies):
    s0, s1 = torch.openreg.Stream(0), torch.openreg.Stream(1)
    src = expected().pin_memory()
    a0, b0 = torch.zeros(N, device="openreg:0"), torch.zeros(N, device="openreg:0")
    s0.wait_stream(torch.openreg.current_stream(0))  # zeroed on the current stream (queued there with OPENREG_ASYNC=1)
    with torch.openreg.stream(s0):
        a0.copy_(src, non_blocking=True)
        b0.copy_(src, non_blocking=True)
        copied = s0.record_event()
    with torch.openreg.stream(s1):
        # openreg:0's current stream is its default stream, which s0's copies do not order.
        early = a0.to("openreg:1")
        s1.wait_event(copied)  # a stream of openreg:1 waits for an event of openreg:0
        late = b0.to("openreg:1")
    assert torch.equal(early.cpu(), torch.zeros(N))
    assert torch.equal(late.cpu(), expected())


def test_stream_record_event_and_wait_stream_api(device, slow_copies):
    a, b = torch.openreg.Stream(device), torch.openreg.Stream(device, priority=-1)
    d = torch.zeros(N, device=device)
    a.wait_stream(torch.openreg.current_stream(device))  # d is zeroed on the current stream
    with torch.openreg.stream(a):
        d.copy_(expected().pin_memory(), non_blocking=True)
    e = a.record_event()
    assert isinstance(e, torch.openreg.Event) and not e.query()
    b.wait_stream(a)
    with torch.openreg.stream(b):
        out = d.sum()
        total = out.item()  # on b: after the sum (the default stream does not wait for b)
    assert total == expected().sum().item()
    assert e.query()


# ---------------------------------------------------------------- autograd across streams


def _reference_grads(x, w1, w2):
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    h = (x @ w1).relu()
    loss = ((h @ w2).tanh() ** 2).sum() + (h * 0.5).sum()
    loss.backward()
    return w1.grad, w2.grad


def test_backward_of_tensors_made_on_side_streams(device, slow_copies):
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)
    ref1, ref2 = _reference_grads(x, w1, w2)

    d1 = w1.to(device).requires_grad_()
    d2 = w2.to(device).requires_grad_()
    s1, s2 = torch.openreg.Stream(device), torch.openreg.Stream(device, priority=-1)
    with torch.openreg.stream(s1):
        dx = x.pin_memory().to(device, non_blocking=True)  # in flight on s1
        h = (dx @ d1).relu()
    s2.wait_stream(s1)
    with torch.openreg.stream(s2):
        branch = (h @ d2).tanh() ** 2
    torch.openreg.current_stream(device).wait_stream(s2)
    torch.openreg.current_stream(device).wait_stream(s1)
    loss = branch.sum() + (h * 0.5).sum()
    loss.backward()  # the engine runs each node on its forward stream and syncs them with events
    torch.testing.assert_close(d1.grad.cpu(), ref1)
    torch.testing.assert_close(d2.grad.cpu(), ref2)


def test_backward_called_inside_a_side_stream(device):
    g = torch.Generator().manual_seed(1)
    x, w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)
    ref1, ref2 = _reference_grads(x, w1, w2)
    d1, d2 = w1.to(device).requires_grad_(), w2.to(device).requires_grad_()
    s = torch.openreg.Stream(device)
    dx = x.to(device)
    s.wait_stream(torch.openreg.current_stream(device))
    with torch.openreg.stream(s):
        h = (dx @ d1).relu()
        loss = ((h @ d2).tanh() ** 2).sum() + (h * 0.5).sum()
        loss.backward()
        grads = d1.grad.cpu(), d2.grad.cpu()
    torch.testing.assert_close(grads[0], ref1)
    torch.testing.assert_close(grads[1], ref2)
