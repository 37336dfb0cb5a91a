"""The catalogue of PrivateUse1 gaps (docs/privateuse1_gaps.md): places in torch and in libraries
where a backend outside torch's own list of devices is left out. Each test pins today's
behaviour, so it fails, saying so, the day the gap is closed upstream: then the catalogue entry
(and the workaround in openreg, if any) must be updated.
"""
import io
import os
import re
import subprocess
import sys
import tarfile
import textwrap

import pytest
import torch

# Installed by the Makefile: a missing library fails here, it is not skipped.
import accelerate  # noqa: F401
import peft  # noqa: F401
import transformers

import torch_behaviour
from suite_process import run

CLOSED = "gap closed upstream, update docs/privateuse1_gaps.md: "


# [docs:start GAP_FLEX_ATTENTION]
def test_flex_attention_refuses_privateuse1_devices():
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 2, 8, 4, device="openreg")
    try:
        flex_attention(q, q, q)
    except ValueError as e:
        assert "Found input tensors on openreg device" in str(e)
    else:
        pytest.fail(CLOSED + "flex_attention runs on openreg")
# [docs:end GAP_FLEX_ATTENTION]


def _modeling_common_source(tmp_path_factory):
    """transformers' tests/test_modeling_common.py of the installed release: the wheel does not
    ship the tests, the source distribution on PyPI does."""
    folder = tmp_path_factory.mktemp("transformers_sdist")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", str(folder), f"transformers=={transformers.__version__}"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"cannot download transformers' source distribution: {r.stderr[-300:]}")
    archive = next(folder.glob("transformers-*.tar.gz"))
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/tests/test_modeling_common.py"))
        return io.TextIOWrapper(tar.extractfile(member), encoding="utf-8").read()


def test_transformers_sdpa_tolerance_table_knows_device_names(tmp_path_factory):
    """`_test_eager_matches_sdpa_inference` picks its tolerances by device name; any other
    device gets atol=1e-7, where the CPU gets 5e-3 in float16."""
    source = _modeling_common_source(tmp_path_factory)
    body = source[source.index("def _test_eager_matches_sdpa_inference"):]
    body = body[:body.index("\ndef ")]
    assert 'if torch_device in ["cpu", "cuda"]:' in body, CLOSED + "the table is chosen otherwise"
    tail = body[body.index('elif torch_device == "xpu":'):]
    assert "else:\n                atol = 1e-7" in tail, CLOSED + "other devices get other tolerances"
    assert "openreg" not in body and "privateuse1" not in body.lower()
    assert '("cpu", False, torch.float16): 5e-3' in body


def test_accelerate_test_utils_ask_torch_accelerator():
    """Closed upstream in accelerate 1.16.0 (1.15.0: xla, cuda, mps, mlu, sdaa, musa, npu, xpu,
    hpu, neuron by name, else the CPU): get_backend() asks torch.accelerator, so accelerate's
    own tests run on openreg's two devices. Holds the behaviour of the installed release."""
    from accelerate.test_utils.testing import get_backend
    device, count, _ = get_backend()
    assert (device, count) == ("openreg", torch.openreg.device_count())
    assert torch.accelerator.current_accelerator().type == "openreg"


def test_peft_infer_device_knows_a_fixed_device_list():
    from peft.utils.other import infer_device
    assert infer_device() == "cpu", CLOSED + f"peft picks {infer_device()}"


SAMPLE = '''
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_utils import TestCase, run_tests


class TestSample(TestCase):
    def test_ones(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 2)


instantiate_device_type_tests(TestSample, globals(), {only_for})

if __name__ == "__main__":
    run_tests()
'''


