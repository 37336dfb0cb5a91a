"""Run libraries' own test suites on the CPU and on openreg, and compare them test by test
(docs/test_suites.md, "Libraries' own test suites, measured").

    python tools/library_suites.py install timm --site /work/libs/site-timm
    python tools/library_suites.py run timm /path/to/pytorch-image-models --site /work/libs/site-timm
    python tools/library_suites.py compare timm     # again, from the junit files of the last run

Arguments after `--` go to pytest (`-- -x`, `-- -k resnet`).

`run` takes a clone of the library (or `git archive` of it) at the commit named in LIBRARIES
below, runs the selection there twice, once per device, each group of it in its own pytest
process writing a junit file (build/library_suites/<lib>-<device>-<n>.xml), and prints: how many
passed and failed on each device, the tests that pass on the CPU and fail on openreg grouped by
their error, and the reverse. `--site` is a folder made by `install` (pip --target, no
dependencies) with the library at the release its tests belong to; it goes first on PYTHONPATH.
`--group N` runs one group of the selection again. The libraries' test files are never part of
this repository.

Network: none is needed. Tests that download a model or a data set from the hub fail on both
devices alike (HF_HUB_OFFLINE=1 makes them fail at once): the comparison shows them as failing on
both, not as openreg's.

The switch that points each suite at openreg lives here too (`env` and `plugin`): an environment
line, a device spec, or a pytest plugin loaded with -p (written to build/library_suites/plugins/)
that patches a library's device list, where the library has no switch (docs/privateuse1_gaps.md).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "library_suites"
DEVICES = ("cpu", "openreg")

# timm: small architectures, a forward (test_model_forward, batch 1, the model's input size up to
# 384) and a backward (test_model_backward, batch 2, input size up to 128) each. The `test_*`
# models are timm's own tiny versions of its families, made for tests; the others are the
# smallest real configurations of common CNN and ViT families (each well under 10 M parameters
# but for resnet18, swin_tiny and densenet121, kept for their layers: plain convolutions, shifted
# windows, dense concatenation).
TIMM_CNNS = [
    "test_byobnet", "test_convnext", "test_efficientnet", "test_efficientnet_gn",
    "test_nfnet", "test_resnet", "test_mambaout",
    "resnet10t", "resnet18", "mobilenetv3_small_050", "mobilenetv4_conv_small_035",
    "efficientnet_b0", "lcnet_050", "ghostnet_050", "regnetx_002", "mnasnet_small", "tinynet_e",
    "rexnet_100", "hgnetv2_b0", "convnext_atto", "edgenext_xx_small", "mobilevit_xxs",
    "efficientvit_b0", "fastvit_t8", "repvit_m0_9", "mobileone_s0", "starnet_s050",
    "inception_next_atto", "ese_vovnet19b_slim", "densenet121",
]
TIMM_VITS = [
    "test_vit", "test_vit2", "test_vit3", "test_vit4",
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "levit_128s", "pit_ti_224",
    "xcit_nano_12_p16_224", "mixer_s32_224", "tiny_vit_5m_224", "efficientformerv2_s0",
    "efficientvit_m0", "pvt_v2_b0", "swin_tiny_patch4_window7_224", "eva02_tiny_patch14_224",
    "coatnet_nano_rw_224", "convit_tiny",
]


def timm_selection():
    ids = []
    for name in TIMM_CNNS + TIMM_VITS:
        ids.append(f"tests/test_models.py::test_model_forward[1-{name}]")
        ids.append(f"tests/test_models.py::test_model_backward[2-{name}]")
    return [ids]


# peft: the LoRA tests (LoraConfig itself) of the custom-model tests, over ten of peft's small
# models (MLP, MLP with DoRA, embedding + transformers' Conv1D, Conv1d, Conv2d with and without
# DoRA, grouped Conv2d, Conv3d, MultiheadAttention, a module using nn.Parameter): forward in
# float32 and float16, merging, safe merging, training, adapters switched off, saving and
# loading, deleting; several active adapters at once; the LoRA cases of mixed adapter batches.
# 8 methods x 10 cases: the whole LoRA set (about 45 cases x 40 methods) takes hours on 2 shared
# cores. The decoder-model tests: below.
PEFT_CASES = [
    "Vanilla MLP 1 LoRA-MLP-LoraConfig-config_kwargs6",
    "Vanilla MLP 7 LoRA with DoRA-MLP-LoraConfig-config_kwargs12",
    "Embedding + transformers Conv1D 1 LoRA-EmbConv1D-LoraConfig-config_kwargs20",
    "Conv1d LoRA-Conv1d-LoraConfig-config_kwargs27",
    "Conv2d 1 LoRA-Conv2d-LoraConfig-config_kwargs29",
    "Conv2d 1 LoRA with DoRA-Conv2d-LoraConfig-config_kwargs31",
    "Conv2d Groups LoRA-Conv2dGroups-LoraConfig-config_kwargs33",
    "Conv3d 1 LoRA-Conv3d-LoraConfig-config_kwargs37",
    "MHA 1 LoRA-MHA-LoraConfig-config_kwargs44",
    "MLP 1 using nn.Parameter LoRA-MlpUsingParameters-LoraConfig-config_kwargs46",
]
PEFT_METHODS = ["test_forward_output_finite", "test_forward_float16", "test_merge_layers",
                "test_safe_merge", "test_training_custom_models", "test_disable_adapters",
                "test_save_pretrained", "test_delete_adapter"]
PEFT_DECODER_METHODS = [
    "test_save_pretrained", "test_merge_layers", "test_merge_layers_multi",
    "test_mixed_adapter_batches", "test_generate", "test_merge_layers_fp16",
    "test_generate_half_prec", "test_training_decoders", "test_delete_adapter",
    "test_unload_adapter", "test_disable_adapter"]
PEFT_SELECTION = [
    [f"tests/test_custom_models.py::TestPeftCustomModel::{m}[{c}]"
     for m in PEFT_METHODS for c in PEFT_CASES]
    + ["tests/test_custom_models.py::TestMultipleActiveAdapters::"
       "test_multiple_active_adapters_forward",
       "tests/test_custom_models.py::TestMixedAdapterBatches",
       "-k", "TestPeftCustomModel or (test_multiple_active_adapters_forward and LoraConfig) or "
             "(TestMixedAdapterBatches and LoRA)"],
    # LoRA tests of the decoder-model tests: 11 of its test methods (saving, merging, mixed
    # adapter batches, generation, float16, training, deleting, unloading, switching off) with
    # ALL_CONFIGS' first LoraConfig (config_kwargs16: plain LoRA on the default target modules)
    # over two of its models, tiny GPT-2 and tiny OPT, made here (PEFT_MODELS). The other test
    # methods, LoRA variants and models are left out for time on 2 shared cores.
    [f"tests/test_decoder_models.py::TestDecoderModels::{m}[LoraConfig-config_kwargs16-{model}]"
     for m in PEFT_DECODER_METHODS for model in ("peft-internal-testing/tiny-random-GPT2LMHeadModel",
                                                "peft-internal-testing/tiny-random-OPTForCausalLM")]
    # peft 0.21 calls transformers' is_gradient_checkpointing, deprecated in the installed
    # transformers 5.24 with a FutureWarning, which peft's pytest settings make an error.
    + ["-W", "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"],
]


# The decoder-model tests load their tiny models from the hub, which cannot be reached here (and
# is not needed): the models are made from configs of the hub models' shapes (as far as known
# here: the hub's files were not at hand to compare), with fixed random weights, and saved into
# a local hub cache (build/library_suites/hub) that both devices' runs read with HF_HUB_OFFLINE=1.
# model id -> (transformers config class, its arguments, model class)
PEFT_MODELS = {
    "peft-internal-testing/tiny-random-GPT2LMHeadModel": (
        "GPT2Config", dict(vocab_size=1000, n_positions=512, n_embd=32, n_layer=5, n_head=4,
                           n_inner=37, bos_token_id=98, eos_token_id=98, pad_token_id=98),
        "GPT2LMHeadModel"),
    "peft-internal-testing/tiny-random-OPTForCausalLM": (
        "OPTConfig", dict(vocab_size=50265, hidden_size=16, num_hidden_layers=5, ffn_dim=4,
                          num_attention_heads=4, max_position_embeddings=100,
                          word_embed_proj_dim=16),
        "OPTForCausalLM"),
}


def hub_cache():
    return OUT / "hub"


def make_models(models):
    """Save each model into the local hub cache, laid out as huggingface_hub lays out a
    download (models--ORG--NAME/refs/main naming a snapshot folder); kept once made, so that
    both devices read the same weights."""
    import torch
    import transformers
    for model_id, (config_cls, kwargs, model_cls) in models.items():
        repo = hub_cache() / ("models--" + model_id.replace("/", "--"))
        revision = "0" * 40
        folder = repo / "snapshots" / revision
        if (folder / "config.json").exists():
            continue
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**kwargs)
        getattr(transformers, model_cls)(config).save_pretrained(folder)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        print(f"made {model_id} in {folder}", flush=True)

# peft's tests take their device from peft.utils.infer_device() and accelerate's get_backend(),
# both lists of devices by name (docs/privateuse1_gaps.md): this plugin, loaded before the test
# modules are imported, points both at openreg.
PEFT_PLUGIN = """
    import torch
    import accelerate.test_utils.testing as accelerate_testing
    import peft.utils
    import peft.utils.other


    def _backend():
        return "openreg", torch.openreg.device_count(), torch.openreg.memory_allocated


    accelerate_testing.get_backend = _backend
    (accelerate_testing.torch_device, accelerate_testing.device_count,
     accelerate_testing.memory_allocated_func) = _backend()
    peft.utils.infer_device = peft.utils.other.infer_device = lambda: "openreg"
