"""Cost of module conversion with and without openreg's shallow-copy kernel (docs/module_conversion.md).

    python benchmarks/module_conversion.py [--rounds R]

Measured in one process, interleaving nothing else: `.to("openreg")` of 50 `Linear(64, 64)` (100
parameters) and `param.data = t` between openreg tensors, first with the kernel of
torch_openreg/module_conversion.py (parameters kept), then with torch's
`swap_module_params_on_conversion` flag, then after unregistering the kernel (torch's own answer:
a new Parameter per module). Each line: the median per round, for R rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from torch_openreg import module_conversion


def to_device_ms(repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(50)])
        t0 = time.perf_counter()
        m.to("openreg")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def set_data_us(n: int = 20000) -> float:
    p = nn.Parameter(torch.ones(4, device="openreg"))
    t = torch.zeros(4, device="openreg")
    t0 = time.perf_counter()
    for _ in range(n):
        p.data = t
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):
        rows.setdefault("to('openreg'), 100 params, kernel (ms)", []).append(to_device_ms())
        rows.setdefault("param.data = t, kernel (us)", []).append(set_data_us())
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            rows.setdefault("to('openreg'), 100 params, swap flag (ms)", []).append(to_device_ms())
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    module_conversion._aten._destroy()  # torch's own answer from here on (ties break)
    for _ in range(rounds):
        rows.setdefault("to('openreg'), 100 params, no kernel (ms)", []).append(to_device_ms())
        rows.setdefault("param.data = t, no kernel (us)", []).append(set_data_us())
    for name, values in rows.items():
        print(f"{name:45s} " + " ".join(f"{v:6.2f}" for v in values))


if __name__ == "__main__":
    main()
