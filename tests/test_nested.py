"""Nested tensors on openreg (docs/layouts.md): the strided nested layout (a NestedTensorImpl
whose buffer is device memory, its metadata on the CPU, as on CUDA) and the jagged layout (a
Python subclass over dense device tensors) give the CPU's results, including the Transformer
encoder's fast path and SDPA on jagged inputs."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

D = "openreg"
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


def parts(seed=0, shapes=((2, 3), (4, 3), (1, 3))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def same_nested(dev, cpu):
    assert dev.is_nested and dev.device.type == D and dev.layout == cpu.layout
    assert len(dev.unbind()) == len(cpu.unbind())
    for a, b in zip(dev.unbind(), cpu.unbind()):
        assert a.device.type == D
        torch.testing.assert_close(a.cpu(), b)


# ---- the issue's repro: the encoder's fast path builds a strided nested tensor ----

def test_issue_transformer_encoder_fast_path_with_padding_mask():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    ref = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    dev = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    dev.load_state_dict(ref.state_dict())
    dev.to(D)
    x = torch.randn(3, 7, 16)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:] = True
    mask[2, 2:] = True
    with torch.no_grad():
        expected = ref(x, src_key_padding_mask=mask)
        out = dev(x.to(D), src_key_padding_mask=mask.to(D))
    assert out.device.type == D and out.layout == torch.strided
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)


def test_transformer_encoder_layer_fast_path():
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    dev = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    dev.load_state_dict(ref.state_dict())
    dev.to(D)
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        torch.testing.assert_close(dev(x.to(D), src_key_padding_mask=mask.to(D)).cpu(),
                                   ref(x, src_key_padding_mask=mask), atol=1e-5, rtol=1e-4)


# ---- strided nested layout ----

def test_strided_construction_and_copies():
    ps = parts()
    ref = torch.nested.nested_tensor(ps)
    dev = torch.nested.nested_tensor(ps, device=D)
    same_nested(dev, ref)
    same_nested(ref.to(D), ref)
    back = dev.cpu()
    assert back.is_nested and back.device.type == "cpu"
    same_nested(back.to(D), ref)
    other = dev.to("openreg:1")
    assert other.device.index == 1 and all(t.device.index == 1 for t in other.unbind())
    same_nested(dev.double(), ref.double())
    same_nested(torch.nested.as_nested_tensor([p.to(D) for p in ps]), ref)


def test_strided_memory_is_on_the_device():
    torch.openreg.synchronize()
    before = torch.openreg.memory_allocated()
    nt = torch.nested.nested_tensor([torch.randn(100, 10), torch.randn(50, 10)], device=D)
    assert torch.openreg.memory_allocated() - before >= 150 * 10 * 4
    del nt
    assert torch.openreg.memory_allocated() == before


def test_strided_ops():
    ps = parts()
    ref = torch.nested.nested_tensor(ps)
    dev = ref.to(D)
    same_nested(dev + dev, ref + ref)
    same_nested(dev * 2.0, ref * 2.0)
    same_nested(dev.relu(), ref.relu())
    same_nested(F.gelu(dev), F.gelu(ref))
    same_nested(dev.softmax(-1), ref.softmax(-1))
    same_nested(dev.transpose(1, 2).contiguous(), ref.transpose(1, 2).contiguous())
    w, b = torch.randn(5, 3), torch.randn(5)
    same_nested(F.linear(dev, w.to(D), b.to(D)), F.linear(ref, w, b))
    lw, lb = torch.randn(3), torch.randn(3)
    same_nested(F.layer_norm(dev, (3,), lw.to(D), lb.to(D)), F.layer_norm(ref, (3,), lw, lb))
    padded = torch.nested.to_padded_tensor(dev, 0.5)
    assert padded.device.type == D and padded.layout == torch.strided
    torch.testing.assert_close(padded.cpu(), torch.nested.to_padded_tensor(ref, 0.5))
    dev.mul_(3.0)
    ref.mul_(3.0)
    same_nested(dev, ref)


def test_strided_from_mask_and_padded():
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    ref = torch._nested_tensor_from_mask(x, mask)
    same_nested(torch._nested_tensor_from_mask(x.to(D), mask.to(D)), ref)
    sizes = torch.tensor([[2, 3], [4, 3]])
    same_nested(torch._nested_from_padded(x.to(D), sizes), torch._nested_from_padded(x, sizes))


def test_strided_backward():
    ps = [p.requires_grad_() for p in parts()]
    dps = [p.detach().to(D).requires_grad_() for p in ps]
    w = torch.randn(4, 3)

    def loss(ts, w):
        nt = F.linear(torch.nested.as_nested_tensor(ts), w).relu()
        return torch.nested.to_padded_tensor(nt, 0.0).pow(2).sum()

    loss(ps, w).backward()
    loss(dps, w.to(D)).backward()
    for a, b in zip(dps, ps):
        torch.testing.assert_close(a.grad.cpu(), b.grad)


def test_metadata_is_host_memory_under_strict_memory_isolation():
    # Metadata made by a CPU kernel (the strides of a transposed view, the sizes of a result) is
    # host data: with OPENREG_STRICT_MEMORY=1, host code reading it from device memory would fault.
    code = """
