"""dropout_forward / dropout_backward / dropout_mask and the counter-based generator behind them.

The mask is ours alone (PyTorch draws from its own generator), so the textbook is given our
mask, and PyTorch is met where it decides independently: the fraction it keeps, the values and
gradients it produces, and the p = 0 and p = 1 edges. The generator itself is held to a
pure-Python copy of its formula, to the published SplitMix64 sequence, to binomial bounds and to
a few balance tests.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from closeness import assert_close, f64
from npattn import reference
from npattn.functional.dropout import dropout, dropout_backward, dropout_forward, dropout_mask
from npattn.kernels.dropout import BLOCK
from npattn.kernels.random import keep, keep_threshold, random_bits, seed_key
from strategies import LAYOUTS, arrays, dtypes, lay_out, shapes

# ------------------------------------------------------------------ the formula, in plain Python

MASK64 = 2**64 - 1


def py_mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def py_bits(seed, index):
    """Output ``index`` of the SplitMix64 stream whose state starts at mix64(seed)."""
    return py_mix64((py_mix64(seed) + (index + 1) * 0x9E3779B97F4A7C15) & MASK64)


def py_keep(seed, index, p):
    return (py_bits(seed, index) >> 11) >= round(p * 2**53)


def np_keep(seed, n, p):
    """py_keep for indices 0..n-1, vectorised: uint64 arrays wrap silently, as the formula does."""
    z = np.uint64(py_mix64(seed)) + (np.arange(n, dtype=np.uint64) + 1) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return ((z ^ (z >> 31)) >> 11) >= round(p * 2**53)


def kernel_bits(seed, n):
    """random_bits for indices 0..n-1, one call of the compiled function each."""
    key = np.uint64(seed_key(np.uint64(seed)))
    return np.array([random_bits(key, i) for i in range(n)], dtype=np.uint64)


seeds = st.integers(0, 2**64 - 1)
probabilities = st.one_of(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0))


@st.composite
def dropout_cases(draw, kinds=("normal", "wide", "nan")):
    """x and dout of one drawn shape (0-d and empty included), dtype and layout; p; seed."""
    dtype = draw(dtypes)
    shape = draw(shapes())
    x = draw(arrays(shape, dtype, kinds))
    dout = draw(arrays(shape, dtype, kinds))
    return x, dout, draw(probabilities), draw(seeds)


# ------------------------------------------------------------------ against the textbook

@given(case=dropout_cases())
def test_dropout_forward_matches_reference(case):
    x, _, p, seed = case
    keep_mask = dropout_mask(x.shape, p, seed)
    assert keep_mask.shape == x.shape and keep_mask.dtype == np.bool_
    got = dropout_forward(x, p, seed)
    assert_close(got, reference.dropout_forward(*f64(x), keep_mask, p), dtype=x.dtype, n=1)


@given(case=dropout_cases())
def test_dropout_backward_matches_reference(case):
    x, dout, p, seed = case
    dx = dropout_backward(dout, p, seed)
    want = reference.dropout_backward(*f64(dout), dropout_mask(x.shape, p, seed), p)
    assert_close(dx, want, dtype=x.dtype, n=1)


@given(case=dropout_cases(kinds=("normal",)))
def test_kept_values_are_scaled_in_the_input_dtype(case):
    x, _, p, seed = case
    assume(p < 1.0)
    dtype = x.dtype.type
    keep_mask = dropout_mask(x.shape, p, seed)
    got = dropout(x, p, seed)
    scale = dtype(1) / dtype(1.0 - p)                     # 1 - p in float64, as PyTorch does
    np.testing.assert_array_equal(got[keep_mask], np.asarray(x)[keep_mask] * scale)
    np.testing.assert_array_equal(got[~keep_mask], 0)


# ------------------------------------------------------------------ the mask is (seed, shape) only

@given(case=dropout_cases(kinds=("normal",)), data=st.data())
def test_mask_depends_only_on_seed_and_shape(case, data):
    x, _, p, seed = case
    mask = dropout_mask(x.shape, p, seed)
    np.testing.assert_array_equal(dropout_mask(x.shape, p, seed), mask)      # same seed, same mask
    np.testing.assert_array_equal(dropout(x, p, seed) != 0, mask)            # x has no zeros
    base = np.ascontiguousarray(x)
    want = dropout(base, p, seed)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for layout in LAYOUTS:
        np.testing.assert_array_equal(dropout(lay_out(base, layout, rng), p, seed), want)
        np.testing.assert_array_equal(dropout_backward(lay_out(base, layout, rng), p, seed), want)
    other = base.astype(np.float64 if base.dtype == np.float32 else np.float32)
    np.testing.assert_array_equal(dropout(other, p, seed) != 0, mask)        # nor on the dtype


@given(shape=st.one_of(shapes(max_ndim=3, max_dim=40), st.just((3, BLOCK + 1))),
       p=probabilities, seed=seeds)
def test_mask_is_the_formula_in_c_order(shape, p, seed):
    mask = dropout_mask(shape, p, seed)                  # up to 64 000 elements: many blocks
    want = np_keep(seed, mask.size, p)                   # element t of the C-order ravel
    np.testing.assert_array_equal(mask.ravel(order="C"), want)
    for t in range(min(mask.size, 50)):
        assert want[t] == py_keep(seed, t, p)           # the vectorised copy is the formula
    np.testing.assert_array_equal(dropout_mask(shape, np.float32(p), np.uint64(seed)),
                                  dropout_mask(shape, float(np.float32(p)), seed))


@given(seed=seeds, other=seeds, bit=st.integers(0, 63), flip=st.booleans(),
       p=st.floats(0.1, 0.9), shape=st.sampled_from([(1000,), (10, 10, 10), (3, 7, 64)]))
def test_different_seeds_give_different_masks(seed, other, bit, flip, p, shape):
    if flip:
        other = seed ^ (1 << bit)                              # the nearest seeds
    assume(other != seed)
    # Independent masks agree at one element with probability p² + (1-p)² <= 0.82, so all
    # 1000 or more elements agree with probability below 0.82**1000 < 1e-86.
    assert not np.array_equal(dropout_mask(shape, p, seed), dropout_mask(shape, p, other))


@given(p=probabilities, seed=seeds, shape=st.sampled_from([(100_000,), (4, 8, 57, 61)]))
def test_kept_fraction_is_binomial(p, seed, shape):
    mask = dropout_mask(shape, p, seed)
    n = mask.size
    kept = int(np.count_nonzero(mask))
    # 6 standard deviations of Binomial(n, 1 - p): exceeded with probability 2e-9 per example,
    # while p off by 0.01 shifts the mean by 1000 (6 sd is at most 949 at n = 100 000).
    assert abs(kept - n * (1 - p)) <= 6 * np.sqrt(n * p * (1 - p)) + 1


# ------------------------------------------------------------------ p = 0, p = 1, evaluation

@given(case=dropout_cases(), seed=seeds)
def test_p0_keeps_everything_and_p1_drops_everything(case, seed):
    x, dout, _, _ = case
    assert dropout_mask(x.shape, 0.0, seed).all()
    np.testing.assert_array_equal(dropout(x, 0.0, seed), x)               # unscaled, NaN kept
    np.testing.assert_array_equal(dropout_backward(dout, 0.0, seed), dout)
    assert not dropout_mask(x.shape, 1.0, seed).any()
    for got in (dropout(x, 1.0, seed), dropout_backward(dout, 1.0, seed)):
        assert got.dtype == x.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got, np.zeros(x.shape))             # no 0/0 NaN


@given(case=dropout_cases())
def test_evaluation_is_the_identity(case):
    x, dout, p, seed = case
    assert dropout(x, p, seed, training=False) is x                       # as PyTorch
    assert dropout_backward(dout, p, seed, training=False) is dout
    if x.size:                                          # an empty nested list loses its shape
        got = dropout(x.tolist(), p, seed, training=False)                # a list becomes an array
        assert isinstance(got, np.ndarray) and got.dtype == np.float64
        np.testing.assert_array_equal(got, x)


# ------------------------------------------------------------------ thread count

DIGEST = """
import hashlib
import numpy as np
from npattn.functional.dropout import dropout, dropout_backward, dropout_mask

