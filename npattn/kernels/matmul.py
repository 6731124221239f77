"""Batched matrix product out[t] = a[a_index[t]] · b[b_index[t]].  Dims: T output batches,
Ba/Bb stored a- and b-matrices (broadcasting is an index map, never a copy), M rows, K inner,
N columns.

Accumulator: the input dtype (float32 sums in float32, as PyTorch does), in blocks of
``BLOCK`` terms (see ``kernels/linear.py``). Every inner loop runs over the contiguous last
axis, so LLVM vectorises it; each output element is reduced by one iteration in a fixed order. These are the simple loops; the blocked GEMM engine
(``kernels/gemm.py``) is where speed comes from.
"""
import numpy as np
from numba import prange

from .._jit import parallel_kernel
from .linear import BLOCK  # row sums are blocked: see kernels/linear.py


@parallel_kernel
def matmul_forward_kernel(a, b, a_index, b_index, out):
    # a (Ba, M, K) · b (Bb, K, N) · a_index, b_index (T,) -> out (T, M, N)
    n_batch, n_rows, n_cols = out.shape
    n_inner = a.shape[2]
    for tm in prange(n_batch * n_rows):       # each iteration owns out[t, m, :]
        t = tm // n_rows
        m = tm - t * n_rows
        ia = a_index[t]
        ib = b_index[t]
        part = np.empty(n_cols, out.dtype)    # one block's partial sum of b's rows
        out[t, m, :] = 0
        for k0 in range(0, n_inner, BLOCK):
            part[:] = 0
            for k in range(k0, min(k0 + BLOCK, n_inner)):  # part += a[ia, m, k] * b[ib, k, :]
                g = a[ia, m, k]
                for n in range(n_cols):
                    part[n] += g * b[ib, k, n]
            for n in range(n_cols):
                out[t, m, n] += part[n]


@parallel_kernel
def matmul_backward_kernel(dout, a, b, a_index, b_index, a_order, a_offsets, b_order, b_offsets,
                           da, db):
    # forward was: out[t, m, n] = sum_k a[a_index[t], m, k] * b[b_index[t], k, n]
    # dout (T, M, N) -> da (Ba, M, K), db (Bb, K, N). The output batches that use a-matrix ia
    # are a_order[a_offsets[ia]:a_offsets[ia + 1]], in increasing order (CSR); likewise for b.
    n_a, n_rows, n_inner = a.shape
    n_b, _, n_cols = b.shape
    # da[ia, m, k] = sum_t sum_n dout[t, m, n] * b[b_index[t], k, n]: a dot product over n
    for im in prange(n_a * n_rows):           # each iteration owns da[ia, m, :]
        ia = im // n_rows
        m = im - ia * n_rows
        for k in range(n_inner):
            da[ia, m, k] = 0
        for j in range(a_offsets[ia], a_offsets[ia + 1]):
            t = a_order[j]
            ib = b_index[t]
            for k in range(n_inner):
                acc = da.dtype.type(0)
                for n in range(n_cols):
                    acc += dout[t, m, n] * b[ib, k, n]
                da[ia, m, k] += acc
    # db[ib, k, :] = sum_t sum_m a[a_index[t], m, k] * dout[t, m, :]: rows of dout, scaled
    for ik in prange(n_b * n_inner):          # each iteration owns db[ib, k, :]
        ib = ik // n_inner
        k = ik - ib * n_inner
        part = np.empty(n_cols, db.dtype)
        db[ib, k, :] = 0
        for j in range(b_offsets[ib], b_offsets[ib + 1]):
            t = b_order[j]
            ia = a_index[t]
            for m0 in range(0, n_rows, BLOCK):
                part[:] = 0
                for m in range(m0, min(m0 + BLOCK, n_rows)):
                    g = a[ia, m, k]
                    for n in range(n_cols):
                        part[n] += g * dout[t, m, n]
                for n in range(n_cols):
                    db[ib, k, n] += part[n]
