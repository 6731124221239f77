"""kernels/tanh.py: the vectorised tanh and slope 1 - tanh² of attention's soft-capping, against
float64 NumPy, through the two kernels that use them (score_modifiers.softcap_tile: a tile of
scores and its slopes; softcap_scores: a row), in the arithmetic of each dtype."""
import numpy as np
from hypothesis import given, strategies as st

from npattn.kernels.score_modifiers import softcap_scores, softcap_tile
from npattn.kernels.tanh import SMALL
from strategies import dtypes

# the domain: every float, with the seam of the two forms, tiny and huge values, the edges
edges = st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan, SMALL, -SMALL, np.nextafter(SMALL, 0),
                         1e-30, 5e-324, 1e-8, 0.5, 9.0, 18.0, 44.0, 354.0, 1e30, -1e30])
values = st.one_of(edges, st.floats(-1.0, 1.0), st.floats(-25.0, 25.0),
                   st.floats(allow_nan=False, allow_infinity=False, width=32))

TANH_ULPS = 3.0     # measured: 2.8 (float32), 3.0 (float64) over 7e5 values
SLOPE_ULPS = 8.0    # measured: 4.5, 6.0


def ulps(got, want, dtype):
    """|got - want| in units of the dtype's spacing at want (want > 0 below the dtype's normal
    range counts at its smallest normal spacing)."""
    spacing = np.spacing(np.maximum(np.abs(want), np.finfo(dtype).tiny).astype(dtype))
    return np.abs(got.astype(np.float64) - want) / spacing.astype(np.float64)


@given(dtype=dtypes, xs=st.lists(values, min_size=1, max_size=40))
def test_tanh_and_its_slope_are_within_a_few_ulps(dtype, xs):
    x = np.array(xs, np.float64).astype(dtype)
    tile = x.reshape(1, -1).copy()
    slope = np.empty_like(tile)
    softcap_tile(tile, slope, 1.0)                    # cap 1: tile = tanh(x)
    t, d = tile[0], slope[0]
    for i, value in enumerate(x):                     # each alone: the series where small
        one, slope_one = np.array([[value]]), np.empty((1, 1), dtype)
        softcap_tile(one, slope_one, 1.0)
        assert np.array_equal(one[0], t[i:i + 1], equal_nan=True)
        assert np.array_equal(slope_one[0], d[i:i + 1], equal_nan=True)
    x64 = x.astype(np.float64)
    want_t = np.tanh(x64)
    with np.errstate(over="ignore"):
        want_d = 1.0 / np.cosh(np.minimum(np.abs(x64), 700.0)) ** 2
    assert t.dtype == d.dtype == dtype
    assert np.array_equal(np.isnan(t), np.isnan(x)) and np.array_equal(np.isnan(d), np.isnan(x))
    ok = ~np.isnan(x)
    assert np.all(ulps(t[ok], want_t[ok], dtype) <= TANH_ULPS), x[ok][np.argmax(
        ulps(t[ok], want_t[ok], dtype))]
    # the slope 4e/(1 + e)² is 0 where e = exp(-2|x|) is below the dtype's normal range (as
    # kernels/exp.py returns no subnormals): an absolute error up to 4·tiny there
    flushed = np.abs(d[ok].astype(np.float64) - want_d[ok]) <= 4 * np.finfo(dtype).tiny
    slope_ulps = np.where(flushed, 0.0, ulps(d[ok], want_d[ok], dtype))
    assert np.all(slope_ulps <= SLOPE_ULPS), x[ok][np.argmax(slope_ulps)]
    assert np.all(np.abs(t[ok]) <= 1)
    # odd to the bit, -0 kept: the sign goes on last
    neg = -x.reshape(1, -1)
    softcap_tile(neg, np.empty_like(neg), 1.0)
    assert np.array_equal(neg[0][ok], -t[ok])
    assert np.array_equal(np.signbit(t[ok]), np.signbit(x[ok]))


@given(dtype=dtypes, xs=st.lists(values, min_size=1, max_size=40),
       cap=st.sampled_from([0.05, 1.0, 30.0, 1e4]))
def test_the_row_and_the_tile_cap_to_the_same_bits(dtype, xs, cap):
    """Forward caps its panels with softcap_scores, backward its tiles with softcap_tile: the
    same score must come out the same (backward rebuilds forward's probabilities), whichever
    form each block takes -- the series alone where every score of the block is small, the
    full form where one is not: here the whole row against each score alone, and the tile."""
    x = np.array(xs, np.float64).astype(dtype)
    row, tile = x.copy(), x.reshape(1, -1).copy()
    softcap_scores(row, cap)
    softcap_tile(tile, np.empty_like(tile), cap)
    assert np.array_equal(row, tile[0], equal_nan=True)
    for i, value in enumerate(x):
        alone, one = np.array([value]), np.array([[value]])
        slope_alone = np.empty_like(one)
        softcap_scores(alone, cap)
        softcap_tile(one, slope_alone, cap)
        assert np.array_equal(alone, row[i:i + 1], equal_nan=True)
        assert np.array_equal(one[0], row[i:i + 1], equal_nan=True)
    c = dtype(cap)
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.float64(c) * np.tanh(x.astype(np.float64) * np.float64(dtype(1 / cap)))
    ok = ~np.isnan(x)
    assert np.all(np.abs(row[ok]) <= c)
    # within 8 ulps, or where x / cap underflows, by cap times the smallest subnormal
    atol = 2 * c * np.finfo(dtype).smallest_subnormal
    assert np.all(np.abs(row[ok] - want[ok]) <= 8 * np.spacing(np.abs(want[ok]).astype(dtype))
                  + atol)
