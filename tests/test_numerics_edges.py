"""Numerics at the edges: what softmax, log_softmax, cross_entropy, attention (forward and
backward), layer_norm, gelu and rotary_embedding give for logits of ±1e30, rows whose every entry is -inf, rows with a
single finite entry, denormal inputs, float32 values whose float32 sum would overflow, and NaN.

Each test checks the result the op's docstring states ("Edge cases"): exactly where it is exact
(a one-hot row, a zero gradient, a -inf), against the float64 reference (``npattn.reference``)
within ``closeness``' dtype-scaled tolerance otherwise, in float32 and float64.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import abs64, assert_close, f64
from npattn import reference
from npattn.functional.attention import (LSE_EXACT, attention, attention_backward,
                                         scaled_dot_product_attention,
                                         scaled_dot_product_attention_backward,
                                         scaled_dot_product_attention_forward)
from npattn.functional.cross_entropy import cross_entropy_backward, cross_entropy_forward
from npattn.functional.gelu import gelu_backward, gelu_forward
from npattn.functional.rotary import rotary_embedding_backward, rotary_embedding_forward
from npattn.functional.layer_norm import layer_norm_backward, layer_norm_forward
from npattn.functional.softmax import (log_softmax_backward, log_softmax_forward,
                                       softmax_backward, softmax_forward)
from strategies import dtypes

seeds = st.integers(0, 2**32 - 1)
F32 = np.dtype(np.float32)
FLOAT32_NORMAL_MIN = float(np.finfo(np.float32).tiny)    # 1.2e-38: float32 exp's floor
#: magnitudes of subnormal numbers: float32's subnormals end at 1.2e-38, float64's at 2.2e-308
DENORMAL = {np.dtype(np.float32): 1e-40, np.dtype(np.float64): 1e-310}
FORWARD = {"softmax": softmax_forward, "log_softmax": log_softmax_forward}
BACKWARD = {"softmax": softmax_backward, "log_softmax": log_softmax_backward}
ops = st.sampled_from(["softmax", "log_softmax"])


def rows_of(rng, n, c, dtype, scale=1.0):
    return (rng.standard_normal((n, c)) * scale).astype(dtype)


def textbook(op, x):
    """The float64 reference of softmax/log_softmax along the last axis of x's float64 copy."""
    return getattr(reference, op + "_forward")(f64(x)[0], -1)


# ------------------------------------------------------------------ softmax and log_softmax

@given(op=ops, dtype=dtypes, n=st.integers(1, 4), c=st.integers(1, 40), seed=seeds)
def test_logits_of_1e30_are_exact_enough(op, dtype, n, c, seed):
    """Subtracting the row max keeps every exp in [0, 1]: logits of ±1e30 give the float64
    reference's result, with no inf or NaN, and a gradient to match."""
    rng = np.random.default_rng(seed)
    x = (rng.choice([-1.0, 1.0], (n, c)) * rng.uniform(0.5, 1.5, (n, c)) * 1e30).astype(dtype)
    got = FORWARD[op](x)
    want = textbook(op, x)
    assert np.all(np.isfinite(got))
    assert_close(got, want, dtype=dtype, n=c, scale=np.abs(f64(x)[0]).max(axis=-1, keepdims=True))
    dout = rows_of(rng, n, c, dtype)
    dx = BACKWARD[op](dout, got)
    want_dx = getattr(reference, op + "_backward")(*f64(dout, got), -1)
    assert_close(dx, want_dx, dtype=dtype, n=c, scale=np.abs(f64(dout)[0]).sum(-1, keepdims=True))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_row_of_plus_and_minus_1e30(dtype):
    x = np.array([[1e30, -1e30, 0.0], [1e30, 1e30, -1e30]], dtype)
    assert np.array_equal(softmax_forward(x), np.array([[1, 0, 0], [0.5, 0.5, 0]], dtype))
    assert_close(log_softmax_forward(x), textbook("log_softmax", x), dtype=dtype, n=3,
                 scale=2e30)
    assert log_softmax_forward(x)[0, 0] == 0          # the max: x - m - log 1, exactly


@given(op=ops, dtype=dtypes, n=st.integers(1, 6), c=st.integers(1, 40), seed=seeds)
def test_fully_masked_rows_give_zeros_minus_inf_and_zero_gradients(op, dtype, n, c, seed):
    """A row of -inf: softmax 0, log_softmax -inf (PyTorch: NaN), both gradients 0 for any dout
    -- the rule PyTorch's scaled_dot_product_attention follows since 2.5. Other rows, with
    some -inf entries, match the reference."""
    rng = np.random.default_rng(seed)
    x = rows_of(rng, n, c, dtype, 3.0)
    x[rng.random((n, c)) < 0.3] = -np.inf
    masked = rng.random(n) < 0.5
    x[masked] = -np.inf
    out = FORWARD[op](x)
    fill = 0.0 if op == "softmax" else -np.inf
    assert np.all(out[masked] == fill)
    assert_close(out[~masked], textbook(op, x[~masked]), dtype=dtype, n=c)
    dout = rows_of(rng, n, c, dtype, 1e3)
    dx = BACKWARD[op](dout, out)
    assert np.all(dx[masked] == 0)


@given(op=ops, dtype=dtypes, n=st.integers(1, 6), c=st.integers(1, 40), seed=seeds,
       kind=st.sampled_from(["normal", "1e30", "-1e30", "denormal"]))
