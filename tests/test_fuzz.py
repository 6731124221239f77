"""Fuzz: every public function and module of npattn, called with random -- and randomly wrong --
arguments, either returns a correct result or raises ValueError/TypeError naming the argument.

``TABLE`` maps each public name (``npattn.__all__``, ``npattn.nn.__all__`` and the
initialisers of ``nn.init``, the optimisers of ``npattn.optim``, the checks of
``npattn.gradcheck``) to a case generator. A case is one call (or, for a module, a constructor,
``backward`` before ``forward``, ``forward`` and ``backward``): valid arguments drawn by
Hypothesis -- ranks and shapes with 0-size dims, float32/float64, every memory layout, NaN,
±inf and huge values -- of which 0, 1 or 2 are then replaced by a wrong one: an integer, bool,
complex, float16, object or string dtype, the other float dtype, a mismatched or
non-broadcasting shape, None, a string, a ragged list, a number out of range, a huge int, ...
(and some right ones: nested lists, NumPy scalars, Fractions). Then:

* a case with a wrong argument must raise ValueError or TypeError whose message names one of
  the wrong arguments (as a word: ``p`` does not match ``dropout_p``);
* a valid case must return: the result has the expected shape and dtype, equals the float64
  reference (``npattn.reference``, or NumPy) within a loose tolerance where that is cheap --
  NaN exactly where the reference has NaN -- and the caller's arrays are left untouched;
* anything else -- IndexError, KeyError, AttributeError, ZeroDivisionError, OverflowError, a
  Numba error, a segfault -- is a failure. One exception: ``backward`` before ``forward`` is a
  RuntimeError (a call out of order, not a bad argument), as in ``npattn.nn.Module``.

The cases run in a subprocess (``main`` below) so that a crash in compiled code is a failed
test showing the child's stderr, not a dead test run. Knobs (environment variables):
``NPATTN_FUZZ_EXAMPLES`` (Hypothesis examples per target; default 60, about 50 s with the
kernel cache warm), ``NPATTN_FUZZ_SEED``
(default 0: the same seed draws the same cases), ``NPATTN_FUZZ_ONLY`` (comma-separated
target names).
"""
import collections
import decimal
import fractions
import math
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings, strategies as st

TESTS = pathlib.Path(__file__).resolve().parent
if str(TESTS) not in sys.path:                      # the child imports this file as a module
    sys.path.insert(0, str(TESTS))

import npattn                                       # noqa: E402
from npattn import gradcheck as gradcheck_module_   # noqa: E402
from npattn import nn, optim, reference            # noqa: E402
from strategies import broadcastable_batches, dims, lay_out, make_values, shapes  # noqa: E402

EXAMPLES = int(os.environ.get("NPATTN_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("NPATTN_FUZZ_SEED", "0"))
TIMEOUT = 900                                       # seconds, for the whole child

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
#: How values are drawn: "normal" is what the reference comparison needs; the others are
#: edge values every op must survive (the result is then only checked for shape and dtype,
#: or against the reference where the op's contract covers them).
KINDS = ("normal", "normal", "normal", "normal", "nan", "inf", "huge", "tiny", "masked")
LAYOUTS = ("contiguous", "contiguous", "fortran", "transposed", "sliced", "negative", "readonly")
BAD_DTYPES = ("int32", "int64", "uint8", "bool", "complex64", "complex128", "float16", "object",
              "U8")
RAGGED = [[1.0], [1.0, 2.0]]
DTYPE = "the dtype group decides"   # an option's is_bad: wrong iff its group's dtypes differ


class Malformed:
    """An argument NumPy turns into a 0-d object array."""

    def __repr__(self):
        return "Malformed()"


# ---------------------------------------------------------------------------- the harness

class Case:
    """One fuzz case: the arguments of a call, which of them are wrong on purpose, and what
    every returned result is checked against.

    Generators ``add`` valid arguments, each with its list of replacement ``options``
    ``(label, value, is_bad)``; ``mutate`` then swaps 0-2 of them for a drawn option. ``run``
    calls and judges the outcome.
    """

    def __init__(self, data, target):
        self.data = data
        self.target = target
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "rng seed"))
        self.stage()

    def stage(self):
        """Start the next call of a multi-call case (a module's constructor, then forward...)."""
        self.args = {}
        self.positional = []
        self.options = {}
        self.bad = set()              # the wrong arguments' names (what a message must name)
        self.changed = set()          # every argument mutate replaced, right or wrong
        self.group = []               # float arrays that must share one dtype (see mutate)
        self.recast = set()           # ... of which mutate gave these another float dtype
        self.choice = {}              # argument -> the label of the option mutate put there
        self.finite = True            # every float input holds ordinary finite values

    def draw(self, strategy, label=None):
        return self.data.draw(strategy, label)

    def dtype(self):
        return np.dtype(self.draw(st.sampled_from([np.float32, np.float64]), "dtype"))

    def values(self, shape, dtype, kind="normal"):
        """C-contiguous values of one kind (strategies.make_values, plus ±inf entries)."""
        if kind == "inf":
            x = np.asarray(self.rng.standard_normal(shape))
            inf = np.where(self.rng.random(shape) < 0.5, np.inf, -np.inf)
            x = np.where(self.rng.random(shape) < 0.2, inf, x)
            return np.ascontiguousarray(x, dtype=dtype).reshape(shape)
        if kind == "masked" and len(shape) == 0:
            kind = "normal"
        return make_values(self.rng, shape, dtype, kind)

    def array(self, shape, dtype, kinds=KINDS, name=""):
        """An array of a drawn kind of values, in a drawn memory layout."""
        kind = self.draw(st.sampled_from(kinds), f"{name} values")
        if kind != "normal":
            self.finite = False
        layout = self.draw(st.sampled_from(LAYOUTS), f"{name} layout")
        return lay_out(self.values(tuple(shape), dtype, kind), layout, self.rng)

    def add(self, name, value, options=(), keyword=False):
        """An argument, passed by position unless ``keyword`` (or an earlier one was)."""
        self.args[name] = value
        if not keyword and len(self.positional) == len(self.args) - 1:
            self.positional.append(name)
        if options:                   # (a later option of the same label replaces an earlier)
            self.options[name] = list({o[0]: o for o in options}.values())
        return value

    def mutate(self, most=2):
        """Replace 0..most arguments by a drawn option; the wrong ones go to ``self.bad``.

        An option's ``is_bad`` is True (the message must name the argument), False, or the
        name the message must give instead (a parameter group's ``lr``, say).
        """
        names = sorted(self.options)
        if not names:
            return
        count = self.draw(st.sampled_from([0, 0, 1, 1, 1, 2][:4 + most]), "arguments changed")
        for name in self.draw(st.permutations(names), "order")[:count]:
            options = self.options[name]
            label = self.draw(st.sampled_from([o[0] for o in options]), f"{name} becomes")
            _, value, bad = next(o for o in options if o[0] == label)
            self.args[name] = value
            self.changed.add(name)
            self.choice[name] = label
            if bad is DTYPE:
                self.recast.add(name)
            elif bad:
                self.bad.add(name if bad is True else bad)
        self._resolve_dtypes()

    def _resolve_dtypes(self):
        """A float array given the other float dtype (or float64 as a nested list) is wrong
        exactly when the arrays of its group now disagree; the message then names it."""
        present = {n: float_dtype_of(self.args.get(n)) for n in self.group}
        present = {n: d for n, d in present.items() if d is not None}
        for name in self.recast & set(present):
            if any(d != present[name] for n, d in present.items() if n != name):
                self.bad.add(name)

    def call(self, fn):
        pos = [self.args[n] for n in self.positional]
        kw = {n: v for n, v in self.args.items() if n not in self.positional}
        return fn(*pos, **kw)

    def run(self, fn, check, call=None):
        """Call ``fn`` with the arguments and judge the outcome (see the module docstring)."""
        snapshot = [(v, np.array(v, copy=True)) for v in self.args.values()
                    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf"]
        COUNTS[self.target] += 1
        try:
            with np.errstate(all="ignore"):
                result = (call or self.call)(fn)
        except (ValueError, TypeError) as exc:
            expect_named(exc, self.bad)
            return None
        assert not self.bad, (f"{self.target} accepted the wrong {sorted(self.bad)}: "
                              f"{describe(self.args, self.bad)}; returned {short(result)}")
        for original, copy in snapshot:
            assert np.array_equal(original, copy, equal_nan=True), \
                f"{self.target} wrote into its input"
        with np.errstate(all="ignore"):                # the float64 reference's 0·inf etc.
            check(result, self.args)
        return result


def named(message, name):
    """Whether ``message`` mentions ``name`` as a word (``p`` is not in ``dropout_p``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def expect_named(exc, bad):
    """A ValueError/TypeError is right only for a call with a wrong argument it names."""
    message = str(exc)
    assert bad, f"a valid call raised {type(exc).__name__}: {message}"
    assert any(named(message, name) for name in bad), \
        f"{type(exc).__name__} names none of the wrong arguments {sorted(bad)}: {message!r}"


def short(value):
    if isinstance(value, np.ndarray):
        return f"array(shape={value.shape}, dtype={value.dtype})"
    if isinstance(value, (tuple, list)) and len(value) < 8:
        return "(" + ", ".join(short(v) for v in value) + ")"
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def describe(args, names):
    return ", ".join(f"{n}={short(args[n])}" for n in sorted(names))


def f64(value):
    return None if value is None else np.asarray(value, dtype=np.float64)


def dtype_of(value):
    return np.asarray(value).dtype


def float_dtype_of(value):
    """The float32/float64 dtype NumPy gives ``value``, or None (None, not convertible, other)."""
    if value is None:
        return None
    try:
        dt = np.asarray(value).dtype
    except (ValueError, TypeError):
        return None
    return dt if dt in (F32, F64) else None


def expect(result, shape, dtype, what="result"):
    assert isinstance(result, np.ndarray), f"{what} is {type(result).__name__}, not an ndarray"
    assert result.shape == tuple(shape), f"{what} has shape {result.shape}, expected {shape}"
    assert result.dtype == dtype, f"{what} has dtype {result.dtype}, expected {dtype}"


def close(got, want, dtype, scale=1.0, what="result"):
    """Loose agreement with the float64 truth: NaN and ±inf where it has them, and the finite
    entries within 1e-4 (float32) or 1e-10 (float64) of ``scale + |want|``. Catches a wrong
    formula or a wrong element, not the last bits."""
    got = np.asarray(got, dtype=np.float64)
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), \
        f"{what}: NaN at {np.argwhere(np.isnan(got) != np.isnan(want))[:3].tolist()}"
    inf = np.isinf(want)
    assert np.array_equal(np.isinf(got), inf) and np.array_equal(got[inf], want[inf]), \
        f"{what}: ±inf entries differ"
    finite = np.isfinite(want)
    tol = (1e-4 if dtype == F32 else 1e-10) * (np.broadcast_to(scale, got.shape) + np.abs(want))
    err = np.abs(got - want)
    bad = finite & ~(err <= tol)
    assert not bad.any(), (f"{what}: {bad.sum()} entries off the float64 reference, first "
                           f"at {np.argwhere(bad)[0].tolist()}: got {got[bad][0]!r}, want "
                           f"{want[bad][0]!r}")


def sizes(small=5):
    """A dim: mostly 0..small, sometimes past the register tiles' MR (4, 8) and NR (8, 16, 32)."""
    return st.one_of(dims(small), dims(small), dims(small), st.integers(14, 40))


# ---------------------------------------------------------------------------- options

def cast(value, dtype):
    with np.errstate(all="ignore"):
        return np.asarray(value).astype(dtype)


def other_float(dtype):
    return F64 if np.dtype(dtype) == F32 else F32


def float_options(case, value, *, anchored, bad_shapes=(), optional=False):
    """Replacements for a float array argument. ``anchored``: True when its dtype is fixed
    (a module's), False when any float dtype goes, DTYPE when it must match its dtype group's
    (``case.group``) -- then the other float dtype, or a float64 nested list, is wrong only
    while the rest of the group keeps the old dtype."""
    base = np.asarray(value)
    dtype = base.dtype
    options = [(f"as {dt}", cast(base, dt), True) for dt in BAD_DTYPES]
    options.append(("the other float dtype", cast(base, other_float(dtype)), anchored))
    if base.size:
        options.append(("a nested list", base.tolist(),
                        anchored if anchored is DTYPE or dtype == F32 else False))
    options += [("None", None, not optional), ("a string", "abc", True),
                ("a ragged list", RAGGED, True), ("an object", Malformed(), True)]
    options += [(f"shape {s}", case.values(s, dtype), True) for s in bad_shapes]
    return options


def dim_options(ndim):
    span = max(ndim, 1)
    return [("np.int64(-1)", np.int64(-1), False), ("np.int8(0)", np.int8(0), False),
            (f"{span}", span, True), (f"{-span - 1}", -span - 1, True),
            ("10**30", 10**30, True), ("True", True, True), ("0.0", 0.0, True),
            ("'0'", "0", True), ("None", None, True), ("np.float64(0)", np.float64(0), True)]


def probability_options():
    return [("-0.1", -0.1, True), ("1.5", 1.5, True), ("nan", math.nan, True),
            ("inf", math.inf, True), ("-inf", -math.inf, True), ("'0.5'", "0.5", True),
            ("None", None, True), ("True", True, True), ("10**400", 10**400, True),
            ("0.5j", 0.5j, True), ("np.array(0.5)", np.array(0.5), True),
            ("Decimal('0.5')", decimal.Decimal("0.5"), True),
            ("np.float32(0.25)", np.float32(0.25), False), ("0", 0, False), ("1", 1, False),
            ("Fraction(1, 3)", fractions.Fraction(1, 3), False)]


def seed_options(none_ok=False):
    return [("-1", -1, True), ("2**64", 2**64, True), ("2**100", 2**100, True),
            ("1.0", 1.0, True), ("'1'", "1", True), ("True", True, True),
            ("None", None, not none_ok), ("np.float64(1)", np.float64(1), True),
            ("0", 0, False), ("2**64 - 1", 2**64 - 1, False),
            ("np.uint64(2**64 - 1)", np.uint64(2**64 - 1), False),
            ("np.int8(5)", np.int8(5), False)]


def flag_options():
    return [("1", 1, True), ("0", 0, True), ("'True'", "True", True), ("None", None, True),
            ("1.0", 1.0, True), ("np.bool_(True)", np.bool_(True), False), ("False", False, False)]


def size_options(value, minimum=0):
    """Replacements for a dimension argument (an int >= minimum) whose value is ``value``."""
    options = [("-1", -1, True), ("2.0", 2.0, True), ("'2'", "2", True), ("None", None, True),
               ("True", True, True), ("a NumPy int", np.int64(value), False)]
    if minimum > 0:
        options.append(("0", 0, True))
    return options


def optional_size_options(value):
    """Replacements for a dimension argument that may be None (an int >= 1 or None)."""
    return [o for o in size_options(value or 1, 1) if o[0] != "None"] + [("None", None, False)]


def dtype_options():
    return [("np.int32", np.int32, True), ("'float16'", "float16", True), ("'abc'", "abc", True),
            ("[1]", [1], True), ("complex", complex, True), ("object", object, True),
            ("'float64'", "float64", False), ("np.dtype(np.float32)", F32, False)]


def rng_options(name="rng"):
    return [("-1", -1, True), ("'1'", "1", True), ("1.5", 1.5, True), ("True", True, True),
            ("np.random.RandomState(0)", np.random.RandomState(0), True),
            ("np.int64(3)", np.int64(3), False), ("None", None, False),
            ("a Generator", np.random.default_rng(1), False)]


def index_options(case, value, *, stop, bad_shapes=(), allowed=None):
    """Replacements for an integer index array with entries in [0, stop) (or ``allowed``)."""
    base = np.asarray(value)
    options = [(f"as {dt}", cast(base, dt), True)
               for dt in ("float32", "float64", "bool", "complex128", "object", "U8")]
    if base.size:
        low, high = int(base.min()), int(base.max())
        for dt in ("int8", "int16", "int32", "uint8", "uint16", "uint64"):
            info = np.iinfo(dt)
            if info.min <= low and high <= info.max:
                options.append((f"as {dt}", base.astype(dt), False))
        options.append(("a nested list", base.tolist(), False))
        for bad in (stop, -1, 2**62):
            if bad != allowed:
                wrong = base.copy()
                wrong.flat[int(case.rng.integers(base.size))] = bad
                options.append((f"holding {bad}", wrong, True))
    options += [("None", None, True), ("a string", "abc", True),
                ("a ragged list", [[0], [0, 0]], True), ("an object", Malformed(), True)]
    options += [(f"shape {s}", np.zeros(s, np.int64), True) for s in bad_shapes]
    return options


def choice_options(valid):
    return [("'nope'", "nope", True), ("upper case", valid[0].upper(),
                                       valid[0].upper() not in valid),
            ("None", None, True), ("0", 0, True), ("a list", [valid[0]], True)] + \
           [(repr(v), v, False) for v in valid]


# ---------------------------------------------------------------------------- functional ops

def gen_linear(case, fn, backward):
    dt = case.dtype()
    lead = case.draw(shapes(max_ndim=3, max_dim=4), "lead")
    fin, fout = case.draw(sizes(), "Fin"), case.draw(sizes(), "Fout")
    case.group = ["x", "weight", "bias", "dout"]
    if backward:
        dout = case.array(lead + (fout,), dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            lead + (fout + 1,), (1,) + lead + (fout,)]))
    x = case.add("x", case.array(lead + (fin,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=DTYPE, bad_shapes=[(), lead + (fin + 1,)])
    w = case.add("weight", case.array((fout, fin), dt, name="weight"))
    case.options["weight"] = float_options(case, w, anchored=DTYPE, bad_shapes=[
        (fout,), (fout, fin + 2), (fout, fin, 1), ()])     # (x's is Fin + 1)
    b = case.array((fout,), dt, name="bias") if case.draw(st.booleans(), "bias") else None
    case.add("bias", b, float_options(case, case.values((fout,), dt), anchored=DTYPE, optional=True,
                                      bad_shapes=[(fout + 1,), (fout, 1), ()]))
    case.mutate()

    def check(result, a):
        x, w, b = f64(a["x"]), f64(a["weight"]), f64(a["bias"])
        dt = dtype_of(a["x"])
        if not backward:
            expect(result, x.shape[:-1] + (w.shape[0],), dt)
            if case.finite:
                scale = np.abs(x) @ np.abs(w).T + (0 if b is None else np.abs(b))
                close(result, reference.linear_forward(x, w, b), dt, scale)
            return
        dx, dw, db = result
        expect(dx, x.shape, dt, "dx")
        expect(dw, w.shape, dt, "dweight")
        if b is None:
            assert db is None, "dbias must be None without a bias"
        else:
            expect(db, b.shape, dt, "dbias")
        if case.finite:
            want = reference.linear_backward(f64(a["dout"]), x, w, b)
            n = max(math.prod(x.shape[:-1]), 1)
            for got, ref, what in zip(result, want, ("dx", "dweight", "dbias")):
                if got is not None:
                    close(got, ref, dt, 20.0 * n * (1 + np.abs(ref).max(initial=0)), what)

    case.run(fn, check)


def gen_matmul(case, fn, backward):
    dt = case.dtype()
    batch_a, batch_b = case.draw(broadcastable_batches(max_ndim=2, max_dim=3), "batches")
    m, k, n = (case.draw(sizes(4), d) for d in "MKN")
    a_1d, b_1d = case.draw(st.booleans(), "a 1-D"), case.draw(st.booleans(), "b 1-D")
    a_shape = (k,) if a_1d else batch_a + (m, k)
    b_shape = (k,) if b_1d else batch_b + (k, n)
    out_shape = np.matmul(np.zeros(a_shape), np.zeros(b_shape)).shape
    case.group = ["a", "b", "dout"]
    if backward:
        dout = case.array(out_shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            out_shape[:-1] + (out_shape[-1] + 1,) if out_shape else (1,), (2,) + out_shape]))
    a = case.add("a", case.array(a_shape, dt, name="a"))
    b = case.add("b", case.array(b_shape, dt, name="b"))
    bad_a = [(), a_shape[:-1] + (k + 1,)]
    if batch_b and batch_b[-1] != 1 and not a_1d and not b_1d:
        bad_a.append((2 if batch_b[-1] == 0 else batch_b[-1] + 1, m, k))   # cannot broadcast
    case.options["a"] = float_options(case, a, anchored=DTYPE, bad_shapes=bad_a)
    case.options["b"] = float_options(case, b, anchored=DTYPE, bad_shapes=[
        (), (k + 2,) if b_1d else batch_b + (k + 2, n)])   # (+2: a's is +1, never both right)
    case.mutate()

    def check(result, args):
        a, b = f64(args["a"]), f64(args["b"])
        dt = dtype_of(args["a"])
        if not backward:
            expect(result, np.matmul(a, b).shape, dt)
            if case.finite:
                close(result, np.matmul(a, b), dt, np.matmul(np.abs(a), np.abs(b)))
            return
        da, db = result
        expect(da, a.shape, dt, "da")
        expect(db, b.shape, dt, "db")
        if case.finite:
            dout = f64(args["dout"])
            want = reference.matmul_backward(dout, a, b)
            n = max(dout.size, 1)
            for got, ref, what in zip(result, want, ("da", "db")):
                close(got, ref, dt, 20.0 * n * (1 + np.abs(ref).max(initial=0)), what)

    case.run(fn, check)


