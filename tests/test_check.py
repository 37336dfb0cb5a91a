"""The contract check (torch_openreg/check, docs/contract_check.md): every check passes on openreg,
and, run against deliberately incomplete backends in subprocesses, it names what is missing, keeps
going after a crash, and exits non-zero when a required check fails."""
import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from torch_openreg.check import CHECKS
from torch_openreg.check.testing import BackendContract

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = pathlib.Path(__file__).resolve().parent / "contract_backends"


class TestOpenRegContract(BackendContract):
    """The checks as another backend's CI would run them: collected pytest tests, in process."""
    device = "openreg"
    optional_must_pass = True


def run_check(*args, timeout=400):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(BACKENDS)]))
    return subprocess.run([sys.executable, "-m", "torch_openreg.check", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=str(ROOT))


def results_of(proc):
    report = json.loads(proc.stdout)
    return report, {r["name"]: r for r in report["results"]}


def test_cli_on_openreg_passes_and_exits_zero():
    proc = run_check("--only", "device_module", "--only", "streams_events", "--only", "copies")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  device_module" in proc.stdout and "3 passed, 0 failed" in proc.stdout


def test_python_backend_with_only_torch_helpers_is_reported_piece_by_piece():
    """rename + generated methods + _setup_privateuseone_for_python_backend: no allocator, no
    kernels, dummy module. Every check must report (not crash), required ones fail, exit code 1."""
    proc = run_check("--import", "fakedev_backend", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    report, by_name = results_of(proc)
    assert report["device"] == "fakedev"  # so the check itself did not register openreg
    assert set(by_name) == {c.name for c in CHECKS}
    assert all(r["status"] == "fail" for r in by_name.values()), \
        [n for n, r in by_name.items() if r["status"] == "pass"]
    assert "set_device" in by_name["device_module"]["missing"]
    assert "Stream" in by_name["streams_events"]["missing"]
    assert "memory_allocated" in by_name["allocator"]["missing"]
    assert "UntypedStorage.fakedev" in by_name["generated_methods"]["missing"]
    assert any(m.startswith("empty.memory_format") for m in
               by_name["minimal_ops"]["detail"].split(": ", 1)[1].split(", "))
    assert "NotImplementedError" in by_name["out_of_memory"]["detail"]
    assert "register_interface_for_device" in by_name["compile"]["missing"]
    for r in by_name.values():
        assert r["fix"] and r["guide"].startswith("docs/") and "died" not in r["detail"]


def test_device_module_without_streams_fails_only_the_stream_check():
    proc = run_check("--import", "openreg_nostreams", "--format", "json", "--only", "device_module",
                     "--only", "streams_events", "--only", "device_guard", "--only", "allocator")
    assert proc.returncode == 1
    _, by_name = results_of(proc)
    assert by_name["streams_events"]["status"] == "fail"
    assert by_name["streams_events"]["missing"] == ["Stream", "Event", "current_stream",
                                                    "default_stream", "set_stream", "stream"]
    # the C++ side (DeviceGuard streams through torch.accelerator) is intact and still passes
    assert [n for n, r in by_name.items() if r["status"] == "pass"] == \
        ["device_module", "device_guard", "allocator"]


def test_a_crash_and_a_hang_are_reported_and_the_rest_still_run():
    """The backend's get_device_name never returns (device_module, required: a failure after the
    time limit) and its get_amp_supported_dtype segfaults (autocast, optional: reported as died, a
    new worker runs the checks after it). The others pass; exit 1 for the required failure."""
    proc = run_check("--import", "openreg_crashing", "--format", "junit", "--timeout", "10",
                     "--only", "device_module", "--only", "accelerator", "--only", "autocast",
                     "--only", "serialization")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    suite = ET.fromstring(proc.stdout.split("?>", 1)[1]).find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["device_module", "accelerator", "autocast", "serialization"]
    hang = cases["device_module"].find("failure")
    assert hang is not None and "did not finish within 10 s" in hang.get("message")
    skipped = cases["autocast"].find("skipped")
    assert skipped is not None and "died during this check" in skipped.get("message")
    assert all(len(cases[n]) == 0 for n in ("accelerator", "serialization"))  # passed
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "1")


def test_a_missing_set_is_named_where_torch_load_and_storages_need_it():
    proc = run_check("--import", "openreg_noset", "--format", "json", "--only", "serialization",
                     "--only", "storage", "--only", "minimal_ops", "--only", "copies")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _, by_name = results_of(proc)
    load = by_name["serialization"]
    assert load["status"] == "fail" and load["missing"] == ["set_.source_Storage_storage_offset"]
    assert "torch.load rebuilds every tensor with set_" in load["detail"]
    assert "set_.source_Storage_storage_offset" in load["fix"]
    storage = by_name["storage"]
    assert storage["status"] == "fail" and storage["missing"] == ["set_.source_Storage"]
    assert "set_.source_Storage" in storage["fix"]
    assert "set_ (NotImplementedError)" in by_name["minimal_ops"]["detail"]
    assert by_name["copies"]["status"] == "pass"


def test_a_failing_opinfo_operator_names_its_sample_tolerance_and_difference():
    proc = run_check("--import", "openreg_inexact", "--format", "json", "--only", "opinfo_sample")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # optional
    _, by_name = results_of(proc)
    r = by_name["opinfo_sample"]
    assert r["status"] == "fail" and r["missing"] == ["exp"], r
    detail = r["detail"]
    assert re.search(r"exp sample 0 \(float32\[[0-9, ]*\]\): largest difference ([0-9.e+-]+) "
                     r"\(at tolerance rtol=1.3e-06, atol=1e-05\)", detail), detail
    largest = float(re.search(r"largest difference ([0-9.e+-]+)", detail).group(1))
    assert 1e-4 < largest < 1.0  # 0.1% of exp of a sample value


def test_optional_failures_keep_the_exit_code_zero():
    proc = run_check("--import", "openreg_crashing", "--only", "autocast", "--only", "copies")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL  autocast" in proc.stdout and "PASS  copies" in proc.stdout


def test_the_check_imports_nothing_of_openreg():
    for source in (ROOT / "torch_openreg" / "check").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n.split(".")[0] == "torch_openreg" for n in names), source.name


