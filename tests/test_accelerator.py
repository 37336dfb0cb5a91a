"""The device-agnostic API of torch 2.13 on openreg: torch.accelerator, torch.Stream/Event/
Generator with a device without an index, torch.amp, torch.get_device_module (docs/device.md,
"Device-agnostic API"). Streams, events, generators, memory and graphs have their own test
files; this one checks the entry points device-agnostic code goes through."""

import pytest
import torch

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}


def test_get_device_capability_reports_the_supported_dtypes():
    cap = torch.accelerator.get_device_capability()
    dtypes = cap["supported_dtypes"]
    assert {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
            torch.bool, torch.int64, torch.uint64, torch.float8_e4m3fn} <= dtypes
    assert not dtypes & QUANTIZED
    assert torch.accelerator.get_device_capability("openreg:1") == cap
    assert torch.accelerator.get_device_capability(torch.device("openreg")) == cap


def test_get_device_capability_is_truthful():
    # Every reported dtype can be allocated on the device and copied there and back; the others
    # cannot be allocated.
    dtypes = torch.accelerator.get_device_capability(0)["supported_dtypes"]
    for dt in ALL_DTYPES:
        if dt in dtypes:
            t = torch.empty(3, dtype=dt, device="openreg")
            assert t.dtype == dt
            try:  # dtypes the CPU itself can convert to (not the bit and sub-byte types)
                src = torch.ones(3, dtype=torch.complex64 if dt.is_complex else torch.float32).to(dt)
            except (RuntimeError, NotImplementedError):
                continue
            back = src.to("openreg").cpu()
            assert back.dtype == dt and torch.equal(back.view(torch.uint8), src.view(torch.uint8))
        else:
            with pytest.raises(NotImplementedError):
                torch.empty(3, dtype=dt, device="openreg")


def test_get_device_capability_out_of_range():
    with pytest.raises(RuntimeError, match="device index is out of range"):
        torch.accelerator.get_device_capability(5)


def test_named_tensors_behave_as_on_the_cpu():
    # torch 2.13 removed named tensors: the CPU refuses `names=` with a TypeError, and so does
    # openreg, with the same message.
    for factory in (lambda d: torch.empty(2, 3, names=("a", "b"), device=d),
                    lambda d: torch.zeros(2, 3, names=("a", "b"), device=d)):
        with pytest.raises(TypeError) as cpu:
            factory("cpu")
        with pytest.raises(TypeError) as dev:
            factory("openreg")
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("device", ["openreg", torch.device("openreg"), None])
def test_device_without_index_means_the_current_device(device):
    with torch.accelerator.device_index(1):
        assert torch.accelerator.current_stream(device).device_index == 1
        assert torch.Generator(device or "openreg").device == torch.device("openreg:1")
        assert torch.ones(1, device=device or "openreg").device == torch.device("openreg:1")
        assert torch.get_device_module(device or "openreg") is torch.openreg
        torch.accelerator.synchronize(device)
        assert torch.accelerator.memory_allocated(device) == torch.openreg.memory_allocated(1)
        assert torch.accelerator.get_memory_info(device) == torch.openreg.mem_get_info(1)
        e = torch.Event(device or "openreg")
        e.record()
        assert e.device == torch.device("openreg:1")


def test_set_device_index_needs_an_index_as_on_cuda():
    # torch.accelerator.set_device_index refuses a device without an index for every backend.
    with pytest.raises(ValueError, match="specified index"):
        torch.accelerator.set_device_index(torch.device("openreg"))


def test_accelerator_entry_points():
    assert torch.accelerator.current_accelerator() == torch.device("openreg")
    assert torch.accelerator.current_accelerator(check_available=True) == torch.device("openreg")
    assert torch.accelerator.is_available() and torch.accelerator.device_count() == 2
    with torch.accelerator.device_index(1):
        assert torch.accelerator.current_device_index() == 1
    with torch.accelerator.device_index(None):
        assert torch.accelerator.current_device_index() == 0
    s = torch.Stream(device="openreg:1")
    prev = torch.accelerator.current_stream(1)
    torch.accelerator.set_stream(s)
    try:
        assert torch.accelerator.current_stream(1) == s
        assert torch.accelerator.current_device_index() == 1
    finally:
        torch.accelerator.set_stream(prev)
        torch.accelerator.set_device_index(0)
    x = torch.ones(1024, device="openreg")
    assert torch.accelerator.memory_allocated() >= 4096
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] >= 4096
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    del x
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()
    assert torch.accelerator.memory_reserved() == torch.openreg.memory_reserved()


def test_get_device_module():
    assert torch.get_device_module() is torch.openreg
    assert torch.get_device_module("openreg:1") is torch.openreg
    assert torch.get_device_module(torch.device("openreg")) is torch.openreg


def test_amp_entry_points():
    assert torch.amp.is_autocast_available("openreg")
    x = torch.ones(4, 4, device="openreg")
    with torch.amp.autocast("openreg", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("openreg")
        assert (x @ x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("openreg")
    old = torch.get_autocast_dtype("openreg")
    torch.set_autocast_dtype("openreg", torch.float16)
    try:
        with torch.autocast("openreg"):
            assert (x @ x).dtype == torch.float16
    finally:
        torch.set_autocast_dtype("openreg", old)

    @torch.amp.custom_fwd(device_type="openreg", cast_inputs=torch.float16)
    def f(a):
        return a.dtype

    with torch.autocast("openreg"):
        assert f(x) == torch.float16
    scaler = torch.amp.GradScaler("openreg")
    p = torch.nn.Parameter(torch.ones(2, device="openreg"))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale((p * 2).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach().cpu(), torch.full((2,), -1.0))
