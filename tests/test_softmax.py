"""softmax / log_softmax, forward and backward, against the float64 textbook and against PyTorch."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, f64
from npattn import reference
from npattn.functional.softmax import (log_softmax, log_softmax_backward, log_softmax_forward,
                                       softmax, softmax_backward, softmax_forward)
from npattn.kernels.softmax import (log_softmax_backward_kernel, softmax_backward_kernel,
                                    softmax_forward_kernel)
from strategies import arrays, dims, dtypes, shapes

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

OPS = ("softmax", "log_softmax")
FORWARD = {"softmax": softmax_forward, "log_softmax": log_softmax_forward}
BACKWARD = {"softmax": softmax_backward, "log_softmax": log_softmax_backward}
MASKED_VALUE = {"softmax": 0.0, "log_softmax": -np.inf}  # npattn's rule for a row of -inf


@st.composite
def softmax_cases(draw, kinds=("normal", "wide", "huge", "masked", "nan")):
    """x (0-d to 4-D, any layout), a dim in [-ndim, ndim) and a random dout of x's shape.

    x is drawn with its softmax axis last and then moved to ``dim``: the "masked" kind puts its
    fully -inf rows along the last axis, so this way they lie along ``dim``.
    """
    dtype = draw(dtypes)
    if draw(st.integers(0, 9)) == 0:        # 0-d: one row of one entry (dim 0 or -1)
        x = draw(arrays((1,), dtype, kinds)).reshape(())         # "masked" cannot draw 0-d
        dout = draw(arrays((1,), dtype, ("normal",))).reshape(())
        return x, draw(st.sampled_from([0, -1])), dout
    lead = draw(shapes(max_ndim=3, max_dim=6))
    axis = draw(st.integers(0, len(lead)))
    x = np.moveaxis(draw(arrays(lead + (draw(dims(64)),), dtype, kinds)), -1, axis)
    dim = draw(st.sampled_from([axis, axis - x.ndim]))
    dout = draw(arrays(x.shape, dtype, ("normal", "wide", "huge")))
    return x, dim, dout


def row_length(x, dim):
    return x.shape[dim] if x.ndim else 1


def fully_masked(x, dim):
    """True on the rows along ``dim`` whose every entry is -inf (broadcasts against x)."""
    if np.ndim(x) == 0:
        return np.isneginf(x)               # one row of one entry
    return np.all(np.isneginf(x), axis=dim, keepdims=True)


def textbook_forward(op, x, dim):
    """``reference.<op>_forward`` on a float64 copy, with its gaps filled by the rules it states.

    np.max cannot reduce an empty dim (the result is empty anyway) nor take an axis of a 0-d
    array (one row of one entry); and reference.log_softmax_forward gives NaN on a fully masked
    row (-inf - log 0 = -inf + inf) where its docstring, and npattn, say -inf.
    """
    x64 = np.atleast_1d(f64(x)[0])
    if x64.size == 0:
        return np.empty(x.shape)
    with np.errstate(invalid="ignore"):
        want = getattr(reference, op + "_forward")(x64, dim)
    want = np.where(fully_masked(x64, dim), MASKED_VALUE[op], want)
    return want.reshape(x.shape)


def textbook_backward(op, dout, out, dim):
    """``reference.<op>_backward`` on float64 copies; 0-d and empty arrays as above."""
    dout64, out64 = (np.atleast_1d(a) for a in f64(dout, out))
    if out64.size == 0:
        return np.empty(out.shape)
    return getattr(reference, op + "_backward")(dout64, out64, dim).reshape(out.shape)


def backward_scale(op, dout, out, dim, relogged=False):
    """The magnitudes of the terms that make dx, for closeness' n·eps·scale rule.

    ``relogged``: the truth used softmax(log(out)), whose exp of a rounded log is off from out
    by ~eps·|log y| relative, so there each y counts as y·(1 + |log y|).
    """
    d, y = (np.atleast_1d(a) for a in f64(dout, out))
    d = np.abs(d)
    if op == "softmax":                     # dx = y ∘ (dout - Σ dout∘y)
        if relogged:
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.where(y > 0, y * (1 + np.abs(np.log(y))), y)
        scale = y * (d + np.sum(d * y, axis=dim, keepdims=True))
    else:                                   # dx = dout - exp(y) ∘ Σ dout
        scale = d + np.exp(y) * np.sum(d, axis=dim, keepdims=True)
    return scale.reshape(out.shape)


# ------------------------------------------------------------------ against the textbook

@pytest.mark.parametrize("op", OPS)
@given(case=softmax_cases())
def test_forward_matches_reference(op, case):
    x, dim, _ = case
    got = FORWARD[op](x, dim)
    assert_close(got, textbook_forward(op, x, dim), dtype=x.dtype, n=row_length(x, dim),
                 scale=1.0)


@pytest.mark.parametrize("op", OPS)
@given(case=softmax_cases())
def test_backward_matches_reference(op, case):
    x, dim, dout = case                     # dout is random: an all-ones dout hides softmax bugs
    out = FORWARD[op](x, dim)               # a real forward output, in x's dtype
    got = BACKWARD[op](dout, out, dim)
    assert_close(got, textbook_backward(op, dout, out, dim), dtype=x.dtype,
                 n=row_length(x, dim), scale=backward_scale(op, dout, out, dim))


# ------------------------------------------------------------------ against PyTorch

@pytest.mark.parametrize("op", OPS)
@given(case=softmax_cases())
def test_matches_torch(torch, op, case):
    """torch.softmax / torch.log_softmax and autograd in float64. On fully masked rows PyTorch
    gives NaN; there we expect npattn's documented 0 (softmax) or -inf, and zero gradients."""
    x, dim, dout = case
    n = row_length(x, dim)
    masked = fully_masked(x, dim)
    torch_op = getattr(torch, op)
    want = np.where(masked, MASKED_VALUE[op], torch_op(torch.tensor(f64(x)[0]), dim).numpy())
    out = FORWARD[op](x, dim)
    assert_close(out, want, dtype=x.dtype, n=n, scale=1.0)

    # Gradient at npattn's own output: log-probabilities are logits whose softmax is `out` (up
    # to rounding), so torch's gradient there checks backward alone, free of the forward
    # rounding that the check above allows for.
    with np.errstate(divide="ignore"):
        logits = f64(out)[0] if op == "log_softmax" else np.log(f64(out)[0])
    t = torch.tensor(logits, requires_grad=True)
    torch_op(t, dim).backward(torch.tensor(f64(dout)[0]))
    want = np.where(masked, 0.0, t.grad.numpy())
    assert_close(BACKWARD[op](dout, out, dim), want, dtype=x.dtype, n=n,
                 scale=backward_scale(op, dout, out, dim, relogged=True))


