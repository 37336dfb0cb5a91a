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

def _use_on_side_then_free(record: bool):
    x = torch.ones(N, device="openreg")
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
    until the caching allocator hands out the freed block (other free blocks of the same size,
    left by earlier tests, may come first)."""
    for _ in range(512):
        z = torch.zeros(N, device="openreg")
        keep.append(z)
        if z.untyped_storage().data_ptr() == ptr:
            return z
    raise AssertionError("the freed block was never handed out again")


def test_use_after_free_across_streams_is_flagged(sanitize):
    ptr, side, y = _use_on_side_then_free(record=False)
    keep = []
    with pytest.raises(StreamSanitizerError) as excinfo:
        _allocate_until_reused(ptr, keep)  # zeros writes the block `side` may still read
    e = flagged(excinfo, "zeros", handle(default_stream()), "mul", handle(side))
    assert e.use_after_free
    assert e.previous.allocation.ptr == ptr and e.allocation.ptr == ptr
    text = str(excinfo.value)
    assert "use after free" in text and "freed at" in text
    del y


def test_use_after_free_with_record_stream_is_silent(sanitize):
    ptr, side, y = _use_on_side_then_free(record=True)
    keep = []
    z = _allocate_until_reused(ptr, keep)
    z.add_(1)
    default_stream().wait_stream(side)
    assert torch.equal(y.cpu(), torch.full((N,), 3.0))


def test_use_after_free_after_wait_stream_is_silent(sanitize):
    ptr, side, y = _use_on_side_then_free(record=False)
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
