"""Cross-entropy with class-index targets: log-softmax and the negative log-likelihood fused,
one row at a time, never materialising the log-probabilities.
Dims: N rows (every position: the batch and any extra dims flattened), C classes.

For a row x with target t and label smoothing ε (m = max_c x_c, s = Σ_c exp(x_c - m)):

    log p_c = (x_c - m) - log s
    loss    = -log p_t                                           (ε = 0)
            = (1 - ε)·(-log p_t) + ε/C · Σ_c (-log p_c)          (ε > 0, PyTorch's formula)
    dloss/dx_c = p_c - (1 - ε)·[c = t] - ε/C

Accumulator: float64 for both dtypes -- the shifted logits, Σ exp, the log, Σ (x - m) for label
smoothing, each row's loss and the sum over rows; results are rounded to the input dtype once.
Every exp is of a number <= 0 (``kernels/exp.py``), so logits up to ±1e30 are fine; a -inf logit
has p = 0 (and makes a smoothed loss inf, as in PyTorch); a row whose every logit is -inf, or
with a NaN or +inf, gives NaN -- PyTorch's log_softmax does the same.

Each row is read twice: for its max, then in one vector loop that forms x_c - m, its exp
(``exp_for``, inlined) and the two sums -- the backward keeps the exps for its third pass, the
forward keeps nothing. The exp is float64 arithmetic for both dtypes: within 1 ulp of float64
for float64 rows, and within 7.5e-9 relative for float32 rows (a quarter of float32's half ulp,
at about half the series), whose results are rounded to float32 (measured on a Zen 3, (768, 65)
float32: forward and backward kernels 1.6-1.7x faster than with the float64 rows' exp).
(Measured on Zen 4, (768, 65) and (2048, 65) float32, 2 threads, alternating: forward
1.29-1.31×, backward 1.25-1.27× faster than four passes through float64 scratch rows; the same
bits at these shapes.)

Targets: target[n] in [0, C) is a class; anything else is ignored (loss 0, gradient 0, the row
never read). The functional layer maps ``ignore_index`` to -1 and rejects other values first.
"""
import numpy as np
from numba import prange

from .._jit import kernel, parallel_kernel
from .exp import exp_for
from .softmax import LANES, row_max

ROWS = 16  # rows per parallel work item: the scratch is allocated once per item


@kernel
def row_exp_sum(row, lanes):
    # For one row (C,): (m, s, Σ_c (x_c - m)) with m = max_c x_c in float64 and s = Σ_c exp(x_c
    # - m), in one vector loop after the max. Scratch: lanes (LANES,) of the row's dtype
    m = np.float64(row_max(row, lanes))        # NaN ignored here; it makes s NaN below
    s = 0.0
    total = 0.0
    for c in range(row.shape[0]):
        shifted = np.float64(row[c]) - m       # all -inf: -inf - -inf = NaN, as PyTorch
        s += exp_for(row, shifted)
        total += shifted
    return m, s, total


@kernel
def row_exps(row, lanes, e):
    # For one row (C,): e[c] = exp(x_c - m) (e (C,) float64) and returns their sum s, as
    # row_exp_sum (the same s); one vector loop after the max. (row_exp_sum's twin with the
    # store: one helper whose loop stored only when given a scratch row ran the forward no
    # faster than the old four passes -- Zen 4, (768, 65) float32, 2 threads: 56 µs, against 42)
    m = np.float64(row_max(row, lanes))
    s = 0.0
    for c in range(row.shape[0]):
        ec = exp_for(row, np.float64(row[c]) - m)
        e[c] = ec
        s += ec
    return s


@parallel_kernel
def cross_entropy_forward_kernel(x, target, smoothing, loss):
    # x (N, C), target (N,) int64, smoothing ε float64 -> loss (N,) float64, 0 where ignored
    n_rows, n_cols = x.shape
    for chunk in prange((n_rows + ROWS - 1) // ROWS):  # each iteration owns ROWS entries of loss
        lanes = np.empty(LANES, x.dtype)
        for n in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_rows)):
            t = target[n]
            if t < 0 or t >= n_cols:
                loss[n] = 0.0
                continue
            m, s, total = row_exp_sum(x[n], lanes)
            log_s = np.log(s)
            nll = log_s - (np.float64(x[n, t]) - m)   # -log p_t
            if smoothing > 0:                  # Σ_c -log p_c = C·log s - Σ_c (x_c - m)
                loss[n] = (1.0 - smoothing) * nll + smoothing / n_cols * (n_cols * log_s - total)
            else:                              # (no 0·inf = NaN from a -inf logit elsewhere)
                loss[n] = nll


@kernel
def ordered_sum(values):
    # Σ_n values[n] in float64, one thread, a fixed order
    total = 0.0
    for n in range(values.shape[0]):
        total += values[n]
    return total


@parallel_kernel
def cross_entropy_backward_kernel(grad, x, target, smoothing, dx):
    # forward was: loss[n] = (1 - ε)·(log s - (x[n, t] - m)) + ε/C·Σ_c (log s - (x[n, c] - m))
    # grad (N,) float64: d(result)/d(loss[n]) -> dx (N, C): grad[n]·(p_c - (1-ε)[c = t] - ε/C)
    n_rows, n_cols = x.shape
    for chunk in prange((n_rows + ROWS - 1) // ROWS):  # each iteration owns ROWS rows of dx
        lanes = np.empty(LANES, x.dtype)
        e = np.empty(n_cols, np.float64)
        for n in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_rows)):
            t = target[n]
            if t < 0 or t >= n_cols:
                for c in range(n_cols):
                    dx[n, c] = 0
                continue
            s = row_exps(x[n], lanes, e)
            g = grad[n]
            uniform = smoothing / n_cols
            for c in range(n_cols):
                dx[n, c] = g * (e[c] / s - uniform)
            dx[n, t] = g * (e[t] / s - uniform - (1.0 - smoothing))
