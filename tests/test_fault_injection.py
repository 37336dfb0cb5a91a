"""Fault injection (torch_openreg/faults.py, csrc/runtime/faults.{h,cpp}, docs/fault_injection.md):
out-of-memory errors and asynchronous kernel failures on demand.

Each fault is shown with a program that handles it (passes) and one that does not (fails), and
with real recovery code (accelerate's find_executable_batch_size). The faults are scoped: every
test leaves nothing armed and no device faulted (the fixture below checks).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

faults = torch.openreg.faults
MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_fault_left():
    yield
    for d in range(torch.openreg.device_count()):
        error = faults.device_error(d)
        faults.reset_device(d)
        assert error is None, f"a test left openreg:{d} faulted: {error}"


def stats(device=0):
    s = torch.openreg.memory_stats(device)
    return s.get("num_ooms", 0), s.get("num_alloc_retries", 0)


def run_script(code, env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=full_env)


# ---------------------------------------------------------------- out of memory

def test_nth_allocation_raises_out_of_memory_like_a_real_one():
    keep = torch.empty(MiB, device="openreg:0")  # noqa: F841
    cached = torch.empty(30 * MiB, device="openreg:0")
    del cached  # a cached segment the retry frees
    reserved = torch.openreg.memory_reserved(0)
    ooms, retries = stats()
    with faults.oom(nth=2, device=0) as fault:
        a = torch.ones(4, device="openreg:0")  # the first allocation works
        with pytest.raises(torch.OutOfMemoryError, match="OpenReg out of memory. Tried to allocate 16.00 KiB") as info:
            torch.ones(4096, device="openreg:0")
    assert fault.fired == 1
    assert "injected" in str(info.value)
    assert stats() == (ooms + 1, retries + 1)
    assert torch.openreg.memory_reserved(0) <= reserved - 30 * MiB  # the cache was freed first
    assert (torch.ones(4096, device="openreg:0") + a.sum()).sum().item() == 5 * 4096


def test_first_allocation_above_a_size_on_the_chosen_device_only():
    with faults.oom(min_bytes=8 * MiB, device=1):
        small = torch.empty(MiB, device="openreg:1")
        large0 = torch.empty(16 * MiB, device="openreg:0")  # other device: not matched
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(16 * MiB, device="openreg:1")
        again = torch.empty(16 * MiB, device="openreg:1")  # times=1: fired once
    del small, large0, again


def test_times_none_fails_every_matching_allocation_until_the_block_ends():
    with faults.oom(min_bytes=4 * MiB, times=None, device=0) as fault:
        for _ in range(3):
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(4 * MiB, device="openreg:0")
        torch.empty(MiB // 2, device="openreg:0")  # 2 MiB: below the size
    assert fault.fired == 3
    torch.empty(4 * MiB, device="openreg:0")


def halve_until_it_fits(batch):
    """A correct program: on out-of-memory, frees what it held and halves its batch."""
    while True:
        try:
            activations = torch.empty(batch, MiB // 4, device="openreg:0")  # batch MiB
            return batch, activations.sum().item() * 0
        except torch.OutOfMemoryError:
            batch //= 2


def assume_it_fits(batch):
    """A buggy program: never expects an out-of-memory error."""
    activations = torch.empty(batch, MiB // 4, device="openreg:0")
    return batch, activations.sum().item() * 0


def test_recovery_code_passes_and_code_without_it_fails():
    assert assume_it_fits(64)[0] == 64  # both pass without the fault
    assert halve_until_it_fits(64)[0] == 64
    with faults.oom(min_bytes=16 * MiB, times=None, device=0):
        assert halve_until_it_fits(64)[0] == 8
        with pytest.raises(torch.OutOfMemoryError):
            assume_it_fits(64)


def test_accelerate_find_executable_batch_size_halves_on_injected_ooms():
    accelerate_memory = pytest.importorskip("accelerate.utils.memory")
    tried = []

    def make_train():  # the decorator keeps the batch size it reached: one per run
        @accelerate_memory.find_executable_batch_size(starting_batch_size=128)
        def train(batch_size):
            tried.append(batch_size)
            x = torch.empty(batch_size, MiB // 4, device="openreg:0")  # batch_size MiB
            return batch_size, x.sum().item() * 0
        return train

    assert make_train()()[0] == 128 and tried == [128]  # without the fault, the first size fits
    tried.clear()
    with faults.oom(min_bytes=20 * MiB, times=None, device=0):
        final = make_train()()[0]
    # It reduces the batch (by 10% a step in accelerate 1.15) until it fits below 20 MiB.
    assert final < 20 <= tried[-2]
    assert tried[0] == 128 and tried[-1] == final
    assert all(a > b for a, b in zip(tried, tried[1:]))


def test_oom_arguments_are_checked():
    with pytest.raises(ValueError):
        faults.oom(times=0)
    with pytest.raises(ValueError, match="nth"):
        faults.oom(nth=0).arm()
    with pytest.raises(torch.AcceleratorError, match="out of range"):
        faults.oom(device=7).arm()


def test_oom_environment_form():
    result = run_script("""
        import torch
        torch.ones(1, device="openreg:0")
        try:
            torch.ones(2, device="openreg:0")
        except torch.OutOfMemoryError as e:
            print("OOM", torch.openreg.memory_stats(0)["num_ooms"])
        torch.ones(3, device="openreg:0")
        print("DONE")
    """, {"OPENREG_FAULTS": "oom:nth=2,device=0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OOM", "1", "DONE"]


def test_malformed_environment_form_names_the_variable():
    result = run_script("import torch", {"OPENREG_FAULTS": "oom:nth"})
    assert result.returncode != 0 and "OPENREG_FAULTS" in result.stderr


# ---------------------------------------------------------------- asynchronous kernel failure

def test_kernel_error_surfaces_at_the_next_synchronize_names_the_kernel_and_sticks():
    a = torch.ones(8, 8, device="openreg:0")
    with faults.kernel_error(op="mm", device=0):
        b = a + 1  # not the chosen kernel
        c = a @ b  # the launch returns: the failure is asynchronous
        d = c * 2  # later work is still accepted
    with pytest.raises(torch.AcceleratorError, match="illegal memory access") as info:
        torch.openreg.synchronize(0)
    message = str(info.value)
    assert "aten::mm" in message and "openreg:0" in message
    # Sticky: every synchronizing call on the device reports it.
    for sync in (lambda: torch.openreg.synchronize(0), lambda: d.sum().item(), lambda: d.cpu(),
                 lambda: torch.openreg.current_stream(0).synchronize(),
                 lambda: torch.openreg.current_stream(0).query()):
        with pytest.raises(torch.AcceleratorError, match="aten::mm"):
            sync()
    # Other devices keep working.
    assert torch.ones(3, device="openreg:1").sum().item() == 3
    torch.openreg.synchronize(1)
    assert "aten::mm" in faults.device_error(0)
    faults.reset_device(0)
    assert faults.device_error(0) is None
    assert d.sum().item() == 8 * 8 * 2 * 2 * 8


def test_event_wait_reports_the_kernel_error():
    a = torch.ones(4, device="openreg:1")
    with faults.kernel_error(op="aten::exp", device=1, kind="assert"):
        b = a.exp()
        event = torch.openreg.Event()
        event.record(torch.openreg.current_stream(1))
    with pytest.raises(torch.AcceleratorError, match="device-side assert triggered in kernel aten::exp"):
        event.synchronize()
    with pytest.raises(torch.AcceleratorError, match="aten::exp"):
        event.query()
    faults.reset_device(1)
    assert event.query() is True
    del b


def test_nth_launch_on_a_stream():
    s = torch.openreg.Stream(device="openreg:0")
    a = torch.ones(4, device="openreg:0")
    torch.openreg.synchronize(0)
    with faults.kernel_error(nth=3, stream=s):
        with torch.openreg.stream(s):
            a.add(1)
            a.mul(2)
            torch.openreg.synchronize(0)  # two launches on s: nothing yet
            a.sub(3)  # the third
    with pytest.raises(torch.AcceleratorError, match=f"aten::sub launched on stream {s.stream_id}"):
        s.synchronize()
    faults.reset_device(0)


def step_checking_only_at_launch(x):
    """A buggy program: wraps the call in try, as if errors were synchronous."""
    try:
        y = x @ x
    except RuntimeError:
        return "recovered"
    torch.openreg.synchronize(x.device)
    return y


def step_checking_at_synchronize(x):
    """A correct program: device errors surface at synchronize."""
    y = x @ x
    try:
        torch.openreg.synchronize(x.device)
    except torch.AcceleratorError:
        faults.reset_device(x.device)
        return "recovered"
    return y


def test_a_program_checking_at_synchronize_sees_the_failure_there():
    x = torch.ones(4, 4, device="openreg:0")
    # Without the fault both work.
    assert step_checking_only_at_launch(x).sum().item() == 64
    assert step_checking_at_synchronize(x).sum().item() == 64
    with faults.kernel_error(op="mm", device=0):
        assert step_checking_at_synchronize(x) == "recovered"
    with faults.kernel_error(op="mm", device=0):
        with pytest.raises(torch.AcceleratorError):
            step_checking_only_at_launch(x)
    faults.reset_device(0)


def test_kernel_error_in_the_asynchronous_mode():
    a = torch.ones(4, 4, device="openreg:0")
    with torch.openreg.set_async(True):
        (a @ a).sum()  # the first call of a signature runs synchronously
        torch.openreg.synchronize(0)
        with faults.kernel_error(op="mm", device=0):
            c = a @ a  # queued
        with pytest.raises(torch.AcceleratorError, match="aten::mm"):
            c.sum().item()
    faults.reset_device(0)


@pytest.mark.parametrize("op,call,route,expected", [
    # relu has no C++ meta kernel: from the second call of a signature the asynchronous mode
    # queues it, its outputs made from what the first call showed (docs/async_mode.md).
    ("relu", lambda x, w: x.relu(), "queued", "aten::relu"),
    ("aten::relu", lambda x, w: x[:, :2].relu(), "synchronous", "aten::relu"),  # a first call
    # A kernel queued inside a composite operator matches either name.
    ("linear", lambda x, w: torch.nn.functional.linear(x, w), "queued", "aten::linear"),
    ("addmm", lambda x, w: torch.nn.functional.linear(x, w, w[:, 0]), "queued", "aten::addmm"),
])
def test_kernel_error_by_name_in_the_asynchronous_mode_names_the_kernel(op, call, route,
                                                                        expected, on_a_new_thread):
    # on a thread of its own: there, the call below is the first of its signature or the second
    on_a_new_thread(kernel_error_by_name_in_the_asynchronous_mode_names_the_kernel, op, call,
                    route, expected)


def kernel_error_by_name_in_the_asynchronous_mode_names_the_kernel(op, call, route, expected):
    from torch_openreg import async_mode

    x = torch.randn(7, 5, device="openreg:0")
    w = torch.randn(5, 5, device="openreg:0")
    with torch.openreg.set_async(True):
        if route == "queued":
            call(x, w)  # the first call of the signature runs synchronously
            torch.openreg.synchronize(0)
        before = async_mode.counts()
        with faults.kernel_error(op=op, device=0):
            y = call(x, w)
        after = async_mode.counts()
        with pytest.raises(torch.AcceleratorError, match=f"in kernel {expected} launched"):
            y.sum().item()
    assert after[route] == before[route] + 1  # the route the call took
    faults.reset_device(0)


def test_kernel_error_arguments_are_checked():
    with pytest.raises(ValueError, match="kind"):
        faults.kernel_error(kind="segfault").arm()
    with pytest.raises(torch.AcceleratorError, match="out of range"):
        faults.kernel_error(device=9).arm()


def test_kernel_error_environment_form():
    result = run_script("""
        import torch
        a = torch.ones(2, 2, device="openreg:1")
        b = a @ a
        print("LAUNCHED")
        try:
            torch.openreg.synchronize(1)
        except torch.AcceleratorError as e:
            print("RAISED", "aten::mm" in str(e))
        print(torch.ones(2, device="openreg:0").sum().item())
    """, {"OPENREG_FAULTS": "kernel_error:op=mm,device=1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["LAUNCHED", "RAISED", "True", "2.0"]


# ---------------------------------------------------------------- collectives (occl)

def _check_peer_fails(rank, world, fault):
    import torch.distributed as dist
    import time as _time

    if rank == 1:
        fault(nth=2).arm()  # this rank's second collective
    x = torch.ones(4, device=f"openreg:{rank}")
    dist.all_reduce(x)  # the first collective works on both ranks
    start = _time.monotonic()
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        return ("error", type(e).__name__, str(e)[:300], _time.monotonic() - start)
    return ("no error", x.cpu().tolist(), None, _time.monotonic() - start)


def _check_hang(rank, world):
    return _check_peer_fails(rank, world, faults.collective_hang)


def _check_exit(rank, world):
    return _check_peer_fails(rank, world, faults.rank_exit)


def run_two_ranks(check, timeout_s):
    """Two spawned ranks (the harness of tests/test_distributed.py); returns rank 0's result and
    the ranks' exit codes, killing a rank still running once rank 0 has answered (a launcher
    such as torchrun ends the job when a rank fails)."""
    import multiprocessing
    import tempfile
    import time

    from test_distributed import _entry

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(check, r, 2, init, "cpu:gloo,openreg:occl",
                                                  False, timeout_s, queue, {})) for r in range(2)]
        for p in procs:
            p.start()
        result = None
        deadline = time.monotonic() + 120
        try:
            while result is None and time.monotonic() < deadline:
                try:
                    rank, status, value = queue.get(timeout=0.5)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                if rank == 0:
                    result = (status, value)
            procs[0].join(30)
            procs[1].join(5)
        finally:
            still_running = [p.is_alive() for p in procs]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return result, still_running, [p.exitcode for p in procs]


def test_a_hung_rank_makes_its_peer_time_out_within_the_group_timeout():
    result, still_running, _ = run_two_ranks(_check_hang, timeout_s=3.0)
    assert result is not None and result[0] == "ok", result
    outcome, error_type, message, seconds = result[1]
    assert outcome == "error", result
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
    assert seconds < 3.0 + 15, seconds  # within the timeout (and a margin for a loaded machine)
    assert still_running == [False, True]  # the hung rank is stuck until the launcher ends it


def test_a_rank_that_exits_makes_its_peer_fail():
    result, still_running, codes = run_two_ranks(_check_exit, timeout_s=10.0)
    assert result is not None and result[0] == "ok", result
    outcome, error_type, message, seconds = result[1]
    assert outcome == "error", result
    assert seconds < 10.0 + 15, seconds
    assert still_running == [False, False] and codes[1] == 1


def run_torchrun_ddp(faults_env):
    """examples/ddp.py under torchrun, two ranks on openreg:0 and openreg:1 (occl), with a
    10-second group timeout. Returns the return code and the job's output."""
    from test_distributed import JOB_TIMEOUT, ROOT, _free_port

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OPENREG_FAULTS=faults_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.join(ROOT, "examples", "ddp.py"), "--steps", "5", "--timeout", "10"]
    # The bound: a job that hangs fails the test here (TimeoutExpired) instead of hanging it.
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT)
    return out.returncode, out.stdout + out.stderr