def test_a_single_finite_entry_is_one_hot_with_zero_softmax_gradient(op, dtype, n, c, seed,
                                                                      kind):
    """A row with one finite entry j (of any size): softmax is exactly one-hot and its
    gradient exactly 0; log_softmax is exactly 0 at j and -inf elsewhere, and its gradient
    dout - onehot·Σ dout is exactly dout at the -inf entries."""
    rng = np.random.default_rng(seed)
    value = {"normal": rng.standard_normal(n), "1e30": np.full(n, 1e30),
             "-1e30": np.full(n, -1e30), "denormal": np.full(n, DENORMAL[np.dtype(dtype)])}[kind]
    j = rng.integers(0, c, n)
    x = np.full((n, c), -np.inf, dtype)
    x[np.arange(n), j] = value
    onehot = np.zeros((n, c), bool)
    onehot[np.arange(n), j] = True
    out = FORWARD[op](x)
    dout = rows_of(rng, n, c, dtype)
    dx = BACKWARD[op](dout, out)
    if op == "softmax":
        assert np.array_equal(out, onehot.astype(dtype))
        assert np.all(dx == 0)
    else:
        assert np.array_equal(out, np.where(onehot, 0, -np.inf).astype(dtype))
        assert np.array_equal(dx[~onehot], dout[~onehot])
        want = reference.log_softmax_backward(*f64(dout, out), -1)
        assert_close(dx, want, dtype=dtype, n=c, scale=np.abs(f64(dout)[0]).sum(-1, keepdims=True))


@given(op=ops, dtype=dtypes, n=st.integers(1, 4), c=st.integers(1, 40), seed=seeds)
def test_denormal_inputs(op, dtype, n, c, seed):
    """Subnormal logits are ordinary small numbers: softmax ≈ 1/C per entry, log_softmax
    ≈ -log C, as the reference; no NaN, and finite gradients for subnormal dout too."""
    rng = np.random.default_rng(seed)
    tiny = DENORMAL[np.dtype(dtype)]
    x = (rng.uniform(-1, 1, (n, c)) * tiny).astype(dtype)
    assert np.any((x != 0) & (np.abs(x) < np.finfo(dtype).tiny))   # really subnormal
    out = FORWARD[op](x)
    assert_close(out, textbook(op, x), dtype=dtype, n=c)
    dx = BACKWARD[op]((rng.uniform(-1, 1, (n, c)) * tiny).astype(dtype), out)
    assert np.all(np.isfinite(dx))


def test_float32_softmax_flushes_probabilities_below_the_normal_range():
    """kernels/exp.py's float32 exp returns 0 below 1.2e-38 (no subnormal results): softmax
    of [0, -88] is exactly [1, 0] in float32, where the truth is [1, 6.05e-39] -- an absolute
    error below 1.2e-38. float64 keeps it; log_softmax needs no exp for it and keeps -88."""
    x = np.array([0.0, -88.0])
    truth = reference.softmax_forward(x)
    assert 0 < truth[1] < FLOAT32_NORMAL_MIN
    got32 = softmax_forward(x.astype(np.float32))
    assert np.array_equal(got32, np.array([1, 0], np.float32))
    assert abs(float(got32[1]) - truth[1]) < FLOAT32_NORMAL_MIN
    assert_close(softmax_forward(x), truth, dtype=np.float64, n=2)
    assert log_softmax_forward(x.astype(np.float32))[1] == np.float32(-88.0)


@given(op=ops, n=st.integers(1, 4), c=st.integers(2, 40), seed=seeds)
def test_float32_rows_near_float32_max(op, n, c, seed):
    """Values up to 3.3e38, where a plain float32 sum of the row would overflow: softmax is
    the reference's (every exp <= 1, so the sum is <= C); log_softmax is the reference's
    rounded to float32 -- -inf where x - max < -3.4e38, a value float32 cannot hold."""
    rng = np.random.default_rng(seed)
    x = rng.choice([3.3e38, 3e38, 1e38, 0.0, -1e38, -3e38], (n, c)).astype(np.float32)
    got = FORWARD[op](x)
    want = textbook(op, x)
    if op == "log_softmax":
        with np.errstate(over="ignore"):
            want = want.astype(np.float32).astype(np.float64)
    assert_close(got, want, dtype=np.float32, n=c, scale=np.abs(want[np.isfinite(want)]).max(
        initial=1.0))


@given(op=ops, dtype=dtypes, n=st.integers(2, 6), c=st.integers(1, 40), seed=seeds,
       poison=st.sampled_from([np.nan, np.inf]))
def test_nan_and_plus_inf_reach_exactly_their_rows(op, dtype, n, c, seed, poison):
    """A NaN, or a +inf (inf - inf = NaN, as in PyTorch), makes its whole row NaN -- forward
    and, through dout, backward -- and leaves every other row bitwise unchanged."""
    rng = np.random.default_rng(seed)
    x = rows_of(rng, n, c, dtype)
    bad = rng.random(n) < 0.5
    dirty = x.copy()
    dirty[bad, rng.integers(0, c)] = poison
    clean_out, out = FORWARD[op](x), FORWARD[op](dirty)
    assert np.all(np.isnan(out[bad]))
    assert np.array_equal(out[~bad], clean_out[~bad])
    dout = rows_of(rng, n, c, dtype)
    dirty_dout = dout.copy()
    dirty_dout[bad, rng.integers(0, c)] = np.nan
    clean_dx, dx = BACKWARD[op](dout, clean_out), BACKWARD[op](dirty_dout, clean_out)
    assert np.all(np.isnan(dx[bad]))
    assert np.array_equal(dx[~bad], clean_dx[~bad])


def test_plus_inf_row_is_nan_as_in_pytorch(torch):
    x = np.array([np.inf, 0.0, 1.0])
    want = torch.softmax(torch.tensor(x), 0).numpy()
    assert np.all(np.isnan(want)) and np.all(np.isnan(softmax_forward(x)))


# ------------------------------------------------------------------ cross_entropy