"""

# peft's tests load each hub model once online (testing_utils.hub_online_once), even with
# HF_HUB_OFFLINE=1, and only later accesses offline: this plugin marks the models made here
# (PEFT_MODELS) as loaded already, so that every access reads the local hub cache.
PEFT_HUB_PLUGIN = """
    import sys

    MODELS = {models!r}


    def pytest_collection_finish(session):
        for module in list(sys.modules.values()):
            accesses = getattr(module, "_HUB_MODEL_ACCESSES", None)
            if isinstance(accesses, dict):
                for model_id in MODELS:
                    accesses.setdefault(model_id, 1)
""".format(models=sorted(PEFT_MODELS))


# diffusers: the model tests (the common model tests, training, and for DiT attention) of a UNet
# (UNet2DModel), a VAE (AutoencoderKL) and a transformer (DiT's Transformer2DModel); the tests of
# every scheduler (the whole tests/schedulers/ folder, 33 files: about 5 minutes on the CPU on 2
# shared cores) and two small pipelines (DDPM and DDIM: a UNet and a scheduler made in the test,
# nothing downloaded in their fast tests). Left out for time on 2 shared cores: the model files'
# other UNets (LDM, NCSN++) and their memory and offloading classes.
DIFFUSERS_SELECTION = [
    ["tests/models/unets/test_models_unet_2d.py::TestUnet2DModel",
     "tests/models/unets/test_models_unet_2d.py::TestUnet2DModelTraining",
     "tests/models/autoencoders/test_models_autoencoder_kl.py::TestAutoencoderKL",
     "tests/models/transformers/test_models_dit_transformer2d.py::TestDiTTransformer2D",
     "tests/models/transformers/test_models_dit_transformer2d.py::TestDiTTransformer2DAttention",
     "tests/models/transformers/test_models_dit_transformer2d.py::TestDiTTransformer2DTraining"],
    ["tests/schedulers/", "tests/pipelines/ddpm/test_ddpm.py", "tests/pipelines/ddim/test_ddim.py"],
]


def diffusers_setup(device, folder):
    """The CPU: DIFFUSERS_TEST_DEVICE=cpu. openreg: the device spec, written into the clone (the
    suite imports it by bare file name from the folder it runs in; docs/test_suites.md)."""
    if device == "cpu":
        return {"DIFFUSERS_TEST_DEVICE": "cpu"}
    from torch_openreg import testing
    testing.write_spec("diffusers", folder)
    return {"DIFFUSERS_TEST_DEVICE_SPEC": testing.SPEC_FILE}


# Lifting a library's skips by their reason: the skips of tests that need an accelerator but
# name the devices that may run them ("cuda", "xpu"), so that the tests run on openreg too. A
# pytest skipif mark goes; a method under unittest's skip decorators (skipIf, skipUnless: they
# put a wrapper that raises SkipTest in the method's place, marked __unittest_skip__) is put back
# on its class unwrapped, down to a skip for another reason; a skip the test asks for itself
# (self.skipTest(reason), after a device check in its body) is ignored. Shared by the plugins
# below; the CPU runs load none of them.
LIFT_SKIPS = """
    # [docs:start PLUGIN_LIFT_SKIPS]
    import unittest


    def lift_skips(items, reasons):
        for item in items:
            item.own_markers[:] = [
                m for m in item.own_markers
                if not (m.name == "skipif" and m.kwargs.get("reason") in reasons)]
            cls, name = getattr(item, "cls", None), getattr(item, "originalname", item.name)
            function = lifted = getattr(cls, name, None)
            while (getattr(lifted, "__unittest_skip_why__", None) in reasons
                   and hasattr(lifted, "__wrapped__")):
                lifted = lifted.__wrapped__
            if lifted is not function:
                setattr(cls, name, lifted)
                item._obj = None  # pytest takes the method again


    def lift_runtime_skips(reasons):
        skip_test = unittest.TestCase.skipTest

        def skipTest(self, reason):
            if reason not in reasons:
                skip_test(self, reason)

        unittest.TestCase.skipTest = skipTest
    # [docs:end PLUGIN_LIFT_SKIPS]
