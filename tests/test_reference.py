"""The textbook itself against PyTorch: if the oracle is wrong, every other test is too.

The op tests compare reference.linear/matmul/softmax/dropout with PyTorch already; this file
covers the article's attention, whose kernel arrives in a later issue.
"""
import math

import numpy as np
from hypothesis import given, strategies as st

from closeness import assert_close
from npattn import reference
from strategies import dims, make_values


@st.composite
def attention_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, h = draw(dims(3, 1)), draw(dims(3, 1))
    l, s = draw(dims(7, 1)), draw(dims(7, 1))
    e, ev = draw(dims(6, 1)), draw(dims(6, 1))
    q = make_values(rng, (b, h, l, e), np.float64)
    k = make_values(rng, (b, h, s, e), np.float64)
    v = make_values(rng, (b, h, s, ev), np.float64)
    dout = make_values(rng, (b, h, l, ev), np.float64)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_shape = draw(st.sampled_from([(l, s), (b, 1, 1, s), (b, h, l, s), (1, h, l, 1)]))
    mask = None
    if mask_kind == "bool":
        mask = rng.random(mask_shape) < 0.7          # True takes part; some rows fully masked
    elif mask_kind == "float":
        mask = rng.standard_normal(mask_shape)
        mask[rng.random(mask_shape) < 0.2] = -np.inf
    scale = draw(st.none() | st.floats(0.05, 2.0))
    return q, k, v, dout, mask, scale


@given(case=attention_cases())
def test_reference_attention_matches_torch_sdpa(torch, case):
    q, k, v, dout, mask, scale = case
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tmask = None if mask is None else torch.tensor(mask, requires_grad=mask.dtype != bool)
    tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask,
                                                            scale=scale)
    tout.backward(torch.tensor(dout))
    out, weights = reference.attention_forward(q, k, v, mask, scale=scale)
    n = k.shape[-2] * q.shape[-1]
    assert_close(out, tout.detach().numpy(), dtype=np.float64, n=n, scale=10.0)
    row_sums = weights.sum(-1)                      # 1, or 0 for a fully masked row
    assert np.all((np.abs(row_sums - 1) < 1e-12) | (row_sums == 0))
    grads = reference.attention_backward(dout, q, k, v, mask, scale=scale)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        assert_close(got, want.numpy(), dtype=np.float64, n=n, scale=10.0)
    if mask is not None and mask.dtype != bool:
        # a float mask is a learnable bias: its gradient is dscores summed to the mask's shape
        assert_close(grads[3], tmask.grad.numpy(), dtype=np.float64,
                     n=n * q.shape[0] * q.shape[1], scale=10.0)
    else:
        assert grads[3] is None


@given(case=attention_cases(), p=st.floats(0.0, 0.9), seed=st.integers(0, 2**32 - 1))
def test_reference_dropout_attention_matches_the_formula_in_torch(torch, case, p, seed):
    """PyTorch cannot draw our keep-mask, so it computes the article's formula with ours:
    weights = dropout(softmax(scores)), output = weights·V -- and autograd differentiates it."""
    q, k, v, dout, mask, scale = case
    keep = np.random.default_rng(seed).random(q.shape[:-1] + (k.shape[-2],)) >= p
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        tm = torch.tensor(mask)
        scores = scores.masked_fill(~tm, -math.inf) if mask.dtype == bool else scores + tm
    full = torch.isneginf(scores).all(-1, keepdim=True)     # fully masked rows give 0, as
    probs = torch.softmax(scores.masked_fill(full, 0.0), -1).masked_fill(full, 0.0)  # ours
    tweights = probs * torch.tensor(keep) / (1 - p)
    tout = tweights @ tv
    tout.backward(torch.tensor(dout))
    out, weights = reference.attention_forward(q, k, v, mask, keep, p, scale)
    n = k.shape[-2] * q.shape[-1]
    assert_close(weights, tweights.detach().numpy(), dtype=np.float64, n=k.shape[-2], scale=10.0)
    assert_close(out, tout.detach().numpy(), dtype=np.float64, n=n, scale=100.0)
    grads = reference.attention_backward(dout, q, k, v, mask, keep, p, scale)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        assert_close(got, want.numpy(), dtype=np.float64, n=n, scale=100.0)


def test_the_articles_three_token_example():
    """q¹·k¹, q¹·k², q¹·k³ = 2, 4, 4 (after scaling); softmax gives [0.063, 0.468, 0.468],
    not the article's rounded [0.0, 0.5, 0.5]; the output is the weighted sum of the v's."""
    d_k = 4
    q = np.array([[1.0, 0.0, 0.0, 0.0]]) * math.sqrt(d_k)
    k = np.array([[2.0, 1, 0, 0], [4.0, 0, 1, 0], [4.0, 0, 0, 1]])
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    out, weights = reference.attention_forward(q, k, v)
    e = np.exp([2.0 - 4.0, 0.0, 0.0])
    np.testing.assert_allclose(weights[0], e / e.sum(), rtol=1e-15)
    np.testing.assert_allclose(np.round(weights[0], 3), [0.063, 0.468, 0.468])
    np.testing.assert_allclose(out[0], weights[0] @ v, rtol=1e-15)


def test_fully_masked_rows_are_zero_with_zero_gradient():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    mask = np.ones((4, 4), bool)
    mask[2] = False
    out, weights = reference.attention_forward(q, k, v, mask)
    assert np.all(out[2] == 0) and np.all(weights[2] == 0)
    assert np.all(np.isfinite(out)) and np.all(weights[[0, 1, 3]].sum(-1) > 0.999)
    dq, dk, dv, _ = reference.attention_backward(rng.standard_normal((4, 3)), q, k, v, mask)
    assert np.all(dq[2] == 0) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