def ce_reference(x, target, **kw):
    return reference.cross_entropy_forward(f64(x)[0], target, **kw)


@given(dtype=dtypes, n=st.integers(1, 5), c=st.integers(1, 30), seed=seeds)
def test_cross_entropy_of_1e30_logits(dtype, n, c, seed):
    """Log-softmax and NLL fused in float64: logits of ±1e30 give the reference's loss (up to
    ~1e30 itself when the target is far below the max) and gradient p - onehot."""
    rng = np.random.default_rng(seed)
    x = (rng.choice([-1.0, 1.0], (n, c)) * rng.uniform(0.5, 1.5, (n, c)) * 1e30).astype(dtype)
    t = rng.integers(0, c, n)
    loss = cross_entropy_forward(x, t, reduction="none")
    want = ce_reference(x, t, reduction="none")
    assert_close(loss, want, dtype=dtype, n=c, scale=np.abs(f64(x)[0]).max(axis=-1))
    grad = cross_entropy_backward(np.ones(n, dtype), x, t, reduction="none")
    want_grad = reference.cross_entropy_backward(np.ones(n), f64(x)[0], t, reduction="none")
    assert_close(grad, want_grad, dtype=dtype, n=c)


@given(dtype=dtypes, n=st.integers(2, 6), c=st.integers(1, 30), seed=seeds)
def test_cross_entropy_of_a_row_of_minus_inf_is_nan_as_in_pytorch(dtype, n, c, seed):
    """Its log-softmax is NaN (0/0), as torch.log_softmax's: that row's loss and gradient are
    NaN, the others untouched, and "mean"/"sum" NaN. Ignored, the row is never read: 0."""
    rng = np.random.default_rng(seed)
    x = rows_of(rng, n, c, dtype)
    x[0] = -np.inf
    t = rng.integers(0, c, n)
    loss = cross_entropy_forward(x, t, reduction="none")
    assert np.isnan(loss[0]) and np.all(np.isfinite(loss[1:]))
    assert np.isnan(cross_entropy_forward(x, t)) and np.isnan(cross_entropy_forward(
        x, t, reduction="sum"))
    grad = cross_entropy_backward(np.ones(n, dtype), x, t, reduction="none")
    assert np.all(np.isnan(grad[0])) and np.all(np.isfinite(grad[1:]))
    t_ignored = t.copy()
    t_ignored[0] = -100
    assert cross_entropy_forward(x, t_ignored, reduction="none")[0] == 0
    assert np.isfinite(cross_entropy_forward(x, t_ignored))
    assert np.all(cross_entropy_backward(np.array(1, dtype), x, t_ignored)[0] == 0)


def test_cross_entropy_row_of_minus_inf_matches_pytorch(torch):
    x = np.array([[-np.inf, -np.inf], [0.5, 1.0]])
    t = np.array([0, 1])
    want = torch.nn.functional.cross_entropy(torch.tensor(x), torch.tensor(t),
                                             reduction="none").numpy()
    assert np.isnan(want[0]) and np.isnan(cross_entropy_forward(x, t, reduction="none")[0])
    assert_close(cross_entropy_forward(x, t, reduction="none")[1], want[1], dtype=np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", [0.5, 1e30, -1e30, 1e-40])
def test_cross_entropy_with_a_single_finite_logit(dtype, value):
    """Target on the finite logit: p_t = 1, loss exactly 0, gradient exactly 0. Target on a -inf
    logit: p_t = 0, loss +inf (as PyTorch), gradient exactly -1 there and +1 at the finite one."""
    x = np.array([[-np.inf, value, -np.inf]], dtype)
    on, off = np.array([1]), np.array([2])
    assert cross_entropy_forward(x, on, reduction="none")[0] == 0
    assert np.all(cross_entropy_backward(np.ones(1, dtype), x, on, reduction="none") == 0)
    assert cross_entropy_forward(x, off, reduction="none")[0] == np.inf
    grad = cross_entropy_backward(np.ones(1, dtype), x, off, reduction="none")
    assert np.array_equal(grad, np.array([[0, 1, -1]], dtype))


@given(dtype=dtypes, n=st.integers(1, 5), c=st.integers(1, 30), seed=seeds)
def test_cross_entropy_of_denormal_logits(dtype, n, c, seed):
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, (n, c)) * DENORMAL[np.dtype(dtype)]).astype(dtype)
    t = rng.integers(0, c, n)
    loss = cross_entropy_forward(x, t, reduction="none")
    assert_close(loss, np.full(n, np.log(c)), dtype=dtype, n=c)
    grad = cross_entropy_backward(np.ones(n, dtype), x, t, reduction="none")
    assert_close(grad, reference.cross_entropy_backward(np.ones(n), f64(x)[0], t,
                                                        reduction="none"), dtype=dtype, n=c)


@given(n=st.integers(1, 5), c=st.integers(2, 30), seed=seeds)
def test_cross_entropy_of_float32_logits_near_float32_max(n, c, seed):
    """float64 inside: logits up to 3.3e38 (whose float32 sum overflows) give the reference's
    loss rounded to float32 -- inf only where the true loss itself exceeds float32's max."""
    rng = np.random.default_rng(seed)
    x = rng.choice([3.3e38, 3e38, 1e38, 0.0, -1e38, -3e38], (n, c)).astype(np.float32)
    t = rng.integers(0, c, n)
    with np.errstate(over="ignore"):
        want = ce_reference(x, t, reduction="none").astype(np.float32)
    assert_close(cross_entropy_forward(x, t, reduction="none"), want, dtype=np.float32, n=c,
                 scale=np.abs(want[np.isfinite(want)]).max(initial=1.0))
    grad = cross_entropy_backward(np.ones(n, np.float32), x, t, reduction="none")
    assert_close(grad, reference.cross_entropy_backward(np.ones(n), f64(x)[0], t,
                                                        reduction="none"), dtype=np.float32, n=c)


