"""The textbook: every formula of npattn in plain NumPy, forward and backward.

Written the way the article and PyTorch's documentation write the formulas -- whole arrays,
no blocking, no tricks beyond the max-subtraction that makes softmax computable. It is the
oracle of the tests (they call it on float64 copies of their inputs) and the engine of
``npattn explain``. It is never fast and never meant to be.

Conventions: ``<op>_backward(dout, ...)`` returns one gradient per differentiable input, in
forward's argument order. A fully masked softmax row (every entry ``-inf``) gives zeros, and
zero gradient, as PyTorch's scaled_dot_product_attention does since 2.5.
"""
import math

import numpy as np


# ------------------------------------------------------------------------- linear

def linear_forward(x, weight, bias=None):
    """y = x·Wᵀ + b.  Shapes: x (..., Fin) · weight (Fout, Fin) · bias (Fout,) -> (..., Fout)"""
    out = x @ weight.T                                   # (..., Fout)
    return out if bias is None else out + bias


def linear_backward(dout, x, weight, bias=None):
    """dx = dout·W,  dW = Σ_rows doutᵀ·x,  db = Σ_rows dout."""
    dx = dout @ weight                                   # (..., Fin)
    n = int(np.prod(x.shape[:-1]))
    rows_dout = dout.reshape(n, weight.shape[0])         # (N, Fout)
    rows_x = x.reshape(n, weight.shape[1])               # (N, Fin)
    dweight = rows_dout.T @ rows_x                       # (Fout, Fin)
    dbias = None if bias is None else rows_dout.sum(axis=0)
    return dx, dweight, dbias


# ------------------------------------------------------------------------- matmul

