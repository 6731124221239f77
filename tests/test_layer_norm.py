"""layer_norm_forward / layer_norm_backward against the float64 textbook and against PyTorch."""
import math

import numba
import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, f64
from npattn import reference
from npattn.functional.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from npattn.kernels.layer_norm import layer_norm_backward_kernel, layer_norm_forward_kernel
from strategies import arrays, dtypes, shapes

KINDS = ("normal", "wide", "huge", "tiny", "nan")


@st.composite
def layer_norm_cases(draw, kinds=KINDS):
    """x (..., *normalized_shape) in any layout, normalized_shape as an int, tuple or list,
    weight and bias (each maybe None), eps and a random dout of x's shape."""
    dtype = draw(dtypes)
    lead = draw(shapes(max_ndim=2, max_dim=6))
    normalized = draw(shapes(min_ndim=1, max_ndim=2, max_dim=9))
    x = draw(arrays(lead + normalized, dtype, kinds))
    if len(normalized) == 1 and draw(st.booleans()):
        spelled = normalized[0]                            # an int, as PyTorch allows
    else:
        spelled = draw(st.sampled_from([tuple, list]))(normalized)
    weight = draw(st.none() | arrays(normalized, dtype, ("normal", "wide")))
    bias = draw(st.none() | arrays(normalized, dtype, ("normal", "wide")))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    dout = draw(arrays(x.shape, dtype, ("normal", "wide")))
    return x, spelled, weight, bias, eps, dout


def scales(x, k, weight, bias, eps, dout):
    """Term magnitudes of y, dx, dweight and dbias over the last k axes of x, for closeness'
    n·eps·scale rule. a = (|x| + |μ|)·rstd bounds |x̂| and the error of x̂, which the
    rounding of μ (relative to |x|) moves by rstd times that error."""
    axes = tuple(range(x.ndim - k, x.ndim))
    count = math.prod(x.shape[x.ndim - k:])
    x64 = f64(x)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        def mean(v):
            return np.sum(v, axis=axes, keepdims=True) / count
        mu = mean(x64)
        rstd = 1 / np.sqrt(mean((x64 - mu) ** 2) + eps)
        a = (np.abs(x64) + np.abs(mu)) * rstd
        w = 1.0 if weight is None else np.abs(f64(weight)[0])
        b = 0.0 if bias is None else np.abs(f64(bias)[0])
        d = np.abs(f64(dout)[0])
        g = d * w
        s_y = a * w + b
        s_dx = rstd * (g + mean(g) + a * mean(g * a))
    lead = tuple(range(x.ndim - k))
    return s_y, s_dx, np.sum(d * a, axis=lead), np.sum(d, axis=lead)


def k_of(spelled):
    return 1 if isinstance(spelled, int) else len(spelled)


# ------------------------------------------------------------------ against the textbook

@given(case=layer_norm_cases())
def test_forward_matches_reference(case):
    x, spelled, weight, bias, eps, dout = case
    k = k_of(spelled)
    got = layer_norm_forward(x, spelled, weight, bias, eps)
    want = reference.layer_norm_forward(*f64(x), spelled, *f64(weight, bias), eps)
    s_y = scales(x, k, weight, bias, eps, dout)[0]
    assert_close(got, want, dtype=x.dtype, n=math.prod(x.shape[x.ndim - k:]) + 2, scale=s_y)


@given(case=layer_norm_cases())
def test_backward_matches_reference(case):
    x, spelled, weight, bias, eps, dout = case             # dout random: ones hide bugs
    k = k_of(spelled)
    dx, dweight, dbias = layer_norm_backward(dout, x, spelled, weight, bias, eps)
    want = reference.layer_norm_backward(*f64(dout, x), spelled, *f64(weight, bias), eps)
    s_y, s_dx, s_dw, s_db = scales(x, k, weight, bias, eps, dout)
    width = math.prod(x.shape[x.ndim - k:])
    rows = math.prod(x.shape[:x.ndim - k])
    assert_close(dx, want[0], dtype=x.dtype, n=width + 2, scale=s_dx)
    if weight is None:
        assert dweight is None
    else:
        assert_close(dweight, want[1], dtype=x.dtype, n=rows + width + 2, scale=s_dw)
    if bias is None:
        assert dbias is None
    else:
        assert_close(dbias, want[2], dtype=x.dtype, n=rows + 1, scale=s_db)


