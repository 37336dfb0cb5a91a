"""Operators ATen calls only for accelerators, implemented by openreg
(csrc/ops/overrideable_ops.cpp): convolution_overrideable and its backward, native_dropout from
the device generator, and the fused ("overrideable") scaled dot product attention chosen through
_fused_sdp_choice.

Every result is compared with the same computation on the CPU. The RNN cells are in test_rnn.py.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import torch_openreg


def to_device(tensors, device):
    """Device copies of CPU tensors, as leaves that require grad like the originals."""
    return [None if t is None else t.detach().to(device).requires_grad_(t.requires_grad)
            for t in tensors]


def seed_device(device, seed):
    """Seeds the generator of `device` (torch.openreg.manual_seed seeds the current device)."""
    with torch.openreg.device(torch.device(device)):
        torch.openreg.manual_seed(seed)


def profiled_ops(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


# ---------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------

# (functional, input shape, weight shape, bias, keyword arguments)
CONV_CASES = {
    "1d_stride_pad": (F.conv1d, (2, 4, 11), (6, 4, 3), True, dict(stride=2, padding=1)),
    "1d_groups_dilation_nobias": (F.conv1d, (2, 4, 12), (6, 2, 3), False,
                                  dict(groups=2, dilation=2)),
    "2d": (F.conv2d, (2, 3, 9, 8), (4, 3, 3, 3), True, dict(padding=1)),
    "2d_all_options": (F.conv2d, (2, 6, 9, 8), (9, 2, 3, 3), True,
                       dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=3)),
    "2d_same_even_kernel": (F.conv2d, (1, 2, 7, 7), (3, 2, 4, 4), True, dict(padding="same")),
    "2d_depthwise_nobias": (F.conv2d, (2, 4, 6, 6), (4, 1, 3, 3), False, dict(groups=4)),
    "2d_unbatched": (F.conv2d, (3, 6, 6), (2, 3, 3, 3), True, dict(padding=1)),
    "3d": (F.conv3d, (1, 2, 5, 6, 5), (4, 2, 3, 3, 3), True, dict(padding=1, stride=(1, 2, 1))),
    "transposed_1d": (F.conv_transpose1d, (2, 4, 7), (4, 3, 3), True,
                      dict(stride=2, padding=1, output_padding=1)),
    "transposed_2d_groups_dilation": (F.conv_transpose2d, (2, 4, 5, 6), (4, 3, 3, 3), True,
                                      dict(stride=2, groups=2, dilation=2, padding=1)),
    "transposed_3d_nobias": (F.conv_transpose3d, (1, 2, 3, 4, 3), (2, 3, 2, 2, 2), False,
                             dict(stride=2)),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_convolution_matches_cpu(device, case):
    fn, xs, ws, has_bias, kwargs = CONV_CASES[case]
    torch.manual_seed(0)
    x = torch.randn(xs, requires_grad=True)
    w = torch.randn(ws, requires_grad=True)
    out_channels = ws[1] * kwargs.get("groups", 1) if "transpose" in fn.__name__ else ws[0]
    b = torch.randn(out_channels, requires_grad=True) if has_bias else None
    xd, wd, bd = to_device([x, w, b], device)

    y = fn(x, w, b, **kwargs)
    yd = fn(xd, wd, bd, **kwargs)
    assert yd.device == torch.device(device)
    torch.testing.assert_close(yd.cpu(), y)

    g = torch.randn_like(y)
    y.backward(g)
    yd.backward(g.to(device))
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    torch.testing.assert_close(wd.grad.cpu(), w.grad)
    if has_bias:
        torch.testing.assert_close(bd.grad.cpu(), b.grad)
    for t in (xd, wd, bd):
        assert t is None or t.grad.device == torch.device(device)


def test_convolution_channels_last_and_double(device):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.double).to(memory_format=torch.channels_last)
    w = torch.randn(5, 3, 3, 3, dtype=torch.double)
    x.requires_grad_()
    w.requires_grad_()
    xd, wd = to_device([x, w], device)
    y = F.conv2d(x, w, padding=1)
    yd = F.conv2d(xd, wd, padding=1)
    torch.testing.assert_close(yd.cpu(), y)
    y.sum().backward()
    yd.sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    torch.testing.assert_close(wd.grad.cpu(), w.grad)


def layout(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.storage_offset())


def in_format(t, fmt):
    """`t` channels-last (channels_last for 4-D, channels_last_3d for 5-D, channels innermost for
    3-D), or the transpose of a contiguous tensor of the transposed shape ("transposed")."""
    if fmt == "contiguous":
        return t.contiguous()
    if fmt == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("formats", [("channels_last", "contiguous"),
                                     ("contiguous", "channels_last"),
                                     ("channels_last", "channels_last"),
                                     ("transposed", "contiguous")])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_convolution_layouts_are_the_cpus(device, case, formats):
    # Sizes, strides and storage offset of the output and of the three gradients equal the CPU
    # kernel's for every layout of input and weight (docs/overrideable_ops.md): the CPU keeps a
    # channels-last input's or weight's layout where its backend does.
    fn, xs, ws, has_bias, kwargs = CONV_CASES[case]
    torch.manual_seed(0)
    x, w = in_format(torch.randn(xs), formats[0]), in_format(torch.randn(ws), formats[1])
    out_channels = ws[1] * kwargs.get("groups", 1) if "transpose" in fn.__name__ else ws[0]
    b = torch.randn(out_channels) if has_bias else None
    y = fn(x, w, b, **kwargs)
    yd = fn(*to_device([x, w, b], device), **kwargs)
    assert layout(yd) == layout(y)
    torch.testing.assert_close(yd.cpu(), y, rtol=0, atol=0)
    if x.dim() == w.dim() - 1:
        return  # unbatched: autograd's backward batches it first (layouts of views)
    transposed = "transpose" in fn.__name__
    dims = w.dim() - 2
    stride, padding, dilation = (list(torch.nn.modules.utils._ntuple(dims)(kwargs.get(k, d)))
                                 for k, d in (("stride", 1), ("padding", 0), ("dilation", 1)))
    args = (stride, padding, dilation, transposed, [0] * dims, kwargs.get("groups", 1))
    if isinstance(kwargs.get("padding"), str):
        return  # padding="same" pads in the composite function, not in the kernel
    go = in_format(torch.randn(y.shape), formats[0])
    expected = torch.ops.aten.convolution_backward(go, x, w, [out_channels], *args,
                                                   [True, True, True])
    got = torch.ops.aten.convolution_backward(*to_device([go, x, w], device), [out_channels],
                                              *args, [True, True, True])
    for g, e in zip(got, expected):
        assert layout(g) == layout(e)
        torch.testing.assert_close(g.cpu(), e, rtol=0, atol=0)


@pytest.mark.parametrize("module", ["conv2d", "conv_transpose2d", "conv3d"])
@pytest.mark.parametrize("module_format", ["contiguous", "channels_last"])
def test_convolution_modules_keep_the_cpus_layouts(device, module, module_format):
    # The cases: a channels-last input through Conv2d, ConvTranspose2d and Conv3d, the
    # module itself channels-last or contiguous; the output and the gradients of the input and of
    # the parameters have the CPU's layouts.
    torch.manual_seed(0)
    make, xs = {"conv2d": (lambda: torch.nn.Conv2d(4, 6, 3, padding=1), (2, 4, 6, 6)),
                "conv_transpose2d": (lambda: torch.nn.ConvTranspose2d(4, 6, 3, stride=2),
                                     (2, 4, 5, 5)),
                "conv3d": (lambda: torch.nn.Conv3d(4, 6, 3, padding=1), (2, 4, 4, 5, 3))}[module]
    cpu_module = make()
    x = in_format(torch.randn(xs), "channels_last")
    if module_format == "channels_last":
        cpu_module = cpu_module.to(memory_format=torch.channels_last if x.dim() == 4
                                   else torch.channels_last_3d)
    dev_module = copy.deepcopy(cpu_module).to(device)
    xc, xd = x.clone().requires_grad_(), x.to(device).requires_grad_()
    y, yd = cpu_module(xc), dev_module(xd)
    assert layout(yd) == layout(y)
    g = in_format(torch.randn(y.shape), "channels_last")
    y.backward(g)
    yd.backward(g.to(device))
    for got, expected in [(xd, xc), *zip(dev_module.parameters(), cpu_module.parameters())]:
        assert layout(got.grad) == layout(expected.grad)
        # (close, not equal: backward runs with one OpenMP thread, docs/determinism.md)
        torch.testing.assert_close(got.grad.cpu(), expected.grad)


def test_convolution_double_backward(device):
    # Gradient penalties differentiate through the convolution's backward (composite ATen code
    # that calls the overrideable kernels again).
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g, dtype=torch.double).to(device).requires_grad_()
               for s in ((1, 2, 5, 5), (3, 2, 3, 3), (3,)))
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=2), (x, w, b))
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: F.conv_transpose2d(x, w.transpose(0, 1), b, stride=2), (x, w, b))


def test_convolution_runs_the_overrideable_kernels(device):
    conv = torch.nn.Conv2d(3, 4, 3).to(device)
    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    ops = profiled_ops(lambda: conv(x).sum().backward())
    assert "aten::convolution_overrideable" in ops
    assert "aten::convolution_backward_overrideable" in ops


@pytest.mark.parametrize("output_mask", [(True, True, True), (True, False, False),
                                         (False, True, True), (False, False, True)])
def test_convolution_backward_overrideable_output_mask(device, output_mask):
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 7, 7), torch.randn(6, 2, 3, 3)
    # stride, padding, dilation, transposed, output_padding, groups
    args = ([2, 1], [1, 0], [1, 2], False, [0, 0], 2)
    y = torch.ops.aten.convolution_overrideable(x.to(device), w.to(device), None, *args)
    torch.testing.assert_close(y.cpu(), torch.ops.aten.convolution(x, w, None, *args))
    go = torch.randn(y.shape)
    got = torch.ops.aten.convolution_backward_overrideable(
        go.to(device), x.to(device), w.to(device), *args, list(output_mask))
    expected = torch.ops.aten.convolution_backward(go, x, w, [6], *args, list(output_mask))
    for wanted, g, e in zip(output_mask, got, expected):
        if wanted:
            assert g.device == torch.device(device)
            torch.testing.assert_close(g.cpu(), e)
        else:
            assert g is None


def test_convolution_device_mismatch_raises():
    x = torch.randn(1, 2, 5, 5, device="openreg:0")
    for w in (torch.randn(3, 2, 3, 3, device="openreg:1"), torch.randn(3, 2, 3, 3)):
        with pytest.raises(RuntimeError, match="same device|should be the same"):
            F.conv2d(x, w)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ops.aten.convolution_overrideable(x, torch.randn(3, 2, 3, 3, device="openreg:1"),
                                                None, *args)


# ---------------------------------------------------------------------------------------------
# native_dropout: the mask comes from the openreg generator
# ---------------------------------------------------------------------------------------------

def test_dropout_draws_from_the_device_generator(device):
    x = torch.randn(4000, device=device)
    cpu_state = torch.get_rng_state()
    seed_device(device, 7)
    a = F.dropout(x, 0.3)
    seed_device(device, 7)
    b = F.dropout(x, 0.3)
    seed_device(device, 8)
    c = F.dropout(x, 0.3)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator was not used
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a.cpu(), c.cpu())
    kept = a.cpu() != 0
    assert 0.65 < kept.float().mean().item() < 0.75
    torch.testing.assert_close(a.cpu()[kept], x.cpu()[kept] / 0.7)


def test_dropout_devices_have_independent_generators():
    x0 = torch.ones(1000, device="openreg:0")
    x1 = torch.ones(1000, device="openreg:1")
    torch.openreg.manual_seed_all(3)
    a = F.dropout(x1, 0.5).cpu()
    torch.openreg.manual_seed_all(3)
    F.dropout(x0, 0.5)  # draws from openreg:0 only
    b = F.dropout(x1, 0.5).cpu()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_native_dropout_mask_and_backward(device):
    x = torch.randn(50, 40, device=device, requires_grad=True)
    out, mask = torch.native_dropout(x, 0.25, True)
    assert mask.dtype == torch.bool and mask.device == x.device
    torch.testing.assert_close(out, x.detach() * mask / 0.75)
    out.sum().backward()
    torch.testing.assert_close(x.grad, mask.float() / 0.75)
    out, mask = torch.native_dropout(x, 0.25, False)
    torch.testing.assert_close(out, x.detach(), rtol=0, atol=0)
    assert bool(mask.all())


# ---------------------------------------------------------------------------------------------
# Scaled dot product attention
# ---------------------------------------------------------------------------------------------

def attention_inputs(shape_q, shape_kv, shape_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_v or shape_kv, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


def math_reference(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def attention_node(out):
    """The autograd node of the attention kernel that made `out`. Since torch 2.14,
    scaled_dot_product_attention gives unbatched (3-D) inputs a batch dimension of 1 before a
    fused backend and removes it after, so a squeeze comes first there."""
    node = out.grad_fn
    while node.name().startswith("SqueezeBackward"):
        node = node.next_functions[0][0]
    return node.name()


def check_attention(device, q, k, v, mask=None, grad_atol=None, **kwargs):
    """openreg's own fused kernel (the overrideable backend, chosen explicitly: with the default
    settings openreg follows the CPU's choice, see test_sdpa_equals_the_cpu_bit_for_bit) against
    the math backend on the CPU."""
    qd, kd, vd, maskd = to_device([q, k, v, mask], device)
    out = math_reference(q, k, v, attn_mask=mask, **kwargs)
    with sdpa_kernel(SDPBackend.OVERRIDEABLE):
        outd = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=maskd, **kwargs)
    assert attention_node(outd) == "ScaledDotProductFusedAttentionOverrideableBackward0"
    assert outd.shape == out.shape and outd.device == torch.device(device)
    torch.testing.assert_close(outd.cpu(), out)
    g = torch.randn_like(out)
    out.backward(g)
    outd.backward(g.to(device))
    tol = {} if grad_atol is None else dict(atol=grad_atol, rtol=grad_atol)
    for a, b in ((qd, q), (kd, k), (vd, v), (maskd, mask)):
        if b is not None and b.requires_grad:
            assert a.grad.shape == b.grad.shape
            torch.testing.assert_close(a.grad.cpu(), b.grad, **tol)
    return outd


def test_sdp_choice_selects_the_overrideable_backend(device):
    q, k, v = (torch.randn(2, 3, 5, 8, device=device) for _ in range(3))
    assert torch._fused_sdp_choice(q, k, v) == SDPBackend.OVERRIDEABLE.value
    # Where the CPU runs its math backend (dropout), so does openreg, unless the user asks for
    # the overrideable backend itself.
    assert torch._fused_sdp_choice(q.cpu(), k.cpu(), v.cpu(), dropout_p=0.1) == \
        SDPBackend.MATH.value
    assert torch._fused_sdp_choice(q, k, v, dropout_p=0.1, is_causal=True) == SDPBackend.MATH.value
    with sdpa_kernel(SDPBackend.OVERRIDEABLE):
        assert torch._fused_sdp_choice(q, k, v, dropout_p=0.1, is_causal=True) == \
            SDPBackend.OVERRIDEABLE.value
    with sdpa_kernel(SDPBackend.MATH):
        assert torch._fused_sdp_choice(q, k, v) == SDPBackend.MATH.value
        assert F.scaled_dot_product_attention(q, k, v).grad_fn is None
        ops = profiled_ops(lambda: F.scaled_dot_product_attention(q, k, v))
        assert "aten::_scaled_dot_product_fused_attention_overrideable" not in ops
    # Grouped-query attention needs enable_gqa; otherwise math (which raises for such inputs).
    kv = torch.randn(2, 1, 5, 8, device=device)
    assert torch._fused_sdp_choice(q, kv, kv, enable_gqa=True) == SDPBackend.OVERRIDEABLE.value
    assert torch._fused_sdp_choice(q, kv, kv) == SDPBackend.MATH.value


def test_sdpa_runs_the_fused_kernel_not_math(device):
    q, k, v = (torch.randn(2, 3, 5, 8, device=device, requires_grad=True) for _ in range(3))
    ops = profiled_ops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert "aten::_scaled_dot_product_fused_attention_overrideable" in ops
    assert "aten::_scaled_dot_product_fused_attention_overrideable_backward" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert not any("softmax" in name for name in ops)  # the math path's softmax
    # Inside, for these inputs: the CPU's flash kernels, run on the device memory.
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops


def test_sdpa_falls_back_to_math_or_raises():
    q = torch.randn(1, 2, 2, 3, 4, device="openreg")  # 5-D: math only
    assert torch._fused_sdp_choice(q, q, q) == SDPBackend.MATH.value
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q).cpu(),
                               math_reference(q.cpu(), q.cpu(), q.cpu()))
    with sdpa_kernel(SDPBackend.OVERRIDEABLE):
        with pytest.raises(RuntimeError, match="No viable backend"):
            with pytest.warns(UserWarning, match="must all be 3-D or all 4-D"):
                F.scaled_dot_product_attention(q, q, q)


ATTENTION_CASES = {
    "plain": dict(shapes=((2, 3, 5, 8), (2, 3, 7, 8))),
    "causal_square": dict(shapes=((2, 2, 6, 4), (2, 2, 6, 4)), is_causal=True),
    "causal_rectangular": dict(shapes=((1, 2, 4, 8), (1, 2, 6, 8)), is_causal=True),
    "scale": dict(shapes=((2, 2, 5, 8), (2, 2, 5, 8)), scale=0.3),
    "value_dim_differs": dict(shapes=((2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 3))),
    "unbatched_3d": dict(shapes=((3, 5, 8), (3, 6, 8))),
    "gqa": dict(shapes=((2, 6, 5, 8), (2, 2, 7, 8)), enable_gqa=True),
    "gqa_causal": dict(shapes=((1, 4, 5, 8), (1, 1, 5, 8)), enable_gqa=True, is_causal=True),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_sdpa_matches_math(device, case):
    kwargs = dict(ATTENTION_CASES[case])
    q, k, v = attention_inputs(*kwargs.pop("shapes"))
    check_attention(device, q, k, v, **kwargs)


def test_sdpa_general_path(device):
    # Inputs the CPU flash kernel does not take (a last dimension that is not contiguous, grouped
    # heads with a mask that needs a gradient) run on openreg's own attention kernel.
    for kwargs in (dict(is_causal=True), dict(scale=0.2)):
        q, k, v = (t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
                   for t in attention_inputs((2, 3, 5, 8), (2, 3, 7, 8)))
        assert q.detach().to(device).stride(-1) != 1
        ops = profiled_ops(lambda: check_attention(device, q, k, v, **kwargs))
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops
    q, k, v = attention_inputs((2, 4, 5, 8), (2, 2, 7, 8))
    mask = torch.randn(2, 1, 5, 7, requires_grad=True)
    check_attention(device, q, k, v, mask=mask, enable_gqa=True)


@pytest.mark.parametrize("mask_shape", [(5, 7), (2, 1, 5, 7), (2, 3, 5, 7)])
def test_sdpa_bool_mask(device, mask_shape):
    q, k, v = attention_inputs((2, 3, 5, 8), (2, 3, 7, 8))
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True  # no row entirely masked here (see test_sdpa_fully_masked_rows)
    check_attention(device, q, k, v, mask=mask)


@pytest.mark.parametrize("mask_shape", [(5, 7), (2, 1, 5, 7), (2, 3, 5, 7)])
def test_sdpa_float_mask_with_gradient(device, mask_shape):
    q, k, v = attention_inputs((2, 3, 5, 8), (2, 3, 7, 8))
    mask = torch.randn(mask_shape, generator=torch.Generator().manual_seed(2), requires_grad=True)
    check_attention(device, q, k, v, mask=mask)


def test_sdpa_fully_masked_rows(device):
    q, k, v = attention_inputs((1, 2, 4, 8), (1, 2, 5, 8))
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out = check_attention(device, q, k, v, mask=mask)
    assert torch.all(out[:, :, 2].cpu() == 0)


def test_sdpa_output_follows_the_query_layout(device):
    # Multi-head attention builds q as a transposed view of [B, L, H, E]; the output (and the
    # gradient of q) keeps that layout, as the meta function of the operator says.
    qs, ks, vs = attention_inputs((2, 5, 3, 8), (2, 7, 3, 8), (2, 7, 3, 4))
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (qs, ks, vs))
    outd = check_attention(device, q, k, v)
    assert outd.transpose(1, 2).is_contiguous()
    qd = q.detach().to(device).transpose(1, 2).contiguous().transpose(1, 2)
    meta = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        qd.to("meta"), k.detach().to("meta"), v.detach().to("meta"))[0]
    real = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        qd, k.detach().to(device), v.detach().to(device))[0]
    assert real.shape == meta.shape and real.stride() == meta.stride()


def test_sdpa_operator_outputs(device):
    q, k, v = (t.detach().to(device) for t in attention_inputs((2, 3, 5, 8), (2, 3, 7, 8)))
    out, lse, cq, ck, max_q, max_k, seed, offset, debug = \
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v, scale=0.5)
    assert (max_q, max_k) == (5, 7)
    assert lse.shape == (2, 3, 5) and lse.dtype == torch.float32 and lse.device == q.device
    expected_lse = torch.logsumexp(q.cpu() @ k.cpu().transpose(-2, -1) * 0.5, dim=-1)
    torch.testing.assert_close(lse.cpu(), expected_lse)
    assert cq is None and ck is None and debug is None
    assert seed.dtype == torch.int64 and offset.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_low_precision(device, dtype):
    q, k, v = attention_inputs((2, 2, 6, 8), (2, 2, 6, 8), dtype=dtype)
    qd, kd, vd = to_device([q, k, v], device)
    outd = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    assert outd.dtype == dtype
    assert attention_node(outd) == "ScaledDotProductFusedAttentionOverrideableBackward0"
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = math_reference(qf, kf, vf, is_causal=True)
    torch.testing.assert_close(outd.cpu().float(), out, atol=2e-2, rtol=2e-2)
    out.sum().backward()
    outd.sum().backward()
    for a, b in ((qd, qf), (kd, kf), (vd, vf)):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad.cpu().float(), b.grad, atol=5e-2, rtol=5e-2)


def test_sdpa_gradcheck_double():
    q, k, v = (t.detach().to("openreg").requires_grad_() for t in
               attention_inputs((1, 2, 3, 4), (1, 2, 4, 4), dtype=torch.float64))
    mask = torch.randn(3, 4, dtype=torch.float64, device="openreg", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), (q, k, v, mask))
    assert torch.autograd.gradcheck(
        lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, scale=0.7), (q, k, v))


def test_sdpa_dropout_is_reproducible_from_the_device_generator(device):
    q, k, v = (t.detach().to(device) for t in attention_inputs((2, 2, 8, 8), (2, 2, 8, 8)))
    cpu_state = torch.get_rng_state()
    seed_device(device, 11)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    seed_device(device, 11)
    b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(b.cpu(), c.cpu())
    assert not torch.allclose(a.cpu(), F.scaled_dot_product_attention(q, k, v).cpu())


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_dropout_matches_math_with_the_same_mask(device, causal):
    # return_debug_mask=True returns the keep-mask; the math backend accepts a dropout mask.
    q, k, v = attention_inputs((2, 2, 6, 8), (2, 2, 6, 8))
    p = 0.4
    qd, kd, vd = to_device([q, k, v], device)
    seed_device(device, 5)
    _, _, _, _, _, _, _, _, keep = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        qd.detach(), kd.detach(), vd.detach(), None, p, causal, True)
    assert keep.dtype == torch.bool and keep.shape == (2, 2, 6, 6)
    assert 0.45 < keep.float().mean().item() < 0.75

    seed_device(device, 5)  # the same seed: the same mask in forward and backward
    with sdpa_kernel(SDPBackend.OVERRIDEABLE):
        outd = F.scaled_dot_product_attention(qd, kd, vd, dropout_p=p, is_causal=causal)
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, p, causal, keep.cpu())
    torch.testing.assert_close(outd.cpu(), out)
    g = torch.randn_like(out)
    out.backward(g)
    outd.backward(g.to(device))
    for a, b in ((qd, q), (kd, k), (vd, v)):
        torch.testing.assert_close(a.grad.cpu(), b.grad)


# Where the CPU's flash-attention kernel serves the inputs, openreg's results are the CPU's bit
# for bit, forward and backward; elsewhere both run the math backend (docs/determinism.md).
BITWISE_ATTENTION = {
    "batched": dict(shapes=((2, 3, 5, 8), (2, 3, 7, 8))),
    "unbatched": dict(shapes=((3, 5, 8), (3, 7, 8))),
    "unbatched_causal": dict(shapes=((3, 6, 8), (3, 6, 8)), is_causal=True),
    "causal": dict(shapes=((2, 2, 6, 16), (2, 2, 9, 16)), is_causal=True),
    "bool_mask": dict(shapes=((2, 3, 5, 8), (2, 3, 7, 8)), mask=(torch.bool, (5, 7))),
    "float_mask": dict(shapes=((2, 3, 5, 8), (2, 3, 7, 8)), mask=(None, (2, 1, 5, 7))),
    "float_mask_with_grad": dict(shapes=((2, 3, 5, 8), (2, 3, 7, 8)), mask=(None, (5, 7)),
                                 mask_grad=True),
    "gqa": dict(shapes=((2, 6, 5, 8), (2, 2, 7, 8)), enable_gqa=True),
    "gqa_causal": dict(shapes=((1, 4, 5, 8), (1, 1, 5, 8)), enable_gqa=True, is_causal=True),
    "scale": dict(shapes=((2, 2, 5, 8), (2, 2, 5, 8)), scale=0.3),
    "value_dim_differs": dict(shapes=((2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 3))),
    "long": dict(shapes=((1, 2, 300, 32), (1, 2, 300, 32)), is_causal=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(BITWISE_ATTENTION))
def test_sdpa_equals_the_cpu_bit_for_bit(case, dtype):
    kwargs = dict(BITWISE_ATTENTION[case])
    q, k, v = attention_inputs(*kwargs.pop("shapes"), dtype=dtype)
    mask = None
    if "mask" in kwargs:
        mask_dtype, shape = kwargs.pop("mask")
        g = torch.Generator().manual_seed(3)
        mask = (torch.rand(shape, generator=g) > 0.3 if mask_dtype == torch.bool else
                torch.randn(shape, generator=g, dtype=dtype))
        if mask_dtype == torch.bool:
            mask[..., 0] = True
        mask.requires_grad_(kwargs.pop("mask_grad", False))
    qd, kd, vd, maskd = to_device([q, k, v, mask], "openreg")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # backward: as on the autograd device thread (docs/determinism.md)
    try:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        outd = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=maskd, **kwargs)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        out.backward(g)
        outd.backward(g.to("openreg"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outd.cpu(), out) and outd.stride() == out.stride()
    for a, b in ((qd, q), (kd, k), (vd, v), (maskd, mask)):
        if b is not None and b.requires_grad:
            assert torch.equal(a.grad.cpu(), b.grad) and a.grad.stride() == b.grad.stride()



# ---------------------------------------------------------------------------------------------
# The second derivative through the overrideable attention (backward with create_graph=True)
# ---------------------------------------------------------------------------------------------

def route_calls(name):
    return torch_openreg._C._route_calls("overrideable_ops.attention_backward." + name)


# (query shape, key/value shape, keyword arguments of scaled_dot_product_attention, mask: None,
# or its kind ("bool", "bool_empty_row", "float", "float_grad") and shape)
GRADGRAD_ATTENTION = {
    "plain": ((1, 2, 3, 4), (1, 2, 4, 4), {}, None),
    "causal_scale": ((1, 2, 4, 4), (1, 2, 4, 4), dict(is_causal=True, scale=0.7), None),
    "causal_rectangular": ((1, 1, 3, 4), (1, 1, 5, 4), dict(is_causal=True), None),
    "bool_mask": ((2, 2, 3, 4), (2, 2, 4, 4), {}, ("bool", (3, 4))),
    "bool_mask_row_masked_entirely": ((1, 2, 3, 4), (1, 2, 4, 4), {}, ("bool_empty_row", (3, 4))),
    "float_mask": ((2, 2, 3, 4), (2, 2, 4, 4), {}, ("float", (2, 1, 3, 4))),
    "float_mask_with_grad": ((1, 2, 3, 4), (1, 2, 4, 4), {}, ("float_grad", (3, 4))),
    "unbatched_3d": ((2, 3, 4), (2, 4, 4), {}, None),
    "gqa": ((1, 4, 3, 4), (1, 2, 4, 4), dict(enable_gqa=True), None),
    "value_dim_differs": ((1, 2, 3, 4), (1, 2, 4, 4), dict(value_dim=3), None),
}


def gradgrad_inputs(case, device):
    """float64 leaves on `device` for a GRADGRAD_ATTENTION case; the mask comes last when it
    requires grad, otherwise it is returned apart."""
    shape_q, shape_kv, kwargs, mask_spec = GRADGRAD_ATTENTION[case]
    kwargs = dict(kwargs)
    shape_v = shape_kv[:-1] + (kwargs.pop("value_dim", shape_kv[-1]),)
    q, k, v = (t.detach().to(device).requires_grad_() for t in
               attention_inputs(shape_q, shape_kv, shape_v, dtype=torch.float64, seed=7))
    mask = None
    if mask_spec is not None:
        kind, shape = mask_spec
        g = torch.Generator().manual_seed(8)
        if kind.startswith("bool"):
            mask = torch.rand(shape, generator=g) > 0.3
            mask[..., 0] = True
            if kind == "bool_empty_row":
                mask[1] = False  # the second query attends to nothing: output and gradients 0
        else:
            mask = torch.randn(shape, generator=g, dtype=torch.float64)
        mask = mask.to(device).requires_grad_(kind == "float_grad")
    inputs = (q, k, v, mask) if mask is not None and mask.requires_grad else (q, k, v)
    return inputs, mask, kwargs


def fused_attention(mask, kwargs):
    """scaled_dot_product_attention on the overrideable backend (chosen explicitly: with the
    default settings a mask that requires grad goes to the math backend, as on the CPU)."""
    def fn(q, k, v, *grad_mask):
        with sdpa_kernel(SDPBackend.OVERRIDEABLE):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=grad_mask[0] if grad_mask else mask, **kwargs)
        assert attention_node(out) == "ScaledDotProductFusedAttentionOverrideableBackward0"
        return out
    return fn


@pytest.mark.parametrize("case", list(GRADGRAD_ATTENTION))
def test_sdpa_gradgradcheck_double(case):
    inputs, mask, kwargs = gradgrad_inputs(case, "openreg")
    fn = fused_attention(mask, kwargs)
    before = route_calls("differentiable")
    assert torch.autograd.gradgradcheck(fn, inputs)
    assert route_calls("differentiable") > before


def second_derivatives(fn, inputs, seed=9):
    """The gradients, with create_graph=True, of <fn(inputs), w>, and the gradients of
    <those gradients, u> with respect to the inputs (u, w fixed random directions)."""
    g = torch.Generator().manual_seed(seed)
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad(out, inputs, w, create_graph=True)
    u = [torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device) for x in grads]
    second = torch.autograd.grad(grads, inputs, u)
    return [x.detach().cpu() for x in grads], [x.cpu() for x in second]


@pytest.mark.parametrize("case", list(GRADGRAD_ATTENTION))
def test_sdpa_second_derivative_equals_the_cpu(device, case):
    inputs, mask, kwargs = gradgrad_inputs(case, device)
    cpu_inputs = [x.detach().cpu().requires_grad_() for x in inputs]
    cpu_mask = None if mask is None or mask.requires_grad else mask.cpu()

    def cpu_fn(q, k, v, *grad_mask):
        # The CPU's own backward for these inputs, its flash kernel, has no derivative (below):
        # the reference is its math backend.
        return math_reference(q, k, v, attn_mask=grad_mask[0] if grad_mask else cpu_mask,
                              **kwargs)

    first, second = second_derivatives(fused_attention(mask, kwargs), inputs)
    first_cpu, second_cpu = second_derivatives(cpu_fn, cpu_inputs)
    for a, b in zip(first + second, first_cpu + second_cpu):
        torch.testing.assert_close(a, b)
    cpu_attn_mask = cpu_inputs[3] if len(cpu_inputs) > 3 else cpu_mask
    choice = torch._fused_sdp_choice(*cpu_inputs[:3], cpu_attn_mask, **kwargs)
    if choice == SDPBackend.FLASH_ATTENTION.value:
        out = F.scaled_dot_product_attention(*cpu_inputs[:3], attn_mask=cpu_attn_mask, **kwargs)
        grads = torch.autograd.grad(out, cpu_inputs, torch.ones_like(out), create_graph=True)
        with pytest.raises(RuntimeError, match="derivative for .*_backward is not implemented"):
            torch.autograd.grad(grads[0].sum(), cpu_inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_second_derivative_with_dropout_uses_the_forward_mask(device, causal):
    # The second derivative applies the forward's dropout mask again (regenerated from the seed
    # the forward returned): the math backend given that mask gives the same derivatives.
    q, k, v = (t.detach().requires_grad_() for t in
               attention_inputs((1, 2, 4, 4), (1, 2, 5, 4), dtype=torch.float64, seed=3))
    p = 0.4
    qd, kd, vd = to_device([q, k, v], device)
    seed_device(device, 6)
    keep = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        qd.detach(), kd.detach(), vd.detach(), None, p, causal, True)[8]

    def fused(q, k, v):
        seed_device(device, 6)  # the same seed: the same mask as `keep`
        with sdpa_kernel(SDPBackend.OVERRIDEABLE):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)

    def math_backend(q, k, v):
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, None, p, causal, keep.cpu())[0]

    with warnings.catch_warnings():  # "Dropout mask should only be used for testing purposes"
        warnings.simplefilter("ignore", UserWarning)
        expected = second_derivatives(math_backend, [q, k, v])
    for a, b in zip(sum(second_derivatives(fused, [qd, kd, vd]), []), sum(expected, [])):
        torch.testing.assert_close(a, b)


def test_sdpa_first_backward_keeps_the_overrideable_kernel(device):
    # An ordinary backward runs the overrideable backward kernel (here the CPU's flash kernel on
    # the device memory, whose bits test_sdpa_equals_the_cpu_bit_for_bit checks); only a backward
    # that must be differentiable (create_graph=True) computes the gradients with
    # differentiable operators.
    q, k, v = (t.detach().to(device).requires_grad_() for t in
               attention_inputs((2, 3, 5, 8), (2, 3, 7, 8)))
    kernel, differentiable = route_calls("kernel"), route_calls("differentiable")
    ops = profiled_ops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    assert (route_calls("kernel"), route_calls("differentiable")) == (kernel + 1, differentiable)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert "aten::_safe_softmax" not in ops

    out = F.scaled_dot_product_attention(q, k, v)
    ops = profiled_ops(lambda: torch.autograd.grad(out.sum(), (q, k, v), create_graph=True))
    assert (route_calls("kernel"), route_calls("differentiable")) == \
        (kernel + 1, differentiable + 1)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" not in ops
    assert "aten::_safe_softmax" in ops
    # Without create_graph the engine turns grad mode off: the kernel again.
    torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
    assert route_calls("kernel") == kernel + 2



def test_sdpa_third_derivative_equals_the_cpu():
    # The differentiable gradients are ordinary operators: they differentiate again.
    def third(device, backend):
        q, k, v = (t.detach().to(device).requires_grad_() for t in
                   attention_inputs((1, 2, 3, 4), (1, 2, 3, 4), dtype=torch.float64, seed=5))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v)
        gq, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        gk, = torch.autograd.grad(gq.pow(2).sum(), k, create_graph=True)
        return torch.autograd.grad(gk.sum(), v)[0].cpu()

    torch.testing.assert_close(third("openreg", SDPBackend.OVERRIDEABLE),
                               third("cpu", SDPBackend.MATH))


def test_sdpa_backward_operator_carries_forward_mode_tangents(device):
    # The gradients are linear in grad_out: the tangent of the gradients along a tangent t of
    # grad_out is the backward of t. torch's own autograd kernel refuses forward AD here.
    q, k, v = (t.detach().to(device) for t in
               attention_inputs((1, 2, 3, 4), (1, 2, 5, 4), dtype=torch.float64, seed=2))
    out, lse, _, _, _, _, seed, offset, _ = \
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v)
    backward = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward
    args = (q, k, v, None, [True, True, True, False], out, lse, None, None, 3, 5, 0.0, False,
            seed, offset)
    grad_out, tangent = torch.randn_like(out), torch.randn_like(out)
    with torch.autograd.forward_ad.dual_level():
        grads = backward(torch.autograd.forward_ad.make_dual(grad_out, tangent), *args)
        tangents = [torch.autograd.forward_ad.unpack_dual(g).tangent for g in grads[:3]]
    for a, b in zip(tangents, backward(tangent, *args)[:3]):
        torch.testing.assert_close(a, b)


def test_sdpa_double_backward_is_captured_and_dropout_refused():
    def step(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        gq, = torch.autograd.grad(out.sum(), q, create_graph=True)
        gq.pow(2).sum().backward()

    q, k, v = (t.detach().to("openreg").requires_grad_() for t in
               attention_inputs((1, 2, 3, 4), (1, 2, 3, 4)))
    step(q, k, v)
    eager = [t.grad.cpu() for t in (q, k, v)]
    stream, graph = torch.Stream(device="openreg"), torch.accelerator.Graph()
    with stream:  # warm-up on the capturing stream, as the CUDA graphs recipe does
        step(q, k, v)
    for t in (q, k, v):
        t.grad = None
    with stream, graph:
        step(q, k, v)
    graph.replay()
    for t, expected in zip((q, k, v), eager):
        assert torch.equal(t.grad.cpu(), expected)
    with stream, torch.accelerator.Graph():
        with sdpa_kernel(SDPBackend.OVERRIDEABLE):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        with pytest.raises(RuntimeError, match="second derivative of attention with dropout_p > 0"):
            torch.autograd.grad(out.sum(), q, create_graph=True)


def module_gradgradcheck(module, *args, **kwargs):
    """gradgradcheck of a module's output with respect to its float64 inputs and parameters, as
    PyTorch's test_modules.py test_gradgrad does; `kwargs` (masks) are passed as they are. In
    gradcheck's fast mode (random projections), which test_modules uses for nn.Transformer: the
    full mode takes 7 times as long (46 s for an encoder layer on a loaded machine)."""
    names = [name for name, _ in module.named_parameters()]
    params = tuple(p.detach().requires_grad_() for p in module.parameters())

    def fn(*flat):
        return torch.func.functional_call(module, dict(zip(names, flat[len(args):])),
                                          flat[:len(args)], kwargs)

    return torch.autograd.gradgradcheck(fn, tuple(args) + params, fast_mode=True)


def float64_leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, device="openreg", requires_grad=True)


def test_transformer_encoder_layer_double_backward():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, 0.0).to("openreg", torch.float64)
    before = route_calls("differentiable")
    assert module_gradgradcheck(layer, float64_leaf(2, 3, 4))
    assert route_calls("differentiable") > before
    # Unbatched, with an attention mask and a key padding mask (bool), as in test_modules.
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, 0.0, batch_first=True, norm_first=True)
    mask = torch.tensor([False, False, True], device="openreg").expand(3, 3)
    pad = torch.tensor([False, False, True], device="openreg")
    assert module_gradgradcheck(layer.to("openreg", torch.float64), float64_leaf(3, 4),
                                src_mask=mask, src_key_padding_mask=pad)


def test_transformer_decoder_layer_double_backward():
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(4, 2, 8, 0.0, batch_first=True, norm_first=True)
    layer = layer.to("openreg", torch.float64)
    before = route_calls("differentiable")
    assert module_gradgradcheck(layer, float64_leaf(2, 3, 4), float64_leaf(2, 4, 4))
    assert route_calls("differentiable") > before
    causal = torch.nn.Transformer.generate_square_subsequent_mask(3, device="openreg",
                                                                  dtype=torch.float64)
    pad = torch.tensor([[False, False, False, True]] * 2, device="openreg")
    assert module_gradgradcheck(layer, float64_leaf(2, 3, 4), float64_leaf(2, 4, 4),
                                tgt_mask=causal, memory_key_padding_mask=pad)


def test_transformer_double_backward():
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=4, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=8, dropout=0.0, batch_first=True)
    model = model.to("openreg", torch.float64)
    before = route_calls("differentiable")
    assert module_gradgradcheck(model, float64_leaf(1, 3, 4), float64_leaf(1, 2, 4))
    assert route_calls("differentiable") > before


def test_sdpa_errors():
    q = torch.randn(1, 2, 3, 4, device="openreg:0")
    op = torch.ops.aten._scaled_dot_product_fused_attention_overrideable
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        op(q, q.to("openreg:1"), q)
    with pytest.raises(RuntimeError, match="same device"):
        op(q, q.cpu(), q)
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
        op(q, q, q, torch.zeros(3, 3, device="openreg"), 0.0, True)
    with pytest.raises(RuntimeError, match="dropout_p"):
        op(q, q, q, None, 1.5)


def test_multihead_attention_uses_the_fused_kernel(device):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    mha_d = torch.nn.MultiheadAttention(16, 4, batch_first=True).to(device)
    mha_d.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    y, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    xd = x.to(device)
    ops = profiled_ops(lambda: mha_d(xd, xd, xd, key_padding_mask=pad.to(device),
                                     need_weights=False))
    assert "aten::_scaled_dot_product_fused_attention_overrideable" in ops
    yd, _ = mha_d(xd, xd, xd, key_padding_mask=pad.to(device), need_weights=False)
    torch.testing.assert_close(yd.cpu(), y)
    assert math.isfinite(yd.sum().item())
