"""Autocast on openreg: the AutocastPrivateUse1 policies, the autocast API, and GradScaler."""

import warnings

import pytest
import torch
import torch.nn.functional as F

LOW = [torch.float16, torch.bfloat16]


def rand(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).to(device)


# --- the API torch asks the device module for --------------------------------------------------


def test_amp_supported_dtypes_and_default_dtype():
    assert torch.openreg.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    assert torch.amp.is_autocast_available("openreg")
    assert torch.get_autocast_dtype("openreg") == torch.float16


def test_unsupported_dtype_warns_and_disables_autocast(device):
    a = rand(4, 4, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("openreg", dtype=torch.float64):
            assert not torch.is_autocast_enabled("openreg")
            assert (a @ a).dtype == torch.float32
    assert any("openreg Autocast only supports" in str(w.message) for w in caught)


# --- cast policies ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW)
def test_matmul_conv_linear_run_in_low_precision(device, dtype):
    a, b = rand(8, 8, device=device), rand(8, 8, device=device)
    img, w = rand(2, 3, 8, 8, device=device), rand(4, 3, 3, 3, device=device)
    with torch.autocast("openreg", dtype=dtype):
        results = {
            "mm": torch.mm(a, b),
            "matmul": a @ b,
            "linear": F.linear(a, b, b[0]),
            "addmm": torch.addmm(b[0], a, b),
            "bmm": torch.bmm(a[None], b[None]),
            "conv2d": F.conv2d(img, w),
            "einsum": torch.einsum("ij,jk->ik", a, b),
        }
    for name, out in results.items():
        assert out.dtype == dtype, name
        assert out.device == device, name
    # The low-precision result is the low-precision computation, not a float32 one cast afterwards.
    torch.testing.assert_close(results["mm"].cpu(), a.cpu().to(dtype) @ b.cpu().to(dtype))


@pytest.mark.parametrize("dtype", LOW)
def test_reductions_softmax_norms_and_losses_run_in_float32(device, dtype):
    x = rand(4, 10, device=device).to(dtype)  # already low precision: autocast must widen it
    target = torch.randint(0, 10, (4,)).to(device)
    with torch.autocast("openreg", dtype=dtype):
        results = {
            "softmax": torch.softmax(x, 1),
            "log_softmax": F.log_softmax(x, 1),
            "sum": x.sum(),
            "cumsum": x.cumsum(1),
            "exp": torch.exp(x),
            "layer_norm": F.layer_norm(x, (10,)),
            "mse_loss": F.mse_loss(x, x.flip(0)),
            "cross_entropy": F.cross_entropy(x, target),
            "bce_with_logits": F.binary_cross_entropy_with_logits(x, torch.sigmoid(x)),
            "norm": torch.norm(x),
        }
    for name, out in results.items():
        assert out.dtype == torch.float32, name
    torch.testing.assert_close(results["softmax"].cpu(), torch.softmax(x.cpu().float(), 1))


def test_ops_without_policy_keep_their_dtype(device):
    x = rand(4, 4, device=device)
    with torch.autocast("openreg"):
        assert torch.relu(x).dtype == torch.float32
        assert (x + 1).dtype == torch.float32
        assert torch.relu(x.half()).dtype == torch.float16


def test_promote_policy_uses_the_widest_input(device):
    a32, a16 = rand(4, device=device), rand(4, device=device).half()
    with torch.autocast("openreg"):
        assert torch.cat([a16, a32]).dtype == torch.float32
        assert torch.stack([a16, a32]).dtype == torch.float32
        assert torch.addcmul(a32, a16, a16).dtype == torch.float32
        assert torch.cat([a16, a16]).dtype == torch.float16


def test_binary_cross_entropy_is_refused_like_on_cuda(device):
    p = torch.rand(4, 3).to(device)
    with torch.autocast("openreg"):
        with pytest.raises(RuntimeError, match="unsafe to autocast.*binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, p)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.BCELoss()(p, p)
    # Outside autocast it is an ordinary op.
    expected = F.binary_cross_entropy(p.cpu(), p.cpu())
    torch.testing.assert_close(F.binary_cross_entropy(p, p).cpu(), expected)


def test_only_openreg_tensors_are_cast(device):
    a_cpu = torch.randn(4, 4)
    with torch.autocast("openreg"):
        assert (a_cpu @ a_cpu).dtype == torch.float32  # CPU autocast is a different switch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = rand(4, 4, device=device)
        assert (a @ a).dtype == torch.float32  # and it does not touch openreg tensors


# --- enabled, nesting, cache --------------------------------------------------------------------


def test_enabled_flag_and_nesting(device):
    a = rand(4, 4, device=device)
    with torch.autocast("openreg", enabled=False):
        assert (a @ a).dtype == torch.float32
    with torch.autocast("openreg"):
        assert torch.is_autocast_enabled("openreg")
        with torch.autocast("openreg", enabled=False):
            assert (a @ a).dtype == torch.float32
        with torch.autocast("openreg", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16
        assert (a @ a).dtype == torch.float16  # the outer region is restored
    assert not torch.is_autocast_enabled("openreg")
    assert (a @ a).dtype == torch.float32


def test_autocast_state_is_restored_after_an_exception(device):
    with pytest.raises(ValueError):
        with torch.autocast("openreg", dtype=torch.bfloat16):
            raise ValueError("boom")
    assert not torch.is_autocast_enabled("openreg")
    assert torch.get_autocast_dtype("openreg") == torch.float16


def test_device_bound_autocast_class(device):
    a = rand(4, 4, device=device)
    with torch.openreg.amp.autocast(dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16


def _memory_held_during_region(device, cache_enabled):
    """Bytes still allocated inside an autocast region after one linear layer ran on a leaf weight."""
    torch.openreg.synchronize(device)
    layer = torch.nn.Linear(1024, 1024, bias=False).to(device)
    x = rand(1, 1024, device=device)
    before = torch.openreg.memory_allocated(device)
    with torch.autocast("openreg", cache_enabled=cache_enabled):
        y = layer(x)
        held = torch.openreg.memory_allocated(device) - before - y.untyped_storage().nbytes()
    after = torch.openreg.memory_allocated(device) - before - y.untyped_storage().nbytes()
    return held, after


def test_cache_keeps_the_low_precision_weight_for_the_region_only(device):
    weight_fp16_bytes = 1024 * 1024 * 2
    held, after = _memory_held_during_region(device, cache_enabled=True)
    assert held >= weight_fp16_bytes  # the cast weight is cached while the region lasts
    assert after < weight_fp16_bytes  # and released when the outermost region exits
    held, after = _memory_held_during_region(device, cache_enabled=False)
    assert held < weight_fp16_bytes  # without the cache, the cast copy dies with the op


# --- autograd under autocast --------------------------------------------------------------------


def test_gradients_come_back_in_the_parameter_dtype(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model_dev = torch.nn.Sequential(*[m for m in model]).to(device)
    x = rand(5, 8, device=device)
    with torch.autocast("openreg"):
        out = model_dev(x)
        assert out.dtype == torch.float16
        loss = F.cross_entropy(out, torch.tensor([0, 1, 2, 0, 1]).to(device))
    assert loss.dtype == torch.float32
    loss.backward()
    for p in model_dev.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.device == device


def test_custom_fwd_casts_inputs_for_openreg(device):
    class Square(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="openreg", cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type="openreg")
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = rand(4, device=device).half().requires_grad_()
    with torch.autocast("openreg"):
        y = Square.apply(x)
    assert y.dtype == torch.float32  # cast_inputs ran forward in float32 with autocast off
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), (2 * x.detach().float()).half().cpu())


# --- GradScaler ---------------------------------------------------------------------------------


def _train_mixed_precision(device_type, device, steps=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen)
    y = torch.randint(0, 4, (64,), generator=gen)
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0**14, growth_interval=4)
    losses, scales = [], []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device_type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, scaler


def test_grad_scaler_trains_and_matches_cpu_autocast(device):
    losses, scales, scaler = _train_mixed_precision("openreg", device)
    cpu_losses, cpu_scales, _ = _train_mixed_precision("cpu", torch.device("cpu"))
    assert losses[-1] < 0.8 * losses[0], losses
    torch.testing.assert_close(losses, cpu_losses, rtol=2e-2, atol=2e-3)
    assert scales == cpu_scales
    assert scales[-1] > 2.0**14  # it grew after growth_interval clean steps
    assert scaler._scale.device == device  # the scale lives (and is updated) on the device


def test_grad_scaler_skips_the_step_and_backs_off_on_inf(device):
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("openreg", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("openreg"):
        loss = model(rand(3, 4, device=device)).float().sum()
    scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach().cpu(), b.cpu(), rtol=0, atol=0)  # the step was skipped
    found_inf = scaler._found_inf_per_device(opt) if hasattr(scaler, "_found_inf_per_device") else None
    if found_inf is not None:
        for t in found_inf.values():
            assert t.device == device


def test_unscale_happens_on_the_device(device):
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.openreg.amp.GradScaler(init_scale=8.0)
    scaler.scale(model(rand(3, 4, device=device)).sum()).backward()
    scaled = model.weight.grad.detach().clone()
    scaler.unscale_(opt)
    torch.testing.assert_close(model.weight.grad.cpu(), scaled.cpu() / 8.0)
    assert model.weight.grad.device == device
