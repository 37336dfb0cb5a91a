"""openreg against the CPU on a busy machine: CPU and openreg work interleaved while other
processes run (issue 31).

    python benchmarks/loaded.py [--runs R] [--steps N] [--cases lockstep,busy,two,suite]
                                [--competitor-session same|new] [--sched] [--env NAME=VALUE ...]

The idle tables of run.py measure one device at a time on a quiet machine. Test suites and
training scripts run differently: a CPU reference and the openreg result one after the other,
thousands of times, next to a build or as several pytest-xdist workers. The cases, each run R
times in fresh processes (the order of the cases rotates from run to run):

- lockstep: the demo's workload (torch_openreg.demo: an MLP and Adam on the CPU, openreg:0 and
  openreg:1, stepped in lockstep), alone: the reference of the moment.
- busy: the same, with one CPU-bound process beside it (started and stopped here; it also ends
  itself after a bounded time).
- two: two copies of it at once (as ``pytest -n 2`` on 2 cores).
- suite: benchmarks/loaded_suite.py under ``pytest -n 2``: small operators, modules, a CPU
  reference and an openreg result compared in each test, backward included. The ratio is the
  openreg parts' total time over the CPU parts' (both workers summed).

Ratios are openreg / CPU: medians of the step times of one process (lockstep cases) or totals
(suite). Next to each figure: the 1-minute load average at its start and the CPU that processes
other than this benchmark's used during it (in cores, from /proc/stat less our children's
rusage), so that a figure measured on a busy machine reads as such.

--sched prints, per lockstep process, the scheduler's counters of each thread over the measured
steps (/proc/<pid>/task/<tid>/schedstat and status): time on a core, time runnable but waiting
for a core, voluntary and involuntary context switches, per step; and, per openreg device, the
median handoff of backward (backward() called -> first kernel on the device thread), time inside
the device thread's kernels and their number, and return (last kernel -> backward() returns).
--competitor-session: the competing process in this benchmark's session (same, the default: a
`cmd &` in the same shell, or the other xdist worker) or a new one (another terminal: with the
kernel's autogroup, the scheduler then shares the cores between sessions first).
--env NAME=VALUE is set in the measured processes (not in the competitor), e.g.
OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = ("lockstep", "busy", "two", "suite")
TARGET = 1.3


# ---------------------------------------------------------------- the machine's load

def _busy_jiffies() -> tuple[int, int]:
    """(non-idle, total) jiffies of all cores since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


class LoadWindow:
    """The load average at the start, and the CPU used by processes other than this one and its
    (waited-for) children during the window, in cores."""

    def __init__(self):
        self.load = os.getloadavg()[0]
        self.t0 = time.monotonic()
        self.busy0, _ = _busy_jiffies()
        self.own0 = self._own()

    @staticmethod
    def _own() -> float:
        c, s = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return c.ru_utime + c.ru_stime + s.ru_utime + s.ru_stime

    def others(self, exclude_cores: float = 0.0) -> float:
        """Cores used by other processes; `exclude_cores` (our competitor's, still running)."""
        wall = time.monotonic() - self.t0
        busy = (_busy_jiffies()[0] - self.busy0) / os.sysconf("SC_CLK_TCK")
        return max(0.0, (busy - (self._own() - self.own0)) / wall - exclude_cores)


# ---------------------------------------------------------------- scheduler counters

