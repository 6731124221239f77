"""exp(x) for x <= 0, vectorisable: what softmax needs, several times faster than a call to
the C library's ``exp`` per element (which LLVM cannot vectorise here: Numba has no SVML).

    exp(x) = 2^t · exp(r),   t = round(x / ln 2),   r = x - t·ln 2,   |r| <= ln(2)/2

``r`` is formed with ln 2 split in two parts (Cody-Waite: t·LN2_HI is exact), ``exp(r)`` is its
Taylor series to degree 13 (the first term left out is below 1e-17 relative), evaluated by
Horner's rule with fused multiply-adds, and 2^t is built from its bits: (t + 1023) << 52 is the
float64 whose value is 2^t (formed in float64 arithmetic: SHIFTER below); the result is within
1 ulp of the true value (measured over 2^20 values of [-∞, 0]: max 1.0 ulp). ``exp_parts_f32``
and its callers do the same steps in float32 arithmetic with twice the lanes (a degree-7
series, whose error is below float32's half ulp; (t + 127) << 23); ``exp_shifted_native``
picks the arithmetic of the input's dtype (softmax and the attention engine use it),
``exp_shifted`` computes in float64 for any input, and ``exp_for`` computes in float64 as
precisely as a float32 or float64 result needs (cross-entropy: ``exp_one_short``, a degree-7
series, for float32).

Edges: x < -708 (where 2^t would leave float64's normal range) and x = -inf give 0; NaN gives
NaN. x > 0 is outside the contract (softmax only ever exponentiates x - max(x) <= 0).
"""
import math

import numpy as np
from numba import types
from numba.extending import overload

from .._jit import OVERLOAD_OPTIONS, fma_kernel

LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01   # ln 2 to 32 bits: t·LN2_HI is exact for |t| < 2^21
LN2_LO = 1.90821492927058770002e-10   # ln 2 - LN2_HI
UNDERFLOW = -708.0                    # exp(-708) ≈ 3.3e-308, still a normal float64
#: 1.5·2^52: for an integer-valued float64 t with |t| < 2^51, t + SHIFTER holds t in the low
#: bits of its significand (two's complement), so (bits of t + SHIFTER + e) << 52 are those
#: of 2^(t + e - 1023) whenever t + e is in [1, 2046] -- 2^t's bits without converting t to an
#: integer, which AVX2 has no vector instruction for (a float64 -> int64 conversion there is
#: four scalar ones per vector: measured on a Zen 3, cross-entropy's rows of float64 exps ran
#: 1.15-1.27x faster this way, the same bits)
SHIFTER = 6755399441055744.0


#: exp(r)'s Taylor coefficients in Horner order, 1/13! down to 1/0!: exp_series evaluates
#: them, and vector_exp.py the same steps on vectors
SERIES = tuple(1.0 / math.factorial(n) for n in range(13, -1, -1))


@fma_kernel
def exp_series(r):
    # exp(r) for |r| <= ln(2)/2 (and a little beyond: kernels/gelu.py's r carries a tail of up
    # to 3e-5), the Taylor series of exp_parts
    p = SERIES[0]                             # 1/13!, then Horner down to 1/0!
    p = p * r + SERIES[1]
    p = p * r + SERIES[2]
    p = p * r + SERIES[3]
    p = p * r + SERIES[4]
    p = p * r + SERIES[5]
    p = p * r + SERIES[6]                     # 1/7!
    return exp_series_tail(p, r)


@fma_kernel
def exp_series_tail(p, r):
    # the last seven of Horner's steps for exp(r)'s Taylor series, from p = its value after 1/7!
    p = p * r + SERIES[7]                     # 1/6!
    p = p * r + SERIES[8]
    p = p * r + SERIES[9]
    p = p * r + SERIES[10]
    p = p * r + SERIES[11]
    p = p * r + SERIES[12]
    return p * r + SERIES[13]                 # 1/0!