def gen_softmax(case, fn, log, backward):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=5), "shape")
    if case.draw(st.booleans(), "long rows"):
        shape = shape + (case.draw(st.integers(14, 70), "C"),)
    span = max(len(shape), 1)
    dim = case.draw(st.integers(-span, span - 1), "dim")
    case.group = ["dout", "out"]
    if backward:
        dout = case.array(shape, dt, name="dout")
        out = case.array(shape, dt, name="out")
        if log:                                      # a log-softmax output is <= 0
            out = -np.abs(out)
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[shape + (1,), (2,) + shape]))
        case.add("out", out, float_options(case, out, anchored=DTYPE, bad_shapes=[shape + (2,)]))
    else:
        x = case.add("x", case.array(shape, dt, name="x"))
        case.options["x"] = float_options(case, x, anchored=False)
    case.add("dim", dim, dim_options(len(shape)), keyword=case.draw(st.booleans(), "dim="))
    case.mutate()

    def check(result, a):
        first = a["out"] if backward else a["x"]
        arr = np.asarray(first)
        expect(result, arr.shape, arr.dtype)
        axis = int(a["dim"]) % span
        if backward:
            if case.finite:
                op = reference.log_softmax_backward if log else reference.softmax_backward
                d, o = np.atleast_1d(f64(a["dout"])), np.atleast_1d(f64(a["out"]))
                want = op(d, o, axis).reshape(arr.shape)
                scale = 20.0 * (1 + np.abs(d).sum(axis, keepdims=True) *
                                np.exp(np.abs(o)).max(initial=1))
                close(result, want, arr.dtype, np.broadcast_to(scale, d.shape).reshape(arr.shape))
            return
        x64 = np.atleast_1d(f64(a["x"]))
        if x64.size == 0:
            return
        want = (reference.log_softmax_forward if log else reference.softmax_forward)(x64, axis)
        scale = 20.0 if not log else 20.0 * (1 + np.abs(x64[np.isfinite(x64)]).max(initial=0))
        close(result, want.reshape(arr.shape), arr.dtype, scale)

    case.run(fn, check)


def gen_dropout(case, fn, backward):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=6), "shape")
    name = "dout" if backward else "x"
    x = case.add(name, case.array(shape, dt, name=name))
    case.options[name] = float_options(case, x, anchored=False)
    p = case.draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 1)), "p")
    case.add("p", p, probability_options(), keyword=case.draw(st.booleans(), "p="))
    case.add("seed", case.draw(st.integers(0, 2**64 - 1), "seed"), seed_options(),
             keyword=case.draw(st.booleans(), "seed="))
    case.add("training", case.draw(st.booleans(), "training"), flag_options(), keyword=True)
    case.mutate()

    def check(result, a):
        x = np.asarray(a[name])
        expect(result, x.shape, x.dtype)
        if not a["training"]:
            assert np.array_equal(result, x, equal_nan=True), "eval mode must return x"
            return
        p = float(a["p"])
        keep = npattn.dropout_mask(x.shape, p, a["seed"])
        close(result, reference.dropout_forward(f64(x), keep, p), x.dtype, 0.0)

    case.run(fn, check)


