"""Recurrent networks on openreg: ATen runs LSTM and GRU cells on accelerators through the fused
cell kernels (_thnn_fused_lstm_cell, _thnn_fused_gru_cell and their backward), which openreg
implements in csrc/ops/overrideable_ops.cpp. Every result is compared with the CPU.
"""
import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.profiler import ProfilerActivity, profile


def make_pair(factory, device, seed=0):
    """The same module on the CPU and on `device` (built on the CPU, then copied)."""
    torch.manual_seed(seed)
    cpu = factory()
    dev = factory().to(device)
    dev.load_state_dict(cpu.state_dict())
    return cpu, dev


def leaf(t, device=None):
    t = t.detach()
    if device is not None:
        t = t.to(device)
    return t.requires_grad_()


def assert_grads_match(cpu_module, dev_module, device):
    for (name, p), (_, pd) in zip(cpu_module.named_parameters(), dev_module.named_parameters()):
        assert pd.grad is not None, name
        assert pd.grad.device == torch.device(device), name
        torch.testing.assert_close(pd.grad.cpu(), p.grad, msg=lambda m: f"{name}: {m}")


def flat(outputs):
    """Tensors of an RNN output: (out, h) or (out, (h, c))."""
    out, state = outputs
    return [out] + (list(state) if isinstance(state, tuple) else [state])


RNN_CONFIGS = {
    "lstm": (nn.LSTM, {}),
    "lstm_2layers_bidirectional": (nn.LSTM, dict(num_layers=2, bidirectional=True)),
    "lstm_batch_first_nobias": (nn.LSTM, dict(batch_first=True, bias=False)),
    "lstm_proj": (nn.LSTM, dict(num_layers=2, proj_size=3)),
    "gru": (nn.GRU, {}),
    "gru_2layers_bidirectional": (nn.GRU, dict(num_layers=2, bidirectional=True)),
    "gru_batch_first_nobias": (nn.GRU, dict(batch_first=True, bias=False)),
    "rnn_tanh_2layers": (nn.RNN, dict(num_layers=2)),
    "rnn_relu_bidirectional": (nn.RNN, dict(nonlinearity="relu", bidirectional=True)),
}


def initial_state(cls, kwargs, batch, hidden):
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    h_size = kwargs.get("proj_size", 0) or hidden
    h0 = torch.randn(layers, batch, h_size, requires_grad=True)
    if cls is nn.LSTM:
        return (h0, torch.randn(layers, batch, hidden, requires_grad=True))
    return h0


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("config", list(RNN_CONFIGS))
def test_rnn_matches_cpu(device, config, with_state):
    cls, kwargs = RNN_CONFIGS[config]
    cpu, dev = make_pair(lambda: cls(4, 6, **kwargs), device)
    seq, batch = 5, 3
    x = torch.randn((batch, seq, 4) if kwargs.get("batch_first") else (seq, batch, 4),
                    requires_grad=True)
    xd = leaf(x, device)
    args, args_d = (x,), (xd,)
    state = None
    if with_state:
        state = initial_state(cls, kwargs, batch, 6)
        states = state if isinstance(state, tuple) else (state,)
        states_d = tuple(leaf(s, device) for s in states)
        args = (x, state)
        args_d = (xd, states_d if cls is nn.LSTM else states_d[0])

    out = flat(cpu(*args))
    out_d = flat(dev(*args_d))
    for a, b in zip(out_d, out):
        assert a.device == torch.device(device)
        torch.testing.assert_close(a.cpu(), b)

    # A loss that uses every output, so that all gradient paths are exercised.
    loss = sum((o * torch.linspace(-1, 1, o.shape[-1])).pow(2).sum() for o in out)
    loss_d = sum((o * torch.linspace(-1, 1, o.shape[-1], device=device)).pow(2).sum()
                 for o in out_d)
    loss.backward()
    loss_d.backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    assert_grads_match(cpu, dev, device)
    if with_state:
        for s, sd in zip(states, states_d):
            torch.testing.assert_close(sd.grad.cpu(), s.grad)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_unbatched_input(device, cls):
    cpu, dev = make_pair(lambda: cls(3, 4, num_layers=2), device)
    x = torch.randn(6, 3)
    for a, b in zip(flat(dev(x.to(device))), flat(cpu(x))):
        torch.testing.assert_close(a.cpu(), b)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_packed_sequence(device, cls):
    cpu, dev = make_pair(lambda: cls(4, 5, num_layers=2, bidirectional=True), device)
    lengths = torch.tensor([3, 6, 1, 4])  # unsorted: pack sorts and restores the order
    x = torch.randn(6, 4, 4, requires_grad=True)
    xd = leaf(x, device)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    packed_d = pack_padded_sequence(xd, lengths, enforce_sorted=False)
    assert packed_d.data.device == torch.device(device)
    assert packed_d.batch_sizes.device.type == "cpu"  # as on CUDA

    out, state = cpu(packed)
    out_d, state_d = dev(packed_d)
    padded, out_lengths = pad_packed_sequence(out)
    padded_d, out_lengths_d = pad_packed_sequence(out_d)
    assert torch.equal(out_lengths_d, out_lengths)
    torch.testing.assert_close(padded_d.cpu(), padded)
    states = state if isinstance(state, tuple) else (state,)
    states_d = state_d if isinstance(state_d, tuple) else (state_d,)
    for a, b in zip(states_d, states):
        torch.testing.assert_close(a.cpu(), b)

    (padded.sum() + sum(s.pow(2).sum() for s in states)).backward()
    (padded_d.sum() + sum(s.pow(2).sum() for s in states_d)).backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    assert_grads_match(cpu, dev, device)


