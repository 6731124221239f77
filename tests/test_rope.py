"""rotary_embedding (RoPE) forward and backward against the float64 textbook and PyTorch, both
pair layouts; nn.RotaryEmbedding's tables, offsets and the relative-position property with
the attention engine; bad input."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import npattn
from closeness import assert_close, f64
from npattn import nn, reference
from npattn.functional import rotary
from npattn.functional.rotary import (rotary_embedding, rotary_embedding_backward,
                                      rotary_embedding_forward)
from strategies import arrays, dims, dtypes, lay_out, shapes

pytestmark = pytest.mark.kernel        # the attention test runs the engine: every tile in CI

KINDS = ("normal", "wide", "huge", "tiny", "nan")


@st.composite
def tables(draw, length, h, dtype):
    """cos θ, sin θ (L, h) of random angles (several turns), in drawn layouts."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    theta = rng.uniform(-20.0, 20.0, (length, h))
    return tuple(lay_out(np.ascontiguousarray(t, dtype), draw(st.sampled_from(
        ("contiguous", "fortran", "transposed", "sliced", "negative", "readonly"))), rng)
        for t in (np.cos(theta), np.sin(theta)))


@st.composite
def rope_cases(draw, kinds=KINDS):
    """x (..., L, E) with leading dims 0 and 1 included, L 0 and 1 included, E = 2h even (2
    included, and some long rows), a random dout, tables, both layouts of the pairs."""
    dtype = draw(dtypes)
    lead = draw(shapes(max_ndim=2, max_dim=4))
    length = draw(dims(6))
    h = draw(st.one_of(st.integers(1, 5), st.integers(6, 40)))
    shape = lead + (length, 2 * h)
    x = draw(arrays(shape, dtype, kinds))
    dout = draw(arrays(shape, dtype, ("normal", "wide")))
    cos, sin = draw(tables(length, h, dtype))
    return x, dout, cos, sin, draw(st.booleans())


def term_scale(x, cos, sin, interleaved):
    """|a|·|cos| + |b|·|sin| in each output's slot: the magnitude of its two terms."""
    ax, ac, s = np.abs(f64(x)[0]), np.abs(f64(cos)[0]), np.abs(f64(sin)[0])
    with np.errstate(invalid="ignore"):
        return np.maximum(reference.rotary_embedding_forward(ax, ac, s, interleaved),
                          reference.rotary_embedding_backward(ax, ac, s, interleaved))


# ------------------------------------------------------------------ against the textbook

@given(case=rope_cases())
def test_forward_matches_reference(case):
    x, _, cos, sin, interleaved = case
    got = rotary_embedding_forward(x, cos, sin, interleaved)
    want = reference.rotary_embedding_forward(*f64(x, cos, sin), interleaved)
    assert_close(got, want, dtype=x.dtype, n=2, scale=term_scale(x, cos, sin, interleaved))


@given(case=rope_cases())
def test_backward_matches_reference(case):
    x, dout, cos, sin, interleaved = case           # dout random: ones hide bugs
    got = rotary_embedding_backward(x, cos, sin, interleaved)
    want = reference.rotary_embedding_backward(*f64(x, cos, sin), interleaved)
    assert_close(got, want, dtype=x.dtype, n=2, scale=term_scale(x, cos, sin, interleaved))
    got = rotary_embedding_backward(dout, cos, sin, interleaved=interleaved)
    want = reference.rotary_embedding_backward(*f64(dout, cos, sin), interleaved)
    assert_close(got, want, dtype=x.dtype, n=2, scale=term_scale(dout, cos, sin, interleaved))


@given(case=rope_cases())
def test_same_bits_as_the_formula_in_the_input_dtype(case):
    """Each product rounded, then the sum, in x's dtype (no fused multiply-add): NumPy's bits
    for a·c − b·s, serial twin or parallel kernel alike."""
    x, dout, cos, sin, interleaved = case
    np.testing.assert_array_equal(rotary_embedding(x, cos, sin, interleaved),
                                  reference.rotary_embedding_forward(x, cos, sin, interleaved))
    np.testing.assert_array_equal(rotary_embedding_backward(dout, cos, sin, interleaved),
                                  reference.rotary_embedding_backward(dout, cos, sin,
                                                                      interleaved))


