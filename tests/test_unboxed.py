"""The unboxed route (csrc/routes/unboxed.cpp): frequent small operators (element-wise arithmetic,
foreach and fused optimizer kernels) get a kernel generated from their C++ declaration, which runs
the CPU kernel on device memory without boxing the arguments. Every case is compared with the CPU
and with the generic fallback the route replaces (route switched off); the route's call counters
prove which path ran."""

import contextlib
import copy

import pytest
import torch
import torch_openreg

C = torch_openreg._C
DEV = "openreg:0"


@contextlib.contextmanager
def route(enabled: bool):
    before = C._unboxed_route_enabled()
    C._set_unboxed_route(enabled)
    try:
        yield
    finally:
        C._set_unboxed_route(before)


@pytest.fixture(autouse=True)
def default_mode():
    # These tests check which path ran: under OPENREG_ASYNC=1 every call is boxed and queued by the
    # fallback (tested below), so each test runs in the default mode and restores the setting.
    was_async = C._is_async()
    if was_async:
        torch.openreg.synchronize()
        C._set_async(False)
    yield
    if was_async:
        torch.openreg.synchronize()
        C._set_async(True)


def counts():
    return C._route_calls("unboxed.direct"), C._route_calls("unboxed.boxed")


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.rand(*shape, generator=g, dtype=dtype)
    return torch.randint(1, 9, shape, generator=g, dtype=dtype)


def run_everywhere(fn, *inputs):
    """fn on CPU tensors, on openreg through the route, on openreg through the fallback; the
    openreg inputs are fresh copies each time. Returns (cpu, route, fallback) (results, inputs)."""
    out = []
    for device, enabled in (("cpu", True), (DEV, True), (DEV, False)):
        args = [x.clone().to(device) for x in inputs]
        with route(enabled):
            r = fn(*args)
        out.append((r, args))
    return out


def assert_same(a, b):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a.cpu(), b.cpu(), equal_nan=True)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    else:
        assert a == b


BINARY = {
    "add": lambda a, b: a + b,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=3),
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "add_": lambda a, b: a.add_(b, alpha=2),
    "sub_": lambda a, b: a.sub_(b),
    "mul_": lambda a, b: a.mul_(b),
    "div_": lambda a, b: a.div_(b),
    "broadcast": lambda a, b: a * b[0],
    "wrapped_scalar": lambda a, b: (a + 1) * 2.5 - b / 4,
    "cpu_0dim": lambda a, b: a * torch.tensor(3.0),
    "noncontiguous": lambda a, b: a.t() + b.t(),
    "overlapping_views": lambda a, b: a[0].add_(a[1]),  # two views of one storage
    "same_tensor_twice": lambda a, b: a.mul_(a),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_operators_match_the_cpu_and_the_fallback(name):
    fn = BINARY[name]
    direct_before, _ = counts()
    (cpu, cpu_in), (r, r_in), (fb, fb_in) = run_everywhere(fn, _t(3, 3), _t(3, 3, seed=1) + 0.5)
    assert counts()[0] > direct_before  # the route ran (and not the fallback)
    assert r.device.type == "openreg"
    assert_same(cpu, r)
    assert_same(cpu, fb)
    assert_same(cpu_in, r_in)  # what in-place kernels wrote landed in device memory


def test_in_place_returns_the_argument_itself():
    a, b = _t(4).to(DEV), _t(4, seed=1).to(DEV)
    for op in (torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_):
        assert op(a, b) is a


def test_integer_true_division_and_type_promotion():
    x, y = _t(5, dtype=torch.int64), _t(5, dtype=torch.int64, seed=1)
    for fn in (lambda a, b: a / b, lambda a, b: a * 0.5, lambda a, b: a + b.double()):
        (cpu, _), (r, _), _ = run_everywhere(fn, x, y)
        assert_same(cpu, r)