def generated(tmp_path, only_for, env):
    (tmp_path / "test_sample.py").write_text(SAMPLE.format(only_for=only_for))
    r = run(["test_sample.py", "-v"], tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(line.split(" ")[1].strip("()") for line in r.stderr.splitlines()
                  if line.startswith("test_"))


def test_pytorch_testing_device_for_custom(tmp_path):
    """A file that instantiates its tests only for CUDA (`only_for="cuda"`) is meant to run on a
    custom device with PYTORCH_TESTING_DEVICE_FOR_CUSTOM. Before torch 2.15 the variable is
    compared with the test base's device type, which is "privateuse1" before the first test class
    is set up and the backend's name after: `openreg` never matches."""
    tests = generated(tmp_path, 'only_for="cuda"', {"PYTORCH_TESTING_DEVICE_FOR_CUSTOM": "openreg"})
    if not torch_behaviour.DEVICE_FOR_CUSTOM_MATCHES_BACKEND_NAME:
        assert tests == [], CLOSED + f"torch {torch.__version__} honours it: {tests}"
    else:
        assert tests == ["__main__.TestSamplePRIVATEUSE1.test_ones_openreg"], tests


def test_torch_test_devices_adds_beside_the_builtin_privateuse1_base(tmp_path):
    """A test base given in TORCH_TEST_DEVICES for the backend is added next to PyTorch's own
    PrivateUse1TestBase (already a base once the backend is registered): every test is generated
    twice, and the built-in copy ignores the test base's exclusions. openreg's test base removes
    the built-in one (torch_openreg/testing/pytorch_test_base.py)."""
    base = tmp_path / "plain_base.py"
    base.write_text("class PlainBase(PrivateUse1TestBase):\n    pass\n\nTEST_CLASS = PlainBase\n")
    tests = generated(tmp_path, "", {"TORCH_TEST_DEVICES": str(base),
                                     "PYTORCH_TESTING_DEVICE_ONLY_FOR": "openreg"})
    assert len(tests) == 2, CLOSED + f"generated once: {tests}"
    assert {t.split(".")[-1] for t in tests} == {"test_ones_openreg"}


# [docs:start GAP_SPEC_PATH]
@pytest.mark.parametrize("module", ["transformers.testing_utils", "diffusers.utils.testing_utils"])
def test_device_spec_is_imported_by_bare_file_name(tmp_path, module):
    """TRANSFORMERS_TEST_DEVICE_SPEC / DIFFUSERS_TEST_DEVICE_SPEC: a path with a folder is turned
    into the module name "/that/folder/spec", which cannot be imported."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_spec.py").write_text(
        "import torch\nDEVICE_NAME = 'openreg'\nMANUAL_SEED_FN = torch.openreg.manual_seed\n"
        "EMPTY_CACHE_FN = torch.openreg.empty_cache\nDEVICE_COUNT_FN = torch.openreg.device_count\n")
    prefix = module.split(".")[0].upper()
    r = run(["-c", f"import {module} as t; print(t.torch_device)"], tmp_path,
            {f"{prefix}_TEST_DEVICE_SPEC": "sub/my_spec.py"})
    assert r.returncode != 0, CLOSED + f"a spec in a folder works: {r.stdout}"
    assert "No module named 'sub/my_spec'" in r.stderr
# [docs:end GAP_SPEC_PATH]


def test_transformers_spec_cannot_name_synchronize_or_memory_functions(tmp_path):
    """transformers reads three functions from a spec (seed, empty cache, device count); its
    other device tables (synchronize, memory allocated, peak memory, the device module) keep
    their defaults for any other device: no-ops and 0."""
    from torch_openreg import testing
    testing.write_spec("transformers", tmp_path)
    r = run(["-c", textwrap.dedent("""
        import torch
        from transformers import testing_utils as t
        x = torch.ones(1 << 16, device="openreg")
        print(t.torch_device, t.backend_memory_allocated("openreg"),
              torch.openreg.memory_allocated() > 0, t.backend_synchronize("openreg"),
              t.backend_torch_accelerator_module("openreg"))
    """)], tmp_path, {"TRANSFORMERS_TEST_DEVICE_SPEC": testing.SPEC_FILE})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["openreg", "0", "True", "None", "None"], (
        CLOSED + f"transformers now reads more from a spec: {r.stdout}")


# [docs:start GAP_REDUCE_OVERHEAD]
def test_reduce_overhead_cudagraphs_are_cuda_only():
    """torch.compile(mode="reduce-overhead") wraps the compiled graph in cudagraph trees only when
    all its nodes are on one device of a type Inductor lists: "cuda" (torch 2.13 and 2.14 compare
    with the literal; 2.15 keeps the list in _CUDAGRAPH_SUPPORTED_DEVICE_TYPES). Any other device is
    skipped like a mix of devices, and silently where the device is not a GPU to Dynamo."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_utils

    node = next(iter(torch.fx.symbolic_trace(lambda x: x + 1).graph.nodes))
    reason = cudagraph_utils.check_multiple_devices_or_any_cpu_nodes({torch.device("openreg", 0): node})
    assert reason is not None, CLOSED + "Inductor accepts cudagraphs on openreg"
    assert reason == "skipping cudagraphs due to multiple devices: device(type='openreg', index=0)"
    assert cudagraph_utils.check_multiple_devices_or_any_cpu_nodes(
        {torch.device("cuda", 0): node}) is None  # the one device type it takes
    # What a user sees: the compiled function runs, without a graph and without a word (the skip is
    # logged only for GPU devices), and only Inductor's counter records it.
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: (x * 2 + 1).sum(), mode="reduce-overhead")
    x = torch.arange(8.0, device="openreg")
    assert f(x).item() == f(x).item() == 64.0
    assert counters["inductor"]["cudagraph_skips"] == 1, CLOSED + dict(counters["inductor"]).__repr__()
    torch._dynamo.reset()
