"""Rotary position embedding (RoPE): each pair of entries of a row rotated by its position's
angles, and the rotation by −θ for the backward. Dims: R rows (the leading dims and L
flattened: row r is position r mod L), E entries per row, h = E/2 pairs, L positions.

    halves      (GPT-NeoX, LLaMA): pair k is (x[k], x[k + h])
    interleaved (GPT-J):           pair k is (x[2k], x[2k + 1])

    out_a = a·cos θ − b·sin θ,   out_b = b·cos θ + a·sin θ        (a, b) pair k, θ = θ[l, k]
    inverse (rotation by −θ):    sin θ → −sin θ  (the backward: dx = R(−θ)·dout)

Accumulator: none (no reduction); the input dtype's arithmetic, each product rounded and then
the sum (``exact_kernel``: no fused multiply-add), so the result has NumPy's bits for
``a*c - b*s`` and the same bits in every copy of the code -- compiled here or loaded from the
disk cache, serial twin or parallel (docs/architecture.md §9.8). Negating sin is exact, so the
inverse rotation is the same arithmetic. NaN and ±inf follow IEEE (inf·0 = NaN where sin θ is
0, at position 0), as the formula and PyTorch do.
"""
from numba import prange

from .._jit import exact_kernel, parallel_kernel

BLOCK = 4096  # elements per prange iteration (whole rows, at least one); one block runs serially


@exact_kernel
def rotate_halves_row(row, c, s, inverse, dst):
    # one row (E,) into dst (E,), c, s (h,): pair k is (row[k], row[k + h])
    h = c.shape[0]
    a, b = row[:h], row[h:]                      # (views from 0: unit strides for LLVM)
    out_a, out_b = dst[:h], dst[h:]
    if inverse:
        for k in range(h):
            out_a[k] = a[k] * c[k] + b[k] * s[k]
            out_b[k] = b[k] * c[k] - a[k] * s[k]
    else:
        for k in range(h):
            out_a[k] = a[k] * c[k] - b[k] * s[k]
            out_b[k] = b[k] * c[k] + a[k] * s[k]


@exact_kernel
def rotate_pairs_row(row, c, s, inverse, dst):
    # one row (E,) into dst (E,), c, s (h,): pair k is (row[2k], row[2k + 1])
    for k in range(c.shape[0]):
        sk = -s[k] if inverse else s[k]          # ±sin θ: exact, the same arithmetic
        a, b = row[2 * k], row[2 * k + 1]
        dst[2 * k] = a * c[k] - b * sk
        dst[2 * k + 1] = b * c[k] + a * sk


@parallel_kernel(twin=True)
def rotary_kernel(x, cos, sin, interleaved, inverse, out):
    # x (R, E), cos, sin (L, E/2) -> out (R, E): every pair of row r rotated by θ[r mod L]
    # (by −θ when inverse: the backward, dx = R(−θ)·dout)
    n_rows, width = x.shape
    length = cos.shape[0]
    rows = max(1, BLOCK // max(width, 1))       # rows per block
    for blk in prange((n_rows + rows - 1) // rows):   # each iteration owns rows of out
        for r in range(blk * rows, min(blk * rows + rows, n_rows)):
            pos = r % length
            if interleaved:
                rotate_pairs_row(x[r], cos[pos], sin[pos], inverse, out[r])
            else:
                rotate_halves_row(x[r], cos[pos], sin[pos], inverse, out[r])
