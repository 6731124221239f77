"""gelu_forward / gelu_backward against the float64 textbook and against PyTorch, both forms."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, f64
from npattn import reference
from npattn.functional.gelu import gelu, gelu_backward, gelu_forward
from strategies import arrays, dtypes, shapes

KINDS = ("normal", "wide", "huge", "tiny", "nan")
APPROXIMATIONS = ("none", "tanh")
approximations = st.sampled_from(APPROXIMATIONS)


@st.composite
def gelu_cases(draw, kinds=KINDS):
    """x of any shape (0-d and empty included), layout and kind of values; a random dout."""
    dtype = draw(dtypes)
    shape = draw(shapes(max_ndim=4, max_dim=7))
    x = draw(arrays(shape, dtype, kinds))
    dout = draw(arrays(shape, dtype, ("normal", "wide")))
    return x, dout, draw(approximations)


def slope_scale(x, dout, approximate):
    """|dout|·(|Φ| + |x·Φ'|): the magnitude of dx's terms (they may cancel near x ≈ −0.75)."""
    x64, d = f64(x, dout)
    cdf, pdf = reference._gelu_parts(x64, approximate)
    with np.errstate(invalid="ignore"):
        return np.abs(d) * (np.abs(cdf) + np.where(pdf == 0, 0.0, np.abs(x64 * pdf)))


def growth(x, approximate):
    """1 + |x·Φ'(x)/Φ(x)| for float64 x (GELU's relative condition number, up to a constant:
    the kernel's rounding of x/√2 or of u moves Φ by that many of its own ulps -- 2z² for
    erfc(z) in the tail); 0 for float32, whose x is exact in the kernel's float64."""
    x64 = f64(x)[0]
    if np.asarray(x).dtype == np.float32:
        return np.zeros(x64.shape)
    cdf, pdf = reference._gelu_parts(x64, approximate)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = 1.0 + np.abs(x64 * pdf / cdf)
    return np.where(np.isfinite(g), g, 0.0)


# ------------------------------------------------------------------ against the textbook

@given(case=gelu_cases())
def test_forward_matches_reference(case):
    """Correctly rounded but for float64's own error: n = 2 and a scale of |GELU| times its
    float64 growth, so the tolerance is relative to GELU itself -- also in the tail x ≪ 0,
    where GELU is tiny."""
    x, _, approximate = case
    got = gelu_forward(x, approximate)
    want = reference.gelu_forward(*f64(x), approximate)
    assert_close(got, want, dtype=x.dtype, n=2, scale=growth(x, approximate) * np.abs(want))


@given(case=gelu_cases())
def test_backward_matches_reference(case):
    x, dout, approximate = case                  # dout random: ones hide bugs
    got = gelu_backward(dout, x, approximate)
    want = reference.gelu_backward(*f64(dout, x), approximate)
    assert_close(got, want, dtype=x.dtype, n=4,
                 scale=slope_scale(x, dout, approximate) * (1 + growth(x, approximate)))


@given(x=arrays((5, 3), np.float64), approximate=approximations)
def test_alias_and_default(x, approximate):
    assert gelu is gelu_forward
    assert np.array_equal(gelu(x), gelu_forward(x, "none"))
    assert np.array_equal(gelu_backward(x, x), gelu_backward(x, x, approximate="none"))
    exact, tanh = gelu(x, "none"), gelu(x, "tanh")
    assert not np.array_equal(exact, tanh)       # the two forms differ (by < 1e-3)
    np.testing.assert_allclose(exact, tanh, atol=1e-3)


def test_the_reference_is_the_documented_formula():
    """PyTorch's documentation, word for word, in float64: 0.5·x·(1 + erf(x/√2)) and
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) -- where its cancellation costs nothing."""
    x = np.linspace(-6.0, 6.0, 2401)
    erf = np.vectorize(math.erf)
    exact = 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    tanh = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(reference.gelu_forward(x, "none"), exact, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(reference.gelu_forward(x, "tanh"), tanh, rtol=1e-15, atol=1e-15)
    # the documented derivatives: Φ + x·φ, and 0.5·(1 + tanh u) + 0.5·x·(1 − tanh²u)·u'
    phi = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    np.testing.assert_allclose(reference.gelu_backward(np.ones_like(x), x, "none"),
                               0.5 * (1 + erf(x / math.sqrt(2))) + x * phi, rtol=1e-15, atol=1e-15)
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    du = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x ** 2)
    np.testing.assert_allclose(reference.gelu_backward(np.ones_like(x), x, "tanh"),
                               0.5 * (1 + np.tanh(u)) + 0.5 * x * (1 - np.tanh(u) ** 2) * du,
                               rtol=1e-15, atol=1e-14)


