"""linear_forward / linear_backward against the float64 textbook and against PyTorch."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from closeness import abs64, assert_close, f64
from npattn import reference
from npattn.functional.linear import linear, linear_backward, linear_forward
from npattn.kernels import tiles
from strategies import arrays, dims, dtypes, shapes

pytestmark = pytest.mark.kernel        # run again under each register tile in CI


@st.composite
def linear_cases(draw, kinds=("normal", "wide")):
    """x (..., Fin), weight (Fout, Fin), bias (Fout,) or None, dout (..., Fout)."""
    dtype = draw(dtypes)
    lead = draw(shapes(max_ndim=3, max_dim=6))
    fin, fout = draw(dims(40)), draw(dims(40))
    x = draw(arrays(lead + (fin,), dtype, kinds))
    weight = draw(arrays((fout, fin), dtype, kinds))
    bias = draw(st.none() | arrays((fout,), dtype, kinds))
    dout = draw(arrays(lead + (fout,), dtype, kinds))
    return x, weight, bias, dout


def check_forward(case):
    x, weight, bias, _ = case
    got = linear_forward(x, weight, bias)
    want = reference.linear_forward(*f64(x, weight, bias))
    scale = reference.linear_forward(*abs64(x, weight, bias))
    assert_close(got, want, dtype=x.dtype, n=x.shape[-1] + 1, scale=scale)


def check_backward(case):
    x, weight, bias, dout = case            # dout is random: an all-ones dout hides bugs
    dx, dweight, dbias = linear_backward(dout, x, weight, bias)
    want = reference.linear_backward(*f64(dout, x, weight, bias))
    abs_ = reference.linear_backward(*abs64(dout, x, weight, bias))
    rows = int(np.prod(x.shape[:-1]))
    assert_close(dx, want[0], dtype=x.dtype, n=weight.shape[0], scale=abs_[0])
    assert_close(dweight, want[1], dtype=x.dtype, n=rows, scale=abs_[1])
    if bias is None:
        assert dbias is None
    else:
        assert_close(dbias, want[2], dtype=x.dtype, n=rows, scale=abs_[2])


def check_torch(torch, case):
    x, weight, bias, dout = case
    tx, tw = (torch.tensor(a, requires_grad=True) for a in f64(x, weight))
    tb = None if bias is None else torch.tensor(f64(bias)[0], requires_grad=True)
    tout = torch.nn.functional.linear(tx, tw, tb)
    tout.backward(torch.tensor(f64(dout)[0]))
    scale = reference.linear_forward(*abs64(x, weight, bias))
    assert_close(linear(x, weight, bias), tout.detach().numpy(), dtype=x.dtype,
                 n=x.shape[-1] + 1, scale=scale)
    got = linear_backward(dout, x, weight, bias)
    abs_ = reference.linear_backward(*abs64(dout, x, weight, bias))
    rows = int(np.prod(x.shape[:-1]))
    assert_close(got[0], tx.grad.numpy(), dtype=x.dtype, n=weight.shape[0], scale=abs_[0])
    assert_close(got[1], tw.grad.numpy(), dtype=x.dtype, n=rows, scale=abs_[1])
    if bias is not None:
        assert_close(got[2], tb.grad.numpy(), dtype=x.dtype, n=rows, scale=abs_[2])


@given(case=linear_cases())
def test_linear_forward_matches_reference(case):
    check_forward(case)


@given(case=linear_cases())
def test_linear_backward_matches_reference(case):
    check_backward(case)


@given(case=linear_cases())
def test_linear_matches_torch(torch, case):
    check_torch(torch, case)


def small_limit(dtype):
    """gemm's SMALL (multiply-adds up to which x·Wᵀ takes the unpacked small_dot_kernel), read
    from the engine instance the functional layer calls for ``dtype`` (tiles.gemm)."""
    return tiles.engine("gemm", dtype).SMALL


@st.composite
def packed_linear_cases(draw, kinds=("normal", "wide")):
    """linear_cases past SMALL: rows·Fout·Fin > SMALL multiply-adds with modest dims, so the
    forward product takes the packed (blocked) engine instead of small_dot_kernel."""
    dtype = draw(dtypes)
    fin, fout = draw(st.integers(100, 300)), draw(st.integers(20, 90))
    rows = small_limit(dtype) // (fin * fout) + 1 + draw(st.integers(0, 9))
    lead = (rows,) if draw(st.booleans()) else (2, (rows + 1) // 2)
    x = draw(arrays(lead + (fin,), dtype, kinds))
    weight = draw(arrays((fout, fin), dtype, kinds))
    bias = draw(st.none() | arrays((fout,), dtype, kinds))
    dout = draw(arrays(lead + (fout,), dtype, kinds))
    return x, weight, bias, dout


@settings(max_examples=12, deadline=None)
@given(case=packed_linear_cases())
def test_linear_past_the_small_product_path_matches_reference(case):
    x, weight, _, _ = case
    rows = int(np.prod(x.shape[:-1]))
    assert rows * weight.shape[0] * x.shape[-1] > small_limit(x.dtype)   # the packed path
    check_forward(case)
    check_backward(case)


@settings(max_examples=4, deadline=None)
@given(case=packed_linear_cases())
def test_linear_past_the_small_product_path_matches_torch(torch, case):
    check_torch(torch, case)


def test_article_example_shapes():
    """The article's batch: X (2, 5, 512) through W_Q = Linear(512, 64) gives Q (2, 5, 64),
    and each of the 2·5 = 10 rows is its own 512-vector times W_Qᵀ."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 512)).astype(np.float32)
    w_q = rng.standard_normal((64, 512)).astype(np.float32)
    b_q = rng.standard_normal(64).astype(np.float32)
    q = linear(x, w_q, b_q)
    assert q.shape == (2, 5, 64) and q.dtype == np.float32
    for b in range(2):
        for t in range(5):
            row = linear(x[b, t], w_q, b_q)                   # one token on its own
            assert row.shape == (64,)
            np.testing.assert_array_equal(row, q[b, t])       # the same loop, the same bits
    dx, dw, db = linear_backward(np.ones_like(q), x, w_q, b_q)
    assert (dx.shape, dw.shape, db.shape) == ((2, 5, 512), (64, 512), (64,))


