"""examples/minimal_backend (docs/first_backend.md): the smallest backend passes every required check
of the contract check, built as a vendor builds it (`python setup.py build_ext --inplace` against the
installed torch, nothing installed), and stays small enough to read in one sitting."""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from torch_openreg.check import CHECKS
from torch_openreg.check.report import table
from torch_openreg.check.runner import Result

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "minimal_backend"
SOURCES = ("setup.py", "minidev.cpp", "minidev/__init__.py")  # the core
# optional mechanisms, a file each, outside the bound
OPTIONAL = ("optional/autocast.cpp", "optional/pinned_memory.cpp", "optional/fork.cpp",
            "optional/inductor.py", "optional/distributed.cpp", "optional/profiler.cpp")
# The bound on the example's size, all three files, comments included (631 lines with the
# pinned-memory hooks and the loader of optional/): "a few hundred lines", what a vendor reads in
# one sitting.
MAX_LINES = 640
# Built once per torch release and per version of the sources: an extension built against one
# torch release fails to load under another, and CI runs this file on three releases.
CACHE = ROOT / "build" / "minimal_backend"
BACKENDS = ROOT / "tests" / "contract_backends"


def test_the_example_is_small_and_says_what_it_is():
    lines = {name: len((EXAMPLE / name).read_text().splitlines()) for name in SOURCES}
    assert sum(lines.values()) <= MAX_LINES, lines
    assert sorted(p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*")
                  if p.suffix in (".py", ".cpp", ".h", ".toml", ".cfg")
                  and "build" not in p.parts) == sorted(SOURCES + OPTIONAL)
    native = (EXAMPLE / "minidev.cpp").read_text()
    assert native.startswith("// Native because: ")
    head = "\n".join(native.splitlines()[:16])
    assert "leaves out" in head and "docs/device_allocator.md" in head and "cpu_fallback" in head
    # imported explicitly: no autoload entry point that would take PrivateUse1 before openreg
    assert "entry_points" not in (EXAMPLE / "setup.py").read_text()


@pytest.fixture(scope="module")
def built() -> pathlib.Path:
    names = SOURCES + OPTIONAL
    digest = hashlib.sha256(b"".join((EXAMPLE / n).read_bytes() for n in names)).hexdigest()[:12]
    dest = CACHE / f"torch-{torch.__version__}-{digest}"
    return build(dest, ["setup.py"], {n: EXAMPLE / n for n in names})


def build(dest: pathlib.Path, setup_args: list[str], sources: dict[str, pathlib.Path]) -> pathlib.Path:
    """Builds minidev._C in ``dest`` (once: kept while the sources stay the same)."""
    if list((dest / "minidev").glob("_C*.so")):
        return dest
    work = CACHE / f".building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name, source in sources.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, work / name)
    # CFLAGS=-g0 (after Python's -g): no debug information, half the compiler's time (as setup.py
    # does for openreg's core); the example's own setup.py stays as a vendor would write it
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               CFLAGS=(os.environ.get("CFLAGS", "") + " -g0").strip())
    proc = subprocess.run([sys.executable, *setup_args, "build_ext", "--inplace"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prefix = dest.name.rsplit("-", 1)[0]
    for stale in CACHE.glob(f"{prefix}-*"):  # builds of older sources
        shutil.rmtree(stale, ignore_errors=True)
    work.rename(dest)
    return dest


# minidev's C++ file with its current device and streams process-wide (it includes minidev.cpp)
GLOBAL_DEVICE = ROOT / "tests" / "contract_backends" / "minidev_global_device.cpp"
GLOBAL_DEVICE_SETUP = """
import sys
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
setup(name="minidev", packages=["minidev"], cmdclass={"build_ext": BuildExtension},
      ext_modules=[CppExtension("minidev._C", ["minidev_global_device.cpp"],
                                include_dirs=[sys.argv.pop(1)], extra_compile_args=["-O2"])])
"""


@pytest.fixture(scope="module")
def built_global_device() -> pathlib.Path:
    sources = {n: EXAMPLE / n for n in SOURCES} | {GLOBAL_DEVICE.name: GLOBAL_DEVICE}
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources.values())).hexdigest()[:12]
    dest = CACHE / f"global-device-torch-{torch.__version__}-{digest}"
    return build(dest, ["-c", GLOBAL_DEVICE_SETUP, str(EXAMPLE)], sources)