def gen_dropout_mask(case, fn):
    shape = case.draw(shapes(max_ndim=3, max_dim=6), "shape")
    case.add("shape", shape, [
        ("an int", 5, False), ("a list", list(shape), False),
        ("an int array", np.array(shape, dtype=np.int64), False), ("()", (), False),
        ("(-1,)", (-1,), True), ("(2.0,)", (2.0,), True), ("'ab'", "ab", True),
        ("None", None, True), ("((2,),)", ((2,),), True), ("(True,)", (True,), True),
        ("(2**62, 2**62)", (2**62, 2**62), True), ("a 2-D array", np.ones((2, 2), int), True)])
    case.add("p", case.draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)), "p"),
             probability_options())
    case.add("seed", case.draw(st.integers(0, 2**64 - 1), "seed"), seed_options())
    case.mutate()

    def check(result, a):
        s = a["shape"]
        want_shape = (s,) if isinstance(s, int) else tuple(int(n) for n in s)
        expect(result, want_shape, np.dtype(np.bool_))
        p = float(a["p"])
        if p == 0:
            assert result.all(), "p = 0 keeps everything"
        if p == 1:
            assert not result.any(), "p = 1 drops everything"
        assert np.array_equal(result, fn(*[a[n] for n in case.positional])), "not deterministic"

    case.run(fn, check)


def mask_shape(case, full):
    """A mask shape that broadcasts to ``full`` without enlarging it: a suffix of it, each dim
    kept or 1."""
    keep = case.draw(st.integers(0, len(full)), "mask ndim")
    return tuple(n if case.draw(st.booleans(), "mask dim kept") else 1
                 for n in full[len(full) - keep:])


def attention_problem(case, sdpa):
    """Valid arguments of scaled_dot_product_attention (``sdpa``) or attention, added to case."""
    dt = case.dtype()
    heads_kind = case.draw(st.sampled_from(["same", "one", "gqa"] if sdpa else ["same", "one"]),
                           "kv heads")
    if heads_kind == "gqa":
        kv_heads = case.draw(st.integers(1, 2), "Hkv")
        heads = kv_heads * case.draw(st.integers(2, 3), "group")
    else:
        heads = case.draw(st.integers(1, 3), "H")
        kv_heads = heads if heads_kind == "same" else 1
    batch_q, batch_k = case.draw(broadcastable_batches(max_ndim=2, max_dim=3), "batches")
    batch_v = batch_k if case.draw(st.booleans(), "value batch = key batch") else batch_q
    try:
        batch = np.broadcast_shapes(batch_q, batch_k, batch_v)
    except ValueError:                          # key and value broadcast only with query's
        batch_v, batch = batch_k, np.broadcast_shapes(batch_q, batch_k)
    length, n_keys, width, vwidth = (case.draw(sizes(), d) for d in ("L", "S", "E", "Ev"))

    def layout(batch_x, h, n, w, name):
        headless = not batch_x and h == 1 and case.draw(st.booleans(), f"{name} 2-D")
        return (n, w) if headless else batch_x + (h, n, w)

    q_shape = layout(batch_q, heads, length, width, "query")
    k_shape = layout(batch_k, kv_heads, n_keys, width, "key")
    v_shape = layout(batch_v, kv_heads, n_keys, vwidth, "value")
    if len(q_shape) == 2 and heads_kind == "gqa":
        q_shape = (heads, length, width)
    case.group = ["query", "key", "value", "attn_mask" if sdpa else "mask", "dout", "output",
                  "logsumexp"]
    q = case.add("query", case.array(q_shape, dt, name="query"))
    k = case.add("key", case.array(k_shape, dt, name="key"))
    v = case.add("value", case.array(v_shape, dt, name="value"))
    full = batch + (heads, length, n_keys)
    mask_kind = case.draw(st.sampled_from(["none", "bool", "float"]), "mask")
    mask = None
    if mask_kind != "none":
        m_shape = mask_shape(case, full)
        if mask_kind == "bool":
            mask = lay_out(case.rng.random(m_shape) < 0.7, case.draw(st.sampled_from(LAYOUTS)),
                           case.rng)
        else:
            mask = case.array(m_shape, dt, ("normal", "masked", "masked"), "mask")
    mask_name = "attn_mask" if sdpa else "mask"
    extra_head = (2,) + full
    case.add(mask_name, mask, [
        ("as int64", np.zeros(full, np.int64), True), ("as complex", np.zeros(full, complex), True),
        ("the other float dtype", np.zeros(full, other_float(dt)), DTYPE),
        ("as object", np.zeros(full, object), True), ("a string", "abc", True),
        ("a ragged list", RAGGED, True), ("an object", Malformed(), True),
        (f"shape {full[:-2] + (length + 2, n_keys)}", np.ones(full[:-2] + (length + 2, n_keys),
                                                             bool), True),
        (f"shape {extra_head}", np.ones(extra_head, bool), True), ("None", None, False)] +
        ([("a bool list", np.ones(full[-2:], bool).tolist(), False)] if length * n_keys else []))
    case.options["query"] = float_options(case, q, anchored=DTYPE, bad_shapes=[
        (length * width,), q_shape[:-1] + (width + 1,)])
    bad_k = [(n_keys * width,), k_shape[:-1] + (width + 2,)]    # (query's is E + 1)
    if len(k_shape) > 2:
        bad_k.append(k_shape[:-3] + (heads + 1,) + k_shape[-2:])
    if batch and batch[-1] != 1:
        bad_k.append((2 if batch[-1] == 0 else batch[-1] + 1,) + k_shape[-3:]
                     if len(k_shape) > 2 else (2 if batch[-1] == 0 else batch[-1] + 1,
                                               kv_heads, n_keys, width))
    case.options["key"] = float_options(case, k, anchored=DTYPE, bad_shapes=bad_k)
    bad_v = [(n_keys * vwidth,), v_shape[:-2] + (n_keys + 1, vwidth)]
    if len(v_shape) > 2:
        bad_v.append(v_shape[:-3] + (kv_heads + 1,) + v_shape[-2:])
    case.options["value"] = float_options(case, v, anchored=DTYPE, bad_shapes=bad_v)
    p = case.draw(st.sampled_from([0.0, 0.0, 0.0, 0.3, 1.0]), "dropout_p")
    seed = case.draw(st.integers(0, 2**64 - 1), "seed") if p > 0 or case.draw(
        st.booleans(), "seed given") else None
    case.add("dropout_p", p, probability_options(), keyword=True)
    case.add("seed", seed, seed_options(none_ok=p == 0), keyword=True)
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options(), keyword=True)
    scale = case.draw(st.one_of(st.none(), st.floats(-2, 2)), "scale")
    case.add("scale", scale, [("'2'", "2", True), ("True", True, True), ("1j", 1j, True),
                              ("np.array(1.0)", np.array(1.0), True), ("10**400", 10**400, True),
                              ("None", None, False), ("np.float32(0.5)", np.float32(0.5), False),
                              ("0", 0, False), ("Fraction(1, 2)", fractions.Fraction(1, 2), False)],
             keyword=True)
    case.add("causal_alignment", case.draw(st.sampled_from(["top-left", "bottom-right"]), "align"),
             choice_options(["top-left", "bottom-right"]), keyword=True)
    if sdpa:
        case.add("enable_gqa", heads_kind == "gqa" or case.draw(st.booleans(), "enable_gqa"),
                 flag_options(), keyword=True)
    return mask_name


def float_mask(mask):
    return isinstance(mask, np.ndarray) and mask.dtype.kind == "f"


def add_mask_grad(case, mask_name):
    has_float = float_mask(case.args[mask_name])
    case.add("mask_grad", has_float and case.draw(st.booleans(), "mask_grad"),
             [("1", 1, True), ("'True'", "True", True), ("None", None, True),
              ("True", True, not has_float), ("np.bool_(True)", np.bool_(True), not has_float),
              ("False", False, False)], keyword=True)


def attention_fixups(case, mask_name):
    """Arguments that are each right but wrong together, after ``mutate``: the message names
    the one listed here."""
    a = case.args
    p = a["dropout_p"]
    p_valid = "dropout_p" not in case.bad
    if p_valid and a["seed"] is None and float(p) > 0:
        case.bad.add("seed")                             # dropout needs a seed
    if a.get("mask_grad") is True or a.get("mask_grad") is np.True_:
        if not float_mask(a[mask_name]) and mask_name not in case.bad:
            case.bad.add("mask_grad")                    # only a float mask has a gradient
    if "enable_gqa" in a and a["enable_gqa"] is False and "enable_gqa" in case.changed:
        q, k = (np.asarray(a[n]) for n in ("query", "key"))
        if ({"query", "key"}.isdisjoint(case.bad) and q.ndim > 2 and k.ndim > 2 and
                q.shape[-3] != k.shape[-3] and k.shape[-3] != 1):
            case.bad.add("enable_gqa")                   # grouped-query heads need the flag


def attention_reference(a, mask_name):
    """(output, weights, logsumexp, keep) in float64 from the final arguments, as the
    reference computes them; ``keep`` from npattn.dropout_mask (the contract's mask)."""
    q, k, v = f64(a["query"]), f64(a["key"]), f64(a["value"])
    mask = a[mask_name]
    mask = None if mask is None else np.asarray(mask)
    mask = None if mask is None else (mask if mask.dtype == np.bool_ else f64(mask))
    heads = q.shape[-3] if q.ndim > 2 else 1
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    length, n_keys = q.shape[-2], k.shape[-2]
    p = float(a["dropout_p"])
    keep = None
    if p > 0:
        keep = npattn.dropout_mask((math.prod(batch), heads, length, n_keys), p, a["seed"])
        keep = keep.reshape(batch + (heads, length, n_keys))
    gqa = bool(a.get("enable_gqa", False)) and k.ndim > 2 and v.ndim > 2  # (2-D broadcasts)
    scale = (1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0) if a["scale"] is None \
        else float(a["scale"])                           # E = 0: npattn's scale is 1
    out, lse = reference.scaled_dot_product_attention_forward(
        q, k, v, mask, keep, p, bool(a["is_causal"]), scale, gqa, a["causal_alignment"])
    out_ndim = max(q.ndim, k.ndim, v.ndim)
    shape = (batch + (heads, length, v.shape[-1]))[-out_ndim:]
    return out.reshape(shape), lse.reshape(shape[:-1]), keep, mask, q, k, v, p, gqa, scale


def attention_scale(a, q, k, v):
    scale = abs(float(a["scale"])) if a["scale"] is not None else 1.0 / math.sqrt(
        max(q.shape[-1], 1))
    return 1.0 + np.abs(v).max(initial=0) * (1 + scale * np.abs(q).max(initial=0) *
                                             np.abs(k).max(initial=0) * q.shape[-1])


def gen_sdpa(case, fn, mode):
    """mode: "output" (scaled_dot_product_attention), "forward" (..._forward), "backward"."""
    mask_name = attention_problem(case, sdpa=True)
    if mode == "backward":
        valid = {n: case.args[n] for n in case.args}
        out, lse = npattn.scaled_dot_product_attention_forward(
            valid["query"], valid["key"], valid["value"], valid["attn_mask"],
            valid["dropout_p"], valid["is_causal"], valid["scale"], valid["enable_gqa"],
            seed=valid["seed"], causal_alignment=valid["causal_alignment"])
        dout = case.values(out.shape, out.dtype)
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[out.shape[:-1] + (out.shape[-1] + 1,)]),
                 keyword=True)
        case.add("output", out, float_options(case, out, anchored=DTYPE,
                                              bad_shapes=[(2,) + out.shape]), keyword=True)
        case.add("logsumexp", lse, float_options(case, lse, anchored=DTYPE,
                                                 bad_shapes=[lse.shape + (1,)]), keyword=True)
        add_mask_grad(case, "attn_mask")
    case.mutate()
    attention_fixups(case, "attn_mask")

    def check(result, a):
        out, lse, keep, mask, q, k, v, p, gqa, scale = attention_reference(a, mask_name)
        dt = dtype_of(a["query"])
        tol = 20.0 * attention_scale(a, q, k, v) * (k.shape[-2] + 1)
        if mode == "output":
            expect(result, out.shape, dt)
            if case.finite:
                close(result, out, dt, tol)
            return
        if mode == "forward":
            got_out, got_lse = result
            expect(got_out, out.shape, dt, "output")
            expect(got_lse, lse.shape, dt, "logsumexp")
            if case.finite:
                close(got_out, out, dt, tol, "output")
                close(got_lse, lse, dt, tol, "logsumexp")
            return
        grads = result
        want_mask_grad = bool(a["mask_grad"])
        assert len(grads) == 3 + want_mask_grad, f"{len(grads)} gradients"
        for g, x, what in zip(grads, (q, k, v, mask), ("dquery", "dkey", "dvalue", "dmask")):
            expect(g, x.shape, dt, what)
        if case.finite:
            want = reference.scaled_dot_product_attention_backward(
                f64(a["dout"]), q, k, v, mask, keep, p, bool(a["is_causal"]), scale, gqa,
                a["causal_alignment"])
            big = tol * (1 + np.abs(f64(a["dout"])).max(initial=0)) * max(q.shape[-2], 1) * 10
            for g, ref, what in zip(grads, want, ("dquery", "dkey", "dvalue", "dmask")):
                close(g, ref, dt, big, what)

    consistent = not (case.changed - {"query", "key", "value", "dout", "output", "logsumexp"})
    case.finite = case.finite and consistent      # forward's output is for the drawn arguments
    case.run(fn, check, call=(lambda f: f(**case.args)) if mode == "backward" else None)


