"""Differential fuzzer: random programs of operators run on the CPU and on openreg, compared.

Each program is a list of Python statements over variables ``v0, v1, ...``. The statements run
one by one, in lockstep, in two namespaces: one where the device ``D`` is ``"cpu"`` and one where
it is ``"openreg:0"`` (``D1``, the peer device, is ``"openreg:1"``). After each statement:

- an error must be raised on both sides or on neither, with the same exception type;
- every tensor it produced is compared: dtype, shape, values (NaN-aware), strides, storage offset,
  and which live variables it shares memory with (view relations);
- after an in-place statement (or ``out=``), every live tensor of the program is compared, so an
  alias that missed a write is caught.

Statements draw from: dtypes float16, bfloat16, float32/64, complex64, int8 to int64, uint8, bool;
shapes including empty and 0-dim; views of a shared base (transposed, sliced with steps, expanded,
``as_strided``, diagonals); in-place operators on views and ``out=``; advanced indexing,
``index_put_``/``scatter_`` with duplicate indices (accumulating, so the result is deterministic);
reductions, matmul and casts; 0-dim CPU tensors mixed in; copies to the peer device and through
pinned memory with ``non_blocking``; work on a side stream; autograd, with gradients compared.
The generator reads the CPU side's tensors to pick mostly valid arguments, so most statements run.

Every disagreement prints a standalone reproduction (a script that runs the program on both
devices). ``median``/``nanmedian`` only ever see contiguous inputs: torch 2.13's own CPU kernels
read uninitialised memory on expanded inputs (DESIGN.md, pitfall 22).

    python tools/fuzz.py --seeds 0:200            # a seed range (make fuzz runs a long one)
    python tools/fuzz.py --seed 17 --show         # print one program

Bitwise modes (docs/determinism.md), with programs that also train (a linear or convolution
layer, backward, an optimizer step: SGD, Adam, AdamW, foreach or fused), attention and
normalisation layers, and reductions large enough to be split over OpenMP threads:

    python tools/fuzz.py --bitwise --seeds 0:100  # CPU and openreg bit for bit, at
                                                  # OMP_NUM_THREADS=1 (re-runs itself so)
    python tools/fuzz.py --modes --seeds 0:100    # openreg against itself at default threads:
                                                  # the default mode, OPENREG_ASYNC=1,
                                                  # OPENREG_SANITIZE=1, OPENREG_STRICT_MEMORY=1,
                                                  # each in a process of its own, bit for bit
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

DEVICE, PEER = "openreg:0", "openreg:1"

# The helpers every program (and every reproduction) starts with.
PRELUDE = '''
import contextlib
import torch

def mk(shape, dtype, seed, special=False):
    """The same values on every device: made on the CPU from a seed, then moved."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=g, dtype=torch.float64).mul_(3)
        if dtype.is_complex:
            t = torch.complex(t, torch.randn(shape, generator=g, dtype=torch.float64))
        if special and t.numel() > 2:
            t.view(-1)[0], t.view(-1)[1] = float("nan"), float("inf")
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low = 0 if dtype == torch.uint8 else -5
    return torch.randint(low, 6, shape, generator=g).to(dtype)

def on(t, D):
    return t.to(D)

def sync(D):
    if D != "cpu":
        torch.openreg.synchronize()

def via_pinned(t, D):
    """Device -> pinned host -> device, both copies non_blocking."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=D != "cpu")
    host.copy_(t, non_blocking=True)
    sync(D)
    back = host.to(D, non_blocking=True)
    sync(D)
    return back

@contextlib.contextmanager
def side_stream(D):
    """Work on a side stream, ordered after and before the current one, as CUDA code does."""
    if D == "cpu":
        yield
        return
    s = torch.openreg.Stream()
    s.wait_stream(torch.openreg.current_stream())
    with torch.openreg.stream(s):
        yield
    torch.openreg.current_stream().wait_stream(s)

def grad_of(f, t):
    w = t.detach().clone().requires_grad_()
    out = f(w)
    (g,) = torch.autograd.grad(out.abs().sum() if out.is_complex() else out.sum(), w)
    return g

def train(make, optimizer, x, seed, steps=2, memory_format=None):
    """A few training steps of a layer made (on the CPU) from a seed: the same weights on every
    device; the trained weights, their gradients and the input's gradient, in one vector."""
    torch.manual_seed(seed)
    m = make().to(x.device)
    if memory_format is not None:
        m = m.to(memory_format=memory_format)
        x = x.contiguous(memory_format=memory_format)
    opt = optimizer(m.parameters())
    x = x.detach().requires_grad_()
    for _ in range(steps):
        opt.zero_grad()
        out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().mean().backward()
        opt.step()
    flat = [p.detach().reshape(-1) for p in m.parameters()]
    flat += [p.grad.reshape(-1) for p in m.parameters() if p.grad is not None]
    return torch.cat(flat + [x.grad.reshape(-1), out.detach().reshape(-1)])

def grads_of(f, *ts):
    """f's result and the gradients of its sum with respect to each of ts (kept in their
    layout: their strides are compared too)."""
    ws = [t.detach().clone().requires_grad_() for t in ts]
    out = f(*ws)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [w.grad for w in ws]
