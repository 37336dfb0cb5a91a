"""Registration and autoload: the backend is usable after `import torch` alone."""
import os
import subprocess
import sys

import torch


def run(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env)


def test_autoload_makes_the_device_usable_without_importing_the_package():
    r = run("import sys, torch; x = torch.ones(2, device='openreg:1') + 1; "
            "print(x.cpu().tolist(), x.device, 'torch_openreg' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[2.0, 2.0] openreg:1 True"


def test_autoload_can_be_switched_off():
    r = run("import sys, torch; print(hasattr(torch, 'openreg'), 'torch_openreg' in sys.modules)",
            TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False False"
    # ... and importing the package explicitly still registers it.
    r = run("import torch, torch_openreg; print(torch.ones(1, device='openreg').device)",
            TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "openreg:0"


def test_backend_is_renamed_and_device_module_registered():
    assert torch._C._get_privateuse1_backend_name() == "openreg"
    assert torch.get_device_module("openreg") is torch.openreg
    assert torch.device("openreg:1").type == "openreg"


def test_generated_tensor_methods():
    t = torch.ones(2)
    d = t.openreg(1)
    assert d.is_openreg and not t.is_openreg
    assert d.device == torch.device("openreg:1")
    assert d.type() == "torch.openreg.FloatTensor"
    assert torch.ones(2, dtype=torch.int64, device="openreg").type() == "torch.openreg.LongTensor"


def test_generated_storage_and_module_methods():
    s = torch.ones(3).untyped_storage().openreg(1)
    assert s.is_openreg and s.device == torch.device("openreg:1")
    m = torch.nn.Linear(2, 2).openreg()
    assert m.weight.device == torch.device("openreg:0")


def test_packed_sequence_methods():
    from torch.nn.utils.rnn import pack_padded_sequence

    seq = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    moved = seq.openreg()
    assert moved.is_openreg and moved.data.device.type == "openreg"


def test_torch_accelerator_reports_openreg():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("openreg")
    assert torch.accelerator.device_count() == 2


def test_importing_the_package_before_torch_works():
    # torch's import runs the autoload while torch_openreg is still being imported.
    r = run("import torch_openreg, torch; print(torch.ones(1, device='openreg:1').device)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "openreg:1"
    r = run("import runpy, sys; sys.argv = ['x', '--steps', '2']; "
            "runpy.run_module('torch_openreg.demo', run_name='__main__')")
    assert r.returncode == 0, r.stderr


def test_the_demo_says_when_the_machine_was_busy():
    # `make demo` prints its ratios with the machine's load next to them (issue 31): with a
    # CPU-bound process per core running beside it, it must say that the machine was busy.
    spin = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        r = run("import runpy, sys; sys.argv = ['x', '--steps', '40']; "
                "runpy.run_module('torch_openreg.demo', run_name='__main__')")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    assert "machine load: load average" in r.stdout and "other processes used" in r.stdout
    assert "The machine was busy" in r.stdout, r.stdout