# ------------------------------------------------------------------ the edge cases, one by one

def test_article_example():
    """The article: softmax([2, 4, 4]) = [0.0634, 0.4683, 0.4683]."""
    scores = [2.0, 4.0, 4.0]
    total = sum(math.exp(s) for s in scores)
    want = [math.exp(s) / total for s in scores]
    for dtype in (np.float32, np.float64):
        assert_close(softmax(np.array(scores, dtype)), want, dtype=dtype, n=3)
        assert_close(log_softmax(np.array(scores, dtype)), np.log(want), dtype=dtype, n=3)
    np.testing.assert_array_equal(np.round(softmax(scores), 4), np.round(want, 4))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [-1, 0])
def test_huge_logits_stay_finite(dtype, dim):
    """±1e30 overflows any unshifted exp (float32 at 88.7); max-subtraction keeps exps <= 1."""
    rows = np.array([[1e30, -1e30, 0.0, 1e29],
                     [1e30, 1e30, 1e30, 1e30],       # naively inf / inf = NaN; truly 1/4 each
                     [-1e30, -1e30, -1e30, -1e30],   # naively 0 / 0 = NaN; truly 1/4 each
                     [-1e30, -1e30, 1e30, -1e30]], dtype)
    x = rows if dim == -1 else np.ascontiguousarray(rows.T)
    p, lp = softmax(x, dim), log_softmax(x, dim)
    assert np.isfinite(p).all() and np.isfinite(lp).all()
    assert_close(p, textbook_forward("softmax", x, dim), dtype=dtype, n=4)
    assert_close(lp, textbook_forward("log_softmax", x, dim), dtype=dtype, n=4)
    p_rows = p if dim == -1 else p.T
    assert_close(p_rows[1:3], np.full((2, 4), 1 / 4), dtype=dtype, n=4)
    assert_close(p.sum(axis=dim), np.ones(4), dtype=dtype, n=4)
    dout = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
    for op, out in (("softmax", p), ("log_softmax", lp)):
        dx = BACKWARD[op](dout, out, dim)
        assert np.isfinite(dx).all()
        assert_close(dx, textbook_backward(op, dout, out, dim), dtype=dtype, n=4,
                     scale=backward_scale(op, dout, out, dim))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_fully_masked_rows(dtype, dim):
    """A row of -inf: softmax 0, log_softmax -inf, zero gradients (PyTorch SDPA >= 2.5)."""
    rng = np.random.default_rng(dim + 7)
    x = rng.standard_normal((3, 4, 5))
    x[rng.random(x.shape) < 0.3] = -np.inf                      # partly masked rows stay rows
    row_shape = tuple(1 if a == dim % 3 else s for a, s in enumerate(x.shape))
    masked = rng.random(row_shape) < 0.5
    masked.flat[:2] = [True, False]                             # both kinds, whatever the draw
    x = np.where(masked, -np.inf, x).astype(dtype)
    some = ~masked & ~np.all(np.isneginf(x), axis=dim, keepdims=True)
    dout = rng.standard_normal(x.shape).astype(dtype)

    p, lp = softmax(x, dim), log_softmax(x, dim)
    assert not np.isnan(p).any() and not np.isnan(lp).any()
    assert np.all(np.where(masked, p, 0.0) == 0.0)
    assert np.all(np.where(masked, lp, -np.inf) == -np.inf)
    assert_close(np.where(some, p.sum(axis=dim, keepdims=True), 1.0),
                 np.ones(row_shape), dtype=dtype, n=5)
    for op, out in (("softmax", p), ("log_softmax", lp)):
        dx = BACKWARD[op](dout, out, dim)
        assert not np.isnan(dx).any()
        assert np.all(np.where(masked, dx, 0.0) == 0.0)
        assert np.any(np.where(some, dx, 0.0) != 0.0)           # the other rows do have gradient
        assert_close(dx, textbook_backward(op, dout, out, dim), dtype=dtype, n=x.shape[dim],
                     scale=backward_scale(op, dout, out, dim))
    # a partly masked row passes dout through log_softmax at its -inf entries: exp(-inf) = 0
    dx = log_softmax_backward(dout, lp, dim)
    partial = np.isneginf(x) & ~masked
    np.testing.assert_array_equal(dx[partial], dout[partial])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_propagates_to_its_row(op, dtype):
    x = np.array([[np.nan, 1.0, 2.0],
                  [np.nan, -np.inf, -np.inf],                  # a NaN, not a masked row
                  [1.0, -np.inf, 3.0],
                  [2.0, 2.5, np.nan]], dtype)
    nan_rows = np.isnan(x).any(axis=1)
    dout = np.random.default_rng(1).standard_normal(x.shape).astype(dtype)
    for dim, xt, rows in ((-1, x, np.s_[nan_rows]), (0, x.T.copy(), np.s_[:, nan_rows])):
        out = FORWARD[op](xt, dim)
        assert np.isnan(out[rows]).all()
        assert not np.isnan(np.delete(out, np.flatnonzero(nan_rows), axis=1 + dim)).any()
        assert_close(out, textbook_forward(op, xt, dim), dtype=dtype, n=3)
        dx = BACKWARD[op](dout if dim == -1 else dout.T.copy(), out, dim)
        assert np.isnan(dx[rows]).all()
        assert not np.isnan(np.delete(dx, np.flatnonzero(nan_rows), axis=1 + dim)).any()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_and_0d(op, dtype):
    """An empty dim gives an empty result; a 0-d x is one row of one entry (PyTorch allows it)."""
    for shape, dim in (((3, 0), -1), ((3, 0), 0), ((0, 4), 0), ((0, 4), 1), ((0,), 0),
                       ((2, 0, 3), 1), ((2, 0, 3), -1)):
        x = np.ones(shape, dtype)
        out = FORWARD[op](x, dim)
        dx = BACKWARD[op](x, out, dim)
        assert (out.shape, out.dtype, dx.shape, dx.dtype) == (shape, dtype, shape, dtype)
    rng = np.random.default_rng(2)
    for dim in (0, -1):
        for value in (rng.standard_normal(), 1e30, -1e30, -np.inf):
            x = np.array(value, dtype)
            out = FORWARD[op](x, dim)
            assert out.shape == () and out.dtype == dtype
            assert_close(out, textbook_forward(op, x, dim), dtype=dtype)
            dout = np.array(rng.standard_normal(), dtype)
            dx = BACKWARD[op](dout, out, dim)
            assert dx.shape == () and dx.dtype == dtype
            assert_close(dx, textbook_backward(op, dout, out, dim), dtype=dtype,
                         scale=backward_scale(op, dout, out, dim))
    assert FORWARD[op](np.float64(0.5)).shape == ()              # a NumPy scalar too


