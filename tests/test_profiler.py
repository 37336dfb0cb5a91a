"""The profiler sees the device (docs/profiler.md): kernels and copies recorded by the runtime
with device, stream and device-side times, linked to the CPU op that issued them."""
import json

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import torch_openreg  # noqa: F401
from torch_openreg import _C

DEVICE_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def device_events(prof):
    return [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]


def chrome_trace(prof, tmp_path):
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def test_device_activity_is_supported_and_plugin_registered():
    assert ProfilerActivity.PrivateUse1 in torch.profiler.supported_activities()
    with profile(activities=DEVICE_ACTIVITIES):
        torch.ones(4, device="openreg").add_(1)
    assert _C._profiler_registered()


# [docs:start TEST_KERNEL_TIME]
def test_kernel_device_time_is_measured_and_grows_with_the_work():
    small = torch.randn(16, 16, device="openreg")
    big = torch.randn(512, 512, device="openreg")
    torch.mm(small, small), torch.mm(big, big)  # warm up
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        torch.mm(small, small)
        torch.mm(big, big)
    mms = [e for e in prof.events() if e.name == "aten::mm"]
    assert len(mms) == 2
    t_small, t_big = (e.device_time_total for e in mms)
    assert t_small > 0 and t_big > 0
    assert t_big > 5 * t_small  # 32768x the flops; the small one is mostly fixed costs
    # The kernel ran on the device of its operands, on the current stream: inside its op in the
    # default mode, after its launch in the asynchronous kernel mode (docs/async_mode.md).
    kernels = [e for e in device_events(prof) if "aten::mm" in e.name]
    assert len(kernels) == 2
    for k, op in zip(kernels, mms):
        assert k.device_index == 0
        assert op.time_range.start <= k.time_range.start <= k.time_range.end
        if not torch.openreg.is_async():
            assert k.time_range.end <= op.time_range.end
    assert "openreg kernel" in prof.key_averages().table(sort_by="device_time_total", row_limit=5)
# [docs:end TEST_KERNEL_TIME]


def test_cpu_only_profiling_records_no_device_work():
    x = torch.randn(64, 64, device="openreg")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(x, x)
    assert device_events(prof) == []
    assert all(e.device_time_total == 0 for e in prof.events())


def test_copies_have_direction_bytes_and_time(tmp_path):
    n = 1 << 18
    host = torch.randn(n)
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        d0 = host.to("openreg:0")            # HtoD
        d1 = d0.to("openreg:1")              # DtoD, onto device 1
        back = d1.cpu()                      # DtoH
    assert torch.equal(back, host)
    copies = [e for e in chrome_trace(prof, tmp_path) if e.get("cat") == "gpu_memcpy"]
    by_name = {e["name"]: e for e in copies}
    assert set(by_name) == {"Memcpy HtoD (Host -> openreg)", "Memcpy DtoD (openreg -> openreg)",
                            "Memcpy DtoH (openreg -> Host)"}
    for e in copies:
        assert e["args"]["bytes"] == 4 * n
        assert e["dur"] > 0
    assert by_name["Memcpy HtoD (Host -> openreg)"]["pid"] == 0
    assert by_name["Memcpy DtoD (openreg -> openreg)"]["pid"] == 1  # the destination's device
    assert by_name["Memcpy DtoH (openreg -> Host)"]["pid"] == 1
    # Each copy is attributed to the op that issued it.
    copy_ops = [e for e in prof.events() if e.name == "aten::copy_"]
    assert sum(1 for e in copy_ops if e.device_time_total > 0) == 3


def test_async_copy_time_is_the_copy_engine_time():
    host = torch.randn(1024).pin_memory()
    old = torch.openreg.set_copy_engine_config(latency_us=20_000)
    try:
        with profile(activities=DEVICE_ACTIVITIES) as prof:
            dev = host.to("openreg", non_blocking=True)
        torch.openreg.synchronize()
    finally:
        torch.openreg.set_copy_engine_config(old.latency_us, old.bandwidth_gbps)
    assert torch.equal(dev.cpu(), host)
    [copy] = [e for e in device_events(prof) if e.name.startswith("Memcpy HtoD")]
    assert copy.time_range.elapsed_us() >= 20_000  # the engine held the copy for its latency
    # Recorded by the stream's worker, still attributed to the op that queued it.
    [op] = [e for e in prof.events() if e.name == "aten::copy_"]
    assert op.device_time_total >= 20_000
    assert op.cpu_time_total < 20_000  # the host did not wait for it


