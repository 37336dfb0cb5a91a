"""The occl c10d backend (torch_openreg/distributed.py, csrc/adapters/distributed.cpp).

Every check runs in real processes (spawn, a FileStore in a temporary directory), several checks
per spawned job to save the ~3 s of `import torch` per process; each job is bounded in time and
its processes are killed when it overruns, so nothing can hang the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import torch_behaviour

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT = 150  # seconds for one spawned job, startup included


# ---------------------------------------------------------------------------------------------
# harness: run `check(rank, world)` in `world` spawned processes


def _entry(check, rank, world, init_file, backend, device_id, timeout_s, queue, env):
    os.environ.update(env)
    dist.set_debug_level_from_env()  # read when torch was imported, before `env` was set
    try:
        torch.openreg.set_device(rank % torch.openreg.device_count())
        kwargs = {} if backend is None else {"backend": backend}
        if device_id:
            kwargs["device_id"] = _dev(rank)
        dist.init_process_group(init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        result = check(rank, world)
        queue.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def run_ranks(check, world=2, backend="cpu:gloo,openreg:occl", timeout_s=60.0,
              job_timeout=JOB_TIMEOUT, expect_errors=False, env=None, device_id=False):
    """Runs `check` on `world` ranks; returns {rank: (status, result or traceback)}. Raises
    AssertionError naming the failing rank unless `expect_errors`. `backend=None` calls
    init_process_group without a backend name; `device_id` passes the rank's device."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(check, r, world, init_file, backend, device_id,
                                                  timeout_s, queue, env or {})) for r in range(world)]
        saved = dict(os.environ)
        os.environ.update(env or {})  # the children start with it (read by torch at import)
        try:
            for p in procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        deadline = time.monotonic() + job_timeout
        results = {}
        try:
            while len(results) < world and time.monotonic() < deadline:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                try:
                    rank, status, value = queue.get(timeout=0.5)
                    results[rank] = (status, value)
                except Exception:  # noqa: BLE001 - queue.Empty
                    pass
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
        finally:
            hung = [p for p in procs if p.is_alive()]
            for p in hung:
                p.kill()
                p.join()
        assert not hung, f"ranks still running after {job_timeout} s: {results}"
    if not expect_errors:
        failed = []
        for r in range(world):
            status, value = results.get(r, ("missing", f"exited with {procs[r].exitcode}"))
            if status != "ok":
                failed.append(f"rank {r}: {value}")
        assert not failed, "\n".join(failed)
    return results, [p.exitcode for p in procs]


def _dev(rank):
    return torch.device("openreg", rank % torch.openreg.device_count())


# ---------------------------------------------------------------------------------------------
# collectives with real data (one job, several checks)


def _check_reduce_like_cpu(rank, world):
    """reduce: the root gets the reduction; a non-root tensor is left as gloo leaves it on the
    CPU (its scratch space: partial reductions), element for element. NCCL would leave it
    unchanged; gloo on the CPU is the reference here."""
    dev = _dev(rank)
    R = dist.ReduceOp
    for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX):
        for n in (5, 1000):
            for dst in range(world):
                init = torch.arange(n, dtype=torch.float32) % 7 + rank + 1
                c = init.clone()
                dist.reduce(c, dst=dst, op=op)  # gloo, CPU tensors of the same group
                x = init.to(dev)
                dist.reduce(x, dst=dst, op=op)
                assert torch.equal(x.cpu(), c), (op, n, dst, rank, x.cpu()[:4], c[:4])
                if rank == dst:
                    full = torch.stack([torch.arange(n, dtype=torch.float32) % 7 + r + 1
                                        for r in range(world)])
                    ref = {R.SUM: full.sum(0), R.AVG: full.mean(0), R.PRODUCT: full.prod(0),
                           R.MIN: full.min(0).values, R.MAX: full.max(0).values}[op]
                    torch.testing.assert_close(x.cpu(), ref)
    # PREMUL_SUM (gloo on the CPU refuses it): the root gets the sum of the scaled inputs
    x = torch.full((5,), float(rank + 1), device=dev)
    dist.reduce(x, dst=0, op=dist._make_nccl_premul_sum(0.5))
    if rank == 0:
        assert torch.equal(x.cpu(), torch.full((5,), 0.5 * sum(range(1, world + 1))))


