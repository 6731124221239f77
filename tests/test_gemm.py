"""The GEMM engine itself: every operand form, batch index, bias and accumulate mode, at sizes
around its tile edges (MR and NR of the tiles in force, KC), on all its paths -- against
float64 NumPy; and every register tile against every other.

The linear and matmul tests prove the engine through the public ops; these reach the corners
those ops rarely hit (a K block boundary, a one-row edge strip, accumulate with bias).
"""
import contextlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close
from npattn import _jit
from npattn.kernels import _lane_max_generate, tiles
from npattn.kernels.linear import column_sum_kernel
from strategies import dtypes, make_values
from test_jit import run_python

pytestmark = pytest.mark.kernel        # run again under each register tile in CI


def engine(dtype):
    """The GEMM engine instance of dtype's tile in force."""
    return tiles.engine("gemm", dtype)


def edges(*blocks):
    """Sizes just below, at and above each block size (and its double), and 0, 1, 2."""
    return sorted({0, 1, 2} | {n * b + d for b in blocks for n in (1, 2) for d in (-1, 0, 1)})


IN_FORCE = [engine(d) for d in tiles.DTYPES]
EDGE = edges(*{e.MR for e in IN_FORCE}, *{e.NR for e in IN_FORCE})      # row and column tiles
K_EDGE = edges(IN_FORCE[0].KC) + [5, 300]                              # K blocks


@st.composite
def gemm_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(dtypes)
    m = draw(st.sampled_from(EDGE) | st.integers(0, 70))
    n = draw(st.sampled_from(EDGE) | st.integers(0, 70))
    k = draw(st.sampled_from(K_EDGE) | st.integers(0, 40))
    trans_a, trans_b = draw(st.sampled_from([(False, False), (False, True), (True, False)]))
    stored_a, stored_b = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n_batch = draw(st.integers(1, 4))
    a_index = rng.integers(0, stored_a, n_batch).astype(np.int64)
    b_index = rng.integers(0, stored_b, n_batch).astype(np.int64)
    a = make_values(rng, (stored_a,) + ((k, m) if trans_a else (m, k)), dtype)
    b = make_values(rng, (stored_b,) + ((n, k) if trans_b else (k, n)), dtype)
    bias = draw(st.none() | st.just(make_values(rng, (n,), dtype)))
    accumulate = draw(st.booleans())
    c = make_values(rng, (n_batch, m, n), dtype)
    path = draw(st.sampled_from(list(PATHS)))
    return a, b, c, bias, a_index, b_index, trans_a, trans_b, accumulate, path


def truth(a, b, c, bias, a_index, b_index, trans_a, trans_b, accumulate):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    op_a = np.swapaxes(a64, -1, -2) if trans_a else a64
    op_b = np.swapaxes(b64, -1, -2) if trans_b else b64
    want = op_a[a_index] @ op_b[b_index]
    scale = np.abs(op_a[a_index]) @ np.abs(op_b[b_index])
    if bias is not None:
        want, scale = want + bias, scale + np.abs(bias)
    if accumulate:
        want, scale = want + c, scale + np.abs(c)
    return want, scale


#: Forcing each of the engine's kernels: (SMALL, BATCHED, PACKED_SMALL, SERIAL_PACKED,
#: ONE_LAUNCH_ROWS, ONE_LAUNCH_B, KEPT_SPACE)
NAMES = ("SMALL", "BATCHED", "PACKED_SMALL", "SERIAL_PACKED", "ONE_LAUNCH_ROWS",
         "ONE_LAUNCH_B", "KEPT_SPACE")
_NEVER = (1 << 62, -1)                                  # (ONE_LAUNCH_ROWS, ONE_LAUNCH_B): off
_KEPT = IN_FORCE[0].KEPT_SPACE
PATHS = {
    "auto": tuple(getattr(IN_FORCE[0], name) for name in NAMES),
    "packed": (0, 1 << 30, -1, -1, *_NEVER, _KEPT),    # gemm_kernel: B packed a K block at a time
    "batched": (0, 0, -1, -1, *_NEVER, _KEPT),         # batched_gemm_kernel: an item per C[t]
    "rows": (0, 1 << 30, -1, -1, 0, -1, _KEPT),         # an item per thread's rows, kept space
    "own": (0, 1 << 30, -1, -1, 0, -1, -1),             # the same, each item's own buffer
    "serial": (0, 1 << 30, 1 << 62, 1 << 62, *_NEVER, _KEPT),   # its serial twin
}


