"""One tolerance rule for every comparison against the float64 truth.

A result computed in dtype ``dt`` by a reduction of length ``n`` (a dot product, a row sum) is
off from the exact value by at most about ``n·eps(dt)`` times the sum of the magnitudes of its
terms -- the classical bound for floating-point summation. So every test states ``n`` and the
magnitude ``scale`` of the terms (``|a|·|b|`` for a product; 1 for probabilities), and
``assert_close`` allows ``4·eps·n·(|want| + scale)``: loose enough for any summation order, tight
enough that a wrong formula (an O(1) error) fails.
"""
import numpy as np

SAFETY = 4.0


def tolerance(dtype, n=1, scale=1.0, want=0.0):
    """Allowed |got - want| for a result of ``dtype`` reduced over ``n`` terms."""
    eps = np.finfo(dtype).eps
    return SAFETY * eps * max(n, 1) * (np.abs(want) + scale) + np.finfo(dtype).tiny


def assert_close(got, want, *, dtype, n=1, scale=1.0):
    """``got`` (the tested result) against ``want`` (the float64 truth).

    Checks the dtype and the shape, that NaN and ±inf sit at the same places, and the finite
    entries within :func:`tolerance`.
    """
    got = np.asarray(got)
    want = np.asarray(want, dtype=np.float64)
    assert got.dtype == np.dtype(dtype), f"dtype {got.dtype}, expected {np.dtype(dtype)}"
    assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
    g = got.astype(np.float64)
    nan_g, nan_w = np.isnan(g), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"NaN at {np.argwhere(nan_g != nan_w)[:5].tolist()}"
    inf_w = np.isinf(want)
    assert np.array_equal(np.isinf(g), inf_w) and np.array_equal(g[inf_w], want[inf_w]), \
        "±inf entries differ"
    finite = ~(nan_w | inf_w)
    tol = np.broadcast_to(tolerance(dtype, n, scale, want), want.shape)
    with np.errstate(invalid="ignore"):   # inf - inf at matching infinities: masked below
        err = np.abs(g - want)
    bad = finite & ~(err <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{bad.sum()} of {finite.sum()} entries differ beyond tolerance; first at {i}: "
            f"got {g[i]!r}, want {want[i]!r}, |err| {err[i]:.3g} > tol {tol[i]:.3g} "
            f"(dtype {np.dtype(dtype)}, n={n}); worst |err|/tol "
            f"{np.max(err[finite] / tol[finite]):.3g}")


def f64(*arrays):
    """Float64 copies of the inputs (``None`` passes through): what the truth is computed from."""
    return [None if a is None else np.array(a, dtype=np.float64, order="C") for a in arrays]


def abs64(*arrays):
    """|a| in float64: fed through a product, it gives the magnitude ``scale`` of its terms."""
    return [None if a is None else np.abs(np.asarray(a, dtype=np.float64)) for a in arrays]
