"""Pinned host memory: the caching host allocator of openreg (csrc/adapters/host_allocator.cpp).

What is checked: pinning (tensors, storages, factories, DataLoader), that freed pinned blocks are
reused, that the statistics are true, and that a block still used by a queued non_blocking copy is
not handed out again before the copy ran (record_event), in both directions.
"""

import gc

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torch_openreg.testing import hold_stream

N = 1 << 16  # floats: 256 KiB, a power of two (the allocator rounds sizes up to one)


def stat(name):
    return torch.openreg.host_memory_stats()[name]


# ---------------------------------------------------------------- pinning


def test_pin_memory_copies_values_and_pins():
    x = torch.randn(3, 5)
    p = x.pin_memory()
    assert p.is_pinned() and not x.is_pinned()
    assert p.data_ptr() != x.data_ptr()
    assert torch.equal(p, x)
    assert p.pin_memory() is p  # already pinned: no copy


def test_views_and_interior_pointers_of_pinned_memory_are_pinned():
    p = torch.arange(100.0).pin_memory()
    assert p[37:].is_pinned()
    assert p.view(10, 10).t().is_pinned()


def test_factory_with_pin_memory():
    e = torch.empty(4, 4, pin_memory=True)
    assert e.is_pinned()
    z = torch.zeros(7, dtype=torch.int64, pin_memory=True)
    assert z.is_pinned() and torch.equal(z, torch.zeros(7, dtype=torch.int64))


def test_pinned_storages():
    s = torch.UntypedStorage(64)
    assert not s.is_pinned()
    ps = s.pin_memory()
    assert ps.is_pinned() and ps.nbytes() == 64
    t = torch.arange(8.0)
    assert t.untyped_storage().pin_memory().is_pinned()
    assert torch.equal(torch.tensor([], dtype=torch.float32).set_(
        t.untyped_storage().pin_memory()), t)


def test_only_cpu_tensors_can_be_pinned():
    x = torch.ones(3, device="openreg")
    with pytest.raises(RuntimeError, match="(?i)pinned"):
        x.pin_memory()
    with pytest.raises(RuntimeError, match="(?i)pinned"):
        torch.empty(3, device="openreg", pin_memory=True)


# ---------------------------------------------------------------- caching and statistics


def test_freed_pinned_block_is_reused_without_a_new_host_allocation():
    p = torch.empty(N).pin_memory()
    address = p.data_ptr()
    allocs = stat("num_host_alloc")
    del p
    q = torch.empty(N).pin_memory()
    assert q.data_ptr() == address
    assert stat("num_host_alloc") == allocs
    # Sizes are rounded up to a power of two, so a slightly smaller request fits the block too.
    del q
    r = torch.empty(N - 100).pin_memory()
    assert r.data_ptr() == address


def test_host_memory_stats_follow_allocations():
    # Pinned blocks freed while their copies may be in flight (as earlier tests leave them)
    for _ in range(2):
        staged = torch.ones(1 << 16).pin_memory()
        staged.to("openreg", non_blocking=True)
        del staged
    torch.accelerator.synchronize()
    # Blocks freed while a copy used them count as active until the allocator next looks at their
    # events (its next allocation; reading the stats does not look, as on CUDA): emptying the
    # cache looks first, so that `before` holds no block an earlier test left pending.
    torch.accelerator.empty_host_cache()
    before = torch.openreg.host_memory_stats()
    assert {"allocations.current", "allocated_bytes.peak", "active_requests.current",
            "active_bytes.current", "num_host_alloc", "num_host_free",
            "host_alloc_time.total"} <= set(before)
    nbytes = 3 * (1 << 20) + 5  # odd size: rounded to the next power of two
    p = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    s = torch.openreg.host_memory_stats()
    assert s["active_requests.current"] == before["active_requests.current"] + 1
    assert s["active_bytes.current"] == before["active_bytes.current"] + (4 << 20)
    del p
    s = torch.openreg.host_memory_stats()
    assert s["active_requests.current"] == before["active_requests.current"]
    assert s["active_bytes.current"] == before["active_bytes.current"]
    # The block stays cached: still counted as allocated from the system.
    assert s["allocations.current"] >= 1
    assert s["allocated_bytes.current"] >= 4 << 20


