"""The packing copies (kernels/vector_pack.py) against NumPy, bit for bit: every element they
name is copied (NaN payloads, signed zeros and infinities included) and nothing else is written,
for the row widths and vector lengths the engines use and some they do not, any count (the
transposition's last columns run one at a time), offsets and steps. Under
``NUMBA_BOUNDSCHECK=1`` (test_boundscheck.py runs this file so) a copy reaching outside its
arrays raises IndexError."""
import functools

import numba
import numpy as np
import pytest
from hypothesis import given, strategies as st

from npattn.kernels import tiles, vector_pack

#: (width, lanes): the engines' (MR and NR per ISA and dtype, BT) and odd ones
PAIRS = sorted({(w, tiles.VECTOR_BYTES[isa] // np.dtype(d).itemsize)
                for (isa, d), (mr, nr) in {**tiles.TILES, **tiles.ATTENTION_TILES}.items()
                for w in (mr, nr, min(nr, tiles.VECTOR_BYTES[isa] // np.dtype(d).itemsize))}
               | {(1, 16), (3, 8), (5, 4), (32, 8)})


@functools.cache
def compiled(width, lanes):
    copy_rows, transpose_rows = vector_pack.packers(width, lanes)

    @numba.njit
    def copy(n, src, s0, s_step, dst, d0, d_step):
        copy_rows(n, src, s0, s_step, dst, d0, d_step)

    @numba.njit
    def transpose(n, src, s0, s_step, dst, d0, d_step):
        transpose_rows(n, src, s0, s_step, dst, d0, d_step)
    return copy, transpose


def special_values(rng, size, dtype):
    """Values with every kind of bits a copy must keep: NaN with a payload, ±0, ±inf."""
    x = rng.standard_normal(size).astype(dtype)
    bits = x.view(np.uint32 if dtype == np.float32 else np.uint64)
    picks = rng.integers(0, size, 4)
    x[picks[0]], x[picks[1]], x[picks[2]] = -0.0, np.inf, -np.inf
    bits[picks[3]] = (0x7FC00123 if dtype == np.float32 else 0x7FF8000000000123)
    return x


def as_bits(x):
    return x.view(np.uint32 if x.dtype == np.float32 else np.uint64)


@given(pair=st.sampled_from(PAIRS), dtype=st.sampled_from([np.float32, np.float64]),
       n=st.integers(0, 70), gap=st.integers(0, 5), pad=st.integers(0, 3),
       offsets=st.tuples(st.integers(0, 7), st.integers(0, 7)), seed=st.integers(0, 2**32 - 1))
def test_copies_move_exactly_the_named_elements(pair, dtype, n, gap, pad, offsets, seed):
    width, lanes = pair
    copy, transpose = compiled(width, lanes)
    rng = np.random.default_rng(seed)
    s0, d0 = offsets
    # copy_rows: n rows of `width`, `width + gap` apart in src, `width + pad` in dst
    s_step, d_step = width + gap, width + pad
    src = special_values(rng, s0 + n * s_step + width, dtype).reshape(1, -1)  # (2-D: any rank)
    dst = np.full(d0 + n * d_step + width, 7, dtype)
    want = dst.copy()
    for r in range(n):
        want[d0 + r * d_step:d0 + r * d_step + width] = src[0, s0 + r * s_step:
                                                               s0 + r * s_step + width]
    copy(n, src, s0, s_step, dst, d0, d_step)
    np.testing.assert_array_equal(as_bits(dst), as_bits(want))
    # transpose_rows: `width` rows of n (n + gap apart) become n rows of `width`
    s_step = n + gap
    src = special_values(rng, s0 + width * s_step + 1, dtype)
    dst = np.full(d0 + n * d_step + width, 7, dtype)
    want = dst.copy()
    for p in range(n):
        want[d0 + p * d_step:d0 + p * d_step + width] = src[s0 + p:s0 + p + width * s_step:
                                                            s_step][:width]
    transpose(n, src, s0, s_step, dst, d0, d_step)
    np.testing.assert_array_equal(as_bits(dst), as_bits(want))


def test_copies_outside_their_arrays_raise_under_bounds_checking():
    """With NUMBA_BOUNDSCHECK=1 (test_boundscheck.py) each copy checks its span first; without
    it, the caller's contract (every element inside) is what keeps it in bounds."""
    if not numba.config.BOUNDSCHECK:
        pytest.skip("checks the NUMBA_BOUNDSCHECK=1 build: test_boundscheck.py runs it so")
    copy, transpose = compiled(8, 16)
    src, dst = np.zeros(64, np.float32), np.zeros(64, np.float32)
    # (outside, inside): the same call one element further, and as far as it may go
    for run, outside, inside in (
            (copy, (8, src, 0, 8, dst, 1, 8), (8, src, 0, 8, dst, 0, 8)),  # dst's last row
            (copy, (8, src, 1, 8, dst, 0, 8), (7, src, 1, 8, dst, 0, 8)),  # src's last row
            (transpose, (9, src, 0, 8, dst, 0, 8), (8, src, 0, 8, dst, 0, 8)),
            (transpose, (8, src, -1, 8, dst, 0, 8), (8, src, 0, 8, dst, 0, 8)),
            (transpose, (8, src, 0, 8, dst, 1, 8), (7, src, 0, 8, dst, 1, 8))):
        with pytest.raises(IndexError, match="vector pack"):
            run(*outside)
        run(*inside)
