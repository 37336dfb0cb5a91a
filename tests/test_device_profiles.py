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


# ---------------------------------------------------------------- libraries under the mps profile
# Tiny models built from configs (no download), a few optimizer steps each, in one subprocess under
# OPENREG_DEVICE_PROFILE=mps; then the call sites where installed libraries create float64 device
# tensors on any device not named "mps" (the catalogue in docs/device_profiles.md).
LIBRARY_RUNS = r'''
import json, traceback, torch
import torch.nn.functional as F
report = {}
def run(name, fn):
    try:
        report[name] = {"raised": None, "value": fn()}
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" in f.filename]
        site = None
        if frames:
            site = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}"
        report[name] = {"raised": type(e).__name__, "message": str(e).splitlines()[0], "site": site}

def train(model, batches, steps=2):
    model = model.to("openreg").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(**batches)
        loss = loss if torch.is_tensor(loss) else loss.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses

try:
    import transformers
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
    report["transformers"] = transformers.__version__
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to("openreg")
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask.to("openreg")}
    torch.manual_seed(0)
    run("gpt2", lambda: train(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32,
        n_layer=2, n_head=2)), batch))
    torch.manual_seed(0)
    run("bert", lambda: train(BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32)), batch))
    from transformers.models.rt_detr.modeling_rt_detr import RTDetrSinePositionEmbedding
    run("rt_detr_position_embedding",
        lambda: str(RTDetrSinePositionEmbedding(16)(4, 4, torch.device("openreg"),
                                                    torch.float32).dtype))
except ImportError:
    pass

try:
    import torchvision
    from torchvision.models import resnet18
    report["torchvision"] = torchvision.__version__
    def construct_on_device():  # weights=None: initialised by torch.nn.init on the device
        with torch.device("openreg"):
            return str(next(resnet18(weights=None, num_classes=10).parameters()).device)
    run("resnet18_construct", construct_on_device)
    class Classify(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = resnet18(weights=None, num_classes=10)
        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)
    x, y = torch.randn(2, 3, 32, 32).to("openreg"), torch.tensor([1, 3]).to("openreg")
    run("resnet18", lambda: train(Classify(), {"x": x, "y": y}))
except ImportError:
    pass

try:
    import diffusers
    from diffusers import UNet2DConditionModel
    report["diffusers"] = diffusers.__version__
    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8).to("openreg")
    sample, context = torch.randn(1, 4, 8, 8).to("openreg"), torch.randn(1, 3, 32).to("openreg")
    run("unet_int_timestep", lambda: list(unet(sample, 10, context).sample.shape))
    run("unet_float_timestep", lambda: list(unet(sample, 10.5, context).sample.shape))
except ImportError:
    pass
print("REPORT" + json.dumps(report))
'''


@pytest.fixture(scope="module")
def libraries_mps():
    env = dict(os.environ, OPENREG_DEVICE_PROFILE="mps", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, "-c", LIBRARY_RUNS], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


def library_run(report, library, name):
    if library not in report:
        pytest.skip(f"{library} is not installed")
    return report[name]


@pytest.mark.parametrize("library,name", [("transformers", "gpt2"), ("transformers", "bert"),
                                          ("torchvision", "resnet18_construct"),
                                          ("torchvision", "resnet18"),
                                          ("diffusers", "unet_int_timestep")])
def test_models_train_under_the_mps_profile(libraries_mps, library, name):
    """GPT-2 and BERT (AdamW, gradient clipping, an attention mask), resnet18 (built on the device,
    trained) need no float64 on the device: openreg under the profile refuses nothing here."""
    outcome = library_run(libraries_mps, library, name)
    assert outcome["raised"] is None, outcome
    if name in ("gpt2", "bert", "resnet18"):
        assert outcome["value"][-1] < outcome["value"][0], outcome


# The library call sites that create float64 device tensors unless the device is named "mps"
# (docs/device_profiles.md, "What the profile found"). Each test fails when the library stops
# doing it, and the catalogue's entry can go.
LIBRARY_ASSUMPTIONS = {
    "rt_detr_position_embedding": ("transformers",
                                   "transformers/models/rt_detr/modeling_rt_detr.py"),
    "unet_float_timestep": ("diffusers", "diffusers/models/unets/unet_2d_condition.py"),
}


@pytest.mark.parametrize("name", sorted(LIBRARY_ASSUMPTIONS))
def test_library_float64_assumption_is_still_there(libraries_mps, name):
    library, path = LIBRARY_ASSUMPTIONS[name]
    outcome = library_run(libraries_mps, library, name)
    assert outcome["raised"] == "TypeError", outcome
    assert "float64" in outcome["message"] and "'mps'" in outcome["message"], outcome
    assert outcome["site"].startswith(path), outcome


def test_library_float64_assumptions_key_on_the_device_name():
    """Without a profile the same calls work on openreg, and the libraries choose float32 for a
    device named mps: what makes them pass on MPS and fail on another device without float64."""
    pytest.importorskip("transformers")
    from transformers.models.rt_detr import modeling_rt_detr
    emb = modeling_rt_detr.build_2d_sinusoidal_position_embedding
    if not torch.openreg.get_device_profile():
        assert emb(2, 2, 8, device=torch.device("openreg")).device.type == "openreg"
    diffusers_utils = pytest.importorskip("diffusers.utils.torch_utils")
    adjust = diffusers_utils.maybe_adjust_dtype_for_device
    assert adjust(torch.float64, torch.device("openreg")) is torch.float64
    assert adjust(torch.float64, torch.device("mps")) is torch.float32
