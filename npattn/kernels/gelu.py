"""GELU, exact and tanh-approximated, forward and backward, in loops LLVM vectorises (no call
to the C library per element).  Dims: N elements (the whole array, flattened).

    GELU(x) = x·Φ(x),   dx = dout·(Φ(x) + x·Φ'(x))
    "none":  Φ(x) = ½·erfc(−x/√2)        Φ'(x) = φ(x) = exp(−x²/2)/√(2π)
    "tanh":  Φ(x) = ½·(1 + tanh u) = 1/(1 + exp(−2u)),   u = √(2/π)·(x + 0.044715·x³)
             Φ'(x) = 2·Φ·(1 − Φ)·u',   u' = √(2/π)·(1 + 3·0.044715·x²)

Accumulator: none (no reduction). float64 x is computed in float64 arithmetic; float32 x in
float32 arithmetic, but for the tanh form's u, its exponent's reduction and 1/(1 + e), and the
normal form's forward after exp(−a²/2), which are float64 (FLOAT32 below). The forms are chosen for the tails:
½·erfc(−x/√2) is ½·(1 + erf(x/√2)) without its cancellation for x ≪ 0 (PyTorch's float32 loses
most digits of GELU(−5) that way), and the tanh form goes through e = exp(−2|u|) ≤ 1, which
never overflows: Φ = 1/(1 + e) or e/(1 + e) by the sign of u, and Φ·(1 − Φ) = e/(1 + e)².

The normal CDF, vectorisable. With a = |x|, Q(a) = ½·erfc(a/√2) = Φ(−a) is computed as

    Q(a) = exp(−a²/2) · g(y) / (K + a),   y = (K − a)/(K + a) ∈ (−1, 1],   K = 4

where g = (K + a)·exp(a²/2)·Q(a) (½·erfcx(a/√2) times K + a: smooth, from 2 at a = 0 to
1/√(2π) as a -> ∞) is one polynomial of degree 22 in y over all of a ∈ [0, 40] -- no ranges,
so no branch, one division -- and the same exp(−a²/2) gives φ for the backward. Then Φ = Q(a)
for x < 0 and 1 − Q(a) for x >= 0 (≥ ½: nothing cancels). The coefficients G0..G22 interpolate
g at the 23 Chebyshev nodes of y ∈ [(K − 40)/(K + 40), 1], solved for in 50-digit arithmetic
and rounded to float64 (this reproduces them bit for bit):

    import mpmath as mp
    mp.mp.dps = 50
    K, A, n = 4, 40, 23
    lo = mp.mpf(K - A) / (K + A)
    ys = [(lo + 1) / 2 + (1 - lo) / 2 * mp.cos(mp.pi * (k + 0.5) / n) for k in range(n)]
    def g(y):
        a = K * (1 - y) / (1 + y)
        return (K + a) * mp.exp(a * a / 2) * mp.erfc(a / mp.sqrt(2)) / 2
    G = mp.lu_solve(mp.matrix([[y ** j for j in range(n)] for y in ys]),
                    mp.matrix([g(y) for y in ys]))

(Degree 20 leaves 6 ulps of g/(K + a), 16 leaves 5e-13 relative; from 22 on the rounding of
the evaluation dominates.) Three steps keep float64's accuracy for large a, as fdlibm's erfc
does with its own split of x²:

* exp(−a²/2) with a² split exactly: ah is a with its low 27 bits cleared, al = a − ah, and
  a² = ah² + al·(a + ah), ah² exact; −ah²/2 goes through exp's Cody-Waite reduction (exactly)
  and the small rest −al·(a + ah)/2 (< 3e-5) is added to the reduced argument. (Rounding
  −a²/2 would cost up to a²/2 ulps: 700 at a = 37, as erfc of a rounded x/√2 does.)
* 2^t is built as 2^(t + BIAS), and x·Φ and Φ + x·φ are scaled by 2^−BIAS last, so they
  round once also where they or Φ and φ are subnormal (x down to −38.6).
* 1/(K + a) carries the rounding of K + a (Fast2Sum), which would otherwise move a by up to
  ulp(4)/2 near a = 0 (3 ulps of Q).

The tanh form: e = exp(−2|u|) by the same scaled exp (kernels/exp.py's reduction and series).

Accuracy, measured against mpmath (60 digits) at 25,000 random x per form in [−38, 12]
("none") or [−21, 12] ("tanh"), a third of them in [−1, 1] and a third in the tail below −5,
in ulps of the result. Float64 "none": GELU within 4.7 ulps, its slope within 17 (3 in the
tail x < −5) but near its root x ≈ −0.752, where Φ + x·φ cancels (within 0.1 of it: 554 ulps
of the small slope; the C library's erfc gave 643). The float64 tanh form is as accurate as
its u, rounded in float64: GELU and slope within 1.6e3 ulps at x ≈ −20 (2|u| ≈ 700 amplifies
u's rounding), as before. (The kernel this replaced, math.erfc of a rounded x/√2 per element:
1836 ulps for float64 GELU in the tail.)

FLOAT32. The same forms in float32 arithmetic, with twice float64's lanes: against rounding
float64 results, forward / backward of 3.1M elements on one Zen 3 core (thread CPU time), "none"
21.9 / 19.7 -> 5.6 / 5.6 ms, tanh 12.2 / 14.6 -> 7.4 / 10.0 ms (PyTorch's float32: 2.9 / 4.4,
11.2 / 11.3 ms; the normal forward's split at |x| = 1, below, came later).
`python -m benchmarks --ops gelu` times it against PyTorch.
Where float32 would round where the result is sensitive:
* the normal form's exp(−a²/2) splits a² as the float64 form does, with ah of 12 significant
  bits (ah² exact in float32; the rest, below 0.06, joins the reduced argument), and reduces
  with ln 2 in float32 parts (t·LN2_HI_F32 exact); exp's series is kernels/exp.py's float32 one;
* the tanh form computes u and −2|u| in float64 (u's rounding would grow 2|u|-fold in
  e = exp(−2|u|)), reduces there, and rounds the reduced argument to float32 once for the
  series; 1/(1 + e) and the products after it are float64 too, so Φ and Φ' carry e's error and
  one rounding (float32 divisions and products there left the slope 2.2 ulps of its terms from
  the truth on [−1, 1], PyTorch's 1.9).
The normal form's g(y) is its own degree-11 polynomial over a in [0, 15] (beyond, GELU rounds to
−0 or x in float32). The backward's slope computes y, 1/(4 + a) (Fast2Sum as above), g and the
products in float32. The forward splits at |x| = 1 (normal_forward_block_f32). Beyond, it takes
the backward's float32 Q: x·Q for x < −1, x − x·Q for x > 1 (where Q ≤ 0.16 of x·Φ, so Q's
error reaches GELU a sixth as large). On [−1, 1], where PyTorch's float32 is accurate and the
all-float32 Q path was 4.6 ulps from the truth, it sums Φ's series: GELU = ½x + t·S(t), t = x²
= th + tl split exactly (normal_small_f32), ½x + C0·th rounded once and the small rest added to
it (with th alone, the rounding of t cost 2.2 ulps near x = −1, as much as PyTorch's error).
Every lane computes both paths and keeps one. Until 2026-12-05 the forward computed all of the
tail ratio in float64 after a float32 exp (1.2 ulps on [−1, 1], 2.1 everywhere); this is
1.26-1.28× faster (measured on Zen 4, 0.4M and 3.1M elements, 1 and 2 threads, alternating).
Measured against the float64 truth on 20001 float32 x per region (tests/test_gelu.py, which
also measures PyTorch 2.13's float32 on the same x and bounds ours by it), in ulps of GELU, and
of |Φ| + |x·Φ'| for the slope (whose root near x = −0.75 leaves any float32 evaluation no
relative digits), on a Zen 4 (PyTorch's figures in parentheses): "none" GELU within 1.5 ulps on
[−1, 1] (2.2), 1.1 on [1, 5] (4.5) and 4.9 below −1 (PyTorch loses all digits there, where its
1 + erf cancels), slope within 4.3 (7.9); tanh GELU within 1.4 (2.7), slope 1.4 (1.9 on
[−1, 1], 4.7 on [1, 5]).

Edges: where Φ is 0 (x < −38.6 or so, and −inf) GELU is −0, the limit (x·0 would be NaN at −inf);
where Φ' is 0 (|x| large, ±inf) the x·Φ' term is 0, the limit (inf·0 would be NaN), so
dx(+inf) = dout and dx(−inf) = 0·dout. NaN propagates. |x| > 40 ("none"; −2|u| < −1000 for
"tanh") takes the limits directly, before x² or x³ can overflow.
"""
import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from .._jit import OVERLOAD_OPTIONS, fma_kernel, parallel_kernel
from .exp import (F32, LN2_HI, LN2_HI_F32, LN2_LO, LN2_LO_F32, LOG2E, LOG2E_F32, SHIFTER,
                  exp_series, exp_series_f32)