def test_nested_stats_match_the_flat_ones():
    nested = torch.openreg.host_memory_stats_as_nested_dict()
    flat = torch.openreg.host_memory_stats()
    assert nested["allocations"]["current"] == flat["allocations.current"]
    assert nested["num_host_alloc"] == flat["num_host_alloc"]


def test_empty_host_cache_returns_cached_blocks_to_the_system():
    torch.accelerator.synchronize()
    kept = torch.empty(N).pin_memory()
    p = torch.empty(8 * N).pin_memory()
    del p
    freed = stat("num_host_free")
    torch.accelerator.empty_host_cache()
    s = torch.openreg.host_memory_stats()
    assert s["num_host_free"] > freed
    assert s["allocations.current"] == s["active_requests.current"]  # only blocks in use remain
    assert kept.is_pinned()
    del kept


def test_reset_peak_and_accumulated_host_stats():
    p = torch.empty(16 * N).pin_memory()
    del p
    torch.openreg.reset_peak_host_memory_stats()
    s = torch.openreg.host_memory_stats()
    assert s["active_bytes.peak"] == s["active_bytes.current"]
    torch.openreg.reset_accumulated_host_memory_stats()
    s = torch.openreg.host_memory_stats()
    assert s["active_requests.allocated"] == 0 and s["active_requests.freed"] == 0
    q = torch.empty(16 * N).pin_memory()
    assert stat("active_requests.allocated") == 1
    del q


# ---------------------------------------------------------------- record_event


def test_block_of_an_in_flight_h2d_copy_is_not_reused_before_the_copy_ran(device):
    torch.accelerator.synchronize()
    stream = torch.openreg.current_stream(device)
    dst = torch.empty(N, device=device)
    with hold_stream(stream):  # the copy stays queued for the whole block
        src = torch.full((N,), 7.0).pin_memory()
        address = src.data_ptr()
        dst.copy_(src, non_blocking=True)
        del src  # the caller drops its reference while the copy is still queued
        gc.collect()
        other = torch.empty(N).pin_memory()
        assert other.data_ptr() != address
        other.fill_(-1.0)  # would corrupt the copy if it had been given the source's block
    torch.openreg.synchronize(device)
    assert torch.equal(dst.cpu(), torch.full((N,), 7.0))
    again = torch.empty(N).pin_memory()  # the copy ran: the block is free again
    assert again.data_ptr() == address


def test_destination_of_an_in_flight_d2h_copy_is_not_reused(device):
    x = torch.arange(N, dtype=torch.float32, device=device)
    with hold_stream(torch.openreg.current_stream(device)):
        host = torch.empty(N).pin_memory()
        address = host.data_ptr()
        host.copy_(x, non_blocking=True)
        del host
        other = torch.full((N,), -1.0).pin_memory()
        assert other.data_ptr() != address
    torch.openreg.synchronize(device)
    # The late copy landed in the old block, not in the new tensor.
    assert torch.equal(other, torch.full((N,), -1.0))


def test_event_of_a_side_stream_copy_is_tracked(device):
    side = torch.openreg.Stream(device)
    src = torch.full((N,), 3.0).pin_memory()
    address = src.data_ptr()
    dst = torch.empty(N, device=device)
    side.wait_stream(torch.openreg.current_stream(device))
    with hold_stream(side):
        with torch.openreg.stream(side):
            dst.copy_(src, non_blocking=True)
        del src
        assert torch.empty(N).pin_memory().data_ptr() != address
    side.synchronize()
    assert torch.empty(N).pin_memory().data_ptr() == address
    torch.openreg.current_stream(device).wait_stream(side)
    assert torch.equal(dst.cpu(), torch.full((N,), 3.0))


# ---------------------------------------------------------------- DataLoader


def test_dataloader_pins_batches_for_openreg_and_training_matches_cpu():
    torch.manual_seed(0)
    xs, ys = torch.randn(64, 8), torch.randn(64, 1)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=16, pin_memory=True)

    def train(device, batches):
        torch.manual_seed(1)
        model = torch.nn.Linear(8, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.weight.detach().cpu()

    pinned = []
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        pinned.append((x, y))
    on_device = train("openreg:1", pinned)
    on_cpu = train("cpu", [(x.clone(), y.clone()) for x, y in pinned])
    torch.testing.assert_close(on_device, on_cpu)
