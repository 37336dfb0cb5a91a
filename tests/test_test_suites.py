"""The test suites people already have run on openreg (docs/test_suites.md): transformers' and
diffusers' testing utilities pick openreg through the device spec shipped in the package, PyTorch's
device-generic tests through the test base for TORCH_TEST_DEVICES, and a setting that would not
test openreg fails with the variable and the fix instead of testing the CPU.

Each suite reads its variables once per process, at import: every case runs in a subprocess.
"""
import json
import os
import textwrap

import pytest
import torch

# Installed by the Makefile: a missing library fails here, it is not skipped.
import diffusers  # noqa: F401
import transformers  # noqa: F401

from torch_openreg import testing
import suite_process
import torch_behaviour

# transformers' and diffusers' own logging off: these tests read the processes' last line
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error"}


def run(args, cwd, env_extra=None, timeout=300):
    return suite_process.run(args, cwd, {**QUIET, **(env_extra or {})}, timeout)


def run_json(code, cwd, env_extra=None):
    r = run(["-c", textwrap.dedent(code)], cwd, env_extra)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# What a suite's helpers did on the device, seen through openreg's own state: the seed of the
# current device (the CPU generator is seeded otherwise, to tell them apart), the cache emptied
# (memory reserved by a freed tensor given back), the device count (3 devices in these runs,
# where the libraries' fallback answers 1 or 0).
PROBE = """
import json, torch
torch.manual_seed(7)
x = torch.ones(1 << 20, device=torch_device)
del x
reserved_before = torch.openreg.memory_reserved()
backend_manual_seed(torch_device, 1234)
backend_empty_cache(torch_device)
out = {"device": torch_device, "seed": torch.openreg.initial_seed(), "cpu_seed": torch.initial_seed(),
       "reserved_before": reserved_before, "reserved_after": torch.openreg.memory_reserved(),
       "count": backend_device_count(torch_device),
       "same_functions": [BACKEND_MANUAL_SEED[torch_device] is torch.openreg.manual_seed,
                          BACKEND_EMPTY_CACHE[torch_device] is torch.openreg.empty_cache,
                          BACKEND_DEVICE_COUNT[torch_device] is torch.openreg.device_count]}
"""


def write_spec_with_cli(suite, folder):
    r = run(["-m", "torch_openreg.testing", "spec", suite], folder)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == testing.SPEC_FILE
    assert (folder / testing.SPEC_FILE).is_file()


def test_transformers_testing_utils_pick_openreg_through_the_spec(tmp_path):
    write_spec_with_cli("transformers", tmp_path)
    out = run_json("""
from transformers.testing_utils import (BACKEND_DEVICE_COUNT, BACKEND_EMPTY_CACHE,
    BACKEND_MANUAL_SEED, backend_device_count, backend_empty_cache, backend_manual_seed,
    torch_device)
""" + PROBE + "print(json.dumps(out))", tmp_path,
        {"TRANSFORMERS_TEST_DEVICE_SPEC": testing.SPEC_FILE, "OPENREG_DEVICE_COUNT": "3"})
    assert out["device"] == "openreg"
    assert out["same_functions"] == [True, True, True]
    assert (out["seed"], out["cpu_seed"]) == (1234, 7)
    assert out["reserved_before"] > 0 and out["reserved_after"] == 0
    assert out["count"] == 3


def test_diffusers_testing_utils_pick_openreg_through_the_spec(tmp_path):
    write_spec_with_cli("diffusers", tmp_path)
    out = run_json("""
from diffusers.utils.testing_utils import (BACKEND_DEVICE_COUNT, BACKEND_EMPTY_CACHE,
    BACKEND_MANUAL_SEED, BACKEND_MAX_MEMORY_ALLOCATED, BACKEND_SUPPORTS_TRAINING,
    backend_device_count, backend_empty_cache, backend_manual_seed, torch_device)
""" + PROBE + """
out["training"] = BACKEND_SUPPORTS_TRAINING[torch_device]
out["max_memory_allocated"] = BACKEND_MAX_MEMORY_ALLOCATED[torch_device] is torch.openreg.max_memory_allocated
print(json.dumps(out))
""", tmp_path, {"DIFFUSERS_TEST_DEVICE_SPEC": testing.SPEC_FILE, "OPENREG_DEVICE_COUNT": "3"})
    assert out["device"] == "openreg"
    assert out["same_functions"] == [True, True, True] and out["max_memory_allocated"]
    assert (out["seed"], out["cpu_seed"]) == (1234, 7)
    assert out["reserved_before"] > 0 and out["reserved_after"] == 0
    assert out["count"] == 3 and out["training"] is True


