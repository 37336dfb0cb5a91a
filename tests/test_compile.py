"""torch.compile on openreg: Dynamo traces, guards and recompiles for openreg tensors, and Inductor
generates C++ kernels that run on device memory, in stream order (torch_openreg/compile.py).

Every result is compared with eager execution on the CPU. Generated code is inspected through
``run_and_get_code``: its kernels, its allocations and its launches must be openreg's.
"""
import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.device_interface import get_interface_for_device
from torch._inductor.utils import run_and_get_code

from test_models import MODELS
from torch_openreg.testing import hold_stream, settled_memory_allocated


@pytest.fixture(autouse=True)
def reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_python(code, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=600)


def cpu_copy(*tensors):
    return [t.detach().cpu().requires_grad_(t.requires_grad) for t in tensors]


# ---- registration ------------------------------------------------------------------------------

def test_import_torch_does_not_import_dynamo_and_registration_follows_it():
    result = run_python("""
        import sys, torch
        assert "torch._dynamo" not in sys.modules, "import torch imported torch._dynamo"
        from torch._dynamo.device_interface import get_interface_for_device
        from torch._inductor.codegen.common import get_scheduling_for_device
        import torch._inductor.codegen.cpp, torch._inductor.codegen.wrapper
        print(get_interface_for_device("openreg").__name__,
              get_scheduling_for_device("openreg").__name__,
              "openreg" in torch._dynamo.list_backends())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OpenRegInterface", "OpenRegScheduling", "True"]


def test_registration_when_dynamo_was_imported_first():
    # Without autoload, a user may import torch._dynamo before torch_openreg.
    result = run_python("""
        import torch, torch._dynamo, torch._inductor.codegen.wrapper, torch._inductor.codegen.cpp
        import torch_openreg
        f = torch.compile(lambda x: x.sin() + 1)
        x = torch.randn(5, device="openreg:1")
        print(torch.allclose(f(x).cpu(), x.cpu().sin() + 1), f(x).device)
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "openreg:1"]


def test_device_interface():
    iface = get_interface_for_device("openreg")
    assert get_interface_for_device("openreg:1") is iface
    assert iface.is_available() and iface.device_count() == torch.openreg.device_count()
    assert iface.current_device() == torch.openreg.current_device()
    previous = iface.exchange_device(1)
    try:
        assert iface.current_device() == 1
    finally:
        iface.maybe_exchange_device(previous)
    assert iface.current_device() == previous
    with iface.device(1):
        assert torch.openreg.current_device() == 1
    props = iface.get_device_properties(1)
    assert props.total_memory > 0 and iface.Worker.get_device_properties(1) == props
    major, minor = torch.openreg.get_device_capability()
    assert iface.get_compute_capability() == major * 10 + minor
    assert iface.is_bf16_supported() and iface.is_dtype_supported(torch.bfloat16)
    assert not iface.is_triton_capable()

    stream = iface.Stream(device=1)
    assert isinstance(stream, torch.Stream) and stream.device == torch.device("openreg:1")
    with iface.stream(stream):
        assert iface.current_stream(1) == stream
        assert iface.get_raw_stream(1) == stream.stream_id
    event = iface.Event()
    assert isinstance(event, torch.Event)
    event.record(stream)
    iface.synchronize(1)
    assert event.query()

    before = iface.memory_allocated(1)
    x = torch.empty(1024, device="openreg:1")
    assert iface.memory_allocated(1) == before + x.nbytes


def test_openreg_dynamo_backend_is_listed_and_generates_code():
    assert "openreg" in torch._dynamo.list_backends()
    x = torch.randn(4, 4, device="openreg")
    out, (code,) = run_and_get_code(torch.compile(lambda x: x.exp() * 2, backend="openreg"), x)
    assert "cpp_fused" in code and out.device == x.device
    torch.testing.assert_close(out.cpu(), x.cpu().exp() * 2)