# [docs:end GAP_REDUCE_OVERHEAD]


# [docs:start GAP_DATA_PARALLEL]
def test_data_parallel_takes_privateuse1_but_copies_with_cuda():
    """DataParallel takes the PrivateUse1 backend and all its devices when no CUDA is there
    (torch._utils._get_available_device_type knows the backend), but scatters and broadcasts
    with torch.nn.parallel.comm, whose torch._C._scatter, _broadcast and _broadcast_coalesced
    are CUDA's. The same in torch 2.13, 2.14 and 2.15. PyTorch's test_autograd.py
    test_unused_output_device (DataParallel's Broadcast on any device with two) is excluded from
    openreg's test base for it."""
    from torch._utils import _get_available_device_type
    from torch.nn.parallel import comm
    from torch_openreg.testing import TEST_EXCLUSIONS

    assert "test_unused_output_device" in TEST_EXCLUSIONS["TestAutogradDeviceType"]
    assert _get_available_device_type() == "openreg"
    model = torch.nn.DataParallel(torch.nn.Linear(3, 2).to("openreg"))
    assert (model.device_ids, model.src_device_obj) == ([0, 1], torch.device("openreg", 0))
    x = torch.randn(4, 3, device="openreg")
    for name, copy in (("DataParallel", lambda: model(x)),
                       ("broadcast_coalesced", lambda: comm.broadcast_coalesced([x], [0, 1])),
                       ("broadcast", lambda: comm.broadcast(x, [0, 1]))):
        try:
            out = copy()
        except RuntimeError as e:  # torch.AcceleratorError is one
            assert "CUDA" in str(e) or "NVIDIA" in str(e), f"{name}: {e}"
        except AttributeError as e:  # a CPU-only build of torch (2.13's here) lacks the bindings
            assert re.search(r"torch\._C' has no attribute '_(broadcast|scatter)", str(e)), \
                f"{name}: {e}"
        else:  # where a CUDA device is there, the copies land on it
            types = {t.device.type for t in torch.utils._pytree.tree_leaves(out)}
            assert "openreg" not in types, (CLOSED + f"{name} copies to openreg; remove the "
                                             "exclusion of test_unused_output_device too")
# [docs:end GAP_DATA_PARALLEL]


def _library_test_file(library, relative):
    """diffusers' and accelerate's test files are not in their wheels on PyPI: read them from a
    clone named by OPENREG_<LIBRARY>_CLONE (the one tools/library_suites.py ran), else skip,
    saying so."""
    variable = f"OPENREG_{library.upper()}_CLONE"
    clone = os.environ.get(variable)
    if not clone:
        pytest.skip(f"the tests of {library} ship in no wheel: set {variable} to a clone")
    return open(os.path.join(clone, relative), encoding="utf-8").read()


def _diffusers_test_file(relative):
    return _library_test_file("diffusers", relative)