@given(case=rope_cases(kinds=("normal", "wide", "huge", "tiny")))
def test_rotation_by_minus_theta_inverts_the_forward(case):
    """backward(forward(x)) = R(−θ)·R(θ)·x = x, up to rounding relative to each pair's norm."""
    x, _, cos, sin, interleaved = case
    back = rotary_embedding_backward(rotary_embedding(x, cos, sin, interleaved), cos, sin,
                                     interleaved)
    x64 = f64(x)[0]
    a, b = reference._rotary_pairs(x64, interleaved)
    norm = np.empty_like(x64)
    na, nb = reference._rotary_pairs(norm, interleaved)
    na[...] = nb[...] = np.abs(a) + np.abs(b)
    assert_close(back, x64, dtype=x.dtype, n=6, scale=norm)


def test_the_reference_is_the_documented_formula():
    """Hugging Face's LLaMA (rotate_half) and GPT-J (rotate_every_two) code, transcribed to
    NumPy, against the textbook: halves and interleaved pairs are those models' layouts."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 8))
    theta = rng.uniform(-5, 5, (5, 4))
    cos, sin = np.cos(theta), np.sin(theta)
    rotate_half = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    llama = x * np.concatenate([cos, cos], -1) + rotate_half * np.concatenate([sin, sin], -1)
    np.testing.assert_allclose(reference.rotary_embedding_forward(x, cos, sin), llama,
                               rtol=1e-15, atol=1e-15)
    every_two = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    gptj = x * np.repeat(cos, 2, -1) + every_two * np.repeat(sin, 2, -1)
    np.testing.assert_allclose(reference.rotary_embedding_forward(x, cos, sin, True), gptj,
                               rtol=1e-15, atol=1e-15)
    assert not np.allclose(llama, gptj)               # the layouts differ


def test_reference_backward_by_finite_differences():
    rng = np.random.default_rng(5)
    x, dout = rng.standard_normal((2, 3, 4, 6))
    theta = rng.uniform(-5, 5, (4, 3))
    cos, sin = np.cos(theta), np.sin(theta)
    h = 1e-6
    for interleaved in (False, True):
        numeric = np.empty_like(x)
        for j in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[j] += h
            down[j] -= h
            numeric[j] = np.sum(dout * (reference.rotary_embedding_forward(up, cos, sin,
                                                                           interleaved)
                                        - reference.rotary_embedding_forward(down, cos, sin,
                                                                             interleaved))) / (2 * h)
        np.testing.assert_allclose(reference.rotary_embedding_backward(dout, cos, sin,
                                                                       interleaved),
                                   numeric, rtol=1e-7, atol=1e-9)


def test_large_arrays_cover_several_blocks():
    """More elements than one prange block (the parallel kernel, not the serial twin): every
    row written, the position of row r is r mod L, a NaN poisons only its pair."""
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((3, 4, 50, 64)).astype(dtype)
        x[1, 2, 7, 5] = np.nan
        theta = rng.uniform(-9, 9, (50, 32))
        cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
        assert x.size > rotary.BLOCK
        for interleaved in (False, True):
            y = rotary_embedding(x, cos, sin, interleaved)
            np.testing.assert_array_equal(y, reference.rotary_embedding_forward(x, cos, sin,
                                                                                interleaved))
            partner = 5 + 32 if not interleaved else 4
            assert np.isnan(y).sum() == 2 and np.isnan(y[1, 2, 7, [5, partner]]).all()


# ------------------------------------------------------------------ against PyTorch

def torch_rotary(torch, x, cos, sin, interleaved):
    """The rotation in PyTorch ops (Hugging Face's rotate_half, GPT-J's every-two layout)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * torch.cat([cos, cos], -1) + rotated * torch.cat([sin, sin], -1)


@given(case=rope_cases(kinds=("normal", "wide", "tiny", "nan")))
def test_matches_torch(torch, case):
    """Forward against the formula in torch ops, dx against torch's autograd of it."""
    x, dout, cos, sin, interleaved = case
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    tc, ts = torch.tensor(f64(cos)[0]), torch.tensor(f64(sin)[0])
    ty = torch_rotary(torch, tx, tc, ts, interleaved)
    ty.backward(torch.tensor(f64(dout)[0]))
    assert_close(rotary_embedding(x, cos, sin, interleaved), ty.detach().numpy(),
                 dtype=x.dtype, n=2, scale=term_scale(x, cos, sin, interleaved))
    assert_close(rotary_embedding_backward(dout, cos, sin, interleaved), tx.grad.numpy(),
                 dtype=x.dtype, n=2, scale=term_scale(dout, cos, sin, interleaved))


# ------------------------------------------------------------------ nn.RotaryEmbedding

