"""The attention engine's vector exponentials (kernels/vector_exp.py) against the scalar loops
they replace, bit for bit -- the same arithmetic, a row a vector -- for the panel widths the
engines use and odd ones, both dtypes, and every kind of input the softmax feeds them (−inf
from masks, NaN with a payload, scores of ±1e30, the underflow cut, denormals, −0):

* the forward's ``exp_rows(x, shift, out)`` gives exactly ``exp.exp_shifted_native``'s results
  and writes nothing past its whole rows;
* the backward's ``grad_row`` (p, w and ds of one tile row, with and without dropout) gives
  exactly what the scalar loop gives, compiled from the same Python (a NaN as a NaN: where two
  meet, which payload survives is LLVM's choice).

(exp.py's own accuracy, within 1 ulp, is tests/test_exp.py's.) Under ``NUMBA_BOUNDSCHECK=1``
(test_boundscheck.py runs this file so) a call whose arrays are too short raises IndexError."""
import functools

import numba
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npattn.kernels import exp, tiles, vector_exp

#: the panel widths: every engine tile's NR, and some no engine uses
WIDTHS = sorted({nr for _, nr in {**tiles.TILES, **tiles.ATTENTION_TILES}.values()}
                | {1, 3, 5, 24})


@functools.cache
def compiled(width):
    exp_rows = vector_exp.shifted_rows(width)

    @numba.njit
    def run(x, shift, out):
        exp_rows(x, shift, out)
    return run


@functools.cache
def compiled_grad(width):
    """(the vector row, the scalar loop it replaced -- _python_grad_row compiled as a kernel
    compiles it, fused multiply-adds allowed)"""
    grad_row = vector_exp.softmax_grad_row(width)

    @numba.njit
    def run(t, dp, kept, dropped, scale, shift, inv, d, ds, w):
        grad_row(t, dp, kept, dropped, scale, shift, inv, d, ds, w)
    scalar = numba.njit(fastmath={"contract"})(vector_exp._python_grad_row(width))
    return run, scalar


def as_bits(x):
    return x.view(np.uint32 if x.dtype == np.float32 else np.uint64)


#: scores as the forward's panels hold them: masked (−inf), NaN (with a payload, set below),
#: far from zero, at exp's underflow cuts, tiny and signed zeros
EDGES = [0.0, -0.0, -np.inf, np.nan, -1e30, 1e30, -708.0, -708.0001, -745.2, -87.33654,
         -87.3366, -103.9, -1e-30, -5e-324, -0.5 * np.log(2), 0.5 * np.log(2)]
values = st.one_of(st.sampled_from(EDGES), st.floats(-800.0, 50.0), st.floats(-1.0, 1.0))


@given(width=st.sampled_from(WIDTHS), dtype=st.sampled_from([np.float32, np.float64]),
       rows=st.integers(0, 12), extra=st.integers(0, 4), data=st.data())
def test_rows_are_exp_py_bit_for_bit(width, dtype, rows, extra, data):
    n = rows * width + min(extra, width - 1)     # x may end in part of a row: not computed
    scores = np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
    shift = np.array(data.draw(st.lists(values, min_size=width, max_size=width)), dtype=dtype)
    shift[np.isnan(shift)] = 0                   # a running max is never NaN here
    lane = np.arange(n) % width
    with np.errstate(invalid="ignore"):         # (±inf − ±inf: NaN, as the engine would see)
        # the contract: x − shift <= 0 (or NaN) -- the shift is at least each lane's scores
        x = np.where(scores - shift[lane] > 0, shift[lane], scores).astype(dtype)
    if n:
        as_bits(x)[data.draw(st.integers(0, n - 1))] = (0x7FC00123 if dtype == np.float32
                                                       else 0x7FF8000000000123)
    want = np.full(n, 7, dtype)
    whole = rows * width
    exp.exp_shifted_native(x[:whole], shift, want[:whole])
    out = np.full(n, 7, dtype)
    compiled(width)(x, shift, out)
    np.testing.assert_array_equal(as_bits(out), as_bits(want))