def test_the_reference_tail_is_relatively_accurate():
    """x ≪ 0, where GELU is tiny: the reference against PyTorch's documented formulas in
    2000-digit arithmetic (1 + tanh u at u = −1900 cancels 1650 digits), relatively."""
    mpmath = pytest.importorskip("mpmath")     # comes with PyTorch (through sympy)
    mpmath.mp.dps = 2000
    for x in (-3.0, -8.0, -20.0, -37.5):
        s = mpmath.sqrt(2)
        want_exact = x * mpmath.erfc(-mpmath.mpf(x) / s) / 2
        slope_exact = mpmath.erfc(-mpmath.mpf(x) / s) / 2 + x * mpmath.exp(
            -mpmath.mpf(x) ** 2 / 2) / mpmath.sqrt(2 * mpmath.pi)
        u = mpmath.sqrt(2 / mpmath.pi) * (x + mpmath.mpf("0.044715") * x ** 3)
        want_tanh = x * (1 + mpmath.tanh(u)) / 2
        du = mpmath.sqrt(2 / mpmath.pi) * (1 + 3 * mpmath.mpf("0.044715") * x ** 2)
        slope_tanh = (1 + mpmath.tanh(u)) / 2 + x * (1 - mpmath.tanh(u) ** 2) / 2 * du
        one = np.ones(1)
        for got, want in ((reference.gelu_forward([x], "none"), want_exact),
                          (reference.gelu_backward(one, [x], "none"), slope_exact),
                          (reference.gelu_forward([x], "tanh"), want_tanh),
                          (reference.gelu_backward(one, [x], "tanh"), slope_tanh)):
            # x/√2 is rounded: erfc(z) amplifies its relative error 2z² times (1e-13 at -37.5)
            assert abs(float(got[0]) - float(want)) <= 1e-12 * abs(float(want)), (x, got, want)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_reference_backward_by_finite_differences(approximate):
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(40) * 3, [-0.75, 0.0, 1e-3, -5.0, 4.0]])
    dout = rng.standard_normal(x.shape)
    h = 1e-6
    numeric = (reference.gelu_forward(x + h, approximate)
               - reference.gelu_forward(x - h, approximate)) / (2 * h)
    np.testing.assert_allclose(reference.gelu_backward(dout, x, approximate), dout * numeric,
                               rtol=1e-7, atol=1e-9)


# ------------------------------------------------------------------ against PyTorch

@given(case=gelu_cases(kinds=("normal", "wide", "tiny", "nan")))
def test_matches_torch(torch, case):
    """PyTorch computes 1 + erf (or 1 + tanh) and so loses GELU's relative accuracy for x ≪ 0:
    the comparison's scale is |x| (and dx's term magnitudes), which its float64 stays within."""
    x, dout, approximate = case
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    ty.backward(torch.tensor(f64(dout)[0]))
    x64 = np.abs(f64(x)[0])
    assert_close(gelu(x, approximate=approximate), ty.detach().numpy(), dtype=x.dtype, n=2,
                 scale=x64)
    assert_close(gelu_backward(dout, x, approximate), tx.grad.numpy(), dtype=x.dtype, n=4,
                 scale=slope_scale(x, dout, approximate) + np.abs(f64(dout)[0]) * x64)