# ---- Dynamo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamo_backends_forward_and_backward(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    cpu_model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    cpu_model.load_state_dict(model.state_dict())
    model.to("openreg:1")
    x = torch.randn(5, 6)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    out = torch.compile(model, backend=counter)(x.to("openreg:1"))
    out.sum().backward()
    ref = cpu_model(x)
    ref.sum().backward()
    assert counter.frame_count == 1
    assert out.device == torch.device("openreg:1")
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    for p, cp in zip(model.parameters(), cpu_model.parameters()):
        assert p.grad.device == torch.device("openreg:1")
        torch.testing.assert_close(p.grad.cpu(), cp.grad, rtol=1e-4, atol=1e-5)


def test_recompiles_on_shape_and_device_change():
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(lambda x: (x * 2).sum(), backend=counter, dynamic=False)
    f(torch.ones(3, device="openreg:0"))
    f(torch.ones(3, device="openreg:0"))
    assert counter.frame_count == 1
    f(torch.ones(4, device="openreg:0"))
    assert counter.frame_count == 2  # shape guard
    out = f(torch.ones(4, device="openreg:1"))
    assert counter.frame_count == 3  # device guard
    assert out.device == torch.device("openreg:1") and out.item() == 8


def test_graph_breaks_on_print_and_item(capsys):
    counter = torch._dynamo.testing.CompileCounter()

    def f(x):
        y = x.relu() * 3
        print("between graphs")
        scale = y.sum().item()
        return y / scale

    x = torch.randn(6, device="openreg")
    out = torch.compile(f, backend=counter)(x)
    assert counter.frame_count >= 2  # one graph before the print, one after
    assert "between graphs" in capsys.readouterr().out
    torch.testing.assert_close(out.cpu(), f(x.cpu()))


def test_fake_tensors_keep_openreg_devices():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        a = mode.from_tensor(torch.randn(2, 3, device="openreg:1"))
        b = torch.ones(3, 4, device="openreg:1")
        c = a @ b
    assert a.device == c.device == torch.device("openreg:1") and c.shape == (2, 4)
    with pytest.raises(RuntimeError, match="device"):
        with FakeTensorMode() as mode:
            mode.from_tensor(torch.randn(2, device="openreg:0")) + \
                mode.from_tensor(torch.randn(2, device="openreg:1"))


# ---- Inductor ----------------------------------------------------------------------------------

class _Cycle:
    pass


@pytest.mark.parametrize("garbage_before", [False, True])
def test_inductor_generates_kernels_that_run_on_device_memory(garbage_before):
    def f(x, y):
        return (x * y + 1).relu().sum(0), torch.tanh(x) @ y.t()

    if garbage_before:  # device memory held by a reference cycle, as an earlier test may leave
        cycle = _Cycle()
        cycle.me, cycle.memory = cycle, torch.empty(512, device="openreg:0")
        del cycle
    x, y = torch.randn(8, 16, device="openreg:1"), torch.randn(8, 16, device="openreg:1")
    # settled: compiling runs the garbage collector, which may free what earlier tests left
    before0, before1 = settled_memory_allocated(0), settled_memory_allocated(1)
    (a, b), (code,) = run_and_get_code(torch.compile(f), x, y)
    # Generated C++ kernels, launched on openreg:1 in stream order, buffers from its allocator.
    assert "cpp_fused" in code and "extern \"C\"" in code
    assert "with openreg_launch_1: cpp_fused" in code
    assert "empty_strided_openreg(" in code and "device='cpu'" not in code
    assert "empty_strided_cpu(" not in code.split("def call")[1]
    assert a.device == b.device == torch.device("openreg:1")
    ra, rb = f(x.cpu(), y.cpu())
    torch.testing.assert_close(a.cpu(), ra)
    torch.testing.assert_close(b.cpu(), rb)
    # The outputs are counted by the device allocator (blocks of 512 bytes), temporaries freed.
    assert torch.openreg.memory_allocated(1) == before1 + 512 + 512
    assert torch.openreg.memory_allocated(0) == before0
    del a, b
    assert torch.openreg.memory_allocated(1) == before1