'''

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
DTYPES = FLOATS + [torch.complex64] + INTS + [torch.bool]
SHAPES = [(), (0,), (1,), (5,), (3, 4), (2, 3, 4), (4, 1), (1, 4), (0, 3), (2, 0, 3), (6, 6),
          (3, 1, 5)]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt)  # "torch.float32"


@dataclass
class Result:
    programs: int = 0
    statements: int = 0
    errors_both: int = 0
    operators: set = field(default_factory=set)
    disagreements: list = field(default_factory=list)


class Disagreement(Exception):
    pass


# --bitwise: results must be equal bit for bit (NaNs of any payload aside), not close.
BITWISE = False
# Torch 2.13's derivative of native_group_norm makes a channels-last input contiguous on every
# device but the CPU (docs/determinism.md): its GroupNorm gradients round otherwise there, so the
# programs give GroupNorm channels-last inputs only where torch keeps the layout (the one entry of
# that difference is in tests/torch_behaviour.py; measured 2026-12-03 with them in every release:
# seeds 0:3000 --bitwise on 2.14.1 gave 0 disagreements, seeds 0:400 on 2.13.0 gave several).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import torch_behaviour  # noqa: E402

GROUP_NORM_KEEPS_LAYOUT = torch_behaviour.GROUP_NORM_BACKWARD_KEEPS_CHANNELS_LAST
# --record: the openreg side's results are recorded (digests), not compared with the CPU's.
RECORD: list | None = None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their width (complex: real and imaginary parts)."""
    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ra = torch.view_as_real(a.resolve_conj()) if a.is_complex() else a
        rb = torch.view_as_real(b.resolve_conj()) if b.is_complex() else b
        nan = ra.isnan()
        if not torch.equal(nan, rb.isnan()):
            return False
        return torch.equal(as_bits(ra.masked_fill(nan, 0)), as_bits(rb.masked_fill(nan, 0)))
    return torch.equal(as_bits(a), as_bits(b))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
    fa, fb = a.reshape(-1), b.reshape(-1)
    for i in range(fa.numel()):
        if not same_bits(fa[i:i + 1], fb[i:i + 1]):
            diff = ""
            if a.dtype.is_floating_point:
                diff = f", {abs(float(fa[i]) - float(fb[i])):.3g} apart"
            return f"element {i}: openreg {fa[i].item()!r}, cpu {fb[i].item()!r}{diff}"
    return "?"


def digest(t: torch.Tensor) -> str:
    """What --modes compares: dtype, shape, strides, offset and the bits."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((t.dtype, tuple(t.shape), t.stride(), t.storage_offset())).encode())
    h.update(as_bits(t).numpy().tobytes())
    return h.hexdigest()


def describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} strides {t.stride()} offset {t.storage_offset()}"


def compare_tensor(name: str, c: torch.Tensor, o: torch.Tensor) -> str | None:
    if o.device.type != "openreg" and c.device.type == "cpu" and name != "host":
        if o.device.type != "cpu":
            return f"{name}: on {o.device}, expected openreg"
    if c.dtype != o.dtype:
        return f"{name}: dtype {o.dtype} on openreg, {c.dtype} on the CPU"
    if c.shape != o.shape:
        return f"{name}: shape {tuple(o.shape)} on openreg, {tuple(c.shape)} on the CPU"
    if c.stride() != o.stride():
        return f"{name}: strides {o.stride()} on openreg, {c.stride()} on the CPU"
    if c.storage_offset() != o.storage_offset():
        return f"{name}: storage offset {o.storage_offset()} on openreg, {c.storage_offset()} on the CPU"
    if c.is_conj() != o.is_conj() or c.is_neg() != o.is_neg():
        return f"{name}: conj/neg bits differ"
    oc = o.detach().cpu()
    cc = c.detach()
    if cc.is_conj():
        cc = cc.resolve_conj()
    if oc.is_conj():
        oc = oc.resolve_conj()
    if cc.is_neg():
        cc = cc.resolve_neg()
    if oc.is_neg():
        oc = oc.resolve_neg()
    if BITWISE:
        return None if same_bits(oc, cc) else f"{name}: bits differ: {first_difference(oc, cc)}"
    try:
        if cc.dtype.is_floating_point or cc.dtype.is_complex:
            torch.testing.assert_close(oc, cc, equal_nan=True, rtol=1e-3 if cc.dtype in (
                torch.float16, torch.bfloat16) else 1e-5, atol=1e-5, check_stride=False)
        elif not torch.equal(oc, cc):
            return f"{name}: values differ:\n  openreg {oc}\n  cpu     {cc}"
    except AssertionError as e:
        return f"{name}: values differ: {str(e).splitlines()[0]}"
    return None


def storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


class Program:
    """Generates statements from the CPU side's state and runs them on both sides."""

    def __init__(self, seed: int, steps: int, result: Result, verbose=False):
        self.rng = random.Random(seed)
        self.seed = seed
        self.steps = steps
        self.result = result
        self.lines: list[str] = []
        self.envs = {}
        for side, (d, d1) in {"cpu": ("cpu", "cpu"), "openreg": (DEVICE, PEER)}.items():
            env = {"D": d, "D1": d1}
            exec(PRELUDE, env)
            self.envs[side] = env
        self.n = 0
        self.verbose = verbose

    # ---- state of the CPU side, for generation ----
    def tensors(self, pred=lambda t: True):
        env = self.envs["cpu"]
        return [k for k in sorted(env) if k.startswith("v") and k[1:].isdigit()
                and isinstance(env[k], torch.Tensor) and pred(env[k])]

    def t(self, name):
        return self.envs["cpu"][name]

    def new(self):
        self.n += 1
        return f"v{self.n - 1}"

    def pick(self, pred=lambda t: True):
        names = self.tensors(pred)
        return self.rng.choice(names) if names else None

    # ---- statement generators: each returns (statement, operator name, writes in place) ----
    def g_make(self):
        r = self.rng
        dt = r.choice(DTYPES)
        shape = r.choice(SHAPES)
        special = r.random() < 0.2
        return (f"{self.new()} = on(mk({shape}, {dtype_name(dt)}, {r.randrange(10**6)}, "
                f"{special}), D)", "make", False)

    def g_view(self):
        r = self.rng
        name = self.pick(lambda t: t.dim() >= 1)
        if name is None:
            return None
        t = self.t(name)
        n = t.dim()
        choices = [
            (f"{name}.t()" if n <= 2 else f"{name}.transpose(0, {n - 1})", "transpose"),
            (f"{name}[::{r.choice([2, 3])}]", "slice"),
            (f"{name}[1:]", "slice"),
            (f"{name}.unsqueeze(0).expand(2, *{name}.shape)", "expand"),
            (f"{name}.unsqueeze({r.randrange(n + 1)})", "unsqueeze"),
            (f"{name}.flip(0)", "flip"),
            (f"{name}.narrow(0, 0, {max(0, t.shape[0] - 1)})", "narrow"),
        ]
        if n >= 2:
            choices.append((f"{name}.diagonal({r.choice([0, 1, -1])})", "diagonal"))
            choices.append((f"{name}.permute({', '.join(map(str, reversed(range(n))))})", "permute"))
        if t.numel() >= 4:
            choices.append((f"{name}.as_strided((2, 2), (1, {r.choice([0, 1, 2])}), "
                            f"{r.randrange(max(1, t.numel() - 3))})", "as_strided"))
        if t.is_contiguous():
            choices.append((f"{name}.view(-1)", "view"))
        if t.dim() >= 1 and t.shape[0] > 0:
            choices.append((f"{name}.select(0, {r.randrange(t.shape[0])})", "select"))
        if t.is_complex():
            choices.append((f"{name}.conj()", "conj"))
            choices.append((f"{name}.real", "real"))
            choices.append((f"torch.view_as_real({name})", "view_as_real"))
        if t.dtype.is_floating_point and t.dtype != torch.bfloat16:
            choices.append((f"{name}.view(torch.int{t.element_size() * 8})", "view_dtype"))
        if t.dim() >= 1 and t.shape[-1] >= 2:
            choices.append((f"{name}.unfold(-1, 2, 1)", "unfold"))
        expr, op = r.choice(choices)
        return f"{self.new()} = {expr}", op, False

    UNARY = ["abs", "neg", "exp", "sin", "sqrt", "sigmoid", "floor", "sign", "tanh", "reciprocal",
             "bitwise_not", "logical_not", "isnan", "clone", "contiguous", "square", "log1p",
             "round", "trunc", "frac", "angle", "sgn", "nan_to_num", "relu", "erf"]
    BINARY = ["add", "sub", "mul", "div", "maximum", "minimum", "eq", "lt", "ge", "pow", "atan2",
              "remainder", "fmod", "bitwise_and", "bitwise_xor", "logical_or", "where_gt",
              "floor_divide", "hypot", "copysign", "lerp", "true_divide", "xlogy"]

    def g_unary(self):
        name = self.pick()
        if name is None:
            return None
        op = self.rng.choice(self.UNARY)
        expr = f"torch.{op}({name})" if op not in ("clone", "contiguous") else f"{name}.{op}()"
        if op == "relu":
            expr = f"torch.nn.functional.relu({name})"
        return f"{self.new()} = {expr}", op, False

    def other_operand(self, t):
        """A second operand broadcastable with t: another variable, a scalar or a 0-dim CPU tensor."""
        r = self.rng
        x = r.random()
        if x < 0.2:
            return repr(r.choice([2, -1, 0.5, 3.0, True, 0]))
        if x < 0.35:
            v = r.choice([2.5, -3, 1, 0])
            dt = r.choice(["torch.float32", "torch.int64", "torch.float64", "torch.bool"])
            return f"torch.tensor({v}, dtype={dt})"  # a 0-dim CPU tensor: a scalar on any device
        same = self.tensors(lambda u: u.shape == t.shape or u.dim() == 0 or (
            u.dim() <= t.dim() and all(a == b or a == 1 for a, b in zip(u.shape[::-1], t.shape[::-1]))))
        if same and r.random() < 0.85:
            return r.choice(same)
        return self.pick() or "1"

    def g_binary(self):
        a = self.pick()
        if a is None:
            return None
        b = self.other_operand(self.t(a))
        op = self.rng.choice(self.BINARY)
        if self.rng.random() < 0.5 and b.startswith("v"):
            # 0-dim CPU tensors stay second: as a first argument, composites such as logical_or
            # allocate their result on the CPU tensor's device and then refuse the mix (the CPU,
            # where everything is on the CPU, cannot be the reference for that case).
            a, b = b, a
        if op == "where_gt":
            return f"{self.new()} = torch.where({a} > 0, {a}, {b})", "where", False
        if op == "lerp":
            return f"{self.new()} = torch.lerp({a}, {b}, 0.3)", op, False
        return f"{self.new()} = torch.{op}({a}, {b})", op, False

    INPLACE = ["add_", "mul_", "sub_", "div_", "clamp_", "zero_", "fill_", "copy_", "neg_",
               "abs_", "masked_fill_", "exp_", "floor_divide_", "pow_", "lerp_"]

    def g_inplace(self):
        name = self.pick()
        if name is None:
            return None
        t = self.t(name)
        op = self.rng.choice(self.INPLACE)
        b = self.other_operand(t)
        if op == "clamp_":
            stmt = f"{name}.clamp_(min=-1, max=2)"
        elif op == "zero_" or op == "neg_" or op == "abs_" or op == "exp_":
            stmt = f"{name}.{op}()"
        elif op == "fill_":
            stmt = f"{name}.fill_({self.rng.choice(['1.5', '-2', 'True', 'torch.tensor(3)'])})"
        elif op == "masked_fill_":
            stmt = f"{name}.masked_fill_({name} != {name}, 7) if {name}.dtype != torch.bool else {name}.masked_fill_({name}, False)"
        elif op == "lerp_":
            stmt = f"{name}.lerp_({b}, 0.5)"
        else:
            stmt = f"{name}.{op}({b})"
        return stmt, op, True

    def g_out(self):
        a = self.pick()
        if a is None:
            return None
        out = self.pick()
        op = self.rng.choice(["add", "mul", "sin", "sum", "cumsum", "abs", "maximum"])
        if op in ("sin", "abs"):
            return f"torch.{op}({a}, out={out})", op + ".out", True
        if op == "sum":
            return f"torch.sum({a}, 0, out={out})", "sum.out", True
        if op == "cumsum":
            return f"torch.cumsum({a}, 0, out={out})", "cumsum.out", True
        return f"torch.{op}({a}, {self.other_operand(self.t(a))}, out={out})", op + ".out", True

    def g_index(self):
        r = self.rng
        name = self.pick(lambda t: t.dim() >= 1 and t.shape[0] > 0)
        if name is None:
            return None
        t = self.t(name)
        n0 = t.shape[0]
        idx = [r.randrange(n0) for _ in range(r.randint(1, 5))]  # duplicates likely
        dev = r.choice(["D", "'cpu'"])  # CPU indices are allowed with device tensors, as on CUDA
        i = f"torch.tensor({idx}, device={dev})"  # (for [] and index_put_ only)
        i_dev = f"torch.tensor({idx}, device=D)"
        kind = r.randrange(7)
        if kind == 0:
            return f"{self.new()} = {name}[{i}]", "index", False
        if kind == 1:
            return f"{self.new()} = {name}[{name} > 0]" if t.dtype != torch.bool else \
                f"{self.new()} = {name}[{name}]", "index_mask", False
        if kind == 2:
            vals = f"torch.ones((), dtype={name}.dtype, device=D)"
            return f"{name}.index_put_(({i},), {vals}, accumulate=True)", "index_put_", True
        if kind == 3:
            uniq = sorted(set(idx))
            return (f"{name}[torch.tensor({uniq}, device=D)] = {r.choice(['2', '0', '-1'])}",
                    "index_put_", True)
        if kind == 4:
            j = f"torch.tensor({idx}, device=D).view(-1, *([1] * ({name}.dim() - 1))).expand(-1, *{name}.shape[1:])"
            return (f"{name}.scatter_add_(0, {j}, torch.ones_like({name})[:{len(idx)}].expand({j}.shape).contiguous())"
                    if t.dim() >= 1 else "pass", "scatter_add_", True)
        if kind == 5:
            j = f"torch.tensor({idx}, device=D).view(-1, *([1] * ({name}.dim() - 1))).expand(-1, *{name}.shape[1:])"
            return f"{self.new()} = {name}.gather(0, {j})", "gather", False
        return f"{self.new()} = {name}.index_select(0, {i_dev})", "index_select", False

    REDUCTIONS = ["sum", "mean", "amax", "argmax", "prod", "std", "cumsum", "any", "all", "sort",
                  "topk", "median", "nanmedian", "logsumexp", "var_mean", "max", "min",
                  "count_nonzero", "norm", "unique"]

    def g_reduce(self):
        name = self.pick()
        if name is None:
            return None
        t = self.t(name)
        op = self.rng.choice(self.REDUCTIONS)
        dim = self.rng.randrange(-1, t.dim()) if t.dim() else None
        src = name
        if op in ("median", "nanmedian"):
            src = f"{name}.contiguous()"  # pitfall 22: torch's own CPU kernel on expanded inputs
        if op == "topk":
            k = min(2, t.shape[dim]) if dim is not None and t.dim() else 1
            return f"{self.new()} = {src}.topk({k}, {dim if dim is not None else 0})[0]", op, False
        if op == "unique":
            return f"{self.new()} = torch.unique({src}, sorted=True)", op, False
        if dim is None or self.rng.random() < 0.3:
            expr = f"torch.{op}({src})"
        elif op in ("sort", "max", "min", "median", "nanmedian", "var_mean"):
            expr = f"torch.{op}({src}, {dim})[0]"
        elif op == "logsumexp":
            expr = f"torch.logsumexp({src}, {dim})"
        elif op in ("sum", "mean", "amax", "prod", "std", "any", "all", "norm"):
            expr = f"torch.{op}({src}, {dim}, keepdim={self.rng.random() < 0.5})"
        else:
            expr = f"torch.{op}({src}, {dim})"
        if op == "var_mean" and dim is None:
            expr += "[0]"
        if op == "sort" and dim is None:
            expr += "[0]"
        return f"{self.new()} = {expr}", op, False

    def g_matmul(self):
        r = self.rng
        dt = r.choice([torch.float32, torch.float64, torch.complex64, torch.int64, torch.bfloat16])
        m, k, n = r.randint(0, 5), r.randint(0, 5), r.randint(1, 5)
        batch = r.choice([(), (2,), (1, 3)])
        a = f"on(mk({batch + (m, k)}, {dtype_name(dt)}, {r.randrange(10**6)}), D)"
        b = f"on(mk({(k, n)}, {dtype_name(dt)}, {r.randrange(10**6)}), D)"
        if r.random() < 0.3:
            b += ".t().contiguous().t()"
        op = r.choice(["matmul", "mm", "addmm", "einsum", "bmm"])
        if op == "mm" and batch:
            op = "matmul"
        if op == "bmm":
            b = f"on(mk({batch + (k, n)}, {dtype_name(dt)}, {r.randrange(10**6)}), D)"
            if len(batch) != 1:
                op = "matmul"
        if op == "addmm":
            if batch:
                op = "matmul"
            else:
                c = f"on(mk(({n},), {dtype_name(dt)}, {r.randrange(10**6)}), D)"
                return f"{self.new()} = torch.addmm({c}, {a}, {b}, beta=2)", op, False
        if op == "einsum":
            return f"{self.new()} = torch.einsum('...ik,kj->...ij', {a}, {b})", op, False
        return f"{self.new()} = torch.{op}({a}, {b})", op, False

    def g_cast(self):
        name = self.pick()
        if name is None:
            return None
        dt = self.rng.choice(DTYPES)
        form = self.rng.randrange(3)
        if form == 0:
            return f"{self.new()} = {name}.to({dtype_name(dt)})", "to", False
        if form == 1:
            return f"{self.new()} = {name}.to(D, {dtype_name(dt)}, copy=True)", "to", False
        return f"{self.new()} = {name}.type({dtype_name(dt)})", "type", False

    def g_device(self):
        name = self.pick()
        if name is None:
            return None
        kind = self.rng.randrange(4)
        if kind == 0:
            return f"{self.new()} = {name}.to(D1, copy=True).mul(2).to(D)", "peer_copy", False
        if kind == 1:
            return f"{self.new()} = via_pinned({name}, D)", "pinned_non_blocking", False
        if kind == 2:
            return (f"{self.new()} = {name}.cpu().to(D, non_blocking=True, copy=True); sync(D)",
                    "cpu_non_blocking", False)
        other = self.pick(lambda t: True)
        return f"{other}.copy_({name}.to(D1, copy=True))", "peer_copy_", True

    def g_stream(self):
        inner = self.rng.choice([self.g_binary, self.g_unary, self.g_inplace, self.g_reduce])()
        if inner is None:
            return None
        stmt, op, writes = inner
        return f"with side_stream(D): {stmt}", op + "@stream", writes

    def g_grad(self):
        name = self.pick(lambda t: t.dtype in (torch.float32, torch.float64, torch.complex64))
        if name is None:
            return None
        f = self.rng.choice([
            "lambda w: (w * w).sin()", "lambda w: w.exp().cumsum(-1) if w.dim() else w.exp()",
            "lambda w: torch.nn.functional.softplus(w.real if w.is_complex() else w)",
            "lambda w: w.abs().sqrt()", "lambda w: w[..., ::2].tanh() * 3",
            "lambda w: (w @ w.mT) if w.dim() >= 2 else w * w",
            "lambda w: w.max(-1)[0] if w.dim() else w", "lambda w: w.norm()",
            "lambda w: torch.nn.functional.layer_norm(w, w.shape[-1:]) if w.dim() and not w.is_complex() else w * 2",
        ])
        return f"{self.new()} = grad_of({f}, {name})", "autograd", False

    # ---- programs that train and reductions split over threads (--bitwise, --modes) ----
    OPTIMIZERS = [
        "lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)",
        "lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True)",
        "lambda p: torch.optim.Adam(p, lr=0.01)",
        "lambda p: torch.optim.Adam(p, lr=0.01, foreach=True)",
        "lambda p: torch.optim.AdamW(p, lr=0.01, fused=True)",
        "lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True, foreach=False)",
        "lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5)",
        "lambda p: torch.optim.Adagrad(p, lr=0.1)",
    ]

    def g_train(self):
        r = self.rng
        seed = r.randrange(10**6)
        big = r.random() < 0.3  # reductions and matmuls large enough to be split over threads
        n = 512 if big else 16
        layers = [
            (f"torch.nn.Linear(64, {256 if big else 32})", (n, 64), None),
            ("torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))",
             (n, 32), None),
            ("torch.nn.Conv2d(4, 6, 3, padding=1)", (8 if big else 2, 4, 12, 12), None),
            # Convolutions on contiguous inputs only: on channels-last ones openreg returns
            # contiguous results (docs/overrideable_ops.md), so their backward rounds otherwise.
            ("torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.GroupNorm(2, 8))",
             (2, 4, 10, 10), None),
            ("torch.nn.GroupNorm(2, 4)", (2, 4, 10, 10),
             r.choice([None, "torch.channels_last" if GROUP_NORM_KEEPS_LAYOUT else None])),
            ("torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.BatchNorm2d(8))",
             (4, 4, 10, 10), None),
            ("torch.nn.BatchNorm2d(4)", (4, 4, 10, 10), r.choice([None, "torch.channels_last"])),
            ("torch.nn.LayerNorm(32)", (n, 32), None),
            ("torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)",
             (2, 6, 16), None),
            # Not LSTM or GRU: openreg runs their fused cells (as CUDA does), the CPU its unfused
            # ones; the results differ in the last bits (docs/determinism.md).
        ]
        layer, shape, fmt = r.choice(layers)
        x = f"on(mk({shape}, torch.float32, {r.randrange(10**6)}), D)"
        return (f"{self.new()} = train(lambda: {layer}, {r.choice(self.OPTIMIZERS)}, {x}, {seed}, "
                f"memory_format={fmt})", "train", False)

    def g_big_reduce(self):
        r = self.rng
        n = r.choice([1 << 16, 1 << 18, 3 * 100003])
        x = f"on(mk(({n},), torch.float32, {r.randrange(10**6)}), D)"
        expr = r.choice([f"{x}.sum()", f"{x}.mean()", f"{x}.var()", f"{x}.norm()",
                         f"{x}.view(-1, {n // 1024 if n % 1024 == 0 else 100003}).sum(0)",
                         f"{x}.softmax(0)[:8]", f"{x}.logsumexp(0)",
                         f"({x}.view(-1, 64)[:256].t() @ {x}.view(-1, 64)[:256]).sum()",
                         f"torch.nn.functional.l1_loss({x}, {x}.flip(0))"])
        return f"{self.new()} = {expr}", "big_reduce", False

    def g_attention(self):
        r = self.rng
        dt = r.choice(["torch.float32", "torch.float32", "torch.bfloat16", "torch.float16"])
        batched = r.random() < 0.7
        hq = r.choice([2, 4])
        hkv = r.choice([hq, hq // 2]) if batched else hq
        L, S, E = r.randint(1, 9), r.randint(1, 9), r.choice([8, 16])
        lead = (2,) if batched else ()
        mk = lambda shape: f"on(mk({shape}, {dt}, {r.randrange(10**6)}), D)"
        q, k, v = mk(lead + (hq, L, E)), mk(lead + (hkv, S, E)), mk(lead + (hkv, S, E))
        kw = []
        if hkv != hq:
            kw.append("enable_gqa=True")
        mask = r.randrange(4)
        if mask == 1:
            kw.append("is_causal=True")
        elif mask == 2:
            kw.append(f"attn_mask=on(mk(({L}, {S}), torch.bool, {r.randrange(10**6)}), D)")
        elif mask == 3:
            kw.append(f"attn_mask=on(mk(({L}, {S}), {dt}, {r.randrange(10**6)}), D)")
        if r.random() < 0.2:
            kw.append("scale=0.3")
        names = ", ".join(self.new() for _ in range(4))
        f = f"lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, {', '.join(kw)})"
        return f"{names} = grads_of({f}, {q}, {k}, {v})", "attention", False

    def g_layer_op(self):
        r = self.rng
        # Channels-last inputs half of the time: results and gradients must have the CPU's
        # strides (a convolution keeps a channels-last input's layout, docs/overrideable_ops.md).
        x4 = f"on(mk((2, 8, 7, 6), torch.float32, {r.randrange(10**6)}), D)"
        x4_cl = x4 + ".contiguous(memory_format=torch.channels_last)"
        if r.random() < 0.5:
            x4 = x4_cl
        w = lambda shape: f"on(mk({shape}, torch.float32, {r.randrange(10**6)}), D)"
        F = "torch.nn.functional"
        choices = [
            (f"lambda x, w: {F}.conv2d(x, w, stride={r.choice([1, 2])}, padding=1, "
             f"dilation={r.choice([1, 2])}, groups={r.choice([1, 2, 4])})",
             [x4, None], "conv2d"),
            (f"lambda x, w: {F}.conv_transpose2d(x, w, stride=2, output_padding=1)",
             [x4, w((8, 3, 3, 3))], "conv_transpose2d"),
            (f"lambda x, w: {F}.conv1d(x, w, padding=2)",
             [w((2, 8, 11)) + r.choice(["", ".transpose(1, 2).contiguous().transpose(1, 2)"]),
              w((5, 8, 3))], "conv1d"),
            (f"lambda x, w: {F}.conv3d(x, w)",
             [w((1, 2, 5, 5, 5)) + r.choice(["", ".contiguous(memory_format=torch.channels_last_3d)"]),
              w((3, 2, 2, 2, 2))], "conv3d"),
            (f"lambda x, w, b: {F}.group_norm(x, 4, w, b)", [x4, w((8,)), w((8,))], "group_norm"),
            (f"lambda x, w, b: {F}.batch_norm(x, None, None, w, b, training=True)",
             [x4, w((8,)), w((8,))], "batch_norm"),
            (f"lambda x, w, b: {F}.instance_norm(x, weight=w, bias=b)", [x4, w((8,)), w((8,))],
             "instance_norm"),
            (f"lambda x, w, b: {F}.layer_norm(x, (6,), w, b)", [x4, w((6,)), w((6,))],
             "layer_norm"),
            (f"lambda x: {F}.interpolate(x, scale_factor=2, mode='bilinear')", [x4],
             "interpolate"),
            (f"lambda x: {F}.max_pool2d(x, 2)", [x4], "max_pool2d"),
            (f"lambda x: {F}.adaptive_avg_pool2d(x, 3)", [x4], "adaptive_avg_pool2d"),
            (f"lambda x, h, w1, w2: torch.rnn_tanh_cell(x, h, w1, w2)",
             [w((3, 8)), w((3, 4)), w((4, 8)), w((4, 4))], "rnn_tanh_cell"),
        ]
        f, args, op = r.choice(choices)
        if op == "conv2d":  # weight shape follows the groups chosen
            groups = int(f.split("groups=")[1].split(")")[0])
            args[1] = w((4, 8 // groups, 3, 3))
        if op == "group_norm" and not GROUP_NORM_KEEPS_LAYOUT and args[0] == x4_cl:
            args[0] = x4_cl.replace(".contiguous(memory_format=torch.channels_last)", "")
        names = ", ".join(self.new() for _ in range(len(args) + 1))
        return f"{names} = grads_of({f}, {', '.join(args)})", op, False

    GENERATORS = [("g_make", 3), ("g_view", 4), ("g_unary", 3), ("g_binary", 4), ("g_inplace", 4),
                  ("g_out", 1), ("g_index", 3), ("g_reduce", 3), ("g_matmul", 1), ("g_cast", 2),
                  ("g_device", 1), ("g_stream", 1), ("g_grad", 1)]
    # Added in the bitwise modes.
    DETERMINISM_GENERATORS = [("g_train", 2), ("g_big_reduce", 2), ("g_attention", 2),
                              ("g_layer_op", 2)]

    def next_statement(self):
        names, weights = zip(*(self.GENERATORS + (self.DETERMINISM_GENERATORS
                                                  if BITWISE or RECORD is not None else [])))
        while True:
            g = self.rng.choices(names, weights)[0] if self.tensors() else "g_make"
            s = getattr(self, g)()
            if s is not None:
                return s

    # ---- running and comparing ----
    def run_side(self, side, stmt):
        env = self.envs[side]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(stmt, env)
        except Exception as e:  # noqa: BLE001 - every error is compared
            return e
        return None

    def compare_all(self, names):
        for name in names:
            c, o = self.envs["cpu"].get(name), self.envs["openreg"].get(name)
            if isinstance(c, torch.Tensor) != isinstance(o, torch.Tensor):
                raise Disagreement(f"{name}: a tensor on one side only")
            if not isinstance(c, torch.Tensor):
                continue
            problem = compare_tensor(name, c, o)
            if problem:
                raise Disagreement(problem)

    def compare_views(self, name):
        """Which live variables share memory with `name`: the same on both sides."""
        shares = {}
        for side in ("cpu", "openreg"):
            env = self.envs[side]
            mine = env[name]
            if not isinstance(mine, torch.Tensor) or mine.untyped_storage().nbytes() == 0:
                return
            key = storage_key(mine)
            shares[side] = sorted(k for k in self.tensors() if k != name and isinstance(
                env.get(k), torch.Tensor) and env[k].untyped_storage().nbytes() > 0 and
                storage_key(env[k]) == key)
        if shares["cpu"] != shares["openreg"]:
            raise Disagreement(f"{name}: shares memory with {shares['openreg']} on openreg, "
                               f"with {shares['cpu']} on the CPU")

    def record(self, error, names):
        """--record: what the openreg side computed, for comparing modes with each other."""
        env = self.envs["openreg"]
        got = [type(error).__name__] if error is not None else []
        for k in names:
            v = env.get(k)
            if isinstance(v, torch.Tensor):
                got.append((k, digest(v)))
        RECORD[-1]["steps"].append(got)

    def step(self, given=None):
        before = set(self.tensors())
        snapshot = {k: storage_key(self.t(k)) for k in before}
        stmt, op, writes = given or self.next_statement()
        self.lines.append(stmt)
        self.result.statements += 1
        self.result.operators.add(op)
        ec = self.run_side("cpu", stmt)
        eo = self.run_side("openreg", stmt)
        if RECORD is not None:
            new = sorted(set(self.tensors()) - before)
            self.record(eo, self.tensors() if writes else new)
            if ec is not None or eo is not None:
                for side in ("cpu", "openreg"):
                    for k in set(self.envs[side]) - before:
                        if k.startswith("v") and k[1:].isdigit():
                            self.envs[side].pop(k, None)
            return
        if (ec is None) != (eo is None) or (ec is not None and type(ec) is not type(eo)):
            what = lambda e: "no error" if e is None else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise Disagreement(f"error mismatch: CPU {what(ec)}; openreg {what(eo)}")
        if ec is not None:
            self.result.errors_both += 1
            # Drop what a failed statement may have bound on one side only, and out= arguments
            # it resized before it failed (their new memory holds garbage on both sides). Their
            # metadata must still agree.
            resized = {k for k in before if storage_key(self.t(k)) != snapshot[k]}
            self.compare_all(sorted(before - resized))
            for k in resized:
                c, o = self.envs["cpu"][k], self.envs["openreg"][k]
                if (c.shape, c.stride(), c.dtype) != (o.shape, o.stride(), o.dtype):
                    raise Disagreement(f"{k}: {describe(o)} on openreg, {describe(c)} on the CPU")
            for side in ("cpu", "openreg"):
                for k in (set(self.tensors()) - before) | resized:
                    self.envs[side].pop(k, None)
            return
        new = sorted(set(self.tensors()) - before)
        self.compare_all(new)
        for name in new:
            self.compare_views(name)
        if writes:
            self.compare_all(self.tensors())

    def run(self, statements=None):
        """Runs `steps` random statements, or the given (statement, operator, writes) triples."""
        self.result.programs += 1
        if RECORD is not None:
            RECORD.append({"seed": self.seed, "lines": self.lines, "steps": []})
        try:
            for given in statements or [None] * self.steps:
                self.step(given)
        except Disagreement as d:
            self.result.disagreements.append((self.seed, str(d), self.repro(str(d))))
            return False
        except Exception:  # a crash of the fuzzer itself, reported with the program
            msg = "fuzzer error: " + traceback.format_exc(limit=3)
            self.result.disagreements.append((self.seed, msg, self.repro(msg)))
            return False
        finally:
            if torch.openreg.is_available():
                torch.openreg.synchronize()
        return True

    def repro(self, what):
        # Statements that raised on both sides are kept (they may have side effects), each in a
        # try block; the last one is the disagreement.
        body = "\n".join(f"    try:\n        {line}\n    except Exception as e:\n"
                         f"        print(D, {i}, type(e).__name__, e)"
                         for i, line in enumerate(self.lines))
        return f'''# fuzz seed {self.seed}: {what.splitlines()[0]}
{PRELUDE}
def program(D, D1):
{body}
    return {{k: v for k, v in locals().items() if k.startswith("v")}}