# [docs:start GAP_DIFFUSERS_FLOAT16]
@pytest.mark.parametrize("relative, reason", [
    ("tests/pipelines/test_pipelines_common.py", "float16 requires CUDA or XPU"),
    ("tests/models/testing_utils/common.py",
     "float16 and bfloat16 can only be use for inference with an accelerator"),
])
def test_diffusers_float16_tests_know_cuda_and_xpu(relative, reason):
    """diffusers' float16 inference tests (pipelines: test_float16_inference,
    test_save_load_float16; models: test_from_save_pretrained_dtype_inference) are skipped on
    every device whose name is not "cuda" or "xpu", although they also require an accelerator
    by the device-agnostic require_accelerator."""
    source = _diffusers_test_file(relative)
    assert reason in source, CLOSED + f"{relative} no longer skips with {reason!r}"
    for at in [i for i in range(len(source)) if source.startswith(reason, i)]:
        assert 'torch_device not in ["cuda", "xpu"]' in source[max(0, at - 200):at], (
            CLOSED + f"{relative} chooses otherwise before {reason!r}")
# [docs:end GAP_DIFFUSERS_FLOAT16]


# [docs:start GAP_ACCELERATE_DEFAULT_DEVICE]
def test_accelerate_default_device_asks_torch_accelerator(tmp_path):
    """Closed upstream in accelerate 1.16.0 (1.15.0: PartialState.default_device listed mps, mlu,
    sdaa, musa, npu, hpu, cuda, xpu, neuron by name, else the CPU): the device accelerate runs on
    and the execution device of cpu_offload_with_hook come from torch.accelerator, with nothing
    set in the environment. Holds the behaviour of the installed release."""
    r = run(["-c", textwrap.dedent("""
        import torch
        from accelerate import PartialState
        from accelerate.big_modeling import cpu_offload_with_hook
        state = PartialState()
        model, hook = cpu_offload_with_hook(torch.nn.Linear(4, 5))
        print(state.device, state.default_device, model(torch.randn(3, 4)).device)
    """)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["openreg", "openreg", "openreg:0"]
# [docs:end GAP_ACCELERATE_DEFAULT_DEVICE]


# [docs:start GAP_ACCELERATE_CUDA_OR_XPU]
def test_accelerate_accelerator_tests_know_cuda_and_xpu(monkeypatch):
    """accelerate's require_cuda_or_xpu and require_multi_gpu_or_xpu skip a test on every
    device but CUDA and XPU, even where accelerate's tests take their device from a patched
    get_backend() (two openreg devices here)."""
    import accelerate.test_utils.testing as testing
    if torch.cuda.is_available() or torch.xpu.is_available():
        pytest.skip("a CUDA or XPU device is there: the decorators run the tests on it")
    monkeypatch.setattr(testing, "device_count", torch.openreg.device_count())
    assert testing.device_count == 2
    for decorator, reason in ((testing.require_cuda_or_xpu, "test requires a CUDA GPU or XPU"),
                              (testing.require_multi_gpu_or_xpu,
                               "test requires multiple GPUs or XPUs")):
        test = decorator(lambda self: None)
        assert getattr(test, "__unittest_skip_why__", None) == reason, (
            CLOSED + f"{decorator.__name__} runs the test on openreg")


def test_accelerate_offload_hook_tests_check_cuda_and_xpu():
    """Two tests of accelerate's tests/test_hooks.py check CUDA and XPU by name in their body
    before offloading to the test device (any device)."""
    source = _library_test_file("accelerate", "tests/test_hooks.py")
    check = ('if not torch.cuda.is_available() and not is_xpu_available():\n'
             '            self.skipTest("CUDA or XPU not available for offload test.")')
    assert source.count(check) == 2, CLOSED + "tests/test_hooks.py checks otherwise"
# [docs:end GAP_ACCELERATE_CUDA_OR_XPU]


# [docs:start GAP_ACCELERATE_CLEAR_DEVICE_CACHE]
def test_accelerate_clear_device_cache_asks_torch_accelerator():
    """Closed upstream in accelerate 1.16.0 (1.15.0: empty_cache() of xpu, mlu, sdaa, musa, npu,
    mps, cuda or neuron by name, else nothing): clear_device_cache() empties the caching allocator
    of the torch.accelerator device, openreg's included. Holds the installed release's
    behaviour."""
    from accelerate.utils.memory import clear_device_cache
    x = torch.empty(4 << 20, device="openreg")
    del x
    reserved = torch.openreg.memory_reserved()
    assert reserved >= 16 << 20
    clear_device_cache(garbage_collection=True)
    assert torch.openreg.memory_reserved() < reserved
# [docs:end GAP_ACCELERATE_CLEAR_DEVICE_CACHE]


# [docs:start GAP_TRAINER_DEVICE]
TRAINER_DEFAULT_DEVICE = """
import tempfile, torch
from accelerate import PartialState
from transformers import Trainer, TrainingArguments

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(1), labels)}

data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(4)]
with tempfile.TemporaryDirectory() as d:
    args = TrainingArguments(output_dir=d, use_cpu=False, max_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True)
    print(PartialState().device, args.device, flush=True)
    Trainer(model=Tiny(), args=args, train_dataset=data).train()
"""


def test_trainer_batches_stay_on_the_cpu_while_accelerate_places_the_model(tmp_path):
    """transformers' TrainingArguments picks its device by name (cuda, mps, xpu, npu, hpu, ...,
    else ACCELERATE_TORCH_DEVICE or the CPU), while accelerate 1.16 asks torch.accelerator: with
    nothing set, Trainer's accelerator puts the model on openreg and Trainer moves the batches
    to the CPU, so the first step fails on mixed devices."""
    r = run(["-c", TRAINER_DEFAULT_DEVICE], tmp_path)
    assert r.stdout.split()[:2] == ["openreg", "cpu"], CLOSED + r.stdout + r.stderr[-2000:]
    assert r.returncode != 0, CLOSED + "Trainer trains with nothing set"
    assert "Expected all tensors to be on the same device" in r.stderr, r.stderr[-3000:]
    told = run(["-c", TRAINER_DEFAULT_DEVICE], tmp_path, {"ACCELERATE_TORCH_DEVICE": "openreg"})
    assert told.returncode == 0, told.stderr[-3000:]
    assert told.stdout.split()[:2] == ["openreg", "openreg"]
# [docs:end GAP_TRAINER_DEVICE]


# [docs:start GAP_ACCELERATE_MULTI_PROCESS]
ACCELERATE_RANKS = """
import os
import torch.distributed as dist
from accelerate import PartialState
state = PartialState()
# one write() per line: both ranks share the pipe, and print() writes each piece separately when
# stdout is unbuffered (PYTHONUNBUFFERED=1), so two ranks' lines could interleave
os.write(1, f"{state.distributed_type} {state.num_processes} {dist.get_world_size()}\\n".encode())
"""


def test_accelerate_multi_process_knows_no_privateuse1_backend(tmp_path):
    """accelerate's multi-process state takes its backend from a table of device types (cuda:
    nccl, xpu: xccl, npu: hccl, ...) and its distributed type from an enum member per device
    (MULTI_GPU, MULTI_XPU, ...). A PrivateUse1 device has neither: launched as two processes
    (torchrun, as `accelerate launch` does), each says it is alone, DistributedType.NO and one
    process, while torch's process group it has just initialized has two ranks."""
    script = tmp_path / "ranks.py"
    script.write_text(ACCELERATE_RANKS)
    r = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(script)], tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [line.split() for line in r.stdout.splitlines() if line.startswith("DistributedType")]
    assert ranks == [["DistributedType.NO", "1", "2"]] * 2, CLOSED + r.stdout
# [docs:end GAP_ACCELERATE_MULTI_PROCESS]


# [docs:start GAP_DIFFUSERS_GET_DEVICE]
def test_diffusers_get_device_asks_torch_accelerator():
    """Closed upstream between diffusers 0.40.0.dev0 (commit 58eb52c0: cuda, npu, xpu, mps, mlu,
    neuron by name, else "cpu") and 0.42.1: get_device() asks torch.accelerator, so the
    pipelines' device_map strategies and enable_model_cpu_offload() take openreg. This test
    holds the fixed behaviour of the installed release."""
    from diffusers.pipelines.pipeline_utils import SUPPORTED_DEVICE_MAP
    from diffusers.utils.torch_utils import get_device
    assert get_device() == "openreg"
    assert "openreg" in SUPPORTED_DEVICE_MAP
# [docs:end GAP_DIFFUSERS_GET_DEVICE]


# [docs:start GAP_CONVOLUTION_LAYOUT]
def test_privateuse1_convolution_layout_is_predicted_nchw():
    """ATen's prediction of a convolution's memory format (the one FakeTensor, and so Inductor,
    uses) for a PrivateUse1 device: the backend is `Overrideable`, whose format is contiguous
    whatever the layouts of input and weight, where the CPU's (and CUDA's, XPU's, MPS's) follows a
    channels-last input or weight. The rule torch's FakeTensor runs, without openreg's own
    (torch_openreg/compile.py, FAKE_CONVOLUTION)."""
    from torch._subclasses import FakeTensorMode, fake_impls

    def predicted(device):
        x = torch.randn(2, 3, 6, 6, device=device).to(memory_format=torch.channels_last)
        w = torch.randn(4, 3, 3, 3, device=device).to(memory_format=torch.channels_last)
        args = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False,
                    output_padding=[0, 0], groups=1)
        mode = FakeTensorMode()
        with mode:
            fx, fw = mode.from_tensor(x), mode.from_tensor(w)
            backend = torch._C._select_conv_backend(fx, fw, bias=None, **args)
            fmt = torch._C._conv_determine_backend_memory_format(fx, fw, backend)
            # torch's own FakeTensor rule (under openreg's, which predicts the CPU's layout)
            rule = fake_impls.op_implementations_dict[torch.ops.aten.convolution.default].args[0]
            out = rule(mode, torch.ops.aten.convolution.default, fx, fw, None, *args.values())
        return str(backend), fmt, out.stride()

    assert predicted("cpu")[1:] == (torch.channels_last, (144, 1, 24, 4))
    backend, fmt, strides = predicted("openreg")
    assert backend.endswith("ConvBackend.Overrideable"), backend
    assert (fmt, strides) == (torch.contiguous_format, (144, 36, 6, 1)), \
        CLOSED + f"{backend} predicts {fmt}, strides {strides}"
