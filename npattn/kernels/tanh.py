"""tanh(y) and its slope 1 - tanh(y)², vectorisable: attention's logit soft-capping
(c·tanh(s/c), Gemma 2) forms one per score, forward and backward, and a call to the C
library's ``tanh`` per element is not vectorised (Numba has no SVML).

With a = |y| (the sign is put back last, so tanh is odd to the bit):

    a <  SMALL:  tanh a = a + a·(a²·P(a²)),  P the Taylor series of (tanh a - a)/a³
                 slope  = 1 - t²                   (t² < 0.12: nothing cancels)
    a >= SMALL:  e = exp(-2a) <= 0.5 (kernels/exp.py, never overflows),
                 tanh a = (1 - e)/(1 + e),  slope = 4e/(1 + e)²   (one division, 1/(1 + e))

Both are computed and one is selected, so a loop over scores has no branch; where every value
of a block is below SMALL (scores within 0.35 of the cap: the usual case, a soft cap being a
guard against outliers) the caller may run the series alone (``series_native``) -- the same
bits at a third of the cost. The series'
coefficients are 2^2n·(2^2n - 1)·B_2n/(2n)! (B: Bernoulli numbers), made exactly here and
rounded once; below SMALL = 0.35 each term is ≤ 0.05 of the one before, so 13 terms reach
float64's precision and 6 float32's. Above it, 1 - e ≥ 0.5 loses nothing to cancellation, and
the slope never forms 1 - t² (which would cancel as t -> 1). Each form computes in the
arithmetic of its dtype; the float32 one returns within 2 ulps of tanh (measured in
tests/test_attention_options.py against NumPy's float64 tanh).

Edges: ±inf gives ±1 and slope 0 (exp(-inf) = 0); a > 354 (float64) or 44 (float32) has
e = 0: ±1, slope 0; NaN gives NaN. Written as ``fma_kernel``s whose every multiply-add
has one way to fuse (Horner's p·a² + c, a + a·(a²·p), 1 - t·t: the product feeds one add),
so each inlined copy fuses the same ones and forward and backward cap a score to the same
bits (tests/test_tanh.py compares the copies).
"""
from fractions import Fraction
from math import comb, factorial

import numpy as np
from numba import types
from numba.extending import overload

from .._jit import OVERLOAD_OPTIONS, fma_kernel
from .exp import exp_one, exp_one_f32

SMALL = 0.35


def _taylor(n_terms):
    """The first n_terms coefficients of tanh's series a, a³, a⁵, ... (exact fractions)."""
    bernoulli = [Fraction(1)]
    for m in range(1, 2 * n_terms + 1):
        bernoulli.append(-sum(comb(m + 1, k) * bernoulli[k] for k in range(m)) / (m + 1))
    return [Fraction(4 ** n * (4 ** n - 1)) * bernoulli[2 * n] / factorial(2 * n)
            for n in range(1, n_terms + 1)]


_T = [float(c) for c in _taylor(13)]          # 1, -1/3, 2/15, -17/315, ...
T3, T5, T7, T9, T11, T13, T15, T17, T19, T21, T23, T25 = _T[1:]
F32 = np.float32
S3, S5, S7, S9, S11 = (F32(c) for c in _T[1:6])
SMALL_F32 = F32(SMALL)


@fma_kernel
def series_f64(a):
    # tanh a for 0 <= a < SMALL, float64: a + a·(a²·P(a²))
    a2 = a * a
    p = T25
    p = p * a2 + T23
    p = p * a2 + T21
    p = p * a2 + T19
    p = p * a2 + T17
    p = p * a2 + T15
    p = p * a2 + T13
    p = p * a2 + T11
    p = p * a2 + T9
    p = p * a2 + T7
    p = p * a2 + T5
    p = p * a2 + T3
    return a + a * (a2 * p)


@fma_kernel
def tanh_slope_f64(y):
    # (tanh y, 1 - tanh² y) for a float64 y, in float64 arithmetic (module docstring)
    a = abs(y)
    small = series_f64(a)
    e = exp_one(-2.0 * a)
    inv = 1.0 / (1.0 + e)
    near = a < SMALL                              # (False for NaN: NaN from the exp form)
    t = small if near else (1.0 - e) * inv
    slope = 1.0 - small * small if near else 4.0 * e * inv * inv
    return np.copysign(t, y), slope


@fma_kernel
def series_f32(a):
    # series_f64 for a float32 a, in float32 arithmetic (6 terms)
    a2 = a * a
    p = S11
    p = p * a2 + S9
    p = p * a2 + S7
    p = p * a2 + S5
    p = p * a2 + S3
    return a + a * (a2 * p)


@fma_kernel
def tanh_slope_f32(y):
    # tanh_slope_f64 for a float32 y in float32 arithmetic
    a = abs(y)
    small = series_f32(a)
    one = F32(1)
    e = exp_one_f32(F32(-2) * a)
    inv = one / (one + e)
    near = a < SMALL_F32
    t = small if near else (one - e) * inv
    slope = one - small * small if near else F32(4) * e * inv * inv
    return np.copysign(t, y), slope


def series_native(a):
    # tanh a for 0 <= a < SMALL in the arithmetic of a's dtype: the bits tanh_slope_native
    # gives there, without the exp form (when a whole block of scores is that small)
    return series_f32(a) if isinstance(a, np.float32) else series_f64(np.float64(a))


def tanh_slope_native(y):
    # (tanh y, 1 - tanh² y) in the arithmetic of y's dtype (the overload below picks the form
    # in compiled code, as kernels/exp.py does). This body runs without the JIT.
    return tanh_slope_f32(y) if isinstance(y, np.float32) else tanh_slope_f64(np.float64(y))


@overload(series_native, jit_options=OVERLOAD_OPTIONS)
def _series_native(a):
    if a == types.float32:
        return lambda a: series_f32(a)
    return lambda a: series_f64(np.float64(a))


@overload(tanh_slope_native, jit_options=OVERLOAD_OPTIONS)
def _tanh_slope_native(y):
    if y == types.float32:
        return lambda y: tanh_slope_f32(y)
    return lambda y: tanh_slope_f64(np.float64(y))