BLOCK = 4096  # elements per prange iteration: enough work to amortise scheduling

INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
SQRT_2_PI = math.sqrt(2.0 / math.pi)
COEFF = 0.044715

FAR = 40.0         # Q(a) = 0 in float64 beyond a = 38.6: Φ is 0 or 1 there, φ is 0
LOWEST = -1000.0   # exp_scaled's smallest h: 2^(t + BIAS) stays a normal float64
BIAS = 600         # exp_scaled returns 2^(t + BIAS) (t in [-1443, 0]); the caller scales back
UNBIAS = 2.0 ** -BIAS
HIGH_BITS = np.int64(-(1 << 27))   # a float64's bits but its low 27: 26 significant bits left
K = 4.0

# g(y) = Σ Gj·y^j (see the module docstring). tail_ratio's steps done in NumPy float64
# (without fused multiply-adds) at 2600 a in [0, 40]: within 5 ulps of Q(a)·exp(a²/2) (mpmath),
# the rounding of y, of 1/(K + a) and of Horner's steps included
G0 = 0.7552851304157515
G1 = 0.6078966419718917
G2 = 0.38713740074221936
G3 = 0.1865218579596934
G4 = 0.06039657489067665
G5 = 0.007540188965625017
G6 = -0.0034796923618040597
G7 = -0.0016308184424805887
G8 = 0.00013334424978358428
G9 = 0.00023109482414997105
G10 = -1.9078434059248706e-06
G11 = -3.51442149682578e-05
G12 = 7.149308325478401e-07
G13 = 5.919013186154044e-06
G14 = -6.249906995369785e-07
G15 = -1.0200713392568465e-06
G16 = 2.6354310560684456e-07
G17 = 1.546196819122192e-07
G18 = -7.634712843441086e-08
G19 = -1.4842390072751344e-08
G20 = 1.3976528155950821e-08
G21 = 1.015295717649618e-11
G22 = -9.990624160023276e-10


