"""cross_entropy_forward / cross_entropy_backward against the float64 textbook and PyTorch."""
import math

import numba
import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, f64
from npattn import reference
from npattn.functional.cross_entropy import (cross_entropy, cross_entropy_backward,
                                             cross_entropy_forward)
from npattn.kernels.cross_entropy import (cross_entropy_backward_kernel,
                                          cross_entropy_forward_kernel)
from strategies import arrays, dims, dtypes, lay_out, layouts, make_values, shapes

REDUCTIONS = ("mean", "sum", "none")
KINDS = ("normal", "wide", "huge", "masked")


@st.composite
def ce_cases(draw, min_classes=0, kinds=KINDS):
    """input (C,), (N, C) or (N, C, d...) in any layout; integer target with some entries
    ignore_index; a reduction, a label smoothing and a random dout of the result's shape.

    The logits are drawn with the classes last and moved to axis 1: the "masked" kind's fully
    -inf rows then lie along the classes (PyTorch gives NaN there, and so do we).
    """
    dtype = draw(dtypes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    form = draw(st.sampled_from(["1-d", "2-d", "n-d"]))
    n_classes = draw(dims(12, min_classes))
    if form == "1-d":
        positions = ()
    elif form == "2-d":
        positions = (draw(dims(8)),)
    else:
        positions = (draw(dims(4)),) + draw(shapes(min_ndim=1, max_ndim=2, max_dim=4))
    logits = draw(arrays(positions + (n_classes,), dtype, kinds))      # classes last
    x = np.moveaxis(logits, -1, 1 if positions else 0)
    ignore_index = draw(st.sampled_from([-100, -1, 0, 3]))
    target = rng.integers(0, max(n_classes, 1), size=positions)
    target = np.where((rng.random(positions) < 0.2) | (n_classes == 0), ignore_index, target)
    target = lay_out(np.asarray(target).astype(draw(st.sampled_from([np.int64, np.int32,
                                                                      np.int16]))),
                     draw(layouts), rng)
    reduction = draw(st.sampled_from(REDUCTIONS))
    label_smoothing = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0))
    dout = make_values(rng, positions if reduction == "none" else (), dtype,
                       draw(st.sampled_from(["normal", "wide"])))
    return x, target, dict(ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing), dout


def n_classes_of(x):
    return x.shape[1 if x.ndim > 1 else 0]


def loss_n(x, reduction):
    """The length of the reduction behind one result: C terms a row, and all rows for a sum."""
    rows = 1 if reduction == "none" else max(math.prod(x.shape) // max(n_classes_of(x), 1), 1)
    return rows * (n_classes_of(x) + 2)


def g_abs(dout, x, target, kw):
    """|g| of each row, in input's shape: |dout| at the row ('none'), |dout| ('sum') or
    |dout| / number of targets not ignored ('mean')."""
    t = np.asarray(target)
    g = np.abs(f64(dout)[0])
    if kw["reduction"] == "mean":
        count = np.sum(t != kw["ignore_index"])
        g = g / count if count else np.zeros(())
    g = np.broadcast_to(g, t.shape)
    return np.expand_dims(g, 1 if x.ndim > 1 else 0) * np.ones(x.shape)


# ------------------------------------------------------------------ against the textbook

@given(case=ce_cases())
def test_forward_matches_reference(case):
    x, target, kw, _ = case
    got = cross_entropy_forward(x, target, **kw)
    want = reference.cross_entropy_forward(f64(x)[0], np.asarray(target), **kw)
    assert got.shape == np.shape(target) if kw["reduction"] == "none" else got.shape == ()
    assert isinstance(got, np.ndarray)
    assert_close(got, want, dtype=x.dtype, n=loss_n(x, kw["reduction"]), scale=1.0)


@given(case=ce_cases())
def test_backward_matches_reference(case):
    x, target, kw, dout = case
    got = cross_entropy_backward(dout, x, target, **kw)
    want = reference.cross_entropy_backward(f64(dout)[0], f64(x)[0], np.asarray(target), **kw)
    assert_close(got, want, dtype=x.dtype, n=n_classes_of(x) + 2,
                 scale=2 * g_abs(dout, x, target, kw))


def numeric_gradient(f, x, h=1e-6):
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[i] += h
        minus[i] -= h
        grad[i] = (f(plus) - f(minus)) / (2 * h)
    return grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(5,), (4, 5), (3, 4, 2)])