def test_compiled_kernel_waits_for_the_stream():
    # A non_blocking copy queued on the stream has not landed while the stream is held; a
    # compiled kernel issued after it must wait for it, like an eager kernel does.
    f = torch.compile(lambda x: x * 2 + 1)
    x = torch.zeros(1000, device="openreg:0")
    f(x)  # compiled outside the hold
    host = torch.arange(1000.0).pin_memory()
    result = {}
    with hold_stream():
        x.copy_(host, non_blocking=True)
        worker = threading.Thread(target=lambda: result.setdefault("y", f(x)))
        worker.start()
        worker.join(0.5)
        waited = worker.is_alive()
    worker.join()
    assert waited, "the compiled kernel ran before the work queued on its stream"
    torch.testing.assert_close(result["y"].cpu(), host * 2 + 1)


def test_compiled_code_runs_on_the_current_stream():
    f = torch.compile(lambda x: x + 1)
    x = torch.zeros(4096, device="openreg:0")
    f(x)
    stream = torch.openreg.Stream()
    host = torch.ones(4096).pin_memory()
    with torch.openreg.stream(stream):
        with hold_stream(stream):
            x.copy_(host, non_blocking=True)  # on `stream`, held
            # The default stream is free: nothing there to wait for, and it sees zeros if the
            # kernel were launched there. The kernel belongs to `stream`, so it waits.
            worker = threading.Thread(
                target=lambda: (torch.openreg.set_stream(stream), result.append(f(x))))
            result = []
            worker.start()
            worker.join(0.5)
            waited = worker.is_alive()
        worker.join()
    assert waited
    torch.testing.assert_close(result[0].cpu(), host + 1)


def test_generated_kernels_of_backward_are_device_thread_kernels():
    # The compiled backward runs on the device's autograd thread; its generated kernels are that
    # thread's kernels, like eager ones: counted (benchmarks' --phases) and placed by the same
    # hook (docs/autograd.md). This backward has generated kernels only: no extern kernel, and
    # the seed gradient is made on this thread.
    from torch_openreg import _C

    f = torch.compile(lambda x: (x.sin() * 2).sum())
    x = torch.randn(4096, device="openreg:0", requires_grad=True)
    _, (_, backward_code) = run_and_get_code(lambda: f(x).backward())
    assert "openreg_launch_0" in backward_code and "extern_kernels." not in backward_code
    x.grad = None
    _C._reset_device_thread_stats()
    try:
        f(x).backward()
        stats = _C._device_thread_stats()
    finally:
        _C._reset_device_thread_stats(False)
    torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu().cos())
    assert stats["kernels"] >= 1
    assert 0 < stats["busy_ns"] <= stats["last_end_ns"] - stats["first_start_ns"]


def test_control_flow_subgraphs():
    # torch.cond lowers its branches with Inductor's subgraph wrappers.
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: (x * 2).sin(), lambda x: (x - 1).cos(), (x,))

    g = torch.compile(f)
    x = torch.rand(6, device="openreg:1") + 0.1
    out, (code,) = run_and_get_code(g, x)
    assert "with openreg_launch_1: cpp_fused" in code and out.device == x.device
    torch.testing.assert_close(out.cpu(), f(x.cpu()))
    torch.testing.assert_close(g(-x).cpu(), f(-x.cpu()))


