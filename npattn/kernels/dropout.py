"""Inverted dropout out = x ∘ keep / (1 - p).  Dims: N elements (the whole array, flattened).

The keep-mask is never stored: element ``t`` of the flat C-order array is kept when
``keep(key, t, threshold)`` (``kernels/random.py``), so the mask depends only on the seed and
the logical shape -- not on memory layout, block size or thread count -- and backward
regenerates it. No reduction: each output is one multiplication in the input dtype.
"""
from numba import prange

from .._jit import parallel_kernel
from .random import keep

BLOCK = 4096  # elements per prange iteration: enough work to amortise scheduling


@parallel_kernel
def dropout_kernel(x, key, threshold, scale, out):
    # x (N,) -> out (N,); also dx from dout: dropout is linear, with the same mask and scale
    n = x.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of out
        for t in range(blk * BLOCK, min(blk * BLOCK + BLOCK, n)):
            if keep(key, t, threshold):
                out[t] = x[t] * scale               # scale has the input dtype
            else:
                out[t] = 0                          # even for x = NaN: a dropped entry is gone


@parallel_kernel
def dropout_mask_kernel(key, threshold, mask):
    # -> mask (N,) bool: the keep-mask dropout_kernel applies
    n = mask.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of mask
        for t in range(blk * BLOCK, min(blk * BLOCK + BLOCK, n)):
            mask[t] = keep(key, t, threshold)