SUITE_MODULES = {"transformers": "transformers.testing_utils",
                 "diffusers": "diffusers.utils.testing_utils"}


MISTAKES = ["backend only", "spec with a folder", "spec not here"]


def mistaken_environment(tmp_path, suite, mistake):
    prefix = testing.SPEC_VARIABLES[suite]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    testing.write_spec(suite, elsewhere)
    return {
        "backend only": {f"{prefix}_TEST_BACKEND": "torch_openreg"},
        "spec with a folder": {f"{prefix}_TEST_DEVICE_SPEC": str(elsewhere / testing.SPEC_FILE)},
        "spec not here": {f"{prefix}_TEST_DEVICE_SPEC": testing.SPEC_FILE},
    }[mistake]


def assert_names_variable_and_fix(message, suite, variable):
    assert variable in message
    assert f"python -m torch_openreg.testing spec {suite}" in message
    assert f"{testing.SPEC_VARIABLES[suite]}_TEST_DEVICE_SPEC={testing.SPEC_FILE}" in message


@pytest.mark.parametrize("suite", ["transformers", "diffusers"])
@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistaken_setting_is_refused(tmp_path, suite, mistake):
    env = mistaken_environment(tmp_path, suite, mistake)
    with pytest.raises(testing.SuiteConfigError) as info:
        testing._check_suite_environment(env, cwd=tmp_path)
    assert_names_variable_and_fix(str(info.value), suite, next(iter(env)))
    # The right setting passes the same check.
    testing.write_spec(suite, tmp_path)
    testing._check_suite_environment(
        {f"{testing.SPEC_VARIABLES[suite]}_TEST_DEVICE_SPEC": testing.SPEC_FILE,
         f"{testing.SPEC_VARIABLES[suite]}_TEST_BACKEND": "torch_openreg"}, cwd=tmp_path)
    # A spec that is not openreg's is the suite's business.
    testing._check_suite_environment(
        {f"{testing.SPEC_VARIABLES[suite]}_TEST_DEVICE_SPEC": "/x/npu_spec.py"}, cwd=tmp_path)


@pytest.mark.parametrize("suite,mistake", [("transformers", "backend only"),
                                           ("diffusers", "spec with a folder")])
def test_a_wrong_or_missing_spec_stops_the_suite_before_it_picks_the_cpu(tmp_path, suite, mistake):
    env = mistaken_environment(tmp_path, suite, mistake)
    r = run(["-c", f"import {SUITE_MODULES[suite]} as t; print('DEVICE', t.torch_device)"],
            tmp_path, env)
    assert r.returncode != 0
    assert "DEVICE" not in r.stdout  # the suite never got to choose a device: not the CPU
    assert "SuiteConfigError" in r.stderr
    assert_names_variable_and_fix(r.stderr, suite, next(iter(env)))


def test_without_a_spec_the_libraries_test_the_cpu(tmp_path):
    """What the check above guards against: told nothing, both suites pick the CPU silently,
    although torch.accelerator is openreg."""
    r = run(["-c", "import torch, transformers.testing_utils as t, diffusers.utils.testing_utils"
             " as d; print(t.torch_device, d.torch_device, torch.accelerator.current_accelerator())"],
            tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "cpu", "openreg"]


def test_torch_test_devices_naming_a_missing_test_base_fails(tmp_path):
    r = run(["-c", "import torch"], tmp_path,
            {"TORCH_TEST_DEVICES": str(tmp_path / "pytorch_test_base.py")})
    assert r.returncode != 0
    assert "TORCH_TEST_DEVICES" in r.stderr
    assert "python -m torch_openreg.testing spec pytorch" in r.stderr