@fma_kernel
def exp_scaled(h, tail):
    # (p, s) with exp(h + tail) = p·s·2^−BIAS for h in [LOWEST, 0] whose Cody-Waite reduction
    # h − t·ln 2 is exact (any float64 h; −ah²/2 below) and |tail| < 3e-5: s = 2^(t + BIAS)
    t = np.floor(h * LOG2E + 0.5)
    r = ((h - t * LN2_HI) - t * LN2_LO) + tail
    return exp_series(r), np.int64(np.float64(t + (SHIFTER + (1023 + BIAS))).view(np.int64)
                                   << 52).view(np.float64)      # (exp.py's SHIFTER)


@fma_kernel
def mills(y):
    # g(y) by Horner's rule with fused multiply-adds
    g = G22 * y + G21
    g = g * y + G20
    g = g * y + G19
    g = g * y + G18
    g = g * y + G17
    g = g * y + G16
    g = g * y + G15
    g = g * y + G14
    g = g * y + G13
    g = g * y + G12
    g = g * y + G11
    g = g * y + G10
    g = g * y + G9
    g = g * y + G8
    g = g * y + G7
    g = g * y + G6
    g = g * y + G5
    g = g * y + G4
    g = g * y + G3
    g = g * y + G2
    g = g * y + G1
    return g * y + G0


