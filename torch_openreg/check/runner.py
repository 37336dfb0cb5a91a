"""Runs the checks in this process, each bounded in time, and turns each into a ``Result``."""

from __future__ import annotations

import gc
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

from .checks import CHECKS, Check, CheckFailed, Context

GUIDE_ROOT = "docs/"


@dataclass
class Result:
    name: str
    mechanism: str
    required: bool
    status: str  # "pass" or "fail"
    detail: str  # the note on success, the reason on failure
    missing: list[str] = field(default_factory=list)
    fix: str = ""
    guide: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict:
        return asdict(self)


def run_one(check: Check, ctx: Context, timeout: float = 60.0) -> Result:
    """Runs one check in a thread so that a hang becomes a failure after ``timeout`` seconds."""
    out: dict = {}
    timeout = max(timeout, check.min_timeout)

    def body():
        try:
            out["note"] = check.func(ctx) or ""
        except CheckFailed as e:
            out["fail"] = (str(e), e.missing)
        except BaseException as e:  # any error of the backend is a finding, not a crash of the tool
            frames = traceback.extract_tb(e.__traceback__)
            where = f" (at {frames[-1].name}:{frames[-1].lineno})" if frames else ""
            first = (str(e).strip().splitlines() or [""])[0][:200]
            out["fail"] = (f"{type(e).__name__}: {first}{where}", [])

    start = time.perf_counter()
    if check.main_thread:
        body()
        alive = False
    else:
        t = threading.Thread(target=body, name=f"check-{check.name}", daemon=True)
        t.start()
        t.join(timeout)
        alive = t.is_alive()
    seconds = time.perf_counter() - start
    # Device tensors held by reference cycles (tracebacks, test inputs) are freed now, not during
    # whatever the process does next (the checks also run inside a backend's own test suite).
    gc.collect()
    base = dict(name=check.name, mechanism=check.mechanism, required=check.required, fix=check.fix,
                guide=GUIDE_ROOT + check.guide, seconds=round(seconds, 3))
    if alive:
        return Result(status="fail", detail=f"did not finish within {timeout:.0f} s (hang)", **base)
    if "fail" in out:
        reason, missing = out["fail"]
        return Result(status="fail", detail=reason, missing=missing, **base)
    return Result(status="pass", detail=out["note"], **base)


def selected(names: list[str] | None = None) -> list[Check]:
    if not names:
        return list(CHECKS)
    known = {c.name: c for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def run_checks(device: str | None = None, names: list[str] | None = None,
               timeout: float = 60.0) -> list[Result]:
    """Runs the checks (all, or those named) against ``device`` (default: the PrivateUse1 name)."""
    ctx = Context.for_device(device)
    return [run_one(c, ctx, timeout) for c in selected(names)]
