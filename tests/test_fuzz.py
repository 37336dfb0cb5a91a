"""The differential fuzzer (tools/fuzz.py): a fixed range of seeds must find no disagreement
between the CPU and openreg, and the fuzzer must catch each kind of disagreement it claims to."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import fuzz  # noqa: E402

# About 40 s on 2 idle cores (16,000 statements); `make fuzz` runs a long range.
SEEDS = "0:400"


def test_fixed_seed_range_finds_no_disagreement():
    # In a subprocess: a crash of openreg on a random program must fail the test, not the suite.
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--seeds", SEEDS,
                        "--steps", "40"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-20000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert "400 programs" in summary and "0 disagreements" in summary, summary


# Bitwise (docs/determinism.md): CPU against openreg at OMP_NUM_THREADS=1, and openreg's modes
# against each other at default threads, with programs that train and reduce over threads. A few
# seconds each on 2 idle cores; `python tools/fuzz.py --bitwise` / `--modes` run longer ranges.
BITWISE_SEEDS = "0:40"
MODES_SEEDS = "0:6"


def test_bitwise_fixed_seed_range_finds_no_difference_from_the_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--bitwise", "--seeds",
                        BITWISE_SEEDS, "--steps", "30"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-20000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert "40 programs" in summary and "0 disagreements" in summary, summary


def test_modes_fixed_seed_range_give_the_same_bits():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--modes", "--seeds",
                        MODES_SEEDS, "--steps", "30"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-20000:]
    assert "0 differences" in r.stdout, r.stdout


def test_bitwise_mode_sees_a_difference_in_the_last_bit():
    fuzz.BITWISE = True
    try:
        ok, result = run(["v0 = torch.ones(3, device=D) if D == 'cpu' else "
                          "torch.ones(3, device=D).nextafter(torch.full((3,), 2.0, device=D))"])
    finally:
        fuzz.BITWISE = False
    assert not ok
    assert "bits differ" in result.disagreements[0][1]
    ok, _ = run(["v0 = torch.ones(3, device=D) if D == 'cpu' else "
                 "torch.ones(3, device=D).nextafter(torch.full((3,), 2.0, device=D))"])
    assert ok  # within the tolerance of the default mode


@pytest.mark.parametrize("line,expected", [
    ("v0 = torch.ones(2, 3, device=D).t() if D == 'cpu' else torch.ones(3, 2, device=D)",
     "strides"),
    ("v0 = torch.ones(4, device=D)[1:] if D == 'cpu' else torch.ones(3, device=D)",
     "storage offset"),
], ids=["strides", "offset"])
def test_bitwise_mode_compares_the_layout(line, expected):
    # --bitwise: equal bits in another layout are a disagreement too.
    fuzz.BITWISE = True
    try:
        ok, result = run([line])
    finally:
        fuzz.BITWISE = False
    assert not ok
    assert expected in result.disagreements[0][1]


def run(lines):
    result = fuzz.Result()
    ok = fuzz.Program(0, 0, result).run([(line, "test", True) for line in lines])
    return ok, result


@pytest.mark.parametrize("lines,expected", [
    (["v0 = torch.ones(3, device=D) if D == 'cpu' else torch.zeros(3, device=D)"],
     "values differ"),
    (["v0 = torch.ones(3, device=D, dtype=torch.float64 if D == 'cpu' else torch.float32)"],
     "dtype"),
    (["v0 = torch.ones(4, device=D)[1:] if D == 'cpu' else torch.ones(3, device=D)"],
     "storage offset"),
    (["v0 = torch.ones(2, 3, device=D).t() if D == 'cpu' else torch.ones(3, 2, device=D)"],
     "strides"),
    (["v0 = torch.ones(3, device=D)", "v1 = v0[:] if D == 'cpu' else v0.clone()"],
     "shares memory"),
    (["v0 = torch.ones(3, device=D)", "v1 = torch.ones(3, device=D)",
      "v0.add_(1) if D == 'cpu' else v1.add_(1)"], "values differ"),
    (["v0 = torch.ones(3, device=D)", "v0.add_(torch.ones(2, device=D)) if D == 'cpu' else None"],
     "error mismatch"),
    (["v0 = torch.ones(3, device=D)",
      "v0.sum(5) if D == 'cpu' else torch.ones(2, device=D).item()"], "error mismatch"),
    (["v0 = torch.ones(3, device=D)", "v0.resize_(5) if D == 'cpu' else None"], "shape"),
], ids=["values", "dtype", "offset", "strides", "view-relation", "missed-write", "error-one-side",
        "error-type", "side-effect"])
def test_the_fuzzer_catches_each_kind_of_disagreement(lines, expected):
    ok, result = run(lines)
    assert not ok
    (seed, what, repro), = result.disagreements
    assert expected in what
    # The reproduction is a standalone script that runs the program on both devices.
    r = subprocess.run([sys.executable, "-c", repro], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cpu" in r.stdout and "openreg:0" in r.stdout


def test_agreeing_statements_pass():
    ok, result = run(["v0 = on(mk((3, 4), torch.float32, 1), D)", "v1 = v0.t()[::2]",
                      "v1.mul_(2)", "v2 = via_pinned(v0, D)", "v3 = grad_of(lambda w: w.exp(), v0)"])
    assert ok, result.disagreements