@fma_kernel
def half_square_exp(a):
    # (p, s) with exp(−a²/2) = p·s·2^−BIAS for float64 a in [0, FAR]: a² split exactly (see
    # the module docstring), its rest added to the reduced argument
    ah = np.int64(np.float64(a).view(np.int64) & HIGH_BITS).view(np.float64)
    al = a - ah
    return exp_scaled(-0.5 * (ah * ah), -0.5 * (al * (a + ah)))


@fma_kernel
def tail_ratio(a):
    # Q(a)·exp(a²/2) = g(y)/(K + a) for float64 a in [0, FAR], y = (K − a)/(K + a)
    d = K + a
    rest = min(K, a) - (d - max(K, a))          # K + a = d + rest exactly (Fast2Sum)
    inv = 1.0 / d
    inv = inv - rest * inv * inv                # 1/(K + a), with rest
    return mills((2.0 * K) * inv - 1.0) * inv   # y = 2K/(K + a) − 1


# The loops. Each block function runs one form and direction over out[start:stop] and is
# vectorised whole. ADDRESSING: each loops over slices from index 0, never over range(start,
# stop) of the whole array: Numba wraps negative indices around (x[t] is x[t + n] for t < 0),
# and only an index that counts up from 0 lets LLVM drop that select -- else it loads and
# stores through gathers and scatters (measured, float32 forward of 393,216 elements on one
# Zen 4 thread: 1,690 µs before, 1,054 µs after, the same bits). its helpers are small enough for LLVM to inline (one function holding
# them all is not, and a call left in the loop keeps it scalar), and its own arithmetic is
# compiled with `contract` only, as fma_kernel's (the prange kernels below add `reassoc`,
# which could undo the Fast2Sum and the order of the polynomials). For the normal form,
# c·2^−BIAS is Φ for x < 0 (c = Q(a)·2^BIAS) and 1 − c·2^−BIAS is Φ for x >= 0, f·2^−BIAS is
# φ; x·Φ and Φ + x·φ are scaled down last, so each rounds once, subnormal or not.

@fma_kernel
def normal_forward_block(x, out, start, stop):
    # out[t] = x[t]·Φ(x[t]) for t in [start, stop)
    x, out = x[start:stop], out[start:stop]     # (an index from 0 up: see ADDRESSING)
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        far = abs(v) > FAR                      # also ±inf; False for NaN, which flows through
        a = 0.0 if far else abs(v)
        p, s = half_square_exp(a)
        c = 0.0 if far else p * tail_ratio(a) * s
        if v < 0.0:                             # (one store, after the branches: the
            y = (v * c) * UNBIAS if c != 0.0 else -0.0   # float32 loop stays vectorised)
        else:                                   # −inf·0 above: the limit, −0
            y = v * (1.0 - c * UNBIAS)
        out[t] = y


@fma_kernel
def normal_backward_block(dout, x, dx, start, stop):
    # dx[t] = dout[t]·(Φ + x·φ)(x[t]) for t in [start, stop)
    dout, x, dx = dout[start:stop], x[start:stop], dx[start:stop]
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        far = abs(v) > FAR
        a = 0.0 if far else abs(v)
        p, s = half_square_exp(a)
        c = 0.0 if far else p * tail_ratio(a) * s
        f = p * INV_SQRT_2PI * s
        xf = 0.0 if far else v * f              # ±inf·0: the limit, 0
        if v < 0.0:
            slope = (c + xf) * UNBIAS
        else:
            slope = (1.0 - c * UNBIAS) + xf * UNBIAS
        dx[t] = np.float64(dout[t]) * slope