def _thread_counters() -> dict[int, dict]:
    out = {}
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"{base}/{tid}/schedstat") as f:
                run_ns, wait_ns, slices = (int(v) for v in f.read().split())
            vol = invol = 0
            with open(f"{base}/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol = int(line.split()[1])
        except OSError:
            continue  # the thread ended
        out[int(tid)] = {"comm": comm, "run": run_ns, "wait": wait_ns, "slices": slices,
                         "vol": vol, "invol": invol}
    return out


def _counter_delta(before: dict, after: dict, steps: int) -> list[dict]:
    rows = []
    pid = os.getpid()
    for tid, a in after.items():
        b = before.get(tid, {"run": 0, "wait": 0, "slices": 0, "vol": 0, "invol": 0})
        row = {k: a[k] - b[k] for k in ("run", "wait", "slices", "vol", "invol")}
        if row["run"] < 1e6 and tid != pid:
            continue  # threads that did (almost) nothing
        name = "main" if tid == pid else a["comm"]
        if name not in ("main",) and not name.startswith("pt_autograd"):
            name = f"{a['comm']}:{tid}"  # OpenMP workers inherit the process's name
        rows.append({"thread": name, **{k: v / steps for k, v in row.items()}})
    return rows


# ---------------------------------------------------------------- worker: lockstep demo

def lockstep_worker(steps: int, sched: bool, prepare=None) -> dict:
    """The demo's trainers stepped in lockstep; `prepare()` runs after the warm-up steps."""
    import torch
    import torch.nn.functional as F
    from torch_openreg import _C
    from torch_openreg.demo import Trainer

    devices = ["cpu"] + [f"openreg:{i}" for i in range(torch.openreg.device_count())]
    trainers = {d: Trainer(d) for d in devices}
    phases = {d: [] for d in devices}
    handoffs = {d: [] for d in devices}

    def step(d: str, tr: Trainer, k: int) -> None:
        i = (k * tr.batch) % tr.x.shape[0]
        t0 = time.perf_counter()
        loss = F.cross_entropy(tr.model(tr.x[i:i + tr.batch]), tr.y[i:i + tr.batch])
        t1 = time.perf_counter()
        tr.opt.zero_grad(set_to_none=True)
        dev = d != "cpu"
        if dev:
            _C._reset_device_thread_stats()
            call_ns = time.monotonic_ns()
        loss.backward()
        if dev:
            ret_ns = time.monotonic_ns()
            s = _C._device_thread_stats()
            _C._reset_device_thread_stats(False)
            if s["kernels"]:
                handoffs[d].append(((s["first_start_ns"] - call_ns) * 1e-3,
                                    (ret_ns - s["last_end_ns"]) * 1e-3, s["busy_ns"] * 1e-3,
                                    s["kernels"]))
        t2 = time.perf_counter()
        tr.opt.step()
        tr.losses.append(loss.item())
        t3 = time.perf_counter()
        tr.times.append(t3 - t0)
        phases[d].append((t1 - t0, t2 - t1, t3 - t2))

    warm = 5
    for k in range(warm):
        for d, tr in trainers.items():
            step(d, tr, k)
    for d in devices:
        trainers[d].times.clear()
        phases[d].clear()
        handoffs[d].clear()
    if prepare is not None:
        prepare()
    before = _thread_counters() if sched else None
    for k in range(warm, warm + steps):  # lockstep: every device sees the same machine load
        for d, tr in trainers.items():
            step(d, tr, k)
    after = _thread_counters() if sched else None
    med = {d: statistics.median(tr.times) for d, tr in trainers.items()}
    out = {
        "torch_threads": torch.get_num_threads(),
        "step_ms": {d: med[d] * 1e3 for d in devices},
        "ratio": {d: med[d] / med["cpu"] for d in devices[1:]},
        "phases_ms": {d: [statistics.median(p[j] for p in phases[d]) * 1e3 for j in range(3)]
                      for d in devices},
        "handoff_us": {d: [statistics.median(h[j] for h in handoffs[d]) for j in range(4)]
                       for d in devices[1:] if handoffs[d]},
        "worst_loss_diff": max(abs(a - b) for d in devices[1:]
                               for a, b in zip(trainers[d].losses, trainers["cpu"].losses)),
    }
    if sched:
        out["threads"] = _counter_delta(before, after, steps)
    return out


def spin_worker(seconds: float) -> None:
    """A CPU-bound process that ends itself after `seconds`."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for _ in range(10000):
            x += 1


# ---------------------------------------------------------------- orchestration

def _env(extra: list[str]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for item in extra:
        k, _, v = item.partition("=")
        env[k] = v
    return env


def _start_lockstep(args) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "lockstep",
           "--steps", str(args.steps)] + (["--sched"] if args.sched else [])
    return subprocess.Popen(cmd, env=_env(args.env), stdout=subprocess.PIPE, text=True)


def _collect(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"worker failed with {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


class Competitor:
    """One CPU-bound process for the duration of a case (and never longer than `seconds`)."""

    def __init__(self, new_session: bool, seconds: float = 600):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "spin",
                                   "--seconds", str(seconds)], start_new_session=new_session)
        time.sleep(0.3)  # running before the measured process starts

    def stop(self) -> None:
        self.p.kill()
        self.p.wait()


def run_case(case: str, args) -> list[dict]:
    """One run of a case: a result per measured process."""
    window = LoadWindow()
    competitor = Competitor(args.competitor_session == "new") if case == "busy" else None
    try:
        if case in ("lockstep", "busy"):
            results = [_collect(_start_lockstep(args))]
        elif case == "two":
            procs = [_start_lockstep(args) for _ in range(2)]
            results = [_collect(p) for p in procs]
        else:
            results = [run_suite(args)]
        # The competitor's CPU is ours, but it is not waited for yet: counted as one core.
        others = window.others(exclude_cores=1.0 if competitor else 0.0)
    finally:
        if competitor:
            competitor.stop()
    for r in results:
        r["load"], r["others"] = window.load, others
    return results


def run_suite(args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = _env(args.env)
        env["OPENREG_LOADED_SUITE_OUT"] = out
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                            "-o", "python_files=loaded_suite.py", os.path.join(HERE, "loaded_suite.py")],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError("suite failed:\n" + p.stdout[-3000:] + p.stderr[-3000:])
        totals = [json.load(open(os.path.join(out, f))) for f in os.listdir(out)]
    cpu = sum(t["cpu"] for t in totals)
    dev = sum(t["openreg"] for t in totals)
    return {"ratio": {"openreg:0": dev / cpu}, "cpu_s": cpu, "openreg_s": dev, "wall_s": wall,
            "tests": sum(t["tests"] for t in totals), "workers": len(totals)}


def _fmt_range(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=("lockstep", "spin"), help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=600, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--competitor-session", choices=("same", "new"), default="same")
    parser.add_argument("--sched", action="store_true", help="print the scheduler's counters")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()

    if args.worker == "spin":
        spin_worker(args.seconds)
        return 0
    if args.worker == "lockstep":
        print(json.dumps(lockstep_worker(args.steps, args.sched)))
        return 0

    cases = [c for c in args.cases.split(",") if c]
    print(f"{os.cpu_count()} cores; measured processes' environment: "
          f"{' '.join(args.env) or 'default'}; competitor in the {args.competitor_session} session; "
          f"{args.runs} runs, {args.steps} lockstep steps\n", flush=True)
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(args.runs):
        order = cases[r % len(cases):] + cases[:r % len(cases)]  # rotate: no case always first
        for case in order:
            for res in run_case(case, args):
                results[case].append(res)
                ratios = " ".join(f"{d} {v:.2f}x" for d, v in res["ratio"].items())
                extra = (f"cpu step {res['step_ms']['cpu']:.2f} ms" if "step_ms" in res
                         else f"cpu {res['cpu_s']:.2f} s, openreg {res['openreg_s']:.2f} s, "
                              f"{res['tests']} tests, wall {res['wall_s']:.1f} s")
                print(f"run {r + 1} {case:9} {ratios}  ({extra}; load {res['load']:.2f}, "
                      f"others {res['others']:.2f} cores)", flush=True)
                if args.sched and "threads" in res:
                    print_sched(res)

    print("\n| case | openreg:0 / cpu | openreg:1 / cpu | cpu | load average | other processes |")
    print("|---|---|---|---|---|---|")
    names = {"lockstep": "demo lockstep, alone", "busy": "demo lockstep, one busy process beside it",
             "two": "demo lockstep, two copies at once", "suite": "test-suite workload, `pytest -n 2`"}
    worst = 0.0
    for case in cases:
        rs = results[case]
        if not rs:
            continue
        cols = []
        for d in ("openreg:0", "openreg:1"):
            vals = [x["ratio"][d] for x in rs if d in x["ratio"]]
            cols.append(_fmt_range(vals) + "x" if vals else "-")
            if case != "lockstep" and vals:
                worst = max(worst, max(vals))
        cpu = (_fmt_range([x["step_ms"]["cpu"] for x in rs]) + " ms" if "step_ms" in rs[0]
               else _fmt_range([x["cpu_s"] for x in rs]) + " s")
        print(f"| {names[case]} | {cols[0]} | {cols[1]} | {cpu} | "
              f"{_fmt_range([x['load'] for x in rs], '{:.1f}')} | "
              f"{_fmt_range([x['others'] for x in rs], '{:.1f}')} cores |")
    print(f"\nworst loaded ratio {worst:.2f}x (target {TARGET}x: {'met' if worst <= TARGET else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if worst <= TARGET else 1


def print_sched(res: dict) -> None:
    print("    per step:  thread            on core ms  waiting ms  slices  vol.sw  invol.sw")
    for row in res["threads"]:
        print(f"               {row['thread']:16} {row['run'] / 1e6:10.3f} {row['wait'] / 1e6:11.3f} "
              f"{row['slices']:7.1f} {row['vol']:7.1f} {row['invol']:9.1f}")
    for d, (h, r, busy, kernels) in res.get("handoff_us", {}).items():
        print(f"    {d} backward: handoff {h:.0f} us, in {kernels:.0f} kernels {busy:.0f} us, "
              f"return {r:.0f} us; phases "
              + " / ".join(f"{v:.2f}" for v in res["phases_ms"][d])
              + f" ms (cpu {' / '.join(f'{v:.2f}' for v in res['phases_ms']['cpu'])})")


if __name__ == "__main__":
    sys.exit(main())
