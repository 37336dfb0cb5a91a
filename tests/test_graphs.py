"""Graph capture and replay: torch.accelerator.Graph on openreg (docs/graphs.md)."""

import re
import threading

import pytest
import torch

DEV = "openreg"


def side_stream():
    return torch.Stream(device=DEV)


def test_capture_records_without_running_and_replay_reruns_on_the_same_memory():
    x = torch.zeros(1000, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        x += 1
        y = x * 2
    # Nothing ran during the capture.
    assert torch.equal(x.cpu(), torch.zeros(1000))
    g.replay()
    assert torch.equal(x.cpu(), torch.ones(1000)) and torch.equal(y.cpu(), torch.full((1000,), 2.0))
    g.replay()
    assert torch.equal(x.cpu(), torch.full((1000,), 2.0))
    assert torch.equal(y.cpu(), torch.full((1000,), 4.0))


def test_static_input_update_gives_new_outputs():
    torch.manual_seed(0)
    w = torch.randn(16, 8, device=DEV)
    static_in = torch.zeros(4, 16, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        out = torch.relu(static_in @ w).sum(1)
    for _ in range(3):
        x = torch.randn(4, 16)
        static_in.copy_(x)
        g.replay()
        torch.testing.assert_close(out.cpu(), torch.relu(x @ w.cpu()).sum(1))


def test_is_capturing_is_truthful():
    s, g = side_stream(), torch.accelerator.Graph()
    assert not s.is_capturing()
    seen = []
    with s, g:
        seen.append(s.is_capturing())
        seen.append(torch.accelerator.current_stream().is_capturing())
        seen.append(torch.openreg.is_current_stream_capturing())
        seen.append(torch.openreg.default_stream().is_capturing())
    assert seen == [True, True, True, False]
    assert not s.is_capturing() and not torch.openreg.is_current_stream_capturing()


def test_kernels_of_every_route_are_captured():
    # fallback (add, mm), codegen (fill_, zero_), dispatch stub (abs), aten kernel (mse_loss),
    # custom op (openreg::custom_abs), overrideable op (convolution), copies.
    torch.manual_seed(0)
    a = torch.randn(3, 4, device=DEV)
    img = torch.randn(1, 2, 5, 5, device=DEV)
    wt = torch.randn(3, 2, 3, 3, device=DEV)
    buf = torch.empty(3, 4, device=DEV)
    z = torch.ones(3, 4, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        buf.fill_(7.0)
        z.zero_()
        r_abs = torch.abs(a)
        r_mse = torch.nn.functional.mse_loss(a, buf)
        r_custom = torch.ops.openreg.custom_abs(a)
        r_conv = torch.nn.functional.conv2d(img, wt)
        r_copy = a.clone()
        r_mm = a @ a.t()
    assert torch.equal(z.cpu(), torch.ones(3, 4))  # not run yet
    g.replay()
    ac = a.cpu()
    assert torch.equal(buf.cpu(), torch.full((3, 4), 7.0))
    assert torch.equal(z.cpu(), torch.zeros(3, 4))
    assert torch.equal(r_abs.cpu(), ac.abs())
    torch.testing.assert_close(r_mse.cpu(), torch.nn.functional.mse_loss(ac, torch.full((3, 4), 7.0)))
    assert torch.equal(r_custom.cpu(), ac.abs())
    torch.testing.assert_close(r_conv.cpu(), torch.nn.functional.conv2d(img.cpu(), wt.cpu()))
    assert torch.equal(r_copy.cpu(), ac)
    torch.testing.assert_close(r_mm.cpu(), ac @ ac.t())


def test_pinned_async_copies_are_captured_and_read_host_memory_at_replay():
    host_in = torch.zeros(8).pin_memory()
    host_out = torch.zeros(8).pin_memory()
    dev = torch.zeros(8, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        dev.copy_(host_in, non_blocking=True)
        dev.mul_(3)
        host_out.copy_(dev, non_blocking=True)
    host_in.copy_(torch.arange(8.0))
    g.replay()
    torch.accelerator.synchronize()
    assert torch.equal(host_out, torch.arange(8.0) * 3)


def test_allocations_come_from_a_private_pool_kept_for_the_graph():
    s, g = side_stream(), torch.accelerator.Graph()
    x = torch.ones(256, device=DEV)
    with s, g:
        tmp = x * 2
        y = tmp + 1
        ptr = tmp.data_ptr()
        del tmp  # freed during capture: its block stays in the graph's pool
    torch.accelerator.empty_cache()
    # Work outside the graph never gets the graph's blocks, even after empty_cache.
    others = [torch.empty(256, device=DEV) for _ in range(20)]
    assert all(o.data_ptr() != ptr for o in others)
    g.replay()
    assert torch.equal(y.cpu(), torch.full((256,), 3.0))
    assert g.pool() != (0, 0)


def test_pool_sharing():
    s = side_stream()
    g1 = torch.accelerator.Graph()
    x = torch.ones(64, device=DEV)
    with s, g1:
        y1 = x + 1
    g2 = torch.accelerator.Graph(pool=g1.pool())
    with s, g2:
        y2 = y1 * 3
    assert g2.pool() == g1.pool()
    g1.replay()
    g2.replay()
    assert torch.equal(y2.cpu(), torch.full((64,), 6.0))
    g3 = torch.accelerator.Graph()
    with s, g3:
        x + 1
    assert g3.pool() != g1.pool()


def test_keep_graph_instantiate_and_reset():
    x = torch.zeros(4, device=DEV)
    s = side_stream()
    g = torch.accelerator.Graph(keep_graph=True)
    with s, g:
        x.add_(1)
    g.instantiate()
    g.replay()
    g.instantiate()  # a kept graph can be instantiated again
    g.replay()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))

    g2 = torch.accelerator.Graph(keep_graph=True)
    with s, g2:
        x.add_(10)
    g2.replay()  # instantiates on first replay
    assert torch.equal(x.cpu(), torch.full((4,), 12.0))

    g3 = torch.accelerator.Graph()  # keep_graph=False: instantiated by capture_end
    with s, g3:
        x.add_(100)
    with pytest.raises(RuntimeError, match="already instantiated and not kept"):
        g3.instantiate()
    g3.replay()
    assert torch.equal(x.cpu(), torch.full((4,), 112.0))
    g3.reset()
    with pytest.raises(RuntimeError, match="needs a captured graph"):
        g3.replay()
    with s, g3:  # captured again after reset
        x.sub_(112)
    g3.replay()
    assert torch.equal(x.cpu(), torch.zeros(4))
    with pytest.raises(RuntimeError, match="already holds a capture"):
        with s, g3:
            pass


def test_debug_dump(tmp_path):
    x = torch.ones(3, 4, device=DEV)
    s = side_stream()
    g = torch.accelerator.Graph()
    g.enable_debug_mode()
    with s, g:
        y = torch.relu(x @ x.t())
    path = tmp_path / "graph.txt"
    g.debug_dump(str(path))
    text = path.read_text()
    assert "2 nodes" in text.splitlines()[0]
    assert re.search(r"^0: aten::mm.out\(Float\[3, 4\]@openreg:0.*, out=Float\[3, 3\]", text, re.M)
    assert re.search(r"^1: aten::relu.out\(Float\[3, 3\]@openreg:0.*, out=Float\[3, 3\]", text, re.M)
    g.replay()
    assert torch.equal(y.cpu(), torch.relu(x.cpu() @ x.cpu().t()))

    quiet = torch.accelerator.Graph()
    with s, quiet:
        x + 1
    with pytest.warns(UserWarning, match="debug mode is not enabled"):
        quiet.debug_dump(str(tmp_path / "none.txt"))


@pytest.mark.parametrize("what, action", [
    ("synchronizing a device", lambda x: torch.accelerator.synchronize()),
    ("synchronizing a stream", lambda x: torch.accelerator.current_stream().synchronize()),
    ("item", lambda x: x.sum().item()),
    ("pageable host memory", lambda x: x.cpu()),
    ("pageable host memory", lambda x: x.copy_(torch.ones(4))),
])
def test_illegal_during_capture(what, action):
    x = torch.ones(4, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="not permitted") as info:
        with s, g:
            action(x)
    # The original error names the operation; the capture is invalidated and cannot be replayed.
    assert what in str(info.value) or what in str(info.value.__context__)
    assert "invalidated" in str(info.value)
    with pytest.raises(RuntimeError, match="needs a captured graph"):
        g.replay()
    assert not s.is_capturing()
    g.reset()
    with s, g:  # the graph can capture again
        x.add_(1)
    g.replay()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))