@pytest.mark.parametrize("op", OPS)
def test_long_rows_in_float32(op):
    """Rows far longer than Hypothesis draws: float32 sums of 5000 terms stay within n·eps."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 5000)) * 10).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    out = FORWARD[op](x)
    assert_close(out, textbook_forward(op, x, -1), dtype=np.float32, n=5000)
    assert_close(BACKWARD[op](dout, out), textbook_backward(op, dout, out, -1),
                 dtype=np.float32, n=5000, scale=backward_scale(op, dout, out, -1))


def test_kernels_only_ever_see_writeable_c_contiguous_rows():
    """Whatever the layout, dim and writeability, the kernels get C-contiguous writeable (N, C)
    rows: one compiled signature per dtype (a read-only array is another Numba type)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 7, 8))[::2, :, ::-1]            # strided and reversed
    frozen = np.ascontiguousarray(x)
    frozen.flags.writeable = False
    for dim in (0, 1, -1):
        for op in OPS:
            out = FORWARD[op](x, dim)
            BACKWARD[op](np.asfortranarray(x), out, dim)
            out = FORWARD[op](frozen, dim)
            out.flags.writeable = False
            BACKWARD[op](frozen, out, dim)
    for k in (softmax_forward_kernel, softmax_backward_kernel, log_softmax_backward_kernel):
        seen = [t for sig in k.signatures for t in sig if hasattr(t, "layout")]
        assert seen and all(t.layout == "C" and t.ndim == 2 and t.mutable for t in seen), \
            k.signatures


