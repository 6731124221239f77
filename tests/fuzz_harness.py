"""The fuzz harness (``tests/test_fuzz.py`` explains the whole): how a case draws valid
arguments, replaces some with wrong ones, runs the call and judges the outcome, and the
option generators the per-op case generators share.
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
COUNTS = collections.Counter()    # calls made, per target (a module case makes several)
CASES = collections.Counter()     # Hypothesis examples run, per target

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


