"""Sparse tensors on openreg (docs/layouts.md): COO and the compressed layouts (CSR, CSC, BSR,
BSC) live on the device with their indices and values in device memory, as on CUDA, and every
operator gives the CPU's result. Unsupported combinations raise NotImplementedError naming the
layout and the operator."""
import pytest
import torch
import torch.nn as nn

from torch_openreg.testing import settled_memory_allocated

D = "openreg"
pytestmark = pytest.mark.filterwarnings("ignore:Sparse")


def coo_pair(shape=(4, 5), nnz=6, dense_dims=(), coalesced=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in shape])
    val = torch.randn((nnz,) + dense_dims, generator=g)
    cpu = torch.sparse_coo_tensor(idx, val, shape + dense_dims)
    if coalesced:
        cpu = cpu.coalesce()
    return cpu, cpu.to(D)


def same_result_or_error(case, cpu_args, dev_args):
    """`case(*dev_args)` gives what `case(*cpu_args)` gives on the CPU: an equal result, or the
    CPU's exception, type and message."""
    try:
        want = case(*cpu_args)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)) as got:
            case(*dev_args)
        assert str(got.value) == str(e)
    else:
        same(case(*dev_args), want)


def same(dev, cpu):
    """`dev` is an openreg tensor equal to the CPU reference `cpu`, layout included."""
    assert dev.device.type == D
    assert dev.layout == cpu.layout, (dev.layout, cpu.layout)
    assert dev.shape == cpu.shape and dev.dtype == cpu.dtype
    if cpu.layout == torch.sparse_coo:
        assert dev._indices().device == dev.device and dev._values().device == dev.device
        assert dev.is_coalesced() == cpu.is_coalesced()
        torch.testing.assert_close(dev._indices().cpu(), cpu._indices())
        torch.testing.assert_close(dev._values().cpu(), cpu._values())
    elif cpu.layout != torch.strided:
        torch.testing.assert_close(dev.values().cpu(), cpu.values())
    torch.testing.assert_close(dev.cpu().to_dense() if dev.layout != torch.strided else dev.cpu(),
                               cpu.to_dense() if cpu.layout != torch.strided else cpu)


# ---- the issue's repros ----

def test_issue_embedding_sparse_backward():
    torch.manual_seed(0)
    ref = nn.Embedding(10, 3, sparse=True)
    dev = nn.Embedding(10, 3, sparse=True).to(D)
    dev.weight.data.copy_(ref.weight.data)
    ids = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]])
    ref(ids).pow(2).sum().backward()
    dev(ids.to(D)).pow(2).sum().backward()
    assert dev.weight.grad.layout == torch.sparse_coo
    same(dev.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_sparse_backward(mode):
    def grad(device):
        torch.manual_seed(0)
        e = nn.EmbeddingBag(10, 3, sparse=True, mode=mode).to(device)
        ids = torch.tensor([1, 2, 4, 5, 4, 3], device=device)
        e(ids, torch.tensor([0, 3], device=device)).pow(2).sum().backward()
        return e.weight.grad

    same(grad(D), grad("cpu"))


def test_issue_to_sparse_and_sparse_mm():
    x = torch.randn(4, 5).relu()
    s = x.to(D).to_sparse()
    same(s, x.to_sparse())
    w = torch.randn(5, 3)
    same(torch.sparse.mm(s, w.to(D)), torch.sparse.mm(x.to_sparse(), w))


def test_issue_sparse_csr():
    x = torch.randn(4, 5).relu()
    same(x.to(D).to_sparse_csr(), x.to_sparse_csr())


# ---- COO ----

def test_construction():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3.0, 4.0, 5.0])
    ref = torch.sparse_coo_tensor(i, v, (2, 3))
    same(torch.sparse_coo_tensor(i, v, (2, 3), device=D), ref)
    same(torch.sparse_coo_tensor(i.to(D), v.to(D), (2, 3)), ref)
    same(torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        2, 0, [2, 3], i.to(D), v.to(D), dtype=torch.float32, layout=torch.sparse_coo, device=D),
        ref)
    same(torch.sparse_coo_tensor(i, v, device=D), torch.sparse_coo_tensor(i, v))
    same(torch.zeros(3, 4, layout=torch.sparse_coo, device=D),
         torch.zeros(3, 4, layout=torch.sparse_coo))
    assert torch.sparse_coo_tensor(i, v, (2, 3), device="openreg:1").device.index == 1


