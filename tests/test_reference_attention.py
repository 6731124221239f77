"""The textbook of scaled_dot_product_attention checked on its own: the oracle of test_attention.py.

reference.scaled_dot_product_attention_forward / _backward are built on the article's
attention_forward / attention_backward (which test_reference.py holds to PyTorch). Here the new
parts are checked: the causal mask and its two alignments, grouped-query heads, broadcast
batch dims, 2-D inputs, the logsumexp, fully masked rows -- and the backward against central
finite differences of the forward, so it does not lean on PyTorch at all.
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close
from npattn import reference
from npattn.reference import (causal_mask, scaled_dot_product_attention_backward,
                              scaled_dot_product_attention_forward)
from strategies import make_values

ALIGNMENTS = ("top-left", "bottom-right")


@st.composite
def tiny_cases(draw, kinds=("none", "bool", "float"), dropout=True):
    """float64 SDPA arguments small enough for finite differences: broadcast batch dims, GQA,
    L != S, E != Ev, every mask kind (float with -inf entries), causal, scale and a keep-mask."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    L, S = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if draw(st.integers(0, 5)) == 0:                     # 2-D: no head dim
        q_shape, k_shape, v_shape, full = (L, E), (S, E), (S, Ev), (L, S)
        enable_gqa = False
    else:
        hkv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
        h = hkv * group
        enable_gqa = group > 1 or draw(st.booleans())
        b = draw(st.sampled_from([(), (2,), (1,), (2, 1)]))
        kb = draw(st.sampled_from([b, b[1:], tuple(1 for _ in b)]))  # key and value broadcast
        q_shape, k_shape, v_shape = b + (h, L, E), kb + (hkv, S, E), kb + (hkv, S, Ev)
        full = b + (h, L, S)
    q = make_values(rng, q_shape, np.float64)
    k = make_values(rng, k_shape, np.float64)
    v = make_values(rng, v_shape, np.float64)
    kind = draw(st.sampled_from(kinds))
    mask = None
    if kind != "none":
        shape = draw(st.sampled_from([full, full[-2:], (1, S), (L, 1),
                                      tuple(1 if i % 2 else n for i, n in enumerate(full))]))
        if kind == "bool":
            mask = rng.random(shape) < 0.7
        else:
            mask = rng.standard_normal(shape)
            mask[rng.random(shape) < 0.2] = -np.inf
    keep, p = None, 0.0
    if dropout and draw(st.booleans()):
        p = draw(st.floats(0.0, 0.9))
        keep = rng.random(full) >= p
    kwargs = dict(attn_mask=mask, keep=keep, dropout_p=p, is_causal=draw(st.booleans()),
                  scale=draw(st.none() | st.floats(-2.0, 2.0)), enable_gqa=enable_gqa,
                  causal_alignment=draw(st.sampled_from(ALIGNMENTS)))
    out, _ = scaled_dot_product_attention_forward(q, k, v, **kwargs)
    dout = make_values(rng, out.shape, np.float64)
    return q, k, v, dout, kwargs


def finite_difference(f, x, h=1e-6):
    """Central differences of the scalar f() with respect to each entry of x (changed in place).

    Entries of -inf (masked) are skipped: their gradient is 0 and x ± h is still -inf.
    """
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        if np.isinf(x[i]):
            continue
        old = x[i]
        x[i] = old + h
        up = f()
        x[i] = old - h
        down = f()
        x[i] = old
        grad[i] = (up - down) / (2 * h)
    return grad


# ------------------------------------------------------------------ causal mask

@pytest.mark.parametrize("L", [0, 1, 2, 5, 8])
@pytest.mark.parametrize("S", [0, 1, 3, 5, 9])
def test_causal_mask_is_the_textbook_rule(L, S):
    top, bottom = causal_mask(L, S), causal_mask(L, S, "bottom-right")
    assert top.shape == bottom.shape == (L, S) and top.dtype == bottom.dtype == np.bool_
    for i in range(L):
        for j in range(S):
            assert top[i, j] == (j <= i)
            assert bottom[i, j] == (j <= i + S - L)
    np.testing.assert_array_equal(top, np.tril(np.ones((L, S), bool)))
    np.testing.assert_array_equal(bottom, np.tril(np.ones((L, S), bool), S - L))
    if L == S:
        np.testing.assert_array_equal(top, bottom)
    if L <= S:                                           # every query sees at least one key
        assert S == 0 or bottom.any(axis=1).all()
    if 0 < L and S:
        assert bottom[-1].all()                          # the newest query sees the whole cache


