"""Concurrency: many Python threads on both devices and several streams, one stream shared by
threads, waits that sleep, interpreter exit with queued work, fork and spawn.

Whatever may hang or kill the process runs in a subprocess with a timeout."""

import os
import resource
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

TIMEOUT = 120


def run_python(code: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())


def run_threads(target, n: int, timeout: float = TIMEOUT) -> list:
    errors = []

    def wrapped(i):
        try:
            target(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "threads did not finish (deadlock?)"
    return errors


def mixed_ops(a, b, idx, other_device):
    """A bit of everything: matmul, pointwise, reductions, indexing, in-place, views, copies."""
    c = (a @ b).relu() + a.t()
    c.mul_(0.5).clamp_(-2, 2)
    d = torch.softmax(c, dim=1)[idx] * b[:, :4].sum()
    e = torch.cat([d, c.flatten()[: d.numel()].view_as(d)], dim=0)
    f = torch.where(e > 0, e, -e).cumsum(0)
    moved = f.to(other_device) if other_device is not None else f
    return moved.sum(0) + moved.mean()


def test_eight_threads_two_devices_two_streams_match_the_cpu():
    old = torch.openreg.set_copy_engine_config(latency_us=200)  # keep copies really in flight

    def work(tid):
        g = torch.Generator().manual_seed(tid)
        for it in range(6):
            a, b = torch.randn(48, 48, generator=g), torch.randn(48, 48, generator=g)
            idx = torch.randint(0, 48, (16,), generator=g)
            want = mixed_ops(a, b, idx, None)
            for dev in (0, 1):
                s1 = torch.openreg.Stream(dev)
                s2 = torch.openreg.Stream(dev, priority=-1)
                with torch.openreg.stream(s1):
                    da = a.pin_memory().to(f"openreg:{dev}", non_blocking=True)
                    db = b.to(f"openreg:{dev}")
                    di = idx.to(f"openreg:{dev}")
                s2.wait_stream(s1)
                with torch.openreg.stream(s2):
                    out = mixed_ops(da, db, di, f"openreg:{1 - dev}")
                    # `out` is on the other device: its copy is queued on that device's current
                    # stream, which s2.synchronize() would not cover.
                    host = out.to("cpu", non_blocking=True)
                    torch.openreg.current_stream(out.device).synchronize()
                torch.testing.assert_close(host, want, msg=f"thread {tid} it {it} dev {dev}")

    try:
        errors = run_threads(work, 8)
    finally:
        torch.openreg.set_copy_engine_config(*old)
    assert not errors, errors[0]


def test_threads_on_the_default_streams_match_the_cpu():
    def work(tid):
        torch.openreg.set_device(tid % 2)
        g = torch.Generator().manual_seed(100 + tid)
        for _ in range(10):
            a, b = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
            idx = torch.randint(0, 32, (8,), generator=g)
            out = mixed_ops(a.to("openreg"), b.to("openreg"), idx.to("openreg"), None)
            torch.testing.assert_close(out.cpu(), mixed_ops(a, b, idx, None))

    errors = run_threads(work, 8)
    assert not errors, errors[0]


def test_kernels_of_one_stream_never_overlap_across_threads(device):
    """On a real device the kernels of a stream run one after the other, whatever thread issued
    them: concurrent read-modify-write kernels lose no update."""
    x = torch.zeros(1 << 22, device=device)
    s = torch.openreg.Stream(device)
    s.wait_stream(torch.openreg.current_stream(device))  # x is zeroed on the current stream

    def work(_):
        with torch.openreg.stream(s):
            for _ in range(25):
                x.add_(1)

    errors = run_threads(work, 4)
    assert not errors, errors[0]
    torch.openreg.current_stream(device).wait_stream(s)  # read after the adds
    assert torch.equal(x.cpu(), torch.full((1 << 22,), 100.0))


def test_cross_device_copies_in_both_directions_from_many_threads():
    """A copy between devices is ordered after both devices' current streams: copies the other
    way round from other threads must not deadlock."""

    def work(tid):
        home, away = f"openreg:{tid % 2}", f"openreg:{1 - tid % 2}"
        x = torch.full((1000,), float(tid), device=home)
        for _ in range(100):
            x = x.to(away).to(home) + 1
        assert torch.equal(x.cpu(), torch.full((1000,), tid + 100.0))

    errors = run_threads(work, 6, timeout=60)
    assert not errors, errors[0]


def test_synchronize_sleeps_while_another_thread_runs_a_kernel():
    s = torch.openreg.Stream(0)
    a = torch.randn(1 << 25, device="openreg:0")
    started = threading.Event()

    def long_kernel():  # single-threaded kernels, so that a spinning waiter would get a core
        with torch.openreg.stream(s):
            started.set()
            for _ in range(3):
                a.cumsum(0)
            s.synchronize()  # its kernels may still be queued (asynchronous kernel mode)

    t = threading.Thread(target=long_kernel)
    t.start()
    started.wait()
    deadline = time.monotonic() + 30
    while s.query() and time.monotonic() < deadline:  # wait until a kernel is in flight
        pass
    assert not s.query()
    usage0, wall0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    s.synchronize()
    usage, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter() - wall0
    t.join()
    assert s.query()
    assert wall > 0.01, "the kernel finished too early to measure the wait"
    # A spinning waiter either burns a core or, when no core is free, keeps being preempted.
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    preempted = usage.ru_nivcsw - usage0.ru_nivcsw
    assert cpu < 0.25 * wall + 0.005, f"synchronize spent {cpu:.3f}s of CPU in {wall:.3f}s"
    assert preempted <= 5, f"synchronize was preempted {preempted} times in {wall:.3f}s"


def test_a_thread_waiting_for_queued_work_does_not_block_other_streams():
    old = torch.openreg.set_copy_engine_config(latency_us=300_000)
    try:
        slow = torch.openreg.Stream(0)
        with torch.openreg.stream(slow):
            torch.zeros(10).pin_memory().copy_(torch.ones(10, device="openreg:0"), non_blocking=True)
        t0 = time.perf_counter()
        waiter = threading.Thread(target=slow.synchronize)
        waiter.start()
        x = torch.ones(4, device="openreg:0")
        for _ in range(50):
            x = x + 1  # default stream: not behind the slow copy
        assert x.cpu()[0].item() == 51
        assert time.perf_counter() - t0 < 0.2
        waiter.join()
    finally:
        torch.openreg.set_copy_engine_config(*old)


# ---------------------------------------------------------------- exit, fork, spawn


def test_exit_with_queued_work_does_not_hang():
    result = run_python("""
        import atexit
        state = {}

        def check():  # registered before torch: runs after torch_openreg's exit handler
            print("drained:", bool(state["host"].eq(1).all()), flush=True)

        atexit.register(check)
        import torch
        torch.openreg.set_copy_engine_config(latency_us=200_000)
        x = torch.ones(1 << 20, device="openreg:0")
        state["host"] = host = torch.zeros(1 << 20).pin_memory()
        host.copy_(x, non_blocking=True)  # a queued copy into a pinned tensor at exit
        s1 = torch.openreg.Stream(1)
        with torch.openreg.stream(s1):
            y = host.to("openreg:1", non_blocking=True)
            e = torch.openreg.Event()
            e.record()
        torch.openreg.current_stream(0).wait_event(e)  # a cross-device wait, also queued
        del x, y
        print("exiting", flush=True)
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout and "drained: True" in result.stdout


def test_exit_with_work_queued_by_other_threads_does_not_hang():
    # (Daemon threads still *inside* an operator at exit abort the interpreter even on the CPU:
    # a torch/CPython limitation. These threads queue work, then wait in Python.)
    result = run_python("""
        import threading, torch
        torch.openreg.set_copy_engine_config(latency_us=50_000)
        queued = threading.Barrier(5)

        def issue_and_park(i):
            dev = i % 2
            s = torch.openreg.Stream(dev, priority=-(i % 4))
            x = torch.full((4096,), float(i), device=f"openreg:{dev}")
            host = torch.empty(4096).pin_memory()
            with torch.openreg.stream(s):
                for _ in range(3):
                    host.copy_(x, non_blocking=True)
                    y = host.to(f"openreg:{1 - dev}", non_blocking=True)
                    torch.openreg.current_stream(dev).wait_stream(s)
            queued.wait()
            threading.Event().wait()  # parked forever

        for i in range(4):
            threading.Thread(target=issue_and_park, args=(i,), daemon=True).start()
        queued.wait()
        print("exiting", flush=True)
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout


FORK_MESSAGE = ("Cannot re-initialize OpenReg in forked subprocess. To use OpenReg with "
                "multiprocessing, you must use the 'spawn' start method")


def test_using_openreg_in_a_forked_child_raises():
    result = run_python("""
        import os, torch
        x = torch.ones(2, device="openreg")  # initialises the runtime
        s = torch.openreg.Stream()
        pid = os.fork()
        if pid == 0:
            failures = 0
            for use in (lambda: torch.ones(2, device="openreg:1"), lambda: x + x,
                        lambda: torch.openreg.synchronize(), lambda: torch.openreg.Stream(),
                        lambda: s.synchronize(), lambda: torch.openreg.Event().record(),
                        lambda: x.cpu()):
                try:
                    use()
                    print("no error", flush=True)
                except RuntimeError as e:
                    failures += str(e).startswith(%r)
            os._exit(0 if failures == 7 else 1)
        _, status = os.waitpid(pid, 0)
        print("child status", os.waitstatus_to_exitcode(status))
        print("parent still works:", (x + x).cpu().tolist())
    """ % FORK_MESSAGE)
    assert result.returncode == 0, result.stderr
    assert "child status 0" in result.stdout, result.stdout
    assert "parent still works: [2.0, 2.0]" in result.stdout


def test_fork_before_initialisation_is_fine():
    result = run_python("""
        import os, torch
        assert not torch.openreg.is_initialized()
        pid = os.fork()
        if pid == 0:
            ok = (torch.ones(2, device="openreg:1") * 2).cpu().tolist() == [2.0, 2.0]
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("child status", os.waitstatus_to_exitcode(status))
    """)
    assert result.returncode == 0, result.stderr
    assert "child status 0" in result.stdout


def test_multiprocessing_with_spawn_works(tmp_path):
    script = tmp_path / "spawn_child.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import torch

        def child(dev):
            s = torch.openreg.Stream(dev)
            with torch.openreg.stream(s):
                x = torch.arange(4.0).pin_memory().to(f"openreg:{dev}", non_blocking=True)
                return (x * 2).cpu().tolist()

        if __name__ == "__main__":
            torch.ones(1, device="openreg")  # initialised in the parent
            with mp.get_context("spawn").Pool(2) as pool:
                print(pool.map(child, [0, 1]))
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=TIMEOUT, env=os.environ.copy())
    assert result.returncode == 0, result.stderr
    assert "[[0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0]]" in result.stdout