def digest():
    # 3·4099·97 elements: many prange blocks, and a ragged last one
    x = np.linspace(-1.0, 1.0, 3 * 4099 * 97, dtype=np.float32).reshape(3, 4099, 97)
    parts = [dropout_mask(x.shape, 0.3, 2**64 - 12345), dropout(x, 0.3, 987654321),
             dropout_backward(x.astype(np.float64), 0.7, 5)]
    return hashlib.sha256(b"".join(a.tobytes() for a in parts)).hexdigest()
"""


def test_mask_is_the_same_at_any_thread_count():
    namespace = {}
    exec(DIGEST, namespace)
    want = namespace["digest"]()
    root = Path(__file__).resolve().parents[1]
    script = DIGEST + "import numba\nprint(numba.get_num_threads(), digest())\n"
    for threads in ("1", "3"):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads,
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        used, got = run.stdout.split()
        assert used == threads
        assert got == want


# ------------------------------------------------------------------ the generator itself

@given(seed=seeds, index=st.integers(0, 2**63 - 1), p=probabilities)
def test_generator_matches_the_python_formula(seed, index, p):
    key = seed_key(np.uint64(seed))
    assert key == py_mix64(seed)
    assert random_bits(np.uint64(key), index) == py_bits(seed, index)
    assert keep(np.uint64(key), index, keep_threshold(p)) == py_keep(seed, index, p)
    assert keep_threshold(p) == round(p * 2**53)
    top = np.uint64(py_bits(seed, index) >> 11)            # the comparison's edge: >=, not >
    assert keep(np.uint64(key), index, top) and not keep(np.uint64(key), index, top + 1)


def test_generator_is_the_splitmix64_stream():
    # The published SplitMix64 sequence for state 1234567 (Rosetta Code, "Pseudo-random
    # numbers/Splitmix64"): random_bits keyed directly by a state is that state's stream.
    published = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                 4593380528125082431, 16408922859458223821]
    assert [random_bits(np.uint64(1234567), i) for i in range(5)] == published
    assert [py_mix64((1234567 + (i + 1) * 0x9E3779B97F4A7C15) & MASK64)
            for i in range(5)] == published


def chi_square(counts):
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seed", [0, 1, 2, 2**63, 2**64 - 1])
def test_generator_bits_are_balanced(seed):
    n = 100_000
    bits = kernel_bits(seed, n)
    nxt = kernel_bits(seed + 1 if seed < MASK64 else 0, n)      # the neighbouring seed
    ones = ((bits[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)).sum(axis=0)
    # Each bit: Binomial(n, 1/2), sd = 158; 6 sd is exceeded with probability 2e-9.
    assert np.all(np.abs(ones - n / 2) <= 6 * np.sqrt(n / 4)), ones
    # Chi-square with 255 degrees of freedom (mean 255, sd 22.6): outside [150, 400] with
    # probability below 1e-7. Too uniform fails as well as too lumpy: an unmixed Weyl sequence
    # gives tiny values for single bytes and huge ones for pairs of neighbours.
    top, low = (bits >> np.uint64(56)).astype(np.int64), (bits & np.uint64(255)).astype(np.int64)
    top4 = top >> 4
    tests = {
        "top byte": np.bincount(top, minlength=256),
        "low byte": np.bincount(low, minlength=256),
        "neighbouring indices": np.bincount(top4[:-1] * 16 + top4[1:], minlength=256),
        "neighbouring seeds": np.bincount(top4 * 16 + (nxt >> np.uint64(60)).astype(np.int64),
                                          minlength=256),
    }
    for name, counts in tests.items():
        assert 150 <= chi_square(counts) <= 400, name


# ------------------------------------------------------------------ PyTorch, with its own mask

def kept_fractions_agree(keep, p, blocks=20):
    """The fraction kept -- overall, in each of ``blocks`` row blocks and in each of ``blocks``
    column blocks -- is Binomial(n, 1-p)/n: within 6 sd of 1 - p (each check fails a correct
    generator with probability 2e-9)."""
    rows, cols = keep.shape
    parts = [keep] + np.split(keep, blocks, axis=0) + np.split(keep, blocks, axis=1)
    for part in parts:
        sd = np.sqrt(p * (1 - p) / part.size)
        assert abs(part.mean() - (1 - p)) <= 6 * sd + 1e-12, (part.shape, part.mean(), 1 - p)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_dropout_matches_torch(torch, dtype, p):
    """torch.nn.functional.dropout on the same input, with PyTorch's own generator (fixed seeds):
    both keep a fraction 1 - p of the entries (binomial bounds, evenly over rows and columns);
    the values both produce from an all-ones input are exactly {0, 1/(1-p)} -- the same
    1/(1-p), bitwise -- and our backward is dout·keep·(torch's kept value), the rule torch's
    autograd applies with torch's mask. p = 0 is the identity, p = 1 all zeros, as in torch."""
    shape = (400, 500)
    tdtype = {np.float32: torch.float32, np.float64: torch.float64}[dtype]
    torch.manual_seed(20240607)
    tx = torch.ones(shape, dtype=tdtype, requires_grad=True)
    tout = torch.nn.functional.dropout(tx, p, training=True)
    dout = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    tout.backward(torch.tensor(dout))
    t_out, t_grad = tout.detach().numpy(), tx.grad.numpy()
    x = np.ones(shape, dtype)
    out = dropout(x, p, seed=12345)
    dx = dropout_backward(dout, p, seed=12345)
    assert out.dtype == dx.dtype == np.dtype(dtype)
    t_keep, keep = t_out != 0, out != 0
    if p == 0:                               # the identity: everything kept, unscaled
        assert t_keep.all() and np.array_equal(out, t_out) and np.array_equal(dx, t_grad)
        assert np.array_equal(dx, dout)
        return
    if p == 1:                               # everything dropped: zeros, and zero gradients
        assert not t_keep.any() and not keep.any()
        assert np.array_equal(out, t_out) and np.array_equal(dx, t_grad) and not dx.any()
        return
    kept_fractions_agree(t_keep, p)          # (the statistics hold for torch's mask ...)
    kept_fractions_agree(keep, p)            # (... and for ours)
    t_values, values = np.unique(t_out), np.unique(out)
    assert t_values.size == 2 and t_values[0] == 0      # torch: exactly {0, 1/(1-p)}
    assert np.array_equal(values, t_values), (values, t_values)   # ours: the same two values
    assert_close(t_values[1], 1 / (1 - p), dtype=dtype, n=2)
    scale = t_values[1]
    # torch's autograd: dout·mask·scale with its own mask; ours: the same with our mask
    assert np.array_equal(t_grad, np.where(t_keep, dout * scale, 0).astype(dtype))
    assert np.array_equal(dx, np.where(keep, dout * scale, 0).astype(dtype))
    assert np.array_equal(keep, dropout_mask(shape, p, 12345))


@given(case=dropout_cases(kinds=("normal",)), p=st.floats(0.0, 0.99))
def test_kept_values_match_torch_dropout_bitwise(torch, case, p):
    # torch's own mask differs from ours, but where both keep an entry the value is x / (1 - p)
    # computed the same way: 1 - p in float64, its reciprocal in x's dtype, one multiplication.
    x, _, _, seed = case
    torch.manual_seed(seed >> 1)
    tout = torch.nn.functional.dropout(torch.tensor(np.array(x)), p, training=True).numpy()
    both = (tout != 0) & dropout_mask(x.shape, p, seed)   # x has no zeros
    np.testing.assert_array_equal(dropout(x, p, seed)[both], tout[both])


# ------------------------------------------------------------------ bad input

BAD_P = [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
         ("0.5", TypeError), (True, TypeError), (None, TypeError)]
BAD_SEED = [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), ("1", TypeError),
            (True, TypeError), (None, TypeError)]
