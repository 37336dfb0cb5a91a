"""PyTorch's main device-generic test files on the CPU and on openreg, compared test by test
(docs/test_suites.md, "PyTorch's main suites"; issue 39). Not part of CI: a run takes tens of
minutes.

    python tools/pytorch_suites.py run PT_TESTS [--files test_ops.py ...]   # run, then compare
    python tools/pytorch_suites.py compare [--files ...]                    # compare saved runs
    make pytorch-suites PT_TESTS=/work/pt-tests/<commit>/test

``PT_TESTS`` is a folder holding PyTorch's test files (``test/`` of a PyTorch checkout, or single
files fetched from one): the project contains no PyTorch test code. Each selected file runs twice
from that folder, in two processes at once (one core each):

- CPU: ``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` and ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch
  without openreg);
- openreg: ``TORCH_TEST_DEVICES=<openreg's test base>`` and
  ``PYTORCH_TESTING_DEVICE_ONLY_FOR=openreg``;

with the same selection (``SELECTION`` below, applied by tools/pytorch_suites_plugin.py) and the
same shims. Per-test outcomes go to ``build/pytorch_suites/<file>-<device>.xml`` (JUnit XML);
the comparison prints, per file, the tests passed on each device and the tests passing on the CPU
but not on openreg, grouped by error message.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from pytorch_suites_plugin import test_key  # noqa: E402

OUT = ROOT / "build" / "pytorch_suites"

# [docs:start SELECTION]
# What runs of each file, in parts (one pytest process per part and device, so that a part's
# results stand even when a later part is cut short): (part name, generic test class -> the
# dtypes kept, a regular expression of test names left out, N: one test in N kept, the same on
# both devices). Dtypes: "none" for tests with no dtype in their name (those over OpDTypes.none),
# "*" for all. Chosen so that a file takes about 20 minutes per device on the shared 2-core
# machine (load 18-20 on 2 cores on 2026-12-02, where one process gets a tenth of a core and
# runs about 40 OpInfo tests a minute); the reasons:
SELECTION: dict[str, list[tuple[str, dict[str, list[str]], str, int]]] = {
    "test_ops.py": [
        # The OpInfo tests over every operator. float32 is the dtype every operator supports
        # and the one CUDA's CI weighs most; "none" keeps test_out_warning, test_errors and the
        # other dtype-less checks (24,073 TestCommon tests over all dtypes, 8,239 of them
        # float32 or dtype-less). Left out: test_python_ref*, the primTorch references against
        # ATen in Python (1,486 float32 tests; the reference runs the same ATen operators on
        # both devices), and test_dtypes, which runs every sample of an operator in all 12
        # dtypes with backward (the slowest). Then one test in 10: a tenth of the operators for
        # each test method.
        ("common", {"TestCommon": ["float32", "none"]}, r"test_python_ref|test_dtypes_", 10),
        # test_conj_view (complex64); float64 (test_neg_view) and complex128
        # (test_neg_conj_view) are the same mechanism, the negative bit, in more dtypes.
        # TestTags: one dtype per operator by the file's choice (OpDTypes.any_one).
        ("mathbits_tags", {"TestMathBits": ["complex64"], "TestTags": ["*"]}, "", 10),
        # float32 only by the file's choice. The slowest per test: check_all_permutations and
        # the backward formulas over every sample; test_backward of
        # nn.functional.multi_head_attention_forward alone ran over 8 minutes per device.
        ("composite", {"TestCompositeCompliance": ["float32"]}, "", 10),
    ],
    # TestTorchDeviceType in every dtype: its tests are quick (float32, int64 and dtype-less, 308
    # tests on the CPU, took 125-130 s per device side by side at load 21-25 on 2026-12-02; all
    # dtypes, 753 tests, about 2 minutes), so all of them run, no sample.
    "test_torch.py": [("all", {"TestTorchDeviceType": ["*"]}, "", 1)],
    "test_nn.py": [
        # TestNNDeviceType, float32 and dtype-less: 1,575 tests on torch 2.15, 1,152 of them the
        # variants of one method, test_upsamplingBiMode2d_consistency (uint8 against float32
        # resizes of 400x400 images, 9 parameters). Part "all": every other test (423).
        ("all", {"TestNNDeviceType": ["float32", "none"]},
         r"test_upsamplingBiMode2d_consistency", 1),
        # that method's variants, one in 48 (31 tests): the same kernels in each variant.
        ("bimode_consistency", {"TestNNDeviceType": ["float32", "none"]},
         r"(?!test_upsamplingBiMode2d_consistency)", 48),
    ],
    # All of TestAutogradDeviceType, every dtype its tests name (float32, float64, complex128,
    # int8 to int64): 70 tests, 76-88 s per device (2026-12-02, load about 20), no sampling.
    "test_autograd.py": [("all", {"TestAutogradDeviceType": ["*"]}, "", 1)],
    # TestLinalg float32 and dtype-less: 581 of its 1,261 tests, all of them (one test in 2 ran
    # in 200 s per device at load 15-18 on 2026-12-02, so no sample is needed).
    "test_linalg.py": [("all", {"TestLinalg": ["float32", "none"]}, "", 1)],
    # The generic optimizer tests (issue 41: the suite's time on openreg against the CPU's),
    # all of them: 804 tests, 15-21 minutes per device at load 15-28. The file's other classes
    # (TestLRScheduler, TestDifferentiableOptimizer, TestSWAUtils, from test/optim/) are not run.
    "test_optim.py": [("all", {"TestOptimRenewed": ["*"]}, "", 1)],
}
# Generic classes the file instantiates for the CPU only (only_for="cpu") that the plugin
# generates for openreg too: test_ops.py's TestTags (the issue asks for it on openreg).
ALL_DEVICES = {"test_ops.py": ["TestTags"]}
# Environment set for a file's runs on both devices, each a shim for a difference between the
# stored file and torch 2.15: test_linalg.py (of 2025) sets the legacy
# torch.backends.cuda.matmul.allow_tf32 in TestLinalg's setUp and tearDown, which torch 2.15's
# TestCase reports as an "fp32 precision flag leak" failure of every test, on the CPU too;
# PYTORCH_DISABLE_FP32_PRECISION_LEAK_CHECK=1 is torch's switch for that check.
FILE_ENV = {"test_linalg.py": {"PYTORCH_DISABLE_FP32_PRECISION_LEAK_CHECK": "1"}}
# [docs:end SELECTION]
# Modules a file imports from beside it (module -> the test classes it must define) that the
# selection does not run: when PT_TESTS lacks them, the plugin puts in empty stand-ins, so that a
# single file fetched from PyTorch runs. test_optim.py imports a class from each of test/optim/'s
# three files (and instantiates TestSWAUtils for each device).
STANDINS = {"test_optim.py": {"optim.test_lrscheduler": ["TestLRScheduler"],
                              "optim.test_optim": ["TestDifferentiableOptimizer"],
                              "optim.test_swa_utils": ["TestSWAUtils"]}}

DEVICES = ("cpu", "openreg")


def test_base() -> str:
    """What ``python -m torch_openreg.testing spec pytorch`` prints (without importing torch here)."""
    return str(ROOT / "torch_openreg" / "testing" / "pytorch_test_base.py")


def command(file: str, part: tuple, device: str) -> tuple[list[str], dict[str, str]]:
    name, classes, deselect, sample = part
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tools"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = device
    env["OPENREG_PT_SELECT"] = json.dumps(classes)
    env["OPENREG_PT_DESELECT"] = deselect
    env["OPENREG_PT_SAMPLE"] = str(sample)
    env["OPENREG_PT_ALL_DEVICES"] = ",".join(ALL_DEVICES.get(file, []))
    env.update(FILE_ENV.get(file, {}))
    env["OPENREG_PT_STANDINS"] = json.dumps(STANDINS.get(file, {}))
    env["OMP_NUM_THREADS"] = "1"  # one core per device: the two runs go side by side
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        env.pop("TORCH_TEST_DEVICES", None)
    else:
        env["TORCH_TEST_DEVICES"] = test_base()
    xml = OUT / f"{Path(file).stem}-{name}-{device}.xml"
    cmd = ["nice", "-n", "15", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
           "-p", "pytorch_suites_plugin", "-q", "-rfE", "--tb=line", "-o", "addopts=",
           f"--junitxml={xml}", file]
    return cmd, env


def run(files: list[str], pt_tests: Path, parts: list[str] | None = None,
        sample: int | None = None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for file in files:
        if not (pt_tests / file).exists():
            print(f"== {file}: not in {pt_tests}, skipped")
            continue
        for part in SELECTION[file]:
            if parts and part[0] not in parts:
                continue
            if sample:  # a sparser sample: with N a multiple of the part's, a subset of it
                part = (*part[:3], sample)
            procs = []
            start = time.time()
            for device in DEVICES:
                cmd, env = command(file, part, device)
                log = open(OUT / f"{Path(file).stem}-{part[0]}-{device}.log", "w")
                print(f"== {file} [{part[0]}] on {device}: {json.dumps(part[1])}"
                      + (f", without {part[2]}" if part[2] else "")
                      + (f", one test in {part[3]}" if part[3] > 1 else ""), flush=True)
                procs.append((device, subprocess.Popen(cmd, cwd=pt_tests, env=env, stdout=log,
                                                       stderr=subprocess.STDOUT), log))
            for device, proc, log in procs:
                proc.wait()
                log.close()
                print(f"   {device}: exit {proc.returncode}, {time.time() - start:.0f} s",
                      flush=True)


def outcomes(xml: Path, device: str) -> dict[str, tuple[str, str]]:
    """JUnit XML -> {test key without the device: (outcome, message)}; outcome is passed,
    failed or skipped (pytest's xfail counts as skipped)."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        key = test_key(case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""), device)
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or node.text or "").strip()
                if node.get("type") == "pytest.xfail":
                    message = "expected failure (xfail) " + message
                break
        result[key] = (outcome, message)
    return result


