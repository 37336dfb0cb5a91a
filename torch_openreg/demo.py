"""Demo workload: trains the same small model on the CPU, openreg:0 and openreg:1.

    python -m torch_openreg.demo [--steps 60]

Prints the losses side by side (they agree: openreg runs the CPU's kernels on its own memory), the
time per step against the CPU, the machine's load while it ran, and the memory statistics of each
device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn


def make_data(n: int = 512, features: int = 64, classes: int = 8):
    """A learnable synthetic task: labels given by a fixed random teacher network."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    return x, (x @ teacher).argmax(dim=1)


class Trainer:
    """One copy of the model on one device, stepped in lockstep with the others."""

    def __init__(self, device: str, batch: int = 64):
        self.device, self.batch = device, batch
        x, y = make_data()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(x.shape[1], 256), nn.ReLU(), nn.Linear(256, 256),
                                   nn.ReLU(), nn.Linear(256, 8)).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.x, self.y = x.to(device), y.to(device)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, step: int) -> None:
        i = (step * self.batch) % self.x.shape[0]
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(self.x[i:i + self.batch]),
                                           self.y[i:i + self.batch])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())
        self.times.append(time.perf_counter() - t0)

    def step_time(self) -> float:
        measured = self.times[min(5, len(self.times) - 1):]  # the first steps warm caches up
        return statistics.median(measured)

    def accuracy(self) -> float:
        with torch.no_grad():
            return (self.model(self.x).argmax(1) == self.y).float().mean().item()


class MachineLoad:
    """How busy the machine was while the demo ran: the 1-minute load average, and the CPU that
    other processes used (cores, from /proc/stat less this process's own CPU time). The ratios to
    the CPU are measured in lockstep, so both devices see the same load, but openreg's backward
    hands work to the device thread and back, and each handoff waits for a free core when other
    processes keep every core busy (README, "Speed on a busy machine")."""

    BUSY_CORES = 0.25  # other processes using more than this: the machine was busy

    def __init__(self):
        self.load_start = os.getloadavg()[0]
        self.wall, self.own, self.busy = time.monotonic(), self._own(), self._busy_seconds()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:8]]
        except (OSError, ValueError):
            return None  # not Linux: the load average only
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def report(self) -> str:
        cores = os.cpu_count() or 1
        wall = time.monotonic() - self.wall
        text = (f"machine load: load average {self.load_start:.2f} at the start, "
                f"{os.getloadavg()[0]:.2f} at the end ({cores} cores)")
        busy_now = self._busy_seconds()
        if busy_now is None or self.busy is None or wall <= 0:
            busy = self.load_start > 1.0
        else:
            others = max(0.0, (busy_now - self.busy - (self._own() - self.own)) / wall)
            text += f"; other processes used {others:.2f} cores while the demo ran"
            busy = others > self.BUSY_CORES
        if busy:
            text += ("\nThe machine was busy: every time above includes waiting for a free core, the "
                     "cpu's too, and the ratios move from run to run. openreg waits at each "
                     "handoff to the autograd device thread and back; README, \"Speed on a busy "
                     "machine\", has the figures and the setting for CI.")
        else:
            text += "\nThe machine was idle: the ratios above are openreg's own speed."
        return text


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    devices = ["cpu"] + [f"openreg:{i}" for i in range(torch.openreg.device_count())]
    print(f"torch {torch.__version__}; openreg devices: {torch.openreg.device_count()} "
          f"({torch.openreg.get_device_name(0)}, "
          f"{mib(torch.openreg.get_device_properties(0).total_memory)} each); "
          f"accelerator: {torch.accelerator.current_accelerator()}\n")
    trainers = {d: Trainer(d) for d in devices}
    load = MachineLoad()
    for step in range(args.steps):  # lockstep: every device sees the same machine load
        for trainer in trainers.values():
            trainer.step(step)

    print("step  " + "".join(f"{d:>14}" for d in devices))
    for step in sorted(set(range(0, args.steps, 10)) | {args.steps - 1}):
        print(f"{step:4d}  " + "".join(f"{trainers[d].losses[step]:14.5f}" for d in devices))
    cpu_time = trainers["cpu"].step_time()
    print("\ntime per step (median) and accuracy on the training set:")
    for d, trainer in trainers.items():
        t = trainer.step_time()
        print(f"  {d:10} {t * 1e3:7.3f} ms  ({t / cpu_time:.2f}x cpu)  accuracy {trainer.accuracy():.3f}")
    worst = max(abs(a - b) for d in devices[1:]
                for a, b in zip(trainers[d].losses, trainers["cpu"].losses))
    print(f"largest loss difference against the cpu: {worst:.2e}")
    print(load.report())

    print("\nmemory statistics (caching allocator of each device):")
    for i in range(torch.openreg.device_count()):
        stats = torch.openreg.memory_stats(i)
        print(f"  openreg:{i}  allocated {mib(torch.openreg.memory_allocated(i))}, "
              f"peak {mib(torch.openreg.max_memory_allocated(i))}, "
              f"reserved {mib(torch.openreg.memory_reserved(i))}, "
              f"allocations {stats.get('allocation.all.allocated', 0)}, "
              f"segments {stats.get('segment.all.current', 0)}")
    del trainers, trainer
    print("after releasing the models: allocated " + ", ".join(
        f"openreg:{i} {mib(torch.openreg.memory_allocated(i))}"
        for i in range(torch.openreg.device_count())))


if __name__ == "__main__":
    main()
