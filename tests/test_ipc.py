"""Device tensors across processes (IPC), multiprocessing and DataLoader workers.

Spawned processes cost ~2 s each (import torch): one long-lived peer serves most checks through
command queues; the few checks that need another configuration (fewer devices, strict memory, a
sender that exits) each use one more child. Every wait is bounded.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

TIMEOUT = 60  # seconds for any single answer of a child (its startup included)
SPAWN = mp.get_context("spawn")


def _maps_inodes() -> set[int]:
    """Inodes of the shared-memory files mapped into this process."""
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/memfd:openreg"):
                inodes.add(int(parts[4]))
    return inodes


def _segment_inode(t: torch.Tensor) -> int:
    """Inode of the shared-memory file of the device segment holding `t`."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if low <= address < high:
                assert len(parts) >= 6 and parts[5].startswith("/memfd:openreg-device"), line
                return int(parts[4])
    raise AssertionError("device memory not found in /proc/self/maps")


def _start(target, args, env=None):
    saved = dict(os.environ)
    os.environ.update(env or {})  # the child reads OPENREG_* when it imports torch
    try:
        p = SPAWN.Process(target=target, args=args, daemon=True)
        p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return p


# ---------------------------------------------------------------------------------------------
# the peer: runs commands sent by the test process, keeps what it received in `held`


def _peer_main(conn):
    held = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            return
        try:
            result = ("ok", _PEER_COMMANDS[cmd](held, arg))
        except BaseException:  # noqa: BLE001 - reported to the test
            result = ("error", traceback.format_exc())
        conn.send(result)


def _peer_describe(held, tensors):
    """Keeps the received tensors; returns what they are."""
    held["tensors"] = tensors
    base = tensors[0].untyped_storage().data_ptr()
    return [(str(t.device), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
             t.untyped_storage().data_ptr() == base, t.detach().cpu(), type(t).__name__, t.requires_grad)
            for t in tensors]


def _peer_add_one(held, _):
    t = held["tensors"][0]
    t.add_(1)
    torch.openreg.synchronize(t.device)
    return None


def _peer_read(held, _):
    return [t.cpu() for t in held["tensors"]]


def _peer_make(held, device):
    t = torch.arange(6.0, device=device).reshape(2, 3)
    held["made"] = t
    return t


def _peer_read_made(held, _):
    return held["made"].cpu()


def _peer_echo(held, _):
    return held["tensors"]


def _peer_resize(held, _):
    try:
        held["tensors"][0].untyped_storage().resize_(1 << 20)
    except RuntimeError as e:
        return str(e)
    return "resized"


def _peer_drop(held, inode):
    held.clear()
    import gc
    gc.collect()
    return inode in _maps_inodes()


_PEER_COMMANDS = {"describe": _peer_describe, "add_one": _peer_add_one, "read": _peer_read,
                  "make": _peer_make, "read_made": _peer_read_made, "resize": _peer_resize, "echo": _peer_echo,
                  "drop": _peer_drop}


@pytest.fixture(scope="module")
def peer():
    # A pipe pickles in the calling thread: an error while sending is raised here, at once.
    conn, child_conn = SPAWN.Pipe()
    p = _start(_peer_main, (child_conn,))

    def call(cmd, arg=None):
        conn.send((cmd, arg))
        assert conn.poll(TIMEOUT), "the peer did not answer"
        status, value = conn.recv()
        assert status == "ok", value
        return value

    yield call
    conn.send(("stop", None))
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0


# ---------------------------------------------------------------------------------------------
# sharing


def test_views_offsets_strides_and_dtypes_arrive_on_the_same_memory(peer):
    t = torch.arange(24.0, device="openreg:1").reshape(4, 6)
    tensors = [t, t.t(), t[1:, 2:5], t[:, ::2], t.view(torch.int32), t.view(torch.float16)]
    got = peer("describe", tensors)
    for sent, (device, dtype, shape, stride, offset, same_storage, values, cls, rg) in zip(tensors, got):
        assert device == "openreg:1" and dtype == sent.dtype
        assert (shape, stride, offset) == (tuple(sent.shape), sent.stride(), sent.storage_offset())
        assert same_storage  # one storage in the receiver, like in the sender
        assert torch.equal(values, sent.cpu()) or (values.dtype.is_floating_point
                                                   and torch.allclose(values, sent.cpu(), equal_nan=True))
        assert cls == "Tensor" and not rg

    # a write in the receiver is seen here after it synchronized, and the other way round
    peer("add_one")
    torch.testing.assert_close(t.cpu(), torch.arange(24.0).reshape(4, 6) + 1)
    t.mul_(2)
    torch.openreg.synchronize()
    expected = (torch.arange(24.0).reshape(4, 6) + 1) * 2
    torch.testing.assert_close(peer("read")[1], expected.t())