@fma_kernel
def tanh_finish(x, u, eb, unbias):
    # (c, f, m) of tanh_parts from float64 x, u and eb = e·2^BIAS (e = exp(−2|u|)), the
    # exp's scale 2^−BIAS given as unbias: m is unbias for u < 0, where Φ = e/(1 + e) may be
    # subnormal, else 1
    e = eb * unbias
    inv = 1.0 / (1.0 + e)
    du = SQRT_2_PI * (1.0 + 3.0 * COEFF * x * x)
    negative = u < 0.0
    w = eb if negative else e                   # e, scaled as Φ is
    # Φ = e/(1 + e) for u < 0, 1/(1 + e) else; Φ' = 2e/(1 + e)²·u', 0 where e is: |u| ≫ 1
    # (u' may be inf there)
    f = 0.0 if w == 0.0 else 2.0 * w * inv * inv * du
    return (w * inv if negative else inv), f, (unbias if negative else 1.0)


@fma_kernel
def tanh_parts(x):
    # (c, f, m) with Φ(x) = c·m and Φ'(x) = f·m of the tanh form for one float64 x: m is
    # 2^−BIAS for u < 0, where Φ = e/(1 + e) may be subnormal, else 1
    u = SQRT_2_PI * (x + COEFF * x * x * x)
    h = -2.0 * abs(u)                           # NaN for x = NaN, −inf for |x| = inf
    under = h < LOWEST                          # e = exp(h) is 0 (x³ may have overflowed)
    p, s = exp_scaled(0.0 if under else h, 0.0)
    eb = 0.0 if under else p * s                # e = exp(−2|u|) = eb·2^−BIAS ≤ 1
    return tanh_finish(x, u, eb, UNBIAS)


@fma_kernel
def tanh_forward_block(x, out, start, stop):
    x, out = x[start:stop], out[start:stop]
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        c, _, m = tanh_parts(v)
        out[t] = (v * c) * m if c != 0.0 else -0.0


@fma_kernel
def tanh_backward_block(dout, x, dx, start, stop):
    dout, x, dx = dout[start:stop], x[start:stop], dx[start:stop]
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        c, f, m = tanh_parts(v)
        slope = (c + v * f) * m if f != 0.0 else c * m
        dx[t] = np.float64(dout[t]) * slope


# ------------------------------------------------------------------ float32
# The same forms for float32 x, in float32 arithmetic (twice float64's lanes) but for the tanh
# form's steps whose rounding float32 cannot afford (FLOAT32 in the module docstring). Every constant is a float32 (a bare Python float would make the loop float64).

FAR_F32 = F32(15.0)          # GELU(−15) = −1.2e-49·… rounds to −0 in float32, and Q(15) ≪ ulp(1)
LOWEST_F32 = -130.0          # exp_scaled_f32's smallest h: 2^(t + BIAS_F32) stays normal
BIAS_F32 = 64                # exp_scaled_f32 returns 2^(t + BIAS_F32); the caller scales back
UNBIAS_F32 = F32(2.0 ** -BIAS_F32)
UNBIAS_F32_64 = 2.0 ** -BIAS_F32
HIGH_BITS_F32 = np.int32(-(1 << 12))   # a float32's bits but its low 12: 12 significant bits
K_F32 = F32(K)
TWO_K_F32 = F32(2.0 * K)
INV_SQRT_2PI_F32 = F32(INV_SQRT_2PI)

# g(y) for a in [0, FAR_F32] (y in [−11/19, 1]), degree 11: the 12-node Chebyshev interpolant of
# the module docstring's recipe with A = 15, n = 12, rounded to float32. Horner's rule in float32
# with fused multiply-adds keeps it within 1.0 ulp of g (mpmath, 1000 y)
F0 = F32(0.7552851438522339)
F1 = F32(0.607896625995636)
F2 = F32(0.38713738322257996)
F3 = F32(0.18652184307575226)
F4 = F32(0.06039714440703392)
F5 = F32(0.007540089078247547)
F6 = F32(-0.003483883338049054)
F7 = F32(-0.0016283021541312337)
F8 = F32(0.00014632134116254747)
F9 = F32(0.00021852913778275251)
F10 = F32(-1.6130457879626192e-05)
F11 = F32(-1.476027046010131e-05)