"""


# diffusers skips some accelerator-only tests (float16 and bfloat16 inference) unless the device
# is "cuda" or "xpu" by name (docs/privateuse1_gaps.md). On openreg this plugin lifts exactly
# those skips, by their reason, so that they run; the CPU run skips them as diffusers means to.
DIFFUSERS_PLUGIN = LIFT_SKIPS + """
    # [docs:start PLUGIN_DIFFUSERS]
    DEVICE_LIST_SKIPS = (
        "float16 requires CUDA or XPU",
        "float16 and bfloat16 can only be use for inference with an accelerator",
    )


    def pytest_collection_modifyitems(config, items):
        lift_skips(items, DEVICE_LIST_SKIPS)
    # [docs:end PLUGIN_DIFFUSERS]
"""


# accelerate: the test files whose tests need an accelerator (device maps, offloading, hooks,
# memory utilities), run whole: their CPU tests run on both runs. (tests/test_accelerator.py
# too would be next; left out for time on 2 shared cores.)
ACCELERATE_SELECTION = [
    ["tests/test_big_modeling.py", "tests/test_hooks.py", "tests/test_modeling_utils.py",
     "tests/test_memory_utils.py"],
]

# accelerate's tests take their device from accelerate.test_utils.testing.get_backend(), a list
# of devices by name (docs/privateuse1_gaps.md): on openreg it says "cpu", and every
# require_non_cpu test is skipped. This plugin points it at openreg before the test modules
# import it (ACCELERATE_TORCH_DEVICE=openreg points accelerate's own runtime there).
#
# It also lifts, by their reason, the skips of the tests that need an accelerator but name CUDA
# and XPU (accelerate's require_cuda_or_xpu and require_multi_gpu_or_xpu, and two tests of
# test_hooks.py that check torch.cuda and XPU in their body; docs/privateuse1_gaps.md).
ACCELERATE_PLUGIN = LIFT_SKIPS + """
    # [docs:start PLUGIN_ACCELERATE]
    import torch
    import accelerate.test_utils as accelerate_test_utils
    import accelerate.test_utils.testing as accelerate_testing


    def _backend():
        return "openreg", torch.openreg.device_count(), torch.openreg.memory_allocated


    accelerate_testing.get_backend = _backend
    for module in (accelerate_testing, accelerate_test_utils):
        module.torch_device, module.device_count, module.memory_allocated_func = _backend()

    DEVICE_LIST_SKIPS = (
        "test requires a CUDA GPU or XPU",
        "test requires multiple GPUs or XPUs",
        "CUDA or XPU not available for offload test.",
    )
    lift_runtime_skips(DEVICE_LIST_SKIPS)


    def pytest_collection_modifyitems(config, items):
        lift_skips(items, DEVICE_LIST_SKIPS)
    # [docs:end PLUGIN_ACCELERATE]
