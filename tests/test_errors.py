"""Bad input raises the exception PyTorch raises for CUDA in the same case, with a message naming
the problem: device index out of range, tensors on two devices in one operator, `.numpy()` on a
device tensor, a dtype the CPU kernel does not support. Nothing crashes the process."""
import os
import subprocess
import sys

import warnings

import pytest
import torch
import torch.nn.functional as F

SAME_DEVICE = "Expected all tensors to be on the same device"


# ---- device index out of range: torch.AcceleratorError, as CUDA's "invalid device ordinal" ----

@pytest.mark.parametrize("call", [
    lambda: torch.ones(1, device="openreg:7"),
    lambda: torch.empty(2, 3, device="openreg:2"),
    lambda: torch.openreg.set_device(5),
    lambda: torch.accelerator.set_device_index(2),
    lambda: torch.ones(1).to("openreg:2"),
    lambda: torch.ones(1, device="openreg:0").to("openreg:2"),
    lambda: torch.zeros(2, device="openreg:1").new_ones(2, device="openreg:3"),
    lambda: torch.openreg.device(3).__enter__(),
    lambda: torch.openreg.manual_seed_all(0) or torch.openreg.get_rng_state(2),
], ids=["factory", "empty", "set_device", "accelerator", "h2d", "d2d", "new_ones", "context",
        "rng_state"])
def test_device_index_out_of_range(call):
    before = torch.openreg.current_device()
    with pytest.raises(torch.AcceleratorError, match="(?i)device index is out of range"):
        call()
    assert issubclass(torch.AcceleratorError, RuntimeError)
    assert torch.openreg.current_device() == before  # nothing half-changed
    assert torch.ones(1, device="openreg").device.index == before


def test_out_of_range_message_names_index_and_count():
    with pytest.raises(torch.AcceleratorError) as info:
        torch.ones(1, device="openreg:7")
    assert "got 7" in str(info.value) and "2 devices" in str(info.value)


# ---- two devices in one operator: RuntimeError "Expected all tensors to be on the same device" ----

def test_binary_op_with_cpu_tensor(device):
    x = torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match=SAME_DEVICE) as info:
        x + torch.ones(3)
    assert "cpu" in str(info.value) and str(device) in str(info.value)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.ones(3) * x
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.mm(torch.ones(2, 2, device=device), torch.ones(2, 2))


def test_two_openreg_devices():
    a = torch.ones(3, device="openreg:0")
    b = torch.ones(3, device="openreg:1")
    with pytest.raises(RuntimeError, match=SAME_DEVICE) as info:
        a + b
    assert "openreg:0" in str(info.value) and "openreg:1" in str(info.value)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.cat([a, b])
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.where(a > 0, a, b)


def test_in_place_and_out_across_devices(device):
    other = "openreg:1" if str(device) == "openreg:0" else "openreg:0"
    x = torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x.add_(torch.ones(3))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x.add_(torch.ones(3, device=other))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.add(x, x, out=torch.empty(3))  # out= on the CPU
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.add(x, x, out=torch.empty(3, device=other))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.ones(3).add_(x)  # CPU tensor written with a device operand
    assert torch.equal(x.cpu(), torch.ones(3))  # the failed calls wrote nothing


def test_zero_dim_cpu_tensor_is_a_scalar_like_on_cuda(device):
    x = torch.arange(4.0, device=device)
    s = torch.tensor(2.5)
    assert (x * s).device == x.device
    torch.testing.assert_close((x * s).cpu(), torch.arange(4.0) * s)
    torch.testing.assert_close(torch.add(x, s, alpha=2).cpu(), torch.add(torch.arange(4.0), s, alpha=2))
    y = x.clone()
    y.mul_(s)
    torch.testing.assert_close(y.cpu(), torch.arange(4.0) * 2.5)
    # Written 0-dim CPU tensors are not scalars: they would be written on the wrong device.
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.sum(x, 0, out=torch.tensor(0.0))