def test_torchrun_ddp_job_with_a_stuck_rank_ends_with_the_timeout_error():
    """Rank 1's fifth occl collective (DDP's bucket rebuild at the second step) never completes:
    rank 0 gets gloo's timeout error after the group's 10 s, exits non-zero, and torchrun ends
    the stuck rank (SIGTERM) and the job. Without the fault the same job finishes: that half is
    tests/test_distributed.py::test_torchrun_example (same script, no fault)."""
    code, output = run_torchrun_ddp("collective_hang:nth=5,rank=1")
    assert code != 0, output[-3000:]
    assert "this rank hangs" in output and "occl collective #5" in output, output[-3000:]
    assert "[rank0]: RuntimeError" in output, output[-3000:]
    assert "Timed out waiting 10000ms" in output, output[-3000:]
    assert "rank      : 1 (local_rank: 1)" in output and "(SIGTERM)" in output, output[-3000:]
    assert "replicas identical" not in output


def test_environment_faults_for_one_rank(monkeypatch):
    """torchrun gives every rank one environment: rank=R keeps a fault for the rank whose RANK
    is R (the test above uses it)."""
    text = "collective_hang:nth=3,rank=1;oom:nth=2"
    for rank, kinds in (("1", ["collective_hang", "oom"]), ("0", ["oom"])):
        monkeypatch.setenv("RANK", rank)
        assert [type(f).__name__ for f in faults._parse_environment(text)] == kinds
    monkeypatch.delenv("RANK")
    assert [type(f).__name__ for f in faults._parse_environment(text)] == ["oom"]


def test_collective_fault_arguments_are_checked():
    with pytest.raises(ValueError, match="nth"):
        faults.collective_hang(nth=0).arm()
    assert [type(f).__name__ for f in faults._parse_environment(
        "collective_hang:nth=3;rank_exit:nth=2,code=7")] == ["collective_hang", "rank_exit"]


# ---------------------------------------------------------------- a device that disappears

def test_a_lost_device_fails_every_call_naming_it_and_others_keep_working():
    x = torch.ones(4, device="openreg:1")
    faults.device_lost(1)
    try:
        for call in (lambda: torch.ones(4, device="openreg:1"), lambda: x + 1,
                     lambda: torch.openreg.synchronize(1), lambda: x.cpu(),
                     lambda: torch.ones(4).to("openreg:1")):
            with pytest.raises(torch.AcceleratorError, match="openreg:1 is no longer available"):
                call()
        assert torch.ones(4, device="openreg:0").sum().item() == 4
        assert torch.openreg.device_count() == 2
    finally:
        faults.reset_device(1)
    assert (x + 1).sum().item() == 8