def _check_collectives(rank, world):
    dev = _dev(rank)
    R = dist.ReduceOp
    # every reduction and dtype, against the same reduction computed on the CPU
    vals = [torch.arange(6, dtype=torch.float64) + r + 1 for r in range(world)]
    stacked = torch.stack(vals)
    refs = {R.SUM: stacked.sum(0), R.AVG: stacked.mean(0), R.PRODUCT: stacked.prod(0),
            R.MIN: stacked.min(0).values, R.MAX: stacked.max(0).values}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for op, ref in refs.items():
            x = vals[rank].to(dtype).to(dev)
            dist.all_reduce(x, op=op)
            expect = ref.trunc() if (op == R.AVG and not dtype.is_floating_point) else ref
            torch.testing.assert_close(x.cpu(), expect.to(dtype), msg=f"{op} {dtype}")
    # PREMUL_SUM: sum of factor * input
    x = vals[rank].float().to(dev)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    torch.testing.assert_close(x.cpu(), 0.5 * stacked.sum(0).float())

    # zero-copy: gloo works on the device memory itself (same address, no device allocation, no
    # host allocation), where a round trip through the host would allocate a host buffer
    x = torch.ones(1 << 18, device=dev)
    ptr = x.data_ptr()
    before = torch.openreg.memory_stats(dev)["allocation.all.allocated"]
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work = dist.all_reduce(x, async_op=True)
        work.wait()
    host_bytes = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert host_bytes < x.nbytes // 4, host_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x.cpu()  # the control: a copy to the host shows
    assert sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0) >= x.nbytes
    assert torch.openreg.memory_stats(dev)["allocation.all.allocated"] == before
    assert x.data_ptr() == ptr and work.result()[0].data_ptr() == ptr
    assert torch.equal(x.cpu(), torch.full_like(x, world, device="cpu"))

    # async work objects: wait, is_completed, get_future (value on the device)
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    work = dist.all_reduce(x, op=R.AVG, async_op=True)
    fut = work.get_future()
    work.wait()
    assert work.is_completed() and work.is_success()
    # the division of AVG is part of the collective: visible right after wait()
    assert torch.equal(x.cpu(), torch.full((1 << 20,), (world + 1) / 2))
    value = fut.wait()[0]
    assert value.device == dev and value.data_ptr() == x.data_ptr()
    chained = dist.all_reduce(torch.ones(3, device=dev), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2).wait()
    assert chained.device == dev and torch.equal(chained.cpu(), torch.full((3,), 2.0 * world))

    # stream order: a non_blocking copy still in flight when the collective is issued is seen
    old = torch.openreg.set_copy_engine_config(latency_us=300_000)
    try:
        host = torch.full((1000,), float(rank + 1)).pin_memory()
        x = torch.zeros(1000, device=dev)
        x.copy_(host, non_blocking=True)
        dist.all_reduce(x)
        assert torch.equal(x.cpu(), torch.full((1000,), float(sum(range(1, world + 1))))), x[:3]
    finally:
        torch.openreg.set_copy_engine_config(*old)

    # broadcast, reduce
    x = torch.full((5,), float(rank), device=dev)
    dist.broadcast(x, src=1)
    assert torch.equal(x.cpu(), torch.full((5,), 1.0))
    _check_reduce_like_cpu(rank, world)

    # all_gather, all_gather_into_tensor, reduce_scatter_tensor
    outs = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank), device=dev))
    assert [o.cpu().tolist() for o in outs] == [[float(r)] * 3 for r in range(world)]
    out = torch.empty(world * 3, device=dev, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=dev, dtype=torch.bfloat16))
    assert out.cpu().tolist() == [float(r) for r in range(world) for _ in range(3)]
    inp = torch.arange(world * 4, dtype=torch.float32, device=dev) * (rank + 1)
    out = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(out, inp, op=R.AVG)
    full = torch.arange(world * 4, dtype=torch.float32) * sum(range(1, world + 1)) / world
    assert torch.equal(out.cpu(), full[rank * 4:(rank + 1) * 4])

    # gather, scatter
    gl = [torch.empty(2, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank), device=dev), gl, dst=0)
    if rank == 0:
        assert [g.cpu().tolist() for g in gl] == [[float(r)] * 2 for r in range(world)]
    out = torch.empty(2, device=dev)
    sl = [torch.full((2,), 10.0 + r, device=dev) for r in range(world)] if rank == 0 else None
    dist.scatter(out, sl, src=0)
    assert out.cpu().tolist() == [10.0 + rank] * 2

    # all_to_all_single, even and uneven splits (rank r sends r*world + d + 1 elements to d)
    inp = torch.arange(world * 2, dtype=torch.float32, device=dev) + 100 * rank
    out = torch.empty(world * 2, device=dev)
    dist.all_to_all_single(out, inp)
    assert out.cpu().tolist() == [100.0 * s + 2 * rank + i for s in range(world) for i in range(2)]
    in_splits = [rank * world + d + 1 for d in range(world)]
    out_splits = [s * world + rank + 1 for s in range(world)]
    inp = torch.cat([torch.full((n,), float(100 * rank + d)) for d, n in enumerate(in_splits)]).to(dev)
    out = torch.empty(sum(out_splits), device=dev)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    expect = torch.cat([torch.full((n,), float(100 * s + rank)) for s, n in enumerate(out_splits)])
    assert torch.equal(out.cpu(), expect)

    # point to point: send/recv, isend/irecv, batch_isend_irecv (a ring)
    peer = (rank + 1) % world
    prev = (rank - 1) % world
    if rank == 0:
        dist.send(torch.full((4,), 7.0, device=dev), dst=1)
    elif rank == 1:
        got = torch.empty(4, device=dev)
        dist.recv(got, src=0)
        assert got.cpu().tolist() == [7.0] * 4
    got = torch.empty(4, device=dev, dtype=torch.int64)
    reqs = [dist.isend(torch.full((4,), rank, device=dev, dtype=torch.int64), peer),
            dist.irecv(got, prev)]
    for r in reqs:
        r.wait()
    assert got.cpu().tolist() == [prev] * 4
    got = torch.empty(4, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank), device=dev), peer),
           dist.P2POp(dist.irecv, got, prev)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert got.cpu().tolist() == [float(prev)] * 4

    # coalesced forms
    xs = [torch.full((3,), float(rank + 1), device=dev), torch.full((2,), 2.0 * rank, device=dev)]
    dist.all_reduce_coalesced(xs)
    assert xs[0].cpu().tolist() == [float(sum(range(1, world + 1)))] * 3
    assert xs[1].cpu().tolist() == [2.0 * sum(range(world))] * 2
    outs = [torch.empty(world * 2, device=dev) for _ in range(2)]
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        for i, o in enumerate(outs):
            dist.all_gather_into_tensor(o, torch.full((2,), float(10 * i + rank), device=dev))
    cm.wait()
    for i, o in enumerate(outs):
        assert o.cpu().tolist() == [float(10 * i + r) for r in range(world) for _ in range(2)]

    # object collectives with openreg as the current device; barrier
    objs = [{"from": rank, "t": [1, 2]}] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"from": 0, "t": [1, 2]}]
    gathered = [None] * world
    dist.all_gather_object(gathered, ("rank", rank))
    assert gathered == [("rank", r) for r in range(world)]
    dist.barrier()

    # CPU tensors of the same group go to gloo, openreg tensors to occl
    group = dist.group.WORLD
    assert group._get_backend(torch.device("cpu")).name() == "gloo"
    assert group._get_backend(dev).name() == "occl"
    c = torch.ones(3)
    dist.all_reduce(c)
    assert c.tolist() == [float(world)] * 3


