"""Operator conformance: every operator of PyTorch's OpInfo database (`op_db`) either works on
openreg exactly like on the CPU or is listed below with the reason it does not.

How it works (docs/fallback.md, "Conformance"):
- For each OpInfo and each dtype of float32, int64 and bool that the OpInfo supports on the CPU,
  its sample inputs are generated for the CPU and run on the CPU first. Samples the CPU rejects
  are dropped; an op/dtype entry none of whose samples runs on the CPU is not counted.
- The same samples, moved to an openreg device (even samples on openreg:0, odd ones on openreg:1;
  a `device=` argument of factory functions is moved too), run on openreg, through the function
  variant, the in-place variant and `out=` (with an empty `out` the kernel has to resize) where
  the OpInfo has them and the CPU accepts them. Results must be on the device and equal to the
  CPU's (torch.testing.assert_close, equal_nan=True); the in-place variant must return its input;
  a result must be a view exactly when the CPU's is.
- Random operators (detected by running the CPU twice under different seeds and getting
  different results) and operators whose result is unspecified memory (`empty*`) are compared by
  structure only: the same shapes, dtypes and devices, not values.
- To keep the file under ~2.5 minutes on 2 cores: at most MAX_SAMPLES samples per entry, samples
  with more than MAX_NUMEL elements in one tensor are skipped, and only the first sample runs the
  in-place and out= variants.

The whole loop runs in a subprocess (`python tests/test_op_conformance.py --json`), so that an
operator crashing the process is reported as a failure naming the operator instead of killing the
test session. Entries that fail are listed in KNOWN_FAILURES with the reason; a listed entry that
starts passing fails the test (strict, so the list can only shrink) and the pass rate is asserted.

Report mode: OPENREG_CONFORMANCE_REPORT=1 pytest -s tests/test_op_conformance.py prints the status
of every entry (or run `python tests/test_op_conformance.py` directly).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch

DTYPES = (torch.float32, torch.int64, torch.bool)
MAX_SAMPLES = 3
MAX_NUMEL = 20_000
REQUIRED_PASS_RATE = 0.95

# Entries ("opname[.variant]:dtype") that do not pass, with the reason. Strict: an entry listed
# here that passes fails test_known_failures_still_fail.
KNOWN_FAILURES: dict[str, str] = {
}

# Results that are unspecified memory: compared by structure only.
UNSPECIFIED_VALUES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                      "empty_permuted", "torch.empty", "nn.functional.dropout"}


# ---- comparison helpers (also used by the self-tests) ----

def tree_map(fn, obj):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, torch.device):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [tree_map(fn, o) for o in obj]
        if hasattr(obj, "_fields"):  # namedtuple (torch.return_types are structseqs)
            return type(obj)(mapped) if not hasattr(obj, "_make") else obj._make(mapped)
        return type(obj)(mapped) if isinstance(obj, list) else tuple(mapped)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return obj


def tensors_of(obj):
    out = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, obj)
    return out


def to_device(obj, device):
    """The sample moved to `device`: tensors, and CPU devices given as device arguments."""
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to(device)
        if isinstance(x, torch.device) and x.type == "cpu":
            return torch.device(device)
        return x
    mapped = tree_map(move, obj)
    if isinstance(obj, dict) and obj.get("device") in ("cpu", torch.device("cpu")):
        mapped["device"] = device
    return mapped


def clone_tree(obj):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def compare(actual, expected, device, values=True):
    """Raises AssertionError unless `actual` (computed on `device`) matches `expected` (CPU)."""
    dev = torch.device(device)
    for t in tensors_of(actual):
        assert t.device == dev, f"result on {t.device}, expected {dev}"
    if not values:
        actual_t, expected_t = tensors_of(actual), tensors_of(expected)
        assert len(actual_t) == len(expected_t), "different number of result tensors"
        for a, e in zip(actual_t, expected_t):
            assert (a.shape, a.dtype) == (e.shape, e.dtype), (
                f"result {a.shape} {a.dtype}, CPU {e.shape} {e.dtype}")
        return
    on_cpu = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, actual)
    if isinstance(expected, (torch.Tensor, list, tuple, dict, int, float, complex, bool)):
        torch.testing.assert_close(on_cpu, expected, equal_nan=True, check_device=False)
    else:
        assert on_cpu == expected, f"{on_cpu!r} != {expected!r}"
    for a, e in zip(tensors_of(actual), tensors_of(expected)):
        assert a._is_view() == e._is_view(), (
            f"view semantics differ: is_view {a._is_view()} on openreg, {e._is_view()} on cpu")


# ---- the conformance loop (runs in a subprocess) ----

def entry_name(op, dtype):
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    return f"{name}:{str(dtype).removeprefix('torch.')}"


def run_variant(fn, sample, device, inplace=False, out=None):
    """Runs `fn` on a copy of `sample` on `device` ('cpu' or openreg)."""
    inp = clone_tree(sample.input)
    args = clone_tree(sample.args)
    kwargs = clone_tree(sample.kwargs)
    if device != "cpu":
        inp, args, kwargs = to_device(inp, device), to_device(args, device), to_device(kwargs, device)
    if out is not None:
        kwargs = dict(kwargs, out=out(device))
    result = fn(inp, *args, **kwargs)
    if inplace:
        assert result is inp, "the in-place variant did not return its input"
    return result


def cpu_differs_with_seed(fn, sample, **kw):
    torch.manual_seed(1)
    try:
        again = run_variant(fn, sample, "cpu", **kw)
    except Exception:
        return True
    torch.manual_seed(0)
    ref = run_variant(fn, sample, "cpu", **kw)
    try:
        compare(again, ref, "cpu")
        return False
    except AssertionError:
        return True


def empty_outs_like(result):
    """out= arguments of size 0 (the kernel resizes them), with the result's dtypes."""
    def make(device):
        if isinstance(result, torch.Tensor):
            return torch.empty(0, dtype=result.dtype, device=device)
        return tuple(torch.empty(0, dtype=t.dtype, device=device) for t in result)
    if isinstance(result, torch.Tensor) or (
            isinstance(result, tuple) and result and all(isinstance(t, torch.Tensor) for t in result)):
        return make
    return None


