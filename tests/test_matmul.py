"""matmul_forward / matmul_backward against the float64 textbook and against PyTorch."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from closeness import abs64, assert_close, f64
from npattn import reference
from npattn.functional.matmul import matmul, matmul_backward, matmul_forward
from npattn.kernels import tiles
from strategies import arrays, broadcastable_batches, dims, dtypes, make_values, shapes

pytestmark = pytest.mark.kernel        # run again under each register tile in CI


def matmul_shapes(shape_a, shape_b):
    """torch.matmul's output shape, and the length of the reduction behind each result.

    Returns (out_shape, n_out, n_da, n_db): out sums over K; da over N for each output batch
    that uses an a-matrix, db over M likewise (broadcast batch dims are summed).
    """
    m, k = (1, shape_a[0]) if len(shape_a) == 1 else shape_a[-2:]
    n = 1 if len(shape_b) == 1 else shape_b[-1]
    batch_a, batch_b = shape_a[:-2], shape_b[:-2]
    batch = np.broadcast_shapes(batch_a, batch_b)
    out_shape = batch + (m,) * (len(shape_a) > 1) + (n,) * (len(shape_b) > 1)
    uses_a = math.prod(batch) // max(math.prod(batch_a), 1)   # output batches per a-matrix
    uses_b = math.prod(batch) // max(math.prod(batch_b), 1)
    return out_shape, k, n * uses_a, m * uses_b


@st.composite
def matmul_cases(draw, kinds=("normal", "wide")):
    """a (*Ba, M, K) or (K,), b (*Bb, K, N) or (K,), and a dout of the product's shape."""
    dtype = draw(dtypes)
    m, k, n = draw(dims(12)), draw(dims(12)), draw(dims(12))
    batch_a, batch_b = draw(broadcastable_batches())
    vector = st.sampled_from([False, False, True])          # a 1-D operand one time in three
    a_is_vector, b_is_vector = draw(vector), draw(vector)
    shape_a = (k,) if a_is_vector else batch_a + (m, k)
    shape_b = (k,) if b_is_vector else batch_b + (k, n)
    a = draw(arrays(shape_a, dtype, kinds))
    b = draw(arrays(shape_b, dtype, kinds))
    out_shape = matmul_shapes(shape_a, shape_b)[0]
    dout = draw(arrays(out_shape, dtype, kinds)).reshape(out_shape)  # make_values gives () as (1,)
    return a, b, dout


def check_against_reference(a, b, dout):
    out_shape, n_out, n_da, n_db = matmul_shapes(a.shape, b.shape)
    got = matmul_forward(a, b)
    assert got.shape == out_shape
    want = reference.matmul_forward(*f64(a, b))
    scale = reference.matmul_forward(*abs64(a, b))
    assert_close(got, want, dtype=a.dtype, n=n_out, scale=scale)
    da, db = matmul_backward(dout, a, b)
    want_da, want_db = reference.matmul_backward(*f64(dout, a, b))
    abs_da, abs_db = reference.matmul_backward(*abs64(dout, a, b))
    assert_close(da, want_da, dtype=a.dtype, n=n_da, scale=abs_da)
    assert_close(db, want_db, dtype=a.dtype, n=n_db, scale=abs_db)


@given(case=matmul_cases())
def test_matmul_forward_matches_reference(case):
    a, b, _ = case
    got = matmul_forward(a, b)
    want = reference.matmul_forward(*f64(a, b))
    scale = reference.matmul_forward(*abs64(a, b))
    assert_close(got, want, dtype=a.dtype, n=matmul_shapes(a.shape, b.shape)[1], scale=scale)


@given(case=matmul_cases())
def test_matmul_backward_matches_reference(case):
    a, b, dout = case                       # dout is random: an all-ones dout hides bugs
    da, db = matmul_backward(dout, a, b)
    want = reference.matmul_backward(*f64(dout, a, b))
    abs_ = reference.matmul_backward(*abs64(dout, a, b))
    _, _, n_da, n_db = matmul_shapes(a.shape, b.shape)
    assert_close(da, want[0], dtype=a.dtype, n=n_da, scale=abs_[0])
    assert_close(db, want[1], dtype=a.dtype, n=n_db, scale=abs_[1])


@given(case=matmul_cases(kinds=("nan",)))
def test_matmul_propagates_nan(case):
    check_against_reference(*case)


@given(case=matmul_cases())
def test_matmul_matches_torch(torch, case):
    check_against_torch(torch, *case)


def check_against_torch(torch, a, b, dout):
    ta, tb = (torch.tensor(x, requires_grad=True) for x in f64(a, b))
    tout = torch.matmul(ta, tb)
    tout.backward(torch.tensor(f64(dout)[0]))
    _, n_out, n_da, n_db = matmul_shapes(a.shape, b.shape)
    scale = reference.matmul_forward(*abs64(a, b))
    assert_close(matmul(a, b), tout.detach().numpy(), dtype=a.dtype, n=n_out, scale=scale)
    da, db = matmul_backward(dout, a, b)
    abs_ = reference.matmul_backward(*abs64(dout, a, b))
    assert_close(da, ta.grad.numpy(), dtype=a.dtype, n=n_da, scale=abs_[0])
    assert_close(db, tb.grad.numpy(), dtype=a.dtype, n=n_db, scale=abs_[1])