def test_collectives():
    run_ranks(_check_collectives)


# ---------------------------------------------------------------------------------------------
# how a process group picks occl; errors named by occl


def _check_occl_only(rank, world):
    dev = _dev(rank)
    group = dist.group.WORLD
    assert group._get_backend(dev).name() == "occl"
    x = torch.ones(2, device=dev)
    dist.all_reduce(x)
    assert x.cpu().tolist() == [float(world)] * 2
    # occl alone serves openreg tensors only, as NCCL serves CUDA tensors only
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))
    return dist.get_backend()


def test_occl_alone():
    results, _ = run_ranks(_check_occl_only, backend="occl")
    assert results[0][1] == "occl"


def _check_default_backends(rank, world):
    """init_process_group() without a backend name (with or without device_id=): gloo for CPU
    tensors, occl for openreg tensors, in the group and in its subgroups; DDP trains."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _dev(rank)
    for group in (dist.group.WORLD, dist.new_group(list(range(world)))):
        assert group._get_backend(dev).name() == "occl"
        assert group._get_backend(torch.device("cpu")).name() == "gloo"
        x = torch.full((3,), float(rank + 1), device=dev)
        dist.all_reduce(x, group=group)
        c = torch.full((3,), float(rank + 1))
        dist.all_reduce(c, group=group)
        assert x.cpu().tolist() == c.tolist() == [float(sum(range(1, world + 1)))] * 3
    gathered = [None] * world
    dist.all_gather_object(gathered, rank)  # through openreg, the current device
    assert gathered == list(range(world))
    # DDP's constructor asks the group for its default backend (torch 2.13 made it GLOO without
    # creating it: "Could not find backend type 1")
    ddp = DDP(_mlp().to(dev), device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mine = slice(rank * 4, (rank + 1) * 4)
    for x, y in _batches(world):
        opt.zero_grad()
        F.mse_loss(ddp(x[mine].to(dev)), y[mine].to(dev)).backward()
        opt.step()
    for p, q in zip(ddp.module.parameters(), _reference(world).parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    return dist.get_backend(), dist.group.WORLD._get_backend_name()


@pytest.mark.parametrize("device_id", [False, True])
def test_no_backend_name(device_id):
    results, _ = run_ranks(_check_default_backends, backend=None, device_id=device_id)
    # torch records the name it was given: none ("undefined") or the one found for device_id;
    # the group's default backend: occl ("custom", as with "occl"), or none named (as with
    # "cpu:gloo,openreg:occl" spelled out)
    if device_id:
        assert results[0][1] == ("cpu:gloo,openreg:occl",
                                 torch_behaviour.MIXED_GROUP_DEFAULT_BACKEND_WITH_DEVICE_ID)
    else:
        assert results[0][1] == ("undefined", "custom")


def test_registration():
    assert dist.Backend.default_device_backend_map["openreg"] == "cpu:gloo,openreg:occl"
    assert dist.get_default_backend_for_device("openreg") == "cpu:gloo,openreg:occl"
    assert dist.Backend.backend_capability["occl"] == ["openreg"]
    assert dist.Backend("occl") == "occl"
    assert dist.is_backend_available("occl")
    assert dist.is_backend_available("cpu:gloo,openreg:occl")


def _check_strict_memory(rank, world):
    # device pages are PROT_NONE to the host outside kernels: gloo's threads may touch them only
    # while occl has opened them for a collective (a fault would kill the rank)
    from torch_openreg import _C  # noqa: F401
    dev = _dev(rank)
    x = torch.full((1 << 16,), float(rank + 1), device=dev)
    work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    assert torch.equal(x.cpu(), torch.full((1 << 16,), (world + 1) / 2))
    out = torch.empty(world * 4, device=dev)
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=dev))
    assert out.cpu().tolist() == [float(r) for r in range(world) for _ in range(4)]
    got = torch.empty(8, device=dev)
    reqs = [dist.isend(torch.full((8,), float(rank), device=dev), (rank + 1) % world),
            dist.irecv(got, (rank - 1) % world)]
    for r in reqs:
        r.wait()
    assert got.cpu().tolist() == [float((rank - 1) % world)] * 8


def test_strict_memory():
    run_ranks(_check_strict_memory, env={"OPENREG_STRICT_MEMORY": "1"})


# ---------------------------------------------------------------------------------------------
# more ranks than devices (ranks share a device), subgroups


def _check_three_ranks(rank, world):
    dev = _dev(rank)
    assert dev.index == rank % 2  # ranks 0 and 2 share openreg:0
    _check_reduce_like_cpu(rank, world)  # gloo's scratch differs between ranks with 3 ranks
    x = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    assert x.cpu().tolist() == [6.0] * 4
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        y = torch.full((3,), float(rank + 1), device=dev)
        dist.all_reduce(y, group=sub)
        assert y.cpu().tolist() == [4.0] * 3
        assert sub._get_backend(dev).name() == "occl"
        outs = [torch.empty(1, device=dev) for _ in range(2)]
        dist.all_gather(outs, torch.full((1,), float(rank), device=dev), group=sub)
        assert [o.item() for o in outs] == [0.0, 2.0]
    dist.barrier()


def test_more_ranks_than_devices_and_subgroups():
    run_ranks(_check_three_ranks, world=3)


def _check_split(rank, world):
    """Bound to a device (init_process_group(device_id=...)), torch splits the default group:
    split_group, a 2-D DeviceMesh, new_group on the ranks left out. Each split group has occl
    for openreg tensors and gloo for CPU tensors, and reduces over its own ranks only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dev = _dev(rank)

    def reduce_in(group, members):
        assert group._get_backend(dev).name() == "occl"
        assert group._get_backend(torch.device("cpu")).name() == "gloo"
        assert sorted(dist.get_process_group_ranks(group)) == sorted(members)
        x = torch.full((3,), float(rank + 1), device=dev)
        c = torch.full((3,), float(rank + 1))
        dist.all_reduce(x, group=group)
        dist.all_reduce(c, group=group)
        assert x.cpu().tolist() == c.tolist() == [float(sum(m + 1 for m in members))] * 3

    mesh = init_device_mesh("openreg", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        reduce_in(group, dist.get_process_group_ranks(group))
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [rank // 2 * 2, rank // 2 * 2 + 1]
    # Groups that leave ranks out come last: torch 2.13 names a split group after its ranks and
    # the number of groups this rank knows, and gloo (for CPU tensors and under occl) meets its
    # peers in the store under that name, so a split after such a group hangs until the timeout
    # (docs/distributed.md)
    halves = [[0, 3], [1, 2]]
    sub = dist.split_group(split_ranks=halves, timeout=datetime.timedelta(seconds=30))
    mine = halves[0] if rank in halves[0] else halves[1]
    reduce_in(sub, mine)
    assert sub.bound_device_id == dev
    def partial_group():
        pair = dist.new_group([0, 1])  # ranks 2, 3: perform_nocolor_split on occl
        if rank < 2:
            reduce_in(pair, [0, 1])

    if torch_behaviour.PARTIAL_GROUP_BEFORE_SPLITS:
        partial_group()
    # the ranks left out take part in the split and get no group
    three = dist.split_group(split_ranks=[[1, 2, 3]])
    assert (three == torch_behaviour.NOT_IN_SPLIT) == (rank == 0)
    # split of a split: ranks of the parent group (0, 1, 2 of [1, 2, 3])
    again = dist.split_group(parent_pg=three, split_ranks=[[0, 1, 2]]) if rank else None
    if rank:
        reduce_in(three, [1, 2, 3])
        reduce_in(again, [1, 2, 3])
    if not torch_behaviour.PARTIAL_GROUP_BEFORE_SPLITS:
        partial_group()
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dt = distribute_tensor(t.to(dev), mesh, [Shard(0), Shard(1)])
    assert torch.equal(dt.redistribute(mesh, [Replicate(), Replicate()]).to_local().cpu(), t)
    dist.barrier()


def test_split_groups_and_2d_mesh():
    run_ranks(_check_split, world=4, backend=None, device_id=True)


# ---------------------------------------------------------------------------------------------
# DDP, FSDP2, DTensor tensor parallelism, distributed checkpoint: equal to one process


def _mlp():
    import torch.nn as nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _batches(world, steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g))
            for _ in range(steps)]