@pytest.mark.parametrize("case", ["shape", "dtype", "devices", "cpu_tensor"])
def test_errors_are_the_cpus(case):
    def call(device, other_device=None):
        a = _t(3).to(device)
        if case == "shape":
            return a.add_(_t(2, 3).to(device))  # cannot broadcast into self
        if case == "dtype":
            return _t(3, dtype=torch.int64).to(device).div_(a)  # float result into an int tensor
        if case == "devices":
            return a + _t(3).to(other_device)
        return a + _t(3)  # a CPU tensor that is not a 0-dim scalar

    if case in ("shape", "dtype"):
        with pytest.raises(RuntimeError) as cpu_err:
            call("cpu")
        for enabled in (True, False):
            with route(enabled), pytest.raises(type(cpu_err.value)) as err:
                call(DEV)
            assert str(err.value) == str(cpu_err.value)
    else:
        messages = []
        for enabled in (True, False):
            with route(enabled), pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as err:
                call(DEV, "openreg:1")
            messages.append(str(err.value))
        assert messages[0] == messages[1]  # the fallback's check, unchanged


def test_autograd_through_routed_operators():
    x_cpu = _t(3, 3).requires_grad_()
    w_cpu = _t(3, 3, seed=1).requires_grad_()
    x_dev = x_cpu.detach().to(DEV).requires_grad_()
    w_dev = w_cpu.detach().to(DEV).requires_grad_()
    for x, w in ((x_cpu, w_cpu), (x_dev, w_dev)):
        ((x * w + x / (w + 1) - 2 * x).sum()).backward()
    torch.testing.assert_close(x_dev.grad.cpu(), x_cpu.grad)
    torch.testing.assert_close(w_dev.grad.cpu(), w_cpu.grad)


def _lists(n, seed):
    return [_t(7, seed=seed * 100 + i) + 0.1 for i in range(n)]


FOREACH = {
    "add_List": lambda a, b: torch._foreach_add_(a, b),
    "add_Scalar": lambda a, b: torch._foreach_add_(a, 2.0),
    "mul_List": lambda a, b: torch._foreach_mul_(a, b),
    "mul_Scalar": lambda a, b: torch._foreach_mul_(a, 0.5),
    "lerp_Scalar": lambda a, b: torch._foreach_lerp_(a, b, 0.3),
    "lerp_List": lambda a, b: torch._foreach_lerp_(a, b, b),
    "addcmul_": lambda a, b: torch._foreach_addcmul_(a, b, b, value=0.5),
    "addcdiv_": lambda a, b: torch._foreach_addcdiv_(a, b, b, value=0.5),
    "sqrt": lambda a, b: torch._foreach_sqrt(a),
    "div_List": lambda a, b: torch._foreach_div_(a, b),
    "add_out_of_place": lambda a, b: torch._foreach_add(a, b),
    "mul_out_of_place": lambda a, b: torch._foreach_mul(a, 3.0),
}


@pytest.mark.parametrize("name", sorted(FOREACH))
def test_foreach_operators_match_the_cpu_and_the_fallback(name):
    fn = FOREACH[name]
    a, b = _lists(20, 1), _lists(20, 2)
    results = []
    for device, enabled in (("cpu", True), (DEV, True), (DEV, False)):
        xa, xb = [t.clone().to(device) for t in a], [t.clone().to(device) for t in b]
        before = counts()[0]
        with route(enabled):
            r = fn(xa, xb)
        if device != "cpu":
            assert (counts()[0] > before) == enabled
        results.append((r, xa))
    for r, xa in results[1:]:
        assert_same(results[0][1], xa)
        if results[0][0] is not None:
            assert all(t.device.type == "openreg" for t in r)
            assert_same(results[0][0], r)


