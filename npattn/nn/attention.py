"""Attention modules: the article's single head (``SelfAttention``) and PyTorch's
``MultiheadAttention``, both on the fused engine of ``functional/attention.py``.
"""
import numpy as np

from .. import _checks
from ..functional.attention import (attention, attention_backward, merge_heads,
                                    scaled_dot_product_attention_backward,
                                    scaled_dot_product_attention_forward, split_heads)
from ..functional.linear import linear_backward, linear_forward
from . import init
from .dropout import draw_seed
from .linear import Linear
from .module import Module, Parameter


class SelfAttention(Module):
    """The article's self-attention head: three linear maps of the same X, then attention.

        Q = X·W_Qᵀ + b_Q,   K = X·W_Kᵀ + b_K,   V = X·W_Vᵀ + b_V     (the article's W_Q = nn.Linear)
        scores = Q·Kᵀ / √d_k                   (row t: how much token t attends to each token)
        weights = dropout(softmax(scores))     (each row sums to 1 before dropout: p_attn)
        output = weights · V                   (row t: token t's context-weighted new vector)

    Shapes: x (B, L, d_model) or (L, d_model) -> output (..., L, d_v), weights (..., L, L);
    W_Q.weight, W_K.weight (d_k, d_model), W_V.weight (d_v, d_model)

    ``mask`` is npattn.attention's: bool (True = attend; the article's ``mask == 0`` are the
    masked ones) or float (added to the scores), broadcastable to (..., L, L); ``is_causal``
    lets token t see tokens 0..t only. A fully masked row gives a zero output row.

    ``dropout`` (the probability) applies to the weights in training mode, with a seed drawn
    per forward from ``numpy.random.Generator(seed)``. The weights come back after dropout, as
    the article's ``p_attn``. ``rng`` initialises W_Q, W_K, W_V (in that order) as nn.Linear.
    ``backward(dout)`` returns dx = the sum of the three projections' input gradients.
    """

    def __init__(self, d_model, d_k, d_v=None, bias=True, *, dropout=0.0, dtype=np.float32,
                 rng=None, seed=None):
        super().__init__()
        self.d_model = _checks.size("d_model", d_model, 1)
        self.d_k = _checks.size("d_k", d_k, 1)
        self.d_v = self.d_k if d_v is None else _checks.size("d_v", d_v, 1)
        bias = _checks.flag("bias", bias)
        self.dropout = _checks.probability("dropout", dropout)
        dtype = _checks.float_dtype(dtype)
        gen = _checks.generator(rng)
        self.W_Q = Linear(self.d_model, self.d_k, bias, dtype=dtype, rng=gen)
        self.W_K = Linear(self.d_model, self.d_k, bias, dtype=dtype, rng=gen)
        self.W_V = Linear(self.d_model, self.d_v, bias, dtype=dtype, rng=gen)
        self._generator = _checks.generator(seed, "seed")

    def forward(self, x, mask=None, is_causal=False):
        """``(output, weights)``; see the class docstring."""
        x = _checks.float_input("x", x, self.W_Q.weight.dtype, "SelfAttention")
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, L, {self.d_model}) or (L, {self.d_model}) "
                             f"to match d_model; got {x.shape}")
        q = self.W_Q(x)                                            # (..., L, d_k)
        k = self.W_K(x)                                            # (..., L, d_k)
        v = self.W_V(x)                                            # (..., L, d_v)
        p = self.dropout if self.training else 0.0
        seed = draw_seed(self._generator) if p > 0 else None
        output, weights, lse = attention(q, k, v, mask, dropout_p=p, is_causal=is_causal,
                                         seed=seed, return_logsumexp=True)
        self._saved = (q, k, v, mask, p, is_causal, seed, output, lse)
        return output, weights                                     # (..., L, d_v), (..., L, L)

    def backward(self, dout):
        """dx = dQ·W_Q + dK·W_K + dV·W_V; adds the three projections' parameter gradients."""
        q, k, v, mask, p, is_causal, seed, output, lse = self._saved_for_backward()
        dq, dk, dv = attention_backward(dout, q, k, v, mask, dropout_p=p, is_causal=is_causal,
                                        seed=seed, output=output, logsumexp=lse)
        return self.W_Q.backward(dq) + self.W_K.backward(dk) + self.W_V.backward(dv)

    def extra_repr(self):
        return (f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}, "
                f"dropout={self.dropout}")


