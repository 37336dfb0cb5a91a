"""``python -m torch_openreg.check``: the contract check against the registered PrivateUse1 backend.

The checks run in a worker process that loads this package by its path, without importing
torch_openreg (``python -m torch_openreg.check`` has to import the torch_openreg package, which
registers openreg: a worker is the only way to check another backend honestly). With ``--import``
the worker imports the named modules with autoload off, so they register the backend. If the worker
dies inside a check (a segfault of the backend), that check is reported as crashed and a new
worker runs the remaining ones.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

PREFIX = "@@privateuse1-check "
HERE = pathlib.Path(__file__).resolve().parent

# Loads this directory as the package `privateuse1_check` and runs the worker.
BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "privateuse1_check", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]])
pkg = importlib.util.module_from_spec(spec)
sys.modules["privateuse1_check"] = pkg
spec.loader.exec_module(pkg)
import privateuse1_check.__main__ as m
m.worker(sys.argv[2:])
"""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_openreg.check", description=(
        "Check what PyTorch expects of a PrivateUse1 accelerator backend against the one "
        "registered in this process (autoloaded, or imported with --import)."))
    p.add_argument("--device", help="device type name (default: the PrivateUse1 backend's name)")
    p.add_argument("--format", choices=("table", "json", "junit"), default="table")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers the backend); turns autoload off unless "
                        "TORCH_DEVICE_BACKEND_AUTOLOAD is set")
    p.add_argument("--only", action="append", default=[], metavar="CHECK", help="run only this check")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per check (default 60)")
    p.add_argument("--output", help="write the report to this file instead of stdout")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    return p.parse_args(argv)


def worker(argv: list[str]) -> None:
    """Runs in the worker process: import the backend, run the checks, print one line per result."""
    args = parse(argv)
    import importlib

    import torch
    for name in args.imports:
        importlib.import_module(name)
    from . import runner
    device = args.device or torch._C._get_privateuse1_backend_name()
    print(PREFIX + json.dumps({"device": device, "torch": torch.__version__}), flush=True)
    ctx = runner.Context.for_device(device, tuple(args.imports))
    for check in runner.selected(args.only):
        print(PREFIX + json.dumps({"start": check.name}), flush=True)
        result = runner.run_one(check, ctx, args.timeout)
        print(PREFIX + json.dumps(result.to_dict()), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a check that hung leaves a thread behind: do not wait for it


def supervise(args: argparse.Namespace, argv: list[str]):
    from .checks import CHECKS
    from .runner import Result, selected

    pending = [c.name for c in selected(args.only)]
    results: list[Result] = []
    meta = {"device": args.device or "?", "torch": "?"}
    env = dict(os.environ)
    if args.imports:
        env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    passthrough = [a for a in argv if a not in ("--list",)]
    passthrough = _without(passthrough, ("--only", "--output", "--format"))
    by_name = {c.name: c for c in CHECKS}
    while pending:
        cmd = [sys.executable, "-c", BOOTSTRAP, str(HERE), *passthrough,
               *[x for n in pending for x in ("--only", n)]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=sum(max(args.timeout, by_name[n].min_timeout)
                                              for n in pending) + 120)
            out, code = proc.stdout, proc.returncode
            err = proc.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            code, err = "timeout", ""
        started = None
        for line in out.splitlines():
            if not line.startswith(PREFIX):
                continue
            msg = json.loads(line[len(PREFIX):])
            if "torch" in msg and "status" not in msg:
                meta = msg
            elif "start" in msg:
                started = msg["start"]
            else:
                results.append(Result(**msg))
                pending.remove(msg["name"])
                started = None
        if not pending:
            break
        if started is None and not results and meta["torch"] == "?":
            tail = (err.strip().splitlines() or ["no output"])[-1]
            print(f"error: the backend could not be set up: {tail}", file=sys.stderr)
            return None, meta
        name = started or pending[0]
        c = by_name[name]
        results.append(Result(name=name, mechanism=c.mechanism, required=c.required, status="fail",
                              detail=f"the process died during this check (exit {code})",
                              fix=c.fix, guide="docs/" + c.guide))
        pending.remove(name)
    order = {c.name: i for i, c in enumerate(CHECKS)}
    results.sort(key=lambda r: order[r.name])
    return results, meta


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    from . import report
    from .checks import CHECKS
    from .runner import selected
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<18} {'required' if c.required else 'optional'}  {c.mechanism}  [docs/{c.guide}]")
        return 0
    try:
        selected(args.only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results, meta = supervise(args, argv)
    if results is None:
        return 2
    device = meta["device"]
    if args.format == "json":
        text = report.as_json(results, device, meta["torch"])
    elif args.format == "junit":
        text = report.junit(results, device)
    else:
        text = report.table(results, device, f" (torch {meta['torch']})")
    if device == "privateuseone" and all(not r.passed for r in results):
        print("note: no PrivateUse1 backend is registered in the worker (autoload found none, or "
              "TORCH_DEVICE_BACKEND_AUTOLOAD=0): name its module with --import", file=sys.stderr)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n")
        print(report.summary(results))
    else:
        print(text)
    return 1 if any(r.required and not r.passed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
