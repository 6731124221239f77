"""kernels/exp.py: the vectorised exp of x <= 0 that softmax and attention use, against float64
NumPy: exp_nonpositive (float64 arithmetic), and the _native / _shifted forms that compute in
the input's dtype (float32 arithmetic for float32) with an optional shift per lane."""
import numpy as np
from hypothesis import given, strategies as st
from numba import njit

from npattn.kernels.exp import (exp_for, exp_nonpositive, exp_nonpositive_native,
                                exp_shifted_native)
from strategies import dtypes

# the domain: [-inf, 0], with its edges (the underflow cut, denormal inputs) drawn often
edges = st.sampled_from([0.0, -0.0, -np.inf, np.nan, -708.0, -708.0001, -745.2, -1e-310,
                         -5e-324, -87.3, -103.9, -104.0, -1e-30, -0.5 * np.log(2)])
values = st.one_of(edges, st.floats(-750.0, 0.0), st.floats(-1.0, 0.0))


@given(dtype=dtypes, xs=st.lists(values, min_size=0, max_size=70))
def test_exp_within_one_ulp_of_float64(dtype, xs):
    x = np.array(xs, dtype=dtype)
    out = np.empty_like(x)
    exp_nonpositive(x, out)
    want = np.exp(x.astype(np.float64))
    assert out.dtype == x.dtype
    assert np.array_equal(np.isnan(out), np.isnan(want))
    tiny = np.finfo(dtype).tiny
    normal = np.isfinite(want) & (want >= tiny) & (x.astype(np.float64) >= -708.0)
    ulps = np.abs(out[normal].astype(np.float64) - want[normal]) / (want[normal] *
                                                                     np.finfo(dtype).eps)
    assert np.all(ulps <= 1.0), (x[normal][np.argmax(ulps)], np.max(ulps))
    # below float64's normal range (x < -708) the result is 0; below the dtype's, at most tiny
    assert np.all(out[x < -708.0] == 0)
    assert np.all(np.abs(out[~normal & ~np.isnan(want)]) <= tiny)


def test_exp_in_place_over_a_long_row():
    x = -np.abs(np.random.default_rng(0).standard_normal(1 << 16) * 30)
    want = np.exp(x)
    exp_nonpositive(x, x)   # out may be x itself
    np.testing.assert_allclose(x, want, rtol=2.3e-16, atol=0)


def _native_exp(x, shift=None):
    """exp_nonpositive_native(x), or exp_shifted_native(x, shift) with W = shift lanes."""
    out = np.empty_like(x)
    if shift is None:
        exp_nonpositive_native(x, out)
    else:
        exp_shifted_native(x, shift, out)
    return out


@given(dtype=dtypes, xs=st.lists(values, min_size=0, max_size=70),
       width=st.sampled_from([None, 1, 3, 16]), data=st.data())
def test_native_exp_within_one_ulp_in_its_dtype(dtype, xs, width, data):
    """float32 arithmetic for float32: within 1 ulp of float32 where exp is a normal float32
    (x >= ln 2^-126 ≈ -87.34), 0 below; float64 as exp_nonpositive. With a shift per lane,
    out[j·W + c] = exp(x[j·W + c] - shift[c]), the difference rounded in the dtype first."""
    x = np.array(xs[:len(xs) // width * width] if width else xs, dtype=dtype)
    shift, arg = None, x.astype(np.float64)
    if width:
        shift = np.array(data.draw(st.lists(st.floats(-50.0, 50.0), min_size=width,
                                            max_size=width)), dtype=dtype)
        lanes = np.tile(shift, x.shape[0] // width)
        with np.errstate(invalid="ignore"):
            x = (x + lanes).astype(dtype)                     # the caller's scores ...
            arg = (x - lanes).astype(np.float64)              # ... and what gets exponentiated
    out = _native_exp(x, shift)
    want = np.exp(arg)
    assert out.dtype == x.dtype
    assert np.array_equal(np.isnan(out), np.isnan(want))
    tiny = np.finfo(dtype).tiny
    normal = np.isfinite(want) & (want >= tiny) & (arg >= -708.0) & (arg <= 0)
    ulps = np.abs(out[normal].astype(np.float64) - want[normal]) / (want[normal] *
                                                                     np.finfo(dtype).eps)
    assert np.all(ulps <= 1.0), (arg[normal][np.argmax(ulps)], np.max(ulps))
    assert np.all(np.abs(out[~normal & ~np.isnan(want) & (arg <= 0)]) <= tiny)


@njit
def _short_exps(like, x, out):
    for k in range(x.shape[0]):
        out[k] = exp_for(like, x[k])


@given(dtype=dtypes, xs=st.lists(values, min_size=0, max_size=70))
def test_exp_for_a_dtype_is_as_precise_as_that_dtype_needs(dtype, xs):
    """exp_for(like, x): float64 arithmetic for any like, within 7.5e-9 relative of exp(x) for
    a float32 like (exp_one_short: the degree-7 series leaves r^8/8! <= 7.3e-9 of exp(r) at
    r = -ln(2)/2, a quarter of float32's half ulp) and within float64's 1 ulp for a float64 one
    (exp_one); 0 below -708 and at -inf, NaN for NaN."""
    x = np.array(xs, dtype=np.float64)
    out = np.empty_like(x)
    _short_exps(np.empty(0, dtype), x, out)
    want = np.exp(x)
    assert np.array_equal(np.isnan(out), np.isnan(want))
    normal = np.isfinite(want) & (x >= -708.0) & (want >= np.finfo(np.float64).tiny)
    rel = np.abs(out[normal] - want[normal]) / want[normal]
    bound = 7.5e-9 if dtype == np.float32 else np.finfo(np.float64).eps
    assert np.all(rel <= bound), (x[normal][np.argmax(rel)], np.max(rel))
    assert np.all(out[x < -708.0] == 0)