def test_loop_transforms_are_off_for_openreg_graphs_only():
    """Three loop transformations of Inductor's fusion pass that C++ kernels do not support are
    turned off while a graph with openreg nodes is fused (compile.py, OpenRegScheduling); a CPU
    graph of the same process, compiled before or after, is fused with torch's settings."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    names = ("loop_ordering_after_fusion", "loop_reindexing_after_fusion",
             "loop_index_inversion_in_fusion")
    defaults = tuple(config._config[n].default for n in names)  # torch's, env included
    seen = set()

    class Recorder(InductorChoices):
        @staticmethod
        def can_fuse(scheduler, node1, node2, shared_data_score):
            seen.add((node1.get_device().type, tuple(getattr(config, n) for n in names)))
            return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

    def f(x):
        return (x.sin() * 2).sum(1) + x.cos().sum(1)

    # no cache: the scheduler must run for every graph
    with V.set_choices_handler(Recorder()), config.patch(fx_graph_cache=False):
        for device in ("cpu", "openreg:1", "cpu"):
            torch._dynamo.reset()
            x = torch.rand(8, 16, device=device)
            torch.testing.assert_close(torch.compile(f)(x).cpu(), f(x.cpu()))
    assert seen == {("cpu", defaults), ("openreg", (False, False, False))}, seen
    assert tuple(getattr(config, n) for n in names) == defaults


def test_bool_buffers_are_stored_and_loaded_as_bytes_in_openreg_graphs_only():
    """A training forward through relu saves the bool mask for the backward. openreg kernels
    store and load contiguous bool buffers as bytes with whole-vector conversions
    (compile.py, BOOL_VECTORS) instead of ``VecMask::store(bool*)`` / ``VecMask::from(bool*)``,
    which go lane by lane (docs/compile.md, Speed); a CPU graph keeps torch's code."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert pick_vec_isa(), "Inductor found no vector ISA: its vectorized C++ kernels are not used"
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(16, 48), nn.ReLU())
    x = torch.randn(37, 16)
    codes, grads = {}, {}
    with config.patch(fx_graph_cache=False):  # the code generators must run
        for device in ("openreg:1", "cpu"):
            torch._dynamo.reset()
            model = nn.Sequential(nn.Linear(16, 48), nn.ReLU()).to(device)
            model.load_state_dict(cpu_model.state_dict())
            step = torch.compile(model)  # relu's output leaves the graph, its mask is saved
            _, codes[device] = run_and_get_code(
                lambda: step(x.to(device)).square().sum().backward())
            grads[device] = model[0].weight.grad.cpu()
    cpu_model(x).square().sum().backward()
    torch.testing.assert_close(grads["openreg:1"], cpu_model[0].weight.grad)
    torch.testing.assert_close(grads["cpu"], cpu_model[0].weight.grad)
    forward, backward = codes["openreg:1"]
    assert "bool* out_ptr" in forward and "bool* in_ptr" in backward  # the saved mask
    assert "at::vec::convert<int8_t,1,float,1>(" in forward
    assert "at::vec::Vectorized<int8_t>::loadu(" in backward
    cpu_forward, cpu_backward = codes["cpu"]
    assert "bool* out_ptr" in cpu_forward and "convert<int8_t" not in cpu_forward
    assert "Vectorized<int8_t>::loadu" not in cpu_backward

    # The bytes equal the CPU's (0 or 1), for tails, int64 comparisons, bool inputs, vertical
    # bool reductions, and masks of two vectors (bf16 kernels).
    def f(x, i, m):
        return (x > 0.1, i * 3 > 7, torch.where(m, x, -x), (m & (x > 0)) | ~m, m.any(0),
                (x > 0).all(0), (x > 0).t().contiguous())

    def g(h, m):
        return (h.float() > 0) & m, torch.where(m, h, h * 2)

    x, m = torch.randn(37, 53), torch.randn(37, 53) > 0
    cases = ((f, (x, torch.randint(-5, 5, (37, 53)), m), "convert<int8_t,1,float,1>"),
             (g, (torch.randn(37, 53, dtype=torch.bfloat16), m), "convert<int8_t,1,float,2>"))
    for fn, args, store in cases:
        with config.patch(fx_graph_cache=False):
            outs, (code,) = run_and_get_code(torch.compile(fn),
                                             *(a.to("openreg:0") for a in args))
        assert store in code and "Vectorized<int8_t>::loadu" in code
        for out, ref in zip(outs, fn(*args)):
            assert out.device == torch.device("openreg:0")
            if ref.dtype == torch.bool:
                assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
            else:
                torch.testing.assert_close(out.cpu(), ref)


