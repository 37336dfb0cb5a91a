"""Operator conformance: every operator of PyTorch's OpInfo database (`op_db`) either works on
openreg exactly like on the CPU or is listed below with the reason it does not.

How it works (docs/fallback.md, "Conformance"):
- Entries are op/dtype pairs: each OpInfo with every dtype it supports on the CPU (float32, int64
  and bool get every check below; the other dtypes EXTRA_SAMPLES sample of the function variant).
  Per op also "op:errors" (op.error_inputs: the documented exception type, with the CPU's exact
  message) and "op:grad" (float64 gradients of the first sample equal the CPU's). Entries
  alternate between openreg:0 and openreg:1.
- Samples are generated for the openreg device, as PyTorch's device tests do, and the CPU
  reference gets the same values moved to the CPU (tensors the sample function put on the CPU on
  purpose stay there; `device=` arguments follow). The CPU runs first: samples it rejects are
  dropped, and an entry none of whose samples runs on the CPU is not counted.
- On openreg run the function variant, and for the first sample also the in-place variant (it
  must return its input) and `out=` (an empty `out` the kernel has to resize), where the OpInfo
  has them and the CPU accepts them. Results must be on the device, equal to the CPU's
  (torch.testing.assert_close, equal_nan=True), and share memory with the same inputs as the CPU's
  results do (views stay views).
- Random operators (the OpInfo wraps them in wrapper_set_seed, or running them changes the CPU
  generator's state) and operators whose result is unspecified memory (`empty*`) are compared by
  structure only: the same shapes, dtypes and devices, not values.
- Layouts: every result (and float64 gradient) must have the CPU's sizes, strides and storage
  offset. The first sample of the main dtypes also runs in other memory formats
  (CONFORMANCE_LAYOUTS: channels-last, transposed, expanded, sliced; the function variant) and
  out= once more into an out of the right sizes transposed in memory. A format in which the CPU's
  own results are not those of the contiguous sample is the CPU's bug and is not compared
  (CPU_LAYOUT_BUGS, strict). About 11% more CPU time than without (48.8 s against 43.8 s,
  2026-12-02, loaded machine).
- To keep the file under ~2.5 minutes on 2 cores: at most MAX_SAMPLES samples per entry (plus a
  non-contiguous copy of the first), samples with a tensor of more than MAX_NUMEL elements are
  skipped, and only the first sample runs the in-place and out= variants.

The whole loop runs in a subprocess (`python tests/test_op_conformance.py --json`), so that an
operator crashing the process is reported as a failure naming the operator instead of killing the
test session. Entries that fail are listed in KNOWN_FAILURES with the reason; a listed entry that
starts passing fails the test (strict, so the list can only shrink) and the pass rate is asserted.

Report mode: OPENREG_CONFORMANCE_REPORT=1 pytest -s tests/test_op_conformance.py prints the status
of every entry (or run `python tests/test_op_conformance.py` directly).

Bits: the subprocess runs with OMP_NUM_THREADS=1 (backward runs on the autograd device thread with
one OpenMP thread, docs/determinism.md), and every passing comparison of values (results and
float64 gradients) is also made bit for bit (NaNs of any payload aside). An entry whose results
are close but not equal gets a "bits" note; test_results_are_the_cpus_bit_for_bit asserts there is
none outside BITWISE_DIFFERENCES, which lists each with its reason (strict, like KNOWN_FAILURES).
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

# The main dtypes get MAX_SAMPLES samples and every variant; every other dtype the OpInfo supports
# on the CPU gets EXTRA_SAMPLES samples of the function variant (to stay within the time budget).
DTYPES = (torch.float32, torch.int64, torch.bool)
EXTRA_SAMPLES = 1
MAX_ERROR_INPUTS = 6
MAX_SAMPLES = 3
MAX_NUMEL = 20_000
REQUIRED_PASS_RATE = 0.95

# Entries ("opname[.variant]:dtype") that do not pass: the reason, and a fragment of the error they
# must fail with (a clear one). Strict: an entry listed here that passes fails
# test_listed_failures_still_fail, so the list can only shrink.
KNOWN_FAILURES: dict[str, tuple[str, str]] = {}

# Entries whose results are close to the CPU's but not equal bit for bit, with the reason
# (docs/determinism.md). Strict: an entry listed here whose bits are equal fails.
BITWISE_DIFFERENCES: dict[str, str] = {
    "nn.functional.mse_loss:float32": "openreg's own one-pass kernel, accumulating in double "
                                      "(csrc/routes/aten_kernel.cpp)",
    "abs:complex128": "openreg's own abs_stub kernel, the example of the DispatchStub route "
                      "(csrc/routes/dispatch_stub.cpp): its complex magnitude rounds otherwise",
    # Found by this test, not yet explained (torch 2.15; docs/determinism.md lists them).
    "nn.functional.linear_cross_entropy.chunked:float16": "not yet explained",
    "nn.functional.linear_cross_entropy.chunked_none:float16": "not yet explained",
    "nn.functional.mish:grad": "not yet explained",
}

# Entries whose CPU results in one of the memory formats below are not its results for the same
# values in the contiguous layout: torch's CPU kernel is wrong there, so that format is not
# compared (docs/determinism.md, "Layouts"). Strict, like the lists above.
CPU_LAYOUT_BUGS: dict[str, str] = {
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:float32":
        "channels_last: the CPU's flash attention kernel reads (B, H, L, E) tensors whose last "
        "dimension is not contiguous as if it were (values of other positions, run to run "
        "different); scaled_dot_product_attention itself does not pass it such tensors",
}

# Operators whose values depend on the layout of their input by definition (they reinterpret its
# memory): their results in another memory format are compared with the CPU's, not with the
# contiguous sample's.
LAYOUT_DEPENDENT_VALUES = {"resize_", "resize_as_"}

# Results that are unspecified memory: compared by structure only.
UNSPECIFIED_VALUES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                      "empty_permuted"}


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


def to_cpu(obj):
    """A sample generated for an openreg device, moved to the CPU: its openreg tensors, and the
    openreg devices it passes as arguments (factory functions, `to`). Tensors the sample function
    put on the CPU on purpose (e.g. tensor_split's indices) stay there."""
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().cpu() if x.device.type == "openreg" else x.detach()
        if isinstance(x, torch.device) and x.type == "openreg":
            return torch.device("cpu")
        return x
    if isinstance(obj, str) and obj.startswith("openreg"):
        return "cpu"
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(to_cpu(o) for o in obj) if isinstance(obj, list) else tuple(
            to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return tree_map(move, obj)


def clone_tree(obj):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, obj)


def same_bits(a, e):
    """Bit for bit (NaNs of any payload aside, -0.0 is not 0.0)."""
    if a.dtype != e.dtype or a.shape != e.shape:
        return False
    if a.is_complex():
        a, e = torch.view_as_real(a.resolve_conj()), torch.view_as_real(e.resolve_conj())
    if a.dtype.is_floating_point and a.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                     torch.float64):
        a, e = a.float(), e.float()  # float8: exact in float32
    if a.dtype.is_floating_point:
        nan = a.isnan()
        if not torch.equal(nan, e.isnan()):
            return False
        a, e = a.masked_fill(nan, 0), e.masked_fill(nan, 0)
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), e.contiguous().view(ints))
    return torch.equal(a, e)


