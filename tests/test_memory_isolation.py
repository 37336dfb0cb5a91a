"""Memory isolation (csrc/runtime/memory.cpp): with OPENREG_STRICT_MEMORY=1, device memory is not
accessible to host code except inside the runtime's kernels and copies, so a host access through a
raw device pointer is caught, as it would be on a real accelerator. Every strict-mode test runs in a
subprocess (a caught access ends the process)."""

import os
import subprocess
import sys
import textwrap

import pytest

RAW_READ = """
    import ctypes, torch
    x = torch.arange(10.0, device="openreg:1")
    torch.openreg.synchronize(1)  # the host must wait for the device's kernels (OPENREG_ASYNC)
    print("before", flush=True)
    value = ctypes.c_float.from_address(x.data_ptr() + 4 * 3).value  # host reads device memory
    print("read", value, flush=True)
"""

RAW_WRITE = """
    import ctypes, torch
    x = torch.zeros(10, device="openreg:0")
    torch.openreg.synchronize(0)  # the host must wait for the device's kernels (OPENREG_ASYNC)
    print("before", flush=True)
    ctypes.c_float.from_address(x.data_ptr()).value = 5.0  # host writes device memory
    print("written", x[0].item(), flush=True)
"""


def run(code, strict, *python_flags):
    env = dict(os.environ, OPENREG_STRICT_MEMORY="1" if strict else "0")
    return subprocess.run([sys.executable, *python_flags, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("code", [RAW_READ, RAW_WRITE], ids=["read", "write"])
@pytest.mark.parametrize("flags", [(), ("-X", "faulthandler")], ids=["plain", "faulthandler"])
def test_strict_mode_catches_host_access_to_device_memory(code, flags):
    r = run(code, True, *flags)
    assert r.returncode != 0
    assert "before" in r.stdout and "read" not in r.stdout and "written" not in r.stdout
    assert "host code accessed device memory" in r.stderr
    assert "OPENREG_STRICT_MEMORY=1" in r.stderr
    assert "tensor.cpu()" in r.stderr


def test_default_mode_does_not_protect_device_memory():
    # Documented: without strict mode, device memory is ordinary host memory.
    r = run(RAW_READ, False)
    assert r.returncode == 0, r.stderr
    assert "read 3.0" in r.stdout
    r = run(RAW_WRITE, False)
    assert r.returncode == 0, r.stderr
    assert "written 5.0" in r.stdout


WORKLOAD = """
    import torch
    torch.manual_seed(0)
    out = []
    a = torch.randn(16, 16)
    for dev in ["cpu", "openreg:0"]:
        x = a.to(dev)
        y = (x @ x.t()).relu().sum(dim=1)  # kernels through the fallback
        z = x.to("openreg:1").mul(2).to(dev)  # cross-device copies
        pinned = torch.empty(16, 16).pin_memory()
        pinned.copy_(x * 3, non_blocking=True)  # asynchronous copy
        torch.accelerator.synchronize()
        v = x[2:5, ::3].contiguous().view(-1)  # views
        r = x.clone().view(-1)
        r.resize_(300)  # storage growth copies device memory
        out.append([y.cpu(), z.cpu(), pinned.clone(), v.cpu(), r[:256].cpu()])
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        data, target = a.to(dev), torch.arange(16).remainder(4).to(dev)
        for _ in range(4):
            loss = torch.nn.functional.cross_entropy(model(data), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[-1].append(model[0].weight.detach().cpu())
    for c, d in zip(*out):
        torch.testing.assert_close(c, d)
    print(torch.ones(2, device="openreg:0"))  # printing reads device memory through the runtime
    print("ok")
"""


def test_ops_copies_printing_and_training_work_in_strict_mode():
    r = run(WORKLOAD, True)
    assert r.returncode == 0, r.stderr
    assert "tensor([1., 1.], device='openreg:0')" in r.stdout
    assert r.stdout.strip().endswith("ok")
