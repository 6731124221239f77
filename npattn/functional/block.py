"""A decoded position through a pre-LayerNorm transformer block (nanoGPT's ``Block``), fused:
generation's step, one call per layer per new token.

    h  = layer_norm(x; ln_1)                          x (B, C): each row one new position
    q, k, v = heads(h·W_attnᵀ + b_attn)               (B, nh, 1, hs) each; k, v go into the
                                                      caches at ``position``
    x1 = x + heads⁻¹(attention(q, cached keys and values 0 .. position))·W_projᵀ + b_proj
    x2 = x1 + gelu(layer_norm(x1; ln_2)·W_fcᵀ + b_fc)·W_outᵀ + b_out       (exact GELU)

Why a function of its own: a decoded token is one row per sequence, so each op of the block is a
few µs of kernel behind several µs of module and argument-check Python (measured on a Zen 3,
the baby GPT's decode step, 4 layers: 640-700 µs per token through the modules, 330-380 µs
through the kernels the modules reach). Here the block's arguments are checked once per call
and each op then runs exactly what its functional op runs on the same shapes -- the same
kernel, its serial twin or not, on the same values -- so the result is bitwise the modules'
(``tests/test_block_decode.py`` holds it). Inference only: no dropout, nothing saved.
"""
import collections
import math

import numpy as np

from .. import _checks
from ..kernels.gelu import gelu_forward_kernel
from ..kernels.tiles import engine
from .attention import _with_kv_cache, split_heads
from .gelu import _sized
from .layer_norm import _forward_rows

#: The twelve arrays of one block, by nanoGPT's module names (``ln_1.weight`` ...,
#: ``attn.c_attn.weight``, ``attn.c_proj.weight``, ``mlp.c_fc.weight``, ``mlp.c_proj.weight``).
#: Shapes, C = n_embd and F the MLP's width (4C in nanoGPT): ln_1, ln_2 (C,); attn (3C, C) and
#: (3C,); attn_proj (C, C) and (C,); fc (F, C) and (F,); mlp_proj (C, F) and (C,). Any bias, or a
#: layer norm's weight, may be None (``bias=False``: none; a missing weight is ones).
BlockWeights = collections.namedtuple("BlockWeights", (
    "ln_1_weight", "ln_1_bias", "attn_weight", "attn_bias", "attn_proj_weight",
    "attn_proj_bias", "ln_2_weight", "ln_2_bias", "fc_weight", "fc_bias", "mlp_proj_weight",
    "mlp_proj_bias"))


def block_decode(x, weights, key_cache, value_cache, position, n_head, eps=1e-5):
    """x2 (B, C) of the block for x (B, C), one new position per row at ``position``, after
    writing its keys and values into ``key_cache`` and ``value_cache`` (B, nh, Smax, hs) there.

    Attention is causal over the cache: each row sees positions 0 .. position (the earlier ones
    already in the caches), scale 1/√hs, as ``Block.forward(x, cache, position)`` runs it.
    ``weights``: a :data:`BlockWeights` (or a sequence of its twelve fields); ``eps`` both layer
    norms'. Returns a new array; x and the weights are not written.
    """
    x, weights, n_head, position, eps = _checks.block_decode_args(
        x, weights, key_cache, value_cache, position, n_head, eps)
    (ln_1_w, ln_1_b, attn_w, attn_b, proj_w, proj_b, ln_2_w, ln_2_b, fc_w, fc_b, out_w,
     out_b) = weights
    batch, width = x.shape
    hs = width // n_head
    gemm = engine("gemm", x.dtype).gemm                       # (tiles.gemm's, looked up once)
    h = _layer_norm(x, ln_1_w, ln_1_b, eps)                   # (B, C)
    qkv = _linear(gemm, h, attn_w, attn_b)                    # (B, 3C)
    # q, k, v (B, nh, 1, hs): split_heads' layout; one row already is it (views, as the GPT's
    # own decode step takes them)
    q, k, v = (qkv.reshape(3, 1, n_head, 1, hs) if batch == 1 else
               split_heads(qkv[:, None], n_head, True, parts=3))
    scale = 1.0 / math.sqrt(hs)                               # (_checks.kv_cache_args' default)
    y, _ = _with_kv_cache(q, key_cache, value_cache, k, v, position + 1, True, scale)
    x1 = _linear(gemm, y.reshape(batch, width), proj_w, proj_b)     # (B, C): heads side by side
    x1 += x
    f = _linear(gemm, _layer_norm(x1, ln_2_w, ln_2_b, eps), fc_w, fc_b)   # (B, F)
    g = np.empty_like(f)
    _sized(gelu_forward_kernel, f.size)(f.reshape(-1), False, g.reshape(-1))
    x2 = _linear(gemm, g, out_w, out_b)                       # (B, C)
    x2 += x1
    return x2


def _layer_norm(rows, weight, bias, eps):
    out = np.empty_like(rows)
    stats = np.empty((2, rows.shape[0]), np.float64)          # mean, rstd (not kept)
    _forward_rows(rows, weight, bias, eps, out, stats[0], stats[1])
    return out


def _linear(gemm, rows, weight, bias):
    out = np.empty((rows.shape[0], weight.shape[0]), rows.dtype)
    gemm(rows, weight, out, bias=bias, trans_b=True)          # rows·Wᵀ + b, as linear_forward
    return out
