"""Device management: torch.openreg's device API, the per-thread current device, lazy init,
OPENREG_DEVICE_COUNT, properties, and the device-generic torch.accelerator view of them."""
import os
import subprocess
import sys
import threading

import pytest
import torch


def run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=120)


def test_count_and_availability():
    assert torch.openreg.is_available()
    assert torch.openreg.device_count() == 2
    assert torch.accelerator.device_count() == 2


@pytest.mark.parametrize("count", ["1", "4"])
def test_device_count_comes_from_the_environment(count):
    r = run("import torch; print(torch.openreg.device_count()); "
            f"x = torch.ones(1, device='openreg:{int(count) - 1}'); print(x.device)",
            OPENREG_DEVICE_COUNT=count)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [count, f"openreg:{int(count) - 1}"]


def test_zero_devices_means_unavailable_not_a_crash():
    r = run("import torch; print(torch.openreg.is_available(), torch.openreg.device_count())",
            OPENREG_DEVICE_COUNT="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "0"]


def test_set_device_changes_where_tensors_are_created():
    prev = torch.openreg.current_device()
    try:
        torch.openreg.set_device(1)
        assert torch.openreg.current_device() == 1
        assert torch.ones(1, device="openreg").device == torch.device("openreg:1")
        torch.openreg.set_device("openreg:0")
        assert torch.ones(1, device="openreg").device == torch.device("openreg:0")
        torch.accelerator.set_device_index(1)
        assert torch.accelerator.current_device_index() == 1
    finally:
        torch.openreg.set_device(prev)


def test_device_context_manager_restores_on_exit_and_on_exception():
    assert torch.openreg.current_device() == 0
    with torch.openreg.device(1):
        assert torch.openreg.current_device() == 1
        assert torch.empty(1, device="openreg").device.index == 1
    assert torch.openreg.current_device() == 0
    with pytest.raises(ZeroDivisionError):
        with torch.openreg.device("openreg:1"):
            1 / 0
    assert torch.openreg.current_device() == 0
    with torch.accelerator.device_index(1):
        assert torch.openreg.current_device() == 1
    assert torch.openreg.current_device() == 0


def test_device_of_follows_a_tensor():
    t = torch.ones(1, device="openreg:1")
    with torch.openreg.device_of(t):
        assert torch.openreg.current_device() == 1
    with torch.openreg.device_of(torch.ones(1)):  # a CPU tensor changes nothing
        assert torch.openreg.current_device() == 0


def test_current_device_is_per_thread():
    seen = {}

    def worker():
        seen["start"] = torch.openreg.current_device()
        torch.openreg.set_device(1)
        seen["after"] = torch.openreg.current_device()

    torch.openreg.set_device(0)
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen == {"start": 0, "after": 1}
    assert torch.openreg.current_device() == 0


def test_out_of_range_index_is_a_clear_error():
    with pytest.raises(RuntimeError, match="(?i)device index is out of range"):
        torch.openreg.set_device(2)
    with pytest.raises(RuntimeError, match="(?i)device index is out of range"):
        torch.openreg.get_device_properties(5)
    with pytest.raises(ValueError, match="openreg"):
        torch.openreg.set_device("cpu")


def test_properties_name_and_capability():
    props = torch.openreg.get_device_properties(1)
    assert props.name == torch.openreg.get_device_name(1) == "OpenReg Simulated Device"
    assert props.total_memory == torch.openreg.mem_get_info(1)[1] > 0
    assert torch.openreg.get_device_capability() == (props.major, props.minor)
    assert props.multi_processor_count >= 1


def test_device_memory_capacity_comes_from_the_environment():
    r = run("import torch; print(torch.openreg.get_device_properties(0).total_memory)",
            OPENREG_DEVICE_MEMORY="512MB")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 512 * 2**20


def test_lazy_initialisation():
    r = run("import torch; print(torch.openreg.is_initialized()); "
            "torch.ones(1, device='openreg'); print(torch.openreg.is_initialized())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
    r = run("import torch; torch.openreg.init(); print(torch.openreg.is_initialized())")
    assert r.stdout.split() == ["True"]


def test_synchronize_accepts_every_device_spelling():
    torch.openreg.synchronize()
    torch.openreg.synchronize(1)
    torch.openreg.synchronize("openreg:1")
    torch.openreg.synchronize(torch.device("openreg:0"))
    torch.accelerator.synchronize(1)