def k_block(dtype):
    """gemm's KC (the K block of its packed path), from the engine instance the functional layer
    calls for ``dtype`` (tiles.gemm)."""
    return tiles.engine("gemm", dtype).KC


@st.composite
def long_k_cases(draw, kinds=("normal", "wide")):
    """matmul_cases with K across one or two K blocks: K in [KC + 1, 2·KC + 17]."""
    dtype = draw(dtypes)
    kc = k_block(dtype)
    m, k, n = draw(dims(12)), draw(st.integers(kc + 1, 2 * kc + 17)), draw(dims(12))
    batch_a, batch_b = draw(broadcastable_batches(max_ndim=2, max_dim=3))
    vector = st.sampled_from([False, False, False, True])
    shape_a = (k,) if draw(vector) else batch_a + (m, k)
    shape_b = (k,) if draw(vector) else batch_b + (k, n)
    a = draw(arrays(shape_a, dtype, kinds))
    b = draw(arrays(shape_b, dtype, kinds))
    out_shape = matmul_shapes(shape_a, shape_b)[0]
    dout = draw(arrays(out_shape, dtype, kinds)).reshape(out_shape)
    return a, b, dout


@settings(max_examples=12, deadline=None)
@given(case=long_k_cases())
def test_matmul_across_k_blocks_matches_reference(case):
    a, b, _ = case
    assert a.shape[-1] > k_block(a.dtype)
    check_against_reference(*case)


@settings(max_examples=6, deadline=None)
@given(case=long_k_cases())
def test_matmul_across_k_blocks_matches_torch(torch, case):
    check_against_torch(torch, *case)