def test_reference_backward_by_finite_differences(reduction, label_smoothing, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape) * 2
    positions = shape[:1] + shape[2:] if len(shape) > 1 else ()
    target = rng.integers(0, shape[1 if len(shape) > 1 else 0], size=positions)
    if positions:
        target.flat[0] = -100                              # an ignored position
    dout = rng.standard_normal(positions if reduction == "none" else ())
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)

    def f(z):
        return np.sum(dout * reference.cross_entropy_forward(z, target, **kw))

    numeric = numeric_gradient(f, x)
    np.testing.assert_allclose(reference.cross_entropy_backward(dout, x, target, **kw), numeric,
                               rtol=1e-6, atol=1e-8)
    if positions:                                          # the ignored row: no gradient
        assert np.all(np.moveaxis(numeric, 1, -1)[(0,) * len(positions)] == 0)


# ------------------------------------------------------------------ against PyTorch

@given(case=ce_cases(min_classes=1))
def test_matches_torch(torch, case):
    """F.cross_entropy and autograd in float64. One deviation, on purpose: an ignored row whose
    logits hold a NaN (or are all -inf) gets gradient 0 here and NaN from PyTorch."""
    x, target, kw, dout = case
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tx, torch.tensor(np.asarray(target).astype(np.int64)),
                                              **kw)
    tloss.backward(torch.tensor(f64(dout)[0]))
    assert_close(cross_entropy(x, target, **kw), tloss.detach().numpy(), dtype=x.dtype,
                 n=loss_n(x, kw["reduction"]), scale=1.0)
    ignored = np.expand_dims(np.asarray(target) == kw["ignore_index"], 1 if x.ndim > 1 else 0)
    want = np.where(ignored, 0.0, tx.grad.numpy())
    assert_close(cross_entropy_backward(dout, x, target, **kw), want, dtype=x.dtype,
                 n=n_classes_of(x) + 2, scale=2 * g_abs(dout, x, target, kw))