@given(dtype=dtypes, n=st.integers(2, 6), c=st.integers(1, 30), seed=seeds)
def test_cross_entropy_nan_reaches_exactly_its_row(dtype, n, c, seed):
    rng = np.random.default_rng(seed)
    x = rows_of(rng, n, c, dtype)
    t = rng.integers(0, c, n)
    dirty = x.copy()
    bad = rng.random(n) < 0.5
    dirty[bad, rng.integers(0, c)] = np.nan
    clean, loss = (cross_entropy_forward(a, t, reduction="none") for a in (x, dirty))
    assert np.all(np.isnan(loss[bad])) and np.array_equal(loss[~bad], clean[~bad])
    grad = cross_entropy_backward(np.ones(n, dtype), dirty, t, reduction="none")
    assert np.all(np.isnan(grad[bad]))
    assert np.array_equal(grad[~bad], cross_entropy_backward(np.ones(n, dtype), x, t,
                                                             reduction="none")[~bad])


# ------------------------------------------------------------------ attention

@st.composite
def attention_cases(draw, max_keys=40):
    """(q, k, v, dout, rng) of shapes (B, H, L, E) etc., small, ordinary values."""
    dtype = draw(dtypes)
    rng = np.random.default_rng(draw(seeds))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    length, keys = draw(st.integers(1, 6)), draw(st.integers(1, max_keys))
    width, vwidth = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    q = rng.standard_normal((b, h, length, width)).astype(dtype)
    k = rng.standard_normal((b, h, keys, width)).astype(dtype)
    v = rng.standard_normal((b, h, keys, vwidth)).astype(dtype)
    dout = rng.standard_normal((b, h, length, vwidth)).astype(dtype)
    return q, k, v, dout, rng


def sdpa_reference(dout, q, k, v, mask, scale=None):
    """Float64 output, logsumexp and gradients (dq, dk, dv, dmask) of the reference."""
    args = f64(q, k, v)
    m = mask if mask is None or mask.dtype == np.bool_ else f64(mask)[0]
    out, lse = reference.scaled_dot_product_attention_forward(*args, m, scale=scale)
    grads = reference.scaled_dot_product_attention_backward(f64(dout)[0], *args, m, scale=scale)
    return out, lse, grads


def attention_sizes(q, k, v, dout):
    """closeness' (n, scale) for output and gradients: the reduction lengths and magnitudes."""
    mag = float(np.abs(f64(q)[0]).max() * np.abs(f64(k)[0]).max() * q.shape[-1])
    vmax, dmax = float(np.abs(f64(v)[0]).max()), float(np.abs(f64(dout)[0]).max())
    n = k.shape[-2] * max(q.shape[-1], v.shape[-1])
    return n, vmax, (1 + mag) * vmax * dmax * v.shape[-1] * (1 + np.abs(f64(k)[0]).max())


def gradient_bounds(dout, q, k, v, mask):
    """closeness' (n, scale) for dq, dk, dv and a float mask's dmask, entry by entry.

    The classical bound, term by term (the float64 weights P of the reference): a score is a
    dot product of E terms of total size t = scale·|q_i|·|k_j|, so each weight carries a
    relative error of about eps·(E·max t + S) (the exp, the row max and the row sum of S
    terms); a huge mask entry is exact and cancels in s - max, so it adds nothing. Then
    dv = Pᵀ·dout sums L terms of size P·|dout|; dS = P∘(dout·vᵀ - D) has terms of size
    P_ij·(A_ij + Σ_j P_ij·A_ij) with A = |dout|·|v|ᵀ (Ev products each); dq = scale·dS·k and
    dk = scale·dSᵀ·q sum S and L of those times |k| or |q|; dmask sums dS over B·H. n adds the
    lengths of the chains an entry goes through; scale is the sum of the magnitudes of its terms
    -- so the bound is eps × a few hundred × O(|gradient terms|), not × their product.
    """
    do_, q_, k_, v_ = abs64(dout, q, k, v)
    s = 1 / np.sqrt(q.shape[-1])
    (b, h, length, width), keys, vwidth = q.shape, k.shape[-2], v.shape[-1]
    qf, kf = f64(q, k)
    scores = s * (qf @ np.swapaxes(kf, -1, -2)) + (0 if mask is None else f64(mask)[0])
    probs = reference.softmax_forward(scores, -1)
    terms = s * (q_ @ np.swapaxes(k_, -1, -2))           # |score terms|, without the mask
    n = 4 + 2 * (keys + length) + width + vwidth + b * h + width * float(terms.max())
    a = do_ @ np.swapaxes(v_, -1, -2)                    # |dout_i|·|v_j|   (B, H, L, S)
    ds = probs * (a + np.sum(probs * a, axis=-1, keepdims=True))
    return n, (s * (ds @ k_), s * (np.swapaxes(ds, -1, -2) @ q_),
               np.swapaxes(probs, -1, -2) @ do_, ds.sum(axis=(0, 1)))