def small(sample):
    return all(t.numel() <= MAX_NUMEL
               for t in tensors_of([sample.input, list(sample.args), sample.kwargs]))


def check_entry(op, dtype):
    """('pass' | 'fail' | 'cpu-only', detail, number of samples compared)."""
    torch.manual_seed(0)
    try:
        samples = [s for s in itertools.islice(op.sample_inputs("cpu", dtype), 4 * MAX_SAMPLES)
                   if small(s)][:MAX_SAMPLES]
    except Exception as e:  # the sample generator itself fails: nothing runs on the CPU
        return "cpu-only", f"no samples: {type(e).__name__}: {e}", 0
    compared = 0
    for i, sample in enumerate(samples):
        device = f"openreg:{i % 2}"
        variants = [("function", op.op, {})]
        if i == 0 and op.inplace_variant is not None:
            variants.append(("in-place", op.inplace_variant, {"inplace": True}))
        for label, fn, kw in variants:
            torch.manual_seed(0)
            try:
                expected = run_variant(fn, sample, "cpu", **kw)
            except Exception:
                continue  # the CPU rejects this sample/variant: not counted
            values = op.name not in UNSPECIFIED_VALUES and not cpu_differs_with_seed(fn, sample, **kw)
            todo = [(label, kw)]
            if i == 0 and label == "function" and op.supports_out:
                out = empty_outs_like(expected)
                if out is not None:
                    torch.manual_seed(0)
                    try:
                        expected_out = run_variant(fn, sample, "cpu", out=out)
                        todo.append(("out=", {"out": out}))
                    except Exception:
                        pass
            for what, kw2 in todo:
                try:
                    torch.manual_seed(0)
                    actual = run_variant(fn, sample, device, **kw2)
                    compare(actual, expected_out if what == "out=" else expected, device, values)
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    return "fail", f"{what} on {device}: {type(e).__name__}: {msg[0] if msg else ''}", compared
                compared += 1
    if compared == 0:
        return "cpu-only", "no sample runs on the CPU", 0
    return "pass", "", compared


def run_all(progress_path=None, names=None):
    from torch.testing._internal.common_methods_invocations import op_db

    results = {}
    start = time.perf_counter()
    for op in op_db:
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            name = entry_name(op, dtype)
            if names is not None and name not in names:
                continue
            if progress_path:  # a crash leaves the name of the entry that crashed here
                with open(progress_path, "w") as f:
                    f.write(name)
            t0 = time.perf_counter()
            try:
                status, detail, n = check_entry(op, dtype)
            except Exception as e:
                status, detail, n = "fail", f"harness: {type(e).__name__}: {e}", 0
            results[name] = {"status": status, "detail": detail, "samples": n,
                             "seconds": round(time.perf_counter() - t0, 4)}
    return results, time.perf_counter() - start


def print_report(results, file=sys.stdout):
    for name, r in sorted(results.items()):
        listed = " (listed)" if name in KNOWN_FAILURES else ""
        print(f"{r['status']:8} {name}{listed} {r['detail']}", file=file)
    counted = [r for r in results.values() if r["status"] != "cpu-only"]
    passed = sum(r["status"] == "pass" for r in counted)
    print(f"{passed}/{len(counted)} entries pass ({len(results) - len(counted)} do not run on the "
          "CPU)", file=file)


if __name__ == "__main__":
    progress = os.environ.get("OPENREG_CONFORMANCE_PROGRESS")
    only = os.environ.get("OPENREG_CONFORMANCE_ONLY")
    results, seconds = run_all(progress, set(only.split(",")) if only else None)
    if "--json" in sys.argv:
        json.dump({"results": results, "seconds": seconds}, sys.stdout)
    else:
        print_report(results)
        print(f"{seconds:.1f} s")