def test_capture_error_modes_and_the_default_stream():
    x = torch.ones(4, device=DEV)
    other = torch.ones(4, device="openreg:1")
    s = side_stream()
    # global (the default): another thread's default-stream work is refused.
    errors = []

    def worker():
        try:
            other.add_(1)  # default stream of openreg:1
        except RuntimeError as e:
            errors.append(str(e))

    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="invalidated"):
        with s, g:
            x.add_(1)
            t = threading.Thread(target=worker)
            t.start()
            t.join()
    assert errors and "default stream" in errors[0] and "global mode" in errors[0]

    # thread_local: other threads are free; this thread's unsafe calls are refused.
    errors.clear()
    g = torch.accelerator.Graph(capture_error_mode="thread_local")
    with s, g:
        x.add_(1)
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert not errors
    g = torch.accelerator.Graph(capture_error_mode="thread_local")
    with pytest.raises(RuntimeError, match="thread_local mode"):
        with s, g:
            torch.openreg.synchronize(1)

    # relaxed: unsafe calls on other streams are allowed; the capturing stream still refuses.
    g = torch.accelerator.Graph(capture_error_mode="relaxed")
    with s, g:
        x.add_(1)
        torch.openreg.synchronize(1)
        other.add_(1)
    g = torch.accelerator.Graph(capture_error_mode="relaxed")
    with pytest.raises(RuntimeError, match="is capturing"):
        with s, g:
            x.sum().item()


