import os
import random

import pytest
import torch

# The backend must be registered by autoload, through `import torch` alone.
assert hasattr(torch, "openreg"), (
    "torch_openreg was not autoloaded: install it with `pip install --no-build-isolation -e .`"
)

import torch_openreg  # noqa: E402  (after the check: importing it by name would register it)


def pytest_collection_modifyitems(config, items):
    """OPENREG_TEST_ORDER_SEED=<n> runs the collected tests in an order shuffled by that seed
    (`make shuffled`). What one test leaves behind in process-wide state (caches, pools, modes)
    then meets other tests than the ones after it in file order, and a test that depends on it
    fails reproducibly instead of as a rare flake of CI's workers, whose files meet in an order
    that depends on timing."""
    seed = os.environ.get("OPENREG_TEST_ORDER_SEED")
    if seed:
        random.Random(int(seed)).shuffle(items)


@pytest.fixture(params=["openreg:0", "openreg:1"])
def device(request):
    """Both simulated devices: tests using it run once per device."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def devices_idle_after_each_test():
    """Each test ends with its device work done: what it queued (the asynchronous kernel mode,
    `OPENREG_ASYNC=1`, queues every kernel; `non_blocking` copies are queued in every mode) has
    run, and an error of that work is reported by the test that queued it, not by the next
    synchronizing call of another test. The autograd device threads have let go of the test's last
    backward (they do so a moment after backward() returns): its graph's device memory is not
    freed in the middle of the next test, whose memory counts would move."""
    yield
    if torch.openreg.is_initialized():
        torch_openreg._C._release_autograd_graphs()
        for index in range(torch.openreg.device_count()):
            torch.openreg.synchronize(index)


@pytest.fixture
def slow_copies():
    """During the test, every `non_blocking` copy between pinned memory and a device stays in
    flight for the latency this fixture yields (0.25 s): far longer than the few microseconds a
    host thread needs to read a destination too early, so a missing synchronization shows."""
    latency = 0.25
    old = torch.openreg.set_copy_engine_config(latency_us=latency * 1e6)
    try:
        yield latency
    finally:
        for index in range(torch.openreg.device_count()):
            torch.openreg.synchronize(index)
        torch.openreg.set_copy_engine_config(*old)


@pytest.fixture
def on_a_new_thread():
    """Runs a function on a host thread of its own and re-raises what it raised. The asynchronous
    mode learns signatures per host thread (docs/async_mode.md): on a new thread the first call
    of a signature is its first, whatever earlier tests in the process called, so a test that
    checks what a first call does runs the same alone, in file order and shuffled."""
    import threading

    def run(body, *args):
        raised = []

        def target():
            try:
                body(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
                raised.append(e)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if raised:
            raise raised[0]

    return run
