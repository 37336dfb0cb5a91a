"""The stream sanitizer (torch_openreg/sanitizer.py, docs/sanitizer.md): a catalogue of small
programs with a missing synchronization, each flagged with the right operators and streams, and
each also written correctly, on which the sanitizer stays silent.
"""

import gc
import os
import subprocess
import sys

import pytest
import torch

from torch_openreg import sanitizer
from torch_openreg.sanitizer import StreamSanitizerError

N = 4096


@pytest.fixture
def sanitize():
    torch.openreg.synchronize()
    sanitizer.enable()
    try:
        yield
    finally:
        sanitizer.disable()
        torch.openreg.synchronize()


def side_stream():
    return torch.Stream(device="openreg:0")


def default_stream():
    return torch.openreg.current_stream(0)


def flagged(excinfo, current_op, current_stream, previous_op, previous_stream):
    errors = excinfo.value.errors
    assert len(errors) >= 1
    e = errors[0]
    assert current_op in e.current.operator, str(e)
    assert previous_op in e.previous.operator, str(e)
    assert e.current.stream == current_stream, str(e)
    assert e.previous.stream == previous_stream, str(e)
    return e


def handle(stream):
    return -1 if stream == "host" else (stream.device_index << 16) | stream.stream_id


# ---------------------------------------------------------------- read after write

def test_read_after_write_across_streams_is_flagged(sanitize):
    x = torch.ones(N, device="openreg")
    side = side_stream()
    with pytest.raises(StreamSanitizerError) as excinfo:
        with torch.openreg.stream(side):
            x * 2
    e = flagged(excinfo, "mul", handle(side), "ones", handle(default_stream()))
    assert not e.current.write and e.previous.write
    assert not e.use_after_free
    text = str(excinfo.value)
    # the allocation, both streams, both operators, both stack traces (this file, twice)
    assert f"0x{x.untyped_storage().data_ptr():x}" in text
    assert f"stream {side.stream_id} of openreg:0" in text
    assert "the default stream of openreg:0" in text
    assert "aten::mul.Tensor" in text and "aten::ones" in text
    assert text.count("test_sanitizer.py") >= 3  # new access, earlier access, allocation


@pytest.mark.parametrize("how", ["wait_stream", "event", "synchronize"])
def test_read_after_write_synchronized_is_silent(sanitize, how):
    x = torch.ones(N, device="openreg")
    side = side_stream()
    if how == "wait_stream":
        side.wait_stream(default_stream())
    elif how == "event":
        e = torch.Event(device="openreg")
        e.record(default_stream())
        side.wait_event(e)
    else:
        torch.openreg.synchronize()
    with torch.openreg.stream(side):
        y = x * 2
    default_stream().wait_stream(side)
    assert torch.equal(y.cpu(), torch.full((N,), 2.0))


# ---------------------------------------------------------------- write after read

def test_write_after_read_across_streams_is_flagged(sanitize):
    x = torch.ones(N, device="openreg")
    side = side_stream()
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        y = x.sum()
    with pytest.raises(StreamSanitizerError) as excinfo:
        x.add_(1)
    e = flagged(excinfo, "add_", handle(default_stream()), "sum", handle(side))
    assert e.current.write and not e.previous.write
    del y


def test_write_after_read_synchronized_is_silent(sanitize):
    x = torch.ones(N, device="openreg")
    side = side_stream()
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        y = x.sum()
    default_stream().wait_stream(side)
    x.add_(1)
    assert y.item() == N
    assert torch.equal(x.cpu(), torch.full((N,), 2.0))


def test_write_after_write_across_streams_is_flagged(sanitize):
    x = torch.ones(N, device="openreg")
    side = side_stream()
    with pytest.raises(StreamSanitizerError) as excinfo:
        with torch.openreg.stream(side):
            x.zero_()
    flagged(excinfo, "zero_", handle(side), "ones", handle(default_stream()))


# ---------------------------------------------------------------- use after free

