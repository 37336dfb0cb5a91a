"""Device profiles (torch_openreg/device_profiles.py, csrc/runtime/device_profile.{h,cpp},
docs/device_profiles.md): openreg refusing dtypes, as MPS refuses float64.

A profile is fixed before the devices are initialised, so each profile runs in a subprocess: one
script per profile runs every case and reports, per case, the exception raised (type and message)
and whether device memory was left allocated; the tests below read that report.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Each case: a name and the code of a function body run on openreg under the profile.
CASES = r'''
import io, json, sys, torch

def buggy_normalize(x):          # a library's habit: compute in float64, hand back float32
    x64 = x.double()
    return ((x64 - x64.mean()) / x64.std()).float()

def fixed_normalize(x):
    return (x - x.mean()) / x.std()

buf = io.BytesIO()
torch.save(torch.arange(4, dtype=torch.float64), buf)
x = torch.arange(6, dtype=torch.float32, device="openreg")

cases = {
    "factory": lambda: torch.zeros(2, dtype=torch.float64, device="openreg"),
    "factory_device1": lambda: torch.ones(2, dtype=torch.float64, device="openreg:1"),
    "tensor": lambda: torch.tensor([1.0, 2.0], dtype=torch.float64, device="openreg"),
    "arange": lambda: torch.arange(3, dtype=torch.float64, device="openreg"),
    "to_host_double": lambda: torch.ones(2, dtype=torch.float64).to("openreg"),
    "double": lambda: x.double(),
    "to_dtype": lambda: x.to(torch.float64),
    "empty_like": lambda: torch.empty_like(x, dtype=torch.float64),
    "new_zeros": lambda: x.new_zeros(3, dtype=torch.float64),
    "sum_dtype": lambda: x.sum(dtype=torch.float64),
    "cumsum_dtype": lambda: torch.cumsum(x, 0, dtype=torch.float64),
    "load": lambda: torch.load(io.BytesIO(buf.getvalue()), map_location="openreg"),
    "complex128": lambda: torch.zeros(2, dtype=torch.complex128, device="openreg"),
    "fft": lambda: torch.fft.fft(x),
    "bf16": lambda: x.to(torch.bfloat16),
    "buggy_library": lambda: buggy_normalize(x),
    "fixed_library": lambda: fixed_normalize(x),
    "float32": lambda: (x * 2).sum().item(),
    "complex64": lambda: torch.zeros(2, dtype=torch.complex64, device="openreg").abs(),
    "cpu_double": lambda: torch.ones(2, dtype=torch.float64) * 2,
}
torch.openreg.synchronize()
base = [torch.openreg.memory_allocated(d) for d in range(2)]
report = {}
for name, case in cases.items():
    try:
        case()
        outcome = {"raised": None}
    except Exception as e:
        outcome = {"raised": type(e).__name__, "message": str(e).splitlines()[0]}
    torch.openreg.synchronize()
    outcome["leaked"] = [torch.openreg.memory_allocated(d) - base[d] for d in range(2)]
    report[name] = outcome
report["profile"] = torch.openreg.get_device_profile()
report["bf16_supported"] = torch.openreg.is_bf16_supported()
report["amp_dtypes"] = [str(d) for d in torch.openreg.get_amp_supported_dtype()]
report["float64_supported"] = torch.openreg.is_dtype_supported(torch.float64)
try:
    torch.openreg.set_device_profile("")
    report["set_after_init"] = None
except RuntimeError as e:
    report["set_after_init"] = str(e)
print("REPORT" + json.dumps(report))
'''


def run_cases(env=None, prologue=""):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("OPENREG_DEVICE_PROFILE", None)
    full_env.update(env or {})
    result = subprocess.run([sys.executable, "-c", prologue + CASES], capture_output=True,
                            text=True, timeout=300, env=full_env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


@pytest.fixture(scope="module")
def no_profile():
    return run_cases()


@pytest.fixture(scope="module")
def no_float64():
    return run_cases({"OPENREG_DEVICE_PROFILE": "no-float64"})


@pytest.fixture(scope="module")
def no_complex_no_bf16():
    # Set at run time, before the first use, through the Python API.
    return run_cases(prologue="import torch\ntorch.openreg.set_device_profile('no-complex, no-bfloat16')\n")


FLOAT64_CASES = ["factory", "tensor", "arange", "to_host_double", "double", "to_dtype",
                 "empty_like", "new_zeros", "sum_dtype", "cumsum_dtype", "load", "buggy_library"]


def test_without_a_profile_every_case_runs(no_profile):
    for name in FLOAT64_CASES + ["complex128", "fft", "bf16", "fixed_library"]:
        assert no_profile[name]["raised"] is None, (name, no_profile[name])
    assert no_profile["profile"] == ""
    assert no_profile["bf16_supported"] and no_profile["float64_supported"]


@pytest.mark.parametrize("case", FLOAT64_CASES)
def test_no_float64_refuses_creating_or_computing_in_float64(no_float64, case):
    outcome = no_float64[case]
    assert outcome["raised"] == "TypeError", outcome
    message = outcome["message"]
    assert "float64" in message and "openreg:0" in message and "'no-float64'" in message, message
    assert "Please use float32 instead" in message


def test_no_float64_names_the_device(no_float64):
    assert "openreg:1" in no_float64["factory_device1"]["message"]


def test_no_float64_leaves_no_memory_behind(no_float64):
    for case in FLOAT64_CASES + ["factory_device1"]:
        assert no_float64[case]["leaked"] == [0, 0], (case, no_float64[case])


def test_no_float64_refuses_complex128_and_keeps_the_rest(no_float64):
    assert no_float64["complex128"]["raised"] == "TypeError"
    assert "complex128" in no_float64["complex128"]["message"]
    for case in ["float32", "complex64", "fft", "bf16", "fixed_library", "cpu_double"]:
        assert no_float64[case]["raised"] is None, (case, no_float64[case])
    assert no_float64["profile"] == "no-float64"
    assert not no_float64["float64_supported"] and no_float64["bf16_supported"]


def test_a_float64_habit_passes_without_the_profile_and_fails_with_it(no_profile, no_float64):
    """The complement: the buggy function passes on openreg without the profile (and on the
    CPU), and fails under it; the fixed one passes in both."""
    x = torch.arange(6, dtype=torch.float32)
    assert torch.allclose(((x.double() - x.double().mean()) / x.double().std()).float(),
                          (x - x.mean()) / x.std())
    assert no_profile["buggy_library"]["raised"] is None
    assert no_float64["buggy_library"]["raised"] == "TypeError"
    assert no_float64["fixed_library"]["raised"] is None


def test_combined_profile_set_at_run_time(no_complex_no_bf16):
    r = no_complex_no_bf16
    assert r["profile"] == "no-complex,no-bfloat16"
    for case, dtype in [("fft", "complex64"), ("complex64", "complex64"),
                        ("complex128", "complex128"), ("bf16", "bfloat16")]:
        assert r[case]["raised"] == "TypeError", (case, r[case])
        assert dtype in r[case]["message"] and "'no-complex,no-bfloat16'" in r[case]["message"]
        assert r[case]["leaked"] == [0, 0]
    assert "Please use float16 instead" in r["bf16"]["message"]
    for case in FLOAT64_CASES:
        assert r[case]["raised"] is None, (case, r[case])
    assert r["bf16_supported"] is False
    assert r["amp_dtypes"] == ["torch.float16"]


def test_profile_cannot_change_after_initialization(no_float64):
    assert "before openreg is initialized" in no_float64["set_after_init"]


def test_malformed_profile_fails_at_import_naming_the_variable():
    env = dict(os.environ, OPENREG_DEVICE_PROFILE="no-float65")
    result = subprocess.run([sys.executable, "-c", "import torch; torch.ones(1, device='openreg')"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "OPENREG_DEVICE_PROFILE" in result.stderr and "no-float65" in result.stderr


def test_api_in_this_process_without_profile():
    assert torch.openreg.get_device_profile() in ("", os.environ.get("OPENREG_DEVICE_PROFILE", ""))
    if not torch.openreg.get_device_profile():
        assert torch.openreg.is_dtype_supported(torch.float64)
        assert torch.openreg.is_bf16_supported()
    with pytest.raises(ValueError, match="unknown device profile"):
        torch.openreg.set_device_profile("no-such-dtype-xyz")