# Set by check_entry/check_gradients for the entry that runs: where its bits first differed.
BITS_NOTE: list = []
# Set by check_entry: memory formats in which the CPU's own results are not its results for the
# same values in the contiguous sample (not compared; listed in the report and docs/determinism.md).
CPU_NOTE: list = []
# Set by check_entry: the memory formats (and transposed out=) compared for the entry.
FORMATS_RUN: list = []


def note_bits(actual, expected, what):
    """After a passing comparison of values: are they also equal bit for bit?"""
    actual_t, expected_t = tensors_of(actual), tensors_of(expected)
    for a, e in zip(actual_t, expected_t):
        if a is None or e is None or a.layout != torch.strided or e.layout != torch.strided:
            continue
        try:
            same = same_bits(a.detach().cpu().resolve_neg(), e.detach().resolve_neg())
        except Exception:  # noqa: BLE001 - a dtype the comparison cannot handle
            continue
        if not same:
            if not BITS_NOTE:
                BITS_NOTE.append(f"{what}: bits differ")
            return


def compare(actual, expected, device, values=True, cpu_allowed=False):
    """Raises AssertionError unless `actual` (computed on `device`) matches `expected` (CPU).
    cpu_allowed: the sample asked for a CPU result itself (e.g. `torch.ones_like(x, device="cpu")`)."""
    dev = torch.device(device)
    for t in tensors_of(actual):
        assert t.device == dev or (cpu_allowed and t.device.type == "cpu"), (
            f"result on {t.device}, expected {dev}")
    if not values:
        actual_t, expected_t = tensors_of(actual), tensors_of(expected)
        assert len(actual_t) == len(expected_t), "different number of result tensors"
        for a, e in zip(actual_t, expected_t):
            assert (a.shape, a.dtype) == (e.shape, e.dtype), (
                f"result {a.shape} {a.dtype}, CPU {e.shape} {e.dtype}")
        compare_layouts(actual, expected)
        return
    compare_layouts(actual, expected)
    on_cpu = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, actual)
    if isinstance(expected, (torch.Tensor, list, tuple, dict, int, float, complex, bool)):
        torch.testing.assert_close(on_cpu, expected, equal_nan=True, check_device=False)
    else:
        assert on_cpu == expected, f"{on_cpu!r} != {expected!r}"