@contextlib.contextmanager
def forced(path):
    """Force one of the engine's kernels (for each dtype's instance); the thresholds are
    restored afterwards."""
    instances = [engine(d) for d in tiles.DTYPES]
    saved = [tuple(getattr(e, name) for name in NAMES) for e in instances]
    for e in instances:
        for name, value in zip(NAMES, PATHS[path]):
            setattr(e, name, value)
    try:
        yield
    finally:
        for e, values in zip(instances, saved):
            for name, value in zip(NAMES, values):
                setattr(e, name, value)


def run_gemm(a, b, c, bias, a_index, b_index, trans_a, trans_b, accumulate):
    got = c.copy()
    engine(c.dtype).gemm(a, b, got, bias=bias, a_index=a_index, b_index=b_index, trans_a=trans_a,
                trans_b=trans_b, accumulate=accumulate)
    return got


@given(case=gemm_cases())
def test_gemm_matches_float64(case):
    *args, path = case
    with forced(path):
        got = run_gemm(*args)
    a, b, c, bias, a_index, b_index, trans_a, trans_b, accumulate = args
    want, scale = truth(*args)
    k = b.shape[2] if trans_b else b.shape[1]
    assert_close(got, want, dtype=a.dtype, n=k + 2, scale=scale)


@given(case=gemm_cases())
def test_packed_and_batched_kernels_give_the_same_bits(case):
    """The engine picks a kernel by the shapes and the thread count -- all of B packed a K
    block at a time, an item per output batch, an item per thread's share of the rows (each
    packing B into its slot of the kept space, or into a buffer of its own), or that on the
    calling thread; all sum in the same order, so which one ran never shows in the result."""
    *args, _ = case
    results = {}
    for path in ("packed", "batched", "rows", "own", "serial"):
        with forced(path):
            results[path] = run_gemm(*args)
    for path, got in results.items():
        np.testing.assert_array_equal(got, results["packed"], err_msg=path)