def test_cli(tmp_path, capsys, monkeypatch):
    from torch_openreg.testing.__main__ import main
    monkeypatch.chdir(tmp_path)
    assert main(["spec", "pytorch"]) == 0
    assert capsys.readouterr().out.strip() == str(testing.TEST_BASE)
    assert testing.TEST_BASE.is_file()
    with pytest.raises(FileNotFoundError):  # no such folder: an error, not a silent pass
        main(["spec", "diffusers", "--dir", str(tmp_path / "d")])
    (tmp_path / testing.SPEC_FILE).write_text("DEVICE_NAME = 'mine'\n")
    with pytest.raises(FileExistsError, match="not openreg's device spec"):
        main(["spec", "transformers"])
    assert (tmp_path / testing.SPEC_FILE).read_text() == "DEVICE_NAME = 'mine'\n"
    with pytest.raises(SystemExit) as info:
        main(["spec", "jax"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert main(["exclusions"]) == 0
    out = capsys.readouterr().out
    for cls, methods in testing.TEST_EXCLUSIONS.items():
        for method, reason in methods.items():
            dtypes = testing.TEST_EXCLUSION_DTYPES.get(cls, {}).get(method)
            only = f" [{', '.join(str(d) for d in dtypes)}]" if dtypes else ""
            assert f"{cls}.{method}{only}: {reason}" in out


# A device-generic test file as PyTorch writes them. Its class is named after one of PyTorch's
# so that the test base's exclusions apply to it: the excluded test expects CUDA's behaviour.
GENERIC = '''
import torch
from torch.testing._internal.common_device_type import (dtypes, instantiate_device_type_tests,
                                                        onlyNativeDeviceTypes)
from torch.testing._internal.common_utils import TestCase, run_tests


class TestBinaryUfuncs(TestCase):
    @onlyNativeDeviceTypes  # as PyTorch's: openreg, autoloaded, is one of NATIVE_DEVICES
    @dtypes(torch.int64, torch.uint8)
    def test_fmod_remainder_by_zero_integral(self, device, dtype):
        x = torch.arange(1, 7, device=device, dtype=dtype)
        for fn in (torch.fmod, torch.remainder):
            if self.device_type == "cpu":
                with self.assertRaisesRegex(RuntimeError, "ZeroDivisionError"):
                    fn(x, torch.zeros_like(x))
            else:
                value = 255 if dtype == torch.uint8 else -1
                self.assertTrue(torch.all(fn(x, torch.zeros_like(x)) == value))

    # Excluded for float16 only: its float32 variant runs (from torch 2.14; 2.13 leaves out the
    # whole method).
    @dtypes(torch.float16, torch.float32)
    def test_pow(self, device, dtype):
        x = torch.full((3,), 0.5, device=device, dtype=dtype)
        if self.device_type == "cpu" and dtype == torch.float16:
            with self.assertRaisesRegex(RuntimeError, "not implemented for 'ComplexHalf'"):
                torch.pow(x, 1.0j)
        else:
            self.assertEqual(torch.pow(x, 1.0j).cpu(), torch.pow(x.cpu().double(), 1.0j),
                             exact_dtype=False, atol=1e-3, rtol=1e-3)

    @dtypes(torch.float32, torch.int64)
    def test_add(self, device, dtype):
        x = torch.arange(6, device=device).to(dtype)
        self.assertEqual(x.device.type, "openreg")
        self.assertEqual((x + x).cpu(), torch.arange(6).to(dtype) * 2)

    def test_all_devices(self, devices):
        self.assertEqual(devices, ["openreg:0", "openreg:1"])

    test_all_devices.num_required_devices = 2


instantiate_device_type_tests(TestBinaryUfuncs, globals())

if __name__ == "__main__":
    run_tests()
'''


def run_generic(tmp_path, env_extra):
    (tmp_path / "test_generic.py").write_text(GENERIC)
    r = run(["test_generic.py", "-v"], tmp_path,
            {"PYTORCH_TESTING_DEVICE_ONLY_FOR": "openreg", **env_extra})
    results = {}
    for line in r.stderr.splitlines():
        if " ... " in line and line.startswith("test_"):
            name, rest = line.split(" ", 1)
            cls = rest[rest.index("(") + 1:rest.index(")")].split(".")[-2]
            results[f"{cls}.{name}"] = rest.rsplit(" ... ", 1)[-1].strip()
    return r, results


def test_pytorch_device_generic_tests_run_through_the_test_base(tmp_path):
    r, results = run_generic(tmp_path, {"TORCH_TEST_DEVICES": str(testing.TEST_BASE)})
    assert r.returncode == 0, r.stderr[-3000:]
    # Every generated test ran on openreg, once, under one class: the excluded one is not there.
    classes = {name.split(".")[0] for name in results}
    assert len(classes) == 1, results
    pow_variants = ["test_pow_openreg_float32"] if torch_behaviour.DTYPE_EXCLUSIONS else []
    assert sorted(n.split(".")[1] for n in results) == [
        "test_add_openreg_float32", "test_add_openreg_int64", "test_all_devices_openreg",
        *pow_variants]
    assert set(results.values()) == {"ok"}


def test_without_the_test_base_the_excluded_test_fails(tmp_path):
    """The exclusion is needed: PyTorch's own PrivateUse1TestBase generates the test, and it
    fails on openreg for the reason TEST_EXCLUSIONS gives."""
    r, results = run_generic(tmp_path, {})
    assert r.returncode != 0
    failed = sorted(n.split(".")[1] for n, s in results.items() if s != "ok")
    assert failed == ["test_fmod_remainder_by_zero_integral_openreg_int64",
                      "test_fmod_remainder_by_zero_integral_openreg_uint8",
                      "test_pow_openreg_float16"]
    assert results["TestBinaryUfuncsPRIVATEUSE1.test_pow_openreg_float32"] == "ok"
    assert "ZeroDivisionError" in r.stderr
    assert "not implemented for 'ComplexHalf'" in r.stderr


@pytest.mark.parametrize("fn", [torch.fmod, torch.remainder])
def test_excluded_deviation_still_holds_integer_division_by_zero_raises(fn):
    """TEST_EXCLUSIONS['TestBinaryUfuncs']['test_fmod_remainder_by_zero_integral']: the day
    openreg returns CUDA's value instead of raising, this fails and the entry must go."""
    assert "test_fmod_remainder_by_zero_integral" in testing.TEST_EXCLUSIONS["TestBinaryUfuncs"]
    for dtype in (torch.int64, torch.uint8):
        x = torch.arange(1, 7, dtype=dtype, device="openreg")
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            fn(x, torch.zeros_like(x))


# [docs:start EXCLUSION_CHECK_COMPLEXHALF_POW]
@pytest.mark.parametrize("method", ["test_pow", "test_complex_scalar_pow_tensor"])
def test_excluded_deviation_still_holds_complexhalf_pow_raises(method):
    """TEST_EXCLUSIONS['TestBinaryUfuncs'][method], float16 only: float16 with a complex exponent
    (test_pow) or under a complex base (test_complex_scalar_pow_tensor) computes in ComplexHalf,
    where the CPU's pow kernel has no implementation. The day openreg computes it, this fails and
    the entry must go."""
    assert testing.TEST_EXCLUSION_DTYPES["TestBinaryUfuncs"][method] == (torch.float16,)
    x = torch.tensor([0.5, 1.5, 2.0], dtype=torch.float16)
    for device in ("cpu", "openreg"):  # the CPU raises too: the deviation is CUDA's, not ours
        xd = x.to(device)
        with pytest.raises(NotImplementedError, match="not implemented for 'ComplexHalf'"):
            torch.pow(xd, 1.0j) if method == "test_pow" else torch.pow(1.5j, xd)
    # float32 computes in ComplexFloat: the other dtypes of these tests run on openreg.
    assert torch.equal(torch.pow(x.float().to("openreg"), 1.0j).cpu(), torch.pow(x.float(), 1.0j))
# [docs:end EXCLUSION_CHECK_COMPLEXHALF_POW]


def test_excluded_deviation_still_holds_int4_packing_is_cudas():
    """TEST_EXCLUSIONS['TestLinalg']['test__int4_mm'] and ['test_compile_int4_mm']: on a device
    that is not the CPU they pack with _convert_weight_to_int4pack, CUDA's operator, which has no
    CPU kernel for openreg to run. The day openreg packs with it, this fails and the entries
    must go."""
    assert {"test__int4_mm", "test_compile_int4_mm"} <= set(testing.TEST_EXCLUSIONS["TestLinalg"])
    w = torch.randint(0, 16, (64, 32), dtype=torch.int32)
    for device in ("cpu", "openreg"):  # the CPU has no kernel either: the op is CUDA's
        with pytest.raises(NotImplementedError, match="_convert_weight_to_int4pack"):
            torch._convert_weight_to_int4pack(w.to(device), 2)
    # the CPU's packing, which the test uses on the CPU, runs on openreg with the CPU's result
    packed = torch._convert_weight_to_int4pack_for_cpu(w, 2)
    assert torch.equal(torch._convert_weight_to_int4pack_for_cpu(w.to("openreg"), 2).cpu(), packed)


def test_excluded_deviation_still_holds_lstsq_driver_error_is_the_cpus():
    """TEST_EXCLUSIONS['TestLinalg']['test_linalg_lstsq_input_checks']: an unknown lstsq driver
    raises the CPU's message on openreg (all four drivers exist), where the test expects CUDA's
    "other than `gels` is not supported". The day openreg raises CUDA's, this fails."""
    assert "test_linalg_lstsq_input_checks" in testing.TEST_EXCLUSIONS["TestLinalg"]
    a, b = torch.rand(2, 2, 2, 2), torch.rand(2, 2, 2)
    for device in ("cpu", "openreg"):
        with pytest.raises(RuntimeError, match=r"should be one of \(gels, gelsy, gelsd, gelss\)"):
            torch.linalg.lstsq(a.to(device), b.to(device), driver="fictitious_driver")


def test_excluded_deviation_still_holds_storage_type_is_the_backends():
    """TEST_EXCLUSIONS['TestTorchDeviceType']['test_tensor_storage_type']: openreg's typed storage
    class is torch.openreg's, as CUDA's is torch.cuda's; the test expects the CPU's."""
    assert "test_tensor_storage_type" in testing.TEST_EXCLUSIONS["TestTorchDeviceType"]
    for dtype, name in ((torch.float32, "FloatStorage"), (torch.int64, "LongStorage")):
        t = torch.ones(2, dtype=dtype, device="openreg")
        assert t.storage_type() is getattr(torch.openreg, name)
        assert t.storage_type() is not getattr(torch, name)


def test_excluded_deviation_still_holds_grad_scale_is_not_a_cpu_float_tensor():
    """TEST_EXCLUSIONS['TestTorchDeviceType']['test_grad_scaling_state_dict']: GradScaler's scale
    on openreg is an openreg tensor, not an instance of the CPU's legacy torch.FloatTensor."""
    assert "test_grad_scaling_state_dict" in testing.TEST_EXCLUSIONS["TestTorchDeviceType"]
    scaler = torch.GradScaler(device="openreg", init_scale=6.0)
    scaler.scale(torch.full((1,), 4.0, device="openreg"))
    assert scaler._scale.device.type == "openreg"
    assert scaler._scale.type() == "torch.openreg.FloatTensor"
    assert not isinstance(scaler._scale, torch.FloatTensor)


def test_excluded_deviation_still_holds_cpu_grad_scaler_warning_names_the_cpu():
    """TEST_EXCLUSIONS['TestTorchDeviceType']['test_grad_scaler_deprecated_warning']: the test
    builds torch.cpu.amp.GradScaler on every device but CUDA; its warning names the CPU's class,
    not torch.openreg.amp.GradScaler as the test expects."""
    assert "test_grad_scaler_deprecated_warning" in testing.TEST_EXCLUSIONS["TestTorchDeviceType"]
    with pytest.warns(FutureWarning) as record:
        torch.cpu.amp.GradScaler(init_scale=2.0)
    messages = " ".join(str(w.message) for w in record)
    assert "`torch.cpu.amp.GradScaler(args...)` is deprecated" in messages
    assert "torch.openreg.amp.GradScaler" not in messages


@pytest.mark.parametrize("method", ["test_linear_cross_entropy_loss_default",
                                    "test_linear_cross_entropy_loss_prob_target_none_reduction"])
def test_excluded_deviation_still_holds_linear_cross_entropy_gives_the_cpus_results(method):
    """TEST_EXCLUSIONS['TestNNDeviceType'][method]: the test's ULP caps for a device that is not
    the CPU are CUDA's, and openreg gives the CPU's results (the CPU's kernels), bit for bit,
    chunked forward and backward. The day openreg computes them otherwise, this fails and the
    entry must be looked at again."""
    assert method in testing.TEST_EXCLUSIONS["TestNNDeviceType"]
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=4)
    reduction = "none" if "none_reduction" in method else "mean"
    results = []
    for device in ("cpu", "openreg"):
        torch.manual_seed(0)
        inp = torch.randn(13, 7).to(device).requires_grad_()
        weight = torch.randn(11, 7).to(device).requires_grad_()
        if "prob_target" in method:
            target = torch.softmax(torch.randn(13, 11), dim=1).to(device)
        else:
            target = torch.randint(0, 11, (13,)).to(device)
        out = torch.nn.functional.linear_cross_entropy(inp, weight, target, reduction=reduction,
                                                       options=options)
        out.sum().backward()
        results.append([t.detach().cpu() for t in (out, inp.grad, weight.grad)])
    for cpu, ore in zip(*results):
        assert torch.equal(cpu, ore)


def test_excluded_deviation_still_holds_transformer_fast_path_on_privateuse1():
    """TEST_EXCLUSIONS['TestNNDeviceType']['test_transformerencoderlayer']: the test expects the
    fast path's NaN for a fully masked row only when ``result.is_cuda or result.is_cpu``;
    nn.TransformerEncoderLayer takes the fast path on the PrivateUse1 device as well."""
    assert "test_transformerencoderlayer" in testing.TEST_EXCLUSIONS["TestNNDeviceType"]
    for device in ("cpu", "openreg"):
        layer = torch.nn.TransformerEncoderLayer(4, 2, 16, 0.0, batch_first=True).to(device)
        x = torch.tensor([[[20., 30., 40., 50.]]], device=device)
        mask = torch.tensor([[True]], device=device)
        with torch.no_grad():
            out = layer.eval()(x, src_key_padding_mask=mask)
        assert torch.isnan(out.cpu()).all()  # the fast path's result, on both devices
    assert not (out.is_cuda or out.is_cpu)  # what the test tests instead


@pytest.mark.parametrize("method", ["test_broadcast_double_backwards", "test_broadcast_no_grad",
                                    "test_broadcast_not_requiring_grad",
                                    "test_data_parallel_with_empty_parameter_shapes"])
def test_excluded_deviation_still_holds_nn_parallel_broadcast_is_cuda_only(method):
    """TEST_EXCLUSIONS['TestNNDeviceType'][method]: torch.nn.parallel's Broadcast and
    DataParallel copy through torch._C._broadcast_coalesced, which only CUDA implements (a
    CPU-only build of torch, as 2.13's here, has no such binding at all)."""
    assert method in testing.TEST_EXCLUSIONS["TestNNDeviceType"]
    with pytest.raises((RuntimeError, AttributeError),
                       match=r"NVIDIA|CUDA|torch\._C' has no attribute '_broadcast"):
        torch.nn.parallel.comm.broadcast(torch.ones(2, device="openreg"), [0, 1])


def test_exclusion_config_leaves_out_only_the_listed_dtypes():
    config = testing.exclusion_config()["TestBinaryUfuncs"]
    assert config["test_fmod_remainder_by_zero_integral"] == "*"
    assert config["test_pow"] == {"dtypes": [torch.float16]}
    assert set(config) == set(testing.TEST_EXCLUSIONS["TestBinaryUfuncs"])


def test_the_test_base_is_not_importable_as_a_module():
    import runpy
    with pytest.raises(ImportError, match="TORCH_TEST_DEVICES"):
        runpy.run_path(str(testing.TEST_BASE))


def test_pytorch_suites_comparison_pairs_tests_across_devices(tmp_path, monkeypatch, capsys):
    """tools/pytorch_suites.py (make pytorch-suites) pairs a test's two runs by its name without
    the device, and reports the tests passing on the CPU but failing on openreg by cause."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import pytorch_suites

    def junit(device, cls, cases):
        body = "".join(f'<testcase classname="test_ops.{cls}" name="{name}">{inner}</testcase>'
                       for name, inner in cases)
        (tmp_path / f"test_ops-common-{device}.xml").write_text(
            f"<testsuites><testsuite>{body}</testsuite></testsuites>")

    junit("cpu", "TestCommonCPU", [("test_out_abs_cpu_float32", ""),
                                   ("test_out_cos_cpu_float32", ""),
                                   ("test_compare_cpu_sin_cpu_float32", '<skipped message="x"/>')])
    junit("openreg", "TestCommonPRIVATEUSE1", [
        ("test_out_abs_openreg_float32", ""),
        ("test_out_cos_openreg_float32",
         '<failure message="RuntimeError: Expected all tensors to be on openreg:0"/>'),
        ("test_compare_cpu_sin_openreg_float32", "")])
    monkeypatch.setattr(pytorch_suites, "OUT", tmp_path)
    monkeypatch.setitem(pytorch_suites.SELECTION, "test_ops.py", [("common", {}, "", 1)])
    pytorch_suites.compare(["test_ops.py"])
    out = capsys.readouterr().out
    assert "cpu           3 run:      2 passed" in out
    assert "openreg       3 run:      2 passed,     1 failed" in out
    assert "passed on the CPU and failed on openreg: 1" in out
    assert "1 x RuntimeError: Expected all tensors to be on DEV" in out
    assert "TestCommon::test_out_cos_DEVICE_float32" in out


def test_pytorch_suites_comparison_gives_each_devices_time(tmp_path, monkeypatch, capsys):
    """The comparison gives the time each device took for the same selection (issue 41's
    measurement of test_optim.py): the sum of the JUnit testcases' times and pytest's session
    time, and openreg's over the CPU's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import pytorch_suites

    for device, cls, times, session in (("cpu", "TestOptimRenewedCPU", (1.5, 2.5), 5.0),
                                        ("openreg", "TestOptimRenewedPRIVATEUSE1", (2.0, 4.0), 7.5)):
        body = "".join(f'<testcase classname="test_optim.{cls}" name="test_{i}_{device}_float32" '
                       f'time="{t}"/>' for i, t in enumerate(times))
        (tmp_path / f"test_optim-all-{device}.xml").write_text(
            f'<testsuites><testsuite time="{session}">{body}</testsuite></testsuites>')
    monkeypatch.setattr(pytorch_suites, "OUT", tmp_path)
    monkeypatch.setitem(pytorch_suites.SELECTION, "test_optim.py", [("all", {}, "", 1)])
    pytorch_suites.compare(["test_optim.py"])
    out = capsys.readouterr().out
    assert "test time (sum of testcases): cpu 4.0 s, openreg 6.0 s, openreg / cpu 1.50x" in out
    assert "wall time (pytest session): cpu 5.0 s, openreg 7.5 s, openreg / cpu 1.50x" in out


def test_pytorch_suites_plugin_stands_in_for_missing_sibling_modules(tmp_path, monkeypatch):
    """A module the test file imports from beside it gets an empty stand-in defining the named
    classes when the folder lacks it (test_optim.py without test/optim/), and the real module
    is used when it is there."""
    import sys
    import unittest
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import pytorch_suites_plugin

    (tmp_path / "present_pkg").mkdir()
    (tmp_path / "present_pkg" / "real.py").write_text("class TestReal:\n    origin = 'file'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPENREG_PT_STANDINS", json.dumps(
        {"absent_pkg_41.test_mod": ["TestA", "TestB"], "present_pkg.real": ["TestReal"]}))
    for name in ("absent_pkg_41", "absent_pkg_41.test_mod", "present_pkg", "present_pkg.real"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    pytorch_suites_plugin._standins_shim()
    from absent_pkg_41.test_mod import TestA, TestB  # noqa: F401
    assert issubclass(TestA, unittest.TestCase)
    assert unittest.TestLoader().loadTestsFromTestCase(TestA).countTestCases() == 0
    from present_pkg.real import TestReal
    assert TestReal.origin == "file"
    for name in ("absent_pkg_41", "absent_pkg_41.test_mod"):
        sys.modules.pop(name, None)


def test_pytorch_suites_plugin_cpu_configs_gives_openreg_the_cpus_optimizer_configs(monkeypatch):
    """PyTorch's optimizer-test helper gives openreg (foreach kernels) a foreach twin of each
    configuration the CPU does not get: OPENREG_PT_CPU_CONFIGS=1 gives every device the CPU's
    list, so that test_optim's times compare the same work."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import pytorch_suites_plugin
    from torch.testing._internal import common_optimizers as co

    rmsprop = next(o for o in co.optim_db if o.optim_cls.__name__ == "RMSprop")
    helper = co._get_optim_inputs_including_global_cliquey_kwargs
    cpu = [i.kwargs for i in helper("cpu", torch.float32, rmsprop)]
    assert len([i.kwargs for i in helper("openreg", torch.float32, rmsprop)]) > len(cpu)
    monkeypatch.setattr(co, "_get_optim_inputs_including_global_cliquey_kwargs", helper)
    monkeypatch.setenv("OPENREG_PT_CPU_CONFIGS", "1")
    pytorch_suites_plugin._cpu_configs()
    now = co._get_optim_inputs_including_global_cliquey_kwargs
    assert [i.kwargs for i in now("openreg", torch.float32, rmsprop)] == cpu


# The test file the switches of tools/library_suites.py are tried on: skips for a device-list
# reason (lifted on openreg) and for other reasons (kept), in unittest's and pytest's forms.
LIFTED_SKIPS_TESTS = """
import unittest
import pytest

LISTED = {listed!r}


class TestUnittestForm(unittest.TestCase):
    @unittest.skipIf(True, LISTED)
    def test_skipif(self):
        pass

    @unittest.skipUnless(False, LISTED)
    def test_skipunless(self):
        pass

    @unittest.skipUnless(False, LISTED)
    @unittest.skip("flaky")
    def test_listed_over_other(self):
        pass

    def test_runtime_listed(self):
        self.skipTest("CUDA or XPU not available for offload test.")

    def test_runtime_other(self):
        self.skipTest("test is slow")


class TestPytestForm:
    @pytest.mark.skipif(True, reason=LISTED)
    def test_marked(self):
        pass

    @pytest.mark.skipif(True, reason="other")
    def test_marked_other(self):
        pass
"""


@pytest.mark.parametrize("lib, listed, lifted", [
    ("diffusers", "float16 requires CUDA or XPU", set()),
    ("accelerate", "test requires a CUDA GPU or XPU", {"test_runtime_listed"}),
])
def test_library_suites_plugins_lift_device_list_skips(tmp_path, monkeypatch, lib, listed,
                                                       lifted):
    """The openreg plugins of tools/library_suites.py run the tests a library skips for one of
    its device-list reasons, in unittest's form (skipIf, skipUnless: the method is wrapped) as in
    pytest's (skipif marks), and in accelerate's, the test's own skipTest; every other skip
    stays, also one under a lifted one."""
    import sys
    import xml.etree.ElementTree as ET
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import library_suites

    monkeypatch.setattr(library_suites, "OUT", tmp_path / "out")
    plugins = library_suites.write_plugins(lib, "openreg")
    (tmp_path / "test_lifted.py").write_text(LIFTED_SKIPS_TESTS.format(listed=listed))
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "--junitxml", "out.xml", "test_lifted.py"]
    for name in plugins:
        args += ["-p", name]
    r = run(args, tmp_path, {"PYTHONPATH": os.pathsep.join(
        [str(library_suites.plugin_dir()), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(tmp_path / "out.xml").getroot().iter("testcase"):
        skipped = [c.get("message") for c in case if c.tag == "skipped"]
        outcomes[case.get("name")] = skipped[0] if skipped else "passed"
    assert {name for name, outcome in outcomes.items() if outcome == "passed"} == (
        {"test_skipif", "test_skipunless", "test_marked"} | lifted), outcomes
    assert outcomes["test_listed_over_other"] == "flaky"
    assert outcomes["test_runtime_other"] == "test is slow"
    assert outcomes["test_marked_other"] == "other"
    if not lifted:
        assert outcomes["test_runtime_listed"] == "CUDA or XPU not available for offload test."