# ------------------------------------------------------------------ the edge cases, one by one

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_logits(dtype):
    """±1e30 overflows any unshifted exp; the loss stays finite and exact."""
    x = np.array([[1e30, 1e30, -1e30],        # two equal leaders: -log p = log 2
                  [1e30, -1e30, 0.0],         # the target wins outright: 0
                  [-1e30, 1e30, 0.0],         # the target loses by 2e30: 2e30
                  [-1e30, -1e30, -1e30]], dtype)   # uniform: log 3
    target = np.array([0, 0, 0, 2])
    loss = cross_entropy(x, target, reduction="none")
    assert np.isfinite(loss).all()
    assert_close(loss, [math.log(2), 0.0, 2e30, math.log(3)], dtype=dtype, n=3)
    assert_close(cross_entropy(x, target, reduction="sum"), 2e30, dtype=dtype, n=12)
    dx = cross_entropy_backward(np.array(1.0, dtype), x, target, reduction="sum")
    want = [[-0.5, 0.5, 0], [0, 0, 0], [-1, 1, 0], [1 / 3, 1 / 3, -2 / 3]]
    assert_close(dx, want, dtype=dtype, n=3)
    smoothed = cross_entropy(x, target, reduction="none", label_smoothing=0.3)
    assert_close(smoothed, reference.cross_entropy_forward(f64(x)[0], target, reduction="none",
                                                           label_smoothing=0.3),
                 dtype=dtype, n=5)
    assert smoothed[1] > 1e29                    # ε·mean_c(-log p_c) sees the -1e30 class


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_negative_infinite_logits(dtype):
    """A -inf logit has p = 0. Loss inf if it is the target, or when label smoothing averages
    over it; a row of -inf only is NaN (as PyTorch's log_softmax); gradients stay finite."""
    inf = np.inf
    x = np.array([[1.0, -inf, 2.0], [-inf, 0.0, 0.0], [-inf, -inf, -inf]], dtype)
    target = np.array([2, 0, 1])
    loss = cross_entropy(x, target, reduction="none")
    assert_close(loss[0], math.log(1 + math.e) - 1, dtype=dtype, n=3)   # -log(e²/(e + e²))
    assert loss[1] == inf and np.isnan(loss[2])
    smoothed = cross_entropy(x, target, reduction="none", label_smoothing=0.1)
    assert smoothed[0] == inf and smoothed[1] == inf and np.isnan(smoothed[2])
    for eps in (0.0, 0.1):
        dx = cross_entropy_backward(np.ones(3, dtype), x, target, reduction="none",
                                    label_smoothing=eps)
        assert np.isfinite(dx[:2]).all() and np.isnan(dx[2]).all()
        p = np.array([1 / (1 + math.e), 0, math.e / (1 + math.e)])
        assert_close(dx[0], p - (1 - eps) * np.eye(3)[2] - eps / 3, dtype=dtype, n=3)
        assert_close(dx[1], [-(1 - eps) - eps / 3, 0.5 - eps / 3, 0.5 - eps / 3], dtype=dtype, n=3)
    assert cross_entropy(x[:2], target[:2], reduction="mean") == inf


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_targets_ignored(dtype):
    """mean: 0/0 = NaN as PyTorch; sum: 0; none: zeros; gradients zero everywhere -- also
    where the ignored rows hold NaN, since an ignored row is never read."""
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(dtype)
    x[1] = np.nan
    target = np.full(3, 7)
    for eps in (0.0, 0.25):
        kw = dict(ignore_index=7, label_smoothing=eps)
        mean = cross_entropy(x, target, **kw)
        assert mean.shape == () and mean.dtype == dtype and np.isnan(mean)
        assert cross_entropy(x, target, reduction="sum", **kw) == 0
        np.testing.assert_array_equal(cross_entropy(x, target, reduction="none", **kw),
                                      np.zeros(3, dtype))
        for reduction, dout in (("mean", np.array(1.0, dtype)), ("sum", np.array(1.0, dtype)),
                                ("none", np.ones(3, dtype))):
            dx = cross_entropy_backward(dout, x, target, reduction=reduction, **kw)
            np.testing.assert_array_equal(dx, np.zeros((3, 4), dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_counts_only_targets_not_ignored(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 3)).astype(dtype)       # N = 2, C = 5, d1 = 3
    target = np.array([[0, -100, 4], [-100, -100, 2]])
    for eps in (0.0, 0.4):
        none = cross_entropy(x, target, reduction="none", label_smoothing=eps)
        assert none[0, 1] == 0 and none[1, 0] == 0 and np.all(none[target != -100] > 0)
        assert_close(cross_entropy(x, target, label_smoothing=eps),
                     none.astype(np.float64).sum() / 3, dtype=dtype, n=20)
        dmean = cross_entropy_backward(np.array(1.5, dtype), x, target, label_smoothing=eps)
        dsum = cross_entropy_backward(np.array(0.5, dtype), x, target, reduction="sum",
                                      label_smoothing=eps)
        assert_close(dmean, dsum, dtype=dtype, n=5)        # 1.5 / 3 = 0.5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_label_smoothing_is_pytorchs_formula(dtype):
    """loss = (1 - ε)·nll + ε·mean_c(-log p_c), written out from log-probabilities."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 4)).astype(dtype)
    target = rng.integers(0, 4, 6)
    logp = f64(x)[0] - np.log(np.exp(f64(x)[0]).sum(axis=1, keepdims=True))
    for eps in (0.0, 0.1, 0.5, 1.0):
        want = (1 - eps) * -logp[np.arange(6), target] + eps * -logp.mean(axis=1)
        assert_close(cross_entropy(x, target, reduction="none", label_smoothing=eps), want,
                     dtype=dtype, n=6)
        dx = cross_entropy_backward(np.ones(6, dtype), x, target, reduction="none",
                                    label_smoothing=eps)
        assert_close(dx, np.exp(logp) - (1 - eps) * np.eye(4)[target] - eps / 4, dtype=dtype,
                     n=6)
        assert_close(dx.sum(axis=1), np.zeros(6), dtype=dtype, n=6)   # softmax: rows sum to 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty(dtype):
    """No positions: mean NaN, sum 0, none empty; C = 0 with every target ignored; empty d1."""
    for shape, tshape in (((0, 4), (0,)), ((3, 4, 0), (3, 0)), ((0, 4, 2), (0, 2)),
                          ((2, 0), (2,))):
        x = np.ones(shape, dtype)
        target = np.full(tshape, -100)
        assert np.isnan(cross_entropy(x, target))
        assert cross_entropy(x, target, reduction="sum") == 0
        none = cross_entropy(x, target, reduction="none")
        assert none.shape == tshape and none.dtype == dtype and np.all(none == 0)
        for reduction, dout in (("mean", np.array(1, dtype)), ("none", np.ones(tshape, dtype))):
            dx = cross_entropy_backward(dout, x, target, reduction=reduction, label_smoothing=0.5)
            assert dx.shape == shape and dx.dtype == dtype and np.all(dx == 0)


def test_one_dimensional_input_and_layouts():
    """A 1-D input (C,) takes a 0-d target; inputs may be strided, transposed or read-only."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal(5)
    loss = cross_entropy(logits, np.int64(3), reduction="none")
    assert loss.shape == () and isinstance(loss, np.ndarray)
    assert_close(loss, -(logits[3] - np.log(np.exp(logits).sum())), dtype=np.float64, n=5)
    assert_close(cross_entropy(logits, 3), loss, dtype=np.float64)
    dx = cross_entropy_backward(np.array(2.0), logits, 3)
    assert_close(dx, 2 * (np.exp(logits) / np.exp(logits).sum() - np.eye(5)[3]),
                 dtype=np.float64, n=5)
    x = rng.standard_normal((4, 6, 3)).astype(np.float32).transpose(2, 1, 0)[:, ::2]   # (3, 3, 4)
    x.flags.writeable = False
    target = np.asfortranarray(rng.integers(0, 3, (3, 4)).astype(np.int32))
    want = reference.cross_entropy_forward(f64(x)[0], target, reduction="none")
    assert_close(cross_entropy(x, target, reduction="none"), want, dtype=np.float32, n=5)
    cross_entropy_backward(np.ones((3, 4), np.float32), x, target, reduction="none")
    for k in (cross_entropy_forward_kernel, cross_entropy_backward_kernel):   # never read-only
        seen = [t for sig in k.signatures for t in sig if hasattr(t, "layout")]
        assert seen and all(t.layout == "C" and t.mutable for t in seen), k.signatures
    assert cross_entropy is cross_entropy_forward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_at_any_thread_count(dtype):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((300, 50, 2)) * 5).astype(dtype)
    target = rng.integers(-1, 50, (300, 2))
    results = []
    threads = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            kw = dict(ignore_index=-1, label_smoothing=0.1)
            results.append([cross_entropy(x, target, **kw),
                            cross_entropy(x, target, reduction="none", **kw),
                            cross_entropy_backward(np.array(1.0, dtype), x, target, **kw)])
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_kernels_never_index_out_of_bounds():
    """Targets outside [0, C) reach the kernels only as -1 (ignored); any other is skipped too."""
    x = np.ones((4, 3))
    target = np.array([0, -1, 3, 2**40])
    loss = np.full(4, np.nan)
    cross_entropy_forward_kernel(x, target, 0.0, loss)
    assert_close(loss, [math.log(3), 0, 0, 0], dtype=np.float64, n=3)
    dx = np.full((4, 3), np.nan)
    cross_entropy_backward_kernel(np.ones(4), x, target, 0.0, dx)
    assert_close(dx, [[-2 / 3, 1 / 3, 1 / 3], [0] * 3, [0] * 3, [0] * 3], dtype=np.float64, n=3)