def test_sent_back_to_the_sender_it_is_the_original_storage(peer):
    t = torch.arange(10.0, device="openreg:0")
    peer("describe", [t[2:], t[:3]])
    a, b = peer("echo")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == t.data_ptr()
    assert a.storage_offset() == 2 and torch.equal(b.cpu(), torch.arange(3.0))


def test_dtypes_and_parameters(peer):
    cpu = [torch.tensor([1.5, -2.0, 3.25]), torch.tensor([1, -7, 2**40]), torch.tensor([True, False]),
           torch.tensor([1 + 2j, -3j]), torch.tensor([0.5, 2.0], dtype=torch.bfloat16),
           torch.tensor([7, 8], dtype=torch.uint8)]
    param = nn.Parameter(torch.randn(3, 2, device="openreg:0"))
    got = peer("describe", [c.to("openreg:0") for c in cpu] + [param])
    for c, (device, dtype, *_rest, values, cls, rg) in zip(cpu, got):
        assert device == "openreg:0" and dtype == c.dtype and torch.equal(values, c)
    *_, values, cls, rg = got[-1]
    assert cls == "Parameter" and rg and torch.equal(values, param.detach().cpu())


def test_a_tensor_made_by_the_receiver_comes_back(peer):
    t = peer("make", "openreg:1")
    assert t.device == torch.device("openreg:1")
    torch.testing.assert_close(t.cpu(), torch.arange(6.0).reshape(2, 3))
    t.neg_()
    torch.openreg.synchronize()
    torch.testing.assert_close(peer("read_made"), -torch.arange(6.0).reshape(2, 3))