"""


# Each library: where its tests come from (repository and commit of the snapshot measured), the
# release installed for them, the selection with its reasons, and the switch per device.
LIBRARIES = {
    "timm": {
        "repository": "huggingface/pytorch-image-models",
        "commit": "aa4b5850c1543fa488abf260f18390eda46cf85d",  # 2026-08-08, timm 1.0.29.dev0
        # 1.0.29 is the first release after the commit (the snapshot says 1.0.29.dev0).
        "install": ["timm==1.0.29"],
        "selection": timm_selection,
        "why": "tests/test_models.py forward and backward over 48 small architectures "
               "(30 CNNs, 18 ViTs and hybrids)",
        # timm's test file reads TORCH_DEVICE (and imports TORCH_BACKEND): no patch needed.
        "env": {"cpu": {"TORCH_DEVICE": "cpu"},
                "openreg": {"TORCH_DEVICE": "openreg", "TORCH_BACKEND": "torch_openreg"}},
        # The clone has timm's source at its top level: -P and importlib import mode keep the
        # folder off sys.path, so that the installed release is what the tests import.
        "python_flags": ["-P"],
        "pytest_flags": ["--import-mode=importlib"],
    },
    "peft": {
        "repository": "huggingface/peft",
        "commit": "5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40",  # 2026-08-21, peft 0.20.1.dev0
        # 0.21.0, the release after the commit, is the closest to it (55 files of the package
        # differ against 81 for 0.20.0). The tests import datasets (and so pyarrow and pandas).
        "install": ["peft==0.21.0"],
        "extra": ["datasets", "pyarrow", "pandas", "dill", "xxhash", "multiprocess",
                  "python-dateutil", "tzdata", "pytz"],
        "selection": PEFT_SELECTION,
        "why": "LoRA tests of the custom models (TestPeftCustomModel, 8 methods x 10 models; "
               "several and mixed adapters) and of the decoder models tiny GPT-2 and tiny OPT "
               "(made locally)",
        "env": {},
        "models": PEFT_MODELS,
        "plugins": {"cpu": {"peft_local_models": PEFT_HUB_PLUGIN},
                    "openreg": {"openreg_peft_switch": PEFT_PLUGIN,
                                "peft_local_models": PEFT_HUB_PLUGIN}},
    },
    "diffusers": {
        "repository": "huggingface/diffusers",
        "commit": "58eb52c0803ea9af3abec60841c2a093bdf1f951",  # 2026-08-23, diffusers 0.40.0.dev0
        # The suite's tests/conftest.py puts the clone's src/ first on sys.path: the tests run
        # the clone's diffusers whatever is installed (0.40.0, the release after the commit,
        # differs from it in 16 files).
        "install": ["diffusers==0.40.0"],
        # imported by src/ and tests/; scipy by the schedulers' beta_sigmas and by
        # test_compatibles (schedulers that import it); torchsde (and its trampoline) by the
        # SDE schedulers' tests, skipped without it
        "extra": ["httpx", "httpcore", "h11", "parameterized", "requests_mock", "scipy",
                  "torchsde", "trampoline"],
        "selection": DIFFUSERS_SELECTION,
        "why": "model tests of UNet2DModel, AutoencoderKL and DiT's Transformer2DModel; the tests "
               "of every scheduler (tests/schedulers/); the DDPM and DDIM pipelines",
        "env": {},
        "setup": diffusers_setup,
        "plugins": {"openreg": {"openreg_diffusers_switch": DIFFUSERS_PLUGIN}},
    },
    "accelerate": {
        "repository": "huggingface/accelerate",
        "commit": "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83",  # 2026-07-24, accelerate 1.15.0.dev0
        "install": ["accelerate==1.15.0"],
        "extra": ["parameterized"],  # imported by tests/
        "selection": ACCELERATE_SELECTION,
        "why": "the test files of big modeling, hooks, modeling utils and memory utils, whole",
        # The tied-weights memory tests (two of those lifted) fill the device's free memory but
        # for what the model needs: a device of 1 GB (8 by default) keeps that within the
        # machine's RAM.
        "env": {"openreg": {"ACCELERATE_TORCH_DEVICE": "openreg", "OPENREG_DEVICE_MEMORY": "1GB"}},
        "plugins": {"openreg": {"openreg_accelerate_switch": ACCELERATE_PLUGIN}},
    },
}


def plugin_dir():
    return OUT / "plugins"


def write_plugins(lib, device):
    """The pytest plugins a library's run on a device loads (-p NAME), written where PYTHONPATH
    finds them."""
    folder = plugin_dir()
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for name, text in LIBRARIES[lib].get("plugins", {}).get(device, {}).items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
        names.append(name)
    return names


def install(lib, site):
    spec = LIBRARIES[lib]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
           *spec["install"], *spec.get("extra", [])]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def clone_commit(folder):
    r = subprocess.run(["git", "-C", str(folder), "log", "-1", "--format=%H %cd"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def selection(lib):
    """The library's selection: a list of groups, each the pytest arguments of one run."""
    groups = LIBRARIES[lib]["selection"]
    return groups() if callable(groups) else groups