def gen_attention(case, fn, backward):
    mask_name = attention_problem(case, sdpa=False)
    if backward:
        dout_shape = attention_reference(case.args, mask_name)[0].shape
        dout = case.values(dout_shape, dtype_of(case.args["query"]))
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            dout_shape[:-1] + (dout_shape[-1] + 1,)]), keyword=True)
        add_mask_grad(case, "mask")
    case.mutate()
    attention_fixups(case, "mask")

    def check(result, a):
        out, _, keep, mask, q, k, v, p, _, scale = attention_reference(a, mask_name)
        dt = dtype_of(a["query"])
        tol = 20.0 * attention_scale(a, q, k, v) * (k.shape[-2] + 1)
        if not backward:
            got_out, got_w = result
            expect(got_out, out.shape, dt, "output")
            expect(got_w, out.shape[:-1] + (k.shape[-2],), dt, "weights")
            if case.finite:
                close(got_out, out, dt, tol, "output")
                close(got_out, f64(got_w) @ v, dt, tol, "output = weights · value")
                if p == 0:                             # each row sums to 1, or 0 if masked
                    sums = f64(got_w).sum(axis=-1)
                    assert np.all((np.abs(sums - 1) < 1e-3) | (sums == 0)), "weight rows"
            return
        grads = result
        assert len(grads) == 3 + bool(a["mask_grad"]), f"{len(grads)} gradients"
        for g, x, what in zip(grads, (q, k, v, mask), ("dquery", "dkey", "dvalue", "dmask")):
            expect(g, x.shape, dt, what)
        if case.finite:
            want = reference.scaled_dot_product_attention_backward(
                f64(a["dout"]), q, k, v, mask, keep, p, bool(a["is_causal"]), scale, False,
                a["causal_alignment"])
            big = tol * (1 + np.abs(f64(a["dout"])).max(initial=0)) * max(q.shape[-2], 1) * 10
            for g, ref, what in zip(grads, want, ("dquery", "dkey", "dvalue", "dmask")):
                close(g, ref, dt, big, what)

    case.run(fn, check, call=lambda f: f(**case.args))


def gen_embedding(case, fn, backward):
    dt = case.dtype()
    n_rows, width = case.draw(dims(6), "V"), case.draw(dims(4), "E")
    case.group = ["weight", "dout"]
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "indices shape")
    if n_rows == 0:
        shape = shape[:-1] + (0,) if shape else (0,)
    indices = case.rng.integers(0, max(n_rows, 1), size=shape)
    if backward:
        dout = case.array(shape + (width,), dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            shape + (width + 1,), shape]))
    case.add("indices", indices, index_options(case, indices, stop=n_rows,
                                               bad_shapes=[(2,) + shape] if backward else []))
    weight = case.add("weight", case.array((n_rows, width), dt, name="weight"))
    case.options["weight"] = float_options(case, weight, anchored=DTYPE if backward else False,
                                           bad_shapes=[(n_rows,), (n_rows, width, 1)])
    pad = case.draw(st.one_of(st.none(), st.integers(-n_rows, n_rows - 1)) if n_rows else
                    st.none(), "padding_idx")
    case.add("padding_idx", pad, [("V", n_rows, True), ("-V - 1", -n_rows - 1, True),
                                  ("1.0", 1.0, True), ("'0'", "0", True), ("True", True, True),
                                  ("None", None, False)] +
             ([("np.int32(0)", np.int32(0), False)] if n_rows else []))
    case.mutate()

    def check(result, a):
        w = f64(a["weight"])
        idx = np.asarray(a["indices"])
        dt = dtype_of(a["weight"])
        if not backward:
            expect(result, idx.shape + (w.shape[1],), dt)
            close(result, w[idx], dt, 0.0)
            return
        expect(result, w.shape, dt)
        if case.finite:
            pad = a["padding_idx"]
            want = reference.embedding_backward(f64(a["dout"]), idx, w,
                                                None if pad is None else int(pad))
            close(result, want, dt, 10.0 * max(idx.size, 1))

    case.run(fn, check)


def gen_cross_entropy(case, fn, backward):
    dt = case.dtype()
    rank = case.draw(st.sampled_from([1, 2, 2, 3]), "input ndim")
    case.group = ["input", "dout"]
    classes = case.draw(dims(5), "C")
    n = case.draw(dims(4), "N")
    extra = case.draw(shapes(max_ndim=1, max_dim=3), "d") if rank == 3 else ()
    in_shape = (classes,) if rank == 1 else (n, classes) + extra
    t_shape = () if rank == 1 else (n,) + extra
    ignore = case.draw(st.sampled_from([-100, -1, 0, 2**63 - 1]), "ignore_index")
    target = case.rng.integers(0, max(classes, 1), size=t_shape)
    if classes == 0 or case.draw(st.booleans(), "some ignored"):
        target = np.where(case.rng.random(t_shape) < (1.0 if classes == 0 else 0.3), ignore,
                          target)
    target = np.asarray(target)
    if backward:
        reduction_default = case.draw(st.sampled_from(["mean", "sum", "none"]), "reduction")
        d_shape = t_shape if reduction_default == "none" else ()
        dout = case.array(d_shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE, bad_shapes=[
            d_shape + (2,)]))
    x = case.add("input", case.array(in_shape, dt, name="input"))
    case.options["input"] = float_options(case, x, anchored=DTYPE if backward else False,
                                          bad_shapes=[()])
    case.add("target", target, index_options(case, target, stop=classes, allowed=ignore,
                                             bad_shapes=[t_shape + (2,)]) +
             [("floats", target.astype(float), True)])
    case.add("ignore_index", ignore, [("2**63", 2**63, True), ("-2**63 - 1", -2**63 - 1, True),
                                      ("1.0", 1.0, True), ("'x'", "x", True), ("True", True, True),
                                      ("None", None, True)], keyword=True)
    reduction = reduction_default if backward else case.draw(
        st.sampled_from(["mean", "sum", "none"]), "reduction")
    case.add("reduction", reduction, [o for o in choice_options(["mean", "sum", "none"])
                                      if not backward or not o[1] in ("mean", "sum", "none")
                                      or o[1] == reduction], keyword=True)
    case.add("label_smoothing", case.draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]), "smoothing"),
             probability_options(), keyword=True)
    case.mutate()

    def check(result, a):
        x = f64(a["input"])
        t = np.asarray(a["target"])
        dt = dtype_of(a["input"])
        ref_args = (x, t.astype(np.int64), int(a["ignore_index"]), a["reduction"],
                    float(a["label_smoothing"]))
        if not backward:
            expect(result, t.shape if a["reduction"] == "none" else (), dt)
            if case.finite:
                close(result, reference.cross_entropy_forward(*ref_args), dt,
                      20.0 * (1 + np.abs(x).max(initial=0)) * max(t.size, 1))
            return
        expect(result, x.shape, dt)
        if case.finite:
            close(result, reference.cross_entropy_backward(f64(a["dout"]), *ref_args), dt,
                  20.0 * (1 + np.abs(f64(a["dout"])).max(initial=0)))

    case.run(fn, check)


def gen_layer_norm(case, fn, backward):
    dt = case.dtype()
    norm = case.draw(shapes(min_ndim=1, max_ndim=2, max_dim=5), "normalized_shape")
    lead = case.draw(shapes(max_ndim=2, max_dim=4), "lead")
    case.group = ["x", "weight", "bias", "dout"]
    shape = lead + norm
    if backward:
        dout = case.array(shape, dt, name="dout")
        case.add("dout", dout, float_options(case, dout, anchored=DTYPE,
                                             bad_shapes=[shape + (1,), (2,) + shape]))
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=DTYPE, bad_shapes=[
        lead + norm[:-1] + (norm[-1] + 1,)])
    ns = norm if case.draw(st.booleans(), "ns tuple") or len(norm) > 1 else norm[0]
    case.add("normalized_shape", ns, [
        ("()", (), True), ("a negative dim", (-1,), True), ("2.0", 2.0, True),
        ("'3'", "3", True), ("None", None, True), ("True", True, True),
        ("a mismatch", norm[:-1] + (norm[-1] + 2,), True), ("(2.0,)", (2.0,), True),
        ("a list", list(norm), False), ("np ints", tuple(np.int64(n) for n in norm), False),
        ("an array", np.array(norm), False)])
    for name in ("weight", "bias"):
        value = case.array(norm, dt, name=name) if case.draw(st.booleans(), name) else None
        case.add(name, value, float_options(case, case.values(norm, dt), anchored=DTYPE,
                                            optional=True, bad_shapes=[norm + (1,), ()]),
                 keyword=True)
    eps = case.draw(st.sampled_from([1e-5, 0.0, 1.0]), "eps")
    case.add("eps", eps, [("-1e-5", -1e-5, True), ("nan", math.nan, True), ("inf", math.inf, True),
                          ("'1e-5'", "1e-5", True), ("None", None, True), ("True", True, True),
                          ("10**400", 10**400, True), ("np.float32(1e-3)", np.float32(1e-3), False),
                          ("1", 1, False)], keyword=True)
    case.mutate()

    def check(result, a):
        x, w, b = f64(a["x"]), f64(a["weight"]), f64(a["bias"])
        dt = dtype_of(a["x"])
        ns = a["normalized_shape"]
        ns = tuple(int(n) for n in (ns if np.iterable(ns) else (ns,)))
        eps = float(a["eps"])
        if not backward:
            expect(result, x.shape, dt)
            if case.finite and eps > 0:
                want = reference.layer_norm_forward(x, ns, w, b, eps)
                close(result, want, dt, 20.0 * (1 + np.abs(want)).max(initial=1))
            return
        dx, dw, db = result
        expect(dx, x.shape, dt, "dx")
        for g, p, what in ((dw, w, "dweight"), (db, b, "dbias")):
            if p is None:
                assert g is None, f"{what} must be None"
            else:
                expect(g, p.shape, dt, what)
        if case.finite and eps >= 1e-5 and x.size:
            dout = f64(a["dout"])
            want = reference.layer_norm_backward(dout, x, ns, w, b, eps)
            d = math.prod(ns)
            # rstd can be 1/√eps: a row of (nearly) equal entries amplifies rounding
            amp = 1.0 / math.sqrt(eps) * (1 + np.abs(dout).max()) * (1 + np.abs(
                w if w is not None else 1).max()) * 20.0 * (d + x.size)
            for g, ref, what in zip(result, want, ("dx", "dweight", "dbias")):
                if g is not None:
                    close(g, ref, dt, amp, what)

    case.run(fn, check)


# ---------------------------------------------------------------------------- nn modules

def backward_first(case, module, dout):
    """``backward`` before any ``forward`` is a RuntimeError that says so."""
    COUNTS[case.target] += 1
    with pytest.raises(RuntimeError, match="before forward"):
        module.backward(dout)


def construct(case, cls, check=None):
    """Mutate and call the constructor; the module, or None when it rightly raised."""
    case.mutate()
    return case.run(cls, check or (lambda module, a: None))


def check_grads(module, finite):
    for name, param in module.named_parameters():
        expect(param.grad, param.data.shape, param.data.dtype, f"{name}.grad")
        if finite:
            assert np.all(np.isfinite(param.grad)), f"{name}.grad is not finite"