def test_each_stream_has_its_own_row(tmp_path):
    x = torch.randn(128, 128, device="openreg")
    side = torch.openreg.Stream()
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        torch.mm(x, x)
        with torch.openreg.stream(side):
            torch.mm(x, x)
    events = chrome_trace(prof, tmp_path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert sorted(e["tid"] for e in kernels) == sorted([0, side.stream_id])
    assert all(e["pid"] == 0 and e["args"]["stream"] == e["tid"] for e in kernels)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert rows[(0, side.stream_id)] == f"stream {side.stream_id}"
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names[0] == "openreg:0"


def test_backward_kernels_are_recorded_on_the_device_thread():
    w = torch.randn(256, 256, device="openreg", requires_grad=True)
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        (w @ w).sum().backward()
    mm_kernels = [e for e in device_events(prof) if "aten::mm" in e.name]
    assert len(mm_kernels) == 3  # forward + two in backward
    assert all(e.time_range.elapsed_us() > 0 for e in mm_kernels)


@pytest.mark.parametrize("use_kineto", [False, True])
def test_autograd_profiler_use_device(use_kineto):
    # use_kineto=False (the default): the legacy stubs time each op with device events;
    # use_kineto=True: the Kineto plugin, as torch.profiler.
    small = torch.randn(16, 16, device="openreg")
    big = torch.randn(512, 512, device="openreg")
    torch.mm(small, small), torch.mm(big, big)  # warm up
    repeats = 5
    with torch.autograd.profiler.profile(use_device="openreg", use_kineto=use_kineto) as prof:
        for _ in range(repeats):
            torch.mm(small, small)
            torch.mm(big, big)
    mms = [e for e in prof.function_events if e.name == "aten::mm"]
    assert len(mms) == 2 * repeats
    # Each op gets its own device time. The fastest of the repeats: on a busy machine a kernel's
    # thread can lose its core between the device events around it (seen in CI under xdist).
    small_time = min(e.device_time_total for e in mms[0::2])
    big_time = min(e.device_time_total for e in mms[1::2])
    assert 0 < small_time and 5 * small_time < big_time
    table = prof.key_averages().table(sort_by="device_time_total")
    assert "OPENREG total" in table


def test_profile_memory_records_device_allocations_and_frees():
    with profile(activities=DEVICE_ACTIVITIES, profile_memory=True) as prof:
        x = torch.empty(1 << 20, device="openreg")  # 4 MiB
        del x
    [empty] = [e for e in prof.events() if e.name == "aten::empty"]
    assert empty.device_memory_usage == 4 << 20
    assert empty.cpu_memory_usage == 0
    frees = [e for e in prof.events() if e.name == "[memory]" and e.device_memory_usage < 0]
    assert [e.device_memory_usage for e in frees] == [-(4 << 20)]


def flows(events):
    """{flow id: (start event, end event)} of the trace's CPU-to-device links."""
    starts = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e.get("cat") == "ac2g" and e["ph"] == "f"}
    assert set(starts) == set(ends)
    return {i: (starts[i], ends[i]) for i in starts}


# [docs:start TEST_FLOWS]
def test_trace_links_each_launch_to_its_device_work(tmp_path):
    x = torch.randn(64, 64, device="openreg")
    host = torch.randn(1 << 16).pin_memory()
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        torch.mm(x, x)                                 # a kernel
        x.zero_()                                      # a memset
        dev = host.to("openreg", non_blocking=True)    # an asynchronous copy
    assert torch.equal(dev.cpu(), host)
    events = chrome_trace(prof, tmp_path)
    [mm_op] = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    # (torch's profiler synchronizes the device as it stops: that wait is recorded too)
    calls = {e["name"]: e for e in events if e.get("cat") == "privateuse1_runtime"
             and not e["name"].endswith("Synchronize")}
    assert set(calls) == {"openregLaunchKernel", "openregMemset", "openregMemcpy"}
    device_work = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    assert len(device_work) == 3
    links = flows(events)
    assert len(links) == 3
    for start, end in links.values():
        # The arrow starts at the runtime call on the issuing thread (the op's row)...
        [call] = [c for c in calls.values() if c["ts"] == start["ts"]]
        assert (start["pid"], start["tid"]) == (call["pid"], call["tid"]) == (mm_op["pid"], mm_op["tid"])
        # ...and ends on the device work it issued, on the device's row.
        [work] = [w for w in device_work if w["ts"] == end["ts"]]
        assert (end["pid"], end["tid"]) == (work["pid"], work["tid"]) == (0, 0)
        assert end["bp"] == "e"
        assert work["ts"] >= call["ts"]
    # The kernel starts when its launch returns (its stream is free) and, in the default mode,
    # runs inside its op, on the op's thread (in the asynchronous kernel mode the stream's worker
    # runs it later, docs/async_mode.md); the asynchronous copy lands after its call returned (it
    # was only queued).
    kernel = next(w for w in device_work if w["cat"] == "kernel")
    launch = calls["openregLaunchKernel"]
    assert mm_op["ts"] <= launch["ts"] <= launch["ts"] + launch["dur"] <= kernel["ts"] + 0.01
    if not torch.openreg.is_async():
        assert kernel["ts"] + kernel["dur"] <= mm_op["ts"] + mm_op["dur"] + 0.01
    copy = next(w for w in device_work if w["cat"] == "gpu_memcpy")
    assert copy["ts"] >= calls["openregMemcpy"]["ts"] + calls["openregMemcpy"]["dur"]