def run(lib, folder, site, devices, extra_args, groups=None):
    spec = LIBRARIES[lib]
    folder = Path(folder).resolve()
    found = clone_commit(folder)
    if found and not found.startswith(spec["commit"]):
        print(f"note: {folder} is at {found}, the measured commit is {spec['commit']}")
    OUT.mkdir(parents=True, exist_ok=True)
    if "models" in spec:
        make_models(spec["models"])
    for device in devices:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        if "models" in spec:
            env["HF_HUB_CACHE"] = str(hub_cache())
        env.update(spec["env"].get(device, {}))
        if "setup" in spec:
            env.update(spec["setup"](device, folder))
        paths = [str(site)] if site else []
        paths.append(str(plugin_dir()))
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        for n, group in enumerate(selection(lib)):
            if groups is not None and n not in groups:
                continue
            (OUT / f"{lib}-{device}-{n}.xml").unlink(missing_ok=True)
            xml = OUT / f"{lib}-{device}-{n}.xml"
            cmd = ["nice", "-n", "19", sys.executable, *spec.get("python_flags", []), "-m",
                   "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-o", "addopts=",
                   "--junitxml", str(xml), *spec.get("pytest_flags", [])]
            for p in write_plugins(lib, device):
                cmd += ["-p", p]
            cmd += [*group, *extra_args]
            shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in group[:6])
            print(f"== {lib} on {device}, group {n}: {shown}{' ...' if len(group) > 6 else ''}",
                  flush=True)
            start = time.time()
            with open(OUT / f"{lib}-{device}-{n}.log", "w") as log:
                subprocess.call(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
            print(f"   {time.time() - start:.0f} s, log {OUT / f'{lib}-{device}-{n}.log'}",
                  flush=True)
    return compare(lib)


def results(lib, device):
    """test id -> (outcome, message) from the junit files of a library's run on a device."""
    out = {}
    cases = [c for xml in sorted(OUT.glob(f"{lib}-{device}-*.xml"))
             for c in ET.parse(xml).getroot().iter("testcase")]
    for case in cases:
        tid = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = child.get("message") or (child.text or "").strip().splitlines()[-1:]
                message = message if isinstance(message, str) else " ".join(message)
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        out[tid] = (outcome, message)
    return out


def error_kind(message):
    """A failure's message with numbers, addresses and paths blurred, to group alike failures."""
    first = message.strip().splitlines()[0] if message.strip() else "(no message)"
    first = re.sub(r"0x[0-9a-f]+", "0x?", first)
    first = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", first)
    return first[:200]


def compare(lib):
    runs = {d: results(lib, d) for d in DEVICES}
    if not all(runs.values()):
        print(f"{lib}: missing a junit file in {OUT}")
        return 1
    for device, res in runs.items():
        count = collections.Counter(o for o, _ in res.values())
        print(f"{lib} {device}: {count['passed']} passed, {count['failed']} failed, "
              f"{count['skipped']} skipped ({len(res)} in all)")
    cpu, dev = runs["cpu"], runs["openreg"]
    both = sorted(set(cpu) & set(dev))
    only_cpu = [t for t in both if cpu[t][0] == "passed" and dev[t][0] == "failed"]
    only_dev = [t for t in both if dev[t][0] == "passed" and cpu[t][0] == "failed"]
    skip_dev = [t for t in both if cpu[t][0] == "passed" and dev[t][0] == "skipped"]
    # Tests the CPU skips that run on openreg (an accelerator-only test, or a device list lifted
    # by the library's plugin): by their outcome on openreg.
    run_dev = [t for t in both if cpu[t][0] == "skipped" and dev[t][0] != "skipped"]
    failed_both = [t for t in both if cpu[t][0] == dev[t][0] == "failed"]
    print(f"{lib}: passed on both {sum(cpu[t][0] == dev[t][0] == 'passed' for t in both)}, "
          f"failed on both {len(failed_both)}, only on openreg failed {len(only_cpu)}, "
          f"only on the CPU failed {len(only_dev)}, passed on the CPU and skipped on openreg "
          f"{len(skip_dev)}, skipped on the CPU and run on openreg {len(run_dev)} "
          f"({sum(dev[t][0] == 'passed' for t in run_dev)} passed)")
    for title, tests, res in (("passed on the CPU, failed on openreg", only_cpu, dev),
                              ("failed on the CPU, passed on openreg", only_dev, cpu),
                              ("passed on the CPU, skipped on openreg", skip_dev, dev),
                              ("skipped on the CPU, run on openreg (by openreg's error)",
                               [t for t in run_dev if dev[t][0] == "failed"], dev),
                              ("failed on both (by the CPU's error)", failed_both, cpu)):
        if not tests:
            continue
        print(f"-- {title}:")
        groups = collections.defaultdict(list)
        for t in tests:
            groups[error_kind(res[t][1])].append(t)
        for kind, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"   [{len(members)}] {kind}")
            for t in members[:8]:
                print(f"       {t}")
            if len(members) > 8:
                print(f"       ... and {len(members) - 8} more")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="pip install --target the release the tests belong to")
    p.add_argument("lib", choices=LIBRARIES)
    p.add_argument("--site", required=True)
    p = sub.add_parser("run", help="run the selection on both devices and compare")
    p.add_argument("lib", choices=LIBRARIES)
    p.add_argument("folder", help="a clone of the library at the commit in LIBRARIES")
    p.add_argument("--site", help="the folder `install` filled (first on PYTHONPATH)")
    p.add_argument("--device", choices=DEVICES, action="append",
                   help="only this device (repeatable; default both)")
    p.add_argument("--group", type=int, action="append",
                   help="only this group of the selection (repeatable; default all)")
    p = sub.add_parser("compare", help="print the comparison of the last run's junit files")
    p.add_argument("lib", choices=LIBRARIES)
    p = sub.add_parser("list", help="print the libraries, commits and selections")
    # What follows `--` (or any argument not known here) goes to pytest.
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if pytest_args and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(pytest_args)}")
    if args.command == "install":
        return install(args.lib, args.site)
    if args.command == "run":
        return run(args.lib, args.folder, args.site and Path(args.site).resolve(),
                   args.device or DEVICES, pytest_args, args.group)
    if args.command == "compare":
        return compare(args.lib)
    for lib, spec in LIBRARIES.items():
        print(f"{lib}: {spec['repository']}@{spec['commit']} ({', '.join(spec['install'])}); "
              f"{spec['why']}")
        for group in selection(lib):
            print("   pytest " + " ".join(group if len(group) < 8 else group[:8] + ["..."]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
