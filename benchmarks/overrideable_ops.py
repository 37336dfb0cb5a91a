"""Per-step cost of the operators openreg implements itself (csrc/ops/overrideable_ops.cpp),
against the same computation on the CPU.

    PYTHONPATH=. python benchmarks/overrideable_ops.py [--threads N]

Rounds alternate the CPU and openreg:0 so that both see the same machine load; the reported
time is the median over all measured steps, the ratio is openreg / CPU.
"""
import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


def measure(fn, device, n):
    sync = torch.openreg.synchronize if device.startswith("openreg") else (lambda: None)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def compare(make, rounds=5, steps=10):
    cpu_step, dev_step = make("cpu"), make("openreg:0")
    measure(cpu_step, "cpu", 3)
    measure(dev_step, "openreg:0", 3)
    cpu, dev = [], []
    for _ in range(rounds):
        cpu += measure(cpu_step, "cpu", steps)
        dev += measure(dev_step, "openreg:0", steps)
    return statistics.median(cpu), statistics.median(dev)


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


def lstm_forward_per_step_cpu(device):
    """The same LSTM forward; on the CPU with oneDNN off, so that the CPU too runs one cell per
    time step (the path ATen takes on every accelerator)."""
    step = lstm_forward(device)
    if device != "cpu":
        return step

    def cpu_step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a notice about TF32 on Intel GPUs
            with torch.backends.mkldnn.flags(enabled=False):
                step()
    return cpu_step


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
    "LSTM forward, CPU per time step (oneDNN off)": lstm_forward_per_step_cpu,
    "LSTM train step (same)": lstm_train_step,
    "SDPA fwd+bwd (8x4x64x32, causal)": attention_train_step,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads (1 avoids OpenMP stalls on a loaded machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads\n")
    print("| case | cpu ms | openreg ms | ratio |")
    print("|---|---|---|---|")
    for name, make in CASES.items():
        cpu, dev = compare(make)
        print(f"| {name} | {cpu * 1e3:.3f} | {dev * 1e3:.3f} | {dev / cpu:.2f}x |")


if __name__ == "__main__":
    main()
