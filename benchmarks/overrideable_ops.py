"""Per-step cost of the operators openreg implements itself (csrc/ops/overrideable_ops.cpp),
against the same computation on the CPU.

    PYTHONPATH=. python benchmarks/overrideable_ops.py

Prints the median time of each case on cpu and openreg:0 and their ratio.
"""
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def median_time(fn, device, warmup=5, repeat=30):
    sync = torch.openreg.synchronize if device.startswith("openreg") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def conv_train_step(device):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (16,), device=device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def lstm_forward(device, hidden=128, seq=32, batch=16):
    torch.manual_seed(0)
    lstm = nn.LSTM(64, hidden, num_layers=2).to(device)
    x = torch.randn(seq, batch, 64, device=device)

    def step():
        with torch.no_grad():
            lstm(x)
    return step


def lstm_train_step(device, hidden=128, seq=32, batch=16):
    torch.manual_seed(0)
    lstm = nn.LSTM(64, hidden, num_layers=2).to(device)
    x = torch.randn(seq, batch, 64, device=device)

    def step():
        lstm.zero_grad()
        out, _ = lstm(x)
        out.sum().backward()
    return step


def attention_train_step(device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 4, 64, 32, device=device, requires_grad=True) for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return step


CASES = {
    "conv train step (2 conv, b16 32x32)": conv_train_step,
    "LSTM forward (2 layers, h128, seq32, b16)": lstm_forward,
    "LSTM train step (same)": lstm_train_step,
    "SDPA fwd+bwd (8x4x64x32, causal)": attention_train_step,
}


def main():
    print(f"{'case':45s} {'cpu ms':>8s} {'openreg ms':>11s} {'ratio':>6s}")
    for name, make in CASES.items():
        cpu = median_time(make("cpu"), "cpu")
        dev = median_time(make("openreg:0"), "openreg:0")
        print(f"{name:45s} {cpu * 1e3:8.3f} {dev * 1e3:11.3f} {dev / cpu:6.2f}")


if __name__ == "__main__":
    main()