def test_construction_is_zero_copy():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=D)
    v = torch.tensor([3.0, 4.0, 5.0], device=D)
    s = torch.sparse_coo_tensor(i, v, (2, 3))
    assert s._indices().data_ptr() == i.data_ptr()
    assert s._values().data_ptr() == v.data_ptr()


def test_memory_is_on_the_device():
    before = settled_memory_allocated()
    x = torch.zeros(256, 256, device=D)
    x[::7, ::5] = 1.0
    s = x.to_sparse()
    del x
    torch.openreg.synchronize()
    nnz = s._nnz()
    used = torch.openreg.memory_allocated() - before
    assert used >= nnz * (4 + 2 * 8)  # values and indices in device memory
    del s
    assert torch.openreg.memory_allocated() == before


def test_copies_between_devices():
    cpu, dev = coo_pair(coalesced=True)
    back = dev.cpu()
    assert back.device.type == "cpu" and back.layout == torch.sparse_coo
    same(dev, cpu)
    other = dev.to("openreg:1")
    assert other.device.index == 1 and other._values().device.index == 1
    same(other, cpu)
    same(dev.double(), cpu.double())


def test_copy_between_devices():
    cpu, dev = coo_pair(coalesced=True)
    for target in ("openreg:0", "openreg:1", "cpu"):
        dst = torch.zeros(4, 5, device=target).to_sparse()
        dst.copy_(dev)
        assert dst.device == torch.device(target) and dst._values().device == dst.device
        torch.testing.assert_close(dst.to_dense().cpu(), cpu.to_dense())
    dst = torch.zeros(4, 5, device=D).to_sparse()
    dst.copy_(cpu)
    same(dst, cpu)
    with pytest.raises(RuntimeError, match="between dense and sparse"):
        torch.zeros(4, 5, device=D).to_sparse().copy_(torch.ones(4, 5, device=D))


def test_to_dense_coalesce_indices_values():
    cpu, dev = coo_pair(nnz=12)
    assert not dev.is_coalesced()
    same(dev.to_dense(), cpu.to_dense())
    same(dev.coalesce(), cpu.coalesce())
    assert dev.coalesce().is_coalesced()
    same(dev.coalesce().indices(), cpu.coalesce().indices())
    same(dev.coalesce().values(), cpu.coalesce().values())
    assert dev._nnz() == cpu._nnz() and dev.sparse_dim() == 2 and dev.dense_dim() == 0


def test_metadata_operators_skip_the_fallback():
    """The members' accessors, the flags and the constructor from indices and values run the
    same device-generic kernels as on CUDA (docs/layouts.md, "Operators that need no CPU twin"),
    with the CPU's results; the CPU kernels (coalesce's sort) still run, through the fallback or
    its unboxed route."""
    import torch_openreg

    def fallback_calls():
        return torch_openreg._C._route_calls("layouts.fallback")

    def cpu_kernel_calls():
        return fallback_calls() + torch_openreg._C._route_calls("layouts.direct")

    cpu, dev = coo_pair(nnz=12)
    i, v = dev._indices(), dev._values()
    before = fallback_calls()
    got = (dev.is_coalesced(), dev._nnz(), dev.sparse_dim(), dev.dense_dim())
    assert got == (cpu.is_coalesced(), cpu._nnz(), cpu.sparse_dim(), cpu.dense_dim())
    same(dev._indices(), cpu._indices())
    same(dev._values(), cpu._values())
    built = torch.sparse_coo_tensor(i, v, (4, 5))
    assert built._indices().data_ptr() == i.data_ptr() and built.device == dev.device
    same(built, cpu)
    flagged = built._coalesced_(True)
    assert flagged.is_coalesced()
    assert fallback_calls() == before
    kernels = cpu_kernel_calls()
    same(dev.coalesce().indices(), cpu.coalesce().indices())
    assert cpu_kernel_calls() > kernels
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            1, 0, [3], torch.tensor([[0, 1]]), torch.ones(2, device=D), dtype=torch.float32,
            layout=torch.sparse_coo, device=D)
    on1 = torch.sparse_coo_tensor(i.to("openreg:1"), v.to("openreg:1"), (4, 5))
    assert on1.device == torch.device("openreg:1") and on1._values().device == on1.device