def module_dtype(case):
    dt = case.dtype()
    case.add("dtype", dt, dtype_options(), keyword=True)
    return dt


def built_dtype(a):
    return np.dtype(a["dtype"])


def gen_linear_module(case, cls):
    fin, fout = case.draw(dims(5), "in"), case.draw(dims(5), "out")
    case.add("in_features", fin, size_options(fin))
    case.add("out_features", fout, size_options(fout))
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    module_dtype(case)
    case.add("rng", case.draw(st.integers(0, 9), "rng"), rng_options(), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.weight.dtype
    fin, fout = module.in_features, module.out_features
    lead = case.draw(shapes(max_ndim=2, max_dim=4), "lead")
    backward_first(case, module, np.zeros(lead + (fout,), dt))
    case.stage()
    x = case.add("x", case.array(lead + (fin,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[(), lead + (fin + 1,)])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape[:-1] + (fout,), dt)
        if case.finite:
            b = None if module.bias is None else f64(module.bias.data)
            close(y, reference.linear_forward(x, f64(module.weight.data), b), dt,
                  20.0 * (1 + np.abs(x).sum(axis=-1, keepdims=True)))

    if case.run(module, check_forward) is None:
        return
    finite = case.finite
    case.stage()
    dout = case.add("dout", case.values(lead + (fout,), dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[lead + (fout + 1,), (2,) + lead + (fout,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, lead + (fin,), dt),
                                             check_grads(module, finite)))


def gen_dropout_module(case, cls):
    case.add("p", case.draw(st.sampled_from([0.0, 0.5, 1.0]), "p"), probability_options())
    case.add("seed", case.draw(st.integers(0, 9), "seed"), rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "shape")
    backward_first(case, module, np.zeros(shape, dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    x = case.add("x", case.array(shape, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=False)
    case.mutate()

    def check_forward(y, a):
        x = np.asarray(a["x"])
        expect(y, x.shape, x.dtype)
        if not module.training or module.p == 0:
            assert np.array_equal(y, x, equal_nan=True), "dropout off must return x"
        elif module.p == 1:
            assert not np.any(y), "p = 1 must zero everything"

    y = case.run(module, check_forward)
    if y is None:
        return
    case.stage()
    dout = case.add("dout", case.values(y.shape, y.dtype))
    case.options["dout"] = float_options(case, dout, anchored=False,
                                         bad_shapes=[y.shape + (1,), (2,) + y.shape])
    case.mutate()
    case.run(module.backward, lambda dx, a: expect(dx, y.shape, dtype_of(a["dout"])))


def sequence_input(case, dt, width, name="x"):
    """x (B, L, width) or (L, width), and the mask options for an (L, L) attention."""
    batch = case.draw(st.sampled_from([(), (1,), (2,)]), "batch")
    length = case.draw(dims(4), "L")
    x = case.add(name, case.array(batch + (length, width), dt, ("normal",) * 3 + ("nan", "huge"),
                                  name=name))
    case.options[name] = float_options(case, x, anchored=True, bad_shapes=[
        (width,), batch + (length, width + 1)])
    return batch, length


def gen_self_attention(case, cls):
    d_model, d_k = case.draw(st.integers(1, 5), "d_model"), case.draw(st.integers(1, 4), "d_k")
    case.add("d_model", d_model, size_options(d_model, 1))
    case.add("d_k", d_k, size_options(d_k, 1))
    d_v = case.draw(st.one_of(st.none(), st.integers(1, 4)), "d_v")
    case.add("d_v", d_v, optional_size_options(d_v))
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.0, 0.5]), "dropout"),
             probability_options(), keyword=True)
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    case.add("seed", 1, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.W_Q.weight.dtype
    backward_first(case, module, np.zeros((1, module.d_v), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batch, length = sequence_input(case, dt, module.d_model)
    full = batch + (length, length)
    mask = None
    kind = case.draw(st.sampled_from(["none", "bool", "float"]), "mask")
    if kind == "bool":
        mask = case.rng.random(mask_shape(case, full)) < 0.7
    elif kind == "float":
        mask = case.array(mask_shape(case, full), dt, ("normal", "masked"), "mask")
    case.add("mask", mask, [("as int64", np.zeros(full, np.int64), True),
                            ("the other float dtype", np.zeros(full, other_float(dt)), True),
                            ("a string", "abc", True),
                            (f"shape {full[:-1] + (length + 2,)}",
                             np.ones(full[:-1] + (length + 2,), bool), True),
                            ("None", None, False)])
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options())
    case.mutate()

    def check_forward(result, a):
        out, weights = result
        x = np.asarray(a["x"])
        expect(out, x.shape[:-1] + (module.d_v,), dt, "output")
        expect(weights, x.shape[:-1] + (x.shape[-2],), dt, "weights")
        if case.finite:
            assert np.all(np.isfinite(out)) and np.all(np.isfinite(weights)), "not finite"

    result = case.run(module, check_forward)
    if result is None:
        return
    finite = case.finite
    case.stage()
    out_shape = result[0].shape
    dout = case.add("dout", case.values(out_shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out_shape[:-1] + (out_shape[-1] + 1,)])
    case.mutate()
    x_shape = out_shape[:-1] + (module.d_model,)
    case.run(module.backward, lambda dx, a: (expect(dx, x_shape, dt, "dx"),
                                             check_grads(module, finite)))


def gen_multihead_attention(case, cls):
    heads = case.draw(st.integers(1, 3), "num_heads")
    embed = heads * case.draw(st.integers(1, 3), "head_dim")
    case.add("embed_dim", embed, size_options(embed, 1) + [
        ("embed_dim + 1", embed + 1, "embed_dim" if heads > 1 else False)])
    case.add("num_heads", heads, size_options(heads, 1) + [("embed_dim + 1", embed + 1, True)])
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.0, 0.5]), "dropout"),
             probability_options())
    for name in ("bias", "add_bias_kv", "add_zero_attn"):
        case.add(name, case.draw(st.booleans(), name), flag_options())
    for name in ("kdim", "vdim"):
        width = case.draw(st.one_of(st.none(), st.integers(1, 4)), name)
        case.add(name, width, optional_size_options(width))
    case.add("batch_first", case.draw(st.booleans(), "batch_first"), flag_options())
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    case.add("seed", 1, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.out_proj.weight.dtype
    backward_first(case, module, np.zeros((1, module.embed_dim), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batched = case.draw(st.booleans(), "batched")
    n = case.draw(st.integers(1, 2), "N")
    length, n_keys = case.draw(dims(3), "L"), case.draw(dims(3), "S")
    h = module.num_heads

    def layout(seq, width):
        if not batched:
            return (seq, width)
        return (n, seq, width) if module.batch_first else (seq, n, width)

    for name, seq, width in (("query", length, module.embed_dim), ("key", n_keys, module.kdim),
                             ("value", n_keys, module.vdim)):
        shape = layout(seq, width)
        x = case.add(name, case.array(shape, dt, ("normal",) * 3 + ("nan", "huge"), name=name))
        bad = [(width,), shape[:-1] + (width + 1,)]
        if name == "value":
            bad.append(layout(seq + 1, width))
        if batched and name == "key":
            bad.append((n + 1, seq, width) if module.batch_first else (seq, n + 1, width))
        case.options[name] = float_options(case, x, anchored=True, bad_shapes=bad)
    kpm_shape = (n, n_keys) if batched else (n_keys,)
    kpm = None
    if case.draw(st.booleans(), "key_padding_mask"):
        kpm = (case.rng.random(kpm_shape) < 0.3 if case.draw(st.booleans(), "bool kpm") else
               case.array(kpm_shape, dt, ("normal", "masked"), "key_padding_mask"))
    case.add("key_padding_mask", kpm, [
        ("as int64", np.zeros(kpm_shape, np.int64), True),
        ("the other float dtype", np.zeros(kpm_shape, other_float(dt)), True),
        (f"shape {kpm_shape + (1,)}", np.zeros(kpm_shape + (1,), bool), True),
        ("a ragged list", RAGGED, True), ("None", None, False)], keyword=True)
    case.add("need_weights", case.draw(st.booleans(), "need_weights"), flag_options(),
             keyword=True)
    mask_shapes = [(length, n_keys), ((n * h) if batched else h, length, n_keys)]
    mask = None
    if case.draw(st.booleans(), "attn_mask"):
        shape = case.draw(st.sampled_from(mask_shapes), "attn_mask shape")
        mask = (case.rng.random(shape) < 0.3 if case.draw(st.booleans(), "bool mask") else
                case.array(shape, dt, ("normal", "masked"), "attn_mask"))
    case.add("attn_mask", mask, [
        ("as int64", np.zeros((length, n_keys), np.int64), True),
        ("the other float dtype", np.zeros((length, n_keys), other_float(dt)), True),
        (f"shape {(length + 1, n_keys)}", np.zeros((length + 1, n_keys), bool), True),
        ("one mask plane too many", np.zeros(((n * h if batched else h) + 1, length, n_keys),
                                              bool), True),
        ("an object", Malformed(), True), ("None", None, False)], keyword=True)
    case.add("average_attn_weights", case.draw(st.booleans(), "average"), flag_options(),
             keyword=True)
    case.add("is_causal", case.draw(st.booleans(), "is_causal"), flag_options(), keyword=True)
    case.mutate()
    extra = (module.bias_k is not None) + module.add_zero_attn

    def check_forward(result, a):
        out, weights = result
        q = np.asarray(a["query"])
        s = np.asarray(a["key"]).shape[-2 if (batched and module.batch_first) or
                                       not batched else 0] + extra
        expect(out, q.shape, dt, "attn_output")
        if not a["need_weights"]:
            assert weights is None, "attn_weights must be None without need_weights"
        else:
            lead = (n,) if batched else ()
            heads = () if a["average_attn_weights"] else (h,)
            expect(weights, lead + heads + (length, s), dt, "attn_weights")
        if case.finite:
            assert np.all(np.isfinite(out)), "attn_output is not finite"

    result = case.run(module, check_forward)
    if result is None:
        return
    finite = case.finite
    shapes_in = [np.asarray(case.args[n]).shape for n in ("query", "key", "value")]
    case.stage()
    out_shape = result[0].shape
    dout = case.add("dout", case.values(out_shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out_shape[:-1] + (out_shape[-1] + 1,)])
    case.mutate()

    def check_backward(grads, a):
        assert len(grads) == 3, f"{len(grads)} gradients"
        for g, shape, what in zip(grads, shapes_in, ("dquery", "dkey", "dvalue")):
            expect(g, shape, dt, what)
        check_grads(module, finite)

    case.run(module.backward, check_backward)


def gen_embedding_module(case, cls):
    n_rows, width = case.draw(dims(5), "num_embeddings"), case.draw(dims(4), "embedding_dim")
    case.add("num_embeddings", n_rows, size_options(n_rows))
    case.add("embedding_dim", width, size_options(width))
    pad = case.draw(st.one_of(st.none(), st.integers(-n_rows, n_rows - 1)) if n_rows else
                    st.none(), "padding_idx")
    case.add("padding_idx", pad, [("num_embeddings", n_rows, True), ("1.0", 1.0, True),
                                  ("'0'", "0", True), ("None", None, False)])
    module_dtype(case)
    case.add("rng", 0, rng_options(), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    n_rows, width, dt = module.num_embeddings, module.embedding_dim, module.weight.dtype
    shape = case.draw(shapes(max_ndim=2, max_dim=4), "indices shape")
    if n_rows == 0:
        shape = shape[:-1] + (0,) if shape else (0,)
    backward_first(case, module, np.zeros(shape + (width,), dt))
    case.stage()
    indices = case.rng.integers(0, max(n_rows, 1), size=shape)
    case.add("indices", indices, index_options(case, indices, stop=n_rows))
    case.mutate()
    out = case.run(module, lambda y, a: (
        expect(y, np.asarray(a["indices"]).shape + (width,), dt),
        close(y, f64(module.weight.data)[np.asarray(a["indices"])], dt, 0.0)))
    if out is None:
        return
    case.stage()
    dout = case.add("dout", case.values(out.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[out.shape[:-1] + (width + 1,)])
    case.mutate()

    def check_backward(result, a):
        assert result is None, "Embedding.backward returns None (indices have no gradient)"
        check_grads(module, True)
        if module.padding_idx is not None:
            assert not module.weight.grad[module.padding_idx].any(), "padding row got a grad"

    case.run(module.backward, check_backward)


def gen_positional_encoding(case, cls):
    d_model = case.draw(st.integers(1, 6), "d_model")
    max_len = case.draw(st.integers(0, 6), "max_len")
    case.add("d_model", d_model, size_options(d_model, 1))
    case.add("max_len", max_len, size_options(max_len))
    case.add("dropout", case.draw(st.sampled_from([0.0, 0.1]), "dropout"), probability_options())
    module_dtype(case)
    case.add("seed", 0, rng_options("seed"), keyword=True)
    module = construct(case, cls)
    if module is None:
        return
    dt = module.pe.dtype
    backward_first(case, module, np.zeros((1, module.d_model), dt))
    if case.draw(st.booleans(), "eval"):
        module.eval()
    case.stage()
    batch = case.draw(st.sampled_from([(), (2,)]), "batch")
    length = case.draw(st.integers(0, module.max_len), "L")
    x = case.add("x", case.array(batch + (length, module.d_model), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[
        (module.d_model,), batch + (length, module.d_model + 1),
        batch + (module.max_len + 1, module.d_model)])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dt)
        if not module.training or module.dropout.p == 0:
            close(y, x + f64(module.pe)[0, :x.shape[-2]], dt, 1.0)

    y = case.run(module, check_forward)
    if y is None:
        return
    case.stage()
    dout = case.add("dout", case.values(y.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=False,
                                         bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: expect(dx, y.shape, dtype_of(a["dout"])))


def gen_layer_norm_module(case, cls):
    norm = case.draw(shapes(min_ndim=1, max_ndim=2, max_dim=4), "normalized_shape")
    case.add("normalized_shape", norm if len(norm) > 1 else norm[0], [
        ("()", (), True), ("(-1,)", (-1,), True), ("'3'", "3", True), ("None", None, True),
        ("2.0", 2.0, True), ("True", True, True), ("a list", list(norm), False)])
    case.add("eps", case.draw(st.sampled_from([1e-5, 0.1]), "eps"), [
        ("-1.0", -1.0, True), ("nan", math.nan, True), ("'x'", "x", True),
        ("10**400", 10**400, True), ("None", None, True), ("0", 0, False)])
    case.add("elementwise_affine", case.draw(st.booleans(), "affine"), flag_options())
    case.add("bias", case.draw(st.booleans(), "bias"), flag_options())
    module_dtype(case)
    module = construct(case, cls)
    if module is None:
        return
    norm = module.normalized_shape
    dt = case.dtype() if module.weight is None else module.weight.dtype
    lead = case.draw(shapes(max_ndim=2, max_dim=3), "lead")
    backward_first(case, module, np.zeros(lead + norm, dt))
    case.stage()
    x = case.add("x", case.array(lead + norm, dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=module.weight is not None, bad_shapes=[
        lead + norm[:-1] + (norm[-1] + 1,), ()])
    case.mutate()

    def check_forward(y, a):
        x = f64(a["x"])
        expect(y, x.shape, dtype_of(a["x"]))
        if case.finite and module.eps > 0:
            w = None if module.weight is None else f64(module.weight.data)
            b = None if module.bias is None else f64(module.bias.data)
            want = reference.layer_norm_forward(x, norm, w, b, module.eps)
            close(y, want, dtype_of(a["x"]), 20.0 * (1 + np.abs(want).max(initial=0)))

    y = case.run(module, check_forward)
    if y is None:
        return
    finite = case.finite and module.eps > 0      # eps = 0, a constant sample: 0/0 = NaN
    case.stage()
    dout = case.add("dout", case.values(y.shape, y.dtype))
    case.options["dout"] = float_options(case, dout, anchored=True,
                                         bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, y.shape, y.dtype),
                                             check_grads(module, finite)))


def gen_sequential(case, cls):
    dt = case.dtype()
    width = case.draw(st.integers(1, 4), "width")
    layers = [nn.Linear(width, width, dtype=dt, rng=0), nn.LayerNorm(width, dtype=dt),
              nn.Dropout(0.5, seed=0)]
    if case.draw(st.booleans(), "eval"):
        for layer in layers:
            layer.eval()
    for i, layer in enumerate(layers):
        case.add(f"argument {i}", layer, [("None", None, True), ("a function", np.tanh, True),
                                          ("a string", "Linear", True),
                                          ("the class", nn.Linear, True)])
    module = construct(case, cls, lambda m, a: (len(m) == len(layers)) or
                       pytest.fail("Sequential lost a module"))
    if module is None:
        return
    backward_first(case, module, np.zeros((1, width), dt))
    case.stage()
    lead = case.draw(shapes(max_ndim=2, max_dim=3), "lead")
    x = case.add("x", case.array(lead + (width,), dt, name="x"))
    case.options["x"] = float_options(case, x, anchored=True, bad_shapes=[lead + (width + 1,)])
    case.mutate()
    y = case.run(module, lambda y, a: expect(y, lead + (width,), dt))
    if y is None:
        return
    finite = case.finite
    case.stage()
    dout = case.add("dout", case.values(y.shape, dt))
    case.options["dout"] = float_options(case, dout, anchored=True, bad_shapes=[y.shape + (1,)])
    case.mutate()
    case.run(module.backward, lambda dx, a: (expect(dx, y.shape, dt),
                                             check_grads(module, finite)))


def gen_module_base(case, cls):
    """The base class's own methods, on a small model: state_dict round trips with wrong
    dicts, ``to``, ``train``, ``zero_grad``."""
    dt = case.dtype()
    model = nn.Sequential(nn.Linear(3, 2, dtype=dt, rng=0), nn.LayerNorm(2, dtype=dt))
    assert isinstance(model, cls)
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias"], list(state)
    good = {k: case.values(v.shape, v.dtype) for k, v in state.items()}
    missing = {k: v for k, v in good.items() if k != "1.bias"}
    extra = dict(good, extra=np.zeros(1))
    case.add("state_dict", good, [
        ("None", None, True), ("a list", [1, 2], True), ("a string", "abc", True),
        ("a wrong shape", dict(good, **{"0.weight": np.zeros((2, 4), dt)}),
         "state_dict['0.weight']"),
        ("int values", {k: v.astype(np.int64) for k, v in good.items()},
         "state_dict['0.weight']"),
        ("string values", {k: "abc" for k in good}, "state_dict['0.weight']"),
        ("ragged values", {k: RAGGED for k in good}, "state_dict['0.weight']"),
        ("a missing key", missing, "state_dict"), ("an extra key", extra, "state_dict"),
        ("float64 values", {k: v.astype(np.float64) for k, v in good.items()}, False),
        ("nested lists", {k: v.tolist() for k, v in good.items()}, False)])
    case.add("strict", case.draw(st.booleans(), "strict"),
             [("'yes'", "yes", True), ("None", None, True), ("1", 1, True),
              ("np.bool_(False)", np.bool_(False), False)])
    case.mutate()
    if case.args["state_dict"] is missing or case.args["state_dict"] is extra:
        if case.args["strict"] is False or case.args["strict"] is np.False_:
            case.bad.discard("state_dict")           # strict=False takes a partial dict

    def check_load(result, a):
        got = model.state_dict()
        for k, v in got.items():
            assert v.dtype == dt, f"{k} changed dtype to {v.dtype}"
            if isinstance(a["state_dict"], dict) and k in a["state_dict"]:
                close(v, f64(a["state_dict"][k]), dt, 1.0, k)

    case.run(model.load_state_dict, check_load)
    case.stage()
    case.add("dtype", dt, dtype_options() + [("None", None, False)])
    case.mutate()
    case.run(model.to, lambda m, a: [expect(p.data, p.data.shape, np.dtype(a["dtype"]))
                                     for p in m.parameters()])
    COUNTS[case.target] += 1
    model.train(case.draw(st.booleans(), "mode"))
    model.zero_grad()
    assert all(not p.grad.any() for p in model.parameters()), "zero_grad"


def gen_parameter(case, cls):
    dt = case.dtype()
    shape = case.draw(shapes(max_ndim=3, max_dim=4), "shape")
    data = case.add("data", case.array(shape, dt, name="data"))
    case.options["data"] = float_options(case, data, anchored=False)
    case.mutate()

    def check(param, a):
        want = np.asarray(a["data"])
        expect(param.data, want.shape, want.dtype, "data")
        expect(param.grad, want.shape, want.dtype, "grad")
        assert not param.grad.any(), "grad starts at zero"
        assert not np.shares_memory(param.data, want), "Parameter must own a copy"

    param = case.run(cls, check)
    if param is None:
        return
    case.stage()
    grad = case.add("grad", case.values(param.shape, param.dtype))
    case.options["grad"] = float_options(case, grad, anchored=False, bad_shapes=[
        param.shape + (2,), (3,) + param.shape])
    case.mutate()
    before = param.grad.copy()
    case.run(param.accumulate, lambda r, a: close(param.grad, before + f64(a["grad"]),
                                                  param.dtype, 1.0, "grad"))


# ---------------------------------------------------------------------------- optimisers

def real_options(name, minimum_zero=True):
    options = [("'0.1'", "0.1", True), ("None", None, True), ("True", True, True),
               ("nan", math.nan, minimum_zero), ("10**400", 10**400, True), ("1j", 1j, True),
               ("np.array(0.1)", np.array(0.1), True), ("np.float32(0.1)", np.float32(0.1), False),
               ("Fraction(1, 10)", fractions.Fraction(1, 10), False), ("0", 0, False)]
    if minimum_zero:
        options.append(("-0.1", -0.1, True))
    return options


def gen_optimizer(case, cls):
    dt = case.dtype()
    model = nn.Sequential(nn.Linear(3, 2, dtype=dt, rng=0), nn.LayerNorm(2, dtype=dt))
    params = model.parameters()
    sgd = cls is optim.SGD
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}]
    case.add("params", params if case.draw(st.booleans(), "groups") else groups, [
        ("None", None, True), ("one Parameter", params[0], True),
        ("an array", params[0].data, True), ("[]", [], True), ("ints", [1, 2], True),
        ("a set", set(params), True), ("a repeated Parameter", [params[0], params[0]], True),
        ("a string", "abc", True), ("a group without params", [{"lr": 0.1}], True),
        ("a group that is not a dict", [groups[0], 3], "param_groups"),
        ("a group with a bad lr", [{"params": params, "lr": -1.0}], "lr"),
        ("a Parameter in two groups", [{"params": params}, {"params": params[:1]}], True),
        ("a generator", (p for p in params), False),
        ("a tuple", tuple(params), False)])
    case.add("lr", case.draw(st.sampled_from([0.1, 0.0, 1e-3]), "lr"), real_options("lr"))
    if sgd:
        case.add("momentum", case.draw(st.sampled_from([0.0, 0.9]), "momentum"),
                 real_options("momentum"))
        case.add("dampening", case.draw(st.sampled_from([0.0, 0.1]), "dampening"),
                 real_options("dampening", minimum_zero=False))
        case.add("weight_decay", case.draw(st.sampled_from([0.0, 0.01]), "wd"),
                 real_options("weight_decay"))
        case.add("nesterov", case.draw(st.booleans(), "nesterov"),
                 [("'yes'", "yes", False), ("False", False, False)])
    else:
        case.add("betas", case.draw(st.sampled_from([(0.9, 0.999), (0.0, 0.5)]), "betas"), [
            ("(0.9,)", (0.9,), True), ("(1.0, 0.9)", (1.0, 0.9), True),
            ("(0.9, -0.1)", (0.9, -0.1), True), ("'ab'", "ab", True), ("None", None, True),
            ("(0.9, 'x')", (0.9, "x"), True), ("(nan, 0.9)", (math.nan, 0.9), True),
            ("an array", np.array([0.9, 0.99]), True), ("(10**400, 0.9)", (10**400, 0.9), True),
            ("[0.9, 0.99]", [0.9, 0.99], False), ("(0, 0)", (0, 0), False)])
        case.add("eps", case.draw(st.sampled_from([1e-8, 0.0]), "eps"), real_options("eps"))
        case.add("weight_decay", case.draw(st.sampled_from([0.0, 0.01]), "wd"),
                 real_options("weight_decay"))
        case.add("amsgrad", case.draw(st.booleans(), "amsgrad"),
                 [("'yes'", "yes", False), ("False", False, False)])
    case.add("maximize", case.draw(st.booleans(), "maximize"), [("1", 1, False)])
    case.mutate()
    if sgd and "nesterov" not in case.bad and case.args["nesterov"] and \
            {"momentum", "dampening"}.isdisjoint(case.bad):
        mu, tau = float(case.args["momentum"]), float(case.args["dampening"])
        if mu <= 0 or tau != 0:
            case.bad.add("nesterov")                     # needs momentum and no dampening
    opt = case.run(cls, lambda o, a: None)
    if opt is None:
        return
    owned = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, owned)) == sorted(map(id, params)), "param_groups lost a parameter"
    finite = True                                        # no NaN grad so far (state keeps it)
    for step in range(case.draw(st.integers(1, 2), "steps")):
        case.stage()
        for i, param in enumerate(params):
            param.grad = case.array(param.shape, param.dtype, ("normal",) * 5 + ("nan",),
                                    name=f"grad {i}")
        target = params[case.draw(st.integers(0, len(params) - 1), "which grad")]
        grad = target.grad
        case.add("grad", grad, [
            (f"shape {grad.shape + (1,)}", np.zeros(grad.shape + (1,), dt), True),
            ("as int64", grad.astype(np.int64), True), ("the other float dtype",
                                                       grad.astype(other_float(dt)), True),
            ("a ragged list", RAGGED, True), ("a string", "abc", True),
            ("None", None, False), ("a list", grad.tolist(), dt == F32)])
        case.add("closure", None, [("a string", "abc", True), ("a callable", lambda: 1.5, False)],
                 keyword=True)
        case.mutate(most=1)
        target.grad = case.args.pop("grad")
        case.positional.remove("grad")
        before = [p.data.copy() for p in params]
        finite = finite and case.finite

        def check_step(loss, a):
            assert loss == (None if a["closure"] is None else 1.5), "step returns the loss"
            for p, old in zip(params, before):
                expect(p.data, old.shape, dt, "data")
                if finite:
                    assert np.all(np.isfinite(p.data)), "a finite step gave non-finite data"

        if case.run(opt.step, check_step) is None and case.bad:
            target.grad = np.zeros_like(target.data)   # (parameters before it were updated)
    case.stage()
    saved = opt.state_dict()
    fresh = cls([{"params": g["params"]} for g in opt.param_groups],
                **({"lr": 0.1} if sgd else {}))
    bad_state = {"state": {0: {k: np.zeros(7) for k in ("momentum_buffer", "exp_avg",
                                                        "exp_avg_sq")}},
                 "param_groups": saved["param_groups"]}
    case.add("state_dict", saved, [
        ("None", None, True), ("{}", {}, True), ("a list", [], True),
        ("without state", {"param_groups": saved["param_groups"]}, True),
        ("groups not a list", {"state": {}, "param_groups": 3}, True),
        ("state not a dict", {"state": 3, "param_groups": saved["param_groups"]}, True),
        ("a group without params", {"state": {}, "param_groups": [{"lr": 0.1}]}, True),
        ("one group too many", {"state": {}, "param_groups": saved["param_groups"] * 2}, True),
        ("state for a stranger", {"state": {99: {}}, "param_groups": saved["param_groups"]},
         True),
        ("a state of the wrong shape", bad_state, True if sgd or saved["state"] else "state"),
        ("a bad lr", {"state": {}, "param_groups": [dict(g, lr=-1.0) for g in
                                                     saved["param_groups"]]}, "lr")])
    case.mutate(most=1)
    if case.args["state_dict"] is bad_state:
        case.bad = {"state", "state_dict"}
    case.run(fresh.load_state_dict, lambda r, a: None)


# ---------------------------------------------------------------------------- gradcheck

def tanh_backward(dout, x):
    return dout * (1 - np.tanh(x) ** 2)


def gen_gradcheck(case, fn):
    """gradcheck on tiny problems: a right backward passes, a wrong one fails (GradcheckError
    when raise_exception), and every wrong argument is a ValueError/TypeError naming it."""
    shape = case.draw(shapes(max_ndim=2, max_dim=3), "shape")
    problem = case.draw(st.sampled_from(["tanh", "linear", "softmax"]), "problem")
    wrong = case.draw(st.sampled_from([False, False, True]), "wrong backward")
    factor = 2.0 if wrong else 1.0
    x = case.values(shape, F64)
    if problem == "tanh":
        forward, inputs, out_shape = np.tanh, (x,), shape

        def backward(d, x):
            return factor * tanh_backward(d, x)
    elif problem == "linear":
        w = case.values((2, shape[-1] if shape else 1), F64)
        x = x.reshape(shape if shape else (1,))
        forward, inputs, out_shape = npattn.linear, (x, w), x.shape[:-1] + (2,)

        def backward(d, x, w):
            return tuple(factor * g for g in npattn.linear_backward(d, x, w)[:2])
    else:
        forward, inputs, out_shape = npattn.softmax, (x,), shape

        def backward(d, y):
            return factor * npattn.softmax_backward(d, npattn.softmax(y))
    wrong = wrong and math.prod(out_shape) > 0 and all(a.size for a in inputs) and not (
        problem == "softmax" and (not shape or shape[-1] < 2))   # a constant: gradient 0
    case.add("forward", forward, [
        ("3", 3, True), ("a string result", lambda *a: "abc", True),
        ("a None result", lambda *a: None, True),
        ("a random forward", lambda *a: np.random.default_rng().random(out_shape),
         math.prod(out_shape) > 0)])
    case.add("backward", backward, [
        ("too many gradients", lambda d, *a: (None,) * (len(a) + 1), len(inputs) > 0),
        ("a string gradient", lambda d, *a: ("abc",) * len(a), True),
        ("a wrong shape", lambda d, *a: tuple(np.zeros(np.shape(v) + (2,)) for v in a), True),
        ("None gradients", lambda d, *a: (None,) * len(a), False)])
    case.add("inputs", inputs, [("a dict", {"x": x}, True), ("None", None, True),
                                ("an int", 3, True), ("a list", list(inputs), False)])
    case.add("dout", None, [(f"shape {out_shape + (2,)}", np.zeros(out_shape + (2,)), True),
                            ("a string", "abc", True), ("a ragged list", RAGGED, True),
                            ("zeros", np.zeros(out_shape), False),
                            ("float32", np.ones(out_shape, np.float32), False)], keyword=True)
    for name, good in (("eps", 1e-6), ("atol", 1e-5), ("rtol", 1e-3)):
        case.add(name, good, [("-1.0", -1.0, True), ("nan", math.nan, True),
                              ("'x'", "x", True), ("None", None, True),
                              ("np.float32(0.01)", np.float32(0.01), False)], keyword=True)
    case.args["eps"] = 1e-6
    case.options["eps"].append(("0.0", 0.0, True))
    case.add("seed", case.draw(st.integers(0, 99), "seed"),
             [("-1", -1, True), ("'x'", "x", True), ("1.5", 1.5, True), ("None", None, True),
              ("2**64", 2**64, False), ("np.int64(3)", np.int64(3), False)], keyword=True)
    case.add("raise_exception", case.draw(st.booleans(), "raise_exception"), keyword=True)
    case.mutate()
    a = case.args
    shape_problem = case.choice.get("backward") == "a wrong shape"
    if shape_problem and not a["raise_exception"]:
        case.bad.discard("backward")                 # reported (report.ok False), not raised
    wrong = wrong and a["dout"] is None and "backward" not in case.changed and \
        "forward" not in case.changed
    if {"forward", "backward"} & case.changed:
        wrong = False
    case.finite = not (wrong or {"eps", "atol", "rtol", "dout", "backward"} & case.changed)

    def check(report, a):
        assert isinstance(report, gradcheck_module_.GradcheckReport), type(report).__name__
        if case.finite:
            assert report.ok, f"a right backward failed the check:\n{report}"
        if wrong or shape_problem:
            assert not report.ok, "a wrong backward passed"
        str(report), repr(report)

    def call(f):
        try:
            return f(a["forward"], a["backward"], a["inputs"], **{
                k: v for k, v in a.items() if k not in ("forward", "backward", "inputs")})
        except gradcheck_module_.GradcheckError as exc:
            if isinstance(exc, ValueError):
                raise
            assert a["raise_exception"], "GradcheckError without raise_exception"
            assert wrong or not case.finite, f"a right backward failed the check:\n{exc}"
            return None

    result = case.run(fn, lambda r, a: r is None or check(r, a), call=call)
    return result


def gen_gradcheck_module(case, fn):
    dt = case.dtype()
    kind = case.draw(st.sampled_from(["linear", "layer_norm", "embedding"]), "module")
    if kind == "linear":
        module, inputs = nn.Linear(3, 2, dtype=dt, rng=0), (case.values((2, 3), F64),)
    elif kind == "layer_norm":
        module, inputs = nn.LayerNorm(3, dtype=dt), (case.values((2, 3), F64),)
    else:
        module, inputs = nn.Embedding(4, 2, dtype=dt, rng=0), (np.array([0, 3, 3]),)
    case.add("module", module, [("3", 3, True), ("None", None, True), ("a string", "abc", True),
                                ("a function", np.tanh, True)])
    case.add("inputs", inputs, [("a dict", {"x": 1}, True), ("None", None, True)])
    case.add("output", None, [("3", 3, True), ("a string", "x", True),
                              ("the first", lambda r: r, False)], keyword=True)
    case.add("eps", 1e-6, [("0", 0, True), ("'x'", "x", True), ("nan", math.nan, True)],
             keyword=True)
    case.add("seed", 0, [("-1", -1, True), ("'x'", "x", True)], keyword=True)
    case.mutate()
    before = {k: v.copy() for k, v in module.state_dict().items()}

    def check(report, a):
        assert report.ok, f"{kind}: a right module failed the check:\n{report}"
        after = module.state_dict()
        assert all(np.array_equal(after[k], v) for k, v in before.items()), \
            "gradcheck_module changed the caller's module"

    case.run(fn, check, call=lambda f: f(case.args["module"], case.args["inputs"], **{
        k: v for k, v in case.args.items() if k not in ("module", "inputs")}))


# ---------------------------------------------------------------------------- nn.init

INIT_FUNCTIONS = ("uniform", "normal", "constant", "zeros", "ones", "xavier_uniform",
                  "xavier_normal", "kaiming_uniform", "kaiming_normal", "calculate_gain",
                  "fan_in_and_fan_out", "generator", "float_dtype", "size", "float_input")


def gen_init(case, fn):
    """Every initialiser and shared check of nn.init, each argument fuzzed."""
    init = nn.init
    name = case.draw(st.sampled_from(INIT_FUNCTIONS), "function")
    fn = getattr(init, name)
    case.target = f"nn.init.{name}"
    shape = case.draw(shapes(min_ndim=0, max_ndim=3, max_dim=4), "shape")
    needs_2d = name.startswith(("xavier", "kaiming")) or name == "fan_in_and_fan_out"
    if needs_2d and len(shape) < 2:
        shape = shape + (2,) * (2 - len(shape))
    shape_options = [("(-1, 2)", (-1, 2), True), ("(2.0, 2)", (2.0, 2), True),
                     ("'ab'", "ab", True), ("None", None, True), ("(True, 2)", (True, 2), True),
                     ("a list", list(shape), False)]
    if needs_2d:
        shape_options.append(("(3,)", (3,), True))
    real = [("'x'", "x", True), ("None", None, True), ("1j", 1j, True),
            ("10**400", 10**400, True), ("np.float32(0.5)", np.float32(0.5), False)]
    if name in ("uniform", "normal", "constant", "zeros", "ones", "xavier_uniform",
                "xavier_normal", "kaiming_uniform", "kaiming_normal", "fan_in_and_fan_out"):
        case.add("shape", shape, shape_options)
    if name == "uniform":
        case.add("a", -1.0, real)
        case.add("b", 1.0, real)
    if name == "normal":
        case.add("mean", 0.0, real)
        case.add("std", 1.0, real + [("-1.0", -1.0, True), ("nan", math.nan, True)])
    if name == "constant":
        case.add("value", 0.5, real[:-1])
    if name in ("xavier_uniform", "xavier_normal"):
        case.add("gain", 1.0, real + [("-1.0", -1.0, name == "xavier_normal"),
                                      ("inf", math.inf, True)])
    if name in ("kaiming_uniform", "kaiming_normal"):
        case.add("a", math.sqrt(5), [o for o in real if o[0] != "None"] + [("None", None, False)])
        case.add("mode", case.draw(st.sampled_from(["fan_in", "fan_out"]), "mode"),
                 choice_options(["fan_in", "fan_out"]))
        case.add("nonlinearity", "leaky_relu", choice_options(["leaky_relu", "relu", "tanh"]))
    if name in INIT_FUNCTIONS[:9]:
        if name not in ("constant", "zeros", "ones"):
            case.add("rng", 0, rng_options(), keyword=True)
        module_dtype(case)
    if name == "calculate_gain":
        case.add("nonlinearity", case.draw(st.sampled_from(["relu", "leaky_relu", "tanh"]),
                                           "nonlinearity"),
                 choice_options(["relu", "leaky_relu", "linear", "selu"]))
        case.add("param", None, real + [("None", None, False), ("0.2", 0.2, False)])
    if name == "generator":
        case.add("value", 0, rng_options("value"))
    if name == "float_dtype":
        case.add("dtype", np.float32, dtype_options())
    if name == "size":
        case.add("name", "width")
        case.add("value", 3, size_options(3, 1))
        case.add("minimum", 1)
    if name == "float_input":
        dt = case.dtype()
        case.add("name", "x")
        x = case.add("value", case.values(shape, dt))
        case.options["value"] = [(o[0], o[1], "x" if o[2] else False)
                                 for o in float_options(case, x, anchored=True)]
        case.add("dtype", dt)
        case.add("owner", "Test")
    case.mutate()
    if name == "calculate_gain" and case.args["nonlinearity"] != "leaky_relu" and \
            "param" in case.bad:
        case.bad.discard("param")                    # param is read by leaky_relu only
    rename = {"size": "width", "generator": "rng"}      # these name what the caller says
    if name in rename:
        case.bad = {rename[name] if b == "value" else b for b in case.bad}

    def check(result, a):
        if name in INIT_FUNCTIONS[:9]:
            s = a["shape"]
            expect(result, tuple(s), np.dtype(a["dtype"]))
            assert np.all(np.isfinite(result)), "initial values are not finite"
        elif name == "fan_in_and_fan_out":
            s = tuple(a["shape"])
            receptive = math.prod(s[2:])
            assert result == (s[1] * receptive, s[0] * receptive), result

    case.run(fn, check)


# ---------------------------------------------------------------------------- the table

class Target:
    """A case generator bound to the callable it exercises: ``Target(case)`` runs one case."""

    def __init__(self, gen, fn, **kw):
        self.gen, self.fn, self.kw = gen, fn, kw
        self.key = (gen, id(fn), tuple(sorted(kw.items())))

    def __call__(self, case):
        return self.gen(case, self.fn, **self.kw)


FUNCTIONAL = {  # name -> (generator, its options); the callable is getattr(npattn, name)
    "linear": (gen_linear, dict(backward=False)),
    "linear_forward": (gen_linear, dict(backward=False)),
    "linear_backward": (gen_linear, dict(backward=True)),
    "matmul": (gen_matmul, dict(backward=False)),
    "matmul_forward": (gen_matmul, dict(backward=False)),
    "matmul_backward": (gen_matmul, dict(backward=True)),
    "softmax": (gen_softmax, dict(log=False, backward=False)),
    "softmax_forward": (gen_softmax, dict(log=False, backward=False)),
    "softmax_backward": (gen_softmax, dict(log=False, backward=True)),
    "log_softmax": (gen_softmax, dict(log=True, backward=False)),
    "log_softmax_forward": (gen_softmax, dict(log=True, backward=False)),
    "log_softmax_backward": (gen_softmax, dict(log=True, backward=True)),
    "dropout": (gen_dropout, dict(backward=False)),
    "dropout_forward": (gen_dropout, dict(backward=False)),
    "dropout_backward": (gen_dropout, dict(backward=True)),
    "dropout_mask": (gen_dropout_mask, {}),
    "scaled_dot_product_attention": (gen_sdpa, dict(mode="output")),
    "scaled_dot_product_attention_forward": (gen_sdpa, dict(mode="forward")),
    "scaled_dot_product_attention_backward": (gen_sdpa, dict(mode="backward")),
    "attention": (gen_attention, dict(backward=False)),
    "attention_forward": (gen_attention, dict(backward=False)),
    "attention_backward": (gen_attention, dict(backward=True)),
    "embedding": (gen_embedding, dict(backward=False)),
    "embedding_forward": (gen_embedding, dict(backward=False)),
    "embedding_backward": (gen_embedding, dict(backward=True)),
    "cross_entropy": (gen_cross_entropy, dict(backward=False)),
    "cross_entropy_forward": (gen_cross_entropy, dict(backward=False)),
    "cross_entropy_backward": (gen_cross_entropy, dict(backward=True)),
    "layer_norm": (gen_layer_norm, dict(backward=False)),
    "layer_norm_forward": (gen_layer_norm, dict(backward=False)),
    "layer_norm_backward": (gen_layer_norm, dict(backward=True)),
}
OTHERS = {  # name -> (generator, the class or function it exercises)
    "nn.Module": (gen_module_base, nn.Module),
    "nn.Parameter": (gen_parameter, nn.Parameter),
    "nn.Sequential": (gen_sequential, nn.Sequential),
    "nn.Linear": (gen_linear_module, nn.Linear),
    "nn.Dropout": (gen_dropout_module, nn.Dropout),
    "nn.SelfAttention": (gen_self_attention, nn.SelfAttention),
    "nn.MultiheadAttention": (gen_multihead_attention, nn.MultiheadAttention),
    "nn.Embedding": (gen_embedding_module, nn.Embedding),
    "nn.PositionalEncoding": (gen_positional_encoding, nn.PositionalEncoding),
    "nn.LayerNorm": (gen_layer_norm_module, nn.LayerNorm),
    "optim.SGD": (gen_optimizer, optim.SGD),
    "optim.Adam": (gen_optimizer, optim.Adam),
    "optim.AdamW": (gen_optimizer, optim.AdamW),
    "gradcheck.gradcheck": (gen_gradcheck, gradcheck_module_.gradcheck),
    "gradcheck.gradcheck_module": (gen_gradcheck_module, gradcheck_module_.gradcheck_module),
}
_INIT = Target(gen_init, nn.init)
#: public name -> the Target that fuzzes it (nn.init's functions share one: each case draws
#: which function it calls)
TABLE = {**{name: Target(gen, getattr(npattn, name), **kw)
            for name, (gen, kw) in FUNCTIONAL.items()},
         **{name: Target(gen, fn) for name, (gen, fn) in OTHERS.items()},
         "nn.init": _INIT, **{f"nn.init.{name}": _INIT for name in INIT_FUNCTIONS}}


def public_names():
    """Every name the fuzz table must cover, from the packages themselves."""
    names = {n for n in npattn.__all__ if callable(getattr(npattn, n))}
    names |= {f"nn.{n}" for n in nn.__all__}
    names |= {f"nn.init.{n}" for n in nn.init.__all__}
    defined = {n for n, v in vars(nn.init).items()
               if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") ==
               nn.init.__name__}
    assert defined <= set(nn.init.__all__), f"nn.init defines {defined - set(nn.init.__all__)} " \
        "outside its __all__"
    names |= {f"optim.{n}" for n, v in vars(optim).items()
              if isinstance(v, type) and issubclass(v, optim.Optimizer)
              and v is not optim.Optimizer}
    names |= {f"gradcheck.{n}" for n, v in vars(gradcheck_module_).items()
              if callable(v) and not isinstance(v, type) and not n.startswith("_")
              and getattr(v, "__module__", "") == gradcheck_module_.__name__}
    return names


def targets():
    """Distinct runs: aliases (``softmax`` is ``softmax_forward``) run once, under both names."""
    runs = {}
    for name in sorted(TABLE):
        if not name.startswith("nn.init."):
            runs.setdefault(TABLE[name].key, []).append(name)
    return {" = ".join(names): TABLE[names[0]] for names in runs.values()}


# ---------------------------------------------------------------------------- the child

COUNTS = collections.Counter()    # calls made, per target (a module case makes several)
CASES = collections.Counter()     # Hypothesis examples run, per target


def main():
    """Run every target's fuzz cases; print a summary; 0 when all passed."""
    only = {n for n in os.environ.get("NPATTN_FUZZ_ONLY", "").split(",") if n}
    failures = []
    start = time.perf_counter()
    for label, runner in targets().items():
        if only and not only & set(label.split(" = ")):
            continue
        print(f"fuzz: {label}", end="", flush=True)
        begin, calls = time.perf_counter(), sum(COUNTS.values())

        @hypothesis_seed(SEED)
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), print_blob=True)
        @given(data=st.data())
        def fuzz(data):
            CASES[label] += 1
            with np.errstate(all="ignore"):        # NaN/inf inputs: no RuntimeWarning noise
                runner(Case(data, label))

        try:
            fuzz()
        except Exception:                          # noqa: BLE001 -- report it, go on
            failures.append(label)
            print(f"\nFAILED {label}:\n{traceback.format_exc()}", flush=True)
        print(f": {sum(COUNTS.values()) - calls} calls, {time.perf_counter() - begin:.1f} s",
              flush=True)
    print(f"fuzz cases run: {sum(CASES.values())} ({sum(COUNTS.values())} calls) over "
          f"{len(CASES)} targets covering {len(TABLE)} public names, {EXAMPLES} examples per "
          f"target, seed {SEED}, {time.perf_counter() - start:.1f} s", flush=True)
    if failures:
        print(f"fuzz FAILED: {', '.join(failures)}", flush=True)
    return 1 if failures else 0