# The float32 forward's series for |x| <= 1 (normal_small_f32): Φ(x) − ½ = x·S(x²) with
# S(t) = C0·Σ_n (−t/2)^n / (n!·(2n + 1)), C0 = 1/√(2π) (erf's Taylor series at x/√2); S1..S8
# are its terms n = 1..8 over t: the first left out, n = 9, is below 1.2e-10·t^9 (C0 carried
# in two float32 parts)
C0_HI = F32(INV_SQRT_2PI)
C0_LO = F32(INV_SQRT_2PI - float(C0_HI))
S1, S2, S3, S4, S5, S6, S7, S8 = (
    F32((-0.5) ** n * INV_SQRT_2PI / (math.factorial(n) * (2 * n + 1))) for n in range(1, 9))
HALF_F32 = F32(0.5)
TINY_F32 = F32(1e-20)   # below: GELU(x) = ½x to float32's precision (x² ≪ ulp)


@fma_kernel
def exp_scaled_f32(h):
    # (p, s) with exp(h) = p·s·2^−BIAS_F32 for float64 h in [LOWEST_F32, 0]: the reduction
    # h − t·ln 2 in float64 (exact: h's few significant bits, ln 2 in two parts), rounded to
    # float32 once; the series in float32; s = 2^(t + BIAS_F32), a float32 from its bits
    t = np.floor(h * LOG2E + 0.5)
    r = F32((h - t * LN2_HI) - t * LN2_LO)
    bits = (np.int32(t) + np.int32(127 + BIAS_F32)) << np.int32(23)
    return exp_series_f32(r), np.int32(bits).view(np.float32)


@fma_kernel
def half_square_exp_f32(a):
    # (p, s) with exp(−a²/2) = p·s·2^−BIAS_F32 for float32 a in [0, FAR_F32], all in float32:
    # a² split as half_square_exp's, ah with 12 significant bits (ah² exact), the rest
    # −al·(a + ah)/2 (< 0.06) added to the reduced argument; t·LN2_HI_F32 is exact (t < 2^8)
    ah = np.int32(np.float32(a).view(np.int32) & HIGH_BITS_F32).view(np.float32)
    al = a - ah
    h = F32(-0.5) * (ah * ah)
    t = np.floor(h * LOG2E_F32 + F32(0.5))
    r = ((h - t * LN2_HI_F32) - t * LN2_LO_F32) + F32(-0.5) * (al * (a + ah))
    bits = (np.int32(t) + np.int32(127 + BIAS_F32)) << np.int32(23)
    return exp_series_f32(r), np.int32(bits).view(np.float32)


@fma_kernel
def mills_f32(y):
    # g(y) by Horner's rule in float32
    g = F11 * y + F10
    g = g * y + F9
    g = g * y + F8
    g = g * y + F7
    g = g * y + F6
    g = g * y + F5
    g = g * y + F4
    g = g * y + F3
    g = g * y + F2
    g = g * y + F1
    return g * y + F0


@fma_kernel
def tail_ratio_f32(a):
    # Q(a)·exp(a²/2) = g(y)/(K + a) for float32 a in [0, FAR_F32], as tail_ratio
    d = K_F32 + a
    rest = min(K_F32, a) - (d - max(K_F32, a))      # K + a = d + rest exactly (Fast2Sum)
    inv = F32(1.0) / d
    inv = inv - rest * inv * inv
    return mills_f32(TWO_K_F32 * inv - F32(1.0)) * inv


@fma_kernel
def normal_parts_f32(v):
    # (c, f) with Q(|v|) = c·2^−BIAS_F32 and φ(v) = f·2^−BIAS_F32 for one float32 v
    far = abs(v) > FAR_F32                           # also ±inf; False for NaN
    a = F32(0.0) if far else abs(v)
    p, s = half_square_exp_f32(a)
    c = p * tail_ratio_f32(a) * s                   # computed for every lane, then selected:
    f = p * INV_SQRT_2PI_F32 * s                    # a call under a branch keeps LLVM from
    return (F32(0.0) if far else c), (F32(0.0) if far else f)   # vectorising the loop


