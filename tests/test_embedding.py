"""embedding_forward / embedding_backward against the float64 textbook and against PyTorch."""
import numba
import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import abs64, assert_close, f64
from npattn import reference
from npattn.functional.embedding import embedding, embedding_backward, embedding_forward
from npattn.kernels.embedding import embedding_backward_kernel, embedding_forward_kernel
from strategies import arrays, dims, dtypes, lay_out, layouts, shapes

INDEX_DTYPES = (np.int64, np.int32, np.int16, np.uint8, np.uint64)


@st.composite
def embedding_cases(draw, min_rows=0):
    """indices (0-d to 3-D, any integer dtype and layout), weight (V, E), padding_idx, dout.

    V is small, so indices repeat often: the scatter-add's interesting case.
    """
    dtype = draw(dtypes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_rows, width = draw(dims(12, min_rows)), draw(dims(20))
    index_shape = draw(shapes(max_ndim=3, max_dim=7))
    if n_rows == 0 and np.prod(index_shape) > 0:       # no row to pick: only empty indices
        index_shape = (0,) + index_shape[1:] if index_shape else (0,)
    raw = rng.integers(0, max(n_rows, 1), size=index_shape)
    indices = lay_out(np.asarray(raw).astype(draw(st.sampled_from(INDEX_DTYPES))),
                      draw(layouts), rng)
    weight = draw(arrays((n_rows, width), dtype, ("normal", "wide")))
    padding_idx = draw(st.none() | st.integers(-n_rows, n_rows - 1)) if n_rows else None
    dout = draw(arrays(tuple(index_shape) + (width,), dtype, ("normal", "wide")))
    return indices, weight, padding_idx, dout


def max_count(indices, n_rows):
    """How many indices the most-used row has: the length of its sum."""
    return int(np.bincount(np.ravel(indices).astype(np.int64), minlength=n_rows).max(initial=0))


# ------------------------------------------------------------------ against the textbook

@given(case=embedding_cases())
def test_forward_matches_reference(case):
    indices, weight, padding_idx, _ = case
    got = embedding_forward(indices, weight, padding_idx)
    want = reference.embedding_forward(np.asarray(indices), f64(weight)[0], padding_idx)
    assert got.dtype == weight.dtype and got.shape == np.shape(indices) + weight.shape[1:]
    np.testing.assert_array_equal(got, want)              # a gather: exact


@given(case=embedding_cases())
def test_backward_matches_reference(case):
    indices, weight, padding_idx, dout = case              # dout random: repeats add up
    got = embedding_backward(dout, indices, weight, padding_idx)
    idx = np.asarray(indices)
    want = reference.embedding_backward(f64(dout)[0], idx, weight, padding_idx)
    scale = reference.embedding_backward(abs64(dout)[0], idx, weight, padding_idx)
    assert_close(got, want, dtype=weight.dtype, n=max_count(idx, weight.shape[0]), scale=scale)


def test_reference_backward_by_finite_differences():
    """d/dweight of Σ dout ∘ weight[indices], numerically: the textbook's scatter-add is the
    gradient (the forward is linear, so central differences are exact up to rounding)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, 3))
    indices = np.array([[0, 3, 3], [4, 3, 0]])
    dout = rng.standard_normal((2, 3, 3))
    h = 1e-6
    numeric = np.zeros_like(weight)
    for i in np.ndindex(weight.shape):
        plus, minus = weight.copy(), weight.copy()
        plus[i] += h
        minus[i] -= h
        numeric[i] = (np.sum(dout * reference.embedding_forward(indices, plus))
                      - np.sum(dout * reference.embedding_forward(indices, minus))) / (2 * h)
    np.testing.assert_allclose(reference.embedding_backward(dout, indices, weight), numeric,
                               rtol=1e-7, atol=1e-8)
    assert np.all(numeric[[1, 2]] == 0) and np.all(numeric[3] != 0)   # unused rows, a repeat


# ------------------------------------------------------------------ against PyTorch

@given(case=embedding_cases())
def test_matches_torch(torch, case):
    indices, weight, padding_idx, dout = case
    tw = torch.tensor(f64(weight)[0], requires_grad=True)
    tidx = torch.tensor(np.asarray(indices).astype(np.int64))
    tout = torch.nn.functional.embedding(tidx, tw, padding_idx=padding_idx)
    tout.backward(torch.tensor(f64(dout)[0]))
    got = embedding(indices, weight, padding_idx)
    np.testing.assert_array_equal(got, tout.detach().numpy())
    scale = reference.embedding_backward(abs64(dout)[0], np.asarray(indices), weight, padding_idx)
    assert_close(embedding_backward(dout, indices, weight, padding_idx), tw.grad.numpy(),
                 dtype=weight.dtype, n=max_count(indices, weight.shape[0]), scale=scale)


# ------------------------------------------------------------------ the edge cases, one by one

def serial_scatter_add(dout, indices, n_rows, padding_idx=None):
    """The serial loop in dout's own dtype: dweight[indices[p]] += dout[p], p in C order."""
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = np.zeros((n_rows, dout.shape[-1]), dout.dtype)
    for p, v in enumerate(np.ravel(indices)):
        dweight[v] += rows[p]                 # one float add per entry, in the dtype
    if padding_idx is not None:
        dweight[padding_idx] = 0
    return dweight


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_indices_sum_in_index_order_at_any_thread_count(dtype):
    """Thousands of indices into a few rows: the scatter-add gives the bits of the serial loop
    in index order, at 1 and 2 threads. Float addition is not associative and these values
    span decades, so another order -- a race, per-thread partial sums -- gives other bits
    (checked below, so this test can fail; a racy kernel failed it when planted)."""
    rng = np.random.default_rng(1)
    n_rows, width = 7, 256                                 # enough work that threads overlap
    indices = rng.integers(0, n_rows, size=(40, 500))      # ~2900 repeats of each row
    dout = (rng.standard_normal((40, 500, width)) * 10.0 ** rng.integers(-3, 4, (40, 500, 1)))
    dout = dout.astype(dtype)
    weight = np.zeros((n_rows, width), dtype)
    want = serial_scatter_add(dout, indices, n_rows, padding_idx=2)
    reordered = serial_scatter_add(dout[::-1, ::-1], indices[::-1, ::-1], n_rows, padding_idx=2)
    halves = (serial_scatter_add(dout[:20], indices[:20], n_rows, padding_idx=2)   # two threads'
              + serial_scatter_add(dout[20:], indices[20:], n_rows, padding_idx=2))  # partials
    assert not np.array_equal(want, reordered)             # the order shows in the bits
    assert not np.array_equal(want, halves)
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), threads}):
            numba.set_num_threads(n)
            got = embedding_backward(dout, indices, weight, padding_idx=2)
            np.testing.assert_array_equal(got, want)
    finally:
        numba.set_num_threads(threads)
    assert np.all(want[2] == 0) and np.all(want[[0, 1, 3, 4, 5, 6]] != 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_padding_idx(dtype):
    """The padding row is looked up as any other but gets no gradient; -1 is the last row."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((6, 4)).astype(dtype)
    indices = np.array([[5, 0, 5], [1, 5, 0]])
    dout = rng.standard_normal((2, 3, 4)).astype(dtype)
    plain = embedding_backward(dout, indices, weight)
    for padding_idx in (5, -1):
        np.testing.assert_array_equal(embedding(indices, weight, padding_idx), weight[indices])
        dweight = embedding_backward(dout, indices, weight, padding_idx)
        assert np.all(dweight[5] == 0) and np.all(plain[5] != 0)
        np.testing.assert_array_equal(dweight[:5], plain[:5])
    assert_close(plain[5], dout[0, 0].astype(np.float64) + dout[0, 2] + dout[1, 1],
                 dtype=dtype, n=3, scale=np.abs(f64(dout)[0]).sum(axis=(0, 1)))
    np.testing.assert_array_equal(plain[[2, 3, 4]], 0)    # rows nobody picked


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_and_0d(dtype):
    """Empty indices, E = 0, V = 0 (then indices must be empty) and a 0-d index."""
    weight = np.arange(12, dtype=dtype).reshape(4, 3)
    for shape in ((0,), (2, 0), (0, 5)):
        idx = np.zeros(shape, np.int64)
        out = embedding(idx, weight)
        assert out.shape == shape + (3,) and out.dtype == dtype
        dweight = embedding_backward(np.ones(shape + (3,), dtype), idx, weight)
        assert dweight.shape == (4, 3) and dweight.dtype == dtype and np.all(dweight == 0)
    wide0 = np.zeros((4, 0), dtype)
    assert embedding([[1, 2]], wide0).shape == (1, 2, 0)
    assert embedding_backward(np.zeros((1, 2, 0), dtype), [[1, 2]], wide0).shape == (4, 0)
    none = np.zeros((0, 3), dtype)
    assert embedding(np.zeros(0, np.int64), none).shape == (0, 3)
    assert embedding_backward(np.zeros((0, 3), dtype), np.zeros(0, np.int64), none).shape == (0, 3)
    out = embedding(np.int64(2), weight)                   # a 0-d index: one row
    np.testing.assert_array_equal(out, weight[2])
    dweight = embedding_backward(np.array([1.0, 2.0, 3.0], dtype), np.array(2), weight)
    np.testing.assert_array_equal(dweight, np.eye(4, dtype=dtype)[2][:, None] * [1, 2, 3])


def test_layouts_and_readonly_inputs():
    """Strided, reversed, Fortran-ordered and read-only inputs, and lists of ints."""
    rng = np.random.default_rng(3)
    weight = np.asfortranarray(rng.standard_normal((9, 5)))
    weight.flags.writeable = False
    indices = rng.integers(0, 9, (8, 6)).astype(np.int32)[::2, ::-2]   # (4, 3), strided
    indices.flags.writeable = False
    dout = rng.standard_normal((5, 3, 4)).transpose(2, 1, 0)          # (4, 3, 5), transposed
    np.testing.assert_array_equal(embedding(indices, weight), np.asarray(weight)[indices])
    assert_close(embedding_backward(dout, indices, weight),
                 reference.embedding_backward(dout, indices, weight), dtype=np.float64,
                 n=max_count(indices, 9), scale=reference.embedding_backward(np.abs(dout),
                                                                             indices, weight))
    np.testing.assert_array_equal(embedding([[0, 8]], weight), np.asarray(weight)[[[0, 8]]])
    frozen = np.ascontiguousarray(indices, dtype=np.int64)     # read-only int64, C order
    frozen.flags.writeable = False
    embedding_backward(dout, frozen, weight)
    embedding(frozen, weight)                            # (ROWS indices or fewer: serial twin)
    many = np.tile(frozen.ravel(), 10)                   # past ROWS: the parallel kernel
    many.flags.writeable = False
    embedding(many, weight)
    for k in (embedding_forward_kernel, embedding_backward_kernel):   # one signature per dtype:
        seen = [t for sig in k.signatures + k.serial_signatures        # never read-only
                for t in sig if hasattr(t, "layout")]
        assert seen and all(t.layout == "C" and t.mutable for t in seen), k.signatures
    assert embedding is embedding_forward


def test_kernels_never_index_out_of_bounds():
    """The functional layer rejects bad indices; the kernels, called directly with them anyway,
    skip them (forward: a zero row; backward: no contribution) instead of reading elsewhere."""
    weight = np.arange(8.0).reshape(4, 2)
    indices = np.array([1, -1, 4, 2**40, 3], np.int64)
    out = np.full((5, 2), np.nan)
    embedding_forward_kernel(indices, weight, out)
    np.testing.assert_array_equal(out, [[2, 3], [0, 0], [0, 0], [0, 0], [6, 7]])
    dweight = np.full((4, 2), np.nan)
    embedding_backward_kernel(np.ones((5, 2)), indices, -1, dweight)
    np.testing.assert_array_equal(dweight, [[0, 0], [1, 1], [0, 0], [1, 1]])


# ------------------------------------------------------------------ bad input

W = np.ones((5, 3))


@pytest.mark.parametrize("args, error, words", [
    ((np.array([0.0, 1.0]), W), TypeError, ["indices", "integer", "float64"]),
    ((np.array([True, False]), W), TypeError, ["indices", "integer", "bool"]),
    (([1.5], W), TypeError, ["indices", "integer", "float64"]),
    ((None, W), TypeError, ["indices", "None"]),
    ((np.array([0, 5]), W), ValueError, ["indices", "[0, 5)", "got 5", "(1,)"]),
    ((np.array([[0, 1], [-1, 2]]), W), ValueError, ["indices", "[0, 5)", "got -1", "(1, 0)"]),
    ((np.array([2**63], np.uint64), W), ValueError, ["indices", str(2**63)]),
    ((np.array(7), W), ValueError, ["indices", "got 7"]),
    ((np.array([0]), np.ones((5, 3), np.int64)), TypeError, ["weight", "int64"]),
    ((np.array([0]), np.ones((5, 3), np.float16)), TypeError, ["weight", "float16"]),
    ((np.array([0]), np.ones(5)), ValueError, ["weight", "(num_embeddings, embedding_dim)",
                                               "(5,)"]),
    ((np.array([0]), np.ones((5, 3, 1))), ValueError, ["weight", "(5, 3, 1)"]),
    ((np.array([0]), W, 5), ValueError, ["padding_idx", "[-5, 5)", "got 5"]),
    ((np.array([0]), W, -6), ValueError, ["padding_idx", "[-5, 5)", "got -6"]),
    ((np.array([0]), W, 1.0), TypeError, ["padding_idx", "int", "float"]),
    ((np.array([0]), W, True), TypeError, ["padding_idx", "int", "bool"]),
])
def test_rejects_bad_input(args, error, words):
    for call in (lambda: embedding(*args),
                 lambda: embedding_backward(np.ones(np.shape(args[0]) + (3,)), *args)):
        with pytest.raises(error) as info:
            call()
        for word in words:
            assert word in str(info.value)


@pytest.mark.parametrize("dout, error, words", [
    (np.ones((2, 3), np.float32), TypeError, ["dout", "float64", "float32"]),
    (np.ones((2, 4)), ValueError, ["dout", "(2, 3)", "(2, 4)"]),
    (np.ones((3,)), ValueError, ["dout", "(2, 3)", "(3,)"]),
    (np.ones((2, 3), np.int64), TypeError, ["dout", "int64"]),
])
def test_backward_rejects_bad_dout(dout, error, words):
    with pytest.raises(error) as info:
        embedding_backward(dout, np.array([0, 4]), W)
    for word in words:
        assert word in str(info.value)