@given(case=layer_norm_cases())
def test_saved_statistics_give_the_same_bits(case):
    """Forward's statistics (return_stats=True) handed to backward (stats=) give the bits
    backward gets computing them itself -- they are the same numbers -- and forward's y is the
    same with or without them. And backward uses them: another sample's statistics give
    another dx (planted: a kernel that ignored ``stats`` passed the first check alone)."""
    x, spelled, weight, bias, eps, dout = case
    k = k_of(spelled)
    y, stats = layer_norm_forward(x, spelled, weight, bias, eps, return_stats=True)
    np.testing.assert_array_equal(y, layer_norm_forward(x, spelled, weight, bias, eps))
    lead = x.shape[:x.ndim - k]
    assert all(s.dtype == np.float64 and s.shape == lead for s in stats)
    x64 = f64(x)[0]
    axes = tuple(range(x.ndim - k, x.ndim))
    count = math.prod(x.shape[x.ndim - k:])
    with np.errstate(all="ignore"):                 # (a sample of no entries: 0/0 = NaN)
        mu = x64.sum(axis=axes) / count
        rstd = 1 / np.sqrt(((x64 - mu.reshape(mu.shape + (1,) * k)) ** 2).sum(axis=axes)
                           / count + eps)
    np.testing.assert_allclose(stats[0], mu, rtol=1e-12, atol=1e-300, equal_nan=True)
    np.testing.assert_allclose(stats[1], rstd, rtol=1e-12, equal_nan=True)
    plain = layer_norm_backward(dout, x, spelled, weight, bias, eps)
    saved = layer_norm_backward(dout, x, spelled, weight, bias, eps, stats=stats)
    for a, b in zip(plain, saved):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    other = (stats[0] + 1.0, stats[1] * 2.0)                      # not x's statistics
    wrong = layer_norm_backward(dout, x, spelled, weight, bias, eps, stats=other)[0]
    finite = np.isfinite(plain[0]) & (np.abs(plain[0]) > 0)
    if finite.any() and np.isfinite(wrong).all() and count > 1:
        assert not np.array_equal(wrong[finite], plain[0][finite])


def numeric_gradient(f, a, h=1e-6):
    grad = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        plus, minus = a.copy(), a.copy()
        plus[i] += h
        minus[i] -= h
        grad[i] = (f(plus) - f(minus)) / (2 * h)
    return grad


