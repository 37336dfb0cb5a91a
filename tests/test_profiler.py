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
    # The kernel ran inside its op, on the device of its operands, on the current stream.
    kernels = [e for e in device_events(prof) if "aten::mm" in e.name]
    assert len(kernels) == 2
    for k, op in zip(kernels, mms):
        assert k.device_index == 0
        assert op.time_range.start <= k.time_range.start <= k.time_range.end <= op.time_range.end
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
    with torch.autograd.profiler.profile(use_device="openreg", use_kineto=use_kineto) as prof:
        torch.mm(small, small)
        torch.mm(big, big)
    mms = [e for e in prof.function_events if e.name == "aten::mm"]
    assert len(mms) == 2
    assert 0 < mms[0].device_time_total and 5 * mms[0].device_time_total < mms[1].device_time_total
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