@fma_kernel
def normal_small_f32(v):
    # GELU(v) for float32 |v| <= 1 (any v computes; only those are used), from the series of
    # Φ: GELU = ½v + t·S(t), t = v², S(t) = (Φ(v) − ½)/v = C0 + t·S1(t) (module docstring):
    # ½v + C0·t in one rounding, the rest after it. t = th + tl exactly: th = vh², vh = v with
    # 12 significant bits (vh² exact), tl = (v − vh)·(v + vh), so C0·t misses nothing
    vh = np.int32(np.float32(v).view(np.int32) & HIGH_BITS_F32).view(np.float32)
    th = vh * vh
    tl = (v - vh) * (v + vh)
    t = th + tl
    s1 = S8 * t + S7
    s1 = s1 * t + S6
    s1 = s1 * t + S5
    s1 = s1 * t + S4
    s1 = s1 * t + S3
    s1 = s1 * t + S2
    s1 = s1 * t + S1
    head = C0_HI * th + HALF_F32 * v                # ½v + C0·th, one rounding (fused)
    rest = (t * s1) * t + (C0_HI * tl + C0_LO * t)   # t²·S1(t) + the rest of C0·t
    y = head + rest
    return HALF_F32 * v if abs(v) < TINY_F32 else y  # (keeps the sign of ±0 and -tiny)


@fma_kernel
def normal_forward_block_f32(x, out, start, stop):
    # |x| <= 1: the series (normal_small_f32), within 1.5 ulps; |x| > 1: x·Q or x − x·Q from
    # the backward's float32 Q (normal_parts_f32), within 1.1 ulps for x > 1 (Q ≤ 0.16 of
    # x·Φ) and 5 below −1. Both are computed for every lane, then one is selected: a branch
    # would keep LLVM from vectorising the loop
    x, out = x[start:stop], out[start:stop]         # (an index from 0 up: see ADDRESSING)
    for t in range(x.shape[0]):
        v = x[t]
        near = normal_small_f32(v)
        c, _ = normal_parts_f32(v)                  # Q(|v|) = c·2^−BIAS_F32, 0 where far
        if v < F32(0.0):
            y = (v * c) * UNBIAS_F32 if c != F32(0.0) else F32(-0.0)
        else:                                       # x·Φ = x − x·Q; x itself where Q is 0
            y = v - v * (c * UNBIAS_F32)            # (+inf: inf·0 is NaN)
            y = v if c == F32(0.0) else y
        out[t] = near if abs(v) <= F32(1.0) else y


@fma_kernel
def normal_backward_block_f32(dout, x, dx, start, stop):
    dout, x, dx = dout[start:stop], x[start:stop], dx[start:stop]
    for t in range(x.shape[0]):
        v = x[t]
        c, f = normal_parts_f32(v)
        xf = F32(0.0) if f == F32(0.0) else v * f   # ±inf·0: the limit, 0
        if v < F32(0.0):
            slope = (c + xf) * UNBIAS_F32
        else:
            slope = (F32(1.0) - c * UNBIAS_F32) + xf * UNBIAS_F32
        dx[t] = dout[t] * slope


@fma_kernel
def tanh_parts_f32(v):
    # (c, f, m) as tanh_parts, in float64, for one float32 v: only e = exp(−2|u|)'s series runs
    # in float32 (u and −2|u| are float64: x³ cannot overflow there, and u's rounding would
    # grow 2|u|-fold in e); 1/(1 + e) and the products are float64, so Φ and Φ' carry little
    # more than e's own error and the caller rounds once
    x = np.float64(v)
    u = SQRT_2_PI * (x + COEFF * x * x * x)
    h = -2.0 * abs(u)
    under = h < LOWEST_F32                          # e is 0 in float32 (also |v| = inf)
    p, s = exp_scaled_f32(0.0 if under else h)
    eb = 0.0 if under else np.float64(p * s)       # e·2^BIAS_F32
    return tanh_finish(x, u, eb, UNBIAS_F32_64)


