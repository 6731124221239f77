"""TEMPORARY stand-in for ``npattn/functional/gelu.py`` (issue 14's gelu op, written on another
branch): the same two functions, in slow whole-array NumPy, so that ``npattn.models.GPT`` runs
before the real op is merged. Delete this file at merge and import ``npattn.functional.gelu``
instead (``npattn/models/gpt.py`` imports it in one place).

    gelu(x)  = x·Φ(x) = ½·x·(1 + erf(x/√2))                                  (approximate="none")
    gelu(x) ≈ ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))                      (approximate="tanh")
    dx       = dout ∘ (Φ(x) + x·φ(x)),  φ(x) = exp(-x²/2)/√(2π)           (exact form's gradient)

Shapes: x (...) -> y (...), in x's dtype; evaluated in float64 and rounded once.
"""
import math

import numpy as np

from .. import _checks

_erf = np.vectorize(math.erf, otypes=[np.float64])
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh'; got {approximate!r}")
    return approximate


def gelu_forward(x, approximate="none"):
    """y = x·Φ(x) (or the tanh approximation). Shapes: x (...) -> y (...)"""
    x = _checks.float_array("x", x)
    t = x.astype(np.float64)
    if _approximate(approximate) == "none":
        y = 0.5 * t * (1.0 + _erf(t / math.sqrt(2.0)))
    else:
        y = 0.5 * t * (1.0 + np.tanh(_SQRT_2_OVER_PI * (t + 0.044715 * t ** 3)))
    return y.astype(x.dtype).reshape(x.shape)


def gelu_backward(dout, x, approximate="none"):
    """dx = dout ∘ gelu'(x). Shapes: dout (...), x (...) -> dx (...)"""
    x = _checks.float_array("x", x)
    dout = _checks.float_array("dout", dout)
    _checks.same_dtype("dout", dout, "x", x)
    _checks.exact_shape("dout", dout, x.shape, "to match x")
    t = x.astype(np.float64)
    if _approximate(approximate) == "none":
        cdf = 0.5 * (1.0 + _erf(t / math.sqrt(2.0)))
        pdf = np.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
        slope = cdf + t * pdf
    else:
        inner = _SQRT_2_OVER_PI * (t + 0.044715 * t ** 3)
        th = np.tanh(inner)
        slope = 0.5 * (1.0 + th) + 0.5 * t * (1.0 - th * th) * _SQRT_2_OVER_PI * (
            1.0 + 3 * 0.044715 * t * t)
    return (dout.astype(np.float64) * slope).astype(x.dtype).reshape(x.shape)