# ------------------------------------------------------------------ multi-head attention

def _mask_array(name, mask, dtype):
    """A PyTorch MHA mask: bool (True = ignore) or a float array of the module's dtype."""
    mask = _checks.converted(name, mask, f"a bool or {dtype} array")
    if mask.dtype != np.bool_ and mask.dtype != dtype:
        raise TypeError(f"{name} must have dtype bool (True = ignore) or {dtype} (added to "
                        f"the scores, as the module's parameters); got {mask.dtype}")
    return mask


def _pad_keys(mask, extra):
    """Append ``extra`` key columns that every query may see (False = not ignored, or +0)."""
    if not extra:
        return mask
    return np.concatenate([mask, np.zeros(mask.shape[:-1] + (extra,), mask.dtype)], axis=-1)


class MultiheadAttention(Module):
    """``torch.nn.MultiheadAttention``: num_heads attentions side by side on learned projections.

        Q = query·W_qᵀ + b_q,  K = key·W_kᵀ + b_k,  V = value·W_vᵀ + b_v   (W_q, W_k, W_v: the
            three (E, ·) blocks of in_proj_weight, or q/k/v_proj_weight when kdim or vdim != E)
        head h = dropout(softmax(Q_h·K_hᵀ/√D + mask)) · V_h    (Q_h: columns h·D..(h+1)·D - 1)
        attn_output = concat(head 0, ..., head H-1)·W_outᵀ + b_out          (out_proj)

    Shapes: query (L, N, E), key (S, N, kdim), value (S, N, vdim) -- (N, L, E) etc. with
    batch_first, (L, E) etc. unbatched -> attn_output in query's layout; attn_weights
    (N, L, S) averaged over heads, (N, H, L, S) per head (unbatched: no N). E = embed_dim,
    H = num_heads, D = E / H.

    Parameters have PyTorch's names, shapes and initialisation, so ``{k: v.numpy() for k, v in
    torch_mha.state_dict().items()}`` loads: ``in_proj_weight`` (3E, E) xavier-uniform when
    kdim = vdim = E, else ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim),
    ``v_proj_weight`` (E, vdim); ``in_proj_bias`` (3E,) zeros; ``bias_k``, ``bias_v`` (1, 1, E)
    xavier-normal with ``add_bias_kv``; ``out_proj.weight`` (E, E) as nn.Linear's,
    ``out_proj.bias`` zeros. ``add_bias_kv`` appends bias_k, bias_v as one more key and value
    (after the projections), ``add_zero_attn`` a zero key and value: S grows by one each.

    Masks follow PyTorch's rule for this module, the inverse of scaled_dot_product_attention's:
    ``attn_mask`` (L, S) or (N·H, L, S) (unbatched: (H, L, S)) and ``key_padding_mask`` (N, S)
    (unbatched: (S,)) are bool with True = NOT allowed to attend, or float, added to the scores;
    both together add up (bool ones become 0 / -inf first, unless both are bool).

    ``is_causal=True``: PyTorch treats it as a hint that attn_mask is the causal mask and
    raises without one. Here attn_mask=None with is_causal applies the top-left causal mask
    (key j visible to query i iff j <= i); with an attn_mask, the causal mask is applied on
    top of it (for the causal attn_mask the hint promises, that changes nothing, and lets the
    engine skip the key blocks above the diagonal) -- except with add_bias_kv/add_zero_attn,
    where the attn_mask alone is used: the appended key stays visible to every query.

    Differences from PyTorch, by design: a query row whose every key is masked gives a zero
    head output (so attn_output's row is out_proj.bias) and zero gradients, where PyTorch gives
    NaN; dropout masks come from npattn's seeded generator, not torch's.

    ``need_weights=False`` runs the fused engine (output and one logsumexp per row; no L×S
    matrix is stored); ``need_weights=True`` also writes the weights (N, H, L, S), after
    dropout (as PyTorch returns them). Both keep the output and logsumexp for backward, which
    runs the forward again only for rows whose |logsumexp| > 512 (functional/attention.py,
    LSE_EXACT). Dropout (the probability ``dropout``) is active in training mode only, with a
    seed drawn per forward from ``numpy.random.Generator(seed)``.

    ``backward(dout)`` takes the gradient of attn_output (the weights carry none) and returns
    ``(dquery, dkey, dvalue)`` in the inputs' shapes, adding every parameter's gradient. When
    the same array was passed as query, key and value (self-attention), its gradient is
    ``dquery + dkey + dvalue``: the caller adds them, as autograd would.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, *,
                 dtype=np.float32, rng=None, seed=None):
        super().__init__()
        self.embed_dim = _checks.size("embed_dim", embed_dim, 1)
        self.num_heads = _checks.size("num_heads", num_heads, 1)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads; got embed_dim = "
                             f"{self.embed_dim}, num_heads = {self.num_heads}")
        self.head_dim = self.embed_dim // self.num_heads
        self.kdim = self.embed_dim if kdim is None else _checks.size("kdim", kdim, 1)
        self.vdim = self.embed_dim if vdim is None else _checks.size("vdim", vdim, 1)
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        self.dropout = _checks.probability("dropout", dropout)
        bias = _checks.flag("bias", bias)
        add_bias_kv = _checks.flag("add_bias_kv", add_bias_kv)
        self.add_zero_attn = _checks.flag("add_zero_attn", add_zero_attn)
        self.batch_first = _checks.flag("batch_first", batch_first)
        dtype = _checks.float_dtype(dtype)
        gen = _checks.generator(rng)
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(init.xavier_uniform((3 * e, e), rng=gen, dtype=dtype))
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight = Parameter(init.xavier_uniform((e, e), rng=gen, dtype=dtype))
            self.k_proj_weight = Parameter(init.xavier_uniform((e, self.kdim), rng=gen,
                                                               dtype=dtype))
            self.v_proj_weight = Parameter(init.xavier_uniform((e, self.vdim), rng=gen,
                                                               dtype=dtype))
        self.in_proj_bias = Parameter(init.zeros((3 * e,), dtype=dtype)) if bias else None
        if add_bias_kv:
            self.bias_k = Parameter(init.xavier_normal((1, 1, e), rng=gen, dtype=dtype))
            self.bias_v = Parameter(init.xavier_normal((1, 1, e), rng=gen, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None
        self.out_proj = Linear(e, e, bias, dtype=dtype, rng=gen)
        if bias:
            self.out_proj.bias.data[...] = 0
        self._generator = _checks.generator(seed, "seed")

    # -------------------------------------------------------------- helpers
    def _projections(self):
        """(W_q, W_k, W_v) and (b_q, b_k, b_v): views into the parameters' data."""
        e = self.embed_dim
        if self.in_proj_weight is not None:
            w = self.in_proj_weight.data
            weights = (w[:e], w[e:2 * e], w[2 * e:])
        else:
            weights = (self.q_proj_weight.data, self.k_proj_weight.data, self.v_proj_weight.data)
        if self.in_proj_bias is None:
            return weights, (None, None, None)
        b = self.in_proj_bias.data
        return weights, (b[:e], b[e:2 * e], b[2 * e:])

    def _check_inputs(self, query, key, value):
        """Ranks and widths as PyTorch's _mha_shape_check; returns whether the call is batched."""
        layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
        if query.ndim not in (2, 3):
            raise ValueError(f"query must have shape {layout} or (L, E) unbatched; got "
                             f"{query.shape}")
        for name, x, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                               ("value", value, self.vdim)):
            if x.ndim != query.ndim or x.shape[-1] != width:
                what = "embed_dim" if name == "query" else name[0] + "dim"
                raise ValueError(f"{name} must be {query.ndim}-D like query with last dim "
                                 f"{width} ({what}); got {x.shape}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"value must have the sequence and batch dims of key "
                             f"{key.shape[:-1]}; got {value.shape}")
        batched = query.ndim == 3
        if batched:
            axis = 0 if self.batch_first else 1
            if key.shape[axis] != query.shape[axis]:
                raise ValueError(f"key must have query's batch size {query.shape[axis]} "
                                 f"(dim {axis}); got key {key.shape}, query {query.shape}")
        return batched

    def _mask(self, attn_mask, key_padding_mask, is_causal, n, length, n_keys, batched,
              extra, dtype):
        """The two PyTorch masks (True = ignore) as one mask for the engine (True = attend,
        or float added), broadcastable to (N, H, L, S + extra); and whether the engine should
        apply the causal mask itself."""
        heads = self.num_heads
        causal = is_causal
        if is_causal and extra and attn_mask is None:     # the extra keys stay visible
            attn_mask = np.arange(n_keys)[None, :] > np.arange(length)[:, None]   # (L, S)
        if is_causal and extra:
            causal = False                                # attn_mask says it (PyTorch's use)
        parts = []
        if attn_mask is not None:
            mask = _mask_array("attn_mask", attn_mask, dtype)
            if mask.ndim == 2 and mask.shape == (length, n_keys):
                mask = mask.reshape(1, 1, length, n_keys)                   # (1, 1, L, S)
            elif mask.ndim == 3 and mask.shape == (n * heads if batched else heads, length,
                                                   n_keys):
                mask = mask.reshape(n, heads, length, n_keys)                # (N, H, L, S)
            else:
                three = f"({n} * {heads}, {length}, {n_keys})" if batched else \
                    f"({heads}, {length}, {n_keys})"
                raise ValueError(f"attn_mask must have shape (L, S) = ({length}, {n_keys}) "
                                 f"or {'(N·H, L, S)' if batched else '(H, L, S)'} = {three}; "
                                 f"got {mask.shape}")
            parts.append(_pad_keys(mask, extra))
        if key_padding_mask is not None:
            mask = _mask_array("key_padding_mask", key_padding_mask, dtype)
            want = (n, n_keys) if batched else (n_keys,)
            if mask.shape != want:
                raise ValueError(f"key_padding_mask must have shape "
                                 f"{'(N, S)' if batched else '(S,)'} = {want}; got {mask.shape}")
            parts.append(_pad_keys(mask.reshape(n, 1, 1, n_keys), extra))  # (N, 1, 1, S)
        if not parts:
            return None, causal
        if all(m.dtype == np.bool_ for m in parts):
            ignored = parts[0] if len(parts) == 1 else parts[0] | parts[1]
            return ~ignored, causal                                 # True = attend
        added = [np.where(m, -np.inf, 0.0).astype(dtype) if m.dtype == np.bool_ else m
                 for m in parts]
        return (added[0] if len(added) == 1 else added[0] + added[1]), causal

    # -------------------------------------------------------------- forward and backward
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """``(attn_output, attn_weights)``, attn_weights None unless need_weights; see the
        class docstring for shapes and masks."""
        dtype = self.out_proj.weight.dtype
        query = _checks.float_input("query", query, dtype, "MultiheadAttention")
        key = _checks.float_input("key", key, dtype, "MultiheadAttention")
        value = _checks.float_input("value", value, dtype, "MultiheadAttention")
        need_weights = _checks.flag("need_weights", need_weights)
        average_attn_weights = _checks.flag("average_attn_weights", average_attn_weights)
        is_causal = _checks.flag("is_causal", is_causal)
        batched = self._check_inputs(query, key, value)
        batch_first = batched and self.batch_first
        if not batched:                            # (L, E) is (L, 1, E) in the (L, N, E) layout
            query, key, value = (x.reshape(x.shape[0], 1, x.shape[1])
                                 for x in (query, key, value))
        if batch_first:
            n, length = query.shape[:2]
            n_keys = key.shape[1]
        else:
            length, n = query.shape[:2]
            n_keys = key.shape[0]
        heads, width = self.num_heads, self.head_dim

        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projections()
        q = split_heads(linear_forward(query, w_q, b_q), heads, batch_first)   # (N, H, L, D)
        k = split_heads(linear_forward(key, w_k, b_k), heads, batch_first)     # (N, H, S, D)
        v = split_heads(linear_forward(value, w_v, b_v), heads, batch_first)   # (N, H, S, D)
        extra = 0
        if self.bias_k is not None:
            k = np.concatenate([k, np.broadcast_to(self.bias_k.data.reshape(1, heads, 1, width),
                                                   (n, heads, 1, width))], axis=2)
            v = np.concatenate([v, np.broadcast_to(self.bias_v.data.reshape(1, heads, 1, width),
                                                   (n, heads, 1, width))], axis=2)
            extra += 1
        if self.add_zero_attn:
            k = np.concatenate([k, np.zeros((n, heads, 1, width), dtype)], axis=2)
            v = np.concatenate([v, np.zeros((n, heads, 1, width), dtype)], axis=2)
            extra += 1                                                        # k, v (N, H, S', D)
        mask, causal = self._mask(attn_mask, key_padding_mask, is_causal, n, length, n_keys,
                                  batched, extra, dtype)
        p = self.dropout if self.training else 0.0
        seed = draw_seed(self._generator) if p > 0 else None
        if need_weights:                                    # weights (N, H, L, S')
            heads_out, weights, lse = attention(q, k, v, mask, dropout_p=p, is_causal=causal,
                                                seed=seed, return_logsumexp=True)
        else:
            heads_out, lse = scaled_dot_product_attention_forward(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, seed=seed)
            weights = None                                  # heads_out (N, H, L, D), lse (N, H, L)
        output = self.out_proj(merge_heads(heads_out, batch_first))    # query's layout
        self._saved = (query, key, value, q, k, v, mask, causal, p, seed, heads_out, lse,
                       batch_first, batched, n_keys,
                       output.shape if batched else (length, self.embed_dim))
        if not batched:
            output = output.reshape(length, self.embed_dim)                 # (L, E)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(axis=1)                               # (N, L, S')
            if not batched:
                weights = weights[0]                                         # (H, L, S') or (L, S')
        return output, weights

    def backward(self, dout):
        """``(dquery, dkey, dvalue)`` from dout, the gradient of attn_output (its shape)."""
        (query, key, value, q, k, v, mask, causal, p, seed, heads_out, lse, batch_first,
         batched, n_keys, shape) = self._saved_for_backward()
        dtype = self.out_proj.weight.dtype
        dout = _checks.float_input("dout", dout, dtype, "MultiheadAttention")
        if dout.shape != shape:
            raise ValueError(f"dout must have shape {shape} to match attn_output; got "
                             f"{dout.shape}")
        if not batched:
            dout = dout.reshape(dout.shape[0], 1, dout.shape[1])             # (L, 1, E)
        dheads = split_heads(self.out_proj.backward(dout), self.num_heads, batch_first)
        dq, dk, dv = scaled_dot_product_attention_backward(
            dheads, q, k, v, heads_out, lse, attn_mask=mask, dropout_p=p, is_causal=causal,
            seed=seed)                                      # (N, H, L, D), (N, H, S', D) x2
        e = self.embed_dim
        if self.bias_k is not None:                         # key/value column S: the biases
            self.bias_k.accumulate(dk[:, :, n_keys].sum(axis=0).reshape(1, 1, e))
            self.bias_v.accumulate(dv[:, :, n_keys].sum(axis=0).reshape(1, 1, e))
        dk, dv = dk[:, :, :n_keys], dv[:, :, :n_keys]       # the zero key/value: no parameter
        weights, biases = self._projections()
        grads = [linear_backward(merge_heads(d, batch_first), x, w, b)
                 for d, x, w, b in zip((dq, dk, dv), (query, key, value), weights, biases)]
        if self.in_proj_weight is not None:
            self.in_proj_weight.accumulate(np.concatenate([g[1] for g in grads]))  # (3E, E)
        else:
            for param, g in zip((self.q_proj_weight, self.k_proj_weight, self.v_proj_weight),
                                grads):
                param.accumulate(g[1])
        if self.in_proj_bias is not None:
            self.in_proj_bias.accumulate(np.concatenate([g[2] for g in grads]))    # (3E,)
        if batched:
            return tuple(g[0] for g in grads)
        return tuple(g[0].reshape(g[0].shape[0], g[0].shape[2]) for g in grads)   # (L, E) ...

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