@given(case=attention_cases())
def test_attention_scores_of_1e30(case):
    """A float mask of ±1e30 dominates the scores: output, logsumexp and gradients are the
    reference's (in float64), no inf or NaN; the mask's gradient is 0 up to rounding."""
    q, k, v, dout, rng = case
    dtype = q.dtype
    mask = (rng.choice([-1e30, 0.0, 1e30], q.shape[-2:-1] + k.shape[-2:-1])).astype(dtype)
    out, lse = scaled_dot_product_attention_forward(q, k, v, mask)
    want_out, want_lse, want = sdpa_reference(dout, q, k, v, mask)
    n, vmax, _ = attention_sizes(q, k, v, dout)
    assert_close(out, want_out, dtype=dtype, n=n, scale=vmax)
    assert_close(lse, want_lse, dtype=dtype, n=n, scale=1 + np.abs(f64(mask)[0]).max())
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, mask, mask_grad=True)
    gn, gscales = gradient_bounds(dout, q, k, v, mask)
    for got, ref, gscale in zip(grads, want, gscales):
        assert np.all(np.isfinite(got))
        assert_close(got, ref, dtype=dtype, n=gn, scale=gscale)


@given(case=attention_cases(), big=st.sampled_from([-1e9, 1e9, -1e30, 1e30]))
def test_attention_rows_offset_by_a_huge_constant(case, big):
    """A row whose scores all carry one huge constant -- a padding row masked the Annotated
    Transformer's way, masked_fill(mask == 0, -1e9), or tied maxima at 1e30 -- has a
    logsumexp m + log l that cannot hold log l. The weights still sum to 1 (here: uniform) and
    the gradients are the reference's: backward renormalises rows beyond LSE_EXACT by
    l·exp(m - logsumexp) from forward's row max and sum."""
    q, k, v, dout, rng = case
    dtype = q.dtype
    length, keys = q.shape[-2], k.shape[-2]
    i = rng.integers(0, length)
    q[..., i, :] = 0                                 # row i's scores: exactly `big`, all tied
    mask = np.zeros((length, keys), dtype)
    mask[i] = big
    out, weights = attention(q, k, v, mask)
    assert abs(big) > LSE_EXACT[dtype]               # (these rows are all renormalised)
    assert_close(weights.sum(axis=-1), np.ones(weights.shape[:-1]), dtype=dtype, n=keys)
    assert_close(weights[..., i, :], np.full(weights[..., i, :].shape, 1 / keys), dtype=dtype,
                 n=keys)
    want_out, want_lse, want = sdpa_reference(dout, q, k, v, mask)
    n, vmax, _ = attention_sizes(q, k, v, dout)
    out, lse = scaled_dot_product_attention_forward(q, k, v, mask)
    assert_close(out, want_out, dtype=dtype, n=n, scale=vmax)
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, mask, mask_grad=True)
    gn, gscales = gradient_bounds(dout, q, k, v, mask)
    for got, ref, gscale, again in zip(grads, want, gscales,
                                       attention_backward(dout, q, k, v, mask, mask_grad=True)):
        assert_close(got, ref, dtype=dtype, n=gn, scale=gscale)
        assert np.array_equal(got, again)            # the two backward paths agree bitwise