def test_index_with_cpu_indices_is_allowed_like_on_cuda(device):
    x = torch.arange(5.0, device=device)
    idx = torch.tensor([4, 0])
    torch.testing.assert_close(x[idx].cpu(), torch.tensor([4.0, 0.0]))
    x[idx] = torch.tensor([9.0, 8.0], device=device)
    torch.testing.assert_close(x.cpu(), torch.tensor([8.0, 1.0, 2.0, 3.0, 9.0]))


# ---- .numpy() ----

def test_numpy_on_a_device_tensor_raises_type_error(device):
    x = torch.ones(2, device=device)
    with pytest.raises(TypeError, match=f"can't convert {device} device type tensor to numpy"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [1.0, 1.0]


# ---- errors of CPU kernels: the CPU's exception type and message, unchanged ----

ASYNC_ERROR = "openreg: asynchronous error on stream"


def on_the_data(call):
    """Marks a bad input that a kernel can only find in the values of its tensors (an index out
    of range, a division by zero). In the asynchronous kernel mode (OPENREG_ASYNC=1,
    docs/async_mode.md) such an error is raised at the call only by the first call of the
    operator with that signature (dtypes, shapes, ...); otherwise the kernel was queued, and the
    error is reported at the next synchronization, as a GPU reports a device-side error."""
    call.on_the_data = True
    return call


def raised(call, device):
    """(type, message) of what ``call(device)`` raises, or None if it returns. For an error found
    on the data in the asynchronous kernel mode, the next synchronization is part of the call."""
    try:
        call(device)
        if getattr(call, "on_the_data", False) and str(device) != "cpu":
            torch.openreg.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any exception is compared
        return type(e), str(e)
    return None


def assert_same_error(call, device):
    """``call`` fails on the CPU and on ``device`` with the same exception type and message (an
    error found on the data may be reported asynchronously, with the CPU's message, in the
    asynchronous kernel mode)."""
    on_cpu = raised(call, "cpu")
    assert on_cpu is not None, "the CPU accepted the input: not a bad input"
    on_device = raised(call, device)
    assert on_device is not None, f"openreg accepted what the CPU refuses: {on_cpu}"
    if on_device[1].startswith(ASYNC_ERROR) and getattr(call, "on_the_data", False):
        assert torch.openreg.is_async(), on_device
        assert on_device[0] is RuntimeError and on_cpu[1] in on_device[1], (on_device, on_cpu)
        return
    assert on_device == on_cpu


@pytest.mark.parametrize("call", [
    lambda d: torch.ones(3, dtype=torch.complex64, device=d).cummax(0),
    lambda d: torch.clamp(torch.ones(3, dtype=torch.complex64, device=d), 0, 1),
    lambda d: torch.ones(3, device=d) & torch.ones(3, device=d),
    lambda d: -torch.ones(3, dtype=torch.bool, device=d),
    lambda d: torch.ones(2, 2, dtype=torch.int64, device=d).inverse(),
    lambda d: torch.ones(2, 3, device=d) @ torch.ones(4, 5, device=d),
    on_the_data(lambda d: torch.ones(3, device=d)[torch.tensor([5], device=d)]),
    lambda d: torch.ones(3, device=d).narrow_copy(-5, 0, 1),
    lambda d: torch.ones(3, device=d).narrow_copy(0, 2, 5),
    lambda d: torch.ones(2, 3, device=d).sum(dim=4),
    lambda d: torch.cat([torch.ones(2, 3, device=d), torch.ones(2, 4, device=d)]),
    lambda d: torch.ones(3, device=d).gather(0, torch.tensor([[0]], device=d)),
    on_the_data(lambda d: torch.ones(3, device=d).scatter_(0, torch.tensor([7], device=d), 1.0)),
    lambda d: torch.ones(2, 2, device=d).reshape(3),
    lambda d: torch.ones(3, device=d).softmax(dim=2),
    on_the_data(lambda d: torch.nn.functional.cross_entropy(torch.ones(2, 3, device=d),
                                                            torch.tensor([0, 5], device=d))),
    lambda d: torch.ones(3, device=d).add_(torch.ones(2, 3, device=d)),
    on_the_data(lambda d: torch.arange(3, device=d) // 0),
    lambda d: torch.ones(3, dtype=torch.complex32, device=d) ** 2,
    lambda d: torch.ones(3, device=d).to(torch.int64).lerp(torch.ones(3, device=d), 0.5),
    lambda d: torch.ones(3, device=d).topk(5),
    lambda d: torch.ones(2, 3, device=d).view(4),
    on_the_data(lambda d: torch.multinomial(torch.zeros(3, device=d), 1)),
], ids=["cummax-complex", "clamp-complex", "bitwise-and-float", "neg-bool", "inverse-int",
        "mm-shapes", "index-out-of-bounds", "narrow_copy-dim", "narrow_copy-length", "sum-dim",
        "cat-sizes", "gather-dims", "scatter-index", "reshape", "softmax-dim", "cross-entropy-target",
        "add_-broadcast", "int-div-zero", "pow-complexhalf", "lerp-dtype", "topk-k", "view",
        "multinomial-zeros"])
def test_cpu_kernel_errors_are_the_cpus_unchanged(call, device):
    assert_same_error(call, device)


# ---- where openreg behaves like the CPU rather than like CUDA (docs/fallback.md) ----

def test_integer_division_by_zero_raises_like_the_cpu(device):
    # CUDA returns -1 (all bits set) for integer division by zero; the CPU kernels openreg runs
    # raise, and so does openreg.
    for op in (torch.div, torch.floor_divide, torch.remainder, torch.fmod):
        kwargs = {"rounding_mode": "trunc"} if op is torch.div else {}
        call = on_the_data(lambda d: op(torch.arange(3, device=d),
                                        torch.zeros(3, dtype=torch.int64, device=d), **kwargs))
        assert raised(call, "cpu") == (RuntimeError, "ZeroDivisionError")
        assert_same_error(call, device)
    # Float division by zero follows IEEE on every device.
    assert torch.isinf((torch.ones(1, device=device) / 0).cpu()).all()


def test_pow_on_complexhalf_is_refused_like_the_cpu(device):
    # The supported dtypes are those of the CPU kernels: CUDA has a ComplexHalf pow, the CPU has
    # not, and openreg refuses it with the CPU's message.
    x = torch.ones(3, dtype=torch.complex32, device=device)
    with pytest.raises(NotImplementedError, match="^\"pow\" not implemented for 'ComplexHalf'$"):
        x ** 2
    with pytest.raises(NotImplementedError, match="^\"pow\" not implemented for 'ComplexHalf'$"):
        torch.pow(x, x)


def test_foreach_error_is_the_per_tensor_operators():
    # PyTorch's foreach tests check that a foreach operator fails with exactly the message of the
    # per-tensor operator: true on the CPU, and so on openreg.
    def tensors(d):
        return ([torch.ones(2, 3, device=d)], [torch.ones(2, 3, device=d)],
                [torch.ones(4, device=d)])
    for d in ["cpu", "openreg"]:
        with pytest.raises(RuntimeError) as per_tensor:
            torch.addcmul(*(ts[0] for ts in tensors(d)))
        with pytest.raises(RuntimeError) as foreach:
            torch._foreach_addcmul(*tensors(d))
        with pytest.raises(RuntimeError) as foreach_:
            torch._foreach_addcmul_(*tensors(d))
        assert str(foreach.value) == str(per_tensor.value)
        assert str(foreach_.value) == str(per_tensor.value)
        assert "must match the size of tensor" in str(per_tensor.value)
    assert_same_error(lambda d: torch._foreach_addcmul(*tensors(d)), "openreg")


def test_error_context_on_request():
    code = """
import torch
try:
    torch.ones(2, 3, device="openreg:1") @ torch.ones(4, 5, device="openreg:1")
except RuntimeError as e:
    print(e)
"""
    def run(env):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    with pytest.raises(RuntimeError) as on_cpu:  # its wording varies between torch releases
        torch.ones(2, 3) @ torch.ones(4, 5)
    cpu = str(on_cpu.value)
    assert "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)" in cpu
    assert run({"OPENREG_ERROR_CONTEXT": "1"}) == (
        f"{cpu} (while running aten::mm on openreg:1 with its CPU kernel)")
    assert run({"OPENREG_ERROR_CONTEXT": "0"}) == cpu


def test_unsupported_layout_result_fails_clearly(device):
    # Sparse and nested layouts are supported (docs/layouts.md); MKLDNN tensors are not.
    with pytest.raises(NotImplementedError, match="openreg supports only strided tensors"):
        torch.eye(3, device=device).to_mkldnn()


# ---- nothing crashes ----

def test_bad_calls_do_not_crash_the_process():
    code = """
import torch
calls = [
    lambda: torch.ones(1, device='openreg:9'),
    lambda: torch.ones(2, device='openreg:0') + torch.ones(2, device='openreg:1'),
    lambda: torch.ones(2, device='openreg').numpy(),
    lambda: torch.ones(3, device='openreg')[10],
    lambda: torch.ones(3, device='openreg').view(2, 2),
    lambda: torch.ones(2, 3, device='openreg') @ torch.ones(2, 3, device='openreg'),
    lambda: torch.ones(3, dtype=torch.complex64, device='openreg').cummax(0),
    lambda: torch.empty(-1, device='openreg'),
    lambda: torch.ones(3, device='openreg').expand(2, 3).add_(1),
    lambda: (lambda x: x[1:].copy_(x[:-1]))(torch.ones(4, device='openreg')),
    lambda: torch.eye(2, device='openreg').to_mkldnn(),
    lambda: torch.ones(2, device='openreg').item(),
]
for c in calls:
    try:
        c()
    except Exception as e:
        print(type(e).__name__)
print('alive')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "alive"
    assert len(r.stdout.split()) == 13  # every call raised


# ---- the operators openreg implements itself: every bad input refused as on the CPU ----
# Each entry runs on the CPU and on openreg; both must raise the same type and message. `o(d)` is
# the device of the other side of a copy: the CPU for both when d is the CPU.

def _t(*shape, d, **kw):
    return torch.randn(*shape, device=d, **kw)


def _other(d, kind):
    """The other side of a copy: 'same' device, 'cpu', 'pinned' host memory, 'peer' device."""
    if d == "cpu":
        return "cpu"
    return {"same": d, "cpu": "cpu", "pinned": "cpu", "peer": "openreg:1"}[kind]


def _src(shape, d, kind):
    t = torch.ones(*shape, device=_other(d, kind))
    return t.pin_memory() if kind == "pinned" and d != "cpu" else t


FACTORIES = {
    "empty-negative": lambda d: torch.empty(2, -3, device=d),
    "empty_strided-negative": lambda d: torch.empty_strided((2, -3), (1, 1), device=d),
    "empty_strided-lengths": lambda d: torch.empty_strided((2, 3), (1,), device=d),
    "empty_strided-overflow": lambda d: torch.empty_strided((2, 3), (1, -1), device=d),
    "empty-preserve_format": lambda d: torch.empty(2, 3, device=d,
                                                   memory_format=torch.preserve_format),
    "empty-channels_last-2d": lambda d: torch.empty(2, 3, device=d,
                                                    memory_format=torch.channels_last),
}

VIEWS = {
    "as_strided-size": lambda d: _t(6, d=d).as_strided((-1,), (1,)),
    "as_strided-stride": lambda d: _t(6, d=d).as_strided((2,), (-1,)),
    "as_strided-lengths": lambda d: _t(6, d=d).as_strided((2, 3), (1,)),
    "as_strided-bounds": lambda d: _t(6, d=d).as_strided((2, 3), (3, 1), 1),
    "as_strided-offset": lambda d: _t(3, d=d).as_strided((2,), (1,), -1),
    "view-size": lambda d: _t(3, d=d).view(2, 2),
    "view-negative": lambda d: _t(6, d=d).view(-2, 3),
    "view-two-inferred": lambda d: _t(6, d=d).view(-1, -1),
    "view-strides": lambda d: _t(2, 3, d=d).t().view(6),
    "view-dtype-size": lambda d: _t(5, d=d).view(torch.float64),
    "view-dtype-strides": lambda d: _t(4, 4, d=d).t().view(torch.float64),
    "unfold-size": lambda d: _t(6, d=d).unfold(0, 8, 1),
    "unfold-step": lambda d: _t(6, d=d).unfold(0, 2, 0),
    "expand": lambda d: _t(2, 3, d=d).expand(3, 3),
    "transpose-dim": lambda d: _t(2, 3, d=d).transpose(0, 3),
    "diagonal-dims": lambda d: _t(2, 3, d=d).diagonal(0, 0, 0),
    "select-index": lambda d: _t(2, 3, d=d).select(0, 5),
    "slice-negative-step": lambda d: _t(6, d=d)[::-1],
    "view_as_complex": lambda d: torch.view_as_complex(_t(6, d=d)),
    "view_as_real": lambda d: torch.view_as_real(_t(6, d=d)),
    "narrow_copy-dim": lambda d: _t(3, d=d).narrow_copy(-2, 0, 1),
    "narrow_copy-length": lambda d: _t(3, d=d).narrow_copy(0, 2, 5),
}

SET_AND_RESIZE = {
    "set_-offset": lambda d: _t(3, d=d).set_(_t(3, d=d).untyped_storage(), -1, (2,), (1,)),
    "set_-stride-overflow": lambda d: _t(3, d=d).set_(_t(3, d=d).untyped_storage(), 0, (2,), (-1,)),
    "set_-lengths": lambda d: _t(3, d=d).set_(_t(3, d=d).untyped_storage(), 0, (2, 2), (1,)),
    "set_-dtype": lambda d: _t(3, d=d).set_(torch.ones(3, device=d, dtype=torch.float64)),
    "set_-requires-grad": lambda d: _t(3, d=d, requires_grad=True).set_(_t(3, d=d)),
    "resize_-negative": lambda d: _t(3, d=d).resize_(-2),
    "resize_-overflow": lambda d: _t(3, d=d).resize_(-1),
    "resize_-preserve_format": lambda d: _t(3, d=d).resize_(2, 3, 4, 5,
                                                            memory_format=torch.preserve_format),
    "resize_-channels_last-2d": lambda d: _t(3, d=d).resize_(2, 3,
                                                             memory_format=torch.channels_last),
    "resize_-requires-grad": lambda d: _t(3, d=d, requires_grad=True).resize_(5),
    "item-numel": lambda d: _t(2, d=d).item(),
    "item-empty": lambda d: _t(0, d=d).item(),
}

COPIES = {}
for _kind in ["same", "cpu", "pinned", "peer"]:
    for _nb in [False, True]:
        _name = f"{_kind}{'-non_blocking' if _nb else ''}"
        COPIES.update({
            # openreg destination
            f"to-empty-from-{_name}": lambda d, k=_kind, nb=_nb: torch.empty(0, device=d).copy_(
                _src((5,), d, k), non_blocking=nb),
            f"to-empty-2d-from-{_name}": lambda d, k=_kind, nb=_nb: torch.empty(
                0, 3, device=d).copy_(_src((2, 3), d, k), non_blocking=nb),
            f"to-smaller-from-{_name}": lambda d, k=_kind, nb=_nb: torch.empty(3, device=d).copy_(
                _src((2, 3), d, k), non_blocking=nb),
            f"to-0dim-from-{_name}": lambda d, k=_kind, nb=_nb: torch.empty((), device=d).copy_(
                _src((2,), d, k), non_blocking=nb),
            f"to-expanded-from-{_name}": lambda d, k=_kind, nb=_nb: torch.empty(
                3, device=d).expand(2, 3).copy_(_src((2, 3), d, k), non_blocking=nb),
            # openreg source
            f"from-empty-to-{_name}": lambda d, k=_kind, nb=_nb: _src((0,), d, k).copy_(
                torch.ones(5, device=d), non_blocking=nb),
            f"from-larger-to-{_name}": lambda d, k=_kind, nb=_nb: _src((3,), d, k).copy_(
                torch.ones(2, 3, device=d), non_blocking=nb),
        })
COPIES.update({
    "overlapping-views": lambda d: (lambda x: x[1:].copy_(x[:-1]))(_t(4, d=d)),
    "from-meta": lambda d: _t(4, d=d).copy_(torch.empty(4, device="meta")),
})

CONVOLUTION = {
    "channels": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 2, 3, 3, d=d)),
    "input-dims": lambda d: F.conv2d(_t(3, 5, d=d), _t(4, 3, 3, 3, d=d)),
    "kernel-too-large": lambda d: F.conv2d(_t(1, 3, 2, 2, d=d), _t(4, 3, 3, 3, d=d)),
    "stride-0": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d), stride=0),
    "negative-padding": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d), padding=-1),
    "groups": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d), groups=2),
    "bias-size": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d), bias=_t(3, d=d)),
    "dtypes": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d, dtype=torch.float64)),
    "dilation-0": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d), dilation=0),
    "transposed-groups": lambda d: F.conv_transpose2d(_t(1, 3, 5, 5, d=d), _t(3, 4, 3, 3, d=d),
                                                      groups=2),
    "transposed-output_padding": lambda d: F.conv_transpose2d(
        _t(1, 3, 5, 5, d=d), _t(3, 4, 3, 3, d=d), output_padding=2),
    "weight-dims": lambda d: F.conv3d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, 3, d=d)),
    "same-padding-strided": lambda d: F.conv2d(_t(1, 3, 5, 5, d=d), _t(4, 3, 3, 3, d=d),
                                               padding="same", stride=2),
}

RNN_CELLS = {
    "lstm-input-size": lambda d: torch.nn.LSTMCell(3, 4).to(d)(_t(2, 5, d=d)),
    "lstm-hidden-batch": lambda d: torch.nn.LSTMCell(3, 4).to(d)(
        _t(2, 3, d=d), (_t(3, 4, d=d), _t(3, 4, d=d))),
    "gru-hidden-size": lambda d: torch.nn.GRUCell(3, 4).to(d)(_t(2, 3, d=d), _t(2, 5, d=d)),
    "rnn-input-size": lambda d: torch.nn.RNNCell(3, 4).to(d)(_t(2, 5, d=d)),
    "lstm-sequence-size": lambda d: torch.nn.LSTM(3, 4).to(d)(_t(5, 2, 4, d=d)),
    "gru-sequence-dims": lambda d: torch.nn.GRU(3, 4).to(d)(_t(5, 2, 3, 1, d=d)),
}

ATTENTION = {
    "head-dims": lambda d: F.scaled_dot_product_attention(_t(2, 4, 5, 8, d=d), _t(2, 4, 6, 7, d=d),
                                                          _t(2, 4, 6, 8, d=d)),
    "dtypes": lambda d: F.scaled_dot_product_attention(
        _t(2, 4, 5, 8, d=d), _t(2, 4, 6, 8, d=d, dtype=torch.float64), _t(2, 4, 6, 8, d=d)),
    "mask-dtype": lambda d: F.scaled_dot_product_attention(
        _t(2, 4, 5, 8, d=d), _t(2, 4, 6, 8, d=d), _t(2, 4, 6, 8, d=d),
        attn_mask=torch.ones(5, 6, dtype=torch.int64, device=d)),
    "1-d": lambda d: F.scaled_dot_product_attention(_t(8, d=d), _t(8, d=d), _t(8, d=d)),
    "dropout_p": lambda d: F.scaled_dot_product_attention(
        _t(2, 4, 5, 8, d=d), _t(2, 4, 6, 8, d=d), _t(2, 4, 6, 8, d=d), dropout_p=1.5),
    "heads-without-gqa": lambda d: F.scaled_dot_product_attention(
        _t(2, 4, 5, 8, d=d), _t(2, 3, 6, 8, d=d), _t(2, 3, 6, 8, d=d)),
    "heads-gqa": lambda d: F.scaled_dot_product_attention(
        _t(2, 4, 5, 8, d=d), _t(2, 3, 6, 8, d=d), _t(2, 3, 6, 8, d=d), enable_gqa=True),
    "integer": lambda d: F.scaled_dot_product_attention(*(torch.ones(
        2, 4, 5, 8, device=d, dtype=torch.long) for _ in range(3))),
    "multihead-kdim": lambda d: torch.nn.MultiheadAttention(8, 2).to(d)(
        _t(5, 2, 8, d=d), _t(6, 2, 7, d=d), _t(6, 2, 8, d=d)),
}

DROPOUT = {
    "p": lambda d: F.dropout(_t(5, d=d), p=1.5),
    "p-negative": lambda d: F.dropout(_t(5, d=d), p=-0.1),
    "native_dropout-p": lambda d: torch.native_dropout(_t(5, d=d), 1.5, True),
    "dropout2d-p": lambda d: F.dropout2d(_t(2, 3, 4, d=d), 1.5),
    "alpha_dropout-p": lambda d: F.alpha_dropout(_t(5, d=d), 1.5),
}

ROUTES = {  # the operators of csrc/routes/ (mse_loss, abs, nonzero, fill_, zero_)
    "mse_loss-shapes": lambda d: F.mse_loss(_t(3, d=d), _t(4, d=d)),
    "mse_loss-reduction": lambda d: F.mse_loss(_t(3, d=d), _t(3, d=d), reduction="foo"),
    "abs-bool": lambda d: torch.abs(torch.ones(3, device=d, dtype=torch.bool)),
    "abs-out-dtype": lambda d: torch.abs(_t(3, d=d), out=torch.empty(3, device=d, dtype=torch.long)),
    "abs_-complex": lambda d: torch.ones(3, dtype=torch.complex64, device=d).abs_(),
    "nonzero-out-dtype": lambda d: torch.nonzero(_t(3, d=d), out=torch.empty(3, device=d)),
    "fill_-value-dims": lambda d: _t(3, d=d).fill_(_t(2, d=d)),
    "fill_-expanded-tensor-value": lambda d: _t(3, d=d).expand(2, 3).fill_(torch.tensor(2.0)),
    "fill_-expanded-device-value": lambda d: _t(3, d=d).expand(2, 3).fill_(_t(d=d)),
    "fill_-bool-overflow": lambda d: torch.ones(3, dtype=torch.int8, device=d).fill_(1000),
}

FAMILIES = {"factory": FACTORIES, "view": VIEWS, "set_resize": SET_AND_RESIZE, "copy": COPIES,
            "convolution": CONVOLUTION, "rnn": RNN_CELLS, "attention": ATTENTION,
            "dropout": DROPOUT, "routes": ROUTES}
BAD_INPUTS = [pytest.param(call, id=f"{family}-{name}")
              for family, calls in FAMILIES.items() for name, call in calls.items()]


@pytest.mark.parametrize("call", BAD_INPUTS)
def test_native_operators_refuse_what_the_cpu_refuses(call):
    assert_same_error(call, "openreg:0")


def test_set_storage_of_another_device_is_refused_like_on_cuda():
    x = torch.ones(3, device="openreg:0")
    for other in [torch.ones(3), torch.ones(3, device="openreg:1")]:
        with pytest.raises(RuntimeError, match="^Attempted to set the storage of a tensor on device "
                           f"\"openreg:0\" to a storage on different device \"{other.device}\""):
            x.set_(other.untyped_storage(), 0, (3,), (1,))
    assert x.untyped_storage().device == torch.device("openreg:0")


def test_native_dropout_matches_the_cpu_kernel():
    for d in ["cpu", "openreg"]:
        e = torch.randn(0, device=d)
        out, mask = torch.native_dropout(e, 0.5, True)
        assert out is e and mask.dtype == torch.float32  # the CPU returns an empty input itself
        x = torch.randn(2, 3, 4, 5, device=d).to(memory_format=torch.channels_last)
        out, mask = torch.native_dropout(x, 0.5, True)
        assert mask.dtype == torch.bool and mask.stride() == x.stride() == out.stride()


def test_deterministic_mode_fills_new_memory_like_the_cpu(device):
    torch.use_deterministic_algorithms(True)
    try:
        for make in [lambda d: torch.empty(3, device=d),
                     lambda d: torch.empty(3, dtype=torch.int32, device=d),
                     lambda d: torch.empty_strided((2, 2), (1, 2), device=d),
                     lambda d: torch.empty(2, device=d).resize_(5)]:
            torch.testing.assert_close(make(device).cpu(), make("cpu"), equal_nan=True)
    finally:
        torch.use_deterministic_algorithms(False)


# ---- no half-made tensors: quantized dtypes refused at the first quantized operator ----

@pytest.mark.parametrize("call", [
    lambda: torch.quantize_per_tensor(torch.ones(3, device="openreg"), 0.05, 3, torch.quint8),
    lambda: torch.quantize_per_channel(torch.ones(2, 3, device="openreg"),
                                       torch.ones(2, device="openreg"),
                                       torch.zeros(2, dtype=torch.long, device="openreg"), 0,
                                       torch.qint8),
    lambda: torch.empty(2, dtype=torch.qint32, device="openreg"),
    lambda: torch.ones(2, device="openreg").to(torch.quint8),
    lambda: torch.quantize_per_tensor(torch.ones(3), 0.05, 3, torch.quint8).to("openreg"),
], ids=["quantize_per_tensor", "quantize_per_channel", "empty-qint32", "to-quint8",
        "cpu-quantized-to-openreg"])
def test_quantized_tensors_are_refused_by_name(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's deprecation warning of quantized tensors
        with pytest.raises(NotImplementedError,
                           match="openreg does not support quantized tensors.*(QUInt8|QInt8|"
                                 "quantized dtype)") as info:
            call()
    assert "aten::" in str(info.value)



def test_out_argument_resized_before_the_cpu_kernel_fails_is_resized_on_the_device(device):
    # Found by tools/fuzz.py: the CPU's cumsum resizes out= and then refuses bool; the device
    # tensor must end up as the CPU's does, not keep its old shape over a resized alias.
    outs = {}
    for d in ("cpu", device):
        out = torch.empty(0, 3, dtype=torch.bool, device=d)
        with pytest.raises(NotImplementedError, match="not implemented for 'Bool'"):
            torch.cumsum(torch.ones(3, 1, 5, dtype=torch.bool, device=d), 0, out=out)
        outs[d] = out
    assert outs[device].shape == outs["cpu"].shape == (3, 1, 5)
    assert outs[device].stride() == outs["cpu"].stride()
    assert outs[device].untyped_storage().nbytes() >= 15
