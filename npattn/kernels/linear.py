"""Linear layer y = x·Wᵀ + b.  Dims: N rows (leading dims flattened), Fin/Fout features.

Accumulator: the input dtype (float32 sums in float32, as PyTorch does). The forward's dot
products are vectorised by LLVM into partial sums in an order fixed at compile time; the
backward's row sums are blocked (``BLOCK``). These are the simple loops;
the blocked GEMM engine (``kernels/gemm.py``) is where speed comes from.
"""
import numpy as np
from numba import prange

from .._jit import parallel_kernel

#: Terms summed into a fresh partial before it joins the running total. A long sum in one
#: accumulator loses ~count·eps; in blocks, ~(BLOCK + count/BLOCK)·eps (BLAS's K-blocking does
#: the same), which keeps float32 gradients as close to the truth as PyTorch's.
BLOCK = 64


@parallel_kernel
def linear_forward_kernel(x, weight, bias, out):
    # x (N, Fin) · weight (Fout, Fin) · bias (Fout,) -> out (N, Fout)
    n_rows, n_in = x.shape
    n_out = weight.shape[0]
    for t in prange(n_rows * n_out):          # each iteration owns out[n, o]
        n = t // n_out
        o = t - n * n_out
        acc = bias[o]                          # accumulates in the input dtype
        for k in range(n_in):
            acc += x[n, k] * weight[o, k]
        out[n, o] = acc


@parallel_kernel
def linear_backward_kernel(dout, x, weight, dx, dweight, dbias):
    # forward was: out[n, o] = bias[o] + sum_k x[n, k] * weight[o, k]
    n_rows, n_in = x.shape
    n_out = weight.shape[0]
    for n in prange(n_rows):                   # dx[n, :] = sum_o dout[n, o] * weight[o, :]
        part = np.empty(n_in, dx.dtype)        # one block's partial sum of rows
        dx[n, :] = 0
        for o0 in range(0, n_out, BLOCK):
            part[:] = 0
            for o in range(o0, min(o0 + BLOCK, n_out)):
                g = dout[n, o]
                for k in range(n_in):
                    part[k] += g * weight[o, k]
            for k in range(n_in):
                dx[n, k] += part[k]
    for o in prange(n_out):                    # dweight[o, :] and dbias[o]: one feature each
        part = np.empty(n_in, dx.dtype)
        dweight[o, :] = 0
        dbias[o] = 0
        for n0 in range(0, n_rows, BLOCK):
            part[:] = 0
            acc = dbias.dtype.type(0)
            for n in range(n0, min(n0 + BLOCK, n_rows)):
                g = dout[n, o]
                acc += g
                for k in range(n_in):
                    part[k] += g * x[n, k]
            dbias[o] += acc
            for k in range(n_in):
                dweight[o, k] += part[k]