@fma_kernel
def exp_reduce(xv):
    # (r, bits) with exp(xv) = exp(r) · 2^t for float64 xv in [UNDERFLOW, 0]: the reduced
    # argument, |r| <= ln(2)/2, and the bits of the float64 2^t
    t = np.floor(xv * LOG2E + 0.5)
    r = (xv - t * LN2_HI) - t * LN2_LO
    return r, np.float64(t + (SHIFTER + 1023)).view(np.int64) << 52


@fma_kernel
def exp_parts(xv):
    # (p, bits) with exp(xv) = p · 2^t for float64 xv in [UNDERFLOW, 0]; bits: those of 2^t
    r, bits = exp_reduce(xv)
    return exp_series(r), bits


@fma_kernel
def exp_one(xv):
    # exp(xv) for one float64 xv <= 0. 2^t is the float64 whose bits exp_parts returns (a bit
    # cast in registers, no memory), so a loop calling this vectorises whole
    under = xv < UNDERFLOW                    # also -inf; False for NaN, which flows through
    p, bits = exp_parts(0.0 if under else xv)
    return 0.0 if under else p * np.int64(bits).view(np.float64)


@fma_kernel
def exp_nonpositive(x, out):
    # out[k] = exp(x[k]) for x (C,) <= 0, in float64 arithmetic. out may be x itself, but
    # then LLVM's overlap check runs the loop unvectorised (4× slower)
    for k in range(x.shape[0]):
        out[k] = exp_one(np.float64(x[k]))


@fma_kernel
def exp_series_short(r):
    # exp(r) for |r| <= ln(2)/2 to float32's precision, in float64: the Taylor series to degree
    # 7, whose first term left out, r^8/8!, is at most 7.3e-9 of exp(r) (at r = -ln(2)/2): a
    # quarter of float32's half ulp or less
    return exp_series_tail(1.0 / 5040.0, r)


@fma_kernel
def exp_one_short(xv):
    # exp_one to float32's precision (within 7.5e-9 relative): what a float64 sum of float32
    # results needs, at about half exp_one's series
    under = xv < UNDERFLOW
    r, bits = exp_reduce(0.0 if under else xv)
    return 0.0 if under else exp_series_short(r) * np.int64(bits).view(np.float64)


def exp_for(like, xv):
    # exp(xv) for one float64 xv <= 0, in float64, as precise as the dtype of the array `like`
    # needs: exp_one_short for float32, exp_one for float64 (chosen by type in compiled code)
    return exp_one_short(xv) if like.dtype == np.float32 else exp_one(xv)


# float32: the same steps in float32 arithmetic, twice the lanes of the float64 version. ln 2
# in two parts as Cephes' expf (LN2_HI_F32 = 355/512: t·LN2_HI_F32 is exact for |t| < 2^15),
# and the Taylor series to degree 7: the first term left out, r^8/8! at |r| <= ln(2)/2, is
# 5e-9 relative -- below float32's half ulp (3e-8). 2^t is built from the bits of a float32:
# (t + 127) << 23. Results below float32's normal range (x < -87.34, exp < 1.2e-38) are 0.
LOG2E_F32 = np.float32(LOG2E)
LN2_HI_F32 = np.float32(0.693359375)
LN2_LO_F32 = np.float32(-2.12194440e-4)
UNDERFLOW_F32 = np.float32(-87.33654)     # ln(2^-126): exp(x) below it is subnormal
F32 = np.float32


#: the float32 series' coefficients in Horner order, 1/7! down to 1/0! (as SERIES)
SERIES_F32 = tuple(F32(1.0 / math.factorial(n)) for n in range(7, -1, -1))


@fma_kernel
def exp_series_f32(r):
    # exp(r) for float32 |r| <= ln(2)/2 (and a little beyond), the Taylor series of exp_parts_f32
    p = SERIES_F32[0]                         # 1/7!
    p = p * r + SERIES_F32[1]
    p = p * r + SERIES_F32[2]
    p = p * r + SERIES_F32[3]
    p = p * r + SERIES_F32[4]
    p = p * r + SERIES_F32[5]
    p = p * r + SERIES_F32[6]
    return p * r + SERIES_F32[7]              # 1/0!


