"""Profiles a few training steps of a small MLP on openreg and writes a Chrome trace.

    python examples/profile_training.py [trace.json]

Open the trace in https://ui.perfetto.dev (or chrome://tracing): the CPU ops sit on the rows of
the Python and autograd threads, the device's kernels and copies on the rows "openreg:0" /
"stream N", with an arrow from each launch call (openregLaunchKernel, openregMemcpy, ...) to the
work it issued. The table printed at the end is sorted by device time.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import torch_openreg  # noqa: F401  (also autoloaded by `import torch`)


def main(path: str = "openreg_trace.json") -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to("openreg")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(64, 784).pin_memory(), torch.randint(0, 10, (64,)).pin_memory())
            for _ in range(6)]

    def on_trace_ready(prof):
        prof.export_chrome_trace(path)
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=12))
        print(f"wrote {path}")

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                 schedule=schedule(wait=1, warmup=1, active=3), on_trace_ready=on_trace_ready,
                 record_shapes=True) as prof:
        for x, y in data:
            with record_function("train_step"):
                x = x.to("openreg", non_blocking=True)
                y = y.to("openreg", non_blocking=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            prof.step()
    print(f"last loss {loss.item():.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
