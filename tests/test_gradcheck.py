"""npattn.gradcheck: passes correct backwards, catches planted bugs, never touches its arguments."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from npattn import reference
from npattn.gradcheck import (GradcheckError, GradcheckReport, GradcheckShapeError, gradcheck,
                              gradcheck_module)
from npattn.nn import Module, Parameter, Sequential
from strategies import arrays, dims, dtypes, shapes


def values(seed, *shape, dtype=np.float64):
    """Test data from seeds 100 and up: gradcheck draws dout from default_rng(0), and x = dout
    would make dweight = doutᵀ·x symmetric -- a transposed dweight would then pass."""
    return np.random.default_rng(100 + seed).standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------ pairs under test

def softmax_fn(x, dim=-1):
    return npattn.softmax(x, dim)


def softmax_grad(dout, x, dim=-1):
    """The backward takes the output; the wrapper recomputes it from the input."""
    return npattn.softmax_backward(dout, npattn.softmax(x, dim), dim)


def softmax_grad_missing_term(dout, x):
    y = npattn.softmax(x)
    return y * dout                                    # forgot "- Σ_k dout_k y_k"


def linear_grad_sign_flip(dout, x, weight, bias):
    dx, dweight, dbias = npattn.linear_backward(dout, x, weight, bias)
    return dx, -dweight, dbias


def linear_grad_transposed(dout, x, weight, bias):
    dx, dweight, dbias = npattn.linear_backward(dout, x, weight, bias)
    return dx, dweight.T, dbias                        # same shape only for a square weight


def attention_output(query, key, value, mask):
    return reference.attention_forward(query, key, value, mask)[0]


def attention_grads(dout, query, key, value, mask):
    return reference.attention_backward(dout, query, key, value, mask)


# ------------------------------------------------------------------ passing cases

@st.composite
def linear_cases(draw):
    dtype = draw(dtypes)
    lead = draw(shapes(max_ndim=2, max_dim=2))            # small: 2 forwards per element
    fin, fout = draw(dims(4, 1)), draw(dims(4, 1))
    x = draw(arrays(lead + (fin,), dtype))
    weight = draw(arrays((fout, fin), dtype))
    bias = draw(arrays((fout,), dtype)) if draw(st.booleans()) else None
    return x, weight, bias


@given(case=linear_cases())
def test_linear_pair_passes(case):
    x, weight, bias = case
    originals = [None if a is None else a.copy() for a in case]
    if bias is None:
        report = gradcheck(lambda x, w: npattn.linear(x, w),
                           lambda d, x, w: npattn.linear_backward(d, x, w)[:2], (x, weight))
    else:
        report = gradcheck(npattn.linear_forward, npattn.linear_backward, (x, weight, bias))
    assert isinstance(report, GradcheckReport)
    assert report.ok and report.max_error <= 1.0
    assert sorted(report.errors) == list(range(2 if bias is None else 3))
    for given_array, original in zip(case, originals):     # the caller's arrays untouched
        if given_array is not None:
            assert given_array.dtype == original.dtype
            assert np.array_equal(given_array, original)


@given(data=st.data())
def test_softmax_pair_passes(data):
    dtype = data.draw(dtypes)
    shape = data.draw(shapes(min_ndim=1, max_ndim=3, max_dim=4))
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = data.draw(arrays(shape, dtype, ("normal", "wide")))
    report = gradcheck(lambda x: softmax_fn(x, dim), lambda d, x: softmax_grad(d, x, dim), (x,))
    assert report.ok, str(report)


@given(data=st.data())
def test_reference_attention_passes_with_a_bool_mask(data):
    L, S, E = data.draw(dims(3, 1)), data.draw(dims(3, 1)), data.draw(dims(3, 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(s) for s in ((L, E), (S, E), (S, E)))
    mask = rng.random((L, S)) < 0.7                   # bool: passed unchanged, gradient None
    report = gradcheck(attention_output, attention_grads, (q, k, v, mask))
    assert report.ok, str(report)
    assert set(report.errors) == {0, 1, 2} and 3 in report.skipped


def test_reference_matmul_passes_with_broadcasting():
    a, b = values(0, 2, 1, 3, 4), values(1, 3, 4, 2)
    assert gradcheck(reference.matmul_forward, reference.matmul_backward, (a, b)).ok


# ------------------------------------------------------------------ planted bugs

def test_sign_flip_fails():
    args = (values(0, 3, 4), values(1, 2, 4), values(2, 2))
    report = gradcheck(npattn.linear_forward, linear_grad_sign_flip, args, raise_exception=False)
    assert not report.ok and report.max_error > 1
    assert report.errors[1] > 1 and report.errors[0] <= 1 and report.errors[2] <= 1
    assert report.worst.input == 1
    assert report.worst.analytic == pytest.approx(-report.worst.numeric, rel=1e-6)
    with pytest.raises(GradcheckError, match=r"inputs\[1\]"):
        gradcheck(npattn.linear_forward, linear_grad_sign_flip, args)


def test_missing_term_fails():
    x = values(3, 2, 5)
    with pytest.raises(GradcheckError, match="FAILED"):
        gradcheck(softmax_fn, softmax_grad_missing_term, (x,))


def test_transposed_gradient_fails():
    args = (values(0, 3, 4), values(1, 4, 4), values(2, 4))    # square weight: shapes agree
    report = gradcheck(npattn.linear_forward, linear_grad_transposed, args, raise_exception=False)
    assert not report.ok and report.errors[1] > 1 and not report.problems
    with pytest.raises(AssertionError):                        # GradcheckError is one
        gradcheck(npattn.linear_forward, linear_grad_transposed, args)


def test_wrong_shape_is_reported_and_raises_a_value_error():
    args = (values(0, 3, 4), values(1, 2, 4), values(2, 2))   # weight (2, 4), dweight.T (4, 2)
    report = gradcheck(npattn.linear_forward, linear_grad_transposed, args, raise_exception=False)
    assert not report.ok and len(report.problems) == 1
    assert "inputs[1]" in report.problems[0] and "(4, 2)" in report.problems[0]
    assert "inputs[1]" in str(report)
    with pytest.raises(ValueError, match=r"inputs\[1\].*\(4, 2\)") as info:
        gradcheck(npattn.linear_forward, linear_grad_transposed, args)
    assert isinstance(info.value, GradcheckShapeError) and isinstance(info.value, GradcheckError)


def test_worst_points_at_the_planted_element():
    x = values(4, 3, 4)
    spot = (2, 1)

    def grad(dout, x):
        dx = 2 * x * dout
        dx[spot] += 0.5                                 # one wrong element
        return dx

    report = gradcheck(lambda x: x ** 2, grad, (x,), raise_exception=False)
    assert not report.ok and report.worst.input == 0 and report.worst.index == spot
    assert report.worst.analytic - report.worst.numeric == pytest.approx(0.5, rel=1e-5)
    assert "(2, 1)" in str(report)


def test_default_dout_is_random_because_all_ones_hides_softmax_bugs():
    x = values(5, 3, 4)
    zero_grad = lambda dout, x: np.zeros_like(x)     # noqa: E731  (true gradient is 0 for dout=1)
    assert gradcheck(softmax_fn, zero_grad, (x,), dout=np.ones((3, 4))).ok
    assert not gradcheck(softmax_fn, zero_grad, (x,), raise_exception=False).ok


def test_small_error_passes_large_fails_by_the_tolerance_rule():
    x = values(6, 5)

    def off_by(delta):
        return lambda dout, x: 3 * x ** 2 * dout + delta

    f = lambda x: x ** 3                              # noqa: E731
    report = gradcheck(f, off_by(0.0), (x,))
    assert report.max_error < 0.1
    assert not gradcheck(f, off_by(1e-2), (x,), raise_exception=False).ok
    assert gradcheck(f, off_by(1e-2), (x,), atol=0.1).ok


# ------------------------------------------------------------------ None gradients, integers

def gather(table, index):
    return table[index]                               # (V, E)[(N,)] -> (N, E)


def gather_grad(dout, table, index):
    dtable = np.zeros_like(table)
    np.add.at(dtable, index, dout)                    # repeated indices add up
    return dtable, None


def test_integer_input_is_passed_unchanged_and_not_perturbed():
    table, index = values(7, 5, 3), np.array([4, 0, 4, 2])
    seen = []

    def forward(table, index):
        seen.append(index)
        return gather(table, index)

    report = gradcheck(forward, gather_grad, (table, index))
    assert report.ok and list(report.errors) == [0] and 1 in report.skipped
    assert all(s is index for s in seen)               # the same object every call
    assert np.array_equal(index, [4, 0, 4, 2])


def test_a_wrong_gradient_next_to_an_integer_input_fails():
    def forgets_repeats(dout, table, index):
        dtable = np.zeros_like(table)
        dtable[index] = dout                           # a repeated index keeps only one row
        return dtable, None

    table, index = values(8, 5, 3), np.array([4, 0, 4, 2])
    assert not gradcheck(gather, forgets_repeats, (table, index), raise_exception=False).ok


def test_none_gradient_for_a_float_input_is_skipped():
    x, y = values(9, 3), values(10, 3)
    report = gradcheck(lambda x, y: x * y, lambda d, x, y: (d * y, None), (x, y))
    assert report.ok and list(report.errors) == [0]
    assert "None" in report.skipped[1] and "not checked" in str(report)


def test_float32_inputs_are_checked_in_float64():
    x = values(11, 4, dtype=np.float32)
    dtypes_seen = []

    def forward(x):
        dtypes_seen.append(x.dtype)
        return np.sin(x)

    assert gradcheck(forward, lambda d, x: d * np.cos(x), (x,), atol=1e-8, rtol=1e-7).ok
    assert set(dtypes_seen) == {np.dtype(np.float64)} and x.dtype == np.float32


# ------------------------------------------------------------------ usage errors

def test_usage_errors():
    x = values(12, 3)
    with pytest.raises(ValueError, match="one gradient"):
        gradcheck(lambda x, y: x * y, lambda d, x, y: d * y, (x, x))
    with pytest.raises(ValueError, match=r"dout must have the shape .*\(3,\).*\(4,\)"):
        gradcheck(np.sin, lambda d, x: d * np.cos(x), (x,), dout=np.ones(4))
    with pytest.raises(ValueError, match="deterministic"):
        gradcheck(lambda x: x + np.random.random(x.shape), lambda d, x: d, (x,))
    with pytest.raises(ValueError, match="eps"):
        gradcheck(np.sin, lambda d, x: d * np.cos(x), (x,), eps=0)


# ------------------------------------------------------------------ modules

class ToyLinear(Module):
    """y = x·Wᵀ + b, with optional planted bugs in its backward."""

    def __init__(self, fin, fout, seed, bug=None, dtype=np.float64):
        super().__init__()
        self.weight = Parameter(values(seed, fout, fin, dtype=dtype))
        self.bias = Parameter(values(seed + 1, fout, dtype=dtype))
        self.bug = bug

    def forward(self, x):
        self._saved = x
        return npattn.linear(x, self.weight.data, self.bias.data)

    def backward(self, dout):
        dx, dweight, dbias = npattn.linear_backward(dout, self._saved_for_backward(),
                                                    self.weight.data, self.bias.data)
        self.weight.accumulate(-dweight if self.bug == "weight" else dweight)
        self.bias.accumulate(dbias)
        return 2 * dx if self.bug == "input" else dx


class ToyScaledProduct(Module):
    """(x ∘ y · s, x): two inputs, a tuple result, an optional mask-like integer input."""

    def __init__(self):
        super().__init__()
        self.s = Parameter(np.array(1.5))

    def forward(self, x, y, count):
        self._saved = (x, y)
        return x * y * self.s.data * count, x

    def backward(self, dout):
        x, y = self._saved_for_backward()
        self.s.accumulate(np.sum(dout * x * y * 2))
        return dout * y * self.s.data * 2, dout * x * self.s.data * 2, None


class ToyEmbedding(Module):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(values(13, 5, 3))

    def forward(self, index):
        self._saved = index
        return self.weight.data[index]

    def backward(self, dout):
        np.add.at(self.weight.grad, self._saved_for_backward(), dout)
        return None


class ToyDropout(Module):
    """A new mask on every call in training mode, the identity in eval mode.

    The masks alternate instead of being drawn: two random masks of a few elements can come out
    equal (1 in 64 for six), and the check for a deterministic forward would then not fire.
    """

    def forward(self, x):
        self._saved = None
        if not self.training:
            return x
        self._calls = getattr(self, "_calls", 0) + 1
        self._keep = (np.arange(x.size).reshape(x.shape) + self._calls) % 2 == 0
        return np.where(self._keep, 2 * x, 0.0)

    def backward(self, dout):
        return dout if not self.training else np.where(self._keep, 2 * dout, 0.0)


@given(data=st.data())
def test_module_passes(data):
    dtype = data.draw(dtypes)
    lead = data.draw(shapes(max_ndim=2, max_dim=2))
    fin, hidden, fout = (data.draw(dims(3, 1)) for _ in range(3))
    model = Sequential(ToyLinear(fin, hidden, 0, dtype=dtype), ToyLinear(hidden, fout, 5,
                                                                         dtype=dtype))
    x = data.draw(arrays(lead + (fin,), dtype))
    report = gradcheck_module(model, (x,))
    assert report.ok, str(report)
    assert list(report.errors) == [0, "0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("bug, culprit", [("weight", "weight"), ("input", 0)])
def test_module_with_a_wrong_gradient_fails(bug, culprit):
    model, x = ToyLinear(3, 2, 0, bug=bug), values(1, 4, 3)
    report = gradcheck_module(model, (x,), raise_exception=False)
    assert not report.ok and report.worst.input == culprit
    assert [k for k, e in report.errors.items() if e > 1] == [culprit]
    with pytest.raises(GradcheckError, match="FAILED"):
        gradcheck_module(model, (x,))


def test_module_wrong_parameter_gradient_shape_raises_value_error():
    class Flat(ToyLinear):
        def backward(self, dout):
            dx = super().backward(dout)
            self.weight.grad = self.weight.grad.reshape(-1)
            return dx

    with pytest.raises(ValueError, match="parameter 'weight'.*\\(6,\\)"):
        gradcheck_module(Flat(3, 2, 0), (values(1, 4, 3),))


def test_module_leaves_the_callers_module_and_inputs_untouched():
    model = ToyLinear(3, 2, 0, dtype=np.float32)
    model.weight.grad[...] = 7.0                        # the caller's accumulated gradient
    before = {k: v.copy() for k, v in model.state_dict().items()}
    x = values(1, 4, 3, dtype=np.float32)
    x_before = x.copy()
    assert gradcheck_module(model, (x,)).ok             # zero_grad ran on the copy, before backward
    assert model.weight.dtype == np.float32 and x.dtype == np.float32
    assert np.array_equal(x, x_before)
    for key, value in model.state_dict().items():
        assert value.dtype == np.float32 and np.array_equal(value, before[key])
    assert np.all(model.weight.grad == 7.0) and "_saved" not in model.__dict__


def test_module_tuple_result_several_inputs_and_an_integer():
    x, y = values(2, 2, 3), values(3, 2, 3)
    report = gradcheck_module(ToyScaledProduct(), (x, y, 2))
    assert report.ok and list(report.errors) == [0, 1, "s"] and 2 in report.skipped
    second = gradcheck_module(ToyScaledProduct(), (x, y, 2), output=lambda result: result[1],
                              raise_exception=False)
    assert not second.ok                                 # backward differentiates result[0]


def test_module_without_input_gradient():
    report = gradcheck_module(ToyEmbedding(), (np.array([[1, 4], [1, 0]]),))
    assert report.ok and list(report.errors) == ["weight"] and 0 in report.skipped


def test_module_must_be_deterministic_and_the_mode_is_left_alone():
    model = Sequential(ToyLinear(3, 3, 0), ToyDropout())
    x = values(1, 2, 3)
    with pytest.raises(ValueError, match="eval"):
        gradcheck_module(model, (x,))
    assert model.training                                # not switched off behind our back
    assert gradcheck_module(model.eval(), (x,)).ok
