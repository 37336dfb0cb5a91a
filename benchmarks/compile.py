"""torch.compile: compiled openreg vs compiled CPU vs eager openreg training steps, in one process.

    python benchmarks/compile.py [--rounds R] [--steps N] [--device openreg:0]
                                 [--backward-on-caller] [workload ...]

workloads: mlp_train_step, cnn_train_step, transformer_train_step (the default three) and
linear_relu_train_step (the Transformer's feed-forward block alone: the kernels that save and
read relu's bool mask, which openreg generates differently from the CPU, docs/compile.md).

The model's forward and loss are compiled with default settings (Inductor; its backward is
compiled by AOTAutograd); the SGD step is the same eager step in every variant. Rounds
alternate the variants so that all see the same machine load; the reported time is the median
over all measured steps. Targets (issue #9): compiled openreg within 1.15x of compiled CPU, and
faster than eager openreg on the Transformer step.

--backward-on-caller runs backward on the thread that calls it (autograd multithreading off) for
every variant: it removes the hand-off to openreg's autograd device thread (docs/autograd.md),
which is the difference between compiled openreg and compiled CPU that is not generated code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import SmallCNN, SmallTransformer, _train_step, measure  # noqa: E402


def build(name: str, device: str, compiled: bool):
    torch.manual_seed(0)
    if name == "mlp_train_step":
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                              nn.Linear(256, 10))
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
        loss_fn = nn.functional.cross_entropy
    elif name == "linear_relu_train_step":
        # the Transformer's feed-forward block in isolation: in training, Inductor's forward
        # kernel for relu also writes the bool mask the backward needs (relu <= 0); torch's C++
        # code for that store is slow, openreg's is not (docs/compile.md, "Bool buffers")
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        x, y = torch.randn(512, 64), torch.randn(512, 128)
        loss_fn = nn.functional.mse_loss
    elif name == "cnn_train_step":
        model = SmallCNN()
        x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
        loss_fn = nn.functional.cross_entropy
    else:
        model = SmallTransformer()
        x, y = torch.randint(0, 100, (16, 32)), torch.randint(0, 100, (16, 32))

        def loss_fn(out, t):
            return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())
    model.to(device)
    run = torch.compile(model) if compiled else model
    return _train_step(run, x.to(device), y.to(device), loss_fn)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="openreg:0")
    parser.add_argument("--backward-on-caller", action="store_true")
    parser.add_argument("workloads", nargs="*",
                        default=["mlp_train_step", "cnn_train_step", "transformer_train_step"])
    args = parser.parse_args()
    if args.backward_on_caller:
        torch.autograd.set_multithreading_enabled(False)
    variants = {"compiled cpu": ("cpu", True), "compiled openreg": (args.device, True),
                "eager openreg": (args.device, False)}
    print(f"{'workload':<24}{'compiled cpu':>14}{'compiled openreg':>18}{'eager openreg':>15}"
          f"{'c.openreg/c.cpu':>17}{'c.openreg/eager':>17}")
    for name in args.workloads:
        steps = {v: build(name, d, c) for v, (d, c) in variants.items()}
        for step in steps.values():  # compile, warm caches and allocators
            measure(step, max(3, args.steps // 4))
        times = {v: [] for v in steps}
        for _ in range(args.rounds):
            for v, step in steps.items():
                times[v] += measure(step, args.steps)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        print(f"{name:<24}{med['compiled cpu']:>12.2f}ms{med['compiled openreg']:>16.2f}ms"
              f"{med['eager openreg']:>13.2f}ms"
              f"{med['compiled openreg'] / med['compiled cpu']:>16.2f}x"
              f"{med['compiled openreg'] / med['eager openreg']:>16.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