def test_twin_shells_and_results_in_place():
    """The fallback reuses the SparseTensorImpl of an earlier call's CPU twin and makes a fresh
    result (COO or strided) the device tensor in place (docs/layouts.md, "Cost"); every result is
    still the CPU's, owns its own members, and no device memory outlives the tensors that hold
    it."""
    import torch_openreg

    def calls(route):
        return torch_openreg._C._route_calls("layouts." + route)

    memory = settled_memory_allocated()
    cpu, dev = coo_pair(nnz=12)
    h_cpu, h_dev = coo_pair(shape=(3, 4), dense_dims=(2,), seed=3)
    d64_cpu, d64_dev = cpu.double(), dev.double()
    index = torch.tensor([0, 2, 1])
    shells, in_place = calls("twin_shell"), calls("result_in_place")
    dense_in_place = calls("dense_result_in_place")
    results = []
    for _ in range(3):
        for c, d in ((cpu, dev), (h_cpu, h_dev), (d64_cpu, d64_dev)):
            results.append((d.coalesce(), c.coalesce()))
            results.append((d.index_select(0, index.to(D)), c.index_select(0, index)))
            results.append((d * 2.0, c * 2.0))
            results.append((d.to_dense(), c.to_dense()))
    assert calls("twin_shell") - shells >= 30 and calls("result_in_place") - in_place >= 27
    assert calls("dense_result_in_place") - dense_in_place >= 9  # to_dense
    for got, want in results:  # later calls did not change earlier results
        same(got, want)
    assert len({r._values().data_ptr() for r, _ in results if r.is_sparse}) == 27
    # In place on a sparse tensor (the twin's members are replaced by the kernel), then more calls.
    w_cpu, w_dev = cpu.clone(), dev.clone()
    w_cpu.mul_(3.0).add_(cpu)
    w_dev.mul_(3.0).add_(dev)
    same(w_dev, w_cpu)
    same(w_dev.coalesce(), w_cpu.coalesce())
    same(w_dev.zero_(), w_cpu.zero_())
    # A failing kernel leaves its twin to the stack it unwinds: later calls are unaffected.
    with pytest.raises(IndexError) as dev_error:
        dev.index_select(0, torch.tensor([9], device=D))
    with pytest.raises(IndexError) as cpu_error:
        cpu.index_select(0, torch.tensor([9]))
    assert str(dev_error.value) == str(cpu_error.value)
    same(dev.index_select(0, index.to(D)), cpu.index_select(0, index))
    del results, dev, h_dev, d64_dev, w_dev, got, want, c, d
    torch.openreg.synchronize()
    assert torch.openreg.memory_allocated() == memory


def test_layout_route_add_and_to_dense():
    """`add` / `add_` with a sparse argument and `_to_dense` run unboxed (docs/layouts.md, "Cost"):
    the fallback's session without its boxing, the CPU's results and errors; anything out of the
    ordinary (another device, a written sparse or copy-on-write tensor) still takes the
    fallback."""
    import torch_openreg

    def calls(route):
        return torch_openreg._C._route_calls("layouts." + route)

    cpu, dev = coo_pair(nnz=12)
    h_cpu, h_dev = coo_pair(shape=(3, 4), dense_dims=(2,), seed=3)
    b_cpu, b_dev = coo_pair(seed=2)
    dense = torch.randn(4, 5)
    direct, fallback = calls("direct"), calls("fallback")
    same(dense.to(D) + dev, dense + cpu)
    same(torch.add(dense.to(D), dev, alpha=-2.5), torch.add(dense, cpu, alpha=-2.5))
    same(dense.double().to(D) + dev, dense.double() + cpu)  # type promotion
    same(dev + b_dev, cpu + b_cpu)  # a sparse result
    same(dev.to_dense(), cpu.to_dense())
    same(h_dev.to_dense(), h_cpu.to_dense())
    same(dev.double().to_dense(), cpu.double().to_dense())
    w_cpu, w_dev = dense.clone(), dense.to(D)
    assert w_dev.add_(dev, alpha=0.5) is w_dev
    w_cpu.add_(cpu, alpha=0.5)
    same(w_dev, w_cpu)
    hw_cpu = torch.randn(3, 4, 2)
    hw_dev = hw_cpu.to(D)
    same(hw_dev.add_(h_dev), hw_cpu.add_(h_cpu))
    # autograd above the route
    x_cpu = dense.clone().requires_grad_()
    x_dev = dense.to(D).requires_grad_()
    (x_dev + dev).pow(2).sum().backward()
    (x_cpu + cpu).pow(2).sum().backward()
    same(x_dev.grad, x_cpu.grad)
    assert calls("direct") - direct == 10 and calls("fallback") == fallback
    # a loop on the same tensors (the route's memo of their aliases), changed between calls
    d_cpu, d_dev = dense.clone(), dense.to(D)
    s_cpu, s_dev = cpu.clone(), dev.clone()
    for i in range(4):
        same(d_dev + s_dev, d_cpu + s_cpu)
        same(s_dev.to_dense(), s_cpu.to_dense())
        same(d_dev.add_(s_dev, alpha=0.5), d_cpu.add_(s_cpu, alpha=0.5))
        s_dev.mul_(2.0)  # values written in place
        s_cpu.mul_(2.0)
        if i == 1:  # new members
            s_cpu, s_dev = s_cpu.coalesce(), s_dev.coalesce()
        if i == 2:  # new memory for the dense tensor
            d_dev.set_(torch.randn(4, 5).to(D))
            d_cpu.set_(d_dev.cpu())
    # the CPU's errors, type and message
    cases = [
        lambda d, s, dv: torch.zeros(4, 5, dtype=torch.long, device=dv).add_(s),
        lambda d, s, dv: torch.zeros(3, 3, device=dv) + s,
        lambda d, s, dv: s + d,
        lambda d, s, dv: s.to_dense(dtype=torch.float64),
        lambda d, s, dv: s.to_dense(masked_grad=True),
    ]
    for case in cases:
        same_result_or_error(case, (dense, cpu, "cpu"), (dense.to(D), dev, D))
    # the fallback's cases: its device errors, a written sparse tensor, a copy-on-write one
    a_cpu, a_dev = cpu.clone(), dev.clone()
    fallback = calls("fallback")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dense + dev
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dense.to("openreg:1") + dev
    same(a_dev.add_(b_dev), a_cpu.add_(b_cpu))
    source = dense.to(D)
    lazy = torch._lazy_clone(source)
    same(lazy.add_(dev), dense + cpu)
    same(source, dense)
    assert calls("fallback") - fallback == 4