# [docs:end GAP_CONVOLUTION_LAYOUT]


# [docs:start GAP_TENSOR_MAP]
@pytest.mark.parametrize("method", ["map_", "map2_"])
def test_tensor_map_is_cpu_only(method):
    """Tensor.map_ and map2_ (Python callables applied elementwise) run on CPU tensors only, for
    every other device alike; PyTorch's test_torch.py test_broadcast skips them for CUDA
    (`small.is_cuda`) only, so its fn=map and fn=map2 variants fail on any other device."""
    x = torch.ones(3, device="openreg")
    args = (x, x, lambda a, b, c: a + b + c) if method == "map2_" else (x, lambda a, b: a + b)
    try:
        getattr(torch.ones(3, device="openreg"), method)(*args)
    except TypeError as e:
        assert f"{method} is only implemented on CPU tensors" in str(e)
    else:
        pytest.fail(CLOSED + f"Tensor.{method} runs on openreg")
# [docs:end GAP_TENSOR_MAP]


# [docs:start GAP_LARGE_TENSOR_TEST]
def test_large_tensor_test_skips_privateuse1_devices():
    """torch.testing's `largeTensorTest` asks each device for its free memory and knows cuda,
    xpu, mtia, the CPU and mps: on any other device the test is skipped, however small its
    need (test_nn.py's test_ReplicationPad3d_large, test_grid_sample_large_index_2d/_3d)."""
    import unittest
    from torch.testing._internal.common_device_type import largeTensorTest

    class Probe:
        def __init__(self, device):
            self.device = device  # what a device-generic test class carries

        @largeTensorTest(1024)  # bytes
        def test(self):
            return "ran"

    assert Probe("cpu").test() == "ran"
    try:
        Probe("openreg").test()
    except unittest.SkipTest as e:
        assert "Unknown device type" in str(e)
    else:
        pytest.fail(CLOSED + "largeTensorTest runs on openreg")
# [docs:end GAP_LARGE_TENSOR_TEST]