@given(case=attention_cases(), kind=st.sampled_from(["bool", "float", "causal"]))
def test_attention_fully_masked_rows_give_zeros_and_zero_gradients(case, kind):
    """Rows that see no key: output exactly 0, logsumexp -inf, weights exactly 0, and exactly
    zero dq and dmask rows -- PyTorch SDPA's rule since 2.5 (its math path gives NaN) -- for a
    bool mask, a float mask of -inf and bottom-right causal alignment with L > S."""
    q, k, v, dout, rng = case
    dtype = q.dtype
    length, keys = q.shape[-2], k.shape[-2]
    visible = rng.random((length, keys)) < 0.7
    masked = rng.random(length) < 0.5
    visible[masked] = False
    kw = {}
    if kind == "bool":
        mask = visible
    elif kind == "float":
        mask = np.where(visible, rng.standard_normal(visible.shape), -np.inf).astype(dtype)
    else:                                   # bottom-right: the first L - S queries see nothing
        q = np.concatenate([q] * (keys // length + 2), axis=-2)
        dout = np.concatenate([dout] * (keys // length + 2), axis=-2)
        length = q.shape[-2]
        mask, kw = None, dict(is_causal=True, causal_alignment="bottom-right")
        masked = np.arange(length) < length - keys
        visible = reference.causal_mask(length, keys, "bottom-right")
    out, lse = scaled_dot_product_attention_forward(q, k, v, mask, **kw)
    assert np.all(out[..., masked, :] == 0) and np.all(lse[..., masked] == -np.inf)
    got_out, weights = attention(q, k, v, mask, **kw)
    assert np.all(weights[..., masked, :] == 0) and np.all(got_out[..., masked, :] == 0)
    mask_grad = kind == "float"
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, mask,
                                                  mask_grad=mask_grad, **kw)
    assert np.all(grads[0][..., masked, :] == 0)
    if mask_grad:
        assert np.all(grads[3][masked] == 0)
    # the masked rows add nothing to dk, dv: they equal the gradients without those rows' dout
    quiet = dout.copy()
    quiet[..., masked, :] = 0
    for got, same in zip(grads[1:3], scaled_dot_product_attention_backward(
            quiet, q, k, v, out, lse, mask, mask_grad=mask_grad, **kw)[1:3]):
        assert np.array_equal(got, same)
    if masked.all():
        for g in grads:
            assert not np.any(g)
    assert np.array_equal(attention_backward(dout, q, k, v, mask, **kw)[0], grads[0])


@given(case=attention_cases())
def test_attention_with_a_single_visible_key(case):
    """Each query sees one key j: weights exactly one-hot, output exactly v[j] (p = exp(0) = 1,
    l = 1); the softmax's gradient -- dq, and dmask -- is 0 up to rounding (D = rowsum(dout ∘
    out) and dout·v[j] are the same sum taken in two orders), and dv[j] = Σ dout."""
    q, k, v, dout, rng = case
    dtype = q.dtype
    length, keys = q.shape[-2], k.shape[-2]
    j = rng.integers(0, keys, length)
    visible = np.zeros((length, keys), bool)
    visible[np.arange(length), j] = True
    out, lse = scaled_dot_product_attention_forward(q, k, v, visible)
    assert np.array_equal(out, v[..., j, :])
    got_out, weights = attention(q, k, v, visible)
    assert np.array_equal(weights, np.broadcast_to(visible, weights.shape).astype(dtype))
    assert np.array_equal(got_out, out)
    fmask = np.where(visible, 0, -np.inf).astype(dtype)
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, fmask,
                                                  mask_grad=True)
    want = sdpa_reference(dout, q, k, v, fmask)[2]
    n, _, gscale = attention_sizes(q, k, v, dout)
    for got, ref in zip(grads, want):
        assert_close(got, ref, dtype=dtype, n=n, scale=gscale)
    assert np.all(want[0] == 0)                          # the truth of dq is exactly 0


@given(case=attention_cases())
def test_attention_of_denormal_inputs(case):
    q, k, v, dout, rng = case
    dtype = q.dtype
    tiny = DENORMAL[np.dtype(dtype)]
    q, k, v = (a * dtype.type(tiny) for a in (q, k, v))
    out, lse = scaled_dot_product_attention_forward(q, k, v)
    want_out, want_lse, want = sdpa_reference(dout, q, k, v, None)
    # the average of subnormal values, to the subnormal grid's resolution
    assert np.allclose(out, want_out, rtol=1e-2, atol=k.shape[-2] * np.finfo(
        dtype).smallest_subnormal)
    assert np.any(out != 0)
    assert_close(lse, want_lse, dtype=dtype, n=k.shape[-2])
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse)
    for got, ref in zip(grads, want):
        assert np.all(np.isfinite(got))
        assert_close(got, ref, dtype=dtype, n=k.shape[-2] * 8, scale=np.abs(ref).max(initial=0)
                     + np.abs(f64(dout)[0]).max())


@pytest.mark.parametrize("keys", [1, 16, 34])
def test_float32_attention_of_huge_values_is_exact_below_the_accumulator_limit(keys):
    """The engine accumulates Σ_j exp(s_j - m)·v_j unnormalised, in the input dtype: with
    equal scores that is keys·v, so 1e37 over up to 34 keys stays below float32's 3.4e38 and
    the output is the average, 1e37 (to float32 rounding)."""
    q, k = np.zeros((1, 4), np.float32), np.zeros((keys, 4), np.float32)
    v = np.full((keys, 2), 1e37, np.float32)
    assert_close(scaled_dot_product_attention(q, k, v), np.full((1, 2), 1e37),
                 dtype=np.float32, n=keys, scale=1e37)


@pytest.mark.parametrize("keys", [35, 64, 300])
def test_float32_attention_of_huge_values_overflows_past_the_accumulator_limit(keys):
    """Documented (functional/attention.py, "Edge cases"): float32 values whose weighted sum
    Σ_j exp(s_j - m)·v_j exceeds 3.4e38 -- here 1e37 over 35+ equally scored keys -- give inf,
    though the true output (the average, 1e37) is finite. float64 holds the same sum."""
    q, k = np.zeros((1, 4), np.float32), np.zeros((keys, 4), np.float32)
    v = np.full((keys, 2), 1e37, np.float32)
    assert np.all(scaled_dot_product_attention(q, k, v) == np.inf)
    assert np.all(attention(q, k, v)[0] == np.inf)
    out64 = scaled_dot_product_attention(*f64(q, k, v))
    assert_close(out64, f64(v)[0][:1], dtype=np.float64, n=keys, scale=1e37)


@given(case=attention_cases())
def test_attention_nan_reaches_the_rows_it_should(case):
    """NaN in query row i: output row i and logsumexp i are NaN, every other row bitwise as
    without it, and so are dq's other rows. NaN in key j: exactly the rows that see key j under
    a bool mask (a False hides it; a float mask's -inf does not, NaN + -inf = NaN). NaN in value
    j: the rows that see key j are NaN in that column (other rows may be too: a masked weight
    is an exact 0, and 0·NaN = NaN, as in PyTorch's math path); fully masked rows stay 0."""
    q, k, v, dout, rng = case
    length, keys = q.shape[-2], k.shape[-2]
    visible = rng.random((length, keys)) < 0.6
    visible[rng.random(length) < 0.3] = False
    out, lse = scaled_dot_product_attention_forward(q, k, v, visible)
    i, j = rng.integers(0, length), rng.integers(0, keys)
    others = np.arange(length) != i
    qn = q.copy()
    qn[..., i, 0] = np.nan
    got, got_lse = scaled_dot_product_attention_forward(qn, k, v, visible)
    if visible[i].any():
        assert np.all(np.isnan(got[..., i, :])) and np.all(np.isnan(got_lse[..., i]))
    else:
        assert np.all(got[..., i, :] == 0)
    assert np.array_equal(got[..., others, :], out[..., others, :])
    dq = scaled_dot_product_attention_backward(dout, qn, k, v, got, got_lse, visible)[0]
    assert np.array_equal(dq[..., others, :],
                          scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                                visible)[0][..., others, :])
    kn = k.copy()
    kn[..., j, 0] = np.nan
    got = scaled_dot_product_attention(q, kn, v, visible)
    sees = visible[:, j]
    assert np.all(np.isnan(got[..., sees, :]))
    assert np.array_equal(got[..., ~sees, :], out[..., ~sees, :])
    fmask = np.where(visible, 0, -np.inf).astype(q.dtype)  # every row: NaN + -inf = NaN
    assert np.all(np.isnan(scaled_dot_product_attention(q, kn, v, fmask)))
    vn = v.copy()
    vn[..., j, 0] = np.nan
    got = scaled_dot_product_attention(q, k, vn, visible)
    assert np.all(np.isnan(got[..., sees, 0]))
    assert np.array_equal(got[..., 1:], out[..., 1:])    # the other columns never meet it
    dead = ~visible.any(axis=1)
    assert np.all(got[..., dead, :] == 0)