@fma_kernel
def tanh_forward_block_f32(x, out, start, stop):
    x, out = x[start:stop], out[start:stop]
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        c, _, m = tanh_parts_f32(x[t])
        out[t] = F32((v * c) * m) if c != 0.0 else F32(-0.0)


@fma_kernel
def tanh_backward_block_f32(dout, x, dx, start, stop):
    dout, x, dx = dout[start:stop], x[start:stop], dx[start:stop]
    for t in range(x.shape[0]):
        v = np.float64(x[t])
        c, f, m = tanh_parts_f32(x[t])
        slope = (c + v * f) * m if f != 0.0 else c * m
        dx[t] = F32(np.float64(dout[t]) * slope)


# The block a kernel runs, by the dtype of x: float32 x takes the float32 blocks, float64 x the
# float64 ones. In compiled code the choice is the type's (the overloads below: only one form
# compiles); these bodies run without the JIT.

def normal_forward_native(x, out, start, stop):
    if x.dtype == np.float32:
        normal_forward_block_f32(x, out, start, stop)
    else:
        normal_forward_block(x, out, start, stop)


def normal_backward_native(dout, x, dx, start, stop):
    if x.dtype == np.float32:
        normal_backward_block_f32(dout, x, dx, start, stop)
    else:
        normal_backward_block(dout, x, dx, start, stop)


def tanh_forward_native(x, out, start, stop):
    if x.dtype == np.float32:
        tanh_forward_block_f32(x, out, start, stop)
    else:
        tanh_forward_block(x, out, start, stop)


def tanh_backward_native(dout, x, dx, start, stop):
    if x.dtype == np.float32:
        tanh_backward_block_f32(dout, x, dx, start, stop)
    else:
        tanh_backward_block(dout, x, dx, start, stop)


@overload(normal_forward_native, jit_options=OVERLOAD_OPTIONS)
def _normal_forward_native(x, out, start, stop):
    if x.dtype == types.float32:
        return lambda x, out, start, stop: normal_forward_block_f32(x, out, start, stop)
    return lambda x, out, start, stop: normal_forward_block(x, out, start, stop)


@overload(normal_backward_native, jit_options=OVERLOAD_OPTIONS)
def _normal_backward_native(dout, x, dx, start, stop):
    if x.dtype == types.float32:
        return lambda dout, x, dx, start, stop: normal_backward_block_f32(dout, x, dx, start, stop)
    return lambda dout, x, dx, start, stop: normal_backward_block(dout, x, dx, start, stop)


@overload(tanh_forward_native, jit_options=OVERLOAD_OPTIONS)
def _tanh_forward_native(x, out, start, stop):
    if x.dtype == types.float32:
        return lambda x, out, start, stop: tanh_forward_block_f32(x, out, start, stop)
    return lambda x, out, start, stop: tanh_forward_block(x, out, start, stop)


@overload(tanh_backward_native, jit_options=OVERLOAD_OPTIONS)
def _tanh_backward_native(dout, x, dx, start, stop):
    if x.dtype == types.float32:
        return lambda dout, x, dx, start, stop: tanh_backward_block_f32(dout, x, dx, start, stop)
    return lambda dout, x, dx, start, stop: tanh_backward_block(dout, x, dx, start, stop)


@parallel_kernel(twin=True)
def gelu_forward_kernel(x, tanh_form, out):
    # x (N,) -> out (N,): out = x·Φ(x)
    n = x.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of out
        start, stop = blk * BLOCK, min(blk * BLOCK + BLOCK, n)
        if tanh_form:
            tanh_forward_native(x, out, start, stop)
        else:
            normal_forward_native(x, out, start, stop)


@parallel_kernel(twin=True)
def gelu_backward_kernel(dout, x, tanh_form, dx):
    # forward was: out = x·Φ(x)
    # dout, x (N,) -> dx (N,): dx = dout·(Φ(x) + x·Φ'(x))
    n = x.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block of dx
        start, stop = blk * BLOCK, min(blk * BLOCK + BLOCK, n)
        if tanh_form:
            tanh_backward_native(dout, x, dx, start, stop)
        else:
            normal_backward_native(dout, x, dx, start, stop)