def test_accepts_lists_and_numpy_ints_and_keeps_dtype():
    got = softmax([[1.0, 2.0], [3.0, 5.0]], np.int64(0))
    assert got.dtype == np.float64
    assert_close(got, textbook_forward("softmax", np.array([[1.0, 2.0], [3.0, 5.0]]), 0),
                 dtype=np.float64, n=2)
    x = np.array([[1.0, 2.0]], np.float32)
    assert log_softmax(x).dtype == np.float32 and softmax_backward(x, x).dtype == np.float32
    assert softmax is softmax_forward and log_softmax is log_softmax_forward


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("args, error, words", [
    ((np.ones(3, np.int64),), TypeError, ["x", "float32 or float64", "int64"]),
    ((np.ones(3, bool),), TypeError, ["x", "bool"]),
    ((np.ones(3, np.complex128),), TypeError, ["x", "complex128"]),
    ((np.ones(3, np.float16),), TypeError, ["x", "float16"]),
    ((None,), TypeError, ["x", "None"]),
    ((np.ones((2, 3)), 1.0), TypeError, ["dim", "int", "float"]),
    ((np.ones((2, 3)), True), TypeError, ["dim", "int", "bool"]),
    ((np.ones((2, 3)), np.bool_(False)), TypeError, ["dim", "int", "bool"]),
    ((np.ones((2, 3)), "1"), TypeError, ["dim", "int", "str"]),
    ((np.ones((2, 3)), 2), ValueError, ["dim", "[-2, 1]", "got 2"]),
    ((np.ones((2, 3)), -3), ValueError, ["dim", "[-2, 1]", "got -3"]),
    ((np.float64(1.0), 1), ValueError, ["dim", "[-1, 0]", "got 1"]),
])
def test_forward_rejects_bad_input(op, args, error, words):
    with pytest.raises(error) as info:
        FORWARD[op](*args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("args, error, words", [
    ((np.ones((2, 3)), np.ones((3, 2))), ValueError, ["dout", "(2, 3)", "(3, 2)"]),
    ((np.ones(3), np.ones((1, 3))), ValueError, ["dout", "(1, 3)", "(3,)"]),
    ((np.ones((2, 3), np.float32), np.ones((2, 3))), TypeError, ["dout", "float64", "float32"]),
    ((np.ones((2, 3)), np.ones((2, 3), np.int32)), TypeError, ["out", "int32"]),
    ((np.ones((2, 3), np.float16), np.ones((2, 3), np.float16)), TypeError, ["out", "float16"]),
    ((np.ones((2, 3)), np.ones((2, 3)), 2), ValueError, ["dim", "[-2, 1]"]),
    ((np.ones((2, 3)), np.ones((2, 3)), 0.0), TypeError, ["dim", "int"]),
])
def test_backward_rejects_bad_input(op, args, error, words):
    with pytest.raises(error) as info:
        BACKWARD[op](*args)
    for word in words:
        assert word in str(info.value)