def condition(f, x):
    """|x·f'(x)/f(x)|, f's relative condition number: how much a relative error in x (the
    rounding of x/√2 or of u, in float64) grows in f(x). erfc(z) has about 2z², so float64's
    GELU(−37) can only be good to about 1400 ulps; float32's, computed from an exact float64
    x, to one."""
    h = 1e-6
    return np.abs((f(x * (1 + h)) - f(x * (1 - h))) / (2 * h) / f(x))


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_tail_is_relatively_accurate(approximate, dtype):
    """For x ≪ 0 GELU and its slope are tiny (−7.6e-23 at −10): relatively accurate there
    too, as the forms without 1 + erf's cancellation make them (a planted 1 + erf fails)."""
    lowest = 38.0 if approximate == "none" else 21.0     # (below: float64 underflows)
    x = -np.geomspace(0.5, lowest, 3001).astype(dtype)
    x64 = f64(x)[0]
    one = np.ones(x.shape)
    want = reference.gelu_forward(x64, approximate)
    slope = reference.gelu_backward(one, x64, approximate)
    if dtype == np.float64:
        cond_y = condition(lambda v: reference.gelu_forward(v, approximate), x64)
        cond_d = condition(lambda v: reference.gelu_backward(one, v, approximate), x64)
        scale_y, scale_d = cond_y * np.abs(want), cond_d * np.abs(slope)
    else:   # float32: x is exact in the float64 steps; the slope's terms, computed in float32,
        # cancel near its root x ≈ −0.75 (nowhere in the tail, where they are |slope| itself)
        scale_y, scale_d = 0.0, slope_scale(x, one, approximate)
    assert_close(gelu(x, approximate), want, dtype=dtype, n=2, scale=scale_y)
    assert_close(gelu_backward(np.ones_like(x), x, approximate), slope, dtype=dtype, n=8,
                 scale=scale_d)


#: Where PyTorch's float32 GELU is accurate (x >= -1) and where its 1 + erf (1 + tanh) cancels
#: (x < -1: no digits left below -5): npattn's float32 is bounded by PyTorch's error region by
#: region, so the bound is tight where PyTorch is good and is not one worst case for all of them.
REGIONS = ((-14.0, -5.0), (-5.0, -1.0), (-1.0, 1.0), (1.0, 5.0), (5.0, 12.0))


def float32_errors(x, got_y, got_d, approximate):
    """(forward, slope) errors of float32 results against the float64 truth at float32 x: the
    forward in ulps of GELU, the slope in ulps of its terms' size |Φ| + |x·Φ'| (the slope has a
    root near x = −0.75, where any float32 evaluation has no relative digits: PyTorch's neither)."""
    x64 = f64(x)[0]
    want_y = reference.gelu_forward(x64, approximate)
    want_d = reference.gelu_backward(np.ones(x.shape), x64, approximate)
    terms = slope_scale(x, np.ones(x.shape), approximate)

    def ulps(got, want, size):
        spacing = np.spacing(size.astype(np.float32)).astype(np.float64)
        return np.abs(got.astype(np.float64) - want) / np.maximum(spacing, 2.0 ** -149)

    return ulps(got_y, want_y, np.abs(want_y)), ulps(got_d, want_d, terms)


