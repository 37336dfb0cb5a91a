"""Operators on openreg through the minimal native set and the generic fallback, compared with the
same computation on the CPU: copies in every direction, printing and scalars, indexing, data-
dependent shapes, tuple results, in-place and out= (resized), views sharing storage, set_ and
resize_, allocator statistics, and the fixes found by tests/test_op_conformance.py."""
import subprocess
import sys
import warnings

import pytest
import torch
from torch.testing import assert_close

OTHER = {torch.device("openreg:0"): "openreg:1", torch.device("openreg:1"): "openreg:0"}


def cpu_ref(shape=(4, 6), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


# ---- copies ----

LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "sliced": lambda t: t[::2, 1::3],
    "expanded": lambda t: t[:1].expand(3, -1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_copies_in_every_direction(device, layout, dtype, non_blocking):
    src = LAYOUTS[layout](cpu_ref())
    expected = src.to(dtype)
    pin = non_blocking
    host = src.pin_memory() if pin and src.is_contiguous() else src
    # host to device, with a dtype change
    d = host.to(device, dtype=dtype, non_blocking=non_blocking)
    torch.openreg.synchronize(device)  # the device of the copy, not the current one
    assert d.device == torch.device(device) and d.dtype == dtype
    assert_close(d.cpu(), expected)
    # device to device, same device, into a non-contiguous destination
    dst = torch.zeros(expected.shape[::-1], dtype=torch.float64, device=device).t()
    dst.copy_(d, non_blocking=non_blocking)
    assert_close(dst.cpu(), expected.double())
    # across devices, with a layout change
    other = LAYOUTS[layout](cpu_ref().to(OTHER[device]))
    assert_close(other.to(device, dtype=dtype).cpu(), expected)
    # device to host, into pinned memory when asked
    out = torch.empty(expected.shape, dtype=dtype).pin_memory() if pin else torch.empty(
        expected.shape, dtype=dtype)
    out.copy_(d, non_blocking=non_blocking)
    torch.openreg.synchronize(device)  # the device of the copy, not the current one
    assert_close(out, expected)


@pytest.fixture(scope="module")
def math_bit_copies_survive():
    """Before the in-process tests: a copy of a conjugated view and an fft op in a subprocess
    (they overflowed the stack once, killing the process)."""
    code = ("import torch\n"
            "z = torch.randn(3, dtype=torch.complex64, device='openreg:1')\n"
            "z.conj().cpu(); torch.fft.hfft(torch.randn(5, device='openreg:1'))\n"
            "print('alive')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "alive" in r.stdout, f"exit code {r.returncode}: {r.stderr[-2000:]}"


def test_copy_of_conjugated_and_negated_views(device, math_bit_copies_survive):
    """Conjugate/negative views reach _copy_from with their bit set (fft ops overflowed the stack
    resolving them before): each direction applies the bit like the CPU."""
    z = torch.randn(5, dtype=torch.complex64)
    for view in (lambda t: t.conj(), lambda t: t.conj().imag, lambda t: torch._neg_view(t)):
        expected = view(z).resolve_conj().resolve_neg()
        assert_close(view(z).to(device).cpu(), expected)  # host to device
        d = z.to(device)
        assert_close(view(d).cpu(), expected)  # device to host
        assert_close(view(d).to(OTHER[device]).cpu(), expected)  # device to device
        assert_close(view(d).clone().cpu(), expected)
        dst = torch.empty_like(expected, device=device)
        dst.copy_(view(d))
        assert_close(dst.cpu(), expected)


@pytest.mark.parametrize("fn", ["hfft", "ihfft", "irfft", "fft", "rfft2"])
def test_fft_ops_match_the_cpu(device, fn, math_bit_copies_survive):
    x = cpu_ref((4, 8))
    if fn in ("fft", "irfft"):
        x = torch.complex(x, x.flip(0))
    assert_close(getattr(torch.fft, fn)(x.to(device)).cpu(), getattr(torch.fft, fn)(x))


def test_overlapping_copy_raises_like_the_cpu(device):
    for dev in ("cpu", device):
        x = torch.arange(6.0, device=dev)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            x[1:].copy_(x[:-1])
        x.copy_(x)  # the same view: a no-op, on both
        x[:3].copy_(x[3:])  # disjoint parts of one storage: allowed
        assert x.tolist() == [3.0, 4.0, 5.0, 3.0, 4.0, 5.0]


# ---- printing and scalars ----

def test_repr_item_tolist(device):
    x = torch.tensor([[1.5, -2.0], [3.25, 4.0]], device=device)
    assert repr(x) == repr(x.cpu())[:-1] + f", device='{device}')"
    assert x[1, 0].item() == 3.25
    assert x.tolist() == [[1.5, -2.0], [3.25, 4.0]]
    assert torch.tensor(7, device=device).item() == 7
    assert bool(torch.tensor(True, device=device)) is True
    assert float(x.sum()) == 6.75
    assert str(torch.arange(3, device=device)) == f"tensor([0, 1, 2], device='{device}')"



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.int32,
                                   torch.bool, torch.float16, torch.bfloat16, torch.complex64,
                                   torch.int8, torch.uint8])
def test_item_of_every_dtype_view_and_math_bit_matches_the_cpu(device, dtype):
    # A plain tensor of a common dtype is read from device memory directly (minimal_ops.cpp,
    # HOST_READ); views at an offset, other dtypes and the conjugate and negative bits go
    # through the CPU's kernel. Each gives what the CPU gives.
    base = torch.tensor([[1.5, -2.25], [3.0, 0.0]]).to(dtype)
    if dtype.is_complex:
        base = base + 1j * base.flip(0)
    for dev_tensor, cpu_tensor in ((base.to(device), base),):
        for pick in (lambda t: t[1, 0], lambda t: t[0, 1], lambda t: t[1, 1:], lambda t: t.t()[1][0],
                     lambda t: t[1, 0].expand(1, 1), lambda t: t.sum() if dtype != torch.bool else t[0, 0]):
            c, d = pick(cpu_tensor), pick(dev_tensor)
            assert d.item() == c.item() and type(d.item()) is type(c.item())
            assert torch.ops.aten._local_scalar_dense(d) == torch.ops.aten._local_scalar_dense(c)
    if dtype.is_complex:
        c, d = base[1, 0].conj(), base.to(device)[1, 0].conj()
        assert d.is_conj() and d.item() == c.item()
    if dtype.is_floating_point or dtype.is_complex:
        c, d = base[0, 1]._neg_view(), base.to(device)[0, 1]._neg_view()
        assert d.is_neg() and d.item() == c.item()


# ---- indexing ----

def test_indexing_and_index_assignment(device):
    c = cpu_ref((5, 6))
    d = c.to(device)
    idx = torch.tensor([4, 0, 4])
    mask = c > 0
    for get in (lambda t: t[1], lambda t: t[1:4, ::2], lambda t: t[..., -1], lambda t: t[None, 2],
                lambda t: t[idx], lambda t: t[idx.to(t.device), 1:], lambda t: t[:, [5, 1]],
                lambda t: t[mask.to(t.device)], lambda t: t[t > 0], lambda t: t[[0, 1], [2, 3]]):
        assert_close(get(d).cpu(), get(c))
    for put in (lambda t: t.__setitem__(0, 7.0),
                lambda t: t.__setitem__((slice(1, 3), 2), torch.tensor([1.0, 2.0]).to(t.device)),
                lambda t: t.__setitem__(idx.to(t.device), -1.0),
                lambda t: t.__setitem__(t > 5, 0.0),
                lambda t: t.__setitem__(([0, 4], [1, 2]), torch.tensor(3.0)),
                lambda t: t.index_put_((torch.tensor([1, 1]).to(t.device),), torch.ones(6).to(t.device), accumulate=True)):
        put(c)
        put(d)
        assert_close(d.cpu(), c)


# ---- data-dependent shapes, tuples, scalars ----

def test_data_dependent_output_shapes(device):
    c = torch.tensor([[0, 3, 3], [1, 0, 7]])
    d = c.to(device)
    for fn in (torch.nonzero, lambda t: torch.unique(t, return_counts=True),
               lambda t: torch.unique(t, sorted=True, return_inverse=True),
               lambda t: torch.masked_select(t, t > 2), lambda t: t.nonzero(as_tuple=True),
               lambda t: torch.unique_consecutive(t.flatten())):
        expected, actual = fn(c), fn(d)
        assert all(a.device == torch.device(device) for a in
                   (actual if isinstance(actual, tuple) else (actual,)))
        assert_close(tuple(a.cpu() for a in actual) if isinstance(actual, tuple) else actual.cpu(),
                     expected)


def test_ops_returning_tuples_and_scalars(device):
    c = cpu_ref((4, 5))
    d = c.to(device)
    for fn in (lambda t: t.max(dim=1), lambda t: t.min(0, keepdim=True), lambda t: t.sort(dim=0),
               lambda t: t.topk(2), lambda t: torch.aminmax(t), lambda t: t.kthvalue(2, 1),
               lambda t: torch.std_mean(t, 0)):
        expected, actual = fn(c), fn(d)
        assert type(actual) is type(expected)
        for a, e in zip(actual, expected):
            assert a.device == torch.device(device)
            assert_close(a.cpu(), e)
    assert d.max().item() == c.max().item()
    assert d.argmax().item() == c.argmax().item()
    assert torch.equal(d, d.clone()) and not torch.equal(d, d + 1)
    assert torch.allclose(d, d + 1e-9)


# ---- in-place and out= ----

def test_in_place_ops_write_the_device_tensor(device):
    c = cpu_ref()
    d = c.to(device)
    ptr = d.data_ptr()
    for fn in (lambda t: t.add_(1), lambda t: t.mul_(torch.tensor(2.0)), lambda t: t.relu_(),
               lambda t: t.clamp_(max=5), lambda t: t.fill_diagonal_(0), lambda t: t.t_(),
               lambda t: t.unsqueeze_(0), lambda t: t.squeeze_(0), lambda t: t.zero_().add_(3)):
        assert fn(d) is d
        fn(c)
        assert_close(d.cpu(), c)
    assert d.data_ptr() == ptr


@pytest.mark.parametrize("initial", [(4, 6), (0,), (100,)], ids=["exact", "empty", "larger"])
def test_out_arguments_including_resized_ones(device, initial):
    c = cpu_ref()
    d = c.to(device)
    for fn in (lambda t, out: torch.add(t, 1, out=out), lambda t, out: torch.mm(t, t.t(), out=out),
               lambda t, out: torch.cumsum(t, 0, out=out), lambda t, out: torch.sum(t, 1, out=out),
               lambda t, out: torch.cat([t, t], out=out)):
        out_c, out_d = torch.empty(initial), torch.empty(initial, device=device)
        # Resizing an out= with elements warns on the device exactly when it warns on the CPU.
        with warnings.catch_warnings(record=True) as on_device:
            warnings.simplefilter("always")
            fn(d, out_d)
        with warnings.catch_warnings(record=True) as on_cpu:
            warnings.simplefilter("always")
            fn(c, out_c)
        assert [str(w.message) for w in on_device] == [str(w.message) for w in on_cpu]
        assert out_d.shape == out_c.shape and out_d.device == torch.device(device)
        assert_close(out_d.cpu(), out_c)
    # tuple outputs
    values, indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
    r = torch.max(d, 1, out=(values, indices))
    assert r.values is values and r.indices is indices
    assert_close(values.cpu(), c.max(1).values)


def test_mode_with_out_runs_on_the_device(device):
    """mode.values is a composite that accepts only CPU/CUDA/XPU devices: routed to the CPU one."""
    c = torch.tensor([[1.0, 2, 2, 3], [5, 5, 1, 0]])
    values, indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
    torch.mode(c.to(device), 1, out=(values, indices))
    assert_close((values.cpu(), indices.cpu()), tuple(torch.mode(c, 1)))


def test_complex_conj_physical_in_place_and_svd_out(device):
    """conj_physical_ is a composite calling a CPU-only kernel table directly: routed to the CPU
    one (it failed with an internal assert before, and so did svd with out= on complex input)."""
    z = torch.randn(3, 3, dtype=torch.complex64)
    d = z.to(device)
    assert d.conj_physical_() is d
    assert_close(d.cpu(), z.conj_physical())
    outs = tuple(torch.empty(0, dtype=t, device=device)
                 for t in (torch.complex64, torch.float32, torch.complex64))
    torch.svd(z.to(device), out=outs)
    u, s_, v = torch.svd(z)
    assert_close(outs[1].cpu(), s_)
    assert_close((outs[0] @ torch.diag(outs[1]).to(torch.complex64) @ outs[2].mH).cpu(), z,
                 atol=1e-5, rtol=1e-4)


def test_efficient_zero_tensor(device):
    z = torch._efficientzerotensor((2, 3), device=device)
    assert z._is_zerotensor() and z.device == torch.device(device)
    assert_close((z + torch.ones(2, 3, device=device)).cpu(), torch.ones(2, 3))
    assert_close(z.cpu(), torch.zeros(2, 3))
    x = torch.ones(2, 3, device=device)
    assert (z * x)._is_zerotensor() and (z * x).device == torch.device(device)
    assert_close(torch.mm(z, x.t()).cpu(), torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
        z.add_(1)


def test_efficient_zero_tensor_has_the_cpus_storage_size(device):
    for dtype in (torch.float32, torch.float64, torch.int8):
        cpu = torch._efficientzerotensor((2, 3), dtype=dtype)
        dev = torch._efficientzerotensor((2, 3), dtype=dtype, device=device)
        assert dev.untyped_storage().nbytes() == cpu.untyped_storage().nbytes() == 6 * cpu.itemsize
    # Batched gradients view zero tensors with as_strided: checked against that size.
    z = torch._efficientzerotensor((2, 3), device=device)
    v = z.as_strided((4, 2, 3), (0, 3, 1))
    assert v._is_zerotensor() and v.shape == (4, 2, 3)
    assert_close(v.cpu(), torch.zeros(4, 2, 3))
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 24"):
        z.as_strided((4, 2, 3), (1, 3, 1))


def test_gradgradcheck_with_batched_grad_through_zero_tensors(device):
    x = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    t = torch.randn(3, 4, dtype=torch.float64, device=device)
    assert torch.autograd.gradgradcheck(torch.nn.functional.l1_loss, (x, t),
                                        check_batched_grad=True)


def test_group_norm_channels_last_gradient_keeps_the_cpus_layout(device):
    torch.manual_seed(0)
    gn = torch.nn.GroupNorm(2, 4)
    x = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    results = []
    for d in ("cpu", device):
        xd = x.detach().to(d).requires_grad_()
        y = gn.to(d)(xd)
        y.square().sum().backward()
        results.append((y, xd.grad, gn.weight.grad.clone()))
        gn.zero_grad()
    (y, gx, gw), (yd, gxd, gwd) = results
    assert yd.stride() == y.stride() and gxd.stride() == gx.stride() == x.stride()
    assert_close(gxd.cpu(), gx)
    assert_close(gwd.cpu(), gw)


def test_conj_bit_of_results_and_out_arguments(device):
    z = torch.randn(4, dtype=torch.complex64)
    d = z.to(device)
    v = d.conj()
    assert v.is_conj() and v.data_ptr() == d.data_ptr()
    assert_close((v * 2).cpu(), z.conj() * 2)
    out = torch.empty(4, dtype=torch.complex64, device=device)
    torch.mul(v, 2, out=out)
    assert not out.is_conj()
    assert_close(out.cpu(), z.conj() * 2)
    assert_close(torch.view_as_real(v.resolve_conj()).cpu(), torch.view_as_real(z.conj().resolve_conj()))


# ---- tensor lists (foreach, fused optimizers) ----

def _shared_lists(dev):
    """20 rows of one tensor, one tensor twice, and a last pair that partially overlaps: more
    tensors than a fallback session finds by search, so it indexes them (csrc/ops/cpu_kernel.cpp)."""
    base = torch.arange(60.0).reshape(20, 3).to(dev)
    other = torch.ones(20, 3).to(dev)
    x = torch.arange(5.0).to(dev)
    return list(base) + [other, other], list(other) + [base[0], base[1]], x


def test_tensor_lists_sharing_storages_match_the_cpu(device):
    results = {}
    for dev in ("cpu", device):
        a, b, x = _shared_lists(dev)
        torch._foreach_add_(a, b)  # rows of one storage, one tensor twice
        out = torch._foreach_mul(a, 2.0)  # fresh results, one storage each
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch._foreach_copy_(a[:12] + [x[1:]], b[:12] + [x[:-1]])  # partial overlap
        results[dev] = [t.cpu() for t in a + list(out)]
        assert all(t.device == torch.device(dev) for t in out)
    assert len(results["cpu"]) == len(results[device])
    for c, d in zip(results["cpu"], results[device]):
        assert_close(d, c)


# ---- views, set_, resize_ ----

def test_views_share_the_device_storage(device):
    d = torch.arange(24.0, device=device)
    base = d.untyped_storage().data_ptr()
    views = [d.view(4, 6), d.as_strided((3, 3), (5, 1), 2), d.view(4, 6).t(),
             d.unfold(0, 4, 2), d[:1].expand(5, 1), d.narrow(0, 3, 10), d.view(2, 3, 4)[1],
             d.reshape(6, 4), d.view(4, 6).diagonal(), d.view(torch.int32)]
    for v in views:
        assert v.device == d.device and v.untyped_storage().data_ptr() == base
    c = torch.arange(24.0)
    cviews = [c.view(4, 6), c.as_strided((3, 3), (5, 1), 2), c.view(4, 6).t(),
              c.unfold(0, 4, 2), c[:1].expand(5, 1), c.narrow(0, 3, 10), c.view(2, 3, 4)[1],
              c.reshape(6, 4), c.view(4, 6).diagonal(), c.view(torch.int32)]
    for v, cv in zip(views, cviews):
        assert v.stride() == cv.stride() and v.storage_offset() == cv.storage_offset()
        assert_close(v.cpu(), cv)
    # writes through a view are seen by the base and by the other views
    views[5].mul_(-1)
    assert_close(d.cpu(), torch.cat([torch.arange(3.0), -torch.arange(3.0, 13), torch.arange(13.0, 24)]))
    assert_close(views[0].cpu(), d.cpu().view(4, 6))


def test_set_and_resize_act_on_the_real_tensor(device):
    a = torch.arange(6.0, device=device)
    b = torch.empty(0, device=device)
    b.set_(a.untyped_storage(), 2, (2, 2), (1, 2))
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert_close(b.cpu(), torch.arange(6.0).as_strided((2, 2), (1, 2), 2))
    b.fill_(0)
    assert a.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    c = torch.empty(0, device=device).set_(a)
    assert c.shape == a.shape and c.data_ptr() == a.data_ptr()
    a.resize_(2, 3)
    assert a.shape == (2, 3) and a.tolist()[0] == [0.0, 1.0, 0.0]
    a.resize_(50)  # grows the storage, keeping the first elements
    assert a.untyped_storage().nbytes() >= 200 and a[:3].tolist() == [0.0, 1.0, 0.0]
    s = torch.ones(4, device=device).untyped_storage()
    s.resize_(32)
    assert s.nbytes() == 32 and s.device == torch.device(device)
    with pytest.raises(RuntimeError, match="Attempted to set the storage of a tensor on device "
                       ".* to a storage on different device"):
        b.set_(torch.ones(3, device=OTHER[device]).untyped_storage())


# ---- allocator statistics stay true ----

def test_memory_allocated_returns_to_start_after_fallback_results(device):
    torch.openreg.synchronize(device)
    start = torch.openreg.memory_allocated(device)
    x = torch.randn(256, 256, device=device)
    results = [x.relu(), x.sort(1), torch.unique(x), x[x > 0], x.nonzero(), x.t().contiguous(),
               torch.add(x, 1, out=torch.empty(0, device=device)), x.cpu().to(device),
               torch.fft.rfft(x), x.topk(3)]
    assert torch.openreg.memory_allocated(device) > start + 256 * 256 * 4
    del x, results
    torch.openreg.synchronize(device)
    assert torch.openreg.memory_allocated(device) == start


# ---- aliases kept from call to call (csrc/ops/cpu_kernel.cpp, ALIAS_CACHE) ----
# The fallback keeps, per thread, the CPU alias it built for a device tensor and revalidates it on
# the next call. Every way of changing a tensor in place between two calls must be seen.

_METADATA_CHANGES = {
    "resize_ (grows the storage)": lambda t: t.resize_(40)[12:].fill_(1.0),
    "resize_ (shrinks the shape)": lambda t: t.resize_(2, 3),
    "set_ to another storage": lambda t: t.set_(torch.arange(100.0, 112.0).to(t.device)),
    "set_ with offset and strides": lambda t: t.set_(t.untyped_storage(), 3, (3, 2), (1, 4)),
    "as_strided_": lambda t: t.as_strided_((2, 2), (3, 1), 5),
    "t_ after view": lambda t: t.resize_(3, 4).t_(),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    ".data of another dtype": lambda t: setattr(t, "data", torch.arange(5, dtype=torch.int64).to(t.device)),
    "storage resize_(0) and back": lambda t: (t.untyped_storage().resize_(0),
                                              t.untyped_storage().resize_(96), t.fill_(3.0)),
    "out= resize": lambda t: torch.add(torch.ones(7, device=t.device), 1, out=t),
    "neg bit": lambda t: torch._C._set_neg(t, True),
}


@pytest.mark.parametrize("change", list(_METADATA_CHANGES))
def test_cached_alias_sees_changes_between_calls(device, change):
    results = {}
    for dev in ("cpu", device):
        t = torch.arange(12.0).to(dev)
        before = (t * 2).cpu()  # the fallback now holds an alias of t
        _METADATA_CHANGES[change](t)
        results[dev] = (before, (t * 2).cpu(), t.cpu(), t.shape, t.stride(), t.is_neg())
    for c, d in zip(results["cpu"], results[device]):
        if isinstance(c, torch.Tensor):
            assert_close(d, c)
        else:
            assert d == c


def test_cached_alias_sees_the_conj_bit_set_in_place(device):
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    d = z.to(device)
    assert_close((d * 2).cpu(), z * 2)
    torch._C._set_conj(d, True)
    torch._C._set_conj(z, True)
    assert_close((d * 2).cpu(), z * 2)
    assert_close(d.cpu(), z.resolve_conj())


def test_cached_aliases_of_overlapping_views_still_see_the_overlap(device):
    base = torch.arange(10.0, device=device)
    a, b, a2 = base[:6], base[2:8], base[:6]
    (a + 1, b + 1, a2 + 1)  # each view gets an alias of its own, kept by the fallback
    with pytest.raises(RuntimeError, match="unsupported operation: some elements of the input "
                       "tensor and the written-to tensor refer to a single memory location"):
        torch.add(a, 1, out=b)
    torch.add(a2, 1, out=a)  # full overlap is allowed, as on the CPU
    assert base.tolist() == [1.0, 2, 3, 4, 5, 6, 6, 7, 8, 9]


def test_cached_aliases_keep_no_device_memory_alive(device):
    torch.openreg.synchronize(device)
    start = torch.openreg.memory_allocated(device)
    x = torch.randn(1 << 16, device=device)
    for _ in range(3):
        (x * 2).sum()
    torch._foreach_add_([x], [x])
    del x
    assert torch.openreg.memory_allocated(device) == start
    # the tensor lives on, its old storage is replaced: that memory is freed now too
    y = torch.randn(1 << 16, device=device)
    (y * 2).sum()
    y.set_(torch.empty(0, device=device).untyped_storage())
    assert torch.openreg.memory_allocated(device) == start
    del y
    assert torch.openreg.memory_allocated(device) == start


def test_a_dead_tensors_cached_alias_serves_the_next_tensor(device):
    """A tensor seen for the first time takes over the cache entry of one that died: each tensor
    of a chain is passed once, with another dtype, shape, strides, offset or math bit than the
    one before, and every result must be the CPU's."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 3, 2), (4, 3), (1,), (6, 2)]
    dtypes = [torch.float32, torch.float64, torch.int64, torch.complex64]
    cpu_y = torch.randn(3, 4, generator=g)
    y = cpu_y.to(device)
    for i in range(24):
        dtype, shape = dtypes[i % len(dtypes)], shapes[i % len(shapes)]
        src = torch.randn(*shape, 3, generator=g).to(dtype)
        cpu_x = src[..., 1]  # strided, with an offset
        x = src.to(device)[..., 1]
        if dtype.is_complex and i % 3 == 0:
            cpu_x, x = cpu_x.conj(), x.conj()
        cpu_y = cpu_x * 2 + 1
        y = x * 2 + 1  # each x and each intermediate result is passed once, then dies
        assert y.device == torch.device(device)
        torch.testing.assert_close(y.cpu(), cpu_y)
        del x


def test_an_alias_a_kernel_keeps_owns_its_memory(device):
    """A CPU kernel that keeps its argument beyond the call: the alias it kept must hold the
    device memory, not borrow memory the allocator hands out again."""
    kept = []

    @torch.library.custom_op("openreg_test::keep_argument", mutates_args=(), device_types="cpu")
    def keep_argument(x: torch.Tensor) -> torch.Tensor:
        kept.append(x)
        return x.sum()

    torch.openreg.synchronize(device)
    start = torch.openreg.memory_allocated(device)
    x = torch.arange(1024.0, device=device)
    (x + 1).sum()  # x's alias is cached
    keep_argument(x)
    (x + 1).sum()  # and revalidated: not the one the kernel kept
    torch.openreg.synchronize(device)
    held = torch.openreg.memory_allocated(device)
    del x
    assert torch.openreg.memory_allocated(device) == held  # the kept alias holds the memory
    y = torch.full((1024,), -1.0, device=device)  # would reuse the block if it were free
    assert kept[0].device.type == "cpu"
    assert kept[0].tolist() == [float(i) for i in range(1024)]
    del kept[:], y
    assert torch.openreg.memory_allocated(device) == start


def test_two_threads_running_kernels_on_the_same_tensors(device):
    import threading
    w = torch.arange(64.0, device=device).reshape(8, 8)
    errors = []

    def work(k):
        try:
            acc = torch.zeros(8, 8, device=device)
            for i in range(200):
                acc = acc + w * k
                if i % 50 == 0:  # out= resizes of a tensor of this thread's own
                    torch.mul(w, k, out=torch.empty(0, device=device))
            assert_close(acc.cpu(), torch.arange(64.0).reshape(8, 8) * k * 200)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_fresh_results_become_device_tensors_in_place(device):
    """A fresh result of a CPU kernel becomes the device tensor itself (HostKernel::result): it
    must then be a device tensor in every respect, as one made by the allocator."""
    x = torch.randn(8, device=device)
    for inference in (False, True):
        with torch.inference_mode(inference):
            like = torch.empty(8, device=device)
            for y in (x + 1, x.relu(), torch.sort(x)[0], torch.sum(x, 0, keepdim=True)):
                assert y.device == device and y.untyped_storage().device == device
                assert torch._C._dispatch_keys(y) == torch._C._dispatch_keys(like)
                values = y.cpu()
                torch.openreg.synchronize(device)
                before = torch.openreg.memory_allocated(device)
                y.untyped_storage().resize_(1 << 16)  # through the storage's allocator
                assert torch.openreg.memory_allocated(device) >= before + (1 << 16) - 512
                assert_close(y.cpu(), values)
