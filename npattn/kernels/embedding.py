"""Embedding lookup out = weight[indices] and its scatter-add gradient.
Dims: N indices (all dims of ``indices`` flattened), V rows of weight (num_embeddings), E columns
(embedding_dim).

Forward is a gather: no arithmetic. Backward is a scatter-add,
dweight[v] = Σ_{n : indices[n] = v} dout[n], accumulated in the input dtype (as PyTorch does)
and in the order of n: a counting sort lists, for each row v, the positions n that read it in
ascending order, and each ``prange`` iteration owns whole rows of dweight. So the bits are those
of the serial loop ``for n: dweight[indices[n]] += dout[n]`` at any thread count, and rows that
many indices share are still summed by one thread with no atomics.

An index outside [0, V) -- which the functional layer rejects before calling -- is skipped:
forward writes a zero row for it and backward leaves it out, so no kernel reads or writes out of
bounds whatever it is passed.
"""
import numpy as np
from numba import prange

from .._jit import kernel, parallel_kernel

ROWS = 64  # rows of out (forward) or of dweight (backward) per parallel work item


@parallel_kernel(twin=True)
def embedding_forward_kernel(indices, weight, out):
    # indices (N,) int64, weight (V, E) -> out (N, E): out[n] = weight[indices[n]]
    n_idx = indices.shape[0]
    n_rows, width = weight.shape
    for chunk in prange((n_idx + ROWS - 1) // ROWS):   # each iteration owns ROWS rows of out
        for n in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_idx)):
            v = indices[n]
            if 0 <= v < n_rows:
                src = weight[v]
                for e in range(width):
                    out[n, e] = src[e]
            else:
                for e in range(width):
                    out[n, e] = 0


@kernel
def group_by_row(indices, start, order):
    # Counting sort, stable: afterwards order[start[v]:start[v + 1]] holds the n with
    # indices[n] == v in ascending order. start (V + 1,) and order (N,) int64; indices outside
    # [0, V) are left out (start[V] counts the others).
    n_rows = start.shape[0] - 1
    start[:] = 0
    for n in range(indices.shape[0]):
        v = indices[n]
        if 0 <= v < n_rows:
            start[v + 1] += 1
    for v in range(n_rows):
        start[v + 1] += start[v]
    cursor = start[:n_rows].copy()                     # next free slot of each row's group
    for n in range(indices.shape[0]):
        v = indices[n]
        if 0 <= v < n_rows:
            order[cursor[v]] = n
            cursor[v] += 1


@parallel_kernel
def embedding_backward_kernel(dout, indices, padding_idx, dweight):
    # forward was: out[n] = weight[indices[n]]
    # dout (N, E), indices (N,) int64 -> dweight (V, E): dweight[v] = sum of dout[n] over the n
    # with indices[n] == v, in ascending n; the row padding_idx (-1: none) stays zero
    n_rows, width = dweight.shape
    start = np.empty(n_rows + 1, np.int64)
    order = np.empty(indices.shape[0], np.int64)
    group_by_row(indices, start, order)                # serial, O(N + V)
    for chunk in prange((n_rows + ROWS - 1) // ROWS):  # each iteration owns ROWS rows of dweight
        for v in range(chunk * ROWS, min(chunk * ROWS + ROWS, n_rows)):
            row = dweight[v]
            for e in range(width):
                row[e] = 0
            if v == padding_idx:                       # PyTorch: the padding row gets no gradient
                continue
            for j in range(start[v], start[v + 1]):    # ascending n: the serial loop's order
                src = dout[order[j]]
                for e in range(width):
                    row[e] += src[e]