@fma_kernel
def exp_parts_f32(xv):
    # (p, bits) with exp(xv) = p · 2^t for float32 xv in [UNDERFLOW_F32, 0]
    t = np.floor(xv * LOG2E_F32 + F32(0.5))
    r = (xv - t * LN2_HI_F32) - t * LN2_LO_F32
    return exp_series_f32(r), (np.int32(t) + np.int32(127)) << np.int32(23)   # 2^t's bits


@fma_kernel
def exp_one_f32(xv):
    # exp(xv) for one float32 xv <= 0, as exp_one
    zero = F32(0)
    under = xv < UNDERFLOW_F32                # also -inf; False for NaN, which flows through
    p, bits = exp_parts_f32(zero if under else xv)
    return zero if under else p * np.int32(bits).view(np.float32)


@fma_kernel
def exp_nonpositive_f32(x, out):
    # out[k] = exp(x[k]) for float32 x (C,) <= 0
    for k in range(x.shape[0]):
        out[k] = exp_one_f32(x[k])


@fma_kernel
def exp_shifted_f32(x, shift, out):
    # out[j·W + c] = exp(x[j·W + c] - shift[c]) for float32 x (n·W,), shift (W,) with
    # x - shift <= 0 (W lanes: one shift per lane, e.g. per query)
    width = shift.shape[0]
    for j in range(x.shape[0] // width):
        row = j * width
        for c in range(width):
            out[row + c] = exp_one_f32(x[row + c] - shift[c])


@fma_kernel
def exp_shifted(x, shift, out):
    # exp_shifted_f32 in float64 arithmetic (any float x)
    width = shift.shape[0]
    for j in range(x.shape[0] // width):
        row = j * width
        for c in range(width):
            out[row + c] = exp_one(np.float64(x[row + c] - shift[c]))


def exp_one_native(xv):
    # exp(xv) for one xv <= 0 in the arithmetic of its dtype: exp_one_f32 for float32, exp_one
    # for float64 (chosen by type in compiled code, as exp_shifted_native)
    return exp_one_f32(xv) if isinstance(xv, np.float32) else exp_one(np.float64(xv))


def exp_shifted_native(x, shift, out):
    # exp_shifted in the arithmetic of x's dtype: float32 x -> exp_shifted_f32, float64 x ->
    # exp_shifted. In compiled code the choice is made by the type (the overload below), so
    # only the one form compiles; an `if` on the dtype inside a kernel would type and compile
    # both. This body runs without the JIT.
    if x.dtype == np.float32:
        exp_shifted_f32(x, shift, out)
    else:
        exp_shifted(x, shift, out)


def exp_nonpositive_native(x, out):
    # exp_nonpositive in the arithmetic of x's dtype, as exp_shifted_native
    if x.dtype == np.float32:
        exp_nonpositive_f32(x, out)
    else:
        exp_nonpositive(x, out)


@overload(exp_one_native, jit_options=OVERLOAD_OPTIONS)
def _exp_one_native(xv):
    if xv == types.float32:
        return lambda xv: exp_one_f32(xv)
    return lambda xv: exp_one(np.float64(xv))


@overload(exp_for, jit_options=OVERLOAD_OPTIONS)
def _exp_for(like, xv):
    if like.dtype == types.float32:
        return lambda like, xv: exp_one_short(xv)
    return lambda like, xv: exp_one(xv)


@overload(exp_shifted_native, jit_options=OVERLOAD_OPTIONS)
def _exp_shifted_native(x, shift, out):
    if x.dtype == types.float32:
        return lambda x, shift, out: exp_shifted_f32(x, shift, out)
    return lambda x, shift, out: exp_shifted(x, shift, out)


@overload(exp_nonpositive_native, jit_options=OVERLOAD_OPTIONS)
def _exp_nonpositive_native(x, out):
    if x.dtype == types.float32:
        return lambda x, out: exp_nonpositive_f32(x, out)
    return lambda x, out: exp_nonpositive(x, out)
