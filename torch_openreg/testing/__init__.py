"""Testing helpers for code that runs on openreg, and what the test suites people already have
need to run on it (docs/test_suites.md).

``hold_stream`` makes an asynchronous window deterministic: while the block runs, nothing queued
on the stream after its start executes, so a test can show that a result read without
synchronizing is not there yet, whatever the machine load. (A simulated copy latency, see
``torch.openreg.set_copy_engine_config``, shows the same bugs with realistic timing, but a test
that relies on it depends on the host thread being scheduled within that latency.)

For test suites: ``device_spec`` is the device spec of transformers' and diffusers' test suites,
``pytorch_test_base.py`` the test base of PyTorch's device-generic tests (``TORCH_TEST_DEVICES``),
``TEST_EXCLUSIONS`` the tests of PyTorch's suite that openreg does not run, each with its reason,
and ``python -m torch_openreg.testing spec SUITE`` prints (or writes) what a suite needs.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from torch_openreg import _C

__all__ = ["hold_stream"]


# [docs:start HOLD_STREAM]
@contextlib.contextmanager
def hold_stream(stream: torch.Stream | None = None, timeout: float = 10.0) -> Iterator[torch.Stream]:
    """Holds back the work queued on ``stream`` (default: the current stream of the current
    openreg device) from the start of the block until its end::

        with hold_stream():
            host.copy_(x, non_blocking=True)
            assert not torch.equal(host, x.cpu())   # the copy cannot have landed
        torch.openreg.synchronize()                  # now it has

    Inside the block, do not wait for the held stream (``synchronize``, a blocking copy or a
    kernel on it): that would wait for the end of the block. The hold opens by itself after
    ``timeout`` seconds so that such a mistake cannot hang; leaving the block then raises
    ``RuntimeError``.
    """
    if stream is None:
        stream = torch.openreg.current_stream()
    if stream.device.type != "openreg":
        raise ValueError(f"hold_stream expects an openreg stream, got one of {stream.device.type!r}")
    hold = _C._stream_hold(stream.device_index, stream.stream_id, float(timeout))
    expired = False
    try:
        yield stream
    finally:
        expired = not _C._stream_release(hold)
    if expired:
        raise RuntimeError(
            f"hold_stream: the hold of {stream} opened by itself after {timeout} s: the block "
            "waited for the held stream (synchronize, a blocking copy or a kernel on it)"
        )
# [docs:end HOLD_STREAM]


# [docs:start SETTLED_MEMORY_ALLOCATED]
def settled_memory_allocated(device: torch.device | str | int | None = None) -> int:
    """``torch.openreg.memory_allocated(device)`` once what earlier code left behind is gone:
    unreachable reference cycles collected, each autograd device thread done releasing the graph of
    its last backward, and the work queued on every device's streams (frees included) done.

    A leak test reads this before and after the code it checks. ``memory_allocated`` alone can
    move in between for reasons of earlier code: a device thread lets go of a backward's graph
    (with the tensors it saved) a moment after ``backward()`` has returned to the caller, as on
    CUDA, so the free can land in the middle of the next test.
    """
    gc.collect()
    _C._release_autograd_graphs()
    for index in range(torch.openreg.device_count()):
        torch.openreg.synchronize(index)
    return torch.openreg.memory_allocated(device)
# [docs:end SETTLED_MEMORY_ALLOCATED]


__all__ += ["settled_memory_allocated"]


# ---------------------------------------------------------------- test suites (docs/test_suites.md)

import os  # noqa: E402
from pathlib import Path  # noqa: E402

__all__ += ["SPEC_FILE", "SuiteConfigError", "TEST_BASE", "TEST_EXCLUSIONS",
            "TEST_EXCLUSION_DTYPES", "spec_value", "exclusion_config", "write_spec"]

# The file name transformers and diffusers import the device spec by. Both take the spec's path
# from an environment variable but import it by the text before ".py" (importlib.import_module),
# so the value must be a bare file name in the folder the tests run from: a folder in the value
# makes the import fail (docs/test_suites.md, the catalogue). `write_spec` writes a two-line file
# that imports `torch_openreg.testing.device_spec`: the spec itself stays in the package.
SPEC_FILE = "openreg_device_spec.py"
SPEC_VARIABLES = {"transformers": "TRANSFORMERS", "diffusers": "DIFFUSERS"}
# PyTorch's device-generic tests run this file (runpy) for each path in TORCH_TEST_DEVICES.
TEST_BASE = Path(__file__).with_name("pytorch_test_base.py")
_SHIM = ("# Written by `python -m torch_openreg.testing spec {suite}`: the device spec of openreg,\n"
         "# imported from the package (torch_openreg/testing/device_spec.py).\n"
         "from torch_openreg.testing.device_spec import *  # noqa: F401,F403\n")

# [docs:start TEST_EXCLUSIONS]
# Tests of PyTorch's device-generic suite that the openreg test base does not generate: PyTorch
# test class -> {test method: reason}. Each reason is a documented deviation of openreg, not a
# bug: openreg runs the CPU's kernels, so where a test expects CUDA's behaviour of every device
# that is not the CPU, openreg behaves like the CPU. Or the test assumes CUDA where torch does
# (a gap of torch, in docs/privateuse1_gaps.md). tests/test_test_suites.py (a deviation) or
# tests/test_privateuse1_gaps.py (a gap) checks that each reason still holds, so an entry cannot
# outlive it.
TEST_EXCLUSIONS: dict[str, dict[str, str]] = {
    "TestBinaryUfuncs": {
        "test_fmod_remainder_by_zero_integral":
            "integer fmod/remainder by zero raises ZeroDivisionError, as on the CPU (openreg runs "
            "the CPU's kernel); the test expects CUDA's bit pattern (or ROCm's x) on any device "
            "that is not the CPU",
        "test_pow":
            "float16 with complex exponents computes in ComplexHalf, where pow raises "
            "NotImplementedError as on the CPU (openreg runs the CPU's kernel); the test expects "
            "the error on the CPU only",
        "test_complex_scalar_pow_tensor":
            "a complex base with a float16 exponent computes in ComplexHalf, where pow raises "
            "NotImplementedError as on the CPU (openreg runs the CPU's kernel); the test expects "
            "the error on the CPU only",
    },
    "TestLinalg": {
        "test__int4_mm":
            "on any device that is not the CPU the test packs int4 weights with CUDA's "
            "_convert_weight_to_int4pack, which has no CPU kernel: it raises NotImplementedError "
            "on openreg as on the CPU (the CPU's packing, _convert_weight_to_int4pack_for_cpu, "
            "is what openreg runs)",
        "test_compile_int4_mm":
            "the compiled form of test__int4_mm: CUDA's _convert_weight_to_int4pack on any "
            "device that is not the CPU, which has no CPU kernel (NotImplementedError on openreg "
            "as on the CPU)",
        "test_linalg_lstsq_input_checks":
            "linalg.lstsq with an unknown driver raises the CPU's message (openreg runs the "
            "CPU's kernel, which has all four drivers); the test expects CUDA's \"`driver` other "
            "than `gels` is not supported on CUDA\" on any device that is not the CPU",
    },
    "TestAutogradDeviceType": {
        "test_unused_output_device":
            "assumes CUDA: it broadcasts with DataParallel's Broadcast "
            "(torch.nn.parallel._functions), whose copy, torch._C._broadcast_coalesced, is CUDA's, "
            "on any device with two; a gap of torch, in docs/privateuse1_gaps.md (DataParallel)",
    },
    # test_torch.py: tests that know two devices, the CPU and CUDA, and expect the CPU's legacy
    # types (or the CPU's deprecated GradScaler) on every device that is not CUDA.
    "TestTorchDeviceType": {
        "test_tensor_storage_type":
            "an openreg tensor's storage_type() is torch.openreg.<T>Storage, as a CUDA tensor's "
            "is torch.cuda.<T>Storage (the typed storage classes torch registers for the "
            "backend); the test expects torch.cuda's on CUDA and the CPU's torch.<T>Storage on "
            "any other device",
        "test_grad_scaling_state_dict":
            "GradScaler's scale on openreg is an openreg tensor, of legacy type "
            "torch.openreg.FloatTensor; the test expects torch.cuda.FloatTensor on CUDA and the "
            "CPU's torch.FloatTensor on any other device",
        "test_grad_scaler_deprecated_warning":
            "the test builds torch.cpu.amp.GradScaler for every device that is not CUDA and "
            "expects its warning to name torch.<device>.amp.GradScaler: it names "
            "torch.cpu.amp.GradScaler, whatever the device",
    },
    "TestNNDeviceType": {
        "test_linear_cross_entropy_loss_default":
            "the test's ULP caps are chosen by the device's name: any device that is neither "
            "'cpu' nor 'mps' gets CUDA's (input gradient 854 ULP); openreg runs the CPU's kernels "
            "and gives the CPU's results, whose error is within the CPU's cap (8284)",
        "test_linear_cross_entropy_loss_prob_target_none_reduction":
            "the test's ULP caps are chosen by the device's name: any device that is neither "
            "'cpu' nor 'mps' gets CUDA's (float32 input gradient 128 ULP); openreg runs the CPU's "
            "kernels and gives the CPU's results, whose error is within the CPU's cap (384)",
        "test_transformerencoderlayer":
            "the test counts only CUDA and the CPU as devices of the fast path "
            "(result.is_cuda or result.is_cpu), but nn.TransformerEncoderLayer takes it on the "
            "PrivateUse1 device too: a fully masked row gives NaN on openreg, as on the CPU",
        "test_broadcast_double_backwards":
            "torch.nn.parallel's Broadcast (torch._C._broadcast_coalesced) is CUDA-only",
        "test_broadcast_no_grad":
            "torch.nn.parallel's Broadcast (torch._C._broadcast_coalesced) is CUDA-only",
        "test_broadcast_not_requiring_grad":
            "torch.nn.parallel's Broadcast (torch._C._broadcast_coalesced) is CUDA-only",
        "test_data_parallel_with_empty_parameter_shapes":
            "nn.DataParallel replicates through torch._C._broadcast_coalesced, CUDA-only",
    },
}
# Entries that leave out only some dtypes of a method (the other dtypes run): class -> method ->
# dtypes. torch 2.14 and later read this; torch 2.13 leaves out the whole method (see
# exclusion_config).
TEST_EXCLUSION_DTYPES: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    "TestBinaryUfuncs": {
        "test_pow": (torch.float16,),
        "test_complex_scalar_pow_tensor": (torch.float16,),
    },
}
# [docs:end TEST_EXCLUSIONS]


# [docs:start EXCLUSION_CONFIG]
def exclusion_config() -> dict[str, dict[str, object]]:
    """TEST_EXCLUSIONS and TEST_EXCLUSION_DTYPES in the form
    ``DeviceTypeTestBase.set_test_configs(test_exclusions=...)`` takes: class -> {method: "*"
    (every variant) or {"dtypes": [...]}}. torch 2.14 and 2.15 generate the method's other dtypes;
    torch 2.13 tests only whether the method's name is a key, so it leaves out the whole method
    (coarser, never wrong)."""
    config: dict[str, dict[str, object]] = {}
    for cls, methods in TEST_EXCLUSIONS.items():
        dtypes = TEST_EXCLUSION_DTYPES.get(cls, {})
        config[cls] = {m: {"dtypes": list(dtypes[m])} if m in dtypes else "*"
                       for m in sorted(methods)}
    return config
# [docs:end EXCLUSION_CONFIG]


class SuiteConfigError(RuntimeError):
    """A test suite is pointed at openreg in a way that would not test openreg."""


def _spec_fix(suite: str) -> str:
    var = SPEC_VARIABLES[suite]
    return (f"Fix: in the folder you run {suite}' tests from, run "
            f"`python -m torch_openreg.testing spec {suite}` (it writes ./{SPEC_FILE}) and set "
            f"{var}_TEST_DEVICE_SPEC={SPEC_FILE}")


def spec_value(suite: str) -> str:
    """What the suite's environment variable must hold: the file name of the spec for
    transformers and diffusers (a bare name, see SPEC_FILE), the test base's path for PyTorch."""
    if suite == "pytorch":
        return str(TEST_BASE)
    if suite not in SPEC_VARIABLES:
        raise ValueError(f"unknown test suite {suite!r}: expected one of pytorch, "
                         f"{', '.join(SPEC_VARIABLES)}")
    return SPEC_FILE