CALLS = {                                   # each call with one argument replaced
    "forward": lambda p=0.5, seed=0, training=True: dropout_forward([1.0], p, seed, training),
    "backward": lambda p=0.5, seed=0, training=True: dropout_backward([1.0], p, seed, training),
    "mask": lambda p=0.5, seed=0, training=True: dropout_mask((3,), p, seed),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("p, error", BAD_P)
def test_rejects_bad_p(call, p, error):
    with pytest.raises(error, match=r"^p must be"):
        CALLS[call](p=p)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("seed, error", BAD_SEED)
def test_rejects_bad_seed(call, seed, error):
    with pytest.raises(error, match=r"^seed must be an int in \[0, 2\*\*64\)"):
        CALLS[call](seed=seed)


@pytest.mark.parametrize("call", ["forward", "backward"])
@pytest.mark.parametrize("training", [1, 0, "yes", None])
def test_rejects_non_bool_training(call, training):
    with pytest.raises(TypeError, match=r"^training must be a bool"):
        CALLS[call](training=training)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.complex128, np.float16])
@pytest.mark.parametrize("training", [True, False])
def test_rejects_non_float_arrays(dtype, training):
    with pytest.raises(TypeError, match=rf"^x must have dtype float32 or float64; got "
                                        rf"{np.dtype(dtype)}"):
        dropout_forward(np.ones(3, dtype), 0.5, 0, training)
    with pytest.raises(TypeError, match=rf"^dout must have dtype float32 or float64; got "
                                        rf"{np.dtype(dtype)}"):
        dropout_backward(np.ones(3, dtype), 0.5, 0, training)


@pytest.mark.parametrize("shape, error", [((-1,), ValueError), ((2, -3), ValueError),
                                          ((2.0,), TypeError), ((True, 2), TypeError),
                                          ("ab", TypeError), (None, TypeError)])
def test_mask_rejects_bad_shape(shape, error):
    with pytest.raises(error, match=r"^shape must"):
        dropout_mask(shape, 0.5, 0)


def test_mask_takes_an_int_as_a_1d_shape():
    np.testing.assert_array_equal(dropout_mask(7, 0.5, 3), dropout_mask((7,), 0.5, 3))
    assert dropout_mask((), 0.5, 3).shape == () and dropout_mask((2, 0), 0.5, 3).shape == (2, 0)