# ---------------------------------------------------------------------------- the tests

def test_fuzz_table_covers_every_public_name():
    """A new public function, module, optimiser or check must get a fuzz generator."""
    missing = public_names() - set(TABLE)
    stale = set(TABLE) - public_names()
    assert not missing, f"public names the fuzz table does not cover: {sorted(missing)}"
    assert not stale, f"fuzz table entries that are not public names: {sorted(stale)}"
    for name in FUNCTIONAL:
        assert TABLE[name].fn is getattr(npattn, name), name


def _fake_op(behaviour):
    def op(x, dim=-1):
        np.asarray(x)
        if behaviour == "index error":
            raise IndexError("index 7 is out of bounds")
        if behaviour == "anonymous error" or (behaviour == "reject" and not isinstance(
                dim, int)):
            raise ValueError("something went wrong")
        return np.asarray(x)
    return op


@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data())
def test_the_harness_can_fail(data):
    """The judge itself: an IndexError escapes, an error that names no argument fails, a wrong
    argument accepted fails, a valid call that raises fails."""
    case = Case(data, "fake")
    case.add("x", np.ones(3))
    case.add("dim", -1, [("'0'", "0", True)])
    with pytest.raises(IndexError):
        case.run(_fake_op("index error"), lambda r, a: None)
    with pytest.raises(AssertionError, match="valid call raised"):
        case.run(_fake_op("anonymous error"), lambda r, a: None)
    case.mutate(most=1)
    case.args["dim"], case.bad = "0", {"dim"}
    with pytest.raises(AssertionError, match="names none of the wrong arguments"):
        case.run(_fake_op("reject"), lambda r, a: None)
    with pytest.raises(AssertionError, match="accepted the wrong"):
        case.run(_fake_op("accept"), lambda r, a: None)


def test_fuzz_every_public_name_in_a_subprocess(capsys):
    """The fuzz cases, in a child process: a crash is a failure with the child's stderr."""
    env = {**os.environ, "NPATTN_FUZZ_EXAMPLES": str(EXAMPLES), "NPATTN_FUZZ_SEED": str(SEED),
           "PYTHONFAULTHANDLER": "1"}
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_fuzz; "
            f"sys.exit(test_fuzz.main())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=TESTS.parent, timeout=TIMEOUT)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("fuzz cases run")]
    with capsys.disabled():
        print("\n" + (summary[0] if summary else "fuzz: no summary line"))
    assert proc.returncode == 0, (f"fuzz child exited with {proc.returncode}\n--- stdout (tail)\n"
                                  f"{proc.stdout[-12000:]}\n--- stderr (tail)\n"
                                  f"{proc.stderr[-6000:]}")
    assert summary, proc.stdout[-2000:]