@pytest.mark.parametrize("args, error, words", [
    ((np.ones((2, 3), np.int64), np.ones((4, 3))), TypeError, ["x", "float32 or float64", "int64"]),
    ((np.ones((2, 3)), np.ones((4, 3), np.float32)), TypeError, ["weight", "float64", "float32"]),
    ((np.ones((2, 3)), np.ones((4, 5))), ValueError, ["weight", "(Fout, 3)", "(4, 5)"]),
    ((np.ones((2, 3)), np.ones(3)), ValueError, ["weight", "(Fout, 3)", "(3,)"]),
    ((np.float64(1.0), np.ones((4, 1))), ValueError, ["x", "at least 1 dimension", "()"]),
    ((np.ones((2, 3)), np.ones((4, 3)), np.ones(5)), ValueError, ["bias", "(4,)", "(5,)"]),
    ((np.ones((2, 3)), np.ones((4, 3)), np.ones(4, np.float32)), TypeError, ["bias", "float64"]),
    ((np.ones((2, 3), np.complex128), np.ones((4, 3))), TypeError, ["x", "complex128"]),
    ((np.ones((2, 3), np.float16), np.ones((4, 3))), TypeError, ["x", "float16"]),
    ((np.ones((2, 3), bool), np.ones((4, 3))), TypeError, ["x", "bool"]),
    (([[1.0, 2.0], [3.0]], np.ones((4, 2))), TypeError, ["x"]),
    ((np.array([None, 1.0]), np.ones((4, 2))), TypeError, ["x", "object"]),
])
def test_linear_forward_rejects_bad_input(args, error, words):
    with pytest.raises(error) as info:
        linear_forward(*args)
    for word in words:
        assert word in str(info.value)


def test_linear_backward_rejects_mismatched_dout():
    x, w = np.ones((2, 5, 3)), np.ones((4, 3))
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 5, 4\).*got \(2, 5, 3\)"):
        linear_backward(np.ones((2, 5, 3)), x, w)
    with pytest.raises(TypeError, match="dout must have dtype float64"):
        linear_backward(np.ones((2, 5, 4), np.float32), x, w)


def test_linear_accepts_lists_and_keeps_dtype():
    got = linear([[1.0, 2.0]], [[3.0, 4.0]], [0.5])
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [[11.5]])
