"""Row softmax and log-softmax, forward and backward.  Dims: N rows, C entries per row.

Accumulator: the input dtype (float32 rows sum in float32, as PyTorch does). Each row is three
passes in a fixed order -- max, sum of exp, normalise -- so every exp is of a number <= 0 and
logits up to ±1e30 neither overflow nor lose the row. A row whose every entry is -inf (fully
masked) gives zeros from softmax, -inf from log_softmax and zero gradients, never 0/0 = NaN.
A NaN anywhere in a row makes the sum NaN, and with it the whole row.
"""
import numpy as np
from numba import prange

from .._jit import parallel_kernel


@parallel_kernel
def softmax_forward_kernel(x, out, log):
    # x (N, C) -> out (N, C): softmax along C, or log_softmax when log is True
    n_rows, n_cols = x.shape
    for n in prange(n_rows):                   # each iteration owns row n of out
        m = x.dtype.type(-np.inf)              # pass 1: the row max (a NaN is caught by pass 2)
        for k in range(n_cols):
            if x[n, k] > m:
                m = x[n, k]
        if m == -np.inf:                       # every entry -inf: shift by 0, as -inf - -inf is NaN
            m = x.dtype.type(0)
        s = x.dtype.type(0)                    # pass 2: s = sum_k exp(x[n, k] - m), >= 1
        for k in range(n_cols):                # unless the row is fully masked (0) or has a NaN
            shifted = x[n, k] - m
            e = np.exp(shifted)
            s += e
            out[n, k] = shifted if log else e  # kept apart: reassociating x - m - log(s) into
                                               # x - (m + log(s)) would round log(s) away
        # pass 3: normalise. A fully masked row (s == 0) is skipped: pass 2 already wrote
        # exp(-inf) = 0, or -inf - 0 = -inf. A row with a NaN has s = NaN != 0: all NaN.
        if s != 0 and log:
            log_s = np.log(s)
            for k in range(n_cols):
                out[n, k] -= log_s
        elif s != 0:
            for k in range(n_cols):
                out[n, k] /= s


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
    for n in prange(n_rows):                   # dx[n, k] = dout[n, k] - exp(out[n, k]) * acc
        masked = True                          # every out -inf: the row was fully masked, and
        for k in range(n_cols):                # exp(-inf) = 0 would pass dout through unchanged
            if out[n, k] != -np.inf:
                masked = False
                break
        if masked:
            for k in range(n_cols):
                dx[n, k] = 0
        else:
            acc = dx.dtype.type(0)             # acc = sum_j dout[n, j]
            for k in range(n_cols):
                acc += dout[n, k]
            for k in range(n_cols):
                dx[n, k] = dout[n, k] - np.exp(out[n, k]) * acc
