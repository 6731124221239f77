"""PyTorch's initialisers (``torch.nn.init``) as functions that return a new array, and the
argument checks every module shares (generators, dtypes, sizes, inputs), which live in
``npattn._checks`` with every other check and are named here too.

Each initialiser draws from one ``numpy.random.Generator`` in float64 and rounds to ``dtype``,
so the same seed gives the same weights in float32 and float64 (up to rounding). The formulas
are PyTorch's, with fan_in = shape[1]·receptive and fan_out = shape[0]·receptive (receptive:
the product of the dims after the first two, 1 for a matrix):

    xavier_uniform:  U(-a, a),  a = gain·√(6 / (fan_in + fan_out))
    xavier_normal:   N(0, std²), std = gain·√(2 / (fan_in + fan_out))
    kaiming_uniform: U(-b, b),  b = gain·√(3 / fan)     (fan = fan_in or fan_out, by ``mode``)
    kaiming_normal:  N(0, std²), std = gain / √fan

``nn.Linear``'s default, kaiming_uniform with a = √5 (gain √(2 / (1 + a²)) = √(1/3)), is
U(-1/√fan_in, 1/√fan_in). An array with a zero dim has nothing to draw: it comes back empty.
"""
import math

import numpy as np

from .._checks import (finite_real, float_dtype, float_input, generator,  # noqa: F401
                       real_float, size)

#: The initialisers and gains, and the modules' argument checks (defined in npattn._checks).
__all__ = ["calculate_gain", "fan_in_and_fan_out", "uniform", "normal", "constant", "zeros",
           "ones", "xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal",
           "generator", "float_dtype", "size", "float_input"]


def _shape(shape):
    dims = tuple(shape) if np.iterable(shape) else (shape,)
    return tuple(size("shape", n) for n in dims)


# ---------------------------------------------------------------- gains and fans

def calculate_gain(nonlinearity, param=None):
    """PyTorch's recommended gain: 1 (linear, sigmoid, conv), 5/3 (tanh), √2 (relu),
    √(2 / (1 + slope²)) (leaky_relu; slope ``param``, default 0.01), 3/4 (selu)."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                        "conv_transpose2d", "conv_transpose3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3.0
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        else:
            slope = finite_real("param", param)         # the negative slope
        return math.sqrt(2.0 / (1.0 + slope * slope))
    if nonlinearity == "selu":
        return 3.0 / 4.0
    raise ValueError(f"nonlinearity must be one of linear, sigmoid, tanh, relu, leaky_relu, "
                     f"selu, conv*; got {nonlinearity!r}")


def fan_in_and_fan_out(shape):
    """``(fan_in, fan_out)`` of a weight of ``shape`` (at least 2-D), PyTorch's way."""
    shape = _shape(shape)
    if len(shape) < 2:
        raise ValueError(f"shape must have at least 2 dims to define fan_in and fan_out; "
                         f"got {shape}")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _fan(shape, mode):
    fan_in, fan_out = fan_in_and_fan_out(shape)
    if mode == "fan_in":
        return fan_in
    if mode == "fan_out":
        return fan_out
    raise ValueError(f"mode must be 'fan_in' or 'fan_out'; got {mode!r}")


# ---------------------------------------------------------------- initialisers

def uniform(shape, a=0.0, b=1.0, *, rng=None, dtype=np.float32):
    """Samples of U(a, b). Shapes: -> shape"""
    shape, dtype, a, b = _shape(shape), float_dtype(dtype), finite_real("a", a), finite_real("b", b)
    return generator(rng).uniform(a, b, size=shape).astype(dtype)


def normal(shape, mean=0.0, std=1.0, *, rng=None, dtype=np.float32):
    """Samples of N(mean, std²). Shapes: -> shape"""
    shape, dtype = _shape(shape), float_dtype(dtype)
    mean, std = finite_real("mean", mean), finite_real("std", std)
    if std < 0:
        raise ValueError(f"std must be >= 0; got {std}")
    return generator(rng).normal(mean, std, size=shape).astype(dtype)


def constant(shape, value, *, dtype=np.float32):
    """Every entry ``value``. Shapes: -> shape"""
    return np.full(_shape(shape), real_float("value", value), dtype=float_dtype(dtype))


def zeros(shape, *, dtype=np.float32):
    return constant(shape, 0.0, dtype=dtype)


def ones(shape, *, dtype=np.float32):
    return constant(shape, 1.0, dtype=dtype)


def xavier_uniform(shape, gain=1.0, *, rng=None, dtype=np.float32):
    """Glorot & Bengio (2010): U(-a, a) with a = gain·√(6 / (fan_in + fan_out))."""
    shape, gain = _shape(shape), finite_real("gain", gain)
    rng, dtype = generator(rng), float_dtype(dtype)
    fan_in, fan_out = fan_in_and_fan_out(shape)
    if math.prod(shape) == 0:
        return zeros(shape, dtype=dtype)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform(shape, -bound, bound, rng=rng, dtype=dtype)


def xavier_normal(shape, gain=1.0, *, rng=None, dtype=np.float32):
    """Glorot & Bengio (2010): N(0, std²) with std = gain·√(2 / (fan_in + fan_out))."""
    shape, gain = _shape(shape), finite_real("gain", gain)
    rng, dtype = generator(rng), float_dtype(dtype)
    if gain < 0:
        raise ValueError(f"gain must be >= 0 for xavier_normal (it scales a standard "
                         f"deviation); got {gain}")
    fan_in, fan_out = fan_in_and_fan_out(shape)
    if math.prod(shape) == 0:
        return zeros(shape, dtype=dtype)
    return normal(shape, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), rng=rng, dtype=dtype)


def kaiming_uniform(shape, a=0.0, mode="fan_in", nonlinearity="leaky_relu", *, rng=None,
                    dtype=np.float32):
    """He et al. (2015): U(-b, b) with b = gain·√(3 / fan), gain = calculate_gain(
    nonlinearity, a). ``nn.Linear`` uses a = √5, which makes b = 1/√fan_in."""
    shape, rng, dtype = _shape(shape), generator(rng), float_dtype(dtype)
    gain = calculate_gain(nonlinearity, None if a is None else finite_real("a", a))
    fan = _fan(shape, mode)
    if math.prod(shape) == 0:
        return zeros(shape, dtype=dtype)
    bound = gain * math.sqrt(3.0 / fan)
    return uniform(shape, -bound, bound, rng=rng, dtype=dtype)


def kaiming_normal(shape, a=0.0, mode="fan_in", nonlinearity="leaky_relu", *, rng=None,
                   dtype=np.float32):
    """He et al. (2015): N(0, std²) with std = gain / √fan."""
    shape, rng, dtype = _shape(shape), generator(rng), float_dtype(dtype)
    gain = calculate_gain(nonlinearity, None if a is None else finite_real("a", a))
    fan = _fan(shape, mode)
    if math.prod(shape) == 0:
        return zeros(shape, dtype=dtype)
    return normal(shape, 0.0, gain / math.sqrt(fan), rng=rng, dtype=dtype)