def layout(t):
    """What must equal the CPU's besides the values: sizes, strides, storage offset."""
    if t.layout != torch.strided:
        return (tuple(t.shape),)
    return tuple(t.shape), t.stride(), t.storage_offset()


def compare_layouts(actual, expected):
    for i, (a, e) in enumerate(zip(tensors_of(actual), tensors_of(expected))):
        assert layout(a) == layout(e), (
            f"result {i}: sizes, strides, offset {layout(a)}, the CPU's {layout(e)}")


# [docs:start CONFORMANCE_LAYOUTS]
# The first sample of each main-dtype entry also runs in each of these memory formats (the same
# values, or, for "expanded", values broadcast along the last dimension, on both devices): every
# result's sizes, strides and storage offset must be the CPU's. A format that changes none of the
# sample's tensors is skipped.
def _channels_last(t):
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t


def _transposed(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t


def _expanded(t):
    return t[..., :1].expand(t.shape) if t.dim() >= 1 and t.shape[-1] > 1 else t


def _sliced(t):
    """Every second element of a larger buffer, from its second element on."""
    if t.numel() == 0:
        return t
    base = torch.empty(2 * t.numel() + 1, dtype=t.dtype, device=t.device)
    return base[1::2].view(t.shape).copy_(t)


MEMORY_FORMATS = {"channels_last": _channels_last, "transposed": _transposed,
                  "expanded": _expanded, "sliced": _sliced}
# [docs:end CONFORMANCE_LAYOUTS]


def in_memory_format(sample, fmt):
    """`sample` with its dense tensors in memory format `fmt`, or None if it changes none."""
    changed = []

    def convert(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_conj() or t.is_neg():
            return t
        new = MEMORY_FORMATS[fmt](t.detach())
        if new is not t and layout(new) != layout(t):
            changed.append(t)
            return new.requires_grad_(t.requires_grad) if t.requires_grad else new
        return t
    converted = SampleInputLike(tree_map(convert, sample.input), tree_map(convert, sample.args),
                                tree_map(convert, sample.kwargs))
    return converted if changed else None


# ---- the conformance loop (runs in a subprocess) ----

def entry_name(op, dtype):
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    return f"{name}:{str(dtype).removeprefix('torch.')}"


def run_variant(fn, sample, inplace=False, out=None, device=None):
    """Runs `fn` on a copy of `sample`; returns the result and the tensors it was given."""
    inp, args, kwargs = clone_tree(sample.input), clone_tree(sample.args), clone_tree(sample.kwargs)
    if out is not None:
        kwargs = dict(kwargs, out=out(device))
    result = fn(inp, *args, **kwargs)
    if inplace:
        assert result is inp, "the in-place variant did not return its input"
    return result, tensors_of([inp, list(args), kwargs])


def storage_of(t):
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return 0


def aliases(result, inputs):
    """For each result tensor: the index of the input whose memory it shares, or None."""
    ptrs = [storage_of(t) for t in inputs]
    out = []
    for r in tensors_of(result):
        p = storage_of(r)
        out.append(ptrs.index(p) if p and p in ptrs else None)
    return out


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


def transposed_outs_like(result):
    """out= arguments with the result's sizes and dtypes, transposed in memory; None if no result
    has two dimensions."""
    results = [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(
        result, tuple) and all(isinstance(t, torch.Tensor) for t in result) else []
    if not results or not any(t.dim() >= 2 for t in results):
        return None

    def make(device):
        # zeros, not empty: a CPU kernel that ignores such an out (gelu) leaves the same values
        outs = [_transposed(torch.zeros(t.shape, dtype=t.dtype, device=device)) for t in results]
        return outs[0] if isinstance(result, torch.Tensor) else tuple(outs)
    return make


def small(sample):
    return all(t.numel() <= MAX_NUMEL
               for t in tensors_of([sample.input, list(sample.args), sample.kwargs]))


def first_line(e):
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def check_entry(op, dtype, device, full=True):
    """('pass' | 'fail' | 'cpu-only', detail, number of comparisons). Not `full`: EXTRA_SAMPLES
    samples, the function variant only."""
    max_samples = MAX_SAMPLES if full else EXTRA_SAMPLES

    def samples_for(dev):
        torch.manual_seed(0)
        return [s for s in itertools.islice(op.sample_inputs(dev, dtype), 4 * max_samples)
                if small(s)][:max_samples]
    # Samples are generated for the device (as PyTorch's device tests do) and the CPU reference
    # gets the same values moved to the CPU.
    try:
        samples = samples_for(device)
    except Exception as e:
        try:
            samples_for("cpu")
        except Exception:
            return "cpu-only", "no samples on the CPU either", 0
        return "fail", f"sample generation on {device}: {first_line(e)}", 0
    formats = []
    if samples and full:
        # The first sample once more with non-contiguous tensors (strided CPU aliases).
        try:
            samples.append(samples[0].noncontiguous())
        except Exception:
            pass
        # And in each memory format (function variant only).
        for fmt in MEMORY_FORMATS:
            converted = in_memory_format(samples[0], fmt)
            if converted is not None:
                formats.append((fmt, converted))
    compared = 0
    first_expected = None
    for i, (fmt, sample) in enumerate([(None, s) for s in samples] + formats):
        if fmt is not None:
            i = -1  # a memory format: the function variant only
        cpu_sample = SampleInputLike(to_cpu(sample.input), to_cpu(sample.args),
                                     to_cpu(sample.kwargs))
        variants = [("function" if fmt is None else f"function ({fmt})", op.op, {})]
        if full and i == 0 and op.inplace_variant is not None:
            variants.append(("in-place", op.inplace_variant, {"inplace": True}))
        for label, fn, kw in variants:
            torch.manual_seed(0)
            state = torch.get_rng_state()
            try:
                expected, cpu_inputs = run_variant(fn, cpu_sample, **kw)
            except Exception:
                continue  # the CPU rejects this sample/variant: not counted
            values = op.name not in UNSPECIFIED_VALUES and not random_op(op) and torch.equal(
                state, torch.get_rng_state())
            if i == 0 and label == "function":
                first_expected = expected
            elif (fmt not in (None, "expanded") and values and first_expected is not None
                  and op.name not in LAYOUT_DEPENDENT_VALUES):
                # The same values in another layout: a CPU kernel that computes something else
                # there (reads it as if contiguous) is the CPU's bug, not a reference.
                try:
                    torch.testing.assert_close(expected, first_expected, equal_nan=True)
                except Exception:
                    CPU_NOTE.append(f"the CPU's results differ in {fmt}")
                    continue
            todo = [(label, kw, expected, cpu_inputs)]
            if full and i == 0 and label == "function" and op.supports_out:
                # An empty out= (resized by the kernel), and one of the right sizes in another
                # layout (transposed), which the kernel writes through or restrides as the CPU's.
                for what, out in (("out=", empty_outs_like(expected)),
                                  ("out= (transposed)", transposed_outs_like(expected))):
                    if out is None:
                        continue
                    try:
                        torch.manual_seed(0)
                        todo.append((what, {"out": out, "device": device},
                                     *run_variant(fn, cpu_sample, out=out, device="cpu")))
                    except Exception:
                        pass
            for what, kw2, exp, exp_inputs in todo:
                try:
                    torch.manual_seed(0)
                    actual, inputs = run_variant(fn, sample, **kw2)
                    compare(actual, exp, device, values, asks_for_cpu(sample))
                    if values:
                        note_bits(actual, exp, f"{what} on {device}")
                    assert aliases(actual, inputs) == aliases(exp, exp_inputs), (
                        "results share memory with the inputs differently from the CPU's: "
                        f"{aliases(actual, inputs)} vs {aliases(exp, exp_inputs)}")
                except Exception as e:
                    return "fail", f"{what} on {device}: {first_line(e)}", compared
                compared += 1
                if fmt is not None or what == "out= (transposed)":
                    FORMATS_RUN.append(fmt or "out= (transposed)")
    if compared == 0:
        return "cpu-only", "no sample runs on the CPU", 0
    return "pass", "", compared


def check_error_inputs(op, device):
    """op.error_inputs(device): each must raise on openreg the documented type, with the CPU's
    exact message (which matches the documented regex where the CPU's does)."""
    import re
    try:
        torch.manual_seed(0)
        errors = list(itertools.islice(op.error_inputs(device), MAX_ERROR_INPUTS))
    except Exception as e:
        return "fail", f"error_inputs on {device}: {first_line(e)}", 0
    compared = 0
    for ei in errors:
        sample = ei.sample_input
        cpu_sample = SampleInputLike(to_cpu(sample.input), to_cpu(sample.args),
                                     to_cpu(sample.kwargs))
        try:
            op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs)
            continue  # the CPU accepts it (a CUDA-only error input): not counted
        except Exception as e:
            cpu_error = e
        if not isinstance(cpu_error, ei.error_type):
            continue  # documented for another device
        # A message naming devices differs by design (the error input mixes devices).
        names_devices = re.search(r"\b(cpu|meta|cuda|openreg)\b", str(cpu_error)) is not None
        try:
            op(sample.input, *sample.args, **sample.kwargs)
        except Exception as e:
            if type(e) is not type(cpu_error) or (str(e) != str(cpu_error) and not names_devices):
                return "fail", (f"error input on {device}: {first_line(e)}; the CPU raises "
                                f"{first_line(cpu_error)}"), compared
            if re.search(ei.error_regex, str(cpu_error)) and not re.search(ei.error_regex, str(e)):
                return "fail", f"error input on {device}: message does not match {ei.error_regex!r}", compared
            compared += 1
            continue
        return "fail", (f"error input on {device}: accepted; the CPU raises "
                        f"{first_line(cpu_error)}"), compared
    if compared == 0:
        return "cpu-only", "no error input fails on the CPU", 0
    return "pass", "", compared


def check_gradients(op, device):
    """float64 gradients of the first sample (sum of the floating results) equal the CPU's."""
    dtype = torch.float64
    torch.manual_seed(0)
    samples = [s for s in itertools.islice(op.sample_inputs(device, dtype, requires_grad=True), 8)
               if small(s)][:1]
    for sample in samples:
        cpu_sample = SampleInputLike(*(tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
            x) for x in (to_cpu(sample.input), to_cpu(sample.args), to_cpu(sample.kwargs))))
        # to_cpu detaches: mark the CPU copies of the tensors that require grad on the device.
        dev_leaves = [t for t in tensors_of([sample.input, list(sample.args), sample.kwargs])
                      if t.requires_grad]
        cpu_all = tensors_of([cpu_sample.input, list(cpu_sample.args), cpu_sample.kwargs])
        dev_all = tensors_of([sample.input, list(sample.args), sample.kwargs])
        cpu_leaves = [c.requires_grad_() for c, d in zip(cpu_all, dev_all) if d.requires_grad]
        if not dev_leaves:
            return "cpu-only", "no input requires grad", 0

        def grads(s, leaves):
            torch.manual_seed(0)
            out = [t for t in tensors_of(op(s.input, *s.args, **s.kwargs))
                   if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)]
            if not out:
                return None
            total = sum((t.abs() if t.is_complex() else t).sum() for t in out)
            return torch.autograd.grad(total, leaves, allow_unused=True)
        try:
            expected = grads(cpu_sample, cpu_leaves)
        except Exception:
            return "cpu-only", "the CPU's backward fails", 0
        if expected is None:
            return "cpu-only", "no differentiable result", 0
        try:
            actual = grads(sample, dev_leaves)
            assert actual is not None, "no differentiable result on openreg"
            for a, e in zip(actual, expected):
                assert (a is None) == (e is None), "a gradient is missing on one side"
                if a is not None:
                    assert a.device == torch.device(device), f"gradient on {a.device}"
                    torch.testing.assert_close(a.cpu(), e, equal_nan=True)
                    assert layout(a) == layout(e), (
                        f"gradient: sizes, strides, offset {layout(a)}, the CPU's {layout(e)}")
                    note_bits(a, e, f"float64 gradient on {device}")
        except Exception as e:
            return "fail", f"float64 gradient on {device}: {first_line(e)}", 0
        return "pass", "", 1
    return "cpu-only", "no sample", 0