def test_the_core_alone_passes_every_required_check(built):
    """minidev without its optional extensions (minidev_broken with no variant leaves them out at
    import): every required check passes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(built), str(BACKENDS)]),
               MINIDEV_BROKEN="")
    proc = subprocess.run([sys.executable, "-m", "torch_openreg.check", "--import", "minidev_broken",
                           "--format", "json"], capture_output=True, text=True, env=env,
                          cwd=str(built), timeout=900)
    report = json.loads(proc.stdout)
    results = [Result(**r) for r in report["results"]]
    # The table CI shows for the example, one file per torch release.
    text = table(results, report["device"], f" (torch {report['torch']})")
    (CACHE / f"contract_check-core-torch-{torch.__version__}.txt").write_text(text + "\n")
    print(text)
    assert report["device"] == "minidev"  # minidev took PrivateUse1, not an autoloaded openreg
    assert [r.name for r in results] == [c.name for c in CHECKS]
    failed = [f"{r.name}: {r.detail}" for r in results if r.required and not r.passed]
    assert not failed, text
    assert proc.returncode == 0, proc.stderr
    # the optional mechanisms the core leaves out fail, each fix naming what is missing; the rest
    # (opinfo_sample: native_layer_norm through the fallback, docs/first_backend.md) passes
    by_name = {r.name: r for r in results}
    assert sorted(r.name for r in results if not r.passed) == sorted(LEFT_OUT), text
    assert {n: by_name[n].fix for n, piece in LEFT_OUT.items() if piece not in by_name[n].fix} == {}


# What minidev leaves out fails its check, with a fix text that names the missing piece.
LEFT_OUT = {
    "pinned_memory": "at::setHostAllocator",
    "fork_poisoning": "pthread_atfork",
    "autocast": "get_amp_supported_dtype",
    "distributed": "Backend.register_backend",
    "compile": "register_interface_for_device",
    "profiler": "libkineto::IActivityProfiler",
}

# Broken variants of minidev (tests/contract_backends/minidev_broken.py, selected by MINIDEV_BROKEN
# at import): variant -> (the check that must fail, a text its reason or missing pieces must
# contain, a text its fix must contain). Each group runs in one worker; the variants of a group
# break pieces that the group's other checks do not use.
VARIANTS = {
    "no_set_device": ("device_module", "set_device", "set_device"),
    "no_stream_api": ("streams_events", "current_stream", "current_stream"),
    "stub_memory_stats": ("allocator", "memory_allocated grew by 0", "getDeviceStats"),
    "no_is_in_bad_fork": ("generators", "_is_in_bad_fork", "_is_in_bad_fork"),
    "device_index_only": ("serialization", "device(torch.device)", "torch.device"),
    "autocast_lower_only": ("autocast", "softmax", "fp32_set_opt_dtype"),
    "oom_as_runtime_error": ("out_of_memory", "RuntimeError", "OutOfMemoryError"),
    "no_set_source_storage": ("storage", "set_.source_Storage", "set_.source_Storage"),
    "no_module_methods": ("generated_methods", "nn.Module.minidev", "for_module=True"),
    "one_device_copies": ("copies", "between devices", "across devices"),
    "inexact_exp": ("opinfo_sample", "exp sample 0", "fallback"),
    "no_tanh_backward": ("autograd", "tanh_backward", "backward kernels"),
    "amp_dtypes_only": ("autocast", "AutocastPrivateUse1 fallthrough", "makeFallthrough"),
    "autocast_fallthrough_only": ("autocast", "lower_precision_fp mm", "lower_precision_fp"),
    "count_mismatch": ("accelerator", "disagree", "device_count()"),
    "as_strided_through_fallback": ("minimal_ops", "as_strided", "as_strided"),
    "lonely_collectives": ("distributed", "all_reduce between two processes", "c10d::Backend"),
    "inductor_without_wrapper": ("compile", "raised", "register_backend_for_device"),
}
GROUPS = (
    ("no_set_device", "no_stream_api", "stub_memory_stats", "no_is_in_bad_fork",
     "device_index_only", "autocast_lower_only", "count_mismatch"),
    ("oom_as_runtime_error", "no_set_source_storage", "no_module_methods", "one_device_copies",
     "inexact_exp", "no_tanh_backward", "amp_dtypes_only", "inductor_without_wrapper"),
    ("as_strided_through_fallback", "lonely_collectives", "autocast_fallthrough_only"),
)


def test_the_groups_hold_each_variant_once_and_one_variant_per_check():
    names = [v for group in GROUPS for v in group]
    assert sorted(names) == sorted(VARIANTS)
    for group in GROUPS:
        checks = [VARIANTS[v][0] for v in group]
        assert len(checks) == len(set(checks)), group


@pytest.mark.parametrize("group", GROUPS, ids=[f"group{i}" for i in range(len(GROUPS))])
def test_each_broken_variant_fails_its_check_naming_the_missing_piece(built, group):
    """Every check can fail: on a variant of minidev with one piece missing or broken, the check
    for that piece fails, and its reason and fix text name the piece."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(built), str(BACKENDS)]),
               MINIDEV_BROKEN=",".join(group))
    only = [x for v in group for x in ("--only", VARIANTS[v][0])]
    proc = subprocess.run([sys.executable, "-m", "torch_openreg.check", "--import", "minidev_broken",
                           "--format", "json", *only], capture_output=True, text=True, env=env,
                          cwd=str(built), timeout=900)
    assert proc.stdout, proc.stderr[-3000:]
    by_name = {r["name"]: r for r in json.loads(proc.stdout)["results"]}
    wrong = {}
    for variant in group:
        check, reason, fix = VARIANTS[variant]
        r = by_name[check]
        said = r["detail"] + " " + " ".join(r["missing"])
        if r["status"] != "fail" or reason not in said or fix not in r["fix"]:
            wrong[variant] = r
    assert not wrong, json.dumps(wrong, indent=1)