def test_layout_route_sparse_optimizer_operators():
    """`index_select`, `_coalesce` and `sparse_mask` (the sparse operators of Adagrad's and
    SparseAdam's steps and of sparse test loops) take the layout route: no boxed copy of their
    arguments, the CPU's results and errors; another device or layout still takes the
    fallback."""
    import torch_openreg

    def calls(route):
        return torch_openreg._C._route_calls("layouts." + route)

    cpu, dev = coo_pair(nnz=12)
    h_cpu, h_dev = coo_pair(shape=(3, 4), dense_dims=(2,), seed=3)
    dense = torch.randn(4, 5)
    mask_cpu, mask_dev = coo_pair(nnz=7, seed=5, coalesced=True)
    index = torch.tensor([3, 0, 0, 2])
    direct, fallback = calls("direct"), calls("fallback")
    for _ in range(2):  # the second time through the route's memo of the aliases
        same(dev.index_select(0, index.to(D)), cpu.index_select(0, index))
        same(dev.index_select(1, index.to(D)), cpu.index_select(1, index))
        same(h_dev.index_select(0, index[1:].to(D)), h_cpu.index_select(0, index[1:]))
        same(dev.coalesce(), cpu.coalesce())
        same(h_dev.coalesce(), h_cpu.coalesce())
        same(dense.to(D).sparse_mask(mask_dev), dense.sparse_mask(mask_cpu))
    assert calls("direct") - direct == 12 and calls("fallback") == fallback
    # a coalesced tensor's coalesce() is itself (no kernel at all), as on the CPU
    coalesced = dev.coalesce()
    direct = calls("direct")
    assert coalesced.coalesce() is coalesced and calls("direct") == direct
    # the CPU's errors, type and message
    cases = [
        lambda s, d, m, dv: s.index_select(0, torch.tensor([9], device=dv)),
        lambda s, d, m, dv: s.index_select(2, torch.tensor([0], device=dv)),
        lambda s, d, m, dv: s.index_select(0, torch.tensor([0.0], device=dv)),
        lambda s, d, m, dv: d[:3].sparse_mask(m),
        lambda s, d, m, dv: d.double().sparse_mask(m),
    ]
    for case in cases:
        same_result_or_error(case, (cpu, dense, mask_cpu, "cpu"), (dev, dense.to(D), mask_dev, D))
    # another device: the fallback's error
    fallback = calls("fallback")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dev.index_select(0, index)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        dense.sparse_mask(mask_dev)
    assert calls("fallback") - fallback == 2


