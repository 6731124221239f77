"""The part of the linear layer that is not a matrix product: the bias gradient.
Dims: N rows (leading dims flattened), Fout features. The products run on ``kernels/gemm.py``.

Accumulator: the input dtype, summed in blocks of ``BLOCK`` rows: a long sum in one accumulator
loses ~count·eps, in blocks ~(BLOCK + count/BLOCK)·eps, which keeps float32 gradients as close
to the truth as PyTorch's.
"""
import numpy as np
from numba import prange

from .._jit import parallel_kernel

BLOCK = 64


@parallel_kernel
def column_sum_kernel(x, out):
    # x (N, Fout) -> out (Fout,): out[o] = sum_n x[n, o], e.g. dbias from dout
    n_rows, n_cols = x.shape
    for o in prange(n_cols):                   # each iteration owns out[o]
        total = out.dtype.type(0)
        for n0 in range(0, n_rows, BLOCK):
            part = out.dtype.type(0)
            for n in range(n0, min(n0 + BLOCK, n_rows)):
                part += x[n, o]
            total += part
        out[o] = total