def test_a_device_guard_with_a_process_wide_current_device_fails_device_guard(built_global_device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(built_global_device)]))
    proc = subprocess.run([sys.executable, "-m", "torch_openreg.check", "--import", "minidev",
                           "--format", "json", "--only", "device_guard", "--only", "accelerator"],
                          capture_output=True, text=True, env=env, cwd=str(built_global_device),
                          timeout=600)
    by_name = {r["name"]: r for r in json.loads(proc.stdout)["results"]}
    guard = by_name["device_guard"]
    assert guard["status"] == "fail" and "another thread" in guard["detail"], guard
    assert "thread-local current device" in guard["fix"]
    assert by_name["accelerator"]["status"] == "pass"  # the rest of the C++ side still works
    assert proc.returncode == 1


def test_the_example_with_its_optional_mechanisms_passes_every_check(built):
    """minidev as built, with optional/ (a file per mechanism): all 20 checks pass."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(built)]))
    proc = subprocess.run([sys.executable, "-m", "torch_openreg.check", "--import", "minidev",
                           "--format", "json"], capture_output=True, text=True, env=env,
                          cwd=str(built), timeout=900)
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    results = [Result(**r) for r in report["results"]]
    text = table(results, report["device"], f" (torch {report['torch']})")
    (CACHE / f"contract_check-example-torch-{torch.__version__}.txt").write_text(text + "\n")
    print(text)
    assert [r.name for r in results] == [c.name for c in CHECKS]
    assert [f"{r.name}: {r.detail}" for r in results if not r.passed] == [], text
    assert proc.returncode == 0, proc.stderr