def test_causal_mask_rejects_unknown_alignment():
    with pytest.raises(ValueError, match="causal_alignment"):
        causal_mask(3, 3, "bottom_right")


def test_causal_matches_torch_is_causal(torch):
    rng = np.random.default_rng(0)
    for L, S in ((5, 3), (3, 5), (4, 4), (1, 6)):
        q, k, v = (rng.standard_normal(s) for s in ((2, L, 3), (2, S, 3), (2, S, 2)))
        want = torch.nn.functional.scaled_dot_product_attention(
            *(torch.tensor(a) for a in (q, k, v)), is_causal=True).numpy()
        out, _ = scaled_dot_product_attention_forward(q, k, v, is_causal=True)
        assert_close(out, want, dtype=np.float64, n=S * 3, scale=10.0)


# ------------------------------------------------------------------ forward

@given(case=tiny_cases(dropout=False))
def test_forward_matches_torch_sdpa(torch, case):
    """Every option but bottom-right goes to PyTorch as is (causal + mask as one mask: PyTorch
    refuses both); bottom-right becomes an explicit mask, and so does causal with a scale <= 0
    (PyTorch scales its causal bias there: 0·-inf gives NaN)."""
    q, k, v, dout, kw = case
    mask = kw["attn_mask"]
    explicit = kw["is_causal"] and (mask is not None or kw["causal_alignment"] == "bottom-right"
                                    or (kw["scale"] is not None and kw["scale"] <= 0))
    if explicit:
        causal = causal_mask(q.shape[-2], k.shape[-2], kw["causal_alignment"])
        if mask is None:
            mask = causal
        elif mask.dtype == bool:
            mask = mask & causal
        else:
            mask = mask + np.where(causal, 0.0, -np.inf)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tmask = None if mask is None else torch.tensor(mask, requires_grad=mask.dtype != bool)
    tout = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tmask, is_causal=kw["is_causal"] and not explicit,
        scale=kw["scale"], enable_gqa=kw["enable_gqa"])
    tout.backward(torch.tensor(dout))
    out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
    n = k.shape[-2] * q.shape[-1]
    assert_close(out, tout.detach().numpy(), dtype=np.float64, n=n, scale=10.0)
    dq, dk, dv, dmask = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        assert_close(got, want.numpy(), dtype=np.float64, n=n * 12, scale=10.0)
    if tmask is not None and tmask.requires_grad:
        want = tmask.grad.numpy()
        want = reference._sum_to_shape(want, kw["attn_mask"].shape)  # the causal part summed back
        assert_close(dmask, want, dtype=np.float64, n=n * 12, scale=10.0)
    else:
        assert dmask is None


@given(case=tiny_cases())
def test_logsumexp_is_log_sum_exp_of_the_masked_scores(case):
    """Written out without max-shifting (the values are small), and weights = exp(s - lse)."""
    q, k, v, _, kw = case
    out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
    assert lse.shape == out.shape[:-1]
    scale = 1 / math.sqrt(q.shape[-1]) if kw["scale"] is None else kw["scale"]
    if kw["enable_gqa"] and q.ndim > 2:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) * scale
    mask = kw["attn_mask"]
    if kw["is_causal"]:
        scores = np.where(causal_mask(q.shape[-2], k.shape[-2], kw["causal_alignment"]),
                          scores, -np.inf)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    with np.errstate(divide="ignore"):
        want = np.log(np.sum(np.exp(scores), axis=-1))
    assert_close(lse, want, dtype=np.float64, n=scores.shape[-1], scale=10.0)
    visible = ~np.isneginf(lse)
    p = np.exp(scores - np.where(visible, lse, 0.0)[..., None])       # softmax from lse
    want_out = np.where(visible[..., None], p, 0.0)
    if kw["keep"] is not None:
        want_out = reference.dropout_forward(want_out, kw["keep"], kw["dropout_p"])
    if kw["enable_gqa"] and q.ndim > 2:
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    assert_close(out, want_out @ v, dtype=np.float64, n=scores.shape[-1], scale=10.0)