import warnings, torch, torch.nn as nn
warnings.filterwarnings("ignore")
nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], device="openreg")
c = nt.transpose(1, 2).contiguous()
assert c.is_contiguous() and c._nested_tensor_strides().device.type == "cpu"
assert torch.nested.to_padded_tensor(c, 0.0).shape == (2, 3, 4)
m = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1).eval()
m.to("openreg")
x = torch.randn(2, 5, 8, device="openreg")
mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device="openreg")
with torch.no_grad():
    print(m(x, src_key_padding_mask=mask).cpu().shape)
"""
    env = dict(os.environ, OPENREG_STRICT_MEMORY="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch.Size([2, 5, 8])" in r.stdout


# ---- jagged layout ----

def test_jagged_construction_and_ops():
    ps = parts()
    ref = torch.nested.nested_tensor(ps, layout=torch.jagged)
    dev = torch.nested.nested_tensor(ps, layout=torch.jagged, device=D)
    assert dev.values().device.type == D and dev.offsets().device.type == D
    same_nested(dev, ref)
    same_nested(ref.to(D), ref)
    same_nested(dev.relu() * 2 + 1, ref.relu() * 2 + 1)
    w = torch.randn(5, 3)
    same_nested(F.linear(dev, w.to(D)), F.linear(ref, w))
    same_nested(dev.softmax(-1), ref.softmax(-1))
    torch.testing.assert_close(dev.sum(dim=1).cpu(), ref.sum(dim=1))
    torch.testing.assert_close(dev.to_padded_tensor(0.0).cpu(), ref.to_padded_tensor(0.0))


def test_jagged_sdpa_matches_cpu():
    torch.manual_seed(0)
    heads, dim = 2, 8
    seqs = [torch.randn(n, heads * dim) for n in (3, 5, 2)]

    def run(device):
        nt = torch.nested.nested_tensor([s.to(device) for s in seqs], layout=torch.jagged)
        nt.requires_grad_()
        q = nt.unflatten(-1, (heads, dim)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q)
        out.transpose(1, 2).flatten(-2).values().pow(2).sum().backward()
        return out.transpose(1, 2).flatten(-2), nt.grad

    out_d, grad_d = run(D)
    out_c, grad_c = run("cpu")
    same_nested(out_d, out_c)
    torch.testing.assert_close(grad_d.values().cpu(), grad_c.values(), atol=1e-5, rtol=1e-4)


def test_multihead_attention_fast_path_with_padding_mask():
    # eval + no_grad + self-attention: nn.MultiheadAttention's fast path
    # (_native_multi_head_attention), which turns a padding mask into a nested tensor.
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    dev = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    dev.load_state_dict(ref.state_dict())
    dev.to(D)
    x = torch.randn(2, 4, 8)
    mask = torch.tensor([[False, False, True, True], [False] * 4])
    xd = x.to(D)
    with torch.no_grad():
        out_c, _ = ref(x, x, x, key_padding_mask=mask, need_weights=False)
        out_d, _ = dev(xd, xd, xd, key_padding_mask=mask.to(D), need_weights=False)
    torch.testing.assert_close(out_d.cpu(), out_c, atol=1e-5, rtol=1e-4)


# ---- errors ----

def test_mixed_devices_rejected():
    dev = torch.nested.nested_tensor(parts(), device=D)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dev + torch.nested.nested_tensor(parts(), device="openreg:1")


def test_unsupported_op_names_layout_and_op():
    dev = torch.nested.nested_tensor(parts(), device=D)
    with pytest.raises((NotImplementedError, RuntimeError), match="nested"):
        torch.cumsum(dev, 0)
