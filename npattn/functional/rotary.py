"""Rotary position embedding (RoPE, Su et al. 2021): each pair of entries of a query or key
row rotated by angles that grow with its position, so that the score q_rot(i)·k_rot(j) depends
on the positions only through i − j.

Two layouts of the pairs, as the models write them: ``interleaved=False`` rotates the two
halves, pair k = (x[k], x[k + E/2]) (GPT-NeoX, LLaMA, Hugging Face's ``rotate_half``);
``interleaved=True`` adjacent entries, pair k = (x[2k], x[2k + 1]) (GPT-J, the paper's).
``nn.RotaryEmbedding`` builds the tables cos θ, sin θ.

Arithmetic in the input dtype, each product rounded and then the sum (no fused multiply-add):
NumPy's bits for ``a*c - b*s``, at any thread count. NaN and ±inf follow IEEE arithmetic of
the formula, as in PyTorch: an infinite entry gives NaN where its partner's sin θ is 0
(inf·0, at position 0).
"""
import math

import numpy as np

from .. import _checks
from ..kernels.rotary import BLOCK, rotary_kernel


def _rotate(x, cos, sin, interleaved, inverse):
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])          # (R, E)
    out = np.empty_like(rows)
    kernel = rotary_kernel.serial if rows.size <= BLOCK else rotary_kernel   # one block: no launch
    kernel(rows, cos, sin, interleaved, inverse, out)
    return out.reshape(x.shape)                                     # (..., L, E)


def rotary_embedding_forward(x, cos, sin, interleaved=False):
    """Each pair (a, b) of x's last axis at position l rotated by θ[l, k]:

        out_a = a·cos θ − b·sin θ,   out_b = b·cos θ + a·sin θ

    pair k = (x[k], x[k + E/2]) (``interleaved=False``: GPT-NeoX, LLaMA) or (x[2k], x[2k + 1])
    (``interleaved=True``: GPT-J).

    Shapes: x (..., L, E), E even · cos, sin (L, E/2), broadcast over x's leading dims ->
    out (..., L, E), in x's dtype (cos and sin must have it too)
    """
    x, cos, sin, interleaved = _checks.rotary_args(x, cos, sin, interleaved)
    return _rotate(x, cos, sin, interleaved, inverse=False)


def rotary_embedding_backward(dout, cos, sin, interleaved=False):
    """dx = the rotation of dout by −θ (a rotation's inverse is its transpose):

        dx_a = g_a·cos θ + g_b·sin θ,   dx_b = g_b·cos θ − g_a·sin θ    (g = dout's pair)

    Only x gets a gradient: cos and sin are tables of fixed angles (nn.RotaryEmbedding's
    buffers), so none is returned for them.

    Shapes: dout (..., L, E) · cos, sin (L, E/2) -> dx (..., L, E)
    """
    dout, cos, sin, interleaved = _checks.rotary_backward_args(dout, cos, sin, interleaved)
    return _rotate(dout, cos, sin, interleaved, inverse=True)


rotary_embedding = rotary_embedding_forward