@pytest.mark.parametrize("fused", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("scaled", [False, True])
def test_fused_optimizer_kernels_match_the_cpu_and_the_fallback(fused, scaled):
    n = 12
    states = []
    for device, enabled in (("cpu", True), (DEV, True), (DEV, False)):
        lists = [[t.to(device) for t in _lists(n, s)] for s in range(5)]
        steps = [torch.tensor(3.0).to(device) for _ in range(n)]
        extra = {}
        if scaled:
            extra = {"grad_scale": torch.tensor(2.0).to(device),
                     "found_inf": torch.tensor(0.0).to(device)}
        before = counts()[0]
        with route(enabled):
            if fused == "sgd":
                torch._fused_sgd_(lists[0], lists[1], lists[2], weight_decay=0.01, momentum=0.9,
                                  lr=0.1, dampening=0.0, nesterov=True, maximize=False,
                                  is_first_step=False, **extra)
            else:
                fn = torch._fused_adam_ if fused == "adam" else torch._fused_adamw_
                fn(lists[0], lists[1], lists[2], lists[3], lists[4], steps, lr=0.01, beta1=0.9,
                   beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=True, maximize=False, **extra)
        if device != "cpu":
            assert (counts()[0] > before) == enabled
        states.append(lists)
    for lists in states[1:]:
        assert_same(states[0], lists)


def test_optimizers_step_like_the_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    x = torch.randn(4, 6)
    results = {}
    for form in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        for device in ("cpu", DEV):
            m = copy.deepcopy(model).to(device)
            opt = torch.optim.AdamW(m.parameters(), lr=0.01, **form)
            for _ in range(3):
                opt.zero_grad()
                m(x.to(device)).square().sum().backward()
                opt.step()
            results[(str(form), device)] = [p.detach().cpu() for p in m.parameters()]
        for a, b in zip(results[(str(form), "cpu")], results[(str(form), DEV)]):
            torch.testing.assert_close(a, b)


def test_memory_statistics_are_the_fallbacks():
    a, b = _t(256).to(DEV), _t(256, seed=1).to(DEV)
    torch.openreg.synchronize()
    stats = []
    for enabled in (True, False):
        with route(enabled):
            start = torch.openreg.memory_allocated(DEV)
            c = a * b + a  # two fresh results, the first freed at once
            during = torch.openreg.memory_allocated(DEV)
            del c
            stats.append((during - start, torch.openreg.memory_allocated(DEV) - start))
    assert stats[0] == stats[1] == (1024, 0)


def test_graph_capture_and_async_mode_take_the_boxed_path():
    a = _t(16).to(DEV)
    direct, boxed = counts()
    g = torch.accelerator.Graph()
    with torch.openreg.graph(g):
        b = a * 2  # recorded by the capture (through the fallback), not run
    assert counts() == (direct, boxed + 1)
    g.replay()
    torch.testing.assert_close(b.cpu(), a.cpu() * 2)
    was_async = C._is_async()
    C._set_async(True)
    try:
        direct, boxed = counts()
        r = (a + 1) * 3
        torch.openreg.synchronize()
    finally:
        C._set_async(was_async)
    assert counts()[1] > boxed and counts()[0] == direct
    torch.testing.assert_close(r.cpu(), (a.cpu() + 1) * 3)


def test_stream_order_is_kept():
    # A routed kernel runs in the order of its stream: a result written on a side stream is read
    # correctly after a wait, as with the fallback.
    a = torch.zeros(1000, device=DEV)
    s = torch.openreg.Stream()
    with torch.openreg.stream(s):
        for _ in range(20):
            a.add_(1)
    torch.openreg.current_stream().wait_stream(s)
    b = a * 2
    assert b.cpu().eq(40).all()


def test_references_are_unchanged_by_routed_calls():
    # The route borrows the device tensors and their aliases for the call (no reference count of
    # its own): after any number of calls, in-place or not, single or in lists, each tensor has
    # exactly the references it had, C++ and Python alike.
    import sys

    a, b = _t(8).to(DEV), _t(8, seed=1).to(DEV)
    params = [_t(4, seed=s).to(DEV) for s in range(5)]
    grads = [_t(4, seed=10 + s).to(DEV) for s in range(5)]
    tensors = [a, b] + params + grads
    before = [(t._use_count(), sys.getrefcount(t)) for t in tensors]
    for _ in range(50):
        a.add_(b)
        c = a * b - 1
        torch._foreach_mul_(params, 0.99)
        torch._foreach_add_(params, grads, alpha=0.1)
        out = torch._foreach_add(params, grads)
    del c, out
    assert [(t._use_count(), sys.getrefcount(t)) for t in tensors] == before
    assert counts()[0] > 0


UNARY_AND_MATMUL = {
    "mm": lambda a, b: a @ b,
    "addmm": lambda a, b: torch.addmm(b, a, b, beta=0.5, alpha=2),
    "bmm": lambda a, b: torch.bmm(a.unsqueeze(0), b.t().unsqueeze(0)),
    "tanh": lambda a, b: a.tanh(),
    "sigmoid": lambda a, b: torch.sigmoid(a),
    "exp": lambda a, b: a.exp(),
    "neg": lambda a, b: -a,
    "relu": lambda a, b: torch.relu(a - 0.5),
    "pow": lambda a, b: a ** 3,
    "sum_dim": lambda a, b: a.sum(1),
    "mean_dim": lambda a, b: a.mean(0, keepdim=True),
    "softmax": lambda a, b: torch.softmax(a, -1),
    "log_softmax": lambda a, b: torch.log_softmax(a, 0),
}


@pytest.mark.parametrize("name", sorted(UNARY_AND_MATMUL))
def test_matrix_products_and_activations_match_the_cpu_and_the_fallback(name):
    fn = UNARY_AND_MATMUL[name]
    direct_before, _ = counts()
    (cpu, _), (r, _), (fb, _) = run_everywhere(fn, _t(3, 3), _t(3, 3, seed=1))
    assert counts()[0] > direct_before
    assert r.device.type == "openreg"
    assert_same(cpu, r)
    assert_same(cpu, fb)


def test_activation_backward_kernels_match_the_cpu():
    # tanh_backward, sigmoid_backward, threshold_backward (relu), _softmax_backward_data and
    # _log_softmax's backward run on the autograd device thread through the route.
    x_cpu = (_t(4, 5) - 0.5).double().requires_grad_()
    x_dev = x_cpu.detach().to(DEV).requires_grad_()
    direct_before, _ = counts()
    for x in (x_cpu, x_dev):
        y = torch.tanh(x) + torch.sigmoid(x) * torch.relu(x) + torch.softmax(x, -1)
        (y * torch.log_softmax(x, 0)).sum().backward()
    assert counts()[0] > direct_before
    torch.testing.assert_close(x_dev.grad.cpu(), x_cpu.grad)
    assert torch.autograd.gradcheck(lambda t: torch.softmax(torch.tanh(t) @ t.t(), -1),
                                    (x_dev[:3, :3].detach().requires_grad_(),))


# The element-wise kernels of the for-loop forms of Adam and AdamW (lerp_, addcmul_, sqrt,
# addcdiv_ per parameter and step), and the comparisons and reductions of gradcheck and clipping.
# Each case is one call: the route must take it (one more direct call, no boxed one).
SINGLE_CALLS = {
    "lerp_": lambda a, b: a.lerp_(b, 0.1),
    "addcmul_": lambda a, b: a.addcmul_(b, b, value=0.001),
    "addcdiv_": lambda a, b: a.addcdiv_(a, b, value=-0.5),
    "sqrt": lambda a, b: a.sqrt(),
    "rsqrt": lambda a, b: torch.rsqrt(b),
    "div__Scalar": lambda a, b: torch.ops.aten.div_.Scalar(a, 3.0),
    "div_Scalar": lambda a, b: torch.ops.aten.div.Scalar(a, 3.0),
    "eq": lambda a, b: a.eq(0.5),
    "gt": lambda a, b: a > 0.25,
    "sum": lambda a, b: a.sum(),
    "sum_dtype": lambda a, b: a.sum(dtype=torch.float64),
    "vector_norm": lambda a, b: torch.linalg.vector_norm(a, 2.0, (0,), True),
    "clamp_min": lambda a, b: a.clamp_min(0.5),
    # LBFGS's line search (issue 41): dot products, reductions to a scalar and comparisons of
    # scalars, read on the host, hundreds of calls per step.
    "dot": lambda a, b: a[0].dot(b[1]),
    "max": lambda a, b: a.max(),
    "reciprocal": lambda a, b: b.reciprocal(),
    "lt_Scalar": lambda a, b: a < 0.5,
    "le_Scalar": lambda a, b: a <= 0.5,
    "ge_Scalar": lambda a, b: a >= 0.5,
    "lt_Tensor": lambda a, b: a < b,
    "le_Tensor": lambda a, b: a <= b,
    "noncontiguous": lambda a, b: a.t().lerp_(b, 0.5),
    # The out= products Inductor's generated code calls (extern kernels).
    "mm_out": lambda a, b: torch.mm(a, b, out=torch.empty(3, 3, device=a.device)),
    "mm_out_resized": lambda a, b: torch.mm(a, b, out=torch.empty(0, device=a.device)),
    "addmm_out": lambda a, b: torch.addmm(b[0], a, b, beta=0.5, alpha=2,
                                          out=torch.empty(3, 3, device=a.device)),
    "bmm_out": lambda a, b: torch.bmm(a.unsqueeze(0), b.unsqueeze(0),
                                      out=torch.empty(1, 3, 3, device=a.device)),
}


@pytest.mark.parametrize("name", sorted(SINGLE_CALLS))
def test_optimizer_and_reduction_kernels_take_the_route(name):
    fn = SINGLE_CALLS[name]
    a, b = _t(3, 3), _t(3, 3, seed=1) + 0.5
    direct, boxed = counts()
    dev_a, dev_b = a.to(DEV), b.to(DEV)
    r = fn(dev_a, dev_b)
    assert counts() == (direct + 1, boxed), "one routed call, nothing boxed"
    (cpu, cpu_in), _, (fb, fb_in) = run_everywhere(fn, a, b)
    assert r.device.type == "openreg"
    assert_same(cpu, r)
    assert_same(cpu, fb)
    assert_same(cpu_in, [dev_a, dev_b])  # in-place results landed in device memory
    assert_same(cpu_in, fb_in)
    if name in ("lerp_", "addcmul_", "addcdiv_", "div__Scalar"):
        assert r is dev_a  # an in-place kernel returns the device tensor itself


# ---- the memo of a tensor-list operator's last call (csrc/ops/cpu_kernel.cpp, ALIAS_MEMO) ----
# A call passing the same tensors as the call before at the same operator finds their aliases in
# the memo; whatever changed between the two calls must be seen, as without the memo.

def memo_aliases():
    return C._route_calls("unboxed.memo")


def _step(lists):
    """An in-place foreach call and a fused SGD step on the same lists: each call checks the
    memo of the one before."""
    a, b, c = lists
    torch._foreach_mul_(a, 0.5)
    torch._foreach_add_(a, b, alpha=2.0)
    if any(t.is_neg() for l in lists for t in l):
        return  # the fused kernels refuse written tensors with the negative bit, CPU included
    torch._fused_sgd_(a, b, c, weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0,
                      nesterov=False, maximize=False, is_first_step=False)


def _memo_lists(n=6, numel=7):
    return [[_t(numel, seed=100 * s + i) + 0.1 for i in range(n)] for s in range(3)]


def _new_memory(t):
    # A storage grown in place moves to other memory, its contents copied: no kernel sees the
    # tensor in between.
    t.untyped_storage().resize_(2 * t.untyped_storage().nbytes())


_BETWEEN_CALLS = {
    "nothing": lambda lists: None,
    "resize_ (grows the storage)": lambda lists: [t.resize_(12)[7:].fill_(1.0) for t in
                                                  (lists[0][2], lists[1][2], lists[2][2])],
    "resize_ (other shape)": lambda lists: [t.resize_(1, 7) for t in
                                            (lists[0][1], lists[1][1], lists[2][1])],
    "as_strided_": lambda lists: [t.as_strided_((3,), (2,), 1) for t in
                                  (lists[0][3], lists[1][3], lists[2][3])],
    "set_ to another storage": lambda lists: lists[1][0].set_(lists[1][0].clone() * 3),
    "set_ onto another argument's storage": lambda lists: lists[1][4].set_(
        lists[0][5].untyped_storage(), 0, (7,), (1,)),
    "storage grown (new memory)": lambda lists: _new_memory(lists[0][0]),
    "neg bit": lambda lists: torch._C._set_neg(lists[1][3], True),
    "tensors replaced by new ones": lambda lists: [l.__setitem__(i, l[i].clone() + 1)
                                                   for l in lists for i in range(len(l))],
    "same tensors in another order": lambda lists: [l.reverse() for l in lists],
    "a tensor twice in a list": lambda lists: lists[0].__setitem__(4, lists[0][1]),
}


@pytest.mark.parametrize("change", list(_BETWEEN_CALLS))
def test_memo_sees_changes_between_calls(change):
    results = {}
    memo_before = memo_aliases()
    for device in ("cpu", DEV):
        lists = [[t.to(device) for t in l] for l in _memo_lists()]
        _step(lists)
        _step(lists)  # served by the memo
        _BETWEEN_CALLS[change](lists)
        _step(lists)
        _step(lists)
        results[device] = lists
    assert memo_aliases() > memo_before
    for lc, ld in zip(results["cpu"], results[DEV]):
        for c, d in zip(lc, ld):
            assert_same(c, d)
            assert c.is_neg() == d.is_neg()


def test_memo_with_tensors_that_die_and_addresses_reused():
    # Fresh lists each step, the previous ones freed: new tensors (and storages) may come at the
    # addresses of the dead ones, which must never be taken for them.
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        cpu = [[torch.rand(5 + step % 3, generator=g) for _ in range(4)] for _ in range(3)]
        dev = [[t.to(DEV) for t in l] for l in cpu]
        _step(cpu)
        _step(dev)
        for lc, ld in zip(cpu, dev):
            for c, d in zip(lc, ld):
                torch.testing.assert_close(d.cpu(), c)
        del dev


def test_memo_across_many_tensors_and_a_sweep_of_the_cache():
    # More tensors than the alias cache keeps before it sweeps the entries of dead tensors:
    # entries a memo points to leave the cache and are reused by other tensors.
    keep = [_memo_lists(n=8)]
    keep_dev = [[[t.to(DEV) for t in l] for l in keep[0]]]
    for i in range(300):
        a = [t.to(DEV) for t in _memo_lists(n=4)[0]]
        torch._foreach_mul_(a, 2.0)  # four tensors cached, then dead
        if i % 50 == 0:
            _step(keep[0])
            _step(keep_dev[0])
    _step(keep[0])
    _step(keep_dev[0])
    for lc, ld in zip(keep[0], keep_dev[0]):
        for c, d in zip(lc, ld):
            torch.testing.assert_close(d.cpu(), c)


def test_aliases_made_in_inference_mode_serve_calls_outside_it():
    # A kernel's CPU aliases outlive the call (the alias cache, its swept spares, the memo). Made
    # inside torch.inference_mode() they must still serve normal tensors outside it: in-place
    # kernels on them used to raise "Inplace update to inference tensor outside InferenceMode".
    x = {d: torch.arange(6.0, device=d) for d in ("cpu", DEV)}
    lists = {d: [[t.to(d) for t in l] for l in _memo_lists(n=4)] for d in ("cpu", DEV)}
    with torch.inference_mode():
        for d in ("cpu", DEV):
            x[d].add_(1)  # a normal tensor, updated inside the mode: its alias is cached there
            _step(lists[d])
            for i in range(300):  # tensors made and dead inside: their aliases are swept, spare
                fresh = [torch.rand(4, device=d) for _ in range(4)]
                torch._foreach_mul_(fresh, 2.0)
                fresh[0].add_(1).mul_(3)
    for d in ("cpu", DEV):
        x[d].mul_(2)  # the same tensor outside
        _step(lists[d])  # the same lists outside: the memo's aliases
        for i in range(300):  # fresh normal tensors, served by the spare aliases
            fresh = [torch.full((4,), float(i), device=d) for _ in range(4)]
            torch._foreach_mul_(fresh, 2.0)
            fresh[0].add_(1).mul_(3)
            assert fresh[0]._version > 0 and not fresh[0].is_inference()
            if i == 299:
                assert_same(fresh[0].cpu(), torch.full((4,), 3.0 * (2 * i + 1)))
    assert_same(x[DEV].cpu(), x["cpu"])
    for lc, ld in zip(lists["cpu"], lists[DEV]):
        for c, t in zip(lc, ld):
            assert_same(t.cpu(), c)


def _varied_views(base_cpu, base_dev, i):
    """The same view of a CPU and a device tensor: offset, stride, length, conjugate and negative
    bits chosen by i."""
    views = []
    for base in (base_cpu, base_dev):
        n = 1 + (i * 7) % 11
        t = base[i % 3:][:: 1 + i % 2][:n]
        if t.is_complex() and i % 3 == 0:
            t = t.conj()
        elif t.is_floating_point() and i % 4 == 0:
            t = torch._neg_view(t)
        views.append(t)
    return views


def test_new_tensors_get_swept_aliases_revalidated():
    # Entries the alias cache sweeps keep their CPU alias for the next tensors it sees for the
    # first time, which revalidate it. The new tensors differ from the dead ones in dtype, memory
    # size, shape, strides, offset and conjugate / negative bits; every result and every tensor
    # written in place must be the CPU's.
    dtypes = [torch.float32, torch.float64, torch.int64, torch.complex64, torch.int16]
    reused = C._route_calls("unboxed.spare_alias")
    for rnd in range(4):
        g = torch.Generator().manual_seed(rnd)
        keep = []
        for i in range(200):  # more tensors than the cache holds before a sweep
            dtype = dtypes[(i + rnd) % len(dtypes)]
            base_cpu = (torch.rand(30 + (i * 5 + rnd) % 40, generator=g) * 8).to(dtype)
            base_dev = base_cpu.to(DEV)
            c, d = _varied_views(base_cpu, base_dev, i + rnd)
            assert_same(c * 3, d * 3)  # read through the alias
            c.add_(2)
            d.add_(2)  # written through it
            assert_same(base_cpu, base_dev)
            if i % 10 == 0:
                keep.append((base_cpu, base_dev))  # some live on, the rest die
        for base_cpu, base_dev in keep:
            assert_same(base_cpu + 1, base_dev + 1)
    assert C._route_calls("unboxed.spare_alias") > reused


def test_tensors_that_die_young_leave_a_cache_of_many_live_ones():
    # With thousands of live tensors cached, the whole cache is swept only once it doubles; the
    # young entries are looked at every few dozen new ones, and the dead among them give their
    # aliases to the next new tensors.
    live = [torch.full((3,), float(i)).to(DEV) for i in range(2000)]
    for t in live:
        t.add_(1)  # each cached
    reused = C._route_calls("unboxed.spare_alias")
    x = torch.arange(6.0).to(DEV)
    window = []  # each new tensor lives for eight more, so it is not the last few entries' when
    for i in range(300):  # it dies (those a new tensor takes over)
        window.append(x * (i + 1))
        assert (window[-1] + 0).cpu().tolist() == [float(k * (i + 1)) for k in range(6)]
        if len(window) > 8:
            window.pop(0)
    assert C._route_calls("unboxed.spare_alias") > reused
    assert all(t.cpu().tolist() == [i + 1.0] * 3 for i, t in enumerate(live))


def test_memo_with_the_same_tensors_on_another_device_and_dtype():
    results = {}
    for device in ("cpu", DEV, "openreg:1"):
        lists = [[t.to(device) for t in l] for l in _memo_lists()]
        _step(lists)
        _step(lists)
        lists = [[t.to("openreg:0" if device == "openreg:1" else device) for t in l]
                 for l in lists]
        _step(lists)
        lists = [[t.double() for t in l] for l in lists]
        _step(lists)
        _step(lists)
        results[device] = lists
    for other in (DEV, "openreg:1"):
        for lc, ld in zip(results["cpu"], results[other]):
            for c, d in zip(lc, ld):
                assert_same(c, d)


def test_memo_with_views_of_one_storage():
    # Views of one storage in a list get aliases sharing one CPU storage (the ordinary path):
    # the memo must not make them look independent, neither in the call that has them from the
    # start nor after a tensor was moved onto another's storage.
    results = {}
    for device in ("cpu", DEV):
        base = torch.arange(24.0).to(device)
        a = [base[0:6], base[6:12], base[12:18]]
        b = [torch.ones(6).to(device) for _ in range(3)]
        for _ in range(3):
            torch._foreach_add_(a, b)
            torch._foreach_mul_(a, 2.0)
        own = [torch.full((6,), 5.0).to(device) for _ in range(3)]
        torch._foreach_add_(own, b)
        torch._foreach_add_(own, b)
        own[2].set_(own[0].untyped_storage(), 0, (6,), (1,))  # now two views of one storage
        torch._foreach_add_(own, b)
        results[device] = (base, own)
    assert_same(results["cpu"], results[DEV])


def test_memo_sees_a_partial_overlap_made_between_calls():
    # A tensor moved onto another argument's storage, overlapping it in part, the lists otherwise
    # the same tensors: the CPU kernel refuses the in-place write, on openreg as on the CPU.
    for device in ("cpu", DEV):
        base = torch.arange(7.0).to(device)
        x = [torch.arange(6.0).to(device), base[0:6]]
        y = [torch.ones(6).to(device) for _ in range(2)]
        torch._foreach_add_(x, y)
        torch._foreach_add_(x, y)  # served by the memo
        y[1].set_(base.untyped_storage(), 1, (6,), (1,))
        with pytest.raises(RuntimeError, match="unsupported operation: some elements of the "
                           "input tensor and the written-to tensor refer to a single memory"):
            torch._foreach_add_(x, y)


def test_memo_on_two_threads():
    import threading
    errors = []
    lists_cpu = _memo_lists(n=5)

    def work(seed):
        try:
            mine = [[t.clone() for t in l] for l in lists_cpu]
            mine_dev = [[t.to(DEV) for t in l] for l in mine]
            for _ in range(100):
                _step(mine)
                _step(mine_dev)
            for lc, ld in zip(mine, mine_dev):
                for c, d in zip(lc, ld):
                    torch.testing.assert_close(d.cpu(), c)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
