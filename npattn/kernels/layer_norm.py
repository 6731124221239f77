"""Layer normalisation over the last axis of rows, forward and backward.
Dims: N rows (the leading dims flattened), D entries per row (normalized_shape flattened).

    μ = Σ_k x_k / D,   σ² = Σ_k (x_k - μ)² / D,   rstd = 1/√(σ² + eps),   x̂ = (x - μ)·rstd
    y = x̂ ∘ w + b
    dx = rstd·(ĝ - mean(ĝ) - x̂ ∘ mean(ĝ ∘ x̂)) with ĝ = dout ∘ w,
    dw = Σ_rows dout ∘ x̂,   db = Σ_rows dout

Accumulator: float64 for both dtypes. The statistics are two-pass (the mean, then the squared
deviations from it -- no E[x²] - E[x]² cancellation), each row is computed in float64 and
rounded to the input dtype once, at the store.

The forward writes each row's μ and rstd (float64) beside y; the backward takes them (the
functional layer's ``stats``) or, given none, computes them itself with the same code, so the
bits are the same either way. It then reads each row twice: once for the two row sums (and the
row's share of dw, db), once for dx, recomputing x̂ and ĝ from x and dout rather than storing
them (measured on Zen 4, one thread, (2048, 384) float32: 698 µs before, 473 with saved
statistics and the recomputation, 631 with the recomputation alone; the same bits).

Both kernels go through a block of rows pass by pass -- every row's mean, then every row's
rstd, then every row's output (``block_stats``); backward's row sums, then its dx -- rather than
row by row: each pass of a row waits for the sum of the one before, so row by row the core
mostly waited, while the rows of one pass do not depend on each other and overlap. (A block is
at most a few dozen rows, in L1 or L2. Measured on Zen 4, the kernels alone, the row-by-row
module loaded beside it and alternating: (768, 128) float32, the baby GPT's, forward 1.39×
and backward 1.19× faster on 2 threads, 1.41× / 1.23× on one; (2048, 384) 1.10× / 1.17×;
float64 (768, 128) 1.25× / 1.02×. The same bits in float32; in float64 dx differs in the last
bits: the restructured loops compile to another order of operations, as deterministic.)

Both kernels convert weight (and the forward bias) to float64 once per block of rows, not per
entry (exact: the same bits; the forward 1.12-1.14× at (2048, 384) float32 on Zen 4, 1 and 2
threads, alternating; other shapes within the noise).

dw and db are reduced deterministically: the rows are cut into blocks whose size depends only
on N (``row_blocks``); each block's partial sums are one ``prange`` iteration's, over its rows
in order, and the blocks' partials are then summed in block order, each work item owning COLS
columns and adding one block's row of partials to them at a time (the columns side by side in
vectors: 1.04-1.10× the backward's speed against a column at a time, the same bits; Zen 4). The
bits therefore do not depend on the thread count.
"""
import numpy as np
from numba import prange

#: Up to this many entries (N·D) the functional layer runs the forward's serial twin: a launch
#: of the thread pool costs more (measured on Zen 4, one row of 128: 0.5 µs serial, 2.5 µs on
#: 2 threads, the same bits)
SERIAL_ENTRIES = 4096

from .._jit import kernel, parallel_kernel

MIN_ROWS = 16     # rows per block at least: a block is one parallel work item
MAX_BLOCKS = 256  # blocks at most: the partial sums of backward take (blocks, D) float64 each
COLS = 64         # columns per work item when the partials are summed