@pytest.mark.parametrize("region", REGIONS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_float32_is_at_least_as_accurate_as_torch(torch, approximate, region):
    """npattn's float32 GELU computes in float32 (kernels/gelu.py, FLOAT32) and is no further
    from the float64 truth than PyTorch's float32, measured here on the same 20001 inputs per
    region, forward and slope. (A Horner step dropped from the float32 g fails here, on
    [-1, 1]; a float32 u in the tanh form fails test_the_tail_is_relatively_accurate.)"""
    x = np.linspace(*region, 20001).astype(np.float32)
    tx = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    ty.backward(torch.ones_like(ty))
    ours_y, ours_d = float32_errors(x, gelu(x, approximate),
                                    gelu_backward(np.ones_like(x), x, approximate), approximate)
    theirs_y, theirs_d = float32_errors(x, ty.detach().numpy(), tx.grad.numpy(), approximate)
    assert ours_y.max() <= theirs_y.max(), (ours_y.max(), theirs_y.max())
    assert ours_d.max() <= theirs_d.max(), (ours_d.max(), theirs_d.max())


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infinities_give_the_limits(torch, approximate, dtype):
    """GELU(+inf) = +inf, GELU(−inf) = −0, slopes 1 and 0: the limits (PyTorch 2.13 gives NaN
    at −inf, 0·inf, and NaN slopes: a documented deviation). Finite x as PyTorch in value; the
    sign of a zero is checked against the limit, not PyTorch, whose sign of gelu(x ≪ 0) depends
    on the CPU kernel it runs (AVX-512: −0; float32 on an AVX2 Zen 3: +0)."""
    x = np.array([np.inf, -np.inf, -1e30, 1e30, -60.0, 0.0, -0.0, np.nan], dtype)
    y = gelu(x, approximate)
    dx = gelu_backward(np.full_like(x, 2.0), x, approximate)
    want_y = np.array([np.inf, -0.0, -0.0, 1e30, -0.0, 0.0, -0.0, np.nan], dtype)
    assert np.array_equal(y, want_y, equal_nan=True)
    assert np.array_equal(np.signbit(y), np.signbit(want_y))
    assert np.array_equal(dx, np.array([2, 0, 0, 2, 0, 1, 1, np.nan], dtype), equal_nan=True)
    finite = slice(2, 7)                        # where PyTorch agrees, in the same dtype
    tx = torch.tensor(x[finite], requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    ty.backward(torch.full_like(ty, 2.0))
    assert np.array_equal(y[finite], ty.detach().numpy().astype(dtype))
    # (not at ±1e30: PyTorch's float32 tanh-form slope is NaN there, its x³ overflows)
    assert np.array_equal(dx[4:7], tx.grad.numpy()[2:].astype(dtype))


def test_float64_huge_inputs_do_not_overflow():
    """x³ and x² overflow float64 for |x| > 1e103 and 1e154: the results are still the limits."""
    x = np.array([1e200, -1e200, 1e300, -1e300, np.finfo(np.float64).max])
    for approximate in APPROXIMATIONS:
        np.testing.assert_array_equal(gelu(x, approximate), np.where(x > 0, x, -0.0))
        np.testing.assert_array_equal(gelu_backward(np.ones_like(x), x, approximate),
                                      np.where(x > 0, 1.0, 0.0))


def test_large_arrays_cover_several_blocks_and_nan_stays_put():
    """More elements than one prange block: every block is written, a NaN poisons only its
    own element."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5000)).astype(np.float32)
    x[1, 4321] = np.nan
    for approximate in APPROXIMATIONS:
        y = gelu(x, approximate)
        dx = gelu_backward(x, x, approximate)
        assert np.array_equal(np.isnan(y), np.isnan(x))
        assert np.array_equal(np.isnan(dx), np.isnan(x))
        assert_close(y, reference.gelu_forward(*f64(x), approximate), dtype=np.float32, n=2,
                     scale=0.0)


# ------------------------------------------------------------------ bad input

def test_bad_input_names_the_argument():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"approximate must be one of \('none', 'tanh'\); "
                                         r"got 'exact'"):
        gelu(x, approximate="exact")
    for wrong in (None, "Tanh", 0, True, ["tanh"]):
        with pytest.raises(ValueError, match="approximate"):
            gelu_forward(x, wrong)
        with pytest.raises(ValueError, match="approximate"):
            gelu_backward(x, x, wrong)
    with pytest.raises(TypeError, match="x must have dtype float32 or float64; got int64"):
        gelu(np.ones(3, np.int64))
    with pytest.raises(TypeError, match="x must have dtype float32 or float64; got float16"):
        gelu(np.ones(3, np.float16))
    with pytest.raises(TypeError, match="x must be a float32 or float64 array; got None"):
        gelu(None)
    with pytest.raises(TypeError, match="x must be .*; got list that NumPy cannot convert"):
        gelu([[1.0], [1.0, 2.0]])
    with pytest.raises(TypeError, match="dout must have dtype float32 to match x; got float64"):
        gelu_backward(np.ones((2, 3)), x)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 3\) to match x; got \(3, 2\)"):
        gelu_backward(np.ones((3, 2), np.float32), x)
    with pytest.raises(TypeError, match="dout must have dtype float32 or float64; got bool"):
        gelu_backward(np.ones((2, 3), bool), x)


@given(shape=shapes(max_ndim=3, max_dim=4), dtype=dtypes)
def test_results_have_the_input_shape_and_dtype_and_inputs_are_untouched(shape, dtype):
    x = np.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    keep = x.copy()
    for approximate in APPROXIMATIONS:
        y = gelu(x, approximate)
        dx = gelu_backward(x, x, approximate)
        for r in (y, dx):
            assert r.shape == x.shape and r.dtype == x.dtype
            assert r.flags.c_contiguous and not np.shares_memory(r, x)
    assert np.array_equal(x, keep)
    if x.ndim:
        lists = gelu(x.tolist())                 # nested lists: float64, as NumPy reads them
        assert lists.dtype == np.float64
