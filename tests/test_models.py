"""Real models train on openreg exactly as on the CPU.

Each model is built on the CPU from a seed and copied to the device, trained for a few steps on
`openreg:0` and on `openreg:1`, and its losses, parameters and buffers are compared with the same
training on the CPU. These models go through the operators openreg implements itself
(convolution, RNN cells, fused attention) as well as through the generic fallback.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch_openreg.testing import settled_memory_allocated

STEPS = 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.LayerNorm(64), nn.Linear(64, 5))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        # No conv bias before BatchNorm: its gradient is zero up to rounding (BatchNorm subtracts
        # the mean), and Adam turns rounding differences (another summation order on another
        # thread count) into lr-sized steps. Conv bias gradients are checked by gradcheck in
        # tests/test_autograd.py.
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.head = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TinyTransformer(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(30, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 30)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


class LSTMLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 30)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0])


def classification_data(shape, classes):
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g), torch.randint(0, classes, shape[:1], generator=g)


def sequence_data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 30, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


MODELS = {
    "mlp": (MLP, lambda: classification_data((16, 20), 5), F.cross_entropy,
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "cnn_batchnorm": (SmallCNN, lambda: classification_data((8, 3, 8, 8), 5), F.cross_entropy,
                      lambda p: torch.optim.Adam(p, lr=1e-2)),
    # SGD, not Adam: the gradient of the attention's key bias is zero up to rounding (softmax
    # ignores a constant added to a row), and Adam would blow that rounding up to lr-sized steps.
    "transformer_encoder": (TinyTransformer, sequence_data, token_loss,
                            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "lstm": (LSTMLanguageModel, sequence_data, token_loss,
             lambda p: torch.optim.SGD(p, lr=0.5)),
}


def train(name, device):
    factory, data, loss_fn, make_opt = MODELS[name]
    torch.manual_seed(0)
    model = factory().to(device)  # built on the CPU from the seed, then copied
    opt = make_opt(model.parameters())
    x, y = (t.to(device) for t in data())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


@pytest.fixture(scope="module")
def cpu_results():
    return {name: train(name, "cpu") for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_cpu(device, name, cpu_results):
    device = torch.device(device)
    other = 1 - device.index
    # settled: training runs the garbage collector, which may free what earlier tests left
    other_before = settled_memory_allocated(other)

    model, opt, losses = train(name, device)
    torch.openreg.synchronize()

    cpu_model, _, cpu_losses = cpu_results[name]
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]  # it learns
    for (pname, p), (_, cp) in zip(model.named_parameters(), cpu_model.named_parameters()):
        assert p.device == device and p.grad.device == device, pname
        torch.testing.assert_close(p.detach().cpu(), cp.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{pname}: {m}")
    for (bname, b), (_, cb) in zip(model.named_buffers(), cpu_model.named_buffers()):
        assert b.device == device, bname
        torch.testing.assert_close(b.cpu(), cb, rtol=1e-4, atol=1e-5)
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.device == device

    # Device memory: the model lives on its device; the other device was not touched.
    assert torch.openreg.memory_allocated(device) > 0
    assert torch.openreg.memory_allocated(other) == other_before


@pytest.mark.parametrize("name", list(MODELS))
def test_training_memory_is_steady_and_released(device, name):
    torch.openreg.synchronize()
    baseline = torch.openreg.memory_allocated(device)
    factory, data, loss_fn, make_opt = MODELS[name]
    torch.manual_seed(0)
    model = factory().to(device)
    opt = make_opt(model.parameters())
    x, y = (t.to(device) for t in data())
    per_step = []
    for _ in range(4):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        torch.openreg.synchronize()
        per_step.append(torch.openreg.memory_allocated(device))
    assert per_step[1] == per_step[-1]  # no growth once the optimizer state exists
    del model, opt, x, y
    assert torch.openreg.memory_allocated(device) == baseline


def profiled(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("name,op", [
    ("cnn_batchnorm", "aten::convolution_backward_overrideable"),
    ("transformer_encoder", "aten::_scaled_dot_product_fused_attention_overrideable_backward"),
    ("lstm", "aten::_thnn_fused_lstm_cell_backward_impl"),
])
def test_models_use_the_device_kernels(name, op):
    ops = profiled(lambda: train(name, "openreg:0"))
    assert op in ops


def test_transformer_with_dropout_is_reproducible(device):
    torch.manual_seed(0)
    reference = TinyTransformer(dropout=0.2)
    tokens, target = (t.to(device) for t in sequence_data())

    def run(seed):
        model = TinyTransformer(dropout=0.2).to(device)
        model.load_state_dict(reference.state_dict())
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with torch.openreg.device(device):
            torch.openreg.manual_seed(seed)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = token_loss(model(tokens), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a != c


def test_transformer_inference_matches_cpu(device):
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1).eval()
    model_d = TinyTransformer(dropout=0.1).to(device).eval()
    model_d.load_state_dict(model.state_dict())
    tokens, _ = sequence_data()
    with torch.no_grad():
        torch.testing.assert_close(model_d(tokens.to(device)).cpu(), model(tokens))