def _reference(world, steps=3, lr=0.1):
    """The single-process run on the concatenated batch, on the CPU."""
    import torch.nn.functional as F
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in _batches(world, steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _check_parallel(rank, world):
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _dev(rank)
    ref = _reference(world)
    mine = slice(rank * 4, (rank + 1) * 4)

    def train(model, steps=3, no_sync_first=False):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(_batches(world, steps)):
            opt.zero_grad()
            F.mse_loss(model(x[mine].to(dev)), y[mine].to(dev)).backward()
            opt.step()

    # DDP, small buckets (several all_reduce per step), device_ids=[device]
    ddp = DDP(_mlp().to(dev), device_ids=[dev.index], bucket_cap_mb=0.001)
    train(ddp)
    assert ddp._get_ddp_logging_data()["num_buckets_reduced"] >= 2  # several all_reduce a step
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)

    # DDP no_sync: gradients accumulate locally, then one synchronized step averages them all
    ddp = DDP(_mlp().to(dev), device_ids=[dev.index])
    (x, y), = _batches(world, 1)
    half = [slice(rank * 4, rank * 4 + 2), slice(rank * 4 + 2, rank * 4 + 4)]
    with ddp.no_sync():
        F.mse_loss(ddp(x[half[0]].to(dev)), y[half[0]].to(dev)).backward()
    local = [p.grad.cpu().clone() for p in ddp.parameters()]
    others = [torch.empty_like(g) for g in local]
    F.mse_loss(ddp(x[half[1]].to(dev)), y[half[1]].to(dev)).backward()
    refm = _mlp()
    for h in range(2):
        for r in range(world):
            sl = slice(r * 4 + 2 * h, r * 4 + 2 * h + 2)
            (F.mse_loss(refm(x[sl]), y[sl]) / world).backward()
    for p, q in zip(ddp.parameters(), refm.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)
    del local, others

    # FSDP2 with meta-device init, then bfloat16 mixed precision (compared loosely)
    mesh = init_device_mesh("openreg", (world,))
    with torch.device("meta"):
        model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=dev)
    full = _mlp().state_dict()
    model.load_state_dict({k: distribute_tensor(v.to(dev), mesh, [Shard(0)])
                           for k, v in full.items()})
    assert model[0].weight.to_local().shape == (32 // world, 8)
    train(model)
    for (k, p), q in zip(model.state_dict().items(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), rtol=1e-5, atol=1e-5)

    mp_model = copy.deepcopy(_mlp()).to(dev)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in mp_model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(mp_model, mesh=mesh, mp_policy=policy)
    train(mp_model)
    for (k, p), q in zip(mp_model.state_dict().items(), ref.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), rtol=0.05, atol=0.02)

    # distributed checkpoint of the sharded model: save, perturb, load back
    import torch.distributed.checkpoint as dcp
    ckpt = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)
    saved = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=ckpt[0])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=ckpt[0])
    model.load_state_dict(state)
    for k, v in model.state_dict().items():
        assert v.device == dev and torch.equal(v.full_tensor().cpu(), saved[k]), k

    # DTensor: distribute_tensor and tensor-parallel MLP (colwise then rowwise)
    t = torch.arange(16.0).reshape(4, 4)
    dt = distribute_tensor(t.to(dev), mesh, [Shard(0)])
    assert dt.to_local().device == dev and torch.equal(dt.to_local().cpu(), t.chunk(world)[rank])
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local().cpu(), t)
    tp = parallelize_module(_mlp().to(dev), mesh, {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
    opt = torch.optim.SGD(tp.parameters(), lr=0.1, foreach=False)  # DTensor and plain params
    for x, y in _batches(world):
        opt.zero_grad()
        F.mse_loss(tp(x.to(dev)), y.to(dev)).backward()  # TP: every rank sees the full batch
        opt.step()
    for p, q in zip(tp.parameters(), ref.parameters()):
        full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full_p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)


def test_ddp_fsdp2_dtensor_checkpoint():
    run_ranks(_check_parallel, backend="occl")


# ---------------------------------------------------------------------------------------------
# launchers: torchrun (through the example) and torch.multiprocessing.spawn


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_example():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.join(ROOT, "examples", "ddp.py"), "--steps", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0/2 on openreg:0" in out.stdout and "rank 1/2 on openreg:1" in out.stdout
    assert "replicas identical: True" in out.stdout, out.stdout


def _spawned(local_rank, world, port, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.openreg.set_device(local_rank)
    dist.init_process_group(rank=local_rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.full((3,), float(local_rank + 1), device="openreg")
    dist.all_reduce(x)
    with open(os.path.join(tmp, str(local_rank)), "w") as f:
        f.write(f"{x.device} {x.cpu().tolist()}")
    dist.destroy_process_group()


def test_multiprocessing_spawn():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_spawned, args=(2, _free_port(), tmp), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + JOB_TIMEOUT
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("spawned ranks did not finish")
        results = [open(os.path.join(tmp, str(r))).read() for r in range(2)]
    assert results == ["openreg:0 [3.0, 3.0, 3.0]", "openreg:1 [3.0, 3.0, 3.0]"]


# ---------------------------------------------------------------------------------------------
# failures: every surviving rank gets an error within the timeout, nothing is left behind


def _shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _check_mismatch(rank, world, device=None):
    x = torch.ones(4 + 4 * rank, device=device or _dev(rank))  # 4 elements on rank 0, 8 on rank 1
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        return ("error", str(e), time.monotonic() - t0)
    return ("no error", x.cpu().tolist(), time.monotonic() - t0)


def _check_mismatch_cpu(rank, world):
    return _check_mismatch(rank, world, "cpu")


def _check_killed(rank, world):
    x = torch.ones(1 << 22, device=_dev(rank))
    dist.all_reduce(x)  # connections are up
    t0 = time.monotonic()
    work = dist.all_reduce(x, async_op=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the collective
    try:
        work.wait()
    except RuntimeError as e:
        return ("error", str(e), time.monotonic() - t0)
    return ("no error", None, time.monotonic() - t0)


def _check_timeout(rank, world):
    x = torch.ones(4, device=_dev(rank))
    dist.all_reduce(x)
    if rank == 1:
        time.sleep(8)  # never joins rank 0's collective within its 3 s timeout
        return ("slept", None, 0.0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        return ("error", str(e), time.monotonic() - t0)
    return ("no error", None, time.monotonic() - t0)


@pytest.mark.parametrize("case", ["mismatch", "mismatch_no_backend_name", "mismatch_detail",
                                  "killed", "timeout"])
def test_failures_raise_within_timeout(case):
    """Mismatched shapes: occl compares them across ranks before each collective, also in the
    group init_process_group() builds without a backend name; with TORCH_DISTRIBUTED_DEBUG=DETAIL
    PyTorch's own wrapper checks first, with its message."""
    check = {"mismatch": _check_mismatch, "mismatch_no_backend_name": _check_mismatch,
             "mismatch_detail": _check_mismatch,
             "killed": _check_killed, "timeout": _check_timeout}[case]
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if case == "mismatch_detail" else None
    backend = None if case == "mismatch_no_backend_name" else "cpu:gloo,openreg:occl"
    shm = _shm()
    t0 = time.monotonic()
    results, exitcodes = run_ranks(check, timeout_s=3.0, job_timeout=60, expect_errors=True,
                                   env=env, backend=backend)
    elapsed = time.monotonic() - t0
    survivors = {r: v for r, (status, v) in results.items() if status == "ok"}
    if case == "killed":
        assert exitcodes[1] == -signal.SIGKILL and 1 not in results
        assert 0 in survivors, results
    elif case == "timeout":
        assert survivors[1][0] == "slept"
        survivors = {0: survivors[0]}
    else:
        assert set(survivors) == {0, 1}, results
        for r, (status, message, seconds) in survivors.items():
            assert "Detected mismatch between collectives on ranks" in message, message
            if case == "mismatch_detail":  # PyTorch's wrapper checked first, with its message
                assert "CollectiveFingerPrint" in message and "occl:" not in message, message
            else:  # occl's own message names each rank's call
                assert ("group rank 0 called ALLREDUCE(SUM) (Float[4]); "
                        "group rank 1 called ALLREDUCE(SUM) (Float[8])") in message, message
    for r, (status, message, seconds) in survivors.items():
        assert status == "error", (case, r, message)
        assert seconds < 3.0 + 5.0, (case, r, seconds, message)  # the timeout, plus slack
    assert elapsed < 60
    # no shared memory left behind by torch (torch_<pid>_...); /dev/shm is shared with every
    # other process of the machine, so only torch's names are compared
    assert {n for n in _shm() - shm if n.startswith("torch_")} == set()
    assert not multiprocessing.active_children()


def _check_mismatches(rank, world):
    """Each kind of mismatch raises the same error on every rank, before any data moved; the
    group stays usable after each; collectives whose shapes may differ by rank do not raise."""
    dev = _dev(rank)
    seen = {}

    def attempt(name, call, *tensors):
        before = [t.cpu().clone() for t in tensors]
        try:
            call()
        except RuntimeError as e:
            seen[name] = str(e)
        else:
            seen[name] = None
        for b, t in zip(before, tensors):  # nothing written before the check raised
            assert torch.equal(b, t.cpu()) or seen[name] is None, name
        ok = torch.ones(3, device=dev)
        dist.all_reduce(ok)  # the group still works, tags still in step
        assert ok.cpu().tolist() == [world] * 3, name

    small_or_big = torch.full((2 + 2 * rank,), float(rank), device=dev)
    attempt("shape", lambda: dist.all_reduce(small_or_big), small_or_big)
    # a bigger buffer on a non-root rank: gloo would fill its start and raise nothing
    attempt("broadcast", lambda: dist.broadcast(small_or_big, src=0), small_or_big)
    typed = torch.ones(4, device=dev, dtype=torch.float16 if rank == 0 else torch.float32)
    attempt("dtype", lambda: dist.all_reduce(typed), typed)
    four = torch.full((4,), float(rank), device=dev)
    attempt("kind", lambda: dist.all_reduce(four) if rank == 0 else dist.broadcast(four, 0), four)
    attempt("op", lambda: dist.all_reduce(four, op=dist.ReduceOp.SUM if rank == 0
                                          else dist.ReduceOp.MAX), four)
    attempt("root", lambda: dist.broadcast(four, src=rank), four)
    gathered = torch.full((8,), 7.0, device=dev)
    attempt("all_gather", lambda: dist.all_gather_into_tensor(gathered, small_or_big[:2 + rank]),
            gathered)
    # uneven all_to_all_single: rank 0 sends 1 to itself and 2 to rank 1, rank 1 sends 3 to
    # rank 0 and 1 to itself; valid, and then once with rank 1 expecting 3 from rank 0
    sends = [[1, 2], [3, 1]][rank]
    receives = [[1, 3], [2, 1]][rank]
    source = torch.arange(float(sum(sends)), device=dev) + 10 * rank
    target = torch.empty(sum(receives), device=dev)
    attempt("uneven", lambda: dist.all_to_all_single(target, source, receives, sends))
    expected = [[0.0, 10.0, 11.0, 12.0], [1.0, 2.0, 13.0]][rank]
    assert target.cpu().tolist() == expected
    wrong = [[1, 3], [3, 1]][rank]  # rank 1 expects 3 from rank 0, which sends 2
    received = torch.full((sum(wrong),), 7.0, device=dev)
    attempt("splits", lambda: dist.all_to_all_single(received, source, wrong, sends), received)
    # valid calls whose shapes differ by rank: not mismatches
    # an empty tensor from a rank that sends nothing, rows of 3 from the other
    rows = torch.arange(6.0, device=dev).reshape(2, 3) if rank == 0 else torch.empty(0, device=dev)
    got = torch.empty((2, 3) if rank == 1 else (0,), device=dev)
    attempt("empty_rows", lambda: dist.all_to_all_single(got, rows, [2, 0] if rank == 1 else [0, 0],
                                                          [0, 2] if rank == 0 else [0, 0]))
    if rank == 1:
        assert got.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    # reduce_scatter of a list: each rank's output is its share, of its own size
    share = torch.empty(2 + rank, device=dev)
    attempt("uneven_shares", lambda: dist.reduce_scatter(
        share, [torch.ones(2, device=dev), torch.ones(3, device=dev)]))
    assert share.cpu().tolist() == [2.0] * (2 + rank)
    # the same number of elements in another shape (gloo moves elements)
    flat_or_not = torch.ones(() if rank == 0 else (1,), device=dev)
    attempt("scalar_and_one", lambda: dist.all_reduce(flat_or_not))
    assert flat_or_not.cpu().tolist() in (2.0, [2.0])
    # a mismatch inside a coalescing block, whose end torch then skips: the next block works
    pair = [torch.ones(2 + rank, device=dev), torch.ones(2, device=dev)]

    def coalesced():
        with dist._coalescing_manager(async_ops=False):
            for t in pair:
                dist.all_reduce(t)
    attempt("coalesced", coalesced)
    pair = [torch.ones(2, device=dev), torch.ones(3, device=dev)]
    coalesced()
    assert [t.cpu().tolist() for t in pair] == [[2.0] * 2, [2.0] * 3]
    return seen


def test_mismatch_catalogue():
    results, _ = run_ranks(_check_mismatches, timeout_s=10.0, job_timeout=120)
    by_rank = [results[r][1] for r in range(2)]
    assert by_rank[0] == by_rank[1]  # the same error on every rank
    seen = by_rank[0]
    prefix = "occl: Detected mismatch between collectives on ranks: "
    for valid in ("uneven", "empty_rows", "uneven_shares", "scalar_and_one"):
        assert seen[valid] is None, (valid, seen[valid])
    expected = {
        "shape": "group rank 0 called ALLREDUCE(SUM) (Float[2]); "
                 "group rank 1 called ALLREDUCE(SUM) (Float[4])",
        "broadcast": "group rank 0 called BROADCAST(root 0) (Float[2]); "
                     "group rank 1 called BROADCAST(root 0) (Float[4])",
        "dtype": "group rank 0 called ALLREDUCE(SUM) (Half[4]); "
                 "group rank 1 called ALLREDUCE(SUM) (Float[4])",
        "kind": "group rank 0 called ALLREDUCE(SUM) (Float[4]); "
                "group rank 1 called BROADCAST(root 0) (Float[4])",
        "op": "group rank 0 called ALLREDUCE(SUM) (Float[4]); "
              "group rank 1 called ALLREDUCE(MAX) (Float[4])",
        "root": "group rank 0 called BROADCAST(root 0) (Float[4]); "
                "group rank 1 called BROADCAST(root 1) (Float[4])",
        "all_gather": "group rank 0 called ALLGATHER_BASE Float[2] -> Float[8]; "
                      "group rank 1 called ALLGATHER_BASE Float[3] -> Float[8]",
        "splits": "group ranks 0, 1 called ALLTOALL_BASE Float, but group rank 0 sends 2 "
                  "elements to group rank 1, which expects 3 from it",
        "coalesced": "group rank 0 called ALLREDUCE_COALESCED(SUM) (Float[2], Float[2]); "
                     "group rank 1 called ALLREDUCE_COALESCED(SUM) (Float[3], Float[2])",
    }
    for name, text in expected.items():
        assert seen[name] is not None and seen[name].startswith(prefix + text), (name, seen[name])
        assert "OPENREG_OCCL_CHECK=0" in seen[name]


def test_mismatch_unchecked_is_gloo():
    """With the check off (OPENREG_OCCL_CHECK=0) occl does what gloo does on CPU tensors (the
    reference, run in the same job): the rank that receives more bytes than it expects (rank 0:
    4 elements against rank 1's 8) aborts inside gloo ("Received data size doesn't match
    expected size"), the other one raises "Connection reset by peer". Nothing hangs."""
    outcomes = {}
    for device, check in (("cpu", _check_mismatch_cpu), ("openreg", _check_mismatch)):
        results, exitcodes = run_ranks(check, timeout_s=3.0, job_timeout=60, expect_errors=True,
                                       env={"OPENREG_OCCL_CHECK": "0"})
        raised = [r for r, (status, v) in results.items() if status == "ok" and v[0] == "error"]
        aborted = [r for r, code in enumerate(exitcodes) if code == -signal.SIGABRT]
        outcomes[device] = (aborted, raised)
    assert outcomes["openreg"] == outcomes["cpu"] == ([0], [1]), outcomes
    assert not multiprocessing.active_children()