def test_strided_pooling_kernels_are_vectorized_in_openreg_graphs_only():
    """Max pooling with indices over NCHW reads its windows with stride 2: 15% of the kernel's
    operations, above Inductor's CPU limit of 12%, under openreg's 18% (compile.py,
    STRIDED_LOADS). The openreg kernel is vectorized, the same NCHW graph on the CPU is not, and
    the pooled values, their indices (through the backward) and the gradients equal the CPU's."""
    from torch._inductor import config
    from torch._inductor.codegen.cpp import KernelOpStats

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                              nn.MaxPool2d(2))
    x = torch.randn(2, 3, 4, 32)  # 16 pooled columns: one whole vector
    limit = KernelOpStats.OVERHEAD_RATIO_THRESHOLD
    codes, results = {}, {}
    # The CPU graph without its channels-last layout optimization: the graph openreg compiles.
    with config.patch(fx_graph_cache=False, layout_optimization=False):
        for device in ("openreg:0", "cpu"):
            torch._dynamo.reset()
            model = copy.deepcopy(cpu_model).to(device)
            step = torch.compile(model)

            def run():
                out = step(x.to(device))
                out.square().sum().backward()
                return out

            out, codes[device] = run_and_get_code(run)
            results[device] = [out.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]
    assert KernelOpStats.OVERHEAD_RATIO_THRESHOLD == limit  # torch's value is back
    ref = cpu_model(x)
    ref.square().sum().backward()
    for got in results.values():  # (the convolution's bias gradient is 0 up to rounding)
        for g, r in zip(got, [ref.detach()] + [p.grad for p in cpu_model.parameters()]):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    assert "at::vec::maximum" in codes["openreg:0"][0]  # forward: the pooling kernel
    assert "max_propagate_nan(" in codes["cpu"][0] and "at::vec::maximum" not in codes["cpu"][0]


def test_compile_in_another_thread():
    """Inductor's config is per thread in torch 2.13: openreg's settings must apply to graphs
    compiled in any thread (they were once set by assignment in the importing thread only, and a
    graph compiled in another thread failed in the fusion pass)."""
    import threading

    def f(x, y):
        return (x * y + 1).relu().sum(0), torch.tanh(x) @ y.t()

    x, y = torch.randn(8, 8, device="openreg:1"), torch.randn(8, 8, device="openreg:1")
    result = {}

    def run():
        try:
            torch._dynamo.reset()
            result["out"] = [t.cpu() for t in torch.compile(f)(x, y)]
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    for got, want in zip(result["out"], f(x.cpu(), y.cpu())):
        torch.testing.assert_close(got, want)


def test_streams_inside_compiled_region_are_correct():
    # Side streams inside a compiled function graph-break (docs/compile.md, pitfalls), and the
    # work still runs in the right order.
    side = torch.openreg.Stream(device=0)

    def f(x):
        with torch.openreg.stream(side):
            y = x * 2
        torch.openreg.current_stream().wait_stream(side)
        return y + 1

    x = torch.randn(64, device="openreg:0")
    before = torch.openreg.current_stream(0)
    out = torch.compile(f)(x)
    torch.testing.assert_close(out.cpu(), x.cpu() * 2 + 1)
    # the context restored the stream it replaced (torch 2.15's Dynamo dropped the restore)
    assert torch.openreg.current_stream(0) == before


def test_strict_memory_mode():
    result = run_python("""
        import torch
        f = torch.compile(lambda x, y: (x @ y).relu() * 2 + x.sum())
        x, y = torch.randn(8, 8, device="openreg"), torch.randn(8, 8, device="openreg")
        out = f(x, y)
        ref = (x.cpu() @ y.cpu()).relu() * 2 + x.cpu().sum()
        print(torch.allclose(out.cpu(), ref, atol=1e-5))
        # A host access outside a kernel still faults in strict mode.
        import ctypes
        ctypes.c_float.from_address(out.data_ptr()).value
    """, env={"OPENREG_STRICT_MEMORY": "1"})
    assert result.stdout.split() == ["True"], result.stderr
    assert result.returncode != 0 and "accessed device memory" in result.stderr