def test_hybrid_dense_dims():
    cpu, dev = coo_pair(shape=(3, 4), dense_dims=(2,))
    same(dev.to_dense(), cpu.to_dense())
    same(dev.coalesce(), cpu.coalesce())
    same(dev * 2, cpu * 2)


def test_arithmetic():
    a_cpu, a = coo_pair(seed=1)
    b_cpu, b = coo_pair(seed=2)
    same(a + b, a_cpu + b_cpu)
    same(a - b, a_cpu - b_cpu)
    same(a * b, a_cpu * b_cpu)
    same(a * 3.0, a_cpu * 3.0)
    same(torch.sparse.sum(a), torch.sparse.sum(a_cpu))
    same(torch.sparse.sum(a, dim=1), torch.sparse.sum(a_cpu, dim=1))
    same(a.sum(), a_cpu.sum())
    dense = torch.randn(4, 5)
    same(dense.to(D) + a, dense + a_cpu)
    same(a.neg(), a_cpu.neg())
    same(a.t(), a_cpu.t())
    same(a.transpose(0, 1).coalesce(), a_cpu.transpose(0, 1).coalesce())


def test_in_place_ops():
    a_cpu, a = coo_pair(seed=1)
    b_cpu, b = coo_pair(seed=2)
    assert a.add_(b) is a
    a_cpu.add_(b_cpu)
    same(a, a_cpu)
    a.mul_(2.0)
    a_cpu.mul_(2.0)
    same(a, a_cpu)
    a.zero_()
    a_cpu.zero_()
    same(a, a_cpu)
    w_cpu = torch.randn(4, 5)
    w = w_cpu.to(D)
    w.add_(b, alpha=-0.5)  # dense += sparse, what SGD does with a sparse gradient
    w_cpu.add_(b_cpu, alpha=-0.5)
    same(w, w_cpu)


def test_matmul_with_dense():
    a_cpu, a = coo_pair(shape=(4, 5), nnz=8)
    m = torch.randn(5, 3)
    bias = torch.randn(4, 3)
    same(torch.sparse.mm(a, m.to(D)), torch.sparse.mm(a_cpu, m))
    same(torch.mm(a, m.to(D)), torch.mm(a_cpu, m))
    same(a @ m.to(D), a_cpu @ m)
    same(torch.addmm(bias.to(D), a, m.to(D), beta=0.5, alpha=2.0),
         torch.addmm(bias, a_cpu, m, beta=0.5, alpha=2.0))
    same(torch.sparse.addmm(bias.to(D), a, m.to(D)), torch.sparse.addmm(bias, a_cpu, m))
    v = torch.randn(5)
    same(torch.mv(a, v.to(D)), torch.mv(a_cpu, v))
    b_cpu, b = coo_pair(shape=(5, 3), nnz=7, seed=3)
    same(torch.sparse.mm(a, b), torch.sparse.mm(a_cpu, b_cpu))


def test_matmul_backward():
    a_cpu, a = coo_pair(shape=(4, 5), nnz=8, coalesced=True)
    m_cpu = torch.randn(5, 3, requires_grad=True)
    m = m_cpu.detach().to(D).requires_grad_()
    torch.sparse.mm(a_cpu, m_cpu).sum().backward()
    torch.sparse.mm(a, m).sum().backward()
    same(m.grad, m_cpu.grad)
    a_cpu.requires_grad_()
    a.requires_grad_()
    torch.sparse.mm(a_cpu, m_cpu.detach()).pow(2).sum().backward()
    torch.sparse.mm(a, m.detach()).pow(2).sum().backward()
    same(a.grad, a_cpu.grad)


def test_sparse_mask_and_index_select():
    a_cpu, a = coo_pair(coalesced=True)
    x = torch.randn(4, 5)
    same(x.to(D).sparse_mask(a), x.sparse_mask(a_cpu))
    idx = torch.tensor([0, 2, 3])
    same(a.index_select(0, idx.to(D)), a_cpu.index_select(0, idx))


@pytest.mark.parametrize("opt", ["SGD", "SparseAdam", "Adagrad"])
def test_optimizers_with_sparse_gradients(opt):
    def train(device):
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, sparse=True).to(device)
        kwargs = {"lr": 0.1, "momentum": 0.9} if opt == "SGD" else {"lr": 0.1}
        o = getattr(torch.optim, opt)(emb.parameters(), **kwargs)
        for step in range(3):
            ids = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9 + step]], device=device)
            o.zero_grad()
            emb(ids).pow(2).sum().backward()
            o.step()
        return emb.weight.detach()

    torch.testing.assert_close(train(D).cpu(), train("cpu"))