def test_capture_on_the_default_stream_is_refused():
    g = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="default stream"):
        g.capture_begin()


def test_random_ops_draw_fresh_numbers_at_each_replay_like_eager():
    x = torch.ones(64, device=DEV)
    torch.openreg.manual_seed(7)
    eager = [(torch.rand(5, device=DEV).cpu(), torch.nn.functional.dropout(x, 0.5).cpu())
             for _ in range(3)]
    torch.openreg.manual_seed(7)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        r = torch.rand(5, device=DEV)
        d = torch.nn.functional.dropout(x, 0.5)
    for er, ed in eager:
        g.replay()
        assert torch.equal(r.cpu(), er) and torch.equal(d.cpu(), ed)
    # An explicit generator is the one drawn from.
    gen = torch.Generator(device=DEV).manual_seed(3)
    with s, torch.accelerator.Graph() as _:
        pass
    g2 = torch.accelerator.Graph()
    with s, g2:
        q = torch.randn(4, device=DEV, generator=gen)
    gen.manual_seed(3)
    g2.replay()
    ref = torch.randn(4, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
    assert torch.equal(q.cpu(), ref.cpu())


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(32, 4))


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01, capturable=True),
], ids=["sgd-momentum", "adam-capturable"])
def test_whole_network_capture_matches_eager_training(make_opt):
    g_cpu = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 16, generator=g_cpu), torch.randint(0, 4, (8,), generator=g_cpu))
            for _ in range(6)]
    _assert_captured_training_matches_eager(_mlp, data, make_opt)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _assert_captured_training_matches_eager(make_model, data, make_opt=_sgd):
    """PyTorch's "whole network capture" recipe: trains make_model() eagerly on `data`, then a
    second copy with one eager warm-up step on a side stream and a captured step (forward,
    backward, optimizer step) on static inputs, replayed on the rest of the data. Parameters and
    losses must agree with the eager run."""
    loss_fn = torch.nn.CrossEntropyLoss()
    eager = make_model().to(DEV)
    opt = make_opt(eager.parameters())
    torch.openreg.manual_seed(1)
    eager_losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(eager(x.to(DEV)), y.to(DEV))
        loss.backward()
        opt.step()
        eager_losses.append(loss.item())

    model = make_model().to(DEV)
    opt = make_opt(model.parameters())
    torch.openreg.manual_seed(1)
    static_x, static_y = data[0][0].to(DEV), data[0][1].to(DEV)
    s = side_stream()
    s.wait_stream(torch.accelerator.current_stream())
    with s:  # warm-up step, eager
        opt.zero_grad(set_to_none=True)
        loss_fn(model(static_x), static_y).backward()
        opt.step()
    torch.accelerator.current_stream().wait_stream(s)
    g = torch.accelerator.Graph()
    opt.zero_grad(set_to_none=True)
    with s, g:
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    losses = []
    for x, y in data[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        losses.append(static_loss.item())
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses[1:]))