def _sum_to_shape(grad, shape):
    """Undo broadcasting: sum ``grad`` over the dims that broadcasting added or stretched."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(lead))) if lead else grad
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True) if stretched else grad


def matmul_forward(a, b):
    """torch.matmul: 1-D operands are promoted to matrices, batch dims broadcast."""
    return np.matmul(a, b)


def matmul_backward(dout, a, b):
    """da = dout·bᵀ, db = aᵀ·dout, each summed over the batch dims broadcasting added."""
    a2 = a[None, :] if a.ndim == 1 else a                # (..., M, K)
    b2 = b[:, None] if b.ndim == 1 else b                # (..., K, N)
    dout2 = dout
    if a.ndim == 1:
        dout2 = np.expand_dims(dout2, -2 if b.ndim > 1 else 0)   # restore M = 1
    if b.ndim == 1:
        dout2 = dout2[..., None]                         # restore N = 1
    da = dout2 @ np.swapaxes(b2, -1, -2)                 # (batch..., M, K)
    db = np.swapaxes(a2, -1, -2) @ dout2                 # (batch..., K, N)
    da = _sum_to_shape(da, a2.shape).reshape(a.shape)
    db = _sum_to_shape(db, b2.shape).reshape(b.shape)
    return da, db


# ------------------------------------------------------------------------- softmax

def softmax_forward(x, dim=-1):
    """softmax(x)_j = exp(x_j - m) / Σ_k exp(x_k - m), m = max_k x_k; a row of -inf gives 0."""
    m = np.max(x, axis=dim, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)                 # all -inf: exp(-inf) = 0 below
    e = np.exp(x - m)
    s = np.sum(e, axis=dim, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s == 0, 0.0, e / s)


def softmax_backward(dout, out, dim=-1):
    """dx = y ∘ (dout - Σ_k dout_k y_k): the Jacobian-vector product, never the Jacobian."""
    return out * (dout - np.sum(dout * out, axis=dim, keepdims=True))


def log_softmax_forward(x, dim=-1):
    """log_softmax(x)_j = x_j - m - log Σ_k exp(x_k - m); a row of -inf stays -inf."""
    m = np.max(x, axis=dim, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)
    s = np.sum(np.exp(x - m), axis=dim, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s == 0, -np.inf, x - m - np.log(s))  # -inf - log 0 would be NaN


def log_softmax_backward(dout, out, dim=-1):
    """dx = dout - exp(y) ∘ Σ_k dout_k; zero for a row whose every entry is -inf."""
    dx = dout - np.exp(out) * np.sum(dout, axis=dim, keepdims=True)
    masked = np.all(np.isneginf(out), axis=dim, keepdims=True)
    return np.where(masked, 0.0, dx)


# ------------------------------------------------------------------------- dropout

def dropout_forward(x, keep, p):
    """Inverted dropout: kept entries are scaled by 1/(1-p) so the expectation is unchanged."""
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return np.where(keep, x * scale, 0.0)


def dropout_backward(dout, keep, p):
    """The same mask and scale: dropout is linear in x."""
    return dropout_forward(dout, keep, p)


# ------------------------------------------------------------------------- attention

def _capped(raw, softcap):
    """Soft-capping (Gemma 2): scores become softcap·tanh(scores / softcap); None: unchanged."""
    return raw if softcap is None else softcap * np.tanh(raw / softcap)


def _sink_column(sinks, scores):
    """The sink logits (H,) as a column beside the scores (..., H, L, S) -> (..., H, L, 1)
    (without a head dim, (L, S): one sink)."""
    sinks = np.asarray(sinks, np.float64)
    column = sinks.reshape(sinks.shape + (1, 1)) if scores.ndim >= 3 else sinks.reshape(1, 1)
    return np.broadcast_to(column, scores.shape[:-1] + (1,))


def _probabilities(scores, sinks):
    """softmax over the keys; with sinks, over the keys and the sink (whose weight is dropped:
    the rows then sum to less than 1). Returns (probs (..., L, S), the sink's weight (..., L)
    or None)."""
    if sinks is None:
        return softmax_forward(scores, dim=-1), None
    full = softmax_forward(np.concatenate([scores, _sink_column(sinks, scores)], axis=-1))
    return full[..., :-1], full[..., -1]


def attention_forward(query, key, value, mask=None, keep=None, dropout_p=0.0, scale=None,
                      softcap=None, sinks=None):
    """The article's attention: scores = q·kᵀ/√d_k, mask, softmax, dropout, ·v.

    Shapes: query (..., L, E) · key (..., S, E) · value (..., S, Ev) -> output (..., L, Ev),
    weights (..., L, S).  ``mask`` broadcasts to (..., L, S): boolean ``True`` takes part,
    float is added to the scores.  ``keep`` is the dropout keep-mask (..., L, S) or None.
    ``softcap``: the scaled scores become softcap·tanh(scores/softcap) before the mask.
    ``sinks`` (H,): a logit per head that joins each row's softmax with no value.
    Returns ``(output, weights)`` with ``weights`` after dropout (the article's ``p_attn``).
    """
    d_k = query.shape[-1]
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    scores = _capped((query @ np.swapaxes(key, -1, -2)) * scale, softcap)  # (..., L, S)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    probs, _ = _probabilities(scores, sinks)             # (..., L, S)
    weights = probs if keep is None else dropout_forward(probs, keep, dropout_p)
    return weights @ value, weights


def attention_backward(dout, query, key, value, mask=None, keep=None, dropout_p=0.0,
                       scale=None, softcap=None, sinks=None):
    """Gradients of query, key and value (and of a float mask, summed to its shape); with
    ``sinks``, the sinks' gradient (H,) fifth.

    The chain rule written out: output = W·V with W = dropout(P), P = softmax(scores).
    Softmax's gradient needs the pre-dropout P -- at dropped positions too. A sink's logit
    is one more column of the softmax, with no value: its gradient is p_sink·(0 - D).
    The cap's derivative is 1 - tanh²(raw / softcap).
    """
    d_k = query.shape[-1]
    scale = 1.0 / np.sqrt(d_k) if scale is None else scale
    raw = (query @ np.swapaxes(key, -1, -2)) * scale
    scores = _capped(raw, softcap)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    probs, p_sink = _probabilities(scores, sinks)        # P (..., L, S)
    weights = probs if keep is None else dropout_forward(probs, keep, dropout_p)
    dvalue = np.swapaxes(weights, -1, -2) @ dout         # (..., S, Ev)
    dweights = dout @ np.swapaxes(value, -1, -2)         # (..., L, S)
    dprobs = dweights if keep is None else dropout_backward(dweights, keep, dropout_p)
    dscores = softmax_backward(dprobs, probs, dim=-1)    # (..., L, S): p·(dp - Σ_j p·dp)
    draw = dscores if softcap is None else dscores * (1.0 - np.tanh(raw / softcap) ** 2)
    dquery = (draw @ key) * scale                        # (..., L, E)
    dkey = (np.swapaxes(draw, -1, -2) @ query) * scale   # (..., S, E)
    dmask = None
    if mask is not None and mask.dtype != bool:
        dmask = _sum_to_shape(dscores, mask.shape)
    if sinks is None:
        return dquery, dkey, dvalue, dmask
    d = np.sum(dprobs * probs, axis=-1)                  # D (..., L)
    dsink = -p_sink * d                                  # (..., [H,] L)
    if dsink.ndim < 2:                                   # no head dim: one sink
        return dquery, dkey, dvalue, dmask, np.array([dsink.sum()])
    dsinks = dsink.sum(axis=tuple(a for a in range(dsink.ndim) if a != dsink.ndim - 2))  # (H,)
    return dquery, dkey, dvalue, dmask, dsinks


# --------------------------------------------------------------- scaled dot-product attention

CAUSAL_ALIGNMENTS = ("top-left", "bottom-right")


def causal_mask(L, S, alignment="top-left"):
    """The keys each query may see under ``is_causal`` (True = visible).

    "top-left" (PyTorch's ``is_causal``): key j is visible to query i iff j <= i.
    "bottom-right" (a KV cache: the L queries are the last L of the S positions): iff
    j <= i + S - L, so with L > S the first L - S queries see nothing.
    Shapes: -> (L, S) bool
    """
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got {alignment!r}")
    shift = 0 if alignment == "top-left" else S - L
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + shift   # (L, S)


def window_mask(L, S, window, alignment="top-left"):
    """The keys each query may see under ``window=(left, right)`` (True = visible): key j
    iff d - left <= j <= d + right, where d is query i's diagonal -- i ("top-left") or
    i + S - L ("bottom-right"), as causal_mask. ``None`` on a side: no bound there.
    Shapes: -> (L, S) bool
    """
    left, right = (None if n is None else min(n, L + S) for n in window)   # (wider: the same)
    d = np.arange(L)[:, None] + (0 if alignment == "top-left" else S - L)   # (L, 1)
    j = np.arange(S)[None, :]                                             # (1, S)
    visible = np.ones((L, S), bool)
    if left is not None:
        visible &= j >= d - left
    if right is not None:
        visible &= j <= d + right
    return visible


def alibi_bias(L, S, slopes, alignment="top-left"):
    """ALiBi's bias: -slope·|d - j| for query i and key j, d = i's diagonal (i, or i + S - L
    for "bottom-right"), one slope per head.
    Shapes: slopes (..., H) -> (..., H, L, S)
    """
    d = np.arange(L)[:, None] + (0 if alignment == "top-left" else S - L)   # (L, 1)
    distance = np.abs(d - np.arange(S)[None, :])                          # (L, S)
    return -np.asarray(slopes, dtype=np.float64)[..., None, None] * distance


def _with_alibi(mask, slopes, query, S, alignment):
    """mask (None, bool or float) with ALiBi's bias added: a float mask (-inf where a bool
    mask is False), or mask itself when slopes is None."""
    if slopes is None:
        return mask
    bias = alibi_bias(query.shape[-2], S, slopes, alignment)      # (..., H, L, S)
    if query.ndim < 3:                                            # no head dim: one slope
        bias = bias.reshape(bias.shape[-2:])
    if mask is None:
        return bias
    if mask.dtype == bool:
        return np.where(mask, bias, -np.inf)
    return mask + bias


def _sdpa_mask(attn_mask, is_causal, L, S, alignment, window=None):
    """attn_mask, the causal mask and the window as one mask of attention_forward's kinds (or
    None)."""
    if not is_causal and window is None:
        return attn_mask
    visible = np.ones((L, S), bool)                      # (L, S)
    if is_causal:
        visible &= causal_mask(L, S, alignment)
    if window is not None:
        visible &= window_mask(L, S, window, alignment)
    if attn_mask is None:
        return visible
    if attn_mask.dtype == bool:
        return attn_mask & visible                       # (..., L, S)
    return attn_mask + np.where(visible, 0.0, -np.inf)   # (..., L, S)


def _repeat_kv(query, key, value, enable_gqa):
    """Grouped-query attention: query head h reads kv head h // group (torch.repeat_interleave).

    Returns key and value with H heads, and ``group`` = H // Hkv (1 without GQA).
    """
    if not enable_gqa or query.ndim < 3:
        return key, value, 1
    group = query.shape[-3] // key.shape[-3]
    return np.repeat(key, group, axis=-3), np.repeat(value, group, axis=-3), group


def _masked_scores(query, key, mask, scale, softcap=None):
    """scores = q·kᵀ·scale (capped: _capped), then the mask: False (bool) becomes -inf, float
    is added."""
    scores = _capped((query @ np.swapaxes(key, -1, -2)) * scale, softcap)   # (..., L, S)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    return scores


def _logsumexp(scores):
    """log Σ_j exp(scores_j) over the last axis, max-shifted; -inf for a row of -inf."""
    m = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0.0, m)                 # all -inf: log Σ 0 = -inf below
    with np.errstate(divide="ignore"):
        return (m + np.log(np.sum(np.exp(scores - m), axis=-1, keepdims=True)))[..., 0]


def scaled_dot_product_attention_forward(query, key, value, attn_mask=None, keep=None,
                                         dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=False, causal_alignment="top-left",
                                         window=None, alibi_slopes=None, softcap=None,
                                         sinks=None):
    """torch.nn.functional.scaled_dot_product_attention, plus the logsumexp of each score row.

    output = dropout(softmax(q·kᵀ·scale + mask)) · v,  logsumexp_i = log Σ_j exp(scores_ij).
    ``softcap`` and ``sinks``: as attention_forward (the logsumexp then includes the sink).
    ``scale`` defaults to 1/√E; ``attn_mask`` is bool (True takes part) or float (added);
    ``is_causal`` adds :func:`causal_mask` on top of it and ``window`` :func:`window_mask`
    (both hide keys: -inf), ``alibi_slopes`` :func:`alibi_bias`; ``enable_gqa`` repeats each
    kv head
    for H // Hkv query heads; ``keep`` is the dropout keep-mask or None. Batch dims broadcast.
    A fully masked row gives a zero output row and logsumexp -inf.
    Shapes: query (..., H, L, E) · key (..., Hkv, S, E) · value (..., Hkv, S, Ev),
    attn_mask and keep broadcastable to (batch..., H, L, S) -> output (batch..., H, L, Ev),
    logsumexp (batch..., H, L); 2-D (L, E) inputs have no head dim.
    """
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    key, value, _ = _repeat_kv(query, key, value, enable_gqa)   # (..., H, S, E), (..., H, S, Ev)
    mask = _sdpa_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2], causal_alignment,
                      window=window)
    mask = _with_alibi(mask, alibi_slopes, query, key.shape[-2], causal_alignment)
    output, _ = attention_forward(query, key, value, mask=mask, keep=keep, dropout_p=dropout_p,
                                  scale=scale, softcap=softcap, sinks=sinks)
    scores = _masked_scores(query, key, mask, scale, softcap=softcap)
    if sinks is not None:
        scores = np.concatenate([scores, _sink_column(sinks, scores)], axis=-1)
    logsumexp = _logsumexp(scores)                                      # (..., H, L)
    return output, np.broadcast_to(logsumexp, output.shape[:-1]).copy()  # value's batch dims too


def scaled_dot_product_attention_backward(dout, query, key, value, attn_mask=None, keep=None,
                                          dropout_p=0.0, is_causal=False, scale=None,
                                          enable_gqa=False, causal_alignment="top-left",
                                          window=None, alibi_slopes=None, softcap=None,
                                          sinks=None):
    """Gradients of query, key, value and a float attn_mask: attention_backward, put back
    (and, with ``sinks``, the sinks' gradient (H,) fifth).

    Each kv head served H // Hkv query heads, so its gradient is the sum over its group; every
    gradient is then summed over the batch dims its input was broadcast along. ``dmask`` is
    None unless attn_mask is float (a bool mask or the causal mask has no gradient).
    Shapes: dout (batch..., H, L, Ev) and forward's arguments -> dquery, dkey, dvalue,
    dmask of the shapes of query, key, value, attn_mask.
    """
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    key_h, value_h, group = _repeat_kv(query, key, value, enable_gqa)
    mask = _sdpa_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2], causal_alignment,
                      window=window)
    mask = _with_alibi(mask, alibi_slopes, query, key.shape[-2], causal_alignment)
    dquery, dkey, dvalue, dmask, *dsinks = attention_backward(
        dout, query, key_h, value_h, mask=mask, keep=keep, dropout_p=dropout_p, scale=scale,
        softcap=softcap, sinks=sinks)
    if group > 1:                                        # (batch..., Hkv·group, S, ·) -> Hkv
        hkv = key.shape[-3]
        dkey = dkey.reshape(*dkey.shape[:-3], hkv, group, *dkey.shape[-2:]).sum(axis=-3)
        dvalue = dvalue.reshape(*dvalue.shape[:-3], hkv, group, *dvalue.shape[-2:]).sum(axis=-3)
    dquery = _sum_to_shape(dquery, query.shape)
    dkey = _sum_to_shape(dkey, key.shape)
    dvalue = _sum_to_shape(dvalue, value.shape)
    if dmask is not None and attn_mask is not None and attn_mask.dtype != bool:
        dmask = _sum_to_shape(dmask, attn_mask.shape)
    else:
        dmask = None                                     # (a bool mask or ALiBi's bias alone)
    return (dquery, dkey, dvalue, dmask, *dsinks)


def _varlen_sequences(query, cu_seqlens_q, cu_seqlens_k, keep, alibi_slopes):
    """Per sequence s of a packed batch: its query rows and keys (slices), its dropout
    keep-mask (H, L_s, S_s) -- the next H·L_s·S_s entries of the flat ``keep`` -- and its
    slopes."""
    heads, base = query.shape[1], 0
    for s in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]))
        keys = slice(int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1]))
        n = heads * (rows.stop - rows.start) * (keys.stop - keys.start)
        keep_s = None if keep is None else keep[base:base + n].reshape(
            heads, rows.stop - rows.start, keys.stop - keys.start)
        base += n
        slopes = (alibi_slopes if alibi_slopes is None or np.ndim(alibi_slopes) == 1
                  else alibi_slopes[s])
        yield rows, keys, keep_s, slopes


def scaled_dot_product_attention_varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                                keep=None, dropout_p=0.0, is_causal=False,
                                                scale=None, enable_gqa=False,
                                                causal_alignment="top-left", window=None,
                                                alibi_slopes=None, softcap=None, sinks=None):
    """A packed batch of sequences (flash-attn's varlen layout): each sequence s is
    scaled_dot_product_attention_forward on its own rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]
    and keys cu_seqlens_k[s] .. cu_seqlens_k[s+1] (heads as dim -3), the results put back.
    ``keep``: the flat keep-mask (H·Σ_s L_s·S_s,), the sequences' (H, L_s, S_s) masks one
    after the other, or None. A sequence without keys: zero output, logsumexp -inf (with
    ``sinks``, (H,): the sink).
    Shapes: query (total_q, H, E) · key (total_k, Hkv, E) · value (total_k, Hkv, Ev),
    cu_seqlens (n_seq + 1,), alibi_slopes (H,) or (n_seq, H) -> output (total_q, H, Ev),
    logsumexp (H, total_q)
    """
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    output = np.zeros(query.shape[:2] + value.shape[2:])
    logsumexp = np.full(query.shape[1::-1], -np.inf)
    for rows, keys, keep_s, slopes in _varlen_sequences(query, cu_seqlens_q, cu_seqlens_k,
                                                        keep, alibi_slopes):
        if rows.stop == rows.start or (keys.stop == keys.start and sinks is None):
            continue                                     # (no keys: zeros and -inf)
        out_s, lse_s = scaled_dot_product_attention_forward(
            query[rows].transpose(1, 0, 2), key[keys].transpose(1, 0, 2),
            value[keys].transpose(1, 0, 2), keep=keep_s, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            causal_alignment=causal_alignment, window=window, alibi_slopes=slopes,
            softcap=softcap, sinks=sinks)
        output[rows] = out_s.transpose(1, 0, 2)
        logsumexp[:, rows] = lse_s
    return output, logsumexp


def scaled_dot_product_attention_varlen_backward(dout, query, key, value, cu_seqlens_q,
                                                 cu_seqlens_k, keep=None, dropout_p=0.0,
                                                 is_causal=False, scale=None,
                                                 enable_gqa=False, causal_alignment="top-left",
                                                 window=None, alibi_slopes=None, softcap=None,
                                                 sinks=None):
    """Gradients ``(dquery, dkey, dvalue)`` of scaled_dot_product_attention_varlen_forward:
    scaled_dot_product_attention_backward per sequence, put back in its rows (and, with
    ``sinks``, dsinks (H,): the sequences' summed).
    Shapes: dout (total_q, H, Ev) and forward's arguments -> the shapes of query, key, value
    """
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    dquery, dkey, dvalue = np.zeros(query.shape), np.zeros(key.shape), np.zeros(value.shape)
    dsinks = np.zeros(query.shape[1])
    for rows, keys, keep_s, slopes in _varlen_sequences(query, cu_seqlens_q, cu_seqlens_k,
                                                        keep, alibi_slopes):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue                                     # (no weights: zero gradients)
        dq, dk, dv, _, *dsinks_s = scaled_dot_product_attention_backward(
            dout[rows].transpose(1, 0, 2), query[rows].transpose(1, 0, 2),
            key[keys].transpose(1, 0, 2), value[keys].transpose(1, 0, 2), keep=keep_s,
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            causal_alignment=causal_alignment, window=window, alibi_slopes=slopes,
            softcap=softcap, sinks=sinks)
        dquery[rows], dkey[keys], dvalue[keys] = (g.transpose(1, 0, 2) for g in (dq, dk, dv))
        if dsinks_s:
            dsinks += dsinks_s[0]
    if sinks is None:
        return dquery, dkey, dvalue
    return dquery, dkey, dvalue, dsinks


def scaled_dot_product_attention_with_kv_cache(query, key_cache, value_cache, cache_length,
                                               key=None, value=None, is_causal=False,
                                               scale=None, enable_gqa=False):
    """The decode step against a KV cache: ``(output, logsumexp, key_cache', value_cache')``.

    The caches after the write are copies with key and value (if given) at positions
    cache_length .. cache_length + L; the n = cache_length (+ L) live keys are then attended
    as scaled_dot_product_attention_forward(query, key_cache'[..., :n, :], value_cache'[...,
    :n, :], is_causal=is_causal, causal_alignment="bottom-right").
    Shapes: query (..., H, L, E) · key_cache (..., Hkv, Smax, E) · value_cache (..., Hkv,
    Smax, Ev) · key (..., Hkv, L, E) · value (..., Hkv, L, Ev) -> output (..., H, L, Ev),
    logsumexp (..., H, L), and the caches' shapes.
    """
    key_cache, value_cache = key_cache.copy(), value_cache.copy()
    n = cache_length
    if key is not None:
        n += query.shape[-2]
        key_cache[..., cache_length:n, :] = key
        value_cache[..., cache_length:n, :] = value
    output, logsumexp = scaled_dot_product_attention_forward(
        query, key_cache[..., :n, :], value_cache[..., :n, :], is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, causal_alignment="bottom-right")
    return output, logsumexp, key_cache, value_cache


# ------------------------------------------------------------------------- embedding

def embedding_forward(indices, weight, padding_idx=None):
    """out = weight[indices]: each index picks its row of the table.

    Shapes: indices (...) integer in [0, V) · weight (V, E) -> (..., E). ``padding_idx`` only
    matters to backward.
    """
    return weight[indices]


def embedding_backward(dout, indices, weight, padding_idx=None):
    """dweight[v] = Σ_{p : indices[p] = v} dout[p], and zero for the row ``padding_idx``.

    Shapes: dout (..., E) · indices (...) -> dweight (V, E)
    """
    dweight = np.zeros(weight.shape)
    np.add.at(dweight, indices.reshape(-1), dout.reshape(indices.size, weight.shape[1]))
    if padding_idx is not None:
        dweight[padding_idx] = 0.0                       # negative counts from the end
    return dweight


# ------------------------------------------------------------------------- cross-entropy

def _classes_last(input, target):
    """input as rows (M, C) and target as (M,): classes on axis 1 (axis 0 of a 1-D input)."""
    x = np.moveaxis(input, 1, -1) if input.ndim > 1 else input          # (N, d..., C)
    rows = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1])           # (M, C)
    return rows, np.asarray(target).reshape(-1)                         # (M,)


def _log_softmax_rows(x):
    """log p_c = x_c - m - log Σ_k exp(x_k - m) along the last axis; NaN for a row of -inf,
    as torch.log_softmax (unlike this module's ``log_softmax_forward``)."""
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def cross_entropy_forward(input, target, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0):
    """torch.nn.functional.cross_entropy with class-index targets.

    loss_i = (1 - ε)·(-log p_{i, t_i}) + ε·mean_c(-log p_{i, c}),  log p = log_softmax(input)
    over the classes, ε = label_smoothing (the second term only when ε > 0); 0 where
    t_i == ignore_index. "mean" divides Σ_i loss_i by the number of targets not ignored.
    Shapes: input (C,), (N, C), (N, C, d...) · target (), (N,), (N, d...) -> target's shape or ()
    """
    x, t = _classes_last(input, target)                  # (M, C), (M,)
    n_classes = x.shape[-1]
    ignored = t == ignore_index                          # (M,)
    logp = _log_softmax_rows(x)                          # (M, C)
    is_target = np.arange(n_classes) == t[:, None]       # (M, C) one-hot
    loss = -np.sum(np.where(is_target, logp, 0.0), axis=-1)           # -log p_t  (M,)
    if label_smoothing > 0:
        with np.errstate(invalid="ignore", divide="ignore"):     # C = 0: all rows ignored
            smooth = np.sum(-logp, axis=-1) / n_classes           # mean_c(-log p_c)
            loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    loss = np.where(ignored, 0.0, loss)
    if reduction == "none":
        return loss.reshape(np.shape(target))
    if reduction == "sum":
        return np.sum(loss)
    with np.errstate(invalid="ignore"):
        return np.sum(loss) / np.sum(~ignored)           # 0/0 = NaN when all are ignored


def cross_entropy_backward(dout, input, target, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0):
    """dinput_{i, c} = g_i·(p_{i, c} - (1 - ε)·[c = t_i] - ε/C), zero where t_i is ignored.

    g_i = dout_i ("none"), dout ("sum") or dout / #(targets not ignored) ("mean").
    Shapes: dout (target's shape or ()) -> dinput of input's shape
    """
    x, t = _classes_last(input, target)                  # (M, C), (M,)
    n_classes = x.shape[-1]
    ignored = t == ignore_index
    p = np.exp(_log_softmax_rows(x))                     # softmax (M, C)
    is_target = np.arange(n_classes) == t[:, None]       # (M, C)
    if reduction == "none":
        g = np.reshape(dout, -1)
    elif reduction == "sum":
        g = np.full(t.shape, float(dout))
    else:
        count = np.sum(~ignored)
        g = np.full(t.shape, float(dout) / count if count else 0.0)
    uniform = label_smoothing / n_classes if n_classes else 0.0   # C = 0: every row ignored
    with np.errstate(invalid="ignore"):
        drows = g[:, None] * (p - (1 - label_smoothing) * is_target - uniform)
    drows = np.where(ignored[:, None], 0.0, drows)       # (M, C)
    if input.ndim <= 2:
        return drows.reshape(input.shape)
    moved = (input.shape[0],) + input.shape[2:] + (input.shape[1],)
    return np.moveaxis(drows.reshape(moved), -1, 1)


# ------------------------------------------------------------------------- layer norm

def _layer_norm_axes(x, normalized_shape):
    k = 1 if np.ndim(normalized_shape) == 0 else len(normalized_shape)
    return tuple(range(x.ndim - k, x.ndim))


def _mean(a, axes):
    """The mean over ``axes``, keeping them; NaN (quietly) over zero entries."""
    count = int(np.prod([a.shape[i] for i in axes]))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sum(a, axis=axes, keepdims=True) / count


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """y = (x - μ)/√(σ² + eps) ∘ weight + bias; μ, σ² the mean and biased variance over the
    trailing dims ``normalized_shape``.
    Shapes: x (..., *normalized_shape) · weight, bias (*normalized_shape) -> x's shape
    """
    axes = _layer_norm_axes(x, normalized_shape)
    mean = _mean(x, axes)
    var = _mean((x - mean) ** 2, axes)
    y = (x - mean) / np.sqrt(var + eps)                  # x̂
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def layer_norm_backward(dout, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """dx = (ĝ - mean(ĝ) - x̂ ∘ mean(ĝ ∘ x̂))/√(σ² + eps) with ĝ = dout ∘ weight;
    dweight = Σ_samples dout ∘ x̂, dbias = Σ_samples dout (None when absent).
    """
    axes = _layer_norm_axes(x, normalized_shape)
    lead = tuple(range(x.ndim - len(axes)))
    mean = _mean(x, axes)
    rstd = 1 / np.sqrt(_mean((x - mean) ** 2, axes) + eps)
    xhat = (x - mean) * rstd
    ghat = dout if weight is None else dout * weight
    dx = rstd * (ghat - _mean(ghat, axes) - xhat * _mean(ghat * xhat, axes))
    dweight = None if weight is None else np.sum(dout * xhat, axis=lead)
    dbias = None if bias is None else np.sum(dout, axis=lead)
    return dx, dweight, dbias


# ------------------------------------------------------------------------- GELU

GELU_APPROXIMATIONS = ("none", "tanh")
_erfc = np.vectorize(math.erfc, otypes=[np.float64])     # float64, ~1 ulp (the C library's)


def _gelu_parts(x, approximate):
    """(Φ, Φ') of GELU(x) = x·Φ(x), elementwise in float64.

    "none": Φ(x) = ½·(1 + erf(x/√2)), the normal CDF, written ½·erfc(−x/√2) -- the same
    function, without the cancellation of 1 + erf(x/√2) ≈ 0 for x ≪ 0 -- and Φ' = φ, the
    normal density exp(−x²/2)/√(2π).
    "tanh": Φ(x) = ½·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³), written 1/(1 + exp(−2u))
    (again the same function), and Φ' = ½·(1 − tanh²(u))·u' = 2·Φ·(1 − Φ)·u'.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if approximate == "none":
            cdf = 0.5 * _erfc(-x / math.sqrt(2.0))
            pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        else:
            u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
            e = np.exp(-2.0 * np.abs(u))                     # ≤ 1: no overflow
            cdf = np.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
            du = math.sqrt(2.0 / math.pi) * (1.0 + 3.0 * 0.044715 * x * x)
            pdf = 2.0 * e / (1.0 + e) ** 2 * du               # 2·Φ·(1 − Φ)·u'
            pdf = np.where(np.isnan(x), np.nan, np.where(e == 0, 0.0, pdf))   # inf·0 at |x|≫1
    return cdf, pdf


def gelu_forward(x, approximate="none"):
    """GELU(x) = x·Φ(x), Φ the standard normal CDF ("none") or PyTorch's tanh approximation
    ½·(1 + tanh(√(2/π)·(x + 0.044715·x³))) ("tanh"). GELU(−inf) = −0 (the limit), +inf = +inf.
    Shapes: x (...) -> (...)
    """
    x = np.asarray(x, dtype=np.float64)
    cdf, _ = _gelu_parts(x, approximate)
    with np.errstate(invalid="ignore"):
        return np.where(cdf == 0, -0.0, x * cdf)             # −inf·0: the limit, −0

def gelu_backward(dout, x, approximate="none"):
    """dx = dout ∘ (Φ(x) + x·Φ'(x)); the x·Φ' term is 0 where Φ' underflows (|x| ≫ 1, ±inf).
    Shapes: dout, x (...) -> dx (...)
    """
    x = np.asarray(x, dtype=np.float64)
    cdf, pdf = _gelu_parts(x, approximate)
    with np.errstate(invalid="ignore"):
        return dout * (cdf + np.where(pdf == 0, 0.0, x * pdf))


# ------------------------------------------------------------------------- rotary embedding

def _rotary_pairs(x, interleaved):
    """(a, b): the two entries of each pair along the last axis, as views."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]                    # (x[2k], x[2k + 1])
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]                            # (x[k], x[k + E/2])


def rotary_embedding_forward(x, cos, sin, interleaved=False):
    """RoPE: each pair (a, b) at position l rotated by θ[l, k]: a·cos θ − b·sin θ and
    b·cos θ + a·sin θ. Halves (GPT-NeoX, LLaMA) or adjacent pairs (``interleaved``, GPT-J).
    Shapes: x (..., L, E) · cos, sin (L, E/2) -> (..., L, E)
    """
    x = np.asarray(x)
    a, b = _rotary_pairs(x, interleaved)
    out = np.empty(x.shape, np.result_type(x, cos, sin))
    out_a, out_b = _rotary_pairs(out, interleaved)
    out_a[...] = a * cos - b * sin
    out_b[...] = b * cos + a * sin
    return out


def rotary_embedding_backward(dout, cos, sin, interleaved=False):
    """dx = rotation of dout by −θ (the transpose of the rotation): g_a·cos θ + g_b·sin θ and
    g_b·cos θ − g_a·sin θ. cos and sin get no gradient.
    Shapes: dout (..., L, E) · cos, sin (L, E/2) -> dx (..., L, E)
    """
    return rotary_embedding_forward(dout, cos, -np.asarray(sin), interleaved)