def seed_device(device, seed):
    with torch.openreg.device(torch.device(device)):
        torch.openreg.manual_seed(seed)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_dropout_between_layers_uses_the_device_generator(device, cls):
    _, dev = make_pair(lambda: cls(4, 8, num_layers=3, dropout=0.5), device)
    x = torch.randn(5, 2, 4, device=device)
    cpu_state = torch.get_rng_state()
    seed_device(device, 1)
    a = dev(x)[0]
    seed_device(device, 1)
    b = dev(x)[0]
    seed_device(device, 2)
    c = dev(x)[0]
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator was not used
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a.cpu(), c.cpu())
    dev.eval()  # no dropout in eval mode: the CPU result again
    cpu_eval = make_pair(lambda: cls(4, 8, num_layers=3, dropout=0.5), "cpu")[0].eval()
    torch.testing.assert_close(dev(x)[0].cpu(), cpu_eval(x.cpu())[0])


def test_dropout_between_layers_trains(device):
    _, dev = make_pair(lambda: nn.LSTM(4, 8, num_layers=2, dropout=0.3), device)
    x = torch.randn(5, 2, 4, device=device)
    seed_device(device, 4)
    out = dev(x)[0]
    out.sum().backward()
    for name, p in dev.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(4, 5),
    "lstm_cell_nobias": lambda: nn.LSTMCell(4, 5, bias=False),
    "gru_cell": lambda: nn.GRUCell(4, 5),
    "gru_cell_nobias": lambda: nn.GRUCell(4, 5, bias=False),
    "rnn_cell": lambda: nn.RNNCell(4, 5),
}


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("cell", list(CELLS))
def test_cells_match_cpu(device, cell, batched):
    cpu, dev = make_pair(CELLS[cell], device)
    x = torch.randn((3, 4) if batched else (4,), requires_grad=True)
    xd = leaf(x, device)
    hidden = (3, 5) if batched else (5,)
    if isinstance(cpu, nn.LSTMCell):
        h = (torch.randn(hidden, requires_grad=True), torch.randn(hidden, requires_grad=True))
        hd = tuple(leaf(t, device) for t in h)
        out, out_d = cpu(x, h), dev(xd, hd)
    else:
        h = (torch.randn(hidden, requires_grad=True),)
        hd = (leaf(h[0], device),)
        out, out_d = (cpu(x, h[0]),), (dev(xd, hd[0]),)
    for a, b in zip(out_d, out):
        torch.testing.assert_close(a.cpu(), b)
    sum((o * (i + 1)).sum() for i, o in enumerate(out)).backward()
    sum((o * (i + 1)).sum() for i, o in enumerate(out_d)).backward()
    torch.testing.assert_close(xd.grad.cpu(), x.grad)
    for t, td in zip(h, hd):
        torch.testing.assert_close(td.grad.cpu(), t.grad)
    assert_grads_match(cpu, dev, device)


