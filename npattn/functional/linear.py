"""The linear layer of ``nn.Linear``: y = x·Wᵀ + b, with PyTorch's weight layout (Fout, Fin)."""
import math

import numpy as np

from .. import _checks
from ..kernels.tiles import gemm
from ..kernels.linear import column_sum_kernel


def linear_forward(x, weight, bias=None):
    """y = x·Wᵀ + b over the last axis of x, with PyTorch's weight layout.

    Shapes: x (..., Fin) · weight (Fout, Fin) · bias (Fout,) -> out (..., Fout)

    The article's example: x (2, 5, 512) through ``Linear(512, 64)`` is 2·5 = 10 independent
    512-vectors, each multiplied by Wᵀ: out (2, 5, 64).
    """
    x, weight, bias = _checks.linear_args(x, weight, bias)  # one float dtype, C-contiguous
    fout, fin = weight.shape
    out = np.empty(x.shape[:-1] + (fout,), x.dtype)         # (..., Fout)
    if x.ndim == 2:                                         # (a decoded token's rows: no views)
        gemm(x, weight, out, bias=bias, trans_b=True)       # x·Wᵀ: W is read as Wᵀ
    else:                                                   # (N, Fin)·(Fout, Fin)ᵀ -> (N, Fout)
        n = x.size // fin if fin else math.prod(x.shape[:-1])
        gemm(x.reshape(n, fin), weight, out.reshape(n, fout), bias=bias, trans_b=True)
    return out


def linear_backward(dout, x, weight, bias=None):
    """Gradients of ``linear_forward``: ``(dx, dweight, dbias)``; ``dbias`` is None without bias.

    dx = dout·W,  dweight = Σ_rows doutᵀ·x,  dbias = Σ_rows dout  (rows: all leading dims).

    Shapes: dout (..., Fout), x (..., Fin), weight (Fout, Fin) -> dx (..., Fin),
    dweight (Fout, Fin), dbias (Fout,)
    """
    dout, x, weight, bias = _checks.linear_backward_args(dout, x, weight, bias)
    n = math.prod(x.shape[:-1])
    rows_x = x.reshape(n, x.shape[-1])                      # (N, Fin)
    rows_dout = dout.reshape(n, weight.shape[0])            # (N, Fout)
    dx = np.empty_like(rows_x)
    gemm(rows_dout, weight, dx)                             # (N, Fout)·(Fout, Fin)
    dweight = np.empty_like(weight)
    dbias = None if bias is None else np.empty(weight.shape[0], dtype=x.dtype)
    # doutᵀ (Fout, N)·x (N, Fin); dbias = Σ_rows dout, the row sums of doutᵀ, summed by the
    # engine block by block as it packs doutᵀ (no pass of its own over dout) -- but for x
    # without features (an empty product, nothing packed)
    fused = dbias is not None and x.shape[-1] > 0
    gemm(rows_dout, rows_x, dweight, trans_a=True, row_sums=dbias if fused else None)
    if dbias is not None and not fused:
        column_sum_kernel(rows_dout, dbias)
    return dx.reshape(x.shape), dweight, dbias


linear = linear_forward