def write_spec(suite: str, directory: str | os.PathLike = ".") -> Path:
    """Writes ``directory/openreg_device_spec.py`` for transformers or diffusers and returns its
    path. Refuses to overwrite a file of that name that this function did not write."""
    spec_value(suite)  # validates the name
    if suite == "pytorch":
        raise ValueError("PyTorch's suite reads the test base from the package: set "
                         f"TORCH_TEST_DEVICES={TEST_BASE}, nothing to write")
    path = Path(directory) / SPEC_FILE
    text = _SHIM.format(suite=suite)
    if path.exists() and "from torch_openreg.testing.device_spec import" not in path.read_text():
        raise FileExistsError(f"{path} exists and is not openreg's device spec: not overwritten")
    path.write_text(text)
    return path


def _check_suite_environment(environ=os.environ, cwd: str | os.PathLike | None = None) -> None:
    """Raises SuiteConfigError, naming the variable and the fix, when the environment points a
    test suite at openreg in a way that would not test openreg: transformers or diffusers told to
    load openreg but given no device (they would test the CPU), or given openreg's spec by a path
    they cannot import. Called when the package is imported, that is at ``import torch``, before
    the suite reads these variables. Variables that do not name openreg are left alone."""
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    for suite, prefix in SPEC_VARIABLES.items():
        backend = environ.get(f"{prefix}_TEST_BACKEND")
        device = environ.get(f"{prefix}_TEST_DEVICE")
        spec = environ.get(f"{prefix}_TEST_DEVICE_SPEC")
        if backend == "torch_openreg" and not device and not spec:
            raise SuiteConfigError(
                f"{prefix}_TEST_BACKEND=torch_openreg, but neither {prefix}_TEST_DEVICE nor "
                f"{prefix}_TEST_DEVICE_SPEC is set: {suite} would run its tests on the CPU. "
                + _spec_fix(suite))
        if spec and os.path.basename(spec) == SPEC_FILE:
            if os.path.dirname(spec):
                raise SuiteConfigError(
                    f"{prefix}_TEST_DEVICE_SPEC={spec}: {suite} imports the spec by the text "
                    f"before '.py' as a module name, so a folder in the value cannot be imported. "
                    + _spec_fix(suite))
            if not (cwd / spec).is_file():
                raise SuiteConfigError(
                    f"{prefix}_TEST_DEVICE_SPEC={spec}, but there is no {spec} in {cwd}, the "
                    f"folder the tests run from. " + _spec_fix(suite))
    for path in filter(None, environ.get("TORCH_TEST_DEVICES", "").split(":")):
        if os.path.basename(path) == TEST_BASE.name and not os.path.isfile(path):
            raise SuiteConfigError(
                f"TORCH_TEST_DEVICES names {path}, which does not exist. Fix: set "
                f"TORCH_TEST_DEVICES=$(python -m torch_openreg.testing spec pytorch)")