# ---- models ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "cnn_batchnorm", "transformer_encoder"])
def test_model_forward_backward_matches_cpu(name):
    factory, data, loss_fn, _ = MODELS[name]
    torch.manual_seed(0)
    cpu_model = factory()
    model = factory().to("openreg:1")
    model.load_state_dict(cpu_model.state_dict())
    x, y = data()
    step = torch.compile(lambda x, y: loss_fn(model(x), y))

    def train_step():
        loss = step(x.to("openreg:1"), y.to("openreg:1"))
        loss.backward()
        return loss

    loss, codes = run_and_get_code(train_step)
    assert len(codes) == 2  # forward and backward
    for code in codes:
        assert "with openreg_launch_1: cpp_fused" in code
    ref = loss_fn(cpu_model(x), y)
    ref.backward()
    assert loss.device == torch.device("openreg:1")
    torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    for (pname, p), cp in zip(model.named_parameters(), cpu_model.parameters()):
        assert p.grad.device == torch.device("openreg:1"), pname
        torch.testing.assert_close(p.grad.cpu(), cp.grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{pname}: {m}")


def conv_layouts(x, w, b):
    """Strides of a convolution's output and of its input/weight/bias gradients."""
    out = torch.ops.aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    grads = torch.ops.aten.convolution_backward(torch.ones_like(out), x, w, [w.shape[0]], [1, 1],
                                                [1, 1], [1, 1], False, [0, 0], 1,
                                                [True, True, True])
    return [t.stride() for t in (out, *grads)]


@pytest.mark.parametrize("weight_format", [torch.contiguous_format, torch.channels_last])
def test_convolution_layouts_are_the_fake_tensor_prediction(weight_format):
    # Compiled code never runs the kernel to learn its layouts: FakeTensor predicts them, and
    # Inductor asserts that the real strides match. For openreg tensors the prediction is the
    # CPU's (torch's own would be NCHW for any PrivateUse1 device, docs/privateuse1_gaps.md), and
    # so are the kernels' layouts: channels-last stays channels-last.
    from torch._subclasses import FakeTensorMode
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).to(memory_format=weight_format)
    b = torch.randn(4)
    for device in ("openreg", "cpu"):
        real = [t.to(device) for t in (x, w, b)]
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in real]
        with mode:
            predicted = conv_layouts(*fakes)
            out = torch.ops.aten.convolution(*fakes, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
            assert out.device == real[0].device
        assert conv_layouts(*real) == predicted
        assert predicted[0] == (144, 1, 24, 4)  # channels-last, as on the CPU


@pytest.mark.parametrize("case", ["conv2d", "conv2d_weight_channels_last", "conv_transpose2d",
                                  "conv3d"])
def test_compiled_convolution_returns_the_cpus_layout(case):
    # A compiled convolution of a channels-last input: Inductor allocates and asserts the layout
    # FakeTensor predicts (the CPU's, torch_openreg/compile.py FAKE_CONVOLUTION), and the kernel
    # returns it. Before, with the kernels already returning the CPU's layout and torch's own
    # prediction (NCHW), the generated code failed: "expected size 4==4, stride 1==36 at dim=1".
    torch.manual_seed(0)
    cl = torch.channels_last_3d if case == "conv3d" else torch.channels_last
    x = torch.randn((2, 3, 5, 8, 8) if case == "conv3d" else (2, 3, 8, 8)).to(memory_format=cl)
    w = torch.randn((4, 3, 3, 3, 3) if case == "conv3d" else (4, 3, 3, 3) if case != "conv_transpose2d"
                    else (3, 4, 3, 3))
    if case == "conv2d_weight_channels_last":
        x, w = x.contiguous(), w.to(memory_format=torch.channels_last)
    fn = {"conv3d": F.conv3d, "conv_transpose2d": F.conv_transpose2d}.get(case, F.conv2d)

    def f(x, w):
        return fn(x, w).relu()

    ref = f(x, w)
    torch._dynamo.reset()
    got = torch.compile(f)(x.to("openreg"), w.to("openreg"))
    assert (got.shape, got.stride()) == (ref.shape, ref.stride())
    assert ref.stride() != ref.contiguous().stride()  # channels-last, as on the CPU
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_channels_last_cnn_training_step_matches_eager(backend):
    # docs/compile.md pitfall 11: this failed in the backward (convolution_backward's strides),
    # and fails again if the kernels return the CPU's layouts while FakeTensor predicts NCHW.
    # Inductor's layout optimization, which it turns on by itself for larger convolution models
    # (the benchmarks' SmallCNN), keeps the activations channels-last, so the convolution kernels
    # receive channels-last tensors; forced here so that the model can stay small.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
                          nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
    model = model.to("openreg").to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).to("openreg")
    x.requires_grad_()

    def grads(fn):
        model.zero_grad()
        x.grad = None
        loss = fn(x).square().mean()
        loss.backward()
        return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]

    ref = grads(model)
    with torch._inductor.config.patch(force_layout_optimization=True):
        got = grads(torch.compile(model, backend=backend))
    for g, r in zip(got, ref):
        assert (g.stride(), g.storage_offset()) == (r.stride(), r.storage_offset())
        if backend == "aot_eager":  # the same kernels as eager: the same bits
            assert torch.equal(g.cpu(), r.cpu())
        else:
            torch.testing.assert_close(g.cpu(), r.cpu(), rtol=1e-4, atol=1e-5)


