"""Counter-based random numbers: each value is a pure function of (seed, element index).

Nothing is stored and nothing is advanced, so a kernel can draw the value of any element in any
order on any thread: backward regenerates forward's dropout mask from the seed alone, and the
mask is the same at every thread count and for every memory layout.

The contract (all arithmetic on uint64, modulo 2**64)
-----------------------------------------------------
::

    mix64(z)   = SplitMix64's finaliser:  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
                                          z ^= z >> 27; z *= 0x94D049BB133111EB
                                          z ^= z >> 31
    key        = seed_key(seed)          = mix64(seed)            seed in [0, 2**64)
    bits       = random_bits(key, index) = mix64(key + (index + 1) * 0x9E3779B97F4A7C15)
    kept       = keep(key, index, threshold) = (bits >> 11) >= threshold
    threshold  = keep_threshold(p)       = round(p * 2**53)       (Python, once per call)

``random_bits`` is output number ``index`` (0-based) of the SplitMix64 stream whose state starts
at ``key``: 64 uniform bits. Mixing the seed first keeps the streams of nearby seeds apart (with
the raw seed, seed ``s + 0x9E37...`` would be seed ``s``'s stream shifted by one). ``keep``
compares the top 53 bits with ``threshold``, so an element is kept with probability
``1 - threshold / 2**53``: ``p = 0`` keeps every element and ``p = 1`` keeps none.

``index`` is the element's flat C-order index in the *logical* shape of the masked array:
``dropout_mask(shape, p, seed)`` at ``np.unravel_index(index, shape)``. The fused attention
kernel passes ``((b * H + h) * L + i) * S + j`` for weight ``(b, h, i, j)``, so its mask is
``dropout_mask((B, H, L, S), p, seed)``.

Numba types a signed and an unsigned 64-bit integer together as float64, so every value here is
cast to uint64 first and every constant is an ``np.uint64``; ``index`` may be any integer.
"""
import numpy as np

from .._jit import kernel

GOLDEN = np.uint64(0x9E3779B97F4A7C15)   # 2**64 / golden ratio: the Weyl-sequence step
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
ONE = np.uint64(1)
SHIFT30, SHIFT27, SHIFT31 = np.uint64(30), np.uint64(27), np.uint64(31)
SHIFT11 = np.uint64(11)                  # 64 - 53: keep the top 53 bits, a double's mantissa


def keep_threshold(p):
    """The uint64 ``threshold`` for a drop probability ``p`` in [0, 1] (checked by the caller).

    ``p * 2**53`` is exact (a power-of-two scaling), so the only rounding is ``round``.
    """
    return np.uint64(round(p * 2.0**53))


def stream_key(seed):
    """``seed_key(seed)`` as np.uint64, for a kernel argument (Python, once per call): Numba
    would type a Python int below 2**63 as int64."""
    return np.uint64(seed_key(np.uint64(seed)))


def kept_scale(p, dtype):
    """1/(1-p), the factor of a kept element, in ``dtype`` as PyTorch computes it: 1-p in
    float64, the division in ``dtype``. 0 for p = 1 (every element is dropped then)."""
    one = dtype.type(1)
    return dtype.type(0) if p == 1.0 else one / dtype.type(1.0 - p)


@kernel
def mix64(z):
    """SplitMix64's finaliser: a bijection of uint64 whose every output bit depends on every
    input bit."""
    z = np.uint64(z)
    z = (z ^ (z >> SHIFT30)) * MIX1
    z = (z ^ (z >> SHIFT27)) * MIX2
    return z ^ (z >> SHIFT31)


@kernel
def seed_key(seed):
    """The stream key of a seed in [0, 2**64); computed once per call, passed to every draw."""
    return mix64(np.uint64(seed))


@kernel
def random_bits(key, index):
    """64 uniform random bits for element ``index`` of the stream keyed by ``key``."""
    return mix64(np.uint64(key) + (np.uint64(index) + ONE) * GOLDEN)


@kernel
def keep(key, index, threshold):
    """Whether element ``index`` survives dropout: true with probability 1 - threshold / 2**53."""
    return (random_bits(key, index) >> SHIFT11) >= np.uint64(threshold)