for D, D1 in [("cpu", "cpu"), ("openreg:0", "openreg:1")]:
    try:
        env = program(D, D1)
        last = env[max(env, key=lambda k: int(k[1:]))] if env else None
        print(D, {{k: (v.dtype, tuple(v.shape), v.stride()) for k, v in env.items()
                   if isinstance(v, torch.Tensor)}})
        print(last)
    except Exception as e:
        print(D, "raised", type(e).__name__, e)
'''


def run_seeds(seeds, steps=30, verbose=False, show=False) -> Result:
    result = Result()
    for seed in seeds:
        p = Program(seed, steps, result, verbose)
        ok = p.run()
        if show:
            print("\n".join(p.lines))
        if not ok and verbose:
            seed, what, repro = result.disagreements[-1]
            print(f"--- seed {seed}: {what}\n{repro}", file=sys.stderr)
    return result


# The modes --modes compares: each runs the same programs in a process of its own.
MODES = {
    "default": {},
    "OPENREG_ASYNC=1": {"OPENREG_ASYNC": "1"},
    "OPENREG_SANITIZE=1": {"OPENREG_SANITIZE": "1"},
    "OPENREG_STRICT_MEMORY=1": {"OPENREG_STRICT_MEMORY": "1"},
}


def compare_modes(argv, modes=MODES) -> int:
    """Runs the programs once per mode (--record) and compares what openreg computed, bit for bit,
    statement by statement."""
    import tempfile
    records, start = {}, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in modes.items():
            path = os.path.join(tmp, "record.json")
            env = {k: v for k, v in os.environ.items() if k not in
                   ("OPENREG_ASYNC", "OPENREG_SANITIZE", "OPENREG_STRICT_MEMORY")} | env
            r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--record", path],
                               env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name}: the run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
                return 1
            with open(path) as f:
                records[name] = json.load(f)
    reference_name = next(iter(modes))
    reference = records[reference_name]
    programs = len(reference)
    statements = sum(len(p["steps"]) for p in reference)
    tensors = sum(len(s) for p in reference for s in p["steps"])
    # A statement's record: the type of what it raised, if it did, then each tensor's digest.
    # Bits (and whether a statement raised) must agree; another exception type is a note: it is
    # behaviour, not bits.
    def split(step):
        raised = [x for x in step if isinstance(x, str)]
        return raised, [x for x in step if not isinstance(x, str)]
    differences, notes = [], []
    for name, programs_of_mode in records.items():
        for ref, got in zip(reference, programs_of_mode):
            for i, (a, b) in enumerate(zip(ref["steps"], got["steps"])):
                (ra, da), (rb, db) = split(a), split(b)
                if da != db or bool(ra) != bool(rb):
                    differences.append(f"{name} differs from {reference_name}: seed {ref['seed']}, "
                                       f"statement {i}: {ref['lines'][i]}\n    {a}\n    {b}")
                    break
                if ra != rb:
                    notes.append(f"{name}: seed {ref['seed']}, statement {i} raised {rb} where "
                                 f"{reference_name} raised {ra}")
    print(f"{programs} programs, {statements} statements, {tensors} results compared across "
          f"{len(modes)} modes ({', '.join(modes)}), {len(differences)} differences, "
          f"{time.time() - start:.0f} s")
    for d in differences:
        print("  " + d)
    for n in notes:
        print("  note: " + n)
    return 1 if differences else 0


def main(argv=None):
    global BITWISE, RECORD
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", default="0:100", help="a range start:stop")
    ap.add_argument("--seed", type=int, help="one seed")
    ap.add_argument("--steps", type=int, default=30, help="statements per program")
    ap.add_argument("--show", action="store_true", help="print each program")
    ap.add_argument("--bitwise", action="store_true",
                    help="CPU and openreg bit for bit, at OMP_NUM_THREADS=1")
    ap.add_argument("--modes", action="store_true",
                    help="openreg's modes against each other, bit for bit, at default threads")
    ap.add_argument("--record", help=argparse.SUPPRESS)  # a --modes run writes its digests here
    args = ap.parse_args(argv)
    if args.modes:
        rest = [a for a in argv if a != "--modes"]
        return compare_modes(rest)
    if args.bitwise and os.environ.get("OMP_NUM_THREADS") != "1":
        # Backward runs on the autograd device thread with one OpenMP thread; the CPU's equals it
        # bit for bit when the caller runs one too (docs/determinism.md).
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env).returncode
    BITWISE = args.bitwise
    if args.record:
        RECORD = []
    if args.seed is not None:
        seeds = [args.seed]
    else:
        a, b = args.seeds.split(":")
        seeds = range(int(a), int(b))
    start = time.time()
    if RECORD is not None:
        r = run_seeds(seeds, args.steps)
        with open(args.record, "w") as f:
            json.dump(RECORD, f)
        return 0
    r = run_seeds(seeds, args.steps, verbose=True, show=args.show)
    print(f"{r.programs} programs, {r.statements} statements ({r.errors_both} raised on both "
          f"sides), {len(r.operators)} operators, {len(r.disagreements)} disagreements, "
          f"{time.time() - start:.0f} s")
    for seed, what, _ in r.disagreements:
        print(f"  seed {seed}: {what.splitlines()[0]}")
    return 1 if r.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
