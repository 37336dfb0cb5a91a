"""Module conversion keeps Parameter objects and ties, as on CUDA (docs/module_conversion.md).

`nn.Module._apply` (behind `.to()`, `.openreg()`, `.cpu()`, `.half()`) moves converted data into
the existing parameters when `torch._has_compatible_shallow_copy_type` allows it; openreg answers
that question for its own tensors (torch_openreg/module_conversion.py). The CPU is the reference:
the same model trained on the CPU gives the same losses, and CPU-only conversions are unchanged.
"""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def tied_pair():
    """The repro of issue 12: two layers sharing one weight."""
    n = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    n[1].weight = n[0].weight
    return n


class TinyLM(nn.Module):
    """GPT-2's layout in miniature: the output layer shares its weight with the token embedding."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(8, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                   nn.Linear(4 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        h = h + self.block(h)
        return self.lm_head(self.ln_f(h))


def run(code, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120)


def test_issue_repro_tie_survives_to_device():
    n = tied_pair()
    w = n[0].weight
    n.to("openreg")
    assert n[0].weight is n[1].weight
    assert n[0].weight is w and w.device.type == "openreg"
    assert len(list(n.parameters())) == 1


@pytest.mark.parametrize("convert", [
    lambda m: m.to("openreg"),
    lambda m: m.openreg(),
    lambda m: m.openreg(1),
    lambda m: m.to("openreg:1", torch.float64),
    lambda m: m.to("openreg").to("cpu"),
    lambda m: m.to("openreg").cpu(),
    lambda m: m.to("openreg").half(),
    lambda m: m.to("openreg").to(torch.bfloat16),
    lambda m: m.to("openreg:0").to("openreg:1"),
], ids=["to", "openreg()", "openreg(1)", "to_device_dtype", "round_trip_to", "round_trip_cpu",
        "half_on_device", "bf16_on_device", "device_to_device"])
def test_conversions_keep_identity_ties_and_values(convert):
    torch.manual_seed(0)
    m = TinyLM()
    ref = copy.deepcopy(m)
    before = dict(m.named_parameters())
    m.wte.weight.grad = torch.ones_like(m.wte.weight)
    grad = m.wte.weight.grad
    out = convert(m)
    assert out is m
    after = dict(m.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert m.lm_head.weight is m.wte.weight
    assert len(list(m.parameters())) == len(list(ref.parameters()))
    # The gradient is converted in place too (as on CUDA), and follows the parameter.
    assert m.wte.weight.grad is grad and grad.device == m.wte.weight.device
    for (k, p), q in zip(m.named_parameters(), ref.parameters()):
        assert type(p) is nn.Parameter and p.requires_grad
        torch.testing.assert_close(p.detach().cpu(), q.detach().to(p.dtype), msg=k)


def test_optimizer_created_before_to_trains_device_parameters_like_cpu():
    torch.manual_seed(0)
    cpu_model = TinyLM()
    dev_model = copy.deepcopy(cpu_model)
    ids = torch.randint(0, 32, (4, 8))
    losses = {}
    for name, model, device in [("cpu", cpu_model, "cpu"), ("openreg", dev_model, "openreg")]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before .to()
        model.to(device)
        x = ids.to(device)
        losses[name] = []
        for _ in range(5):
            opt.zero_grad()
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
        assert model.lm_head.weight is model.wte.weight
        # Every parameter the optimizer holds is the module's, on the device.
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        assert held == {id(p) for p in model.parameters()}
        assert all(s["exp_avg"].device.type == device for s in opt.state.values())
    torch.testing.assert_close(losses["openreg"], losses["cpu"], rtol=1e-5, atol=1e-5)
    assert losses["cpu"][-1] < losses["cpu"][0]
    for p, q in zip(dev_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("convert", [lambda m: m.to("openreg"), lambda m: m.openreg()],
                         ids=["to", "openreg()"])
@pytest.mark.parametrize("make,shape", [
    (lambda: nn.LazyLinear(3), (2, 5)),
    (lambda: nn.LazyConv2d(4, 3), (1, 2, 6, 6)),
    (lambda: nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d()), (2, 2, 6, 6)),
], ids=["LazyLinear", "LazyConv2d", "LazyBatchNorm2d"])
def test_lazy_modules(convert, make, shape):
    m = make()
    first = m[0] if isinstance(m, nn.Sequential) else m
    w = first.weight
    convert(m)
    assert type(first.weight) is nn.UninitializedParameter and first.weight is w
    if isinstance(m, nn.Sequential):
        assert type(m[1].running_mean) is nn.UninitializedBuffer
    x = torch.randn(shape)
    m(x.to("openreg"))  # the first forward materializes the parameters on the device
    for t in list(m.parameters()) + list(m.buffers()):
        assert type(t) in (nn.Parameter, torch.Tensor) and t.device.type == "openreg"
    ref = copy.deepcopy(m).cpu().eval()
    m.eval()
    torch.testing.assert_close(m(x.to("openreg")).cpu(), ref(x))


def test_lazy_module_loads_state_dict_on_device():
    src = nn.Linear(5, 3)
    m = nn.LazyLinear(3).openreg()
    m.load_state_dict(src.state_dict())
    assert type(m.weight) is nn.Parameter and m.weight.device.type == "openreg"
    torch.testing.assert_close(m.weight.detach().cpu(), src.weight.detach())


def test_load_state_dict_keeps_identity_and_ties_like_cpu():
    for assign in (False, True):
        outcome = {}
        for device in ("cpu", "openreg"):
            torch.manual_seed(0)
            m = TinyLM().to(device)
            w = m.wte.weight
            sd = {k: v.cpu() + 1 for k, v in TinyLM().state_dict().items()}
            m.load_state_dict(sd, assign=assign)
            outcome[device] = (m.wte.weight is w, m.lm_head.weight is m.wte.weight,
                               len(list(m.parameters())))
            torch.testing.assert_close(m.wte.weight.detach().cpu(), sd["wte.weight"])
            if not assign:
                assert m.wte.weight.device.type == device
        assert outcome["openreg"] == outcome["cpu"], assign


def test_future_flags_keep_their_meaning():
    # swap_module_params_on_conversion: `_apply` uses torch.utils.swap_tensors, which (unlike
    # set_data) gives the parameter the converted tensor's version counter.
    def versions(device):
        m = nn.Linear(2, 2)
        w = m.weight
        with torch.no_grad():
            w.add_(1)
        before = w._version
        m.to(device, torch.float64)
        return m.weight is w, w._version == before, w._version == 0
    assert versions("openreg") == versions("cpu") == (True, True, False)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        assert versions("openreg") == versions("cpu") == (True, False, True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    # overwrite_module_params_on_conversion: new Parameter objects, as on CUDA.
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        n = tied_pair()
        w = n[0].weight
        n.to("openreg")
        assert n[0].weight is not w and n[0].weight.device.type == "openreg"
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def test_meta_and_to_empty_behave_as_cuda():
    # meta <-> openreg is not a shallow-copy pair (meta is not a dense backend): to_empty() makes
    # new Parameters, as it does for CUDA.
    assert not torch._has_compatible_shallow_copy_type(torch.empty(1, device="meta"),
                                                       torch.empty(1, device="openreg"))
    with torch.device("meta"):
        m = nn.Linear(3, 3)
    w = m.weight
    m.to_empty(device="openreg")
    assert m.weight is not w and m.weight.device.type == "openreg"


def test_fake_tensor_mode_still_refuses_across_devices():
    """Known gap (docs/module_conversion.md): FakeTensorMode decomposes the operator to TensorImpl's
    rule before any backend kernel, so fake CPU <-> fake openreg stays incompatible."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cpu, dev = torch.ones(2), torch.ones(2, device="openreg")
        assert torch._has_compatible_shallow_copy_type(dev, dev)
        assert not torch._has_compatible_shallow_copy_type(cpu, dev)
        p = nn.Parameter(torch.ones(2))
        with pytest.raises(RuntimeError, match="incompatible tensor type"):
            p.data = dev