@pytest.mark.parametrize("lead, normalized", [((4,), (5,)), ((2, 3), (2, 3)), ((), (6,))])
def test_reference_backward_by_finite_differences(lead, normalized):
    rng = np.random.default_rng(len(lead) + len(normalized))
    x = rng.standard_normal(lead + normalized) * 2 + 1
    w = rng.standard_normal(normalized)
    b = rng.standard_normal(normalized)
    dout = rng.standard_normal(x.shape)
    eps = 1e-3

    def loss(x_, w_, b_):
        return np.sum(dout * reference.layer_norm_forward(x_, normalized, w_, b_, eps))

    dx, dw, db = reference.layer_norm_backward(dout, x, normalized, w, b, eps)
    np.testing.assert_allclose(dx, numeric_gradient(lambda a: loss(a, w, b), x), rtol=1e-6,
                               atol=1e-8)
    np.testing.assert_allclose(dw, numeric_gradient(lambda a: loss(x, a, b), w), rtol=1e-6,
                               atol=1e-8)
    np.testing.assert_allclose(db, numeric_gradient(lambda a: loss(x, w, a), b), rtol=1e-6,
                               atol=1e-8)
    no_affine = reference.layer_norm_backward(dout, x, normalized, None, None, eps)
    assert no_affine[1] is None and no_affine[2] is None
    np.testing.assert_allclose(
        no_affine[0], numeric_gradient(lambda a: np.sum(dout * reference.layer_norm_forward(
            a, normalized, eps=eps)), x), rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------ against PyTorch

@given(case=layer_norm_cases(kinds=("normal", "wide", "huge", "tiny")))
def test_matches_torch(torch, case):
    x, spelled, weight, bias, eps, dout = case
    k = k_of(spelled)
    shape = (spelled,) if k == 1 and isinstance(spelled, int) else tuple(spelled)
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    tw = None if weight is None else torch.tensor(f64(weight)[0], requires_grad=True)
    tb = None if bias is None else torch.tensor(f64(bias)[0], requires_grad=True)
    ty = torch.nn.functional.layer_norm(tx, shape, tw, tb, eps)
    ty.backward(torch.tensor(f64(dout)[0]))
    s_y, s_dx, s_dw, s_db = scales(x, k, weight, bias, eps, dout)
    width = math.prod(shape)
    rows = math.prod(x.shape[:x.ndim - k])
    assert_close(layer_norm(x, spelled, weight, bias, eps), ty.detach().numpy(), dtype=x.dtype,
                 n=width + 2, scale=s_y)
    dx, dweight, dbias = layer_norm_backward(dout, x, spelled, weight, bias, eps)
    assert_close(dx, tx.grad.numpy(), dtype=x.dtype, n=width + 2, scale=s_dx)
    if weight is not None:
        assert_close(dweight, tw.grad.numpy(), dtype=x.dtype, n=rows + width + 2, scale=s_dw)
    if bias is not None:
        assert_close(dbias, tb.grad.numpy(), dtype=x.dtype, n=rows + 1, scale=s_db)


# ------------------------------------------------------------------ the edge cases, one by one

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_mean_small_spread_is_stable(dtype):
    """x = 1e4 + [-1, 0, 1]·1e-2: E[x²] - E[x]² would cancel to noise in float32; the two-pass
    float64 statistics give x̂ = [-√1.5, 0, √1.5] (up to eps)."""
    x = (1e4 + np.array([[-1.0, 0.0, 1.0], [1.0, 0.0, -1.0]]) * 1e-2).astype(dtype)
    x64 = f64(x)[0]
    centred = x64 - x64.mean(axis=1, keepdims=True)
    want = centred / np.sqrt((centred ** 2).mean(axis=1, keepdims=True) + 1e-12)
    assert_close(layer_norm(x, 3, eps=1e-12), want, dtype=dtype, n=3)
    assert np.all(np.abs(layer_norm(x, 3, eps=1e-12)[:, [0, 2]]) > 1.2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_values_do_not_overflow(dtype):
    """1e30² overflows float32; the statistics accumulate in float64."""
    x = np.array([[1e30, -1e30, 3e30, 0.0]], dtype)
    y = layer_norm(x, 4)
    assert np.isfinite(y).all()
    assert_close(y, reference.layer_norm_forward(f64(x)[0], 4), dtype=dtype, n=4, scale=2.0)
    dx, _, _ = layer_norm_backward(np.ones_like(x), x, 4)
    assert np.isfinite(dx).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_constant_rows_and_eps(dtype):
    """A constant row has σ² = 0: x̂ = 0 for eps > 0, and 0/0 = NaN for eps = 0 (PyTorch too)."""
    x = np.full((2, 5), 3.0, dtype)
    bias = np.arange(5, dtype=dtype)
    np.testing.assert_array_equal(layer_norm(x, (5,), bias=bias), np.broadcast_to(bias, (2, 5)))
    with np.errstate(all="ignore"):
        assert np.isnan(layer_norm(x, 5, eps=0.0)).all()
    y = layer_norm(np.array([[1.0, 3.0]], dtype), 2, eps=0.0)
    assert_close(y, [[-1.0, 1.0]], dtype=dtype, n=2)       # σ = 1 exactly: eps 0 is allowed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_propagates_to_its_sample_only(dtype):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 6)).astype(dtype)
    x[1, 2] = np.nan
    w, b = np.ones(6, dtype), np.zeros(6, dtype)
    y = layer_norm(x, 6, w, b)
    assert np.isnan(y[1]).all() and not np.isnan(np.delete(y, 1, axis=0)).any()
    dout = rng.standard_normal(x.shape).astype(dtype)
    dx, dw, db = layer_norm_backward(dout, x, 6, w, b)
    assert np.isnan(dx[1]).all() and not np.isnan(np.delete(dx, 1, axis=0)).any()
    assert np.isnan(dw).all() and not np.isnan(db).any()  # dbias never sees x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty(dtype):
    """No samples: empty y and dx, zero dweight and dbias; samples of zero entries: empty."""
    for shape, normalized in (((0, 4), 4), ((2, 0, 3), (3,)), ((3, 0), 0), ((2, 3, 0), (3, 0))):
        x = np.ones(shape, dtype)
        k = k_of(normalized)
        w = np.ones(shape[len(shape) - k:], dtype)
        y = layer_norm(x, normalized, w, w)
        assert y.shape == shape and y.dtype == dtype
        dx, dw, db = layer_norm_backward(x, x, normalized, w, w)
        assert dx.shape == shape and dw.shape == w.shape and db.shape == w.shape
        assert dx.dtype == dw.dtype == db.dtype == dtype
        assert np.all(dw == 0) and np.all(db == 0)


def test_layouts_and_readonly():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 4, 3)).transpose(2, 1, 0)[:, ::-1]     # (3, 4, 5), strided
    x.flags.writeable = False
    w = rng.standard_normal(10)[::2]                                   # (5,), strided
    w.flags.writeable = False
    dout = np.asfortranarray(rng.standard_normal((3, 4, 5)))
    assert_close(layer_norm(x, [5], w), reference.layer_norm_forward(x, [5], w), dtype=np.float64,
                 n=7, scale=10.0)
    got = layer_norm_backward(dout, x, np.array([5]), w)
    want = reference.layer_norm_backward(dout, x, [5], w)
    assert_close(got[0], want[0], dtype=np.float64, n=7, scale=10.0)
    assert_close(got[1], want[1], dtype=np.float64, n=20, scale=100.0)
    assert got[2] is None
    for k in (layer_norm_forward_kernel, layer_norm_backward_kernel):   # never read-only
        seen = [t for sig in k.signatures + k.serial_signatures for t in sig
                if hasattr(t, "layout")]                # (small inputs run the serial twin)
        assert seen and all(t.layout == "C" and t.mutable for t in seen), k.signatures
    assert layer_norm is layer_norm_forward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_at_any_thread_count(dtype):
    """dweight and dbias sum fixed blocks of samples in a fixed order: the same bits at 1 and
    2 threads, for enough samples (5000) that there are hundreds of blocks."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5000, 24)) * 10.0 ** rng.integers(-3, 4, (5000, 1))).astype(dtype)
    w, b = rng.standard_normal(24).astype(dtype), rng.standard_normal(24).astype(dtype)
    dout = (rng.standard_normal(x.shape) * 10.0 ** rng.integers(-3, 4, (5000, 1))).astype(dtype)
    results = []
    threads = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            results.append([layer_norm(x, 24, w, b), *layer_norm_backward(dout, x, 24, w, b)])
    finally:
        numba.set_num_threads(threads)
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)
    want = reference.layer_norm_backward(*f64(dout, x), 24, *f64(w, b))
    s_dw, s_db = scales(x, 1, w, b, 1e-5, dout)[2:]
    assert_close(results[0][2], want[1], dtype=dtype, n=5000, scale=s_dw)
    assert_close(results[0][3], want[2], dtype=dtype, n=5000, scale=s_db)


# ------------------------------------------------------------------ bad input

X = np.ones((2, 3))


@pytest.mark.parametrize("args, kw, error, words", [
    ((np.ones((2, 3), np.int64), 3), {}, TypeError, ["x", "int64"]),
    ((np.ones((2, 3), np.float16), 3), {}, TypeError, ["x", "float16"]),
    ((None, 3), {}, TypeError, ["x", "None"]),
    ((X, 2), {}, ValueError, ["x", "(..., 2)", "normalized_shape", "(2, 3)"]),
    ((X, (2, 3, 1)), {}, ValueError, ["x", "(..., 2, 3, 1)", "(2, 3)"]),
    ((X, ()), {}, ValueError, ["normalized_shape", "at least one", "()"]),
    ((X, -3), {}, ValueError, ["normalized_shape", "negative", "-3"]),
    ((X, 3.0), {}, TypeError, ["normalized_shape", "int", "float"]),
    ((X, (3.0,)), {}, TypeError, ["normalized_shape", "int", "3.0"]),
    ((X, True), {}, TypeError, ["normalized_shape", "bool"]),
    ((X, "3"), {}, TypeError, ["normalized_shape", "str"]),
    ((X, 3), {"weight": np.ones(4)}, ValueError, ["weight", "(3,)", "(4,)"]),
    ((X, 3), {"weight": np.ones((1, 3))}, ValueError, ["weight", "(3,)", "(1, 3)"]),
    ((X, 3), {"weight": np.ones(3, np.float32)}, TypeError, ["weight", "float64", "float32"]),
    ((X, 3), {"bias": np.ones(2)}, ValueError, ["bias", "(3,)", "(2,)"]),
    ((X, 3), {"bias": np.ones(3, np.int32)}, TypeError, ["bias", "int32"]),
    ((X, 3), {"eps": -1e-5}, ValueError, ["eps", ">= 0", "-1e-05"]),
    ((X, 3), {"eps": math.nan}, ValueError, ["eps", "nan"]),
    ((X, 3), {"eps": math.inf}, ValueError, ["eps", "finite", "inf"]),
    ((X, 3), {"eps": "1e-5"}, TypeError, ["eps", "real", "str"]),
    ((X, 3), {"eps": None}, TypeError, ["eps", "real", "NoneType"]),
])
def test_rejects_bad_input(args, kw, error, words):
    dout = np.ones(np.shape(args[0])) if args[0] is not None else np.ones((2, 3))
    for call in (lambda: layer_norm(*args, **kw),
                 lambda: layer_norm_backward(dout, *args, **kw)):
        with pytest.raises(error) as info:
            call()
        for word in words:
            assert word in str(info.value)


@pytest.mark.parametrize("stats, error, words", [
    (np.zeros(2), TypeError, ["stats", "(mean, rstd)", "ndarray"]),
    ((np.zeros(2),), TypeError, ["stats", "(mean, rstd)", "tuple of 1"]),
    ((np.zeros(2), np.ones(2), np.ones(2)), TypeError, ["stats", "tuple of 3"]),
    ((np.zeros(3), np.ones(2)), ValueError, ["stats[0] (mean)", "(2,)", "(3,)"]),
    ((np.zeros(2), np.ones((2, 1))), ValueError, ["stats[1] (rstd)", "(2,)", "(2, 1)"]),
    ((np.zeros(2, np.float32), np.ones(2)), TypeError, ["stats[0] (mean)", "float64",
                                                       "float32"]),
    ((np.zeros(2), ["a", "b"]), TypeError, ["stats[1] (rstd)", "float64"]),
    ((np.zeros(2), None), TypeError, ["stats[1] (rstd)", "float64", "object"]),
])
def test_backward_rejects_bad_stats(stats, error, words):
    with pytest.raises(error) as info:
        layer_norm_backward(np.ones((2, 3)), X, 3, stats=stats)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("dout, error, words", [
    (np.ones((2, 4)), ValueError, ["dout", "(2, 3)", "(2, 4)"]),
    (np.ones((2, 3), np.float32), TypeError, ["dout", "float64", "float32"]),
    (np.ones((2, 3), bool), TypeError, ["dout", "bool"]),
])
def test_backward_rejects_bad_dout(dout, error, words):
    with pytest.raises(error) as info:
        layer_norm_backward(dout, X, 3)
    for word in words:
        assert word in str(info.value)
