"""GELU, exact and tanh-approximated, forward and backward.  Dims: N elements (the whole
array, flattened).

    GELU(x) = x·Φ(x),   dx = dout·(Φ(x) + x·Φ'(x))
    "none":  Φ(x) = ½·erfc(−x/√2)        Φ'(x) = exp(−x²/2)/√(2π)
    "tanh":  Φ(x) = ½·(1 + tanh u) = 1/(1 + exp(−2u)),   u = √(2/π)·(x + 0.044715·x³)
             Φ'(x) = 2·Φ·(1 − Φ)·u',   u' = √(2/π)·(1 + 3·0.044715·x²)

Accumulator: none (no reduction); each element is computed in float64 for both dtypes and
rounded to the input dtype once, at the store, so float32 results are correctly rounded but for
the last bit of float64's error. The forms are chosen for the tails: ½·erfc(−x/√2) is
½·(1 + erf(x/√2)) without its cancellation for x ≪ 0 (PyTorch's float32 loses most digits of
GELU(−5) that way), and the tanh form goes through e = exp(−2|u|) ≤ 1, which never overflows:
Φ = 1/(1 + e) or e/(1 + e) by the sign of u, and Φ·(1 − Φ) = e/(1 + e)².

Edges: where Φ is 0 (x < −38.5 or so, and −inf) GELU is −0, the limit (x·0 would be NaN at −inf);
where Φ' is 0 (|x| large, ±inf) the x·Φ' term is 0, the limit (inf·0 would be NaN), so
dx(+inf) = dout and dx(−inf) = 0·dout. NaN propagates.
"""
import math

import numpy as np
from numba import prange

from .._jit import kernel, parallel_kernel

BLOCK = 4096  # elements per prange iteration: enough work to amortise scheduling

SQRT1_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
SQRT_2_PI = math.sqrt(2.0 / math.pi)
COEFF = 0.044715


@kernel
def gelu_parts(x, tanh_form):
    # (Φ, Φ') at one float64 x; see the module docstring for the forms
    if not tanh_form:
        return 0.5 * math.erfc(-x * SQRT1_2), math.exp(-0.5 * x * x) * INV_SQRT_2PI
    u = SQRT_2_PI * (x + COEFF * x * x * x)
    e = math.exp(-2.0 * abs(u))                  # ≤ 1 (NaN for x = NaN)
    cdf = 1.0 / (1.0 + e) if u >= 0.0 else e / (1.0 + e)
    if e == 0.0:                                 # |u| ≫ 1: Φ' underflows (u' may be inf)
        return cdf, 0.0
    return cdf, 2.0 * e / ((1.0 + e) * (1.0 + e)) * (SQRT_2_PI * (1.0 + 3.0 * COEFF * x * x))


@parallel_kernel
def gelu_forward_kernel(x, tanh_form, out):
    # x (N,) -> out (N,): out = x·Φ(x)
    n = x.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of out
        for t in range(blk * BLOCK, min(blk * BLOCK + BLOCK, n)):
            v = np.float64(x[t])
            cdf, _ = gelu_parts(v, tanh_form)
            out[t] = v * cdf if cdf != 0.0 else -0.0    # −inf·0: the limit, −0


@parallel_kernel
def gelu_backward_kernel(dout, x, tanh_form, dx):
    # forward was: out = x·Φ(x)
    # dout, x (N,) -> dx (N,): dx = dout·(Φ(x) + x·Φ'(x))
    n = x.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of dx
        for t in range(blk * BLOCK, min(blk * BLOCK + BLOCK, n)):
            v = np.float64(x[t])
            cdf, pdf = gelu_parts(v, tanh_form)
            slope = cdf + v * pdf if pdf != 0.0 else cdf     # ±inf·0: the limit, 0
            dx[t] = np.float64(dout[t]) * slope
