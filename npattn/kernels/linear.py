"""Linear layer y = x·Wᵀ + b.  Dims: N rows (leading dims flattened), Fin/Fout features.

Accumulator: the input dtype (float32 sums in float32, as PyTorch does); LLVM vectorises each
inner loop into partial sums in an order fixed at compile time. These are the simple loops;
the blocked GEMM engine (``kernels/gemm.py``) is where speed comes from.
"""
from numba import prange

from .._jit import parallel_kernel


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
        for k in range(n_in):
            dx[n, k] = 0
        for o in range(n_out):
            g = dout[n, o]
            for k in range(n_in):
                dx[n, k] += g * weight[o, k]
    for o in prange(n_out):                    # dweight[o, :] and dbias[o]: one feature each
        acc = dbias.dtype.type(0)
        for k in range(n_in):
            dweight[o, k] = 0
        for n in range(n_rows):
            g = dout[n, o]
            acc += g
            for k in range(n_in):
                dweight[o, k] += g * x[n, k]
        dbias[o] = acc