def test_rows_of_an_attention_panel_match_over_a_long_block():
    """One key block of a panel as the forward runs it (256 keys × NR queries), every lane's
    scores spread over exp's whole range below its max, both dtypes and every engine width."""
    rng = np.random.default_rng(0)
    for width in sorted({nr for _, nr in tiles.ATTENTION_TILES.values()}):
        for dtype in (np.float32, np.float64):
            x = (rng.standard_normal(256 * width) * 40).astype(dtype)
            x[rng.integers(0, x.size, 64)] = -np.inf
            shift = x.reshape(256, width).max(axis=0)
            want, out = np.empty_like(x), np.empty_like(x)
            exp.exp_shifted_native(x, shift, want)
            compiled(width)(x, shift, out)
            np.testing.assert_array_equal(as_bits(out), as_bits(want))


@given(width=st.sampled_from(WIDTHS), dtype=st.sampled_from([np.float32, np.float64]),
       dropped=st.booleans(), data=st.data())
def test_a_backward_row_is_the_scalar_loop_bit_for_bit(width, dtype, dropped, data):
    def draw(n):
        return np.array(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
    scores, dp = draw(width), draw(width)
    shift, inv, d, scale = (dtype(v) for v in data.draw(st.tuples(values, values, values,
                                                                  values)))
    with np.errstate(invalid="ignore"):          # the contract, as for exp_rows: s − lse <= 0
        t = np.where(scores - shift > 0, shift, scores).astype(dtype)
    as_bits(t)[data.draw(st.integers(0, width - 1))] = (0x7FC00123 if dtype == np.float32
                                                        else 0x7FF8000000000123)
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=width, max_size=width)))
    run, scalar = compiled_grad(width)
    got = [np.full(width + 1, 7, dtype) for _ in range(2)]   # one past the row: untouched
    want = [np.full(width + 1, 7, dtype) for _ in range(2)]
    run(t, dp, kept, dropped, scale, shift, inv, d, got[0], got[1])
    scalar(t, dp, kept, dropped, scale, shift, inv, d, want[0], want[1])
    for g, w in zip(got, want):
        # NaN where the loop has NaN, and every other element's bits. A NaN's payload is not
        # compared: where two NaNs meet (a NaN score times a NaN normaliser, say), LLVM leaves
        # open which one's payload the product keeps -- the loop kept the score's, the vector
        # code the normaliser's, in a case Hypothesis found
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(as_bits(g)[~np.isnan(w)], as_bits(w)[~np.isnan(w)])


def test_short_arrays_raise_under_bounds_checking():
    """With NUMBA_BOUNDSCHECK=1 (test_boundscheck.py) a call checks out and shift first;
    without it, the caller's contract (out as long as x, W shifts) keeps it in bounds."""
    if not numba.config.BOUNDSCHECK:
        pytest.skip("checks the NUMBA_BOUNDSCHECK=1 build: test_boundscheck.py runs it so")
    run = compiled(16)
    x = np.zeros(64, np.float32)
    for shift, out in ((np.zeros(16, np.float32), np.zeros(63, np.float32)),
                       (np.zeros(15, np.float32), np.zeros(64, np.float32))):
        with pytest.raises(IndexError, match="vector exp"):
            run(x, shift, out)
    run(x[:63], np.zeros(16, np.float32), np.zeros(48, np.float32))  # 3 whole rows: fits
    grad, _ = compiled_grad(16)
    row, kept = np.zeros(16, np.float32), np.ones(16, bool)
    one = np.float32(1)
    for short in range(5):                      # each of t, dp, kept, ds, w one short
        args = [row, row, kept, True, one, one, one, one, row.copy(), row.copy()]
        position = (0, 1, 2, 8, 9)[short]
        args[position] = args[position][:15]
        with pytest.raises(IndexError, match="vector exp"):
            grad(*args)
    grad(row, row, kept, True, one, one, one, one, np.zeros(16, np.float32),
         np.zeros(16, np.float32))