@given(case=tiny_cases(), heads=st.sampled_from([(4, 2), (6, 3), (6, 2), (3, 1)]))
def test_gqa_is_repeat_interleave_of_the_kv_heads(case, heads):
    """Query head h reads kv head h // (H // Hkv): the same as repeating each kv head in place,
    and its gradient is the sum over the heads that read it. Checked head by head."""
    _, _, _, _, kw = case
    kw = dict(kw, enable_gqa=True, keep=None, attn_mask=None)
    h, hkv = heads
    rng = np.random.default_rng(h * 10 + hkv)
    q, k, v = (rng.standard_normal(s) for s in ((2, h, 3, 4), (2, hkv, 5, 4), (2, hkv, 5, 2)))
    dout = rng.standard_normal((2, h, 3, 2))
    out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
    dq, dk, dv, _ = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    group = h // hkv
    want_dk, want_dv = np.zeros_like(k), np.zeros_like(v)
    no_gqa = dict(kw, enable_gqa=False)
    for head in range(h):
        g = head // group                                 # repeat_interleave, not tile
        o1, l1 = scaled_dot_product_attention_forward(q[:, head], k[:, g], v[:, g], **no_gqa)
        np.testing.assert_allclose(out[:, head], o1, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(lse[:, head], l1, rtol=1e-14, atol=1e-15)
        g_q, g_k, g_v, _ = scaled_dot_product_attention_backward(
            dout[:, head], q[:, head], k[:, g], v[:, g], **no_gqa)
        np.testing.assert_allclose(dq[:, head], g_q, rtol=1e-14, atol=1e-15)
        want_dk[:, g] += g_k
        want_dv[:, g] += g_v
    assert_close(dk, want_dk, dtype=np.float64, n=group)
    assert_close(dv, want_dv, dtype=np.float64, n=group)


@given(case=tiny_cases())
def test_broadcast_batch_dims_equal_explicit_copies(case):
    """Broadcasting q, k, v (and the mask) equals giving each the full batch shape; each
    gradient is the full-shape one summed over the copies."""
    q, k, v, dout, kw = case
    if q.ndim < 3:
        return
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    full = [np.ascontiguousarray(np.broadcast_to(a, batch + a.shape[-3:])) for a in (q, k, v)]
    mask = kw["attn_mask"]
    kw_full = dict(kw)
    if mask is not None:
        weights_shape = batch + (q.shape[-3], q.shape[-2], k.shape[-2])
        kw_full["attn_mask"] = np.ascontiguousarray(np.broadcast_to(mask, weights_shape))
    got = scaled_dot_product_attention_forward(q, k, v, **kw)
    want = scaled_dot_product_attention_forward(*full, **kw_full)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-13)
    grads = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    full_grads = scaled_dot_product_attention_backward(dout, *full, **kw_full)
    for g, w, x in zip(grads, full_grads, (q, k, v, mask)):
        if g is None:
            assert w is None
            continue
        lead = w.ndim - x.ndim
        w = w.sum(axis=tuple(range(lead)))
        w = w.sum(axis=tuple(i for i, n in enumerate(x.shape) if n == 1), keepdims=True)
        assert g.shape == x.shape
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_2d_inputs_equal_4d_with_unit_batch_and_head():
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal(s) for s in ((5, 3), (7, 3), (7, 2), (5, 2)))
    mask = rng.standard_normal((5, 7))
    for kw in (dict(), dict(attn_mask=mask, is_causal=True, causal_alignment="bottom-right"),
               dict(attn_mask=mask > 0, scale=0.3)):
        out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
        out4, lse4 = scaled_dot_product_attention_forward(q[None, None], k[None, None],
                                                          v[None, None], **kw)
        assert out.shape == (5, 2) and lse.shape == (5,)
        np.testing.assert_array_equal(out, out4[0, 0])
        np.testing.assert_array_equal(lse, lse4[0, 0])
        grads = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
        grads4 = scaled_dot_product_attention_backward(dout[None, None], q[None, None],
                                                       k[None, None], v[None, None], **kw)
        for g, g4 in zip(grads[:3], grads4[:3]):
            np.testing.assert_array_equal(g, g4[0, 0])