# ------------------------------------------------------------------ layer_norm

@given(dtype=dtypes, n=st.integers(1, 5), d=st.integers(2, 40), seed=seeds,
       size=st.sampled_from([3e38, 1e38, 1e30, 1.0]))
def test_layer_norm_of_values_whose_float32_sum_overflows(dtype, n, d, seed, size):
    """Statistics in float64: float32 samples of ±3e38, whose float32 sum (or square) would
    overflow, are normalised as in the float64 reference -- no inf, no NaN -- and so are the
    gradients; ±1e30 likewise, in both dtypes."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, (n, d)) * size).astype(dtype)
    w = rng.standard_normal(d).astype(dtype)
    b = rng.standard_normal(d).astype(dtype)
    y = layer_norm_forward(x, d, w, b)
    want = reference.layer_norm_forward(*f64(x), d, *f64(w, b))
    assert np.all(np.isfinite(y))
    assert_close(y, want, dtype=dtype, n=d, scale=np.abs(f64(w)[0]) * 3 + 1)
    dout = rng.standard_normal((n, d)).astype(dtype)
    grads = layer_norm_backward(dout, x, d, w, b)
    want_grads = reference.layer_norm_backward(*f64(dout, x), d, *f64(w, b))
    # dx = rstd·(ĝ - mean(ĝ) - x̂·mean(ĝ·x̂)) cancels terms of size rstd·|dout·w|
    x64 = f64(x)[0]
    rstd = 1 / np.sqrt(x64.var(axis=-1) + 1e-5).min()
    terms = (np.abs(f64(dout)[0]) * np.abs(f64(w)[0])).max()
    for got, ref, size in zip(grads, want_grads, (rstd * terms, 3 * terms, terms)):
        assert np.all(np.isfinite(got))
        assert_close(got, ref, dtype=dtype, n=d * n, scale=size + np.finfo(dtype).tiny)


@given(dtype=dtypes, n=st.integers(1, 5), d=st.integers(2, 40), seed=seeds)
def test_layer_norm_of_denormal_samples(dtype, n, d, seed):
    """A sample of subnormal numbers has a variance far below eps: y ≈ (x - μ)/√eps ≈ 0, as
    the reference -- no NaN, no division by a flushed zero."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, (n, d)) * DENORMAL[np.dtype(dtype)]).astype(dtype)
    y = layer_norm_forward(x, d)
    assert_close(y, reference.layer_norm_forward(f64(x)[0], d), dtype=dtype, n=d)
    dx = layer_norm_backward(np.ones((n, d), dtype), x, d)[0]
    assert np.all(np.isfinite(dx))