EDGE_SHAPES = [
    ((7,), (7,)),                   # dot product: a 0-d result
    ((0,), (0,)),                   # empty dot product: 0
    ((5,), (5, 3)),                 # vector · matrix
    ((4,), (2, 3, 4, 5)),           # vector · batch: M removed, b's batch kept
    ((2, 3, 4, 5), (5,)),           # batch · vector: N removed, folded into one product
    ((6, 5), (5, 4)),
    ((1, 1), (1, 1)),
    ((0, 5), (5, 4)), ((6, 0), (0, 4)), ((6, 5), (5, 0)),   # M, K, N = 0
    ((3, 6, 0), (3, 0, 4)),         # K = 0 with batches: zeros
    ((2, 1, 3, 4), (5, 4, 2)),      # batch dims stretched and prepended
    ((1, 3, 4), (5, 4, 2)), ((5, 3, 4), (1, 4, 2)), ((3, 4), (5, 4, 2)),
    ((0, 3, 4), (1, 4, 2)), ((1, 3, 4), (0, 4, 2)), ((2, 0, 3, 4), (1, 4, 2)),  # batch 0
    ((4, 1, 3, 4), (2, 4, 2)),      # every a-matrix used twice, every b-matrix four times
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape_a, shape_b", EDGE_SHAPES)
def test_matmul_edge_shapes(shape_a, shape_b, dtype):
    rng = np.random.default_rng(sum(shape_a) * 31 + sum(shape_b))
    a = make_values(rng, shape_a, dtype)
    b = make_values(rng, shape_b, dtype)
    out_shape = matmul_shapes(shape_a, shape_b)[0]
    dout = make_values(rng, out_shape, dtype).reshape(out_shape)      # () comes back as (1,)
    check_against_reference(a, b, dout)


@st.composite
def batched_cases(draw):
    """Fully batched a (*B, M, K), b (*B, K, N) or (K, N), and dout (*B, M, N)."""
    dtype = draw(dtypes)
    batch = draw(shapes(min_ndim=1, max_ndim=2, max_dim=4))
    m, k, n = draw(dims(12)), draw(dims(12)), draw(dims(12))
    b_batch = batch if draw(st.booleans()) else ()
    a = draw(arrays(batch + (m, k), dtype))
    b = draw(arrays(b_batch + (k, n), dtype))
    dout = draw(arrays(batch + (m, n), dtype))
    return a, b, dout


@given(case=batched_cases())
def test_batch_elements_get_the_same_bits_alone(case):
    """Each output element is reduced by one loop in one order, whatever the batch around it."""
    a, b, dout = case
    out = matmul(a, b)
    da, db = matmul_backward(dout, a, b)
    for i in np.ndindex(a.shape[:-2]):
        b_i = b[i] if b.ndim == a.ndim else b
        np.testing.assert_array_equal(matmul(a[i], b_i), out[i])
        if b.ndim == a.ndim:                # a shared b sums over the batch: no per-element db
            da_i, db_i = matmul_backward(dout[i], a[i], b_i)
            np.testing.assert_array_equal(da_i, da[i])
            np.testing.assert_array_equal(db_i, db[i])


def test_article_scores_shapes():
    """The article's scores Q·Kᵀ: Q, K (2, 5, 64) give (2, 5, 5), a 5×5 matrix per sentence."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 64)).astype(np.float32)
    k = rng.standard_normal((2, 5, 64)).astype(np.float32)
    scores = matmul(q, np.swapaxes(k, -1, -2))
    assert scores.shape == (2, 5, 5) and scores.dtype == np.float32
    dq, dkt = matmul_backward(np.ones_like(scores), q, np.swapaxes(k, -1, -2))
    assert (dq.shape, dkt.shape) == ((2, 5, 64), (2, 64, 5))
    assert dq.dtype == dkt.dtype == np.float32


def test_matmul_does_not_write_its_inputs():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((5, 2))
    dout = rng.standard_normal((3, 4, 2))
    copies = [x.copy() for x in (a, b, dout)]
    matmul(a, b)
    matmul_backward(dout, a, b)
    for x, c in zip((a, b, dout), copies):
        np.testing.assert_array_equal(x, c)


I64, F64, F32 = np.ones((2, 3), np.int64), np.ones((2, 3)), np.ones((3, 4), np.float32)


@pytest.mark.parametrize("args, error, words", [
    ((I64, np.ones((3, 4))), TypeError, ["a", "float32 or float64", "int64"]),
    ((F64, np.ones((3, 4), bool)), TypeError, ["b", "float32 or float64", "bool"]),
    ((np.ones((2, 3), np.complex128), np.ones((3, 4))), TypeError, ["a", "complex128"]),
    ((F64, np.ones((3, 4), np.float16)), TypeError, ["b", "float16"]),
    ((F64, F32), TypeError, ["b", "float64", "a", "float32"]),
    ((np.float64(2.0), np.ones(3)), ValueError, ["a", "at least 1 dimension", "()"]),
    ((np.ones(3), np.array(2.0)), ValueError, ["b", "at least 1 dimension", "()"]),
    ((F64, np.ones((4, 5))), ValueError, ["b.shape[-2]", "a.shape[-1] = 3", "(4, 5)"]),
    ((np.ones(3), np.ones(4)), ValueError, ["b.shape[0]", "a.shape[-1] = 3", "(4,)"]),
    ((np.ones((2, 2, 3)), np.ones((3, 3, 4))), ValueError,
     ["batch dims", "a", "b", "(2, 2, 3)", "(3, 3, 4)"]),
    (([[1.0, 2.0], [3.0]], np.ones(2)), TypeError, ["a"]),
    ((np.ones(2), None), TypeError, ["b", "None"]),
])
def test_matmul_rejects_bad_input(args, error, words):
    for call in (lambda: matmul_forward(*args), lambda: matmul_backward(np.ones(()), *args)):
        with pytest.raises(error) as info:
            call()
        for word in words:
            assert word in str(info.value)


@pytest.mark.parametrize("dout, a, b, error, words", [
    (np.ones((2, 5, 3)), np.ones((2, 5, 3)), np.ones((3, 4)), ValueError,
     ["dout", "(2, 5, 4)", "got (2, 5, 3)", "a (2, 5, 3)", "b (3, 4)"]),
    (np.ones((4, 2, 5)), np.ones((2, 5, 3)), np.ones((4, 1, 3, 5)), ValueError,
     ["dout", "(4, 2, 5, 5)", "got (4, 2, 5)"]),
    (np.ones(1), np.ones(3), np.ones(3), ValueError, ["dout", "()", "got (1,)"]),
    (np.ones((2, 1, 4)), np.ones(3), np.ones((2, 3, 4)), ValueError, ["dout", "(2, 4)"]),
    (np.ones((2, 4, 1)), np.ones((2, 4, 3)), np.ones(3), ValueError, ["dout", "(2, 4)"]),
    (np.ones((2, 4), np.float32), np.ones((2, 3)), np.ones((3, 4)), TypeError,
     ["dout", "float64", "float32"]),
    (np.ones((2, 4), np.int32), np.ones((2, 3)), np.ones((3, 4)), TypeError, ["dout", "int32"]),
    (None, np.ones((2, 3)), np.ones((3, 4)), TypeError, ["dout", "None"]),
])
def test_matmul_backward_rejects_bad_dout(dout, a, b, error, words):
    with pytest.raises(error) as info:
        matmul_backward(dout, a, b)
    for word in words:
        assert word in str(info.value)


def test_matmul_accepts_lists_and_keeps_dtype():
    assert matmul(np.ones(3, np.float32), np.ones((3, 2), np.float32)).dtype == np.float32
    got = matmul([1.0, 2.0], [3.0, 4.0])                   # exact in binary: 3 + 8
    assert got.shape == () and got.dtype == np.float64
    assert got == 11.0