def test_causal_and_mask_both_apply():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((2, 6, 3), (2, 4, 3), (2, 4, 5)))
    mask = rng.random((6, 4)) < 0.6
    for alignment in ALIGNMENTS:
        both = mask & causal_mask(6, 4, alignment)
        got = scaled_dot_product_attention_forward(q, k, v, mask, is_causal=True,
                                                   causal_alignment=alignment)
        want = scaled_dot_product_attention_forward(q, k, v, both)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        fmask = np.where(mask, rng.standard_normal((6, 4)), -np.inf)
        got = scaled_dot_product_attention_forward(q, k, v, fmask, is_causal=True,
                                                   causal_alignment=alignment)
        want = scaled_dot_product_attention_forward(q, k, v, np.where(both, fmask, -np.inf))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_causal_alignment_is_ignored_without_is_causal():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((4, 3), (6, 3), (6, 2)))
    a = scaled_dot_product_attention_forward(q, k, v, causal_alignment="bottom-right")
    b = scaled_dot_product_attention_forward(q, k, v)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("how", ["bool", "float", "bottom-right", "no keys"])
def test_fully_masked_rows_give_zero_output_and_gradient(how):
    rng = np.random.default_rng(4)
    L, S = 5, 0 if how == "no keys" else 3
    q, k, v = (rng.standard_normal(s) for s in ((2, L, 4), (2, S, 4), (2, S, 3)))
    dout = rng.standard_normal((2, L, 3))
    kw = {}
    masked = np.zeros((2, L), bool)
    if how == "bool":
        kw["attn_mask"] = np.ones((L, S), bool)
        kw["attn_mask"][[1, 3]] = False
        masked[:, [1, 3]] = True
    elif how == "float":
        kw["attn_mask"] = rng.standard_normal((2, L, S))
        kw["attn_mask"][0, 2] = -np.inf
        masked[0, 2] = True
    elif how == "bottom-right":                          # L > S: the first L - S see nothing
        kw.update(is_causal=True, causal_alignment="bottom-right")
        masked[:, :L - S] = True
    else:
        masked[:] = True
    out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
    assert np.all(out[masked] == 0) and np.all(np.isneginf(lse[masked]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[~masked]))
    dq, dk, dv, dmask = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    assert np.all(dq[masked] == 0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    if how == "float":
        assert np.all(dmask[masked] == 0) and np.all(np.isfinite(dmask))
    # the masked rows contribute nothing to dk and dv: dropping their dout changes nothing
    _, dk2, dv2, _ = scaled_dot_product_attention_backward(np.where(masked[..., None], 0.0, dout),
                                                           q, k, v, **kw)
    np.testing.assert_array_equal(dk, dk2)
    np.testing.assert_array_equal(dv, dv2)


def test_nan_propagates():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((4, 3), (5, 3), (5, 2)))
    q[1, 2] = np.nan
    out, lse = scaled_dot_product_attention_forward(q, k, v)
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert np.isfinite(np.delete(out, 1, axis=0)).all()


# ------------------------------------------------------------------ backward

@given(case=tiny_cases())
def test_backward_matches_finite_differences(case):
    """d/dx Σ dout ∘ output, entry by entry, for query, key, value and a float mask."""
    q, k, v, dout, kw = case
    q, k, v = q.copy(), k.copy(), v.copy()
    mask = None if kw["attn_mask"] is None else kw["attn_mask"].copy()
    kw = dict(kw, attn_mask=mask)

    def loss():
        out, _ = scaled_dot_product_attention_forward(q, k, v, **kw)
        return float(np.sum(dout * out))

    dq, dk, dv, dmask = scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    wants = [(dq, q), (dk, k), (dv, v)]
    if mask is not None and mask.dtype != bool:
        wants.append((dmask, mask))
    else:
        assert dmask is None
    for got, x in wants:
        assert got.shape == x.shape
        want = finite_difference(loss, x)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * (1 + np.abs(want).max()))
