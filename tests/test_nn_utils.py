"""npattn.nn.utils.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ and against a float64
transcription of its formula: total = ‖(‖g_1‖_p, ‖g_2‖_p, ...)‖_p, g ← g·min(max_norm/(total +
1e-6), 1)."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close
from npattn import nn
from npattn.nn.utils import clip_grad_norm_
from strategies import dtypes, make_values, shapes

NORM_TYPES = (2.0, 1.0, 3.0, 0.5, math.inf, 0.0)


@st.composite
def grad_sets(draw, kinds=("normal", "wide")):
    """Parameters of drawn shapes (at least one entry each: PyTorch's inf-norm refuses empty
    grads), one dtype or a mix, with random grads (some None), a max_norm and a norm type."""
    mixed = draw(st.booleans())
    dtype = draw(dtypes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    params = []
    for shape in draw(st.lists(shapes(max_ndim=3, max_dim=5, min_dim=1), min_size=1,
                               max_size=4)):
        dt = draw(dtypes) if mixed else dtype
        param = nn.Parameter(np.zeros(shape, dt))
        if draw(st.integers(0, 5)) == 0:
            param.grad = None
        else:
            param.grad = make_values(rng, shape, dt, draw(st.sampled_from(kinds)))
        params.append(param)
    max_norm = draw(st.sampled_from([0.0, 1e-3, 0.5, 1.0, 10.0, 1e6, math.inf]))
    return params, max_norm, draw(st.sampled_from(NORM_TYPES))


def transcription(grads, max_norm, norm_type):
    """The formula in float64, per grad, then over the per-grad norms (PyTorch's two levels)."""
    def norm(v):
        v = np.abs(np.asarray(v, np.float64).reshape(-1))
        if norm_type == math.inf:
            return v.max()
        if norm_type == 0:
            return float(np.count_nonzero(v))
        return np.sum(v ** norm_type) ** (1 / norm_type)
    total = norm([norm(g) for g in grads])
    coef = min(max_norm / (total + 1e-6), 1.0)
    return total, [np.asarray(g, np.float64) * coef for g in grads]


def scale_of(grads, norm_type):
    """The magnitude of the summed terms of the total, per grad (for closeness' n·eps rule)."""
    return max((float(np.abs(np.asarray(g, np.float64)).max()) for g in grads), default=0.0)


@given(case=grad_sets())
def test_matches_the_float64_transcription(case):
    params, max_norm, norm_type = case
    before = [None if p.grad is None else p.grad.copy() for p in params]
    grads = [g for g in before if g is not None]
    total = clip_grad_norm_(params, max_norm, norm_type)
    if not grads:
        assert total == 0 and total.dtype == np.float32
        return
    dtype = np.result_type(*grads)
    assert isinstance(total, np.generic) and total.dtype == dtype
    want_total, want = transcription(grads, max_norm, norm_type)
    n = sum(g.size for g in grads) + 2
    assert_close(total, want_total, dtype=dtype, n=n)
    clipped = iter(want)
    for p, g in zip(params, before):
        if g is None:
            assert p.grad is None
            continue
        # the coefficient is computed from the rounded total, in dtype: a few ulps of it
        assert_close(p.grad, next(clipped), dtype=g.dtype, n=n + 4, scale=np.abs(g))


@given(case=grad_sets())
def test_matches_torch(torch, case):
    params, max_norm, norm_type = case
    tensors = []
    for p in params:
        t = torch.nn.Parameter(torch.tensor(p.data))
        t.grad = None if p.grad is None else torch.tensor(p.grad.copy())
        tensors.append(t)
    total = clip_grad_norm_(params, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type=norm_type)
    if all(p.grad is None for p in params):        # torch.tensor(0.0): its default dtype
        assert total == want.item() == 0
        return
    assert total.dtype == np.dtype(str(want.dtype).replace("torch.", ""))
    n = sum(p.grad.size for p in params if p.grad is not None) + 2
    # PyTorch rounds each float32 grad's norm to float32 before the (float64) total of a mix;
    # ours stays float64: with a float32 grad in the set, agreement is float32's
    least = np.float32 if any(p.grad is not None and p.grad.dtype == np.float32
                              for p in params) else np.float64
    assert_close(np.asarray(total, least), want.numpy(), dtype=least, n=n)
    for p, t in zip(params, tensors):
        if p.grad is None:
            assert t.grad is None
        else:
            assert_close(np.asarray(p.grad, least), t.grad.numpy(), dtype=least, n=n + 4,
                         scale=np.abs(t.grad.numpy()))


def test_clips_exactly_to_max_norm_and_leaves_small_grads_alone():
    rng = np.random.default_rng(0)
    params = [nn.Parameter(np.zeros((30, 40))), nn.Parameter(np.zeros(7))]
    for p in params:
        p.grad = rng.standard_normal(p.shape) * 5
    raw = [p.grad.copy() for p in params]
    total = clip_grad_norm_(params, 2.0)
    assert total == pytest.approx(math.sqrt(sum(np.sum(g ** 2) for g in raw)), rel=1e-14)
    after = math.sqrt(sum(np.sum(p.grad ** 2) for p in params))
    assert after == pytest.approx(2.0 * total / (total + 1e-6), rel=1e-14)   # just below 2
    for p, g in zip(params, raw):                   # one coefficient for all: directions kept
        np.testing.assert_allclose(p.grad, g * (2.0 / (total + 1e-6)), rtol=1e-15)
    kept = [p.grad.copy() for p in params]
    again = clip_grad_norm_(iter(params), 10.0)    # below max_norm: coefficient 1, unchanged
    assert again < 10.0
    for p, g in zip(params, kept):
        np.testing.assert_array_equal(p.grad, g)
    assert p.grad is params[1].grad                 # in place: the same arrays


def test_a_single_parameter_none_grads_and_no_grads():
    p = nn.Parameter(np.zeros(4, np.float32))
    p.grad = np.array([3.0, 4.0, 0.0, 0.0], np.float32)
    total = clip_grad_norm_(p, 1.0, norm_type=math.inf)
    assert total == np.float32(4.0) and total.dtype == np.float32
    np.testing.assert_array_equal(p.grad, np.array([3, 4, 0, 0], np.float32)
                                  * (np.float32(1.0) / (np.float32(4.0) + np.float32(1e-6))))
    q = nn.Parameter(np.zeros(3))
    q.grad = None
    assert clip_grad_norm_([q], 1.0) == 0.0 and q.grad is None
    assert clip_grad_norm_([], 1.0).dtype == np.float32        # as torch.tensor(0.0)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_non_finite_total(poison):
    """error_if_nonfinite raises PyTorch's RuntimeError before touching the grads; without it
    the grads are scaled by what the formula gives (NaN, or 0 for an infinite norm)."""
    p = nn.Parameter(np.zeros(3))
    p.grad = np.array([1.0, poison, 2.0])
    with pytest.raises(RuntimeError, match="total norm of order 2.0 .* is non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(p.grad, [1.0, poison, 2.0])
    total = clip_grad_norm_([p], 1.0)
    assert np.isnan(total) if np.isnan(poison) else total == np.inf
    if np.isnan(poison):
        assert np.all(np.isnan(p.grad))
    else:
        np.testing.assert_array_equal(p.grad, [0.0, np.nan, 0.0])   # inf·0 is NaN, as torch


def test_float32_is_summed_in_float64_in_a_fixed_order():
    """10⁶ float32 ones: a float32 running sum would stall at 2²⁴; ours is exact, and the
    same bits for a reshaped grad (the chunks are of the flat array)."""
    p = nn.Parameter(np.zeros(10**6 + 3, np.float32))
    p.grad = np.ones(p.shape, np.float32)
    assert clip_grad_norm_([p], max_norm=math.inf) == np.float32(math.sqrt(10**6 + 3))
    q = nn.Parameter(np.zeros((1000003,), np.float32))
    q.grad = np.random.default_rng(0).standard_normal(q.shape).astype(np.float32)
    r = nn.Parameter(np.zeros((1, 1000003), np.float32))
    r.grad = q.grad.reshape(1, -1).copy()
    assert clip_grad_norm_([q], max_norm=math.inf) == clip_grad_norm_([r], max_norm=math.inf)


@pytest.mark.parametrize("call, error, words", [
    (lambda p: clip_grad_norm_(p, -1.0), ValueError, ["max_norm", ">= 0", "-1.0"]),
    (lambda p: clip_grad_norm_(p, math.nan), ValueError, ["max_norm", "nan"]),
    (lambda p: clip_grad_norm_(p, "1"), TypeError, ["max_norm", "str"]),
    (lambda p: clip_grad_norm_(p, None), TypeError, ["max_norm", "NoneType"]),
    (lambda p: clip_grad_norm_(p, 1.0, norm_type=math.nan), ValueError, ["norm_type", "nan"]),
    (lambda p: clip_grad_norm_(p, 1.0, norm_type="fro"), TypeError, ["norm_type", "str"]),
    (lambda p: clip_grad_norm_(p, 1.0, error_if_nonfinite=1), TypeError,
     ["error_if_nonfinite", "bool", "int"]),
    (lambda p: clip_grad_norm_(p, 1.0, foreach="yes"), TypeError, ["foreach", "bool"]),
    (lambda p: clip_grad_norm_(p[0].grad, 1.0), TypeError, ["parameters", "ndarray"]),
    (lambda p: clip_grad_norm_([p[0], p[0].grad], 1.0), TypeError,
     ["parameters[1]", "Parameter", "ndarray"]),
    (lambda p: clip_grad_norm_(None, 1.0), TypeError, ["parameters", "NoneType"]),
    (lambda p: clip_grad_norm_(3, 1.0), TypeError, ["parameters", "int"]),
])
def test_bad_arguments_name_themselves(call, error, words):
    p = nn.Parameter(np.ones(3))
    p.grad = np.full(3, 5.0)
    with pytest.raises(error) as info:
        call([p])
    for word in words:
        assert word in str(info.value)
    np.testing.assert_array_equal(p.grad, 5.0)        # refused before any grad was touched


@pytest.mark.parametrize("grad, words", [
    ([1.0, 2.0, 3.0], ["parameters[1].grad", "list"]),
    (np.ones(4), ["parameters[1].grad", "(3,)", "shape (4,)"]),
    (np.ones(3, np.int64), ["parameters[1].grad", "int64"]),
])
def test_a_bad_grad_is_named(grad, words):
    good, bad = nn.Parameter(np.ones(3)), nn.Parameter(np.ones(3))
    good.grad = np.full(3, 5.0)
    bad.grad = grad
    with pytest.raises(TypeError) as info:
        clip_grad_norm_([good, bad], 1.0)
    for word in words:
        assert word in str(info.value)
    np.testing.assert_array_equal(good.grad, 5.0)


def test_reachable_as_torch_spells_it():
    import npattn
    assert npattn.nn.utils.clip_grad_norm_ is clip_grad_norm_
    assert nn.utils.clip_grad_norm_ is clip_grad_norm_