def case_times(xml: Path, device: str) -> dict[str, float]:
    """JUnit XML -> {test key without the device: its time in seconds}."""
    return {test_key(case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""), device):
            float(case.get("time") or 0) for case in ET.parse(xml).getroot().iter("testcase")}


def times(xml: Path) -> tuple[float, float]:
    """JUnit XML -> (test time: the sum of its testcases' times, wall time: pytest's session
    time, collection included), in seconds."""
    root = ET.parse(xml).getroot()
    test = sum(float(case.get("time") or 0) for case in root.iter("testcase"))
    wall = sum(float(suite.get("time") or 0) for suite in root.iter("testsuite"))
    return test, wall


def cause(message: str) -> str:
    """The first line of an error, with device names, addresses and sizes made alike, so that
    one cause groups its tests."""
    line = message.splitlines()[0] if message else "(no message)"
    line = re.sub(r"openreg(:\d+)?|cpu", "DEV", line)
    line = re.sub(r"0x[0-9a-f]+", "0x..", line)
    return line[:200]


def compare(files: list[str]) -> int:
    for file in files:
        stem = Path(file).stem
        done = [p[0] for p in SELECTION[file]
                if all((OUT / f"{stem}-{p[0]}-{d}.xml").exists() for d in DEVICES)]
        if not done:
            print(f"== {file}: no saved run in {OUT}")
            continue
        cpu, ore = {}, {}
        for name in done:
            cpu.update(outcomes(OUT / f"{stem}-{name}-cpu.xml", "cpu"))
            ore.update(outcomes(OUT / f"{stem}-{name}-openreg.xml", "openreg"))

        def count(res, what):
            return sum(1 for o, _ in res.values() if o == what)

        print(f"== {file}, parts {', '.join(done)} of {', '.join(p[0] for p in SELECTION[file])}")
        for device, res in (("cpu", cpu), ("openreg", ore)):
            print(f"   {device:8s} {len(res):6d} run: {count(res, 'passed'):6d} passed, "
                  f"{count(res, 'failed'):5d} failed, {count(res, 'skipped'):6d} skipped")
        # the time each device took for the same selection (the two ran side by side)
        spent = {d: [sum(t) for t in zip(*(times(OUT / f"{stem}-{p}-{d}.xml") for p in done))]
                 for d in DEVICES}
        for i, what in enumerate(("test time (sum of testcases)", "wall time (pytest session)")):
            cpu_s, ore_s = spent["cpu"][i], spent["openreg"][i]
            print(f"   {what}: cpu {cpu_s:.1f} s, openreg {ore_s:.1f} s, openreg / cpu "
                  + (f"{ore_s / cpu_s:.2f}x" if cpu_s else "-"))
        # Test for test: only the tests that ran on both devices (a test skipped on one, such as
        # those PyTorch runs on accelerators only, is work the other device did not do). The
        # same test may still do more work on openreg: PyTorch's helpers give accelerators more
        # configurations of some tests (docs/test_suites.md, test_optim.py).
        per_test = {d: {} for d in DEVICES}
        for name in done:
            for d in DEVICES:
                per_test[d].update(case_times(OUT / f"{stem}-{name}-{d}.xml", d))
        both = [k for k, (o, _) in cpu.items()
                if o != "skipped" and k in ore and ore[k][0] != "skipped"]
        cpu_s = sum(per_test["cpu"].get(k, 0.0) for k in both)
        ore_s = sum(per_test["openreg"].get(k, 0.0) for k in both)
        print(f"   test time of the {len(both)} tests run on both devices: cpu {cpu_s:.1f} s, "
              f"openreg {ore_s:.1f} s, openreg / cpu " + (f"{ore_s / cpu_s:.2f}x" if cpu_s else "-"))
        only_fail = {k: ore[k][1] for k, (o, _) in cpu.items()
                     if o == "passed" and k in ore and ore[k][0] == "failed"}
        only_skip = {k: ore[k][1] for k, (o, _) in cpu.items()
                     if o == "passed" and k in ore and ore[k][0] == "skipped"}
        missing = [k for k, (o, _) in cpu.items() if o == "passed" and k not in ore]
        only_cpu_fail = [k for k, (o, _) in ore.items()
                         if o == "passed" and k in cpu and cpu[k][0] == "failed"]
        print(f"   passed on the CPU and failed on openreg: {len(only_fail)}")
        groups = collections.defaultdict(list)
        for k, m in only_fail.items():
            groups[cause(m)].append(k)
        for c, keys in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"     {len(keys):4d} x {c}")
            for k in sorted(keys)[:8]:
                print(f"            {k}")
            if len(keys) > 8:
                print(f"            ... {len(keys) - 8} more")
        print(f"   passed on the CPU and skipped on openreg: {len(only_skip)}")
        sgroups = collections.Counter(cause(m) for m in only_skip.values())
        for c, n in sgroups.most_common(12):
            print(f"     {n:4d} x {c}")
        print(f"   passed on the CPU, not generated for openreg: {len(missing)}")
        for k in sorted(missing)[:10]:
            print(f"            {k}")
        print(f"   passed on openreg and failed on the CPU: {len(only_cpu_fail)}")
        for k in sorted(only_cpu_fail)[:10]:
            print(f"            {k}")
        # openreg's other failures: tests the CPU skips (onlyAccelerator, such as
        # test_compare_cpu), expects to fail, or fails too
        other = {k: m for k, (o, m) in ore.items()
                 if o == "failed" and k not in only_fail}
        print(f"   failed on openreg, not passed on the CPU: {len(other)}")
        for k, m in sorted(other.items()):
            on_cpu = cpu[k][0] + (f" ({cause(cpu[k][1])[:60]})" if cpu[k][1] else "") \
                if k in cpu else "not generated"
            print(f"     {k}\n         openreg: {cause(m)}\n         CPU: {on_cpu}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the selection on both devices, then compare")
    r.add_argument("pt_tests", type=Path, help="folder with PyTorch's test files")
    c = sub.add_parser("compare", help="compare the saved runs")
    for s in (r, c):
        s.add_argument("--files", nargs="+", default=list(SELECTION), choices=list(SELECTION))
    r.add_argument("--parts", nargs="+", help="only these parts of the files' selections")
    r.add_argument("--sample", type=int, help="keep one test in N instead of the selection's N")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.files, args.pt_tests.resolve(), args.parts, args.sample)
    return compare(args.files)


if __name__ == "__main__":
    sys.exit(main())