# ------------------------------------------------------------------ bad input

X = np.ones((2, 3))
T = np.array([0, 2])


@pytest.mark.parametrize("args, kw, error, words", [
    ((np.ones((2, 3), np.int64), T), {}, TypeError, ["input", "int64"]),
    ((np.ones((2, 3), np.float16), T), {}, TypeError, ["input", "float16"]),
    ((np.ones(()), np.array(0)), {}, ValueError, ["input", "at least 1", "()"]),
    ((X, np.ones((2, 3)) / 3), {}, TypeError, ["target", "class indices", "probabilities",
                                               "float64"]),
    ((X, np.array([0.0, 2.0])), {}, TypeError, ["target", "class indices", "float64"]),
    ((X, np.array([True, False])), {}, TypeError, ["target", "integer", "bool"]),
    ((X, None), {}, TypeError, ["target", "None"]),
    ((X, np.array([0, 1, 2])), {}, ValueError, ["target", "(2,)", "(3,)"]),
    ((np.ones((2, 3, 4)), np.zeros((2, 3), np.int64)), {}, ValueError, ["target", "(2, 4)",
                                                                       "(2, 3)"]),
    ((np.ones(3), np.array([1])), {}, ValueError, ["target", "()", "(1,)"]),
    ((X, np.array([0, 3])), {}, ValueError, ["target", "[0, 3)", "got 3", "(1,)"]),
    ((X, np.array([-1, 0])), {}, ValueError, ["target", "[0, 3)", "-100", "got -1", "(0,)"]),
    ((X, np.array([-1, 0])), {"ignore_index": -2}, ValueError, ["target", "got -1"]),
    ((X, T), {"reduction": "avg"}, ValueError, ["reduction", "'mean'", "'avg'"]),
    ((X, T), {"reduction": None}, ValueError, ["reduction", "None"]),
    ((X, T), {"label_smoothing": 1.5}, ValueError, ["label_smoothing", "[0, 1]", "1.5"]),
    ((X, T), {"label_smoothing": -0.1}, ValueError, ["label_smoothing", "[0, 1]", "-0.1"]),
    ((X, T), {"label_smoothing": math.nan}, ValueError, ["label_smoothing", "nan"]),
    ((X, T), {"label_smoothing": "0.1"}, TypeError, ["label_smoothing", "str"]),
    ((X, T), {"ignore_index": 1.0}, TypeError, ["ignore_index", "int", "float"]),
    ((X, T), {"ignore_index": 2**64}, ValueError, ["ignore_index", "int64"]),
])
def test_rejects_bad_input(args, kw, error, words):
    dout = np.ones(np.shape(args[1]) if kw.get("reduction") == "none" else ())
    for call in (lambda: cross_entropy(*args, **kw),
                 lambda: cross_entropy_backward(dout, *args, **kw)):
        with pytest.raises(error) as info:
            call()
        for word in words:
            assert word in str(info.value)


@pytest.mark.parametrize("dout, reduction, error, words", [
    (np.ones(2), "mean", ValueError, ["dout", "0-d", "()", "(2,)"]),
    (np.ones(()), "none", ValueError, ["dout", "(2,)", "()"]),
    (np.ones((), np.float32), "sum", TypeError, ["dout", "float64", "float32"]),
    (np.ones((), np.int64), "sum", TypeError, ["dout", "int64"]),
])
def test_backward_rejects_bad_dout(dout, reduction, error, words):
    with pytest.raises(error) as info:
        cross_entropy_backward(dout, X, T, reduction=reduction)
    for word in words:
        assert word in str(info.value)