@pytest.fixture(params=["as_left", "fragmented"])
def cache_state(request):
    """The caching allocator as earlier tests left it, or with twelve free 1 MiB pieces in
    segments still in use, which the freed block comes after (it gets a segment of its own):
    the order in which an earlier run met a fragmented cache."""
    if request.param == "as_left":
        yield None
        return
    holes = [torch.empty(1 << 18, device="openreg") for _ in range(24)]
    del holes[0::2]  # 1 MiB free beside each 1 MiB kept, two per 2 MiB segment
    fill = [torch.empty(1 << 18, device="openreg") for _ in range(12)]
    yield fill  # the test's first tensor goes to a new segment; the free pieces come back now
    holes.clear()


def _use_on_side_then_free(record: bool, cache_state=None):
    x = torch.ones(N, device="openreg")
    if cache_state is not None:
        cache_state.clear()
    ptr = x.untyped_storage().data_ptr()
    side = side_stream()
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        y = x * 3  # the side stream reads x
    if record:
        x.record_stream(side)
    del x  # freed on the default stream's pool while `side` may still read it
    return ptr, side, y


def _allocate_until_reused(ptr, keep):
    """Allocates tensors of the freed tensor's size on the default stream, keeping them alive,
    until the caching allocator hands out memory of the freed block. The allocator serves a
    request from the smallest cached block that fits, so the free pieces that earlier tests left
    smaller than the block `ptr` went back into come first: as many allocations as the cached
    bytes hold. And the freed block may have merged with a free piece before it: the memory comes
    back at another address, overlapping it (in another order of the tests, neither 512
    allocations nor the same address was enough)."""
    cached = torch.openreg.memory_reserved() - torch.openreg.memory_allocated()
    for _ in range(cached // (N * 4) + 2):
        z = torch.zeros(N, device="openreg")
        keep.append(z)
        storage = z.untyped_storage()
        if _overlaps_freed(storage.data_ptr(), storage.nbytes(), ptr):
            return z
    raise AssertionError(f"the freed block was never handed out again ({cached} bytes cached)")


def _overlaps_freed(start, nbytes, ptr):
    """Memory [start, start + nbytes) overlaps the freed tensor's, N floats at ptr."""
    return start < ptr + N * 4 and ptr < start + nbytes


def test_use_after_free_across_streams_is_flagged(sanitize, cache_state):
    ptr, side, y = _use_on_side_then_free(record=False, cache_state=cache_state)
    keep = []
    with pytest.raises(StreamSanitizerError) as excinfo:
        _allocate_until_reused(ptr, keep)  # zeros writes the block `side` may still read
    e = flagged(excinfo, "zeros", handle(default_stream()), "mul", handle(side))
    assert e.use_after_free
    assert e.previous.allocation.ptr == ptr
    assert _overlaps_freed(e.allocation.ptr, e.allocation.size, ptr)
    text = str(excinfo.value)
    assert "use after free" in text and "freed at" in text
    del y


def test_use_after_free_with_record_stream_is_silent(sanitize, cache_state):
    ptr, side, y = _use_on_side_then_free(record=True, cache_state=cache_state)
    keep = []
    z = _allocate_until_reused(ptr, keep)
    z.add_(1)
    default_stream().wait_stream(side)
    assert torch.equal(y.cpu(), torch.full((N,), 3.0))


def test_use_after_free_after_wait_stream_is_silent(sanitize, cache_state):
    ptr, side, y = _use_on_side_then_free(record=False, cache_state=cache_state)
    default_stream().wait_stream(side)  # before the free would have been enough too
    keep = []
    z = _allocate_until_reused(ptr, keep)
    z.add_(1)


def test_reuse_on_the_same_stream_is_silent(sanitize):
    for _ in range(5):
        x = torch.ones(N, device="openreg")
        y = (x * 2).sum()
        del x
        assert y.item() == 2 * N


def _prefetch_loop(wait: bool, record: bool, steps: int = 3):
    """The input pipeline of a training loop: each batch is copied on a side stream, then used on
    the default stream; the batch's memory comes from the side stream's pool."""
    torch.manual_seed(0)
    w = torch.randn(32, 8, device="openreg")
    copy = side_stream()
    results = []
    for _ in range(steps):
        batch = torch.randn(16, 32).pin_memory()
        with torch.openreg.stream(copy):
            x = batch.to("openreg", non_blocking=True)
        if wait:
            default_stream().wait_stream(copy)
        if record:
            x.record_stream(default_stream())
        results.append((x @ w).sum())  # no item(): the host does not wait for the device
    torch.openreg.synchronize()
    return [r.item() for r in results]


def test_prefetch_without_wait_stream_is_flagged(sanitize):
    with pytest.raises(StreamSanitizerError) as excinfo:
        _prefetch_loop(wait=False, record=True)
    side = excinfo.value.errors[0].previous.stream
    flagged(excinfo, "mm", handle(default_stream()), "_to_copy", side)


def test_prefetch_without_record_stream_is_a_use_after_free(sanitize):
    with pytest.raises(StreamSanitizerError) as excinfo:
        _prefetch_loop(wait=True, record=False)
    e = excinfo.value.errors[0]
    assert e.use_after_free
    assert "_to_copy" in e.current.operator and e.current.stream != handle(default_stream())
    assert "mm" in e.previous.operator and e.previous.stream == handle(default_stream())


def test_prefetch_written_correctly_is_silent_and_pinned_buffers_are_reused(sanitize):
    got = _prefetch_loop(wait=True, record=True, steps=5)
    sanitizer.disable()
    try:
        assert got == _prefetch_loop(wait=True, record=True, steps=5)
    finally:
        sanitizer.enable()


# ---------------------------------------------------------------- non_blocking copies and the host

def test_reading_a_non_blocking_device_to_host_copy_before_synchronizing_is_flagged(sanitize):
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = torch.empty(N, pin_memory=True)
    host.copy_(x, non_blocking=True)
    with pytest.raises(StreamSanitizerError) as excinfo:
        host.sum()
    flagged(excinfo, "sum", -1, "copy_", handle(default_stream()))
    assert "the host" in str(excinfo.value)


@pytest.mark.parametrize("how", ["synchronize", "stream", "event"])
def test_reading_a_non_blocking_copy_after_synchronizing_is_silent(sanitize, how):
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = torch.empty(N, pin_memory=True)
    host.copy_(x, non_blocking=True)
    if how == "synchronize":
        torch.openreg.synchronize()
    elif how == "stream":
        default_stream().synchronize()
    else:
        e = torch.Event(device="openreg")
        e.record()
        e.synchronize()
    assert host.sum().item() == sum(range(N))


def test_to_cpu_non_blocking_read_early_is_flagged(sanitize):
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = x.to("cpu", non_blocking=True)
    assert host.is_pinned()  # as on CUDA: the copy lands later, into pinned memory
    with pytest.raises(StreamSanitizerError):
        host.max()


def read_in_another_thread(read):
    """Runs read() in a new host thread; returns what it raised (or None)."""
    import threading
    raised = []

    def body():
        try:
            read()
        except Exception as e:  # noqa: BLE001 - handed to the test
            raised.append(e)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return raised[0] if raised else None


def test_a_non_blocking_copy_read_from_another_host_thread_before_synchronizing_is_flagged(
        sanitize):
    # One thread copies to the host without waiting, another reads the result: nothing orders
    # the read after the copy. Threads started after enable() are checked too.
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = x.to("cpu", non_blocking=True)
    error = read_in_another_thread(lambda: host.sum())
    assert isinstance(error, StreamSanitizerError), error
    e = error.errors[0]
    assert "sum" in e.current.operator and e.current.stream == -1
    assert "copy" in e.previous.operator and e.previous.stream == handle(default_stream())


@pytest.mark.parametrize("who", ["copying thread", "reading thread"])
def test_a_non_blocking_copy_read_from_another_host_thread_after_synchronizing_is_silent(
        sanitize, who):
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = x.to("cpu", non_blocking=True)
    done = torch.Event(device="openreg")
    done.record()
    if who == "copying thread":
        done.synchronize()
        read = lambda: host.sum().item()  # noqa: E731
    else:
        read = lambda: (done.synchronize(), host.sum().item())  # noqa: E731
    assert read_in_another_thread(read) is None
    assert host.sum().item() == sum(range(N))


def test_overwriting_the_source_of_an_in_flight_host_to_device_copy_is_flagged(sanitize):
    host = torch.ones(N).pin_memory()
    dev = host.to("openreg", non_blocking=True)
    with pytest.raises(StreamSanitizerError) as excinfo:
        host.fill_(2)  # the copy engine may not have read it yet
    e = flagged(excinfo, "fill_", -1, "_to_copy", handle(default_stream()))
    assert e.current.write and not e.previous.write
    del dev


def test_overwriting_the_source_after_synchronizing_is_silent(sanitize):
    host = torch.ones(N).pin_memory()
    dev = host.to("openreg", non_blocking=True)
    torch.openreg.current_stream().synchronize()
    host.fill_(2)
    assert torch.equal(dev.cpu(), torch.ones(N))


def test_blocking_copies_and_item_synchronize_the_host(sanitize):
    x = torch.arange(N, dtype=torch.float32, device="openreg")
    host = torch.empty(N, pin_memory=True)
    host.copy_(x, non_blocking=True)
    x.sum().item()  # the host waited for the stream
    host.add_(1)
    host2 = torch.empty(N, pin_memory=True)
    host2.copy_(x, non_blocking=True)
    x.cpu()  # a blocking copy: the same
    assert host2.sum().item() == sum(range(N))


def test_plain_host_memory_is_not_tracked(sanitize):
    a = torch.ones(N)
    b = a * 2
    b.add_(a)
    assert b.sum().item() == 3 * N


# ---------------------------------------------------------------- autograd, allocators, modes

def test_backward_on_a_side_stream_correct_program_is_silent(sanitize):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = model.to("openreg")
    x = torch.randn(8, 16, device="openreg")
    side = side_stream()
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        loss = model(x).square().sum()
        loss.backward()  # on the device's autograd thread, on the side stream
    default_stream().wait_stream(side)
    grads = [p.grad.cpu() for p in model.parameters()]
    cpu = model.cpu()
    for p in cpu.parameters():
        p.grad = None
    cpu(x.cpu()).square().sum().backward()
    for g, p in zip(grads, cpu.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_backward_reading_a_tensor_written_on_another_stream_is_flagged(sanitize):
    w = torch.randn(16, 4, device="openreg", requires_grad=True)
    x = torch.randn(8, 16, device="openreg")
    loss = (x @ w).sum()  # saves x for the backward pass
    side = side_stream()
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        x.data.mul_(2)  # rewrites x on the side stream (.data: autograd does not see it)
    with pytest.raises(StreamSanitizerError) as excinfo:
        loss.backward()  # mm's backward reads x on the default stream, on the autograd thread
    flagged(excinfo, "mm", handle(default_stream()), "mul_", handle(side))
    default_stream().wait_stream(side)


def test_disable_stops_checking():
    torch.openreg.synchronize()
    sanitizer.enable()
    assert sanitizer.enabled()
    sanitizer.disable()
    assert not sanitizer.enabled()
    x = torch.ones(N, device="openreg")
    with torch.openreg.stream(side_stream()):
        x * 2  # a bug, but nobody is checking
    torch.openreg.synchronize()


def test_environment_variable_enables_it_in_a_script():
    script = (
        "import torch\n"
        "x = torch.ones(100, device='openreg')\n"
        "with torch.openreg.stream(torch.Stream(device='openreg')):\n"
        "    y = x + 1\n"
    )
    env = dict(os.environ, OPENREG_SANITIZE="1")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "StreamSanitizerError" in run.stderr
    assert "aten::add.Tensor" in run.stderr and "aten::ones" in run.stderr
    correct = script.replace("with torch.openreg", "s = torch.Stream(device='openreg')\n"
                             "s.wait_stream(torch.openreg.current_stream())\nwith torch.openreg")
    correct = correct.replace("torch.openreg.stream(torch.Stream(device='openreg'))",
                              "torch.openreg.stream(s)")
    correct += "torch.openreg.current_stream().wait_stream(s)\nprint(y.sum().item())\n"
    run = subprocess.run([sys.executable, "-c", correct], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "200.0\n" and run.stderr == "", run.stderr


def test_copies_between_devices_are_ordered_after_the_source_stream(sanitize):
    x = torch.arange(N, dtype=torch.float32, device="openreg:0")
    y = x.to("openreg:1")  # waits for openreg:0's current stream, runs on openreg:1's
    y.mul_(2)
    x.add_(1)
    assert torch.equal(y.cpu(), torch.arange(N, dtype=torch.float32) * 2)


def test_work_on_another_device_read_without_waiting_is_flagged(sanitize):
    x = torch.ones(N, device="openreg:1")
    with torch.openreg.device(1):
        side = torch.Stream(device="openreg:1")
        with pytest.raises(StreamSanitizerError) as excinfo:
            with torch.openreg.stream(side):
                x.neg()
    flagged(excinfo, "neg", handle(side), "ones", handle(torch.openreg.current_stream(1)))


def test_a_compiled_function_is_checked_operator_by_operator(sanitize):
    @torch.compile
    def f(a):
        return (a * 2).sin() + 1

    x = torch.ones(64, device="openreg")
    side = side_stream()
    with pytest.raises(StreamSanitizerError) as excinfo:
        with torch.openreg.stream(side):
            f(x)
    flagged(excinfo, "mul", handle(side), "ones", handle(default_stream()))
    side.wait_stream(default_stream())
    with torch.openreg.stream(side):
        y = f(x)
    default_stream().wait_stream(side)
    torch.testing.assert_close(y.cpu(), (torch.ones(64) * 2).sin() + 1)



# ---------------------------------------------------------------- expanded arguments

# Expanded (stride 0) indices, sources and destinations of in-place operators, the issue's
# statement written correctly among them: the sanitizer takes each argument's whole allocation
# and lets the operator give the CPU's result, or the CPU's error.
EXPANDED_IN_PLACE = {
    "scatter_add_": lambda D: torch.ones(2, 2, 5, 8, dtype=torch.float16, device=D).scatter_add_(
        0, torch.tensor([1, 1, 1, 1], device=D).view(-1, 1, 1, 1).expand(-1, 2, 5, 8),
        torch.ones(1, 2, 5, 8, dtype=torch.float16, device=D).expand(4, 2, 5, 8)),
    "scatter_": lambda D: torch.zeros(3, 4, device=D).scatter_(
        1, torch.tensor([[2], [0]], device=D).expand(2, 4), 5.0),
    "index_put_": lambda D: torch.zeros(5, 3, device=D).index_put_(
        (torch.tensor([1], device=D).expand(4),), torch.ones(1, 3, device=D).expand(4, 3),
        accumulate=True),
    "index_add_": lambda D: torch.zeros(5, 3, device=D).index_add_(
        0, torch.tensor([2], device=D).expand(4), torch.arange(3.0, device=D).expand(4, 3)),
    "add_ into an expanded tensor": lambda D: torch.zeros(1, 4, device=D).expand(3, 4).add_(1),
}


@pytest.mark.parametrize("name", list(EXPANDED_IN_PLACE))
def test_expanded_arguments_of_in_place_operators(sanitize, name):
    def outcome(D):
        try:
            return EXPANDED_IN_PLACE[name](D).cpu()
        except RuntimeError as e:
            return str(e)
    cpu, got = outcome("cpu"), outcome("openreg")
    if isinstance(cpu, str):
        assert got == cpu
    else:
        assert torch.equal(got, cpu) and got.stride() == cpu.stride()

# ---------------------------------------------------------------- failing statements

# CPython frees a failing statement's temporaries while its exception is still set; a device
# tensor or event among them reaches the runtime's trace hooks, which call into Python (issue 30:
# the statement of tools/fuzz.py below raised SystemError, or the process died with a
# segmentation fault, instead of the CPU's RuntimeError). In subprocesses: they crashed.
FAILING_STATEMENTS = """
import torch

def raised(statement, **names):
    try:
        exec(statement, {"torch": torch, **names})
    except Exception as e:
        return type(e), str(e)
    raise AssertionError("no error: " + statement)

def recorded(event):
    event.record()
    return event

# the issue's statement: ones_like(v4)[:4] has 2 rows, so the expand fails; the index tensor
# (expanded, stride 0), already evaluated, is freed as its error propagates
SCATTER = ("v4.scatter_add_(0, torch.tensor([1, 1, 1, 1], device=D).view(-1, 1, 1, 1)"
           ".expand(-1, *v4.shape[1:]), torch.ones_like(v4)[:4].expand((4, 2, 5, 8)).contiguous())")
# a recorded event that only the failing statement holds
EVENT = "print(recorded(torch.Event(device=D)), torch.ones(2, device=D).expand(3))"
for statement, on_cpu in ((SCATTER, SCATTER), (EVENT, "torch.ones(2, device=D).expand(3)")):
    v4 = {D: torch.ones(2, 2, 5, 8, dtype=torch.float16, device=D) for D in ("cpu", "openreg")}
    cpu = raised(on_cpu, D="cpu", v4=v4["cpu"])
    got = raised(statement, D="openreg", v4=v4["openreg"], recorded=recorded)
    assert got == cpu, (got, cpu)
    assert torch.equal(v4["openreg"].cpu(), v4["cpu"]), statement
    print(got[0].__name__)
print(torch.ones(2, 2, 5, 8, device="openreg").sum().item())
exec(SCATTER, {"torch": torch, "D": "openreg", "v4": torch.ones(2, 2, 5, 8, device="openreg")})
"""


def run_script(tmp_path, text, **env):
    script = tmp_path / "program.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("asynchronous", ["0", "1"])
def test_a_failing_statement_raises_the_cpus_error(tmp_path, asynchronous):
    run = run_script(tmp_path, FAILING_STATEMENTS, OPENREG_SANITIZE="1",
                     OPENREG_ASYNC=asynchronous)
    assert run.stdout == "RuntimeError\nRuntimeError\n160.0\n", run.stdout + run.stderr
    # the last statement's error is not caught: the script ends as on the CPU, with its traceback
    assert run.returncode == 1, run.stderr
    assert run.stderr.rstrip().splitlines()[-1].startswith(
        "RuntimeError: The expanded size of the tensor (4) must match the existing size (2)"), \
        run.stderr
    assert "trace hook" not in run.stderr and "SystemError" not in run.stderr, run.stderr


# The hooks still run for what a failing statement frees: a tensor a side stream read, freed as
# the error propagates, is a use after free when its memory is handed out again, and the report
# says where it was freed.
USE_AFTER_FREE = """
import torch
from torch_openreg.sanitizer import StreamSanitizerError

x = [torch.ones(4096, device="openreg")]
ptr = x[0].untyped_storage().data_ptr()
side = torch.Stream(device="openreg")
side.wait_stream(torch.openreg.current_stream())
with torch.openreg.stream(side):
    y = x[0] * 3
try:
    print(x.pop(), torch.ones(2, device="openreg").expand(3))  # x: freed as the error propagates
except RuntimeError:
    print("RuntimeError")
keep = []
try:
    while len(keep) < 512:
        keep.append(torch.zeros(4096, device="openreg"))
        assert keep[-1].untyped_storage().data_ptr() != ptr, "not flagged"
except StreamSanitizerError as e:
    assert e.errors[0].use_after_free and e.errors[0].previous.operator == "aten::mul.Tensor"
    print(str(e).split("and freed at:")[1].split("The memory was")[0].strip().splitlines()[-1])
"""


def test_memory_freed_by_a_failing_statement_is_still_tracked(tmp_path):
    run = run_script(tmp_path, USE_AFTER_FREE, OPENREG_SANITIZE="1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "RuntimeError",
        '    print(x.pop(), torch.ones(2, device="openreg").expand(3))  # x: freed as the error '
        'propagates'], run.stdout + run.stderr
    assert run.stderr == "", run.stderr