def asks_for_cpu(sample):
    """The sample function passed a CPU device itself (a cross-device `*_like` or `new_*`)."""
    found = []

    def visit(x):
        if isinstance(x, (torch.device, str)) and str(x).startswith("cpu"):
            found.append(x)
    for x in [sample.input, *sample.args, *sample.kwargs.values()]:
        visit(x)
    return bool(found)


def random_op(op):
    """Random: the OpInfo wraps it in wrapper_set_seed (it reseeds inside and restores the
    generator after, so the CPU's state does not show it). Operators that draw from the CPU
    generator without the wrapper are caught by the generator state changing."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


class SampleInputLike:
    def __init__(self, input, args, kwargs):
        self.input, self.args, self.kwargs = input, args, kwargs


def run_all(progress_path=None, names=None):
    from torch.testing._internal.common_methods_invocations import op_db

    results = {}
    start = time.perf_counter()
    n = 0
    for op in op_db:
        entries = [(dtype, "values") for dtype in sorted(op.supported_dtypes("cpu"), key=str)]
        entries += [(None, "errors"), (torch.float64, "grad")]
        for dtype, kind in entries:
            if kind == "errors" and op.error_inputs_func is None:
                continue
            if kind == "grad" and (not op.supports_autograd or random_op(op) or
                                   torch.float64 not in op.supported_dtypes("cpu") or
                                   op.name in UNSPECIFIED_VALUES):
                continue
            name = (entry_name(op, dtype) if kind == "values" else
                    entry_name(op, torch.float32).rsplit(":", 1)[0] + f":{kind}")
            if names is not None and name not in names:
                continue
            device = f"openreg:{n % 2}"  # entries alternate between the two devices
            n += 1
            if progress_path:  # a crash leaves the name of the entry that crashed here
                with open(progress_path, "w") as f:
                    f.write(name)
            t0 = time.perf_counter()
            BITS_NOTE.clear()
            CPU_NOTE.clear()
            FORMATS_RUN.clear()
            try:
                if kind == "errors":
                    status, detail, count = check_error_inputs(op, device)
                elif kind == "grad":
                    status, detail, count = check_gradients(op, device)
                else:
                    status, detail, count = check_entry(op, dtype, device, full=dtype in DTYPES)
            except Exception as e:
                status, detail, count = "fail", f"harness: {first_line(e)}", 0
            results[name] = {"status": status, "detail": detail, "samples": count,
                             "device": device, "seconds": round(time.perf_counter() - t0, 4)}
            if status == "pass" and BITS_NOTE:
                results[name]["bits"] = BITS_NOTE[0]
            if CPU_NOTE:
                results[name]["cpu"] = CPU_NOTE[0]
            if FORMATS_RUN:
                results[name]["formats"] = sorted(set(FORMATS_RUN))
    return results, time.perf_counter() - start


def print_report(results, file=sys.stdout):
    for name, r in sorted(results.items()):
        listed = " (listed)" if name in KNOWN_FAILURES else ""
        print(f"{r['status']:8} {name}{listed} {r['detail']}", file=file)
        if "cpu" in r:
            print(f"{'':8} {name}: {r['cpu']} (not compared)", file=file)
    counted = [r for r in results.values() if r["status"] != "cpu-only"]
    passed = sum(r["status"] == "pass" for r in counted)
    print(f"{passed}/{len(counted)} entries pass ({len(results) - len(counted)} do not run on the "
          "CPU)", file=file)
    formats = {}
    for r in results.values():
        for f in r.get("formats", ()):
            formats[f] = formats.get(f, 0) + 1
    print(f"layouts compared in other memory formats: {sum('formats' in r for r in results.values())}"
          f" entries ({', '.join(f'{k} {v}' for k, v in sorted(formats.items()))})", file=file)


# ---- the tests ----

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    progress = tmp_path_factory.mktemp("conformance") / "progress"
    # One OpenMP thread: backward on the CPU then runs with the count of openreg's autograd device
    # thread, and the results can be compared bit for bit (docs/determinism.md).
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"], capture_output=True,
                       text=True, timeout=900, cwd=ROOT,
                       env=dict(os.environ, OPENREG_CONFORMANCE_PROGRESS=str(progress),
                                OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        last = progress.read_text() if progress.exists() else "?"
        pytest.fail(f"the conformance run died (exit code {r.returncode}) while running {last}:\n"
                    f"{r.stderr[-3000:]}")
    data = json.loads(r.stdout)
    if os.environ.get("OPENREG_CONFORMANCE_REPORT"):
        print()
        print_report(data["results"])
        print(f"{data['seconds']:.1f} s in the conformance loop")
    return data["results"]


def test_pass_rate(conformance):
    counted = {k: v for k, v in conformance.items() if v["status"] != "cpu-only"}
    passed = [k for k, v in counted.items() if v["status"] == "pass"]
    ops = {k.rsplit(":", 1)[0] for k in counted}
    ops_passed = ops - {k.rsplit(":", 1)[0] for k, v in counted.items() if v["status"] != "pass"}
    assert len(counted) > 1000, f"only {len(counted)} op/dtype entries ran: is op_db complete?"
    rate = len(passed) / len(counted)
    print(f"\n{len(passed)}/{len(counted)} op/dtype entries pass ({rate:.1%}); "
          f"{len(ops_passed)}/{len(ops)} ops pass for every dtype")
    assert rate >= REQUIRED_PASS_RATE, f"pass rate {rate:.1%} < {REQUIRED_PASS_RATE:.0%}"


def test_every_failure_is_listed(conformance):
    unexpected = {k: v["detail"] for k, v in conformance.items()
                  if v["status"] == "fail" and k not in KNOWN_FAILURES}
    assert not unexpected, "entries failing on openreg:\n" + "\n".join(
        f"  {k}: {d}" for k, d in sorted(unexpected.items()))


def test_listed_failures_still_fail(conformance):
    """Strict expected failures: fix an entry, then remove it from KNOWN_FAILURES."""
    now_passing = [k for k in KNOWN_FAILURES if conformance.get(k, {}).get("status") != "fail"]
    assert not now_passing, f"listed in KNOWN_FAILURES but not failing (remove them): {now_passing}"


def test_results_are_the_cpus_bit_for_bit(conformance):
    differing = {k: v["bits"] for k, v in conformance.items() if "bits" in v}
    unexpected = {k: v for k, v in differing.items() if k not in BITWISE_DIFFERENCES}
    assert not unexpected, "entries close to the CPU's results but not equal bit for bit:\n" + \
        "\n".join(f"  {k}: {d}" for k, d in sorted(unexpected.items()))
    now_equal = [k for k in BITWISE_DIFFERENCES if conformance.get(k, {}).get("status") == "pass"
                 and k not in differing]
    assert not now_equal, f"listed in BITWISE_DIFFERENCES but equal bit for bit: {now_equal}"
    compared = sum(v["status"] == "pass" for v in conformance.values())
    print(f"\n{compared - len(differing)}/{compared} passing entries equal bit for bit")


def test_cpu_layout_bugs_are_listed(conformance):
    noted = {k: v["cpu"] for k, v in conformance.items() if "cpu" in v}
    unexpected = {k: v for k, v in noted.items() if k not in CPU_LAYOUT_BUGS}
    assert not unexpected, "the CPU's results change with the layout of the same values:\n" + \
        "\n".join(f"  {k}: {d}" for k, d in sorted(unexpected.items()))
    # An entry whose OpInfo the installed torch does not have (torch 2.13 has none for
    # _scaled_dot_product_flash_attention_for_cpu) cannot show the bug; one that ran must.
    gone = [k for k in CPU_LAYOUT_BUGS if k in conformance and k not in noted]
    assert not gone, f"listed in CPU_LAYOUT_BUGS but consistent now: {gone}"


def test_bit_differences_are_detected():
    assert same_bits(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0]).nextafter(torch.tensor(2.0)))
    BITS_NOTE.clear()
    note_bits(torch.tensor([1.0 + 1e-7]), torch.tensor([1.0]), "function")
    assert BITS_NOTE == ["function: bits differ"]
    BITS_NOTE.clear()


def test_listed_failures_fail_with_a_clear_message(conformance):
    for name, (_, fragment) in KNOWN_FAILURES.items():
        assert fragment in conformance[name]["detail"], (name, conformance[name]["detail"])


# ---- self-tests: the comparison can fail ----

class FakeOp:
    """The part of an OpInfo that check_entry uses, around a function of our own."""
    variant_test_name = ""
    supports_out = False

    def __init__(self, fn, inplace=None, make=lambda dev: [torch.arange(6.0, device=dev)],
                 name="fake"):
        self.op, self.inplace_variant, self.make, self.name = fn, inplace, make, name

    def sample_inputs(self, device, dtype):
        return [SampleInputLike(t, (), {}) for t in self.make(device)]


def on_device(x):
    return x.device.type == "openreg"


@pytest.mark.parametrize("device", ["openreg:0", "openreg:1"])
def test_a_correct_op_passes(device):
    assert check_entry(FakeOp(lambda x: x * 2), torch.float32, device)[0] == "pass"


def test_wrong_values_are_detected():
    status, detail, _ = check_entry(FakeOp(lambda x: x * 2 + on_device(x)), torch.float32,
                                    "openreg:0")
    assert status == "fail" and "not close" in detail


def test_a_result_left_on_the_cpu_is_detected():
    status, detail, _ = check_entry(FakeOp(lambda x: (x * 2).cpu()), torch.float32, "openreg:1")
    assert status == "fail" and "result on cpu, expected openreg:1" in detail


def test_a_wrong_dtype_is_detected():
    status, detail, _ = check_entry(FakeOp(lambda x: x.double() if on_device(x) else x),
                                    torch.float32, "openreg:0")
    assert status == "fail" and "dtype" in detail


def test_an_in_place_variant_that_does_not_return_its_input_is_detected():
    op = FakeOp(lambda x: x + 1, inplace=lambda x: x.add_(1) if not on_device(x) else x + 1)
    status, detail, _ = check_entry(op, torch.float32, "openreg:0")
    assert status == "fail" and "did not return its input" in detail


def test_a_lost_view_is_detected():
    op = FakeOp(lambda x: x.clone().view(2, 3) if on_device(x) else x.view(2, 3))
    status, detail, _ = check_entry(op, torch.float32, "openreg:0")
    assert status == "fail" and "share memory" in detail


def test_a_different_layout_is_detected():
    # The same values in other strides (a fresh result, so no view relation differs).
    op = FakeOp(lambda x: (x * 2).view(2, 3).t().contiguous() if on_device(x) else
                (x * 2).view(2, 3).t())
    status, detail, _ = check_entry(op, torch.float32, "openreg:0")
    assert status == "fail" and "strides" in detail and "(1, 3)" in detail


def test_a_layout_lost_in_one_memory_format_is_detected():
    # Right for contiguous inputs, but a channels-last input's result comes back contiguous.
    op = FakeOp(lambda x: (x * 2).contiguous() if on_device(x) else x * 2,
                make=lambda dev: [torch.arange(24.0, device=dev).view(1, 2, 3, 4)])
    status, detail, _ = check_entry(op, torch.float32, "openreg:1")
    assert status == "fail" and "function (channels_last)" in detail, detail
    for fmt, expected in [("channels_last", (24, 1, 8, 2)), ("transposed", (24, 12, 1, 3)),
                          ("sliced", (48, 24, 8, 2))]:
        t = in_memory_format(SampleInputLike(torch.ones(1, 2, 3, 4), (), {}), fmt).input
        assert t.stride() == expected and torch.equal(t, torch.ones(1, 2, 3, 4)), fmt
    assert in_memory_format(SampleInputLike(torch.ones(5), (), {}), "channels_last") is None


def test_random_ops_are_compared_by_structure():
    assert check_entry(FakeOp(torch.rand_like), torch.float32, "openreg:0")[0] == "pass"
    wrong_shape = FakeOp(lambda x: torch.rand_like(x[1:] if on_device(x) else x))
    status, detail, _ = check_entry(wrong_shape, torch.float32, "openreg:0")
    assert status == "fail" and "result torch.Size([5])" in detail


class FakeErrorInput:
    def __init__(self, sample, error_type, error_regex):
        self.sample_input, self.error_type, self.error_regex = sample, error_type, error_regex


def test_error_inputs_must_raise_the_cpus_type_and_message():
    def op_raising(message_on_device, type_on_device=RuntimeError):
        def fn(x):
            if on_device(x):
                if message_on_device is not None:
                    raise type_on_device(message_on_device)
                return x
            raise RuntimeError("bad input")
        op = FakeOp(fn)
        op.error_inputs = lambda dev: [FakeErrorInput(
            SampleInputLike(torch.ones(2, device=dev), (), {}), RuntimeError, "bad")]
        op.__call__ = fn
        return op
    for message, kind, expected in [("bad input", RuntimeError, "pass"),
                                    ("bad input (on openreg)", RuntimeError, "fail"),
                                    ("bad input", ValueError, "fail"),
                                    (None, RuntimeError, "fail")]:
        op = op_raising(message, kind)
        status, detail, _ = check_error_inputs(_Callable(op), "openreg:0")
        assert status == expected, (message, kind, detail)


class _Callable:
    """FakeOp made callable like an OpInfo (op(...) calls op.op)."""
    def __init__(self, op):
        self._op = op

    def __getattr__(self, name):
        return getattr(self._op, name)

    def __call__(self, *args, **kwargs):
        return self._op.op(*args, **kwargs)


def test_wrong_gradients_are_detected():
    class GradOp(FakeOp):
        def sample_inputs(self, device, dtype, requires_grad=False):
            return [SampleInputLike(torch.arange(1.0, 4.0, dtype=dtype, device=device)
                                    .requires_grad_(requires_grad), (), {})]
    good = _Callable(GradOp(lambda x: x.sin()))
    assert check_gradients(good, "openreg:1")[0] == "pass"
    # Right values, wrong gradient on the device only.
    wrong = _Callable(GradOp(lambda x: x.sin() if not on_device(x) else
                             x.detach().sin() + (x - x.detach()) * 2))
    status, detail, _ = check_gradients(wrong, "openreg:1")
    assert status == "fail" and "gradient" in detail


def test_ops_the_cpu_rejects_are_not_counted():
    def cpu_rejects(x):
        if not on_device(x):
            raise RuntimeError("no")
        return x
    assert check_entry(FakeOp(cpu_rejects), torch.float32, "openreg:0")[0] == "cpu-only"


def test_a_result_on_the_cpu_is_accepted_only_when_the_sample_asks_for_it():
    asks = FakeOp(lambda x, device=None: torch.ones_like(x, device=device),
                  make=lambda dev: [torch.arange(3.0, device=dev)])
    asks.sample_inputs = lambda dev, dtype: [
        SampleInputLike(torch.arange(3.0, device=dev), (), {"device": "cpu"})]
    assert check_entry(asks, torch.float32, "openreg:1")[0] == "pass"


def test_samples_keep_the_cpu_tensors_a_sample_function_put_on_the_cpu():
    sample = SampleInputLike(torch.ones(2, device="openreg:1"), (torch.tensor([1]),),
                             {"device": torch.device("openreg:1")})
    cpu = to_cpu([sample.input, sample.args, sample.kwargs])
    assert cpu[0].device.type == "cpu" and cpu[1][0] is not None
    assert cpu[2]["device"] == torch.device("cpu")
    assert to_cpu(("openreg:0", 3)) == ("cpu", 3)


if __name__ == "__main__":
    progress = os.environ.get("OPENREG_CONFORMANCE_PROGRESS")
    only = os.environ.get("OPENREG_CONFORMANCE_ONLY")
    results, seconds = run_all(progress, set(only.split(",")) if only else None)
    if "--json" in sys.argv:
        json.dump({"results": results, "seconds": seconds}, sys.stdout)
    else:
        print_report(results)
        print(f"{seconds:.1f} s")