@pytest.mark.parametrize("cell", ["lstm_cell", "gru_cell"])
def test_cells_double_backward(device, cell):
    # With create_graph, autograd uses the differentiable (composite) cell backward.
    cpu, dev = make_pair(CELLS[cell], device)
    x = torch.randn(2, 4, requires_grad=True)
    xd = leaf(x, device)
    results = []
    for module, inp in ((cpu, x), (dev, xd)):
        out = module(inp)
        out = out[0] if isinstance(out, tuple) else out
        (g,) = torch.autograd.grad(out.pow(2).sum(), inp, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), inp)
        results.append((g, gg))
    for a, b in zip(results[1], results[0]):
        torch.testing.assert_close(a.cpu(), b)


def test_rnn_runs_the_fused_cells(device):
    lstm = nn.LSTM(3, 4).to(device)
    gru = nn.GRU(3, 4).to(device)
    x = torch.randn(4, 2, 3, device=device, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lstm(x)[0].sum().backward()
        gru(x)[0].sum().backward()
    ops = {e.key for e in prof.key_averages()}
    for op in ("_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl",
               "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward"):
        assert "aten::" + op in ops, op


def lstm_cell_reference(ig, hg, cx, bi, bh):
    gates = ig + hg + (bi + bh if bi is not None else 0)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def gru_cell_reference(ig, hg, hx, bi, bh):
    if bi is not None:
        ig, hg = ig + bi, hg + bh
    ir, iz, in_ = ig.chunk(3, 1)
    hr, hz, hn = hg.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return n + z * (hx - n), torch.cat([r, z, n, hx, hn], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_cell_operators(device, dtype, bias):
    torch.manual_seed(0)
    B, H = 3, 5
    ig, hg, cx = torch.randn(B, 4 * H, dtype=dtype), torch.randn(B, 4 * H, dtype=dtype), \
        torch.randn(B, H, dtype=dtype)
    bi, bh = (torch.randn(4 * H, dtype=dtype), torch.randn(4 * H, dtype=dtype)) if bias \
        else (None, None)
    d = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = torch.ops.aten._thnn_fused_lstm_cell(d(ig), d(hg), d(cx), d(bi), d(bh))
    for a, b in zip(got, lstm_cell_reference(ig, hg, cx, bi, bh)):
        assert a.device == torch.device(device)
        torch.testing.assert_close(a.cpu(), b)

    ig3, hg3 = ig[:, :3 * H].contiguous(), hg[:, :3 * H].contiguous()
    bi3, bh3 = (bi[:3 * H].contiguous(), bh[:3 * H].contiguous()) if bias else (None, None)
    got = torch.ops.aten._thnn_fused_gru_cell(d(ig3), d(hg3), d(cx), d(bi3), d(bh3))
    for a, b in zip(got, gru_cell_reference(ig3, hg3, cx, bi3, bh3)):
        torch.testing.assert_close(a.cpu(), b)


def test_fused_cell_backward_operators(device):
    torch.manual_seed(0)
    B, H = 3, 5
    ig, hg = torch.randn(B, 4 * H, requires_grad=True), torch.randn(B, 4 * H, requires_grad=True)
    cx = torch.randn(B, H, requires_grad=True)
    bi, bh = torch.randn(4 * H, requires_grad=True), torch.randn(4 * H, requires_grad=True)
    hy, cy, _ = lstm_cell_reference(ig, hg, cx, bi, bh)
    ghy, gcy = torch.randn(B, H), torch.randn(B, H)
    torch.autograd.backward([hy, cy], [ghy, gcy])
    d = lambda t: t.detach().to(device)  # noqa: E731
    hy_d, cy_d, ws_d = torch.ops.aten._thnn_fused_lstm_cell(d(ig), d(hg), d(cx), d(bi), d(bh))
    g_gates, g_cx, g_bias = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
        d(ghy), d(gcy), d(cx), cy_d, ws_d, True)
    torch.testing.assert_close(g_gates.cpu(), ig.grad)
    torch.testing.assert_close(g_gates.cpu(), hg.grad)
    torch.testing.assert_close(g_cx.cpu(), cx.grad)
    torch.testing.assert_close(g_bias.cpu(), bi.grad)
    # A missing gradient (None) counts as zero.
    g_gates, g_cx, g_bias = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
        None, d(gcy), d(cx), cy_d, ws_d, False)
    assert g_bias is None
    ig.grad = hg.grad = cx.grad = None
    hy, cy, _ = lstm_cell_reference(ig, hg, cx, bi, bh)
    cy.backward(gcy)
    torch.testing.assert_close(g_gates.cpu(), ig.grad)
    torch.testing.assert_close(g_cx.cpu(), cx.grad)

    ig3, hg3 = (t.detach()[:, :3 * H].clone().requires_grad_() for t in (ig, hg))
    bi3, bh3 = (t.detach()[:3 * H].clone().requires_grad_() for t in (bi, bh))
    hx = cx.detach().clone().requires_grad_()
    hy, _ = gru_cell_reference(ig3, hg3, hx, bi3, bh3)
    hy.backward(ghy)
    _, ws_d = torch.ops.aten._thnn_fused_gru_cell(d(ig3), d(hg3), d(hx), d(bi3), d(bh3))
    got = torch.ops.aten._thnn_fused_gru_cell_backward(d(ghy), ws_d, True)
    for a, b in zip(got, (ig3.grad, hg3.grad, hx.grad, bi3.grad, bh3.grad)):
        torch.testing.assert_close(a.cpu(), b)


