"""torch.compile: compiled openreg vs compiled CPU vs eager openreg training steps, in one process.

    python benchmarks/compile.py [--rounds R] [--steps N] [--device openreg:0] [--phases]
                                 [--cpu-nchw] [--backward-on-caller] [workload ...]

workloads: mlp_train_step, cnn_train_step, transformer_train_step (the default three) and
linear_relu_train_step (the Transformer's feed-forward block alone: the kernels that save and
read relu's bool mask, which openreg generates differently from the CPU, docs/compile.md).

The model is compiled with default settings (Inductor; its backward is compiled by
AOTAutograd); the loss and the SGD step are the same eager code in every variant. Rounds
alternate the variants so that all see the same machine load; the reported time is the median
over all measured steps. Targets (issue #9): compiled openreg within 1.15x of compiled CPU, and
faster than eager openreg on the Transformer step. Eager CPU is shown too: what a compiled call
costs or saves on the CPU itself.

--phases also prints, per workload, the median forward / backward / optimizer time of each
variant (ms) and, for the openreg variants, where backward went on the device's autograd thread
(as benchmarks/run.py --phases: the handoff to the device thread, its share of backward inside
the device's own kernels, which are the eager kernels and the extern kernels of compiled code,
not its generated kernels, and the return to the caller). Compiled and eager code pay the same
handoff: the difference between compiled openreg and compiled CPU that is not in the phases of
eager openreg and eager CPU is compiled code's own (docs/compile.md, "Where the time goes").
--cpu-nchw adds compiled CPU with Inductor's layout optimization off: the graph the CPU compiles
when its convolutions are not turned channels-last, i.e. the graph openreg compiles.

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
from run import device_thread_line, phase_line  # noqa: E402
from workloads import SmallCNN, SmallTransformer, _train_step, measure  # noqa: E402


def build(name: str, device: str, compiled: bool | dict, phases: list | None = None):
    """One training step; compiled is False, True or the Inductor options to compile with."""
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
    if isinstance(compiled, dict):  # another backend object: Dynamo compiles its own graphs
        run = torch.compile(model, options=compiled)
    else:
        run = torch.compile(model) if compiled else model
    return _train_step(run, x.to(device), y.to(device), loss_fn, phases=phases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="openreg:0")
    parser.add_argument("--backward-on-caller", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--cpu-nchw", action="store_true")
    parser.add_argument("workloads", nargs="*",
                        default=["mlp_train_step", "cnn_train_step", "transformer_train_step"])
    args = parser.parse_args()
    if args.backward_on_caller:
        torch.autograd.set_multithreading_enabled(False)
    variants = {"compiled cpu": ("cpu", True), "compiled openreg": (args.device, True),
                "eager openreg": (args.device, False), "eager cpu": ("cpu", False)}
    if args.cpu_nchw:
        variants["compiled cpu nchw"] = ("cpu", {"layout_optimization": False})
    print(f"{'workload':<24}{'compiled cpu':>14}{'compiled openreg':>18}{'eager openreg':>15}"
          f"{'eager cpu':>11}{'c.openreg/c.cpu':>17}{'c.openreg/eager':>17}"
          + (f"{'c.cpu nchw':>12}" if args.cpu_nchw else ""))
    for name in args.workloads:
        phases = {v: [] for v in variants}
        steps = {v: build(name, d, c, phases[v] if args.phases else None)
                 for v, (d, c) in variants.items()}
        for v, step in steps.items():  # compile, warm caches and allocators
            measure(step, max(3, args.steps // 4))
            phases[v].clear()
        times = {v: [] for v in steps}
        for _ in range(args.rounds):
            for v, step in steps.items():
                times[v] += measure(step, args.steps)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        print(f"{name:<24}{med['compiled cpu']:>12.2f}ms{med['compiled openreg']:>16.2f}ms"
              f"{med['eager openreg']:>13.2f}ms{med['eager cpu']:>9.2f}ms"
              f"{med['compiled openreg'] / med['compiled cpu']:>16.2f}x"
              f"{med['compiled openreg'] / med['eager openreg']:>16.2f}x"
              + (f"{med['compiled cpu nchw']:>10.2f}ms" if args.cpu_nchw else ""), flush=True)
        if args.phases:
            for v in variants:
                line = f"    {v:<18} forward / backward / optimizer {phase_line(phases[v])} ms"
                thread = device_thread_line(phases[v])
                print(line + (f"; {thread}" if thread else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