def test_unknown_check_name_is_a_clear_error():
    from torch_openreg.check.runner import selected
    with pytest.raises(ValueError, match=r"unknown checks \['no_such_check'\]"):
        selected(["no_such_check"])


def test_every_check_is_documented_and_links_an_existing_guide():
    page = (ROOT / "docs" / "contract_check.md").read_text()
    for c in CHECKS:
        assert f"| `{c.name}` |" in page, f"{c.name} is missing from docs/contract_check.md"
        assert (ROOT / "docs" / c.guide).exists(), f"{c.name} links docs/{c.guide}"


def entry_points(text):
    """The code names in a text: qualified (`c10::SetAllocator`, `torch.Stream`), snake_case,
    camelCase or MACRO_CASE words, the way fix texts name what to implement."""
    names = re.findall(r"[A-Za-z_]\w*(?:(?:::|\.)[A-Za-z_]\w*)*", text)
    return [n for n in names if re.search(r"::|\.|_|[a-z][A-Z]", n)]


def documents(page, name):
    """The page names it: in full, or (for a qualified name) by its last component."""
    last = re.split(r"::|\.", name)[-1]
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", page) for n in (name, last))


def test_each_fix_text_names_only_entry_points_its_guide_documents():
    """A fix text sends the reader to its page (`see docs/<page>`): every function, class, macro
    or operator it names must be on that page."""
    undocumented = {}
    for c in CHECKS:
        page = (ROOT / "docs" / c.guide).read_text()
        names = entry_points(c.fix)
        assert names, c.name
        missing = [n for n in names if not documents(page, n)]
        if missing:
            undocumented[f"{c.name} -> docs/{c.guide}"] = missing
    assert not undocumented, undocumented


def test_the_fix_text_test_can_fail():
    assert entry_points("register it with c10::SetAllocator(PrivateUse1) and getNewStream") == \
        ["c10::SetAllocator", "PrivateUse1", "getNewStream"]
    assert documents("`c10::SetAllocator(...)`", "c10::SetAllocator")
    assert documents("call SetAllocator once", "c10::SetAllocator")
    assert not documents("getDeviceStats", "getDevice")
    assert not documents("x_is_available", "is_available")
    assert not documents("REGISTER_ALLOCATOR", "c10::SetAllocator")