@kernel
def row_blocks(n_rows):
    # (rows per block, number of blocks): a function of N alone, never of the thread count
    size = max(MIN_ROWS, (n_rows + MAX_BLOCKS - 1) // MAX_BLOCKS)
    return size, (n_rows + size - 1) // size


@kernel
def row_mean(row):
    # μ of one row (D,) in float64; D = 0 gives NaN (a mean of nothing)
    total = 0.0
    for k in range(row.shape[0]):
        total += np.float64(row[k])
    return total / row.shape[0]


@kernel
def row_rstd(row, mean, eps):
    # rstd = 1/√(σ² + eps) of one row (D,) whose mean is μ: the second pass, in float64
    total = 0.0
    for k in range(row.shape[0]):
        d = np.float64(row[k]) - mean
        total += d * d
    return 1.0 / np.sqrt(total / row.shape[0] + eps)


@kernel
def block_stats(x, r0, r1, eps, means, rstds):
    # means[n], rstds[n] of rows r0 .. r1 of x (N, D), two-pass: every row's mean, then every
    # row's rstd -- pass by pass over the block rather than row by row, so that the rows' sums,
    # which do not depend on each other, overlap in the core (a row's own passes cannot: each
    # waits for the last one's sum)
    for n in range(r0, r1):
        means[n] = row_mean(x[n])
    for n in range(r0, r1):
        rstds[n] = row_rstd(x[n], means[n], eps)


@parallel_kernel(twin=True)
def layer_norm_forward_kernel(x, weight, bias, eps, out, means, rstds):
    # x (N, D), weight (D,), bias (D,) -> out (N, D): out = (x - μ)·rstd ∘ weight + bias per
    # row, and each row's μ and rstd: means, rstds (N,) float64
    n_rows, width = x.shape
    size, n_blocks = row_blocks(n_rows)
    for blk in prange(n_blocks):                 # each iteration owns `size` rows of out
        w64 = np.empty(width, np.float64)        # weight and bias in float64, converted once
        b64 = np.empty(width, np.float64)        # per block (exactly: the same bits)
        for k in range(width):
            w64[k] = weight[k]
            b64[k] = bias[k]
        r0, r1 = blk * size, min(blk * size + size, n_rows)
        block_stats(x, r0, r1, eps, means, rstds)
        for n in range(r0, r1):
            row = x[n]
            orow = out[n]
            mean, rstd = means[n], rstds[n]
            for k in range(width):
                xhat = (np.float64(row[k]) - mean) * rstd
                orow[k] = xhat * w64[k] + b64[k]


@parallel_kernel
def layer_norm_backward_kernel(dout, x, weight, eps, means, rstds, dx, dweight, dbias):
    # forward was: out[n, k] = (x[n, k] - μ_n)·rstd_n·weight[k] + bias[k]
    # dout, x (N, D), weight (D,), forward's means and rstds (N,) float64 -- or (0,) each:
    # computed here -> dx (N, D), dweight (D,), dbias (D,)
    n_rows, width = x.shape
    saved = means.shape[0] == n_rows
    size, n_blocks = row_blocks(n_rows)
    part_w = np.empty((n_blocks, width), np.float64)   # Σ dout ∘ x̂ over each block's rows
    part_b = np.empty((n_blocks, width), np.float64)   # Σ dout over each block's rows
    for blk in prange(n_blocks):                 # each iteration owns `size` rows of dx and
        w64 = np.empty(width, np.float64)        # one row of each partial
        for k in range(width):
            w64[k] = weight[k]
        pw = part_w[blk]
        pb = part_b[blk]
        pw[:] = 0.0
        pb[:] = 0.0
        r0, r1 = blk * size, min(blk * size + size, n_rows)
        if saved:
            mu, rs = means[r0:r1], rstds[r0:r1]
        else:
            mu, rs = np.empty(r1 - r0, np.float64), np.empty(r1 - r0, np.float64)
            block_stats(x[r0:r1], 0, r1 - r0, eps, mu, rs)
        mean_g = np.empty(r1 - r0, np.float64)   # per row: mean(ĝ), mean(ĝ ∘ x̂)
        mean_gx = np.empty(r1 - r0, np.float64)
        for n in range(r0, r1):                  # the row sums first, row after row, so that
            xr, dr = x[n], dout[n]               # they overlap (as block_stats); then dx
            mean, rstd = mu[n - r0], rs[n - r0]
            sum_g = 0.0                          # Σ_k ĝ_k, ĝ = dout ∘ weight
            sum_gx = 0.0                         # Σ_k ĝ_k·x̂_k
            for k in range(width):
                d = np.float64(dr[k])
                xhat = (np.float64(xr[k]) - mean) * rstd
                ghat = d * w64[k]
                sum_g += ghat
                sum_gx += ghat * xhat
                pw[k] += d * xhat
                pb[k] += d
            mean_g[n - r0] = sum_g / width
            mean_gx[n - r0] = sum_gx / width
        for n in range(r0, r1):
            xr, dr, dxr = x[n], dout[n], dx[n]
            mean, rstd = mu[n - r0], rs[n - r0]
            mg, mgx = mean_g[n - r0], mean_gx[n - r0]
            for k in range(width):               # x̂ and ĝ again: cheaper than storing them
                xhat = (np.float64(xr[k]) - mean) * rstd
                ghat = np.float64(dr[k]) * w64[k]
                dxr[k] = rstd * (ghat - mg - xhat * mgx)
    for blk in prange((width + COLS - 1) // COLS):   # each iteration owns COLS columns
        k0 = blk * COLS
        k1 = min(k0 + COLS, width)
        acc_w = np.zeros(k1 - k0, np.float64)
        acc_b = np.zeros(k1 - k0, np.float64)
        for b in range(n_blocks):                # in block order: the same bits at any count;
            pw = part_w[b, k0:k1]                # a block's row of partials at a time, so the
            pb = part_b[b, k0:k1]                # columns' sums run side by side in vectors
            for k in range(k1 - k0):
                acc_w[k] += pw[k]
                acc_b[k] += pb[k]
        for k in range(k1 - k0):
            dweight[k0 + k] = acc_w[k]
            dbias[k0 + k] = acc_b[k]