def test_channels_last_cnn_with_dynamic_shapes_matches_cpu():
    # dynamic=True: FakeTensor predicts the convolutions' layouts with symbolic sizes, and
    # Inductor turns its layout optimization off for symbolic convolutions (on every device), so
    # the graph sees channels-last inputs and parameters with NCHW convolution results. One graph
    # for every batch size, generated for openreg with symbolic sizes, forward and backward.
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Conv2d(8, 4, 3, padding=1), nn.Flatten(),
                              nn.Linear(4 * 4 * 4, 5)).to(memory_format=torch.channels_last)
    model = copy.deepcopy(cpu_model).to("openreg")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, dynamic=True, backend=counter)
    for i, batch in enumerate((2, 3, 5)):
        x = torch.randn(batch, 3, 8, 8).to(memory_format=torch.channels_last)
        xo = x.to("openreg").requires_grad_()
        xc = x.clone().requires_grad_()

        def step():
            loss = compiled(xo).square().mean()
            loss.backward()
            return loss

        if i == 0:
            loss, codes = run_and_get_code(step)
            frames = counter.frame_count
            assert len(codes) == 2  # forward and backward
            for code in codes:
                assert "openreg_launch_0" in code and "empty_strided_openreg" in code
                assert "ks0" in code or "s0" in code  # sizes are symbols, not 2
        else:
            loss = step()
            assert counter.frame_count == frames  # no recompilation for another batch size
        ref = cpu_model(xc).square().mean()
        ref.backward()
        torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xo.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), cpu_model.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
            p.grad = q.grad = None
        for b, c in zip(model.buffers(), cpu_model.buffers()):  # BatchNorm running statistics
            torch.testing.assert_close(b.cpu(), c, rtol=1e-4, atol=1e-5)


def test_tiny_transformers_model_matches_cpu(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers  # installed by the Makefile
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0,
                                     tie_word_embeddings=False)  # ties: see docs/compile.md
    torch.manual_seed(0)
    cpu_model = transformers.GPT2LMHeadModel(config)
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(cpu_model.state_dict())
    model.to("openreg:0")
    ids = torch.randint(0, 64, (2, 8))
    out = torch.compile(model)(ids.to("openreg:0"), labels=ids.to("openreg:0"))
    out.loss.backward()
    ref = cpu_model(ids, labels=ids)
    ref.loss.backward()
    assert out.logits.device == torch.device("openreg:0")
    torch.testing.assert_close(out.logits.detach().cpu(), ref.logits.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss.detach().cpu(), ref.loss.detach())
    for (name, p), cp in zip(model.named_parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), cp.grad, rtol=1e-3, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


# ---- what users compile ------------------------------------------------------------------------

def test_compiled_optimizer_step_matches_eager():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(3)]
    grads = [torch.randn(5, 3), torch.randn(3)]

    def make(device):
        ps = [p.clone().to(device).requires_grad_() for p in params]
        for p, g in zip(ps, grads):
            p.grad = g.to(device)
        return ps, torch.optim.Adam(ps, lr=0.1)

    ps, opt = make("openreg:1")
    cpu_ps, cpu_opt = make("cpu")
    step = torch.compile(opt.step)
    _, codes = run_and_get_code(step)
    step()
    cpu_opt.step()
    cpu_opt.step()
    assert any("with openreg_launch_1: cpp_fused" in code for code in codes)
    for p, cp in zip(ps, cpu_ps):
        assert p.device == torch.device("openreg:1")
        torch.testing.assert_close(p.detach().cpu(), cp.detach())
    for state, cpu_state in zip(opt.state.values(), cpu_opt.state.values()):
        torch.testing.assert_close(state["exp_avg"].cpu(), cpu_state["exp_avg"])


