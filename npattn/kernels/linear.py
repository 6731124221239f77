"""The part of the linear layer that is not a matrix product: the bias gradient.
Dims: N rows (leading dims flattened), Fout features. The products run on ``kernels/gemm.py``,
which usually sums the bias gradient too, block by block as it packs doutᵀ for the weight
gradient's product (``gemm.add_row_sums``: the same blocks, the same bits); this kernel runs
when that product packs nothing (x without features; the GEMM's unpacked A·Bᵀ path).

Accumulator: the input dtype, summed in blocks of ``BLOCK`` rows: a long sum in one accumulator
loses ~count·eps, in blocks ~(BLOCK + count/BLOCK)·eps, which keeps float32 gradients as close
to the truth as PyTorch's.
"""
import numpy as np
from numba import prange

from .._jit import parallel_kernel

BLOCK = 64  # rows per partial sum
COLS = 256  # columns per parallel work item: rows are read contiguously, a slice at a time


@parallel_kernel
def column_sum_kernel(x, out):
    # x (N, Fout) -> out (Fout,): out[o] = sum_n x[n, o], e.g. dbias from dout
    n_rows, n_cols = x.shape
    for blk in prange((n_cols + COLS - 1) // COLS):   # each iteration owns COLS entries of out
        o0 = blk * COLS
        width = min(COLS, n_cols - o0)
        total = out[o0:o0 + width]
        part = np.empty(width, out.dtype)
        total[:] = 0
        for n0 in range(0, n_rows, BLOCK):            # rows in blocks, each block's sum apart
            part[:] = 0
            for n in range(n0, min(n0 + BLOCK, n_rows)):
                row = x[n, o0:o0 + width]             # contiguous: vectorised over columns
                for o in range(width):
                    part[o] += row[o]
            for o in range(width):
                total[o] += part[o]
