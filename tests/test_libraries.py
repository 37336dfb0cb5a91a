"""The libraries people train with run on openreg as on the CPU (docs/troubleshooting.md).

Hugging Face transformers and accelerate, in subprocesses (their device choice reads environment
variables and keeps process-wide state), with tiny models built from configs (no download,
HF_HUB_OFFLINE=1). The same run on the CPU is the reference: losses within float tolerance,
generated tokens equal.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

# Installed by the README's commands (Makefile): a missing library fails here, it is not skipped.
import accelerate  # noqa: E402,F401
import transformers  # noqa: E402,F401

# Tiny configs shared by the scripts below: 2 layers, width 32, vocabulary 64, no dropout (openreg's
# dropout draws from the device generator with its own scheme, docs/generator.md).
MODELS = """
import torch
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, T5Config, T5ForConditionalGeneration)
V = 64

def make(name):
    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2,
            n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
            eos_token_id=1))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1))
    if name == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64,
        num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))

def output_embedding_is_tied(model):
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight
"""


def run_json(code, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **(env_extra or {}))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_transformers_training_and_generate_match_cpu():
    """AdamW steps give the CPU's losses; greedy and seeded sampling give the CPU's tokens."""
    out = run_json(MODELS + """
import copy, json
result = {}
for name in ["gpt2", "llama", "bert", "t5"]:
    base = make(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (2, 12), generator=g)
    labels = torch.randint(2, V, (2, 6), generator=g) if name == "t5" else ids
    for device in ["cpu", "openreg"]:
        model = copy.deepcopy(base)
        count = len(list(model.parameters()))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before .to(), as scripts do
        model.to(device).train()
        r = result.setdefault(name, {}).setdefault(device, {})
        r["tied"] = output_embedding_is_tied(model)
        r["same_count"] = len(list(model.parameters())) == count
        r["losses"] = []
        for _ in range(3):
            loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            r["losses"].append(loss.item())
        if name == "bert":
            continue
        model.eval()
        prompt = ids[:, :5].to(device)
        r["greedy"] = model.generate(prompt, max_new_tokens=6, do_sample=False,
                                     pad_token_id=0).tolist()
        # Sampling draws from the generator of the device the logits are on. On openreg the CPU
        # generator gets another seed, so equal tokens prove the device generator was used.
        torch.manual_seed(5)
        if device == "openreg":
            torch.random.default_generator.manual_seed(123)
        r["sample"] = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0,
                                     pad_token_id=0).tolist()
        if device == "openreg":
            torch.openreg.manual_seed(6)
            r["sample_seed6"] = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0,
                                               pad_token_id=0).tolist()
print(json.dumps(result))
""")
    import torch
    for name, r in out.items():
        cpu, dev = r["cpu"], r["openreg"]
        assert cpu["tied"] and dev["tied"] and dev["same_count"], name
        torch.testing.assert_close(dev["losses"], cpu["losses"], rtol=1e-5, atol=1e-5,
                                   msg=name)
        assert cpu["losses"][-1] < cpu["losses"][0], name
        if name != "bert":
            assert dev["greedy"] == cpu["greedy"], name
            assert dev["sample"] == cpu["sample"], name
            assert dev["sample_seed6"] != dev["sample"], name
    assert any(r["cpu"]["sample"] != r["cpu"]["greedy"] for r in out.values() if "sample" in r["cpu"])


TRAINER = MODELS + """
import json, os, sys, tempfile
from transformers import Trainer, TrainerCallback, TrainingArguments
model = make("gpt2")
g = torch.Generator().manual_seed(1)
# Four sequences, four times each: every batch holds the same text, so the loss must fall.
data = [{"input_ids": x, "labels": x} for x in torch.randint(2, V, (4, 12), generator=g)] * 4
losses = []

class Record(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses.append(logs["loss"])

with tempfile.TemporaryDirectory() as d:
    # [docs:start TRAINER]
    # Run with ACCELERATE_TORCH_DEVICE=openreg: TrainingArguments has no device option, and
    # use_cpu=False alone picks cuda, mps, xpu, npu... by name, else the CPU (while accelerate
    # 1.16 places the model on openreg by itself: docs/privateuse1_gaps.md).
    args = TrainingArguments(output_dir=d, use_cpu=USE_CPU, max_steps=4,
                             per_device_train_batch_size=4, logging_steps=1, learning_rate=5e-3,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Record()]).train()
    # [docs:end TRAINER]
print(json.dumps({"device": args.device.type, "param": next(model.parameters()).device.type,
                  "tied": output_embedding_is_tied(model), "losses": losses}))
"""


def test_trainer_uses_openreg_when_told_by_accelerate_torch_device():
    # use_cpu=False alone: transformers knows accelerators by name (cuda, mps, xpu, npu, ...)
    # and falls back to the CPU; ACCELERATE_TORCH_DEVICE=openreg tells it. (Without it, accelerate
    # 1.16 puts the model on openreg and the batches stay on the CPU: a catalogued gap,
    # test_privateuse1_gaps.py.) The reference is the same run with use_cpu=True.
    default = run_json(TRAINER.replace("USE_CPU", "True"))
    told = run_json(TRAINER.replace("USE_CPU", "False"), {"ACCELERATE_TORCH_DEVICE": "openreg"})
    assert default["device"] == default["param"] == "cpu"
    assert told["device"] == told["param"] == "openreg"
    assert told["tied"] and default["tied"]
    assert len(told["losses"]) == 4
    import torch
    torch.testing.assert_close(told["losses"], default["losses"], rtol=1e-5, atol=1e-5)
    assert told["losses"][-1] < told["losses"][0]


ACCELERATE = """
import json, torch, torch.nn as nn
# [docs:start ACCELERATE]
# accelerate 1.16 and later take the device from torch.accelerator: openreg. (Before 1.16, run
# with ACCELERATE_TORCH_DEVICE=openreg in the environment, which also picks openreg:1.)
from accelerate import Accelerator
accelerator = Accelerator(mixed_precision=MIXED_PRECISION)  # "no" or "bf16"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 16, generator=g)
y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
# [docs:end ACCELERATE]
losses, dtypes = [], set()
# The layers' own outputs show the autocast dtype (prepare() casts the model's outputs to float32).
model[0].register_forward_hook(lambda module, args, out: dtypes.add(str(out.dtype)))
for epoch in range(2):
    for xb, yb in loader:
        with accelerator.autocast():
            loss = nn.functional.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
print(json.dumps({"device": accelerator.device.type, "param": next(model.parameters()).device.type,
                  "batch": xb.device.type, "dtypes": sorted(dtypes), "losses": losses}))
"""


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_uses_openreg_by_itself(mixed_precision):
    code = ACCELERATE.replace("MIXED_PRECISION", repr(mixed_precision))
    cpu = run_json(code, {"ACCELERATE_USE_CPU": "true"})  # Accelerator(cpu=True)
    dev = run_json(code)  # nothing set: accelerate asks torch.accelerator
    assert cpu["device"] == cpu["param"] == cpu["batch"] == "cpu"
    assert dev["device"] == dev["param"] == dev["batch"] == "openreg"
    expected = ["torch.bfloat16"] if mixed_precision == "bf16" else ["torch.float32"]
    assert dev["dtypes"] == cpu["dtypes"] == expected
    import torch
    torch.testing.assert_close(dev["losses"], cpu["losses"], rtol=1e-5, atol=1e-5)
    assert dev["losses"][-1] < dev["losses"][0]
