"""Row softmax and log-softmax, forward and backward.  Dims: N rows, C entries per row.

Accumulator: the input dtype (float32 rows sum in float32, as PyTorch does). Each row is three
passes in a fixed order -- max, exp and its sum, normalise -- so every exp is of a number <= 0
and logits up to ±1e30 neither overflow nor lose the row; that exp is ``kernels/exp.py``'s
vectorised one, in the row's own arithmetic (float32 for float32: twice the SIMD lanes), and
the second pass is one vector loop (exp, store, sum). Only pass 1 reads the row from memory:
the later passes find it in L1. A row whose every entry is -inf (fully
masked) gives zeros from softmax, -inf from log_softmax and zero gradients, never 0/0 = NaN.
A NaN anywhere in a row makes the sum NaN, and with it the whole row.
"""
import numpy as np
from numba import prange

from .._jit import kernel, parallel_kernel
from . import _lane_max
from .exp import exp_nonpositive_native, exp_one_native

ROWS = 16   # rows per parallel work item: the scratch is allocated once per item
LANES = 32  # running maxima in row_max: two AVX-512 registers of float32 (four of float64)

#: The running maxima of row_max as LANES named scalars (generated: kernels/_lane_max_generate.py),
#: which the SLP vectoriser turns into vector registers; a loop over an array of maxima would
#: load and store them every step, as LLVM cannot rule out that it overlaps the row.
lane_max = kernel(getattr(_lane_max, f"lane_max_{LANES}"))


@kernel
def row_max(row, lanes):
    # max of row (C,), NaN ignored (pass 2 propagates it), -inf for an empty row. LANES
    # independent running maxima, so the compare-and-select vectorises (a single running max
    # is a chain LLVM may not reorder without assuming no NaN); the max is the same whatever
    # the order.
    n_full = row.shape[0] // LANES
    lane_max(row, n_full, lanes)
    m = row.dtype.type(-np.inf)
    for j in range(LANES):
        m = lanes[j] if lanes[j] > m else m
    for k in range(n_full * LANES, row.shape[0]):
        m = row[k] if row[k] > m else m
    return m


@parallel_kernel
def softmax_forward_kernel(x, out, log):
    # x (N, C) -> out (N, C): softmax along C, or log_softmax when log is True
    n_rows, n_cols = x.shape
    for chunk in prange((n_rows + ROWS - 1) // ROWS):  # each iteration owns ROWS rows of out
        lanes = np.empty(LANES, x.dtype)       # scratch of row_max
        for n in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_rows)):
            xn = x[n]
            row = out[n]
            m = row_max(xn, lanes)             # pass 1 (a NaN is caught by pass 2)
            if m == -np.inf:                   # every entry -inf: shift by 0, as -inf - -inf is NaN
                m = x.dtype.type(0)
            # pass 2, one vector loop: exp(x - m) of x - m <= 0 (kernels/exp.py) and its sum s;
            # the row stays in L1 for pass 3. s >= 1 unless the row is fully masked (0) or has
            # a NaN
            s = out.dtype.type(0)
            if log:                            # x - m is kept: x - m - log(s) reassociated
                for k in range(n_cols):        # into x - (m + log(s)) would round log(s) away
                    shifted = xn[k] - m
                    row[k] = shifted
                    s += exp_one_native(shifted)
            else:
                for k in range(n_cols):
                    e = exp_one_native(xn[k] - m)
                    row[k] = e
                    s += e
            # pass 3: normalise. A fully masked row (s == 0) keeps exp(-inf) = 0, or -inf - 0 =
            # -inf for log. A row with a NaN has s = NaN != 0: all NaN.
            if s != 0:
                if log:
                    log_s = np.log(s)
                    for k in range(n_cols):
                        row[k] -= log_s
                else:                          # times 1/s, as PyTorch: a division per entry
                    inv = 1 / s                # costs more than the rest of the pass (s >= 1)
                    for k in range(n_cols):
                        row[k] *= inv


@parallel_kernel
def softmax_backward_kernel(dout, out, dx):
    # forward was: out[n, k] = exp(x[n, k] - m) / sum_j exp(x[n, j] - m)
    n_rows, n_cols = out.shape
    for n in prange(n_rows):                   # dx[n, k] = out[n, k] * (dout[n, k] - acc)
        acc = dx.dtype.type(0)                 # acc = sum_j dout[n, j] * out[n, j]
        for k in range(n_cols):
            acc += dout[n, k] * out[n, k]
        for k in range(n_cols):                # a fully masked row has out = 0, so dx = 0
            dx[n, k] = out[n, k] * (dout[n, k] - acc)


@parallel_kernel
def log_softmax_backward_kernel(dout, out, dx):
    # forward was: out[n, k] = x[n, k] - m - log(sum_j exp(x[n, j] - m))
    n_rows, n_cols = out.shape
    for chunk in prange((n_rows + ROWS - 1) // ROWS):  # each iteration owns ROWS rows of dx
        p = np.empty(n_cols, dx.dtype)         # exp(out): the softmax of the forward
        for n in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_rows)):
            masked = True                      # every out -inf: the row was fully masked, and
            for k in range(n_cols):            # exp(-inf) = 0 would pass dout through unchanged
                if out[n, k] != -np.inf:
                    masked = False
                    break
            if masked:
                for k in range(n_cols):
                    dx[n, k] = 0
                continue
            acc = dx.dtype.type(0)             # dx[n, k] = dout[n, k] - exp(out[n, k]) * acc
            for k in range(n_cols):            # acc = sum_j dout[n, j]
                acc += dout[n, k]
            exp_nonpositive_native(out[n], p)
            for k in range(n_cols):
                dx[n, k] = dout[n, k] - p[k] * acc