def direct_tables(dim, max_len, base):
    """cos and sin of θ[p, k] = p·base^(−2k/dim), one Python float at a time."""
    theta = [[p * base ** (-2 * k / dim) for k in range(dim // 2)] for p in range(max_len)]
    return (np.array([[math.cos(t) for t in row] for row in theta]).reshape(max_len, dim // 2),
            np.array([[math.sin(t) for t in row] for row in theta]).reshape(max_len, dim // 2),
            np.array(theta).reshape(max_len, dim // 2))


@given(dim=st.integers(1, 12).map(lambda n: 2 * n), max_len=dims(40),
       base=st.sampled_from([10000.0, 500000.0, 2.0, 1.0]), dtype=dtypes)
def test_module_tables_are_the_float64_formula_rounded_once(dim, max_len, base, dtype):
    m = nn.RotaryEmbedding(dim, max_len, base, dtype=dtype)
    want_cos, want_sin, theta = direct_tables(dim, max_len, base)
    exact = nn.RotaryEmbedding(dim, max_len, base, dtype=np.float64)
    for got, want in ((exact.cos, want_cos), (exact.sin, want_sin)):
        assert got.shape == (max_len, dim // 2) and got.dtype == np.float64
        # θ itself is rounded (pos·inv_freq, inv_freq = base^(...)): a few ulps of θ
        np.testing.assert_allclose(got, want, rtol=0, atol=8e-16 * (1 + theta.max(initial=0)))
    np.testing.assert_array_equal(m.cos, exact.cos.astype(dtype))      # float64, rounded once
    np.testing.assert_array_equal(m.sin, exact.sin.astype(dtype))
    assert m.cos.dtype == m.sin.dtype == np.dtype(dtype)
    assert dict(m.named_buffers()).keys() == {"cos", "sin"} and not m.parameters()
    assert not m.state_dict()                        # not persistent: fixed by the arguments
    np.testing.assert_array_equal(m.to(np.float64).cos, exact.cos)     # computed again


@given(case=rope_cases(kinds=("normal", "wide")), offset=st.integers(0, 5), data=st.data())
def test_module_uses_the_rows_at_offset(case, offset, data):
    x, dout, _, _, interleaved = case
    dim, length = x.shape[-1], x.shape[-2]
    max_len = offset + length + data.draw(st.integers(0, 3))
    m = nn.RotaryEmbedding(dim, max_len, interleaved=interleaved, dtype=x.dtype)
    rows = slice(offset, offset + length)
    y = m(x, offset=offset) if offset or data.draw(st.booleans()) else m(x)
    np.testing.assert_array_equal(y, rotary_embedding(x, m.cos[rows], m.sin[rows], interleaved))
    np.testing.assert_array_equal(m.backward(dout), rotary_embedding_backward(
        dout, m.cos[rows], m.sin[rows], interleaved))


@given(seed=st.integers(0, 2**32 - 1), dtype=dtypes, interleaved=st.booleans(),
       split=st.integers(0, 7))
def test_decoding_at_an_offset_rotates_as_the_whole_sequence(seed, dtype, interleaved, split):
    """A KV cache's prefill (positions 0..P−1) and the next rows (offset P) give the rows of
    one call on the whole sequence, bit for bit."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 7, 16)).astype(dtype)
    m = nn.RotaryEmbedding(16, 7, interleaved=interleaved, dtype=dtype)
    whole = m(x)
    parts = np.concatenate([m(x[..., :split, :]), m(x[..., split:, :], offset=split)], axis=-2)
    np.testing.assert_array_equal(parts, whole)


@given(seed=st.integers(0, 2**32 - 1), interleaved=st.booleans(), base=st.sampled_from(
    [10000.0, 100.0]), i=st.integers(0, 40), j=st.integers(0, 40), shift=st.integers(1, 20))
def test_scores_depend_on_relative_positions_only(seed, interleaved, base, i, j, shift):
    """q_rot(i)·k_rot(j) = q_rot(i + t)·k_rot(j + t): the score sees i − j, not i and j."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, 32))
    m = nn.RotaryEmbedding(32, 64, base, interleaved, dtype=np.float64)

    def score(pi, pj):
        return float(m(q, offset=pi)[0] @ m(k, offset=pj)[0])

    tol = 64 * np.finfo(np.float64).eps * np.sum(np.abs(q) * np.abs(k).max()) * (1 + 64)
    assert abs(score(i, j) - score(i + shift, j + shift)) <= tol
    # the premise: the shift moved the rotated vectors themselves (the check is not empty)
    assert not np.allclose(m(q, offset=i), m(q, offset=i + shift))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_causal_attention_with_rope_is_shift_invariant(dtype, interleaved):
    """The module before scaled_dot_product_attention: queries and keys rotated at positions
    t..t + L − 1 give the same attention output for every t (up to rounding), as the scores
    depend on i − j only. A learned-position-free model can therefore decode at any offset."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 4, 20, 32)).astype(dtype) for _ in range(3))
    m = nn.RotaryEmbedding(32, 200, interleaved=interleaved, dtype=np.float64)

    def attend(t):
        rq = m(q.astype(np.float64), offset=t).astype(dtype)
        rk = m(k.astype(np.float64), offset=t).astype(dtype)
        return npattn.scaled_dot_product_attention(rq, rk, v, is_causal=True)

    base = attend(0)
    eps = np.finfo(dtype).eps
    for t in (1, 17, 150):
        shifted = attend(t)
        assert not np.allclose(m(q.astype(np.float64), offset=t), m(q.astype(np.float64)))
        # rounding the rotated q, k to dtype moves each score by ~eps·|q||k|, exp by as much
        assert np.max(np.abs(shifted - base)) <= 200 * eps * np.abs(v).max()
    without = npattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert np.max(np.abs(without - base)) > 1e3 * 200 * eps   # the rotation changed something


# ------------------------------------------------------------------ bad input

def test_bad_input_names_the_argument(monkeypatch):
    """Each raises before any kernel runs (the kernel is replaced by one that fails)."""
    def no_kernel(*args):
        raise AssertionError("a kernel ran")
    no_kernel.serial = no_kernel
    monkeypatch.setattr(rotary, "rotary_kernel", no_kernel)
    x = np.ones((2, 3, 4), np.float32)
    c = np.ones((3, 2), np.float32)
    cases = [
        ((np.ones((2, 3, 5), np.float32), c, c), ValueError,
         r"x must have an even last dim E \(pairs of entries are rotated\); got shape \(2, 3, 5\)"),
        ((x, np.ones((3, 4), np.float32), c), ValueError,
         r"cos must have shape \(3, 2\) \(L, E/2\) to match x \(\.\.\., 3, 4\); got \(3, 4\)"),
        ((x, c, np.ones((2, 2), np.float32)), ValueError,
         r"sin must have shape \(3, 2\) \(L, E/2\) to match x \(\.\.\., 3, 4\); got \(2, 2\)"),
        ((x, c, np.ones((1, 3, 2), np.float32)), ValueError, r"sin must have shape \(3, 2\)"),
        ((x, c.astype(np.float64), c), TypeError,
         "cos must have dtype float32 to match x; got float64"),
        ((x, c, c.astype(np.float64)), TypeError,
         "sin must have dtype float32 to match x; got float64"),
        ((x.astype(np.int64), c, c), TypeError, "x must have dtype float32 or float64; got int64"),
        ((x.astype(np.float16), c, c), TypeError, "x must have dtype float32 or float64; got "
                                                  "float16"),
        ((None, c, c), TypeError, "x must be a float32 or float64 array; got None"),
        ((np.ones(4, np.float32), c, c), ValueError,
         r"x must have at least 2 dimensions \(\.\.\., L, E\); got shape \(4,\)"),
        ((x, c.astype(np.int32), c), TypeError, "cos must have dtype float32 or float64; got int32"),
        ((x, c, None), TypeError, "sin must be a float32 or float64 array; got None"),
        ((x, [[1.0], [1.0, 2.0]], c), TypeError, "cos must be .*; got list that NumPy cannot "
                                                 "convert"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            rotary_embedding(*args)
        dout_message = message.replace("x must", "dout must").replace("match x", "match dout")
        with pytest.raises(error, match=dout_message):
            rotary_embedding_backward(*args)
    for flag in (1, None, "yes", 0.0):
        with pytest.raises(TypeError, match=f"interleaved must be a bool; got {type(flag).__name__}"):
            rotary_embedding(x, c, c, flag)
        with pytest.raises(TypeError, match="interleaved must be a bool"):
            rotary_embedding_backward(x, c, c, interleaved=flag)


def test_module_bad_input_names_the_argument():
    f32 = np.ones((2, 5, 8), np.float32)
    for make, error, message in [
            (lambda: nn.RotaryEmbedding(7, 4), ValueError, "dim must be even .*; got 7"),
            (lambda: nn.RotaryEmbedding(0, 4), ValueError, "dim must be an int >= 2; got 0"),
            (lambda: nn.RotaryEmbedding(8.0, 4), TypeError, "dim must be an int; got float"),
            (lambda: nn.RotaryEmbedding(8, -1), ValueError, "max_len must be an int >= 0; got -1"),
            (lambda: nn.RotaryEmbedding(8, 4, base=0.0), ValueError,
             "base must be a finite real number > 0; got 0.0"),
            (lambda: nn.RotaryEmbedding(8, 4, base=math.nan), ValueError, "base .*; got nan"),
            (lambda: nn.RotaryEmbedding(8, 4, base="1e4"), TypeError, "base .*; got str"),
            (lambda: nn.RotaryEmbedding(8, 4, interleaved=1), TypeError,
             "interleaved must be a bool; got int"),
            (lambda: nn.RotaryEmbedding(8, 4, dtype=np.int32), TypeError,
             "dtype must be float32 or float64; got int32")]:
        with pytest.raises(error, match=message):
            make()
    m = nn.RotaryEmbedding(8, 6)
    with pytest.raises(RuntimeError, match="RotaryEmbedding.backward was called before forward"):
        m.backward(f32)
    for args, kwargs, error, message in [
            ((f32,), dict(offset=2), ValueError,
             r"offset \+ L must be at most max_len = 6 \(x has L = 5 positions, dim -2\); got "
             r"offset = 2, offset \+ L = 7"),
            ((np.ones((7, 8), np.float32),), {}, ValueError, r"offset \+ L .* got offset = 0, "
                                                              r"offset \+ L = 7"),
            ((f32,), dict(offset=-1), ValueError, "offset must be an int >= 0; got -1"),
            ((f32,), dict(offset=1.0), TypeError, "offset must be an int >= 0; got float"),
            ((f32,), dict(offset=None), TypeError, "offset must be an int >= 0; got NoneType"),
            ((f32.astype(np.float64),), {}, TypeError,
             "x must have dtype float32 to match RotaryEmbedding's parameters; got float64"),
            ((f32.astype(np.int64),), {}, TypeError, "x must have dtype float32 or float64; got "
                                                     "int64"),
            ((f32[..., :6],), {}, ValueError,
             r"x must have shape \(\.\.\., L, 8\) to match RotaryEmbedding's dim; got \(2, 5, 6\)"),
            ((f32[0, 0],), {}, ValueError, r"x must have at least 2 dimensions"),
    ]:
        with pytest.raises(error, match=message):
            m(*args, **kwargs)
    m(f32, offset=1)
    for dout, error, message in [
            (f32[:, :4], ValueError, r"dout must have shape \(\.\.\., 5, 8\) to match the last "
                                     r"forward's x \(\.\.\., 5, 8\); got \(2, 4, 8\)"),
            (f32.astype(np.float64), TypeError, "dout must have dtype float32"),
            (f32[0, 0], ValueError, "dout must have at least 2 dimensions")]:
        with pytest.raises(error, match=message):
            m.backward(dout)
    assert m.backward(np.ones((3, 1, 5, 8), np.float32)).shape == (3, 1, 5, 8)   # other heads


@given(shape=shapes(min_ndim=2, max_ndim=4, max_dim=4), dtype=dtypes, interleaved=st.booleans())
def test_results_have_the_input_shape_and_dtype_and_inputs_are_untouched(shape, dtype,
                                                                         interleaved):
    shape = shape[:-1] + (2 * shape[-1],)
    rng = np.random.default_rng(0)
    x = np.asarray(rng.standard_normal(shape), dtype)
    theta = rng.standard_normal((shape[-2], shape[-1] // 2))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    keep = [a.copy() for a in (x, cos, sin)]
    y = rotary_embedding(x, cos, sin, interleaved)
    dx = rotary_embedding_backward(x, cos, sin, interleaved)
    for r in (y, dx):
        assert r.shape == x.shape and r.dtype == x.dtype
        assert r.flags.c_contiguous and not np.shares_memory(r, x)
    for a, b in zip((x, cos, sin), keep):
        assert np.array_equal(a, b)
    assert rotary_embedding is rotary_embedding_forward
    assert npattn.rotary_embedding is rotary_embedding
    if x.size:
        lists = rotary_embedding(x.tolist(), cos.astype(np.float64).tolist(),
                                 sin.astype(np.float64).tolist())
        assert lists.dtype == np.float64


@pytest.mark.parametrize("interleaved", [False, True])
def test_module_gradients_match_central_differences(interleaved):
    from npattn.gradcheck import gradcheck_module
    rng = np.random.default_rng(2)
    m = nn.RotaryEmbedding(6, 9, base=100.0, interleaved=interleaved, dtype=np.float64)
    report = gradcheck_module(m, (rng.standard_normal((2, 4, 6)),), seed=1)
    assert report.ok, report