def test_cpu_only_behaviour_unchanged():
    """The same CPU-only probe, in a process without torch_openreg and in one with it."""
    probe = """
        import torch, torch.nn as nn
        cpu, meta = torch.ones(2), torch.ones(2, device="meta")
        sparse = torch.ones(2).to_sparse()
        quant = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
        with torch.inference_mode():
            inf = torch.ones(2)
        pairs = [(cpu, cpu.double()), (cpu, meta), (meta, cpu), (cpu, sparse), (sparse, sparse),
                 (cpu, quant), (cpu, inf), (inf, cpu)]
        out = [torch._has_compatible_shallow_copy_type(a, b) for a, b in pairs]
        n = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)); n[1].weight = n[0].weight
        w = n[0].weight
        n.double(); out.append((n[0].weight is w, n[1].weight is w))
        n.to("meta"); out.append((n[0].weight is w, n[1].weight is w))
        n.to_empty(device="cpu"); out.append((n[0].weight is w, n[1].weight is w))
        print(hasattr(torch, "openreg"), out)
    """
    without = run(probe, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    with_pkg = run("import torch_openreg\n" + textwrap.dedent(probe))
    assert without.returncode == 0 and with_pkg.returncode == 0, without.stderr + with_pkg.stderr
    assert without.stdout.startswith("False ") and with_pkg.stdout.startswith("True ")
    assert without.stdout.split(" ", 1)[1] == with_pkg.stdout.split(" ", 1)[1]


def test_fsdp2_fully_shard_cpu_model_with_openreg_accelerator():
    """FSDP2 moves a CPU model's parameters with `param.data = param.to(device)` (set_data)."""
    result = run("""
        import os, torch, torch.nn as nn, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        assert torch.accelerator.current_accelerator().type == "openreg"
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ref.load_state_dict(m.state_dict())
        fully_shard(m, mesh=init_device_mesh("openreg", (1,)))
        assert isinstance(m[0].weight, DTensor) and m[0].weight.device.type == "openreg"
        x = torch.randn(3, 4)
        y = m(x.to("openreg"))
        y.sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(y.cpu(), ref(x))
        torch.testing.assert_close(m[0].weight.grad.full_tensor().cpu(), ref[0].weight.grad)
        dist.destroy_process_group()
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