def test_empty_and_non_leaf_tensors(peer):
    got = peer("describe", [torch.empty(0, 3, device="openreg:1")])
    assert got[0][0] == "openreg:1" and got[0][2] == (0, 3)
    x = torch.ones(2, device="openreg:0", requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        peer("describe", [x])


def test_shared_storages_are_not_resizable(peer):
    # A resize would move the memory away from the other process's window of the segment.
    t = torch.ones(8, device="openreg:0")
    peer("describe", [t])
    assert "not resizable" in peer("resize")
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        t.untyped_storage().resize_(1 << 20)
    assert torch.equal(peer("read")[0], torch.ones(8))


def test_unshareable_segment_raises_a_clear_error(tmp_path):
    # Without memfd (simulated: memfd_create fails), segments are anonymous memory: they work,
    # and sending a tensor on one says why it cannot be shared.
    import subprocess
    import sys
    shim = tmp_path / "nomemfd.c"
    shim.write_text("#include <errno.h>\nint memfd_create(const char* n, unsigned int f) "
                    "{ (void)n; (void)f; errno = EMFILE; return -1; }\n")
    lib = tmp_path / "nomemfd.so"
    # building openreg needs a C compiler, so the README's commands have one
    subprocess.run(["cc", "-shared", "-fPIC", str(shim), "-o", str(lib)], check=True)
    code = ("import torch\n"
            "from multiprocessing.reduction import ForkingPickler\n"
            "t = torch.ones(3, device='openreg:0') * 2\n"
            "print(t.cpu().tolist())\n"
            "ForkingPickler.dumps(t)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=TIMEOUT, env={**os.environ, "LD_PRELOAD": str(lib)})
    assert "[2.0, 2.0, 2.0]" in result.stdout, result.stderr
    assert result.returncode != 0
    assert "device memory cannot be shared: its segment has no shared-memory file" in result.stderr


def test_segments_leave_the_program_its_file_descriptors():
    # Device segments hold at most a quarter of RLIMIT_NOFILE (at least 64) in shared-memory
    # files; the segments after that are anonymous memory, work, and say why they cannot be sent.
    import subprocess
    import sys
    code = ("import os, resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "import torch\n"
            "from multiprocessing.reduction import ForkingPickler\n"
            "before = len(os.listdir('/proc/self/fd'))\n"
            "ts = [torch.empty(1 << 18, device='openreg:0') for i in range(300)]\n"
            "for i, t in enumerate(ts): t[0] = i  # 1 MiB each, 2 per small-pool segment\n"
            "held = len(os.listdir('/proc/self/fd')) - before\n"
            "print('held', held)\n"
            "files = [open(os.devnull) for _ in range(256 - before - held - 8)]\n"
            "print('opened', len(files))\n"
            "print('sum', sum(t[0].item() for t in ts))\n"
            "ForkingPickler.dumps(ts[0])\n"
            "print('first shareable')\n"
            "ForkingPickler.dumps(ts[-1])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=TIMEOUT)
    held = int(result.stdout.split("held ")[1].split()[0]) if "held " in result.stdout else None
    assert held is not None and 60 <= held <= 70, (result.stdout, result.stderr)
    assert "opened" in result.stdout and f"sum {float(sum(range(300)))}" in result.stdout
    assert "first shareable" in result.stdout
    assert result.returncode != 0
    assert "a quarter of RLIMIT_NOFILE" in result.stderr


def test_cpu_tensors_still_go_through_torch(peer):
    t = torch.arange(5.0)
    got = peer("describe", [t])
    assert got[0][0] == "cpu" and torch.equal(got[0][6], t)


def test_memory_is_kept_while_the_receiver_holds_it_then_freed(peer):
    torch.openreg.ipc_collect()
    before = torch.openreg.memory_allocated(0)
    t = torch.ones(1 << 20, device="openreg:0")  # 4 MiB: a segment of its own
    inode = _segment_inode(t)
    peer("describe", [t])
    del t
    # the receiver still uses the memory: this process must not free or reuse it
    assert torch.openreg.ipc_collect() >= 1
    assert torch.openreg.memory_allocated(0) >= before + (4 << 20)
    assert torch.equal(peer("read")[0], torch.ones(1 << 20))
    still_mapped = peer("drop", inode)
    assert not still_mapped  # the receiver unmapped the segment with its last tensor
    assert torch.openreg.ipc_collect() == 0
    assert torch.openreg.memory_allocated(0) == before


# ---------------------------------------------------------------------------------------------
# the sender exits; receivers that cannot use the tensor


def _sender_that_exits(out, ack):
    out.put(torch.arange(8.0, device="openreg:1"))
    ack.get(timeout=TIMEOUT)  # the test process has received it


def test_sender_exits_first():
    out, ack = SPAWN.Queue(), SPAWN.Queue()
    p = _start(_sender_that_exits, (out, ack))
    first = out.get(timeout=TIMEOUT)
    inode = _segment_inode(first)
    ack.put(True)
    p.join(TIMEOUT)
    assert p.exitcode == 0
    # received before the sender exited: the memory is still valid here
    assert torch.equal(first.cpu(), torch.arange(8.0))
    first.add_(1)
    assert torch.equal(first.cpu(), torch.arange(8.0) + 1)
    del first
    import gc
    gc.collect()
    assert inode not in _maps_inodes()  # the last process released it: gone
    # segments are memfd files: nothing was ever created in /dev/shm
    assert not [n for n in os.listdir("/dev/shm") if "openreg" in n]


def _sender_exits_before_receive(out):
    out.put(torch.ones(4, device="openreg:0"))


def test_tensor_received_after_its_sender_died_raises_a_clear_error():
    out = SPAWN.Queue()
    p = _start(_sender_exits_before_receive, (out,))
    p.join(TIMEOUT)
    assert p.exitcode == 0
    with pytest.raises(RuntimeError, match=r"exited before this process received it"):
        out.get(timeout=TIMEOUT)


def _restricted_receiver(inq, outq):
    for _ in range(2):
        try:
            t = inq.get(timeout=TIMEOUT)
            outq.put(("ok", str(t.device), (t * 2).cpu().tolist()))
            t.add_(1)
            torch.openreg.synchronize()
        except Exception as e:  # noqa: BLE001 - reported to the test
            outq.put(("error", type(e).__name__, str(e)))
    outq.put(("maps", _maps_inodes()))


def test_receiver_with_fewer_devices_and_strict_memory():
    inq, outq = SPAWN.Queue(), SPAWN.Queue()
    p = _start(_restricted_receiver, (inq, outq),
               env={"OPENREG_DEVICE_COUNT": "1", "OPENREG_STRICT_MEMORY": "1"})
    torch.openreg.ipc_collect()
    on1 = torch.arange(3.0, device="openreg:1")
    inq.put(on1)
    status, kind, message = outq.get(timeout=TIMEOUT)
    assert status == "error" and kind == "AcceleratorError", message
    assert "device index is out of range" in message
    on0 = torch.arange(3.0, device="openreg:0")
    inq.put(on0)
    # strict memory in the receiver: the received memory is device memory there too, used by
    # kernels and copies only
    status, device, doubled = outq.get(timeout=TIMEOUT)
    assert (status, device, doubled) == ("ok", "openreg:0", [0.0, 2.0, 4.0])
    _, mapped = outq.get(timeout=TIMEOUT)
    assert _segment_inode(on0) in mapped  # still held by the receiver when it reported
    p.join(TIMEOUT)
    assert p.exitcode == 0
    assert torch.equal(on0.cpu(), torch.arange(3.0) + 1)  # the strict receiver's write
    assert torch.openreg.ipc_collect() == 0  # the refused tensor was released too


# ---------------------------------------------------------------------------------------------
# multiprocessing and DataLoader


def _use_openreg_in_child():
    try:
        torch.ones(1, device="openreg")
    except RuntimeError as e:
        os._exit(3 if "Cannot re-initialize OpenReg in forked subprocess" in str(e) else 2)
    os._exit(0)


def test_fork_after_initialisation_raises_in_the_child():
    torch.ones(1, device="openreg")
    p = mp.get_context("fork").Process(target=_use_openreg_in_child)
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 3


def _rank_main(rank, shared):
    torch.openreg.set_device(rank)
    local = torch.full((2,), float(rank + 1), device="openreg")  # one device per process
    assert local.device == torch.device("openreg", rank)
    shared[rank].copy_(local.to(shared.device) * 10)
    torch.openreg.synchronize(shared.device)


def test_multiprocessing_spawn_one_device_per_process():
    shared = torch.zeros(2, 2, device="openreg:0")
    mp.spawn(_rank_main, args=(shared,), nprocs=2, join=True)
    assert torch.equal(shared.cpu(), torch.tensor([[10.0, 10.0], [20.0, 20.0]]))
    assert torch.openreg.ipc_collect() == 0


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((4,), float(i) / 64)
        return x, x.sum(0, keepdim=True) ** 2


def _train(device, loader):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pinned = []
    for x, y in loader:
        pinned.append(x.is_pinned())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()], pinned


def test_dataloader_workers_pin_memory_and_non_blocking_copies():
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=8, num_workers=2, pin_memory=True)
    params, pinned = _train("openreg:0", loader)
    assert all(pinned) and len(pinned) == 8  # pinned by the loader's pin-memory thread
    reference, _ = _train("cpu", torch.utils.data.DataLoader(_Squares(), batch_size=8))
    for p, r in zip(params, reference):
        torch.testing.assert_close(p, r)


class _DeviceSamples(torch.utils.data.Dataset):
    """Made on the device inside the (spawned) worker: each batch crosses processes by IPC."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((3,), float(i), device="openreg:1") * 2


def test_dataloader_spawn_workers_send_device_tensors():
    loader = torch.utils.data.DataLoader(_DeviceSamples(), batch_size=4, num_workers=2,
                                         multiprocessing_context="spawn")
    batches = list(loader)
    assert [b.device for b in batches] == [torch.device("openreg:1")] * 3
    got = torch.cat([b.cpu() for b in batches])
    assert torch.equal(got, (torch.arange(12.0) * 2).unsqueeze(1).expand(12, 3))
