"""pytest plugin of tools/pytorch_suites.py: the selection and the compatibility shims for a run of
PyTorch's device-generic test files on one device (docs/test_suites.md, "PyTorch's main suites").

Loaded with ``-p pytorch_suites_plugin`` (tools/ on ``PYTHONPATH``); it changes nothing in the
test files, which stay outside the project.

- **Selection.** ``OPENREG_PT_SELECT`` (JSON, written by tools/pytorch_suites.py) maps a test
  class, without its device suffix, to the dtypes to keep: ``"float32"``, ``"none"`` for tests
  with no dtype in their name, ``"*"`` for all. Tests of other classes, or other dtypes, are
  deselected (pytest counts them as deselected). ``OPENREG_PT_DESELECT``, a regular expression,
  deselects the tests whose names it matches (``re.match`` on the test's name). The same
  selection runs on both devices, so the runs compare test by test. ``OPENREG_PT_SAMPLE=N``
  keeps one test in N, the same ones on both devices (by a hash of the test's name without its
  device, ``test_key``): a sample of the operators for each test method.
- **Shims**, each for a difference between the stored test file and torch 2.15 or for a test the
  file generates for the CPU only:

  * ``OPENREG_PT_ALL_DEVICES`` (comma-separated class names): ``instantiate_device_type_tests``
    ignores ``only_for="cpu"`` for these classes, so that they are generated for openreg too.
    test_ops.py instantiates ``TestTags`` for the CPU only (``only_for="cpu"``); issue 39 asks
    for it on openreg.
  * ``OPENREG_PT_STANDINS`` (JSON: module -> class names): modules the test file imports from
    beside it that the run's folder does not hold get an empty stand-in defining those classes
    (no tests). test_optim.py imports a class from each of test/optim/'s three files, none of
    which the selection runs; with them a single fetched test_optim.py runs.
  * ``OPENREG_PT_CPU_CONFIGS=1`` (a measurement, not a shim for a difference): the optimizer
    tests get the CPU's list of configurations on any device. PyTorch's helper
    (``_get_optim_inputs_including_global_cliquey_kwargs``) adds a ``foreach=True`` twin of each
    configuration on devices with foreach kernels (any accelerator, openreg included) and a
    ``fused=True`` one where the optimizer lists the device as fused-capable (the CPU for Adam,
    AdamW, Adagrad, SGD): the same test does more work on openreg than on the CPU. With this, both
    devices run the same configurations, so their times compare work for work.
"""
from __future__ import annotations

import json
import os
import re
import zlib

# dtypes as PyTorch's instantiated test names end with them (common_device_type: the dtype's
# name without "torch.")
DTYPES = ("float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
          "bcomplex32", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
          "float8_e8m0fnu", "float4_e2m1fn_x2")
_DTYPE_SUFFIX = re.compile(r"_(" + "|".join(sorted(DTYPES, key=len, reverse=True)) + r")$")
DEVICE_SUFFIXES = ("CPU", "OPENREG", "PRIVATEUSE1")


def base_class(name: str) -> str:
    """``TestCommonOPENREG`` -> ``TestCommon`` (the generic class a device class was made from)."""
    for suffix in DEVICE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def test_dtype(name: str) -> str:
    """The dtype an instantiated test runs in, from its name; ``"none"`` when it has none."""
    m = _DTYPE_SUFFIX.search(name)
    return m.group(1) if m else "none"


def test_key(cls_name: str, name: str, device: str) -> str:
    """``("TestCommonOPENREG", "test_out_abs_openreg_float32", "openreg")`` ->
    ``"TestCommon::test_out_abs_DEVICE_float32"``: the same key for a test on either device."""
    head, sep, tail = name.rpartition("_" + device)
    if sep and (tail == "" or tail.startswith("_")):
        name = head + "_DEVICE" + tail
    return f"{base_class(cls_name)}::{name}"


def _all_devices_shim() -> None:
    classes = {c for c in os.environ.get("OPENREG_PT_ALL_DEVICES", "").split(",") if c}
    if not classes:
        return
    from torch.testing._internal import common_device_type as cdt

    original = cdt.instantiate_device_type_tests

    def instantiate_device_type_tests(generic_test_class, scope, *args, **kwargs):
        if generic_test_class.__name__ in classes and kwargs.get("only_for") == "cpu":
            kwargs["only_for"] = None
        return original(generic_test_class, scope, *args, **kwargs)

    cdt.instantiate_device_type_tests = instantiate_device_type_tests


def _standins_shim() -> None:
    import importlib.util
    import sys
    import types
    import unittest

    for module, classes in json.loads(os.environ.get("OPENREG_PT_STANDINS") or "{}").items():
        try:
            if importlib.util.find_spec(module) is not None:
                continue  # the real module is there: it is used
        except ModuleNotFoundError:  # its package is not there either
            pass
        stand_in = types.ModuleType(module)
        for name in classes:
            setattr(stand_in, name, type(name, (unittest.TestCase,), {"__module__": module}))
        package = module.rpartition(".")[0]
        if package and package not in sys.modules:
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = []
        sys.modules[module] = stand_in


def _cpu_configs() -> None:
    if os.environ.get("OPENREG_PT_CPU_CONFIGS") != "1":
        return
    from torch.testing._internal import common_optimizers as co

    original = co._get_optim_inputs_including_global_cliquey_kwargs

    def cpu_configs(device, dtype, optim_info, skip=()):
        return original("cpu", dtype, optim_info, skip=skip)

    co._get_optim_inputs_including_global_cliquey_kwargs = cpu_configs


def pytest_configure(config):
    _all_devices_shim()
    _standins_shim()
    _cpu_configs()


def pytest_collection_modifyitems(config, items):
    raw = os.environ.get("OPENREG_PT_SELECT")
    if not raw:
        return
    selection: dict[str, list[str]] = json.loads(raw)
    deselect = re.compile(os.environ.get("OPENREG_PT_DESELECT") or r"(?!)")
    sample = int(os.environ.get("OPENREG_PT_SAMPLE") or 1)
    device = os.environ.get("PYTORCH_TESTING_DEVICE_ONLY_FOR", "")
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        dtypes = selection.get(base_class(cls.__name__)) if cls is not None else None
        if (dtypes is not None and ("*" in dtypes or test_dtype(item.name) in dtypes)
                and not deselect.match(item.name)
                and zlib.crc32(test_key(cls.__name__, item.name, device).encode()) % sample == 0):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