class _SeqModel(torch.nn.Module):
    """A recurrent or attention body with a linear head over the last position."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        if kind == "transformer":  # fused attention (overrideable SDPA), with its dropout
            layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
            self.body = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        elif kind == "lstm":       # the fused LSTM cell
            self.body = torch.nn.LSTM(16, 16, batch_first=True)
        else:                      # the fused GRU cell
            self.body = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        y = self.body(x)
        y = y[0] if isinstance(y, tuple) else y
        return self.head(y[:, -1])


@pytest.mark.parametrize("kind", ["transformer", "lstm", "gru"])
def test_sequence_model_training_capture_matches_eager(kind):
    g_cpu = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 6, 16, generator=g_cpu), torch.randint(0, 4, (4,), generator=g_cpu))
            for _ in range(4)]
    _assert_captured_training_matches_eager(lambda: _SeqModel(kind), data)


def test_backward_on_the_autograd_thread_is_captured():
    # Backward runs on openreg's autograd device thread; it issues on the stream of the forward
    # (the capturing stream), so its kernels are recorded, not run.
    w = torch.ones(4, device=DEV, requires_grad=True)
    x = torch.full((4,), 2.0, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        (w * x).sum().backward()
    assert w.grad is not None
    g.replay()
    assert torch.equal(w.grad.cpu(), torch.full((4,), 2.0))
    x.fill_(5.0)
    g.replay()
    assert torch.equal(w.grad.cpu(), torch.full((4,), 5.0))


# [docs:start TEST_FORK_JOIN]
def test_fork_join_across_streams_is_captured():
    s, side, g = side_stream(), side_stream(), torch.accelerator.Graph()
    x = torch.ones(1000, device=DEV)
    with s, g:
        a = x * 2
        side.wait_stream(s)           # fork: side joins the capture
        assert side.is_capturing()
        with side:
            b = x + 1                 # recorded, on side, from the graph's pool
            b.mul_(10)
        s.wait_stream(side)           # join back
        c = a + b
    assert not side.is_capturing()
    for value in (3.0, 5.0):
        x.fill_(value)
        g.replay()
        expected = value * 2 + (value + 1) * 10
        assert torch.equal(c.cpu(), torch.full((1000,), expected))
# [docs:end TEST_FORK_JOIN]


def test_join_through_a_chain_of_streams_and_events():
    s, b, c, g = side_stream(), side_stream(), side_stream(), torch.accelerator.Graph()
    x = torch.ones(8, device=DEV)
    with s, g:
        fork = torch.Event(device=DEV)
        fork.record(s)
        b.wait_event(fork)
        with b:
            y = x + 1
        c.wait_stream(b)              # c joins through b, not through s
        with c:
            z = y * 3
        s.wait_stream(c)              # s has now seen b's work too, through c
        out = z - x
    x.fill_(2.0)
    g.replay()
    assert torch.equal(out.cpu(), torch.full((8,), 7.0))


def test_unjoined_stream_invalidates_the_capture():
    s, side, g = side_stream(), side_stream(), torch.accelerator.Graph()
    x = torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match=r"stream\(s\) \d+ of openreg:0 was not joined back"):
        with s, g:
            x.add_(1)
            side.wait_stream(s)
            with side:
                x.mul_(2)             # never waited for by s
    assert not side.is_capturing()    # the fork ended with the capture
    with pytest.raises(RuntimeError, match="needs a captured graph"):
        g.replay()
    side.synchronize()                # usable again outside the capture


def test_forked_stream_follows_the_capture_rules():
    s, side, g = side_stream(), side_stream(), torch.accelerator.Graph()
    x = torch.ones(4, device=DEV)
    with pytest.raises(RuntimeError, match="synchronizing a stream is not permitted while stream"):
        with s, g:
            side.wait_stream(s)
            with side:
                x.add_(1)
            side.synchronize()        # the host cannot wait for a capturing stream
    g.reset()
    default = torch.accelerator.current_stream()
    with pytest.raises(RuntimeError, match="default stream of openreg:0 cannot join"):
        with s, g:
            default.wait_stream(s)
    assert not default.is_capturing()


def test_debug_dump_names_the_stream_of_forked_work(tmp_path):
    s, side, g = side_stream(), side_stream(), torch.accelerator.Graph()
    g.enable_debug_mode()
    x = torch.ones(4, device=DEV)
    with s, g:
        side.wait_stream(s)
        with side:
            x.add_(1)
        s.wait_stream(side)
    g.debug_dump(str(tmp_path / "g.txt"))
    text = (tmp_path / "g.txt").read_text()
    assert re.search(rf"aten::add_.*\[stream {side.stream_id}\]", text)


def test_graph_on_another_device_and_pool_release():
    torch.accelerator.empty_cache()
    base = torch.accelerator.memory_reserved(1)
    with torch.accelerator.device_index(1):
        x = torch.ones(1 << 20, device=DEV)
        s, g = side_stream(), torch.accelerator.Graph()
        with s, g:
            y = x * 2
            t = y + 1
            del y
        g.replay()
        assert t.device == torch.device("openreg:1") and torch.equal(t[:2].cpu(), torch.full((2,), 3.0))
        g2 = torch.accelerator.Graph(pool=g.pool())
        with s, g2:
            u = t * 3
        g.reset()  # the pool stays: g2 still uses it
        g2.replay()
        assert torch.equal(u[:2].cpu(), torch.full((2,), 9.0))
        del g, g2
        torch.accelerator.empty_cache()
        pool_and_x = torch.accelerator.memory_reserved(1) - base
        del t, u  # the last tensors of the released pool: its memory goes back to the driver
        torch.accelerator.empty_cache()
        assert torch.accelerator.memory_reserved(1) - base < pool_and_x
        del x
        torch.accelerator.empty_cache()
        assert torch.accelerator.memory_reserved(1) == base


def test_views_made_by_the_fallback_are_made_at_capture():
    # unfold and view_as_complex return views; they do no device work, so capture makes them
    # at once (over the same storage) and records the kernels that use them.
    x = torch.arange(10.0, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        u = x[1:].unfold(0, 2, 1)
        c = torch.view_as_complex(x[2:].view(4, 2))
        uu = u * 2
        cc = c * 1j
    assert u.data_ptr() == x.data_ptr() + 4 and c.data_ptr() == x.data_ptr() + 8
    x.add_(1)
    g.replay()
    ref = torch.arange(10.0) + 1
    assert torch.equal(uu.cpu(), ref[1:].unfold(0, 2, 1) * 2)
    assert torch.equal(cc.cpu(), torch.view_as_complex(ref[2:].view(4, 2)) * 1j)


def test_data_dependent_operators_are_refused():
    x = torch.arange(10.0, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="aten::nonzero cannot be captured"):
        with s, g:
            x.nonzero()


def test_event_recorded_during_capture_is_recorded_at_each_replay():
    x = torch.zeros(4, device=DEV)
    s, g = side_stream(), torch.accelerator.Graph()
    start, end = torch.Event(DEV, enable_timing=True), torch.Event(DEV, enable_timing=True)
    with pytest.raises(RuntimeError, match="invalidated"):
        with s, g:
            start.record(s)
            x.add_(1)
            end.record(s)
            with pytest.raises(RuntimeError, match="recorded during graph capture"):
                end.synchronize()
    g = torch.accelerator.Graph()  # the first capture was invalidated by the synchronize
    with s, g:
        start.record(s)
        x.add_(1)
        end.record(s)
    g.replay()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    assert torch.equal(x.cpu(), torch.ones(4))


def test_cnn_training_step_capture_matches_eager():
    # Convolution forward and backward are openreg's own kernels (overrideable ops): recorded
    # through capture_call and replayed through the dispatcher.
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                   torch.nn.Linear(4 * 6 * 6, 3))
    g_cpu = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 1, 8, 8, generator=g_cpu), torch.randint(0, 3, (2,), generator=g_cpu))
            for _ in range(4)]
    _assert_captured_training_matches_eager(make, data)


def test_openreg_graph_context_manager():
    # torch.openreg.graph mirrors torch.cuda.graph: it captures on a side stream of its own.
    x = torch.zeros(4, device=DEV)
    g = torch.accelerator.Graph()
    with torch.openreg.graph(g):
        assert torch.openreg.is_current_stream_capturing()
        assert torch.accelerator.current_stream().stream_id != 0
        x.add_(2)
    assert not torch.openreg.is_current_stream_capturing()
    assert torch.accelerator.current_stream().stream_id == 0
    g.replay()
    assert torch.equal(x.cpu(), torch.full((4,), 2.0))
    pool = torch.openreg.graph_pool_handle()
    g1, g2 = torch.accelerator.Graph(), torch.accelerator.Graph()
    with torch.openreg.graph(g1, pool=pool):
        y = x + 1
    with torch.openreg.graph(g2, pool=pool, capture_error_mode="relaxed"):
        z = y * 2
    assert g1.pool() == g2.pool() == pool
    g1.replay()
    g2.replay()
    assert torch.equal(z.cpu(), torch.full((4,), 6.0))


def test_query_during_capture():
    # Querying the capturing stream is refused; other streams can be queried in any mode.
    other = side_stream()
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        assert other.query()
    g2 = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="invalidated"):
        with s, g2:
            s.query()


@pytest.mark.parametrize("case", ["conv2d", "conv1d", "conv3d_transposed", "unbatched"])
def test_captured_convolutions_have_the_eager_layouts(case):
    # A convolution is recorded without running: its meta function predicts the layouts the kernel
    # returns at replay, the CPU's (channels-last in, channels-last out; docs/overrideable_ops.md).
    torch.manual_seed(0)
    cl = lambda t: t.transpose(1, -1).contiguous().transpose(1, -1)  # channels innermost
    x, w, fn = {"conv2d": ((2, 3, 6, 6), (4, 3, 3, 3), torch.nn.functional.conv2d),
                "conv1d": ((2, 3, 7), (4, 3, 3), torch.nn.functional.conv1d),
                "conv3d_transposed": ((1, 3, 3, 4, 3), (3, 2, 2, 2, 2),
                                      torch.nn.functional.conv_transpose3d),
                "unbatched": ((3, 6, 6), (4, 3, 3, 3), torch.nn.functional.conv2d)}[case]
    x, w = cl(torch.randn(x)).to(DEV), cl(torch.randn(w)).to(DEV)
    go = torch.ones_like(fn(x, w))
    eager = fn(x, w), *torch.autograd.grad(fn(x.requires_grad_(), w.requires_grad_()), (x, w), go)
    s, g = side_stream(), torch.accelerator.Graph()
    with s, g:
        captured = fn(x, w), *torch.autograd.grad(fn(x, w), (x, w), go)
    g.replay()
    for c, e in zip(captured, eager):
        assert (c.shape, c.stride(), c.storage_offset()) == (e.shape, e.stride(), e.storage_offset())
        assert torch.equal(c.cpu(), e.cpu())