def test_dynamic_shapes():
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    f = torch.compile(lambda x: (x * 2).relu().sum(0), dynamic=True, backend=counter)
    for n in (3, 7):
        x = torch.randn(n, 5, device="openreg")
        torch.testing.assert_close(f(x).cpu(), (x.cpu() * 2).relu().sum(0))
    assert counter.frame_count == 1

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    g = torch.compile(lambda x: x.cos() * x.shape[0], backend=counter)  # automatic dynamic
    for n in (3, 4, 5, 6):
        x = torch.randn(n, device="openreg")
        torch.testing.assert_close(g(x).cpu(), x.cpu().cos() * n)
    assert counter.frame_count == 2  # static first, then one dynamic graph for all sizes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_inside_compiled_region(dtype):
    def f(x, w):
        with torch.autocast("openreg", dtype=dtype):
            return (x @ w).relu() + 1

    x, w = torch.randn(8, 8, device="openreg"), torch.randn(8, 8, device="openreg")
    out, (code,) = run_and_get_code(torch.compile(f), x, w)
    assert out.dtype == dtype and out.device == x.device and "cpp_fused" in code
    torch.testing.assert_close(out.cpu(), f(x, w).cpu())
    with torch.autocast("cpu", dtype=dtype):
        ref = (x.cpu() @ w.cpu()).relu() + 1
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-2)


def test_random_ops_draw_from_the_device_generator():
    f = torch.compile(lambda x: F.dropout(x, 0.5) + torch.rand_like(x))
    x = torch.ones(256, device="openreg:1")

    def run(seed):
        with torch.openreg.device(1):
            torch.openreg.manual_seed(seed)
        return f(x).cpu()

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = (a >= 1).float().mean().item()  # dropout keeps ~half, scaled by 2
    assert 0.3 < kept < 0.7
    # They draw from the openreg generator, not from the CPU's: reseeding the CPU generator
    # changes nothing, and drawing leaves the CPU generator's state as it was.
    torch.default_generator.manual_seed(12345)
    cpu_state = torch.get_rng_state()
    assert torch.equal(run(3), a)
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_custom_ops_inside_compiled_region():
    x = torch.randn(5, device="openreg", requires_grad=True)
    f = torch.compile(lambda x: torch.ops.openreg.custom_abs(x * 2) + 1, fullgraph=True)
    out, codes = run_and_get_code(f, x)
    out.sum().backward()
    assert "torch.ops.openreg.custom_abs" in codes[0]
    xc = x.detach().cpu().requires_grad_()
    ref = (xc * 2).abs() + 1
    ref.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    torch.testing.assert_close(x.grad.cpu(), xc.grad)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes(mode):
    # reduce-overhead: CUDA graphs apply to CUDA only; Inductor runs the generated code without
    # them for openreg. max-autotune: the matmul choices Inductor benchmarks for the device.
    f = torch.compile(lambda x, w: (x @ w).relu() + x.sin(), mode=mode)
    x, w = torch.randn(16, 16, device="openreg:1"), torch.randn(16, 16, device="openreg:1")
    for _ in range(3):
        out = f(x, w)
        assert out.device == torch.device("openreg:1")
        torch.testing.assert_close(out.cpu(), (x.cpu() @ w.cpu()).relu() + x.cpu().sin(),
                                   rtol=1e-4, atol=1e-4)


def test_export_runs_on_openreg():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("openreg:1")
    x = torch.randn(3, 4, device="openreg:1")
    ep = torch.export.export(model, (x,))
    assert isinstance(ep, torch.export.ExportedProgram)
    assert all(p.device == torch.device("openreg:1") for p in ep.state_dict.values())
    out = ep.module()(x)
    assert out.device == torch.device("openreg:1")
    torch.testing.assert_close(out.cpu(), model.cpu()(x.cpu()))


def test_compile_error_names_the_generated_source():
    from torch._inductor import config

    f = torch.compile(lambda x: torch.relu(x) + 1)
    with config.patch({"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"}):
        with pytest.raises(Exception, match="C\\+\\+ compile error") as info:
            f(torch.randn(4, device="openreg"))
    paths = [w for w in str(info.value).split() if w.endswith(".cpp")]
    assert paths and os.path.exists(paths[0])
    assert "compile error!" in open(paths[0]).read()  # the injected bug is in that file