@given(case=gemm_cases())
def test_row_sums_are_those_of_the_bias_gradient_on_every_path(case):
    """row_sums (how linear_backward gets its bias gradient during the weight gradient's
    product): each row's Σ_k op(A)[i, k], summed from the packed A blocks on every path, gives
    the bits of column_sum_kernel on op(A)ᵀ (the bias gradient's own kernel: blocks of 64 k's
    summed apart), and leaves C's bits as they are without it."""
    *args, path = case
    a, b, c, bias, a_index, b_index, trans_a, trans_b, accumulate = args
    if c.shape[2] == 0 and (c.shape[1] and (b.shape[2] if trans_b else b.shape[1])):
        return                                          # (no columns: nothing is packed)
    sums = np.full(c.shape[:2], np.nan, c.dtype)
    with forced(path):
        plain = run_gemm(*args)
        got = c.copy()
        engine(c.dtype).gemm(a, b, got, bias=bias, a_index=a_index, b_index=b_index,
                             trans_a=trans_a, trans_b=trans_b, accumulate=accumulate,
                             row_sums=sums)
    np.testing.assert_array_equal(got, plain)
    for t in range(c.shape[0]):
        op_a = a[a_index[t]].T if trans_a else a[a_index[t]]              # (M, K)
        want = np.empty(op_a.shape[0], c.dtype)
        column_sum_kernel(np.ascontiguousarray(op_a.T), want)
        np.testing.assert_array_equal(sums[t], want, err_msg=f"batch {t}")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("trans_a", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_sums_over_several_k_blocks(dtype, trans_a, path):
    """The row sums go on across K blocks: each block's rows of op(A) are summed at its own
    k's (three blocks and a partial one here, and an edge strip of rows) -- the case a drawn
    product of the test above reaches too rarely to rely on."""
    e = engine(dtype)
    rng = np.random.default_rng(11)
    m, k, n = 2 * e.MR + 1, 2 * e.KC + 5, e.NR + 3
    a = make_values(rng, (1, k, m) if trans_a else (1, m, k), dtype)
    b = make_values(rng, (1, k, n), dtype)
    c, sums = np.empty((1, m, n), dtype), np.full((1, m), np.nan, dtype)
    with forced(path):
        e.gemm(a, b, c, trans_a=trans_a, row_sums=sums)
    want = np.empty(m, dtype)
    column_sum_kernel(np.ascontiguousarray(a[0] if trans_a else a[0].T), want)
    np.testing.assert_array_equal(sums[0], want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_and_packed_paths_agree_on_the_linear_form(dtype):
    """The unpacked small path and the packed path compute the same A·Bᵀ (up to rounding)."""
    rng = np.random.default_rng(5)
    a, b = make_values(rng, (37, 129), dtype), make_values(rng, (21, 129), dtype)
    small, packed = np.empty((37, 21), dtype), np.empty((37, 21), dtype)
    engine(dtype).gemm(a, b, small, trans_b=True)
    with forced("packed"):
        engine(dtype).gemm(a, b, packed, trans_b=True)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.T.astype(np.float64))
    assert_close(small, a.astype(np.float64) @ b.T.astype(np.float64), dtype=dtype, n=129,
                 scale=scale)
    assert_close(packed, small.astype(np.float64), dtype=dtype, n=2 * 129, scale=scale)


@given(dtype=dtypes, rows=st.integers(1, 5), cols=st.integers(1, 70), inner=st.integers(1, 300),
       split=st.sampled_from([4, 8, 64, None]), serial=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_small_products_give_the_same_bits_however_the_columns_are_split(
        dtype, rows, cols, inner, split, serial, seed):
    """small_dot_kernel's work items own blocks of columns (a multiple of 4, or all of them:
    ``None`` here), and its callers choose the block by the shapes and whether it runs on the
    calling thread; every element is the same sum whichever item computes it."""
    rng = np.random.default_rng(seed)
    small = engine(dtype).small_dot_kernel
    a, b = make_values(rng, (1, rows, inner), dtype), make_values(rng, (1, cols, inner), dtype)
    bias, one = make_values(rng, (cols,), dtype), np.zeros(1, np.int64)
    whole, split_c = np.empty((1, rows, cols), dtype), np.empty((1, rows, cols), dtype)
    small.serial(a, b, whole, bias, one, one, False, cols)
    (small.serial if serial else small)(a, b, split_c, bias, one, one, False, split or cols)
    np.testing.assert_array_equal(split_c, whole)


@given(dtype=dtypes, m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 300),
       trans=st.sampled_from([(False, False), (False, True), (True, False)]),
       short=st.floats(0.0, 0.99), items=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_packing_space_too_small_is_never_written_past(dtype, m, n, k, trans, short, items, seed):
    """The packing kernels take their space from the caller (gemm sizes it); given less than
    they need -- a slice of a larger buffer here -- they pack into a buffer of their own, never
    past the slice's end, and give the product's bits all the same."""
    e = engine(dtype)
    rng = np.random.default_rng(seed)
    trans_a, trans_b = trans
    a = make_values(rng, (1,) + ((k, m) if trans_a else (m, k)), dtype)
    b = make_values(rng, (1,) + ((n, k) if trans_b else (k, n)), dtype)
    want = np.empty((1, m, n), dtype)
    with forced("packed"):
        e.gemm(a, b, want, trans_a=trans_a, trans_b=trans_b)
    one = np.zeros(1, np.int64)
    bias, sums = e.NO_BIAS[np.dtype(dtype)], e.NO_SUMS[np.dtype(dtype)]
    item_rows = e.MR * -(-m // (e.MR * items))              # `items` items of whole strips
    mc = min(e.MC_MAX, item_rows)
    n_items = -(-m // item_rows)
    needs = {"gemm_kernel": -(-n // e.NR) * e.KC * e.NR,
             "batched_gemm_kernel": n_items * int(e.item_space(n, mc))}
    for name, need in needs.items():
        sentinel = dtype(1234.5)
        big = np.full(need + 4 * e.KC * e.NR, sentinel, dtype)
        space = big[:int(need * short)]
        got = np.empty((1, m, n), dtype)
        common = (a, b, got, bias, sums, one, one, trans_a, trans_b, False, mc)
        if name == "gemm_kernel":
            e.gemm_kernel(*common, space)
        else:
            e.batched_gemm_kernel(*common, item_rows, space)
        assert (big[space.shape[0]:] == sentinel).all(), f"{name} wrote past its space"
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_nan_and_inf_propagate_through_the_packed_path():
    a = np.ones((20, 300), np.float32)
    b = np.ones((300, 40), np.float32)
    a[3, 7] = np.nan
    b[9, 5] = np.inf
    c = np.empty((20, 40), np.float32)
    engine(c.dtype).gemm(a, b, c)
    assert np.isnan(c[3]).all()
    assert np.isinf(c[np.arange(20) != 3, 5]).all()
    assert np.isfinite(np.delete(np.delete(c, 3, 0), 5, 1)).all()


def test_generated_lane_maxima_are_up_to_date():
    """_lane_max.py is what the generator writes now, for every width the kernels use."""
    assert _lane_max_generate.main(["--check"]) == 0
    proc = subprocess.run([sys.executable, "-m", "npattn.kernels._lane_max_generate", "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "up to date" in proc.stdout


def test_slp_vectoriser_is_on_after_import():
    assert _jit.slp_enabled()


def test_kernels_compiled_without_slp_never_enter_the_cache(tmp_path):
    """Numba's cache does not key on the SLP setting: with SLP off, npattn compiles without
    the cache, so a slow kernel can never be served to a process that has SLP."""
    code = """
        import numpy as np, npattn
        x = np.ones((64, 300), np.float32)      # gemm_kernel: past PACKED_SMALL, few rows
        w = np.ones((300, 2048), np.float32)    # and a K block of B past ONE_LAUNCH_B
        npattn.matmul(x, w)
        print(npattn._jit.slp_enabled())
    """
    cache = tmp_path / "cache"
    off = run_python(code, NUMBA_SLP_VECTORIZE="0", NUMBA_CACHE_DIR=str(cache))
    assert off.strip() == "False"
    # the loop, its work items (compiled apart, _jit.ItemKernel) and the serial kernels
    # they call (the register tile is an intrinsic inside block_product: vector_tile.py)
    kernels = ("gemm_kernel", "rows_item", "pack_item", "block_product")
    assert not [p.name for p in cache.rglob("*.nb[ic]")], "SLP-off kernel was cached"
    on = run_python(code, NUMBA_CACHE_DIR=str(cache))
    assert on.strip() == "True"
    for name in kernels:
        assert [p for p in cache.rglob(f"*.{name}*-*")], f"SLP-on {name} was not cached"


@given(dtype=dtypes, rows=st.integers(1, 5), cols=st.integers(1, 70), inner=st.integers(1, 300),
       seed=st.integers(0, 2**32 - 1))
def test_a_row_alone_gives_the_bits_it_has_in_a_pair(dtype, rows, cols, inner, seed):
    """small_dot_kernel computes a row alone (a decoded token's, an odd last row) in 1×8
    blocks and a pair of rows in 2×4 blocks: the same k loops, so every row of a product has
    the same bits as that row computed alone, with the serial twin or split among items."""
    rng = np.random.default_rng(seed)
    small = engine(dtype).small_dot_kernel
    a, b = make_values(rng, (1, rows, inner), dtype), make_values(rng, (1, cols, inner), dtype)
    bias, one = make_values(rng, (cols,), dtype), np.zeros(1, np.int64)
    whole = np.empty((1, rows, cols), dtype)
    small.serial(a, b, whole, bias, one, one, False, cols)
    for i in range(rows):
        alone = np.empty((1, 1, cols), dtype)
        small(a[:, i:i + 1], b, alone, bias, one, one, False, 4)
        np.testing.assert_array_equal(alone[0, 0], whole[0, i])
