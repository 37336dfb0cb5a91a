"""CPU and openreg side by side, in one process, with default autograd settings.

    python benchmarks/run.py [--rounds R] [--steps N] [--device openreg:0] [--phases]
                             [--backward-on-caller] [--optimizer-default] [workload ...]

Rounds alternate CPU and openreg so that both see the same machine load; the reported time is
the median over all measured steps, the ratio is openreg / CPU. Targets (the README's
speed targets): training steps within 1.1x of the CPU with OMP_NUM_THREADS=1, 1.25x with
the default settings; the tiny-op loop within 1.3x (issue 41).

--phases also prints the median forward, backward and optimizer time of the training steps, and
where openreg's backward time went on the device thread (a line under the table per workload):
the handoff from the call of backward() to the device thread's first kernel, the share of
backward spent inside kernels on the device thread, the kernels per backward, and the time from
the last kernel to the return of backward(). A regression of the device thread shows there.
--backward-on-caller runs backward on the thread that calls it (autograd multithreading off), for
both devices: not openreg's configuration, but the bound on what the device threads cost
(docs/autograd.md). The training steps' SGD uses the for-loop implementation on both devices (the
CPU's default) so that both run the same kernels; --optimizer-default leaves the choice to torch,
which takes the foreach operators on openreg as on any accelerator (benchmarks/workloads.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402
from workloads import WORKLOADS, measure  # noqa: E402


def bench(name: str, device: str, rounds: int, steps: int, phases: dict) -> tuple[float, float]:
    """Median step time on the CPU and on `device`; fills phases[device] with the per-step
    (forward, backward, optimizer) times of training workloads."""
    build, _ = WORKLOADS[name]
    timed = name.endswith("_train_step")
    steps_by_device = {}
    for d in ("cpu", device):
        phases[d] = []
        steps_by_device[d] = build(d, phases=phases[d]) if timed else build(d)
    for d, step in steps_by_device.items():  # warm-up: caches, allocator, autograd threads
        measure(step, max(3, steps // 4))
        phases[d].clear()
    times = {d: [] for d in steps_by_device}
    for _ in range(rounds):
        for d, step in steps_by_device.items():
            times[d] += measure(step, steps)
    return statistics.median(times["cpu"]), statistics.median(times[device])


def phase_line(phases: list) -> str:
    if not phases:
        return ""
    return " / ".join(f"{statistics.median(p[i] for p in phases) * 1e3:.3f}" for i in range(3))


def device_thread_line(phases: list) -> str:
    """Where openreg's backward time went (medians over steps): backward() called -> first kernel
    on the device thread (the handoff), the share of backward the device thread spent inside
    kernels, the kernels per backward, last kernel -> backward() returns."""
    detail = [p for p in phases if len(p) == 7]
    if not detail:
        return ""
    med = lambda i: statistics.median(p[i] for p in detail)  # noqa: E731
    share = statistics.median(p[4] / p[1] for p in detail)
    return (f"handoff {med(3) * 1e6:.0f} us, device thread in kernels {share:.0%} of backward "
            f"({med(5):.0f} kernels), return {med(6) * 1e6:.0f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="openreg:0")
    parser.add_argument("--phases", action="store_true",
                        help="also print forward / backward / optimizer medians (ms)")
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="autograd multithreading off for both devices (not openreg's setup)")
    parser.add_argument("--optimizer-default", action="store_true",
                        help="let torch choose the SGD implementation per device (foreach on "
                             "openreg, the for-loop on the CPU) instead of the for-loop on both")
    args = parser.parse_args()
    if args.optimizer_default:
        workloads.OPTIMIZER_FOREACH = None
    if args.backward_on_caller:
        torch.autograd.set_multithreading_enabled(False)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} cores, device {args.device}\n")
    print("SGD: " + ("torch's choice per device (foreach on openreg, for-loop on the CPU)"
                     if args.optimizer_default else "the for-loop implementation on both devices")
          + "\n")
    if args.backward_on_caller:
        print("backward on the calling thread (autograd multithreading off): not openreg's "
              "configuration\n")
    header, rule = "| workload | cpu | openreg | ratio | target |", "|---|---|---|---|---|"
    if args.phases:
        header += " cpu fwd / bwd / opt | openreg fwd / bwd / opt |"
        rule += "---|---|"
    print(header)
    print(rule)
    failed = False
    notes = []
    for name in args.workloads:
        target = WORKLOADS[name][1]
        phases: dict = {}
        try:
            cpu, dev = bench(name, args.device, args.rounds, args.steps, phases)
        except Exception as e:  # report and go on with the other workloads
            print(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
            failed = True
            continue
        ratio = dev / cpu
        ok = ratio <= target
        failed |= not ok
        extra = (f" {phase_line(phases['cpu'])} | {phase_line(phases[args.device])} |"
                 if args.phases else "")
        print(f"| {name} | {cpu * 1e3:.3f} ms | {dev * 1e3:.3f} ms | {ratio:.2f}x | "
              f"<= {target}x {'ok' if ok else 'MISSED'} |" + extra, flush=True)
        if args.phases and device_thread_line(phases[args.device]):
            notes.append(f"{name} backward on openreg: {device_thread_line(phases[args.device])}")
    for note in notes:
        print("\n" + note if note is notes[0] else note)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