# [docs:end TEST_FLOWS]


def test_memset_is_its_own_activity_with_bytes():
    x = torch.randn(1 << 18, device="openreg")
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        x.zero_()
        x.fill_(2.0)  # a fill is a kernel, not a memset
    [memset] = [e for e in device_events(prof) if e.name == "Memset (openreg)"]
    assert memset.time_range.elapsed_us() > 0
    [zero] = [e for e in prof.events() if e.name == "aten::zero_"]
    assert zero.device_time_total > 0
    assert [e.name for e in device_events(prof) if "kernel" in e.name] == ["aten::fill_ (openreg kernel)"]
    table = prof.key_averages().table(sort_by="device_time_total")
    assert "Memset (openreg)" in table


def test_host_waits_are_recorded_on_the_waiting_thread(tmp_path):
    host = torch.randn(1024).pin_memory()
    stream = torch.openreg.Stream()
    old = torch.openreg.set_copy_engine_config(latency_us=20_000)
    try:
        with profile(activities=DEVICE_ACTIVITIES) as prof:
            host.to("openreg", non_blocking=True)
            torch.openreg.synchronize()                   # device: waits for the copy
            with torch.openreg.stream(stream):
                host.to("openreg", non_blocking=True)
            stream.synchronize()                          # stream
            host.to("openreg", non_blocking=True)
            event = torch.openreg.Event()
            event.record()
            event.synchronize()                           # event
            torch.openreg.synchronize()                   # nothing pending: no wait recorded
    finally:
        torch.openreg.set_copy_engine_config(old.latency_us, old.bandwidth_gbps)
    waits = [e for e in chrome_trace(prof, tmp_path) if e.get("cat") == "privateuse1_runtime"
             and e["name"].endswith("Synchronize")]
    assert [e["name"] for e in waits] == ["openregDeviceSynchronize", "openregStreamSynchronize",
                                          "openregEventSynchronize"]
    for e in waits:
        assert e["dur"] >= 5_000  # blocked for (most of) the copy's 20 ms latency
    assert waits[1]["args"]["stream"] == stream.stream_id


def test_occl_collective_is_recorded_as_device_work(tmp_path):
    import torch.distributed as dist

    import torch_openreg.distributed  # noqa: F401  registers occl

    store = dist.HashStore()
    dist.init_process_group("occl", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1 << 16, device="openreg")
        with profile(activities=DEVICE_ACTIVITIES) as prof:
            dist.all_reduce(t)
    finally:
        dist.destroy_process_group()
    assert torch.equal(t.cpu(), torch.ones(1 << 16))
    events = chrome_trace(prof, tmp_path)
    [coll] = [e for e in events if e.get("cat") == "kernel" and "occl:" in e["name"]]
    assert coll["name"] == "occl:allreduce (openreg collective)"
    assert coll["args"]["bytes"] == 4 << 16 and coll["pid"] == 0
    [link] = [s for s, f in flows(events).values() if f["ts"] == coll["ts"]]
    [call] = [e for e in events if e.get("cat") == "privateuse1_runtime" and e["ts"] == link["ts"]]
    assert call["name"] == "occlCollective"


def test_graph_replay_is_one_device_activity():
    x = torch.randn(64, 64, device="openreg")
    graph = torch.accelerator.Graph()
    with torch.openreg.graph(graph):
        y = (x @ x).relu()
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        graph.replay()
    assert torch.allclose(y.cpu(), (x.cpu() @ x.cpu()).relu())
    [replay] = device_events(prof)
    assert replay.name == "Graph replay (openreg)"
    assert replay.time_range.elapsed_us() > 0
    assert [e.name for e in prof.events() if e.name.startswith("openreg")] == ["openregGraphLaunch"]