# ---- compressed layouts ----

LAYOUTS = [("csr", torch.sparse_csr, None), ("csc", torch.sparse_csc, None),
           ("bsr", torch.sparse_bsr, (2, 2)), ("bsc", torch.sparse_bsc, (2, 2))]


def compressed(layout, block):
    x = torch.randn(4, 6)
    x[x < 0.3] = 0
    x[0:2, 2:4] = 0
    if block is None:
        return x, x.to_sparse(layout=layout)
    return x, x.to_sparse(layout=layout, blocksize=block)


@pytest.mark.parametrize("name,layout,block", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_compressed_conversions(name, layout, block):
    x, ref = compressed(layout, block)
    conv = getattr(x.to(D), f"to_sparse_{name}")
    dev = conv(block) if block else conv()
    same(dev, ref)
    same(ref.to(D), ref)
    assert ref.to(D).cpu().layout == layout
    same(dev.to_dense(), x)
    same(dev.to_sparse(), ref.to_sparse())
    if name == "csr":
        same(dev.crow_indices(), ref.crow_indices())
        same(dev.col_indices(), ref.col_indices())
        same(dev.to_sparse_csc(), ref.to_sparse_csc())


@pytest.mark.parametrize("name,layout,block", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_compressed_matmul(name, layout, block):
    x, ref = compressed(layout, block)
    dev = ref.to(D)
    m = torch.randn(6, 3)
    if name == "bsc":  # the CPU has no kernel for it: the same refusal
        with pytest.raises(RuntimeError, match="not implemented for Strided \\+ SparseBsc"):
            ref @ m
        with pytest.raises(RuntimeError, match="not implemented for Strided \\+ SparseBsc"):
            dev @ m.to(D)
        return
    same(dev @ m.to(D), ref @ m)
    if name in ("csr", "bsr"):
        bias = torch.randn(4, 3)
        same(torch.addmm(bias.to(D), dev, m.to(D)), torch.addmm(bias, ref, m))


def test_csr_construction_and_ops():
    crow, col = torch.tensor([0, 2, 3, 3]), torch.tensor([0, 2, 1])
    val = torch.tensor([1.0, 2.0, 3.0])
    ref = torch.sparse_csr_tensor(crow, col, val, (3, 3))
    same(torch.sparse_csr_tensor(crow, col, val, (3, 3), device=D), ref)
    same(torch.sparse_csr_tensor(crow.to(D), col.to(D), val.to(D), (3, 3)), ref)
    dev = ref.to(D)
    same(dev * 2.0, ref * 2.0)
    same(dev + dev, ref + ref)
    same(dev.relu(), ref.relu())
    same(dev.clone(), ref.clone())
    same(dev.t(), ref.t())
    same(dev.sum(), ref.sum())
    same(torch.sparse_csc_tensor(crow, col, val, (3, 3), device=D),
         torch.sparse_csc_tensor(crow, col, val, (3, 3)))


# ---- errors ----

def test_mixed_devices_rejected():
    _, a = coo_pair()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.sparse.mm(a, torch.randn(5, 3))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.sparse.mm(a, torch.randn(5, 3, device="openreg:1"))


def test_invariant_checks_raise_the_cpu_errors():
    with pytest.raises(RuntimeError, match="size is inconsistent with indices"):
        torch.sparse_coo_tensor(torch.tensor([[0, 9]]), torch.ones(2), (3,), device=D,
                                check_invariants=True)
    with pytest.raises(RuntimeError, match="crow_indices"):
        torch.sparse_csr_tensor(torch.tensor([0, 5, 1]), torch.tensor([0]), torch.ones(1), (2, 2),
                                device=D, check_invariants=True)


def test_cpu_errors_are_kept():
    _, a = coo_pair()
    with pytest.raises(RuntimeError, match="Expected dim 0 size 5, got 4"):
        torch.sparse.mm(a, torch.randn(4, 3, device=D))


def test_unsupported_op_names_layout_and_op():
    _, a = coo_pair()
    # No sparse CPU kernel for cumsum: the same refusal as the CPU's, naming layout and operator.
    with pytest.raises(NotImplementedError, match=r"aten::cumsum.*sparse_coo"):
        torch.cumsum(a, 0)
