"""Operators registered through torchgen's generated code (csrc/routes/codegen.yaml ->
build/<torch build tag>/generated/, kernels in csrc/routes/codegen.cpp), compared with the CPU."""
import pathlib
import subprocess

import pytest
import torch

import torch_openreg
from torch_openreg import _native_build

ROOT = pathlib.Path(torch_openreg.__file__).resolve().parent.parent
GENERATED = f"build/{_native_build.build_tag(torch.__version__)}/generated"


def calls(name):
    return torch_openreg._C._route_calls(name)


def test_registrations_come_from_the_generated_file():
    for op in ["aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_"]:
        line = next(l for l in torch._C._dispatch_dump(op).splitlines()
                    if l.startswith("PrivateUse1:"))
        assert f"{GENERATED}/RegisterPrivateUse1.cpp" in line, line


def test_generated_files_are_build_outputs_not_sources():
    generated = ROOT / GENERATED
    assert (generated / "PrivateUse1NativeFunctions.h").exists()
    assert "static at::Tensor & zero_(at::Tensor & self);" in (
        generated / "PrivateUse1NativeFunctions.h").read_text()
    tracked = subprocess.run(["git", "ls-files", "build"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout == ""


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.uint16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zeros_and_full_match_cpu(device, dtype):
    before_zero, before_fill = calls("codegen.zero_"), calls("codegen.fill_")
    z = torch.zeros(3, 5, dtype=dtype, device=device)
    assert calls("codegen.zero_") == before_zero + 1
    value = True if dtype == torch.bool else 3
    f = torch.full((4, 2), value, dtype=dtype, device=device)
    assert calls("codegen.fill_") == before_fill + 1
    torch.testing.assert_close(z.cpu(), torch.zeros(3, 5, dtype=dtype))
    torch.testing.assert_close(f.cpu(), torch.full((4, 2), value, dtype=dtype))


def test_fill_strided_and_conjugate_views(device):
    x = torch.arange(24.0).reshape(4, 6)
    d = x.to(device)
    d[:, 1::2].fill_(-1.5)
    x[:, 1::2].fill_(-1.5)
    d.t()[2].zero_()
    x.t()[2].zero_()
    torch.testing.assert_close(d.cpu(), x)
    c = torch.zeros(3, dtype=torch.complex64)
    cd = c.to(device)
    c.conj().fill_(1 + 2j)
    cd.conj().fill_(1 + 2j)
    torch.testing.assert_close(cd.cpu(), c)
    assert cd.cpu()[0] == 1 - 2j  # stored conjugated, read back through the view as 1+2j


def test_fill_tensor_value(device):
    d = torch.empty(2, 3, device=device)
    d.fill_(torch.tensor(2.5))  # a CPU scalar
    assert (d.cpu() == 2.5).all()
    d.fill_(torch.tensor(-4.0, device=device))  # a device scalar: no host round trip
    assert (d.cpu() == -4.0).all()
    with pytest.raises(RuntimeError, match="fill_ only supports 0-dimension value tensor"):
        d.fill_(torch.ones(2, device=device))


def test_bad_values_raise_like_the_cpu():
    with pytest.raises(RuntimeError) as cpu:
        torch.zeros(2, dtype=torch.uint8).fill_(300)
    with pytest.raises(type(cpu.value), match="overflow"):
        torch.zeros(2, dtype=torch.uint8, device="openreg").fill_(300)


def test_empty(device):
    e = torch.empty(0, 3, device=device)
    e.zero_()
    e.fill_(1)
    assert e.shape == (0, 3)
