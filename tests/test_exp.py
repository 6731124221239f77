"""kernels/exp.py: the vectorised exp of x <= 0 that softmax uses, against float64 NumPy."""
import numpy as np
from hypothesis import given, strategies as st

from npattn.kernels.exp import exp_nonpositive
from strategies import dtypes

# the domain: [-inf, 0], with its edges (the underflow cut, denormal inputs) drawn often
edges = st.sampled_from([0.0, -0.0, -np.inf, np.nan, -708.0, -708.0001, -745.2, -1e-310,
                         -5e-324, -87.3, -103.9, -104.0, -1e-30, -0.5 * np.log(2)])
values = st.one_of(edges, st.floats(-750.0, 0.0), st.floats(-1.0, 0.0))


@given(dtype=dtypes, xs=st.lists(values, min_size=0, max_size=70))
def test_exp_within_one_ulp_of_float64(dtype, xs):
    x = np.array(xs, dtype=dtype)
    out = np.empty_like(x)
    exp_nonpositive(x, out, np.empty(x.shape[0], np.int64))
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
    exp_nonpositive(x, x, np.empty(x.shape[0], np.int64))   # out may be x itself
    np.testing.assert_allclose(x, want, rtol=2.3e-16, atol=0)