def test_low_precision_lstm(device):
    cpu, dev = make_pair(lambda: nn.LSTM(4, 8, num_layers=2), device)
    dev = dev.to(torch.bfloat16)
    x = torch.randn(6, 3, 4)
    out_d = dev(x.to(device, torch.bfloat16))[0]
    assert out_d.dtype == torch.bfloat16
    torch.testing.assert_close(out_d.cpu().float(), cpu(x)[0], atol=3e-2, rtol=3e-2)
    out_d.float().sum().backward()
    for p in dev.parameters():
        assert p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad.float()).all()


def test_cell_shape_and_device_errors():
    d = "openreg:0"
    ig, hg = torch.randn(3, 20, device=d), torch.randn(3, 20, device=d)
    cx = torch.randn(3, 5, device=d)
    lstm_cell = torch.ops.aten._thnn_fused_lstm_cell
    with pytest.raises(RuntimeError, match="same size"):
        lstm_cell(ig, torch.randn(3, 16, device=d), cx)
    with pytest.raises(RuntimeError, match=r"previous state of size \[3, 5\]"):
        lstm_cell(ig, hg, torch.randn(3, 4, device=d))
    with pytest.raises(RuntimeError, match="biases of size"):
        lstm_cell(ig, hg, cx, torch.randn(8, device=d), torch.randn(8, device=d))
    with pytest.raises(RuntimeError, match="dtype"):
        lstm_cell(ig, hg.double(), cx)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        lstm_cell(ig, hg, cx.to("openreg:1"))
    with pytest.raises(RuntimeError, match="same device"):
        lstm_cell(ig, hg, cx.cpu())
    with pytest.raises(RuntimeError, match="multiple of 3"):
        torch.ops.aten._thnn_fused_gru_cell(ig, hg, cx)
    lstm = nn.LSTM(4, 5).to("openreg:0")
    with pytest.raises(RuntimeError):
        lstm(torch.randn(2, 3, 4, device="openreg:1"))