@given(dtype=dtypes, n=st.integers(2, 6), d=st.integers(1, 40), seed=seeds,
       poison=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_layer_norm_nan_and_inf_reach_exactly_their_sample(dtype, n, d, seed, poison):
    """A NaN or ±inf (inf - mean = NaN) makes its sample's output NaN, leaves the other samples
    bitwise unchanged, and -- summed over samples -- makes dweight and dbias NaN where dout
    meets it, as in PyTorch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(dtype)
    bad = rng.random(n) < 0.5
    dirty = x.copy()
    dirty[bad, rng.integers(0, d)] = poison
    w = rng.standard_normal(d).astype(dtype)
    clean, y = layer_norm_forward(x, d, w), layer_norm_forward(dirty, d, w)
    assert np.all(np.isnan(y[bad]))
    assert np.array_equal(y[~bad], clean[~bad])
    dout = rng.standard_normal((n, d)).astype(dtype)
    dx, dw, _ = layer_norm_backward(dout, dirty, d, w)
    assert np.all(np.isnan(dx[bad]))
    assert np.array_equal(dx[~bad], layer_norm_backward(dout, x, d, w)[0][~bad])
    assert np.all(np.isnan(dw)) if bad.any() else np.all(np.isfinite(dw))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_of_a_constant_sample_with_eps_0_is_nan(dtype):
    """Variance 0 and eps 0: (x - μ)/√0 = 0/0 = NaN for that sample only, as PyTorch; any eps
    > 0 gives the bias."""
    x = np.array([[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]], dtype)
    y = layer_norm_forward(x, 3, eps=0.0)
    assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1]))
    bias = np.array([0.5, -1.0, 3.0], dtype)
    assert np.array_equal(layer_norm_forward(x[:1], 3, bias=bias), bias[None])


# ------------------------------------------------------------------ gelu

approximations = st.sampled_from(["none", "tanh"])


@given(dtype=dtypes, approximate=approximations, seed=seeds,
       size=st.sampled_from([1e30, 1e20, 1e5, 100.0]))
def test_gelu_of_huge_values_is_x_or_minus_zero(dtype, approximate, seed, size):
    """|x| of 1e30 (x³ overflows float32 and u with it; x² too): GELU is x for x > 0 and −0
    for x < 0, the slope 1 or 0 -- exactly, no NaN, in both dtypes and both forms."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.5, 1.0, 20) * size * rng.choice([-1.0, 1.0], 20)).astype(dtype)
    y = gelu_forward(x, approximate)
    assert np.array_equal(y, np.where(x > 0, x, np.array(-0.0, dtype)))
    assert np.all(np.signbit(y[x < 0]))
    dout = rng.standard_normal(20).astype(dtype)
    assert np.array_equal(gelu_backward(dout, x, approximate), np.where(x > 0, dout, 0 * dout))


@given(dtype=dtypes, approximate=approximations, n=st.integers(1, 50), seed=seeds,
       poison=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_gelu_nan_and_inf_reach_exactly_their_element(dtype, approximate, n, seed, poison):
    """An elementwise op: a NaN gives NaN, +inf gives +inf (slope 1), −inf gives −0 (slope
    0), the limits; every other element is bitwise what it was without the poison."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(dtype)
    bad = rng.random(n) < 0.3
    dirty = np.where(bad, np.array(poison, dtype), x)
    dout = rng.standard_normal(n).astype(dtype)
    y, dx = gelu_forward(dirty, approximate), gelu_backward(dout, dirty, approximate)
    assert np.array_equal(y[~bad], gelu_forward(x, approximate)[~bad])
    assert np.array_equal(dx[~bad], gelu_backward(dout, x, approximate)[~bad])
    if np.isnan(poison):
        assert np.all(np.isnan(y[bad])) and np.all(np.isnan(dx[bad]))
    elif poison > 0:
        assert np.all(y[bad] == np.inf) and np.array_equal(dx[bad], dout[bad])
    else:
        assert np.all(y[bad] == 0) and np.all(np.signbit(y[bad]))
        assert np.array_equal(dx[bad], 0 * dout[bad])


@given(dtype=dtypes, approximate=approximations, seed=seeds)
def test_gelu_of_denormals_is_half_x(dtype, approximate, seed):
    """Near 0, GELU(x) = x/2 + O(x²) and its slope 1/2: subnormal inputs give x/2 (as the
    reference, which rounds the same way) and the slope 1/2, no flush to zero of the result."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, 30) * DENORMAL[np.dtype(dtype)]).astype(dtype)
    y = gelu_forward(x, approximate)
    assert_close(y, reference.gelu_forward(f64(x)[0], approximate), dtype=dtype, scale=0.0)
    assert np.array_equal(np.signbit(y), np.signbit(x))
    assert np.all(gelu_backward(np.ones_like(x), x, approximate) == 0.5)


# ------------------------------------------------------------------ rotary embedding

def rope_tables(rng, length, h, dtype):
    theta = rng.uniform(-20, 20, (length, h))
    theta[0] = 0.0                                       # position 0: cos 1, sin 0 exactly
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


@given(dtype=dtypes, interleaved=st.booleans(), seed=seeds,
       size=st.sampled_from([1e30, 1e20, 1e-20]))
def test_rotary_of_huge_and_tiny_values_stays_finite_and_rotates(dtype, interleaved, seed, size):
    """|x| up to 1e30 in float32 (its products with cos, sin ≤ 1 cannot overflow, their sum at
    most doubles): finite, within rounding of the float64 rotation; position 0 is x itself;
    the backward undoes the forward."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 5, 8)) * size).astype(dtype)
    cos, sin = rope_tables(rng, 5, 4, dtype)
    y = rotary_embedding_forward(x, cos, sin, interleaved)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[:, 0], x[:, 0])
    scale = np.abs(f64(x)[0]).max()
    assert_close(y, reference.rotary_embedding_forward(*f64(x, cos, sin), interleaved),
                 dtype=dtype, n=2, scale=scale)
    assert_close(rotary_embedding_backward(y, cos, sin, interleaved), f64(x)[0], dtype=dtype,
                 n=6, scale=scale)


@given(dtype=dtypes, interleaved=st.booleans(), seed=seeds,
       poison=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_rotary_nan_and_inf_reach_their_pair_only(dtype, interleaved, seed, poison):
    """A pair is rotated on its own: a NaN or ±inf entry changes its pair's two outputs and no
    other (bitwise). A NaN gives NaN in both; an infinity gives ±inf, or NaN where its factor
    is 0 -- the partner's output at position 0 (inf·sin 0), IEEE's inf·0 as in PyTorch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 6)).astype(dtype)
    cos, sin = rope_tables(rng, 4, 3, dtype)
    dirty = x.copy()
    n, pos, k = 1, int(rng.integers(4)), int(rng.integers(3))
    slots = [2 * k, 2 * k + 1] if interleaved else [k, k + 3]
    dirty[n, pos, slots[0]] = poison
    touched = np.zeros(x.shape, bool)
    touched[n, pos, slots] = True
    for op in (rotary_embedding_forward, rotary_embedding_backward):
        y, clean = op(dirty, cos, sin, interleaved), op(x, cos, sin, interleaved)
        np.testing.assert_array_equal(y[~touched], clean[~touched])
        want = op(*f64(dirty, cos, sin), interleaved)[n, pos, slots]     # IEEE, in float64
        got = y[n, pos, slots]
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
        if np.isnan(poison):
            assert np.all(np.isnan(got))
        elif pos == 0:
            assert np.isinf(got[0]) and np.isnan(got[1])                 # inf·1, inf·0
        else:
            assert np.all(np.isinf(got))


@given(dtype=dtypes, interleaved=st.booleans(), seed=seeds)
def test_rotary_of_denormals_is_not_flushed(dtype, interleaved, seed):
    """Subnormal entries are rotated as the float64 formula rounds them (no flush to zero):
    position 0 gives them back unchanged, other positions within rounding of the reference."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, (2, 3, 4)) * DENORMAL[np.dtype(dtype)]).astype(dtype)
    cos, sin = rope_tables(rng, 3, 2, dtype)
    y = rotary_embedding_forward(x, cos, sin, interleaved)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])
    assert np.any(y[:, 1:] != 0)
    assert_close(y, reference.rotary_embedding_forward(*f64(x, cos, sin), interleaved),
                 dtype=dtype, n=2, scale=DENORMAL[np.dtype(dtype)])

