"""Rotary position embedding as a module: the tables cos θ, sin θ and their use on queries and
keys (the functional op is ``npattn.rotary_embedding``)."""
import numpy as np

from .. import _checks
from ..functional.rotary import rotary_embedding_backward, rotary_embedding_forward
from .module import Module


def rotary_tables(dim, max_len, base=10000.0):
    """cos θ and sin θ in float64, θ[pos, k] = pos·inv_freq[k], inv_freq[k] = base^(−2k/dim).
    Shapes: -> cos, sin (max_len, dim/2)"""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)   # (dim/2,)
    theta = np.outer(np.arange(max_len, dtype=np.float64), inv_freq)      # (max_len, dim/2)
    return np.cos(theta), np.sin(theta)


class RotaryEmbedding(Module):
    """RoPE: rotates each pair of x's last axis at position p by θ[p, k] = p·base^(−2k/dim).

        out_a = a·cos θ − b·sin θ,   out_b = b·cos θ + a·sin θ

    pair k = (x[k], x[k + dim/2]) (``interleaved=False``: GPT-NeoX, LLaMA) or (x[2k], x[2k+1])
    (``interleaved=True``: GPT-J). Applied to queries and keys (not values) before attention,
    it makes each score depend on the positions through i − j only.

    Shapes: x (..., L, dim) -> out (..., L, dim); cos, sin (max_len, dim/2)

    The tables are computed in float64 and rounded once to ``dtype`` (float32 by default; ``to``
    computes them again for the new dtype). They are buffers, not parameters, and not
    persistent: fixed by (dim, max_len, base), they stay out of ``state_dict()``, as the
    tables of PyTorch implementations do (Hugging Face's ``inv_freq``). ``forward(x,
    offset=0)`` uses positions offset .. offset + L − 1 (``offset``: the tokens already in a
    KV cache when decoding), which must end by max_len. ``backward(dout)`` returns dx = dout
    rotated by −θ at the last forward's positions; dout may have other leading dims than that
    forward's x (a query's heads and a key's, under grouped-query attention), the same L.
    """

    def __init__(self, dim, max_len, base=10000.0, interleaved=False, *, dtype=np.float32):
        super().__init__()
        self.dim = _checks.size("dim", dim, 2)
        if self.dim % 2:
            raise ValueError(f"dim must be even (pairs of entries are rotated); got {dim}")
        self.max_len = _checks.size("max_len", max_len)
        self.base = _checks.positive_real("base", base)
        self.interleaved = _checks.flag("interleaved", interleaved)
        self._build(_checks.float_dtype(dtype))

    def _build(self, dtype):
        cos, sin = rotary_tables(self.dim, self.max_len, self.base)         # float64
        self.register_buffer("cos", cos.astype(dtype), persistent=False)    # (max_len, dim/2)
        self.register_buffer("sin", sin.astype(dtype), persistent=False)

    def to(self, dtype):
        """The tables computed again in float64 and rounded to ``dtype`` (not a cast of the
        old ones, which would keep float32's rounding in float64); returns self."""
        super().to(dtype)
        self._build(_checks.float_dtype(dtype))
        return self

    def _tables(self, name, x, offset):
        offset = _checks.rotary_positions(name, x, self.dim, offset, self.max_len,
                                          "RotaryEmbedding")
        rows = slice(offset, offset + x.shape[-2])
        return offset, self.cos[rows], self.sin[rows]                        # (L, dim/2)

    def forward(self, x, offset=0):
        x = _checks.float_input("x", x, self.cos.dtype, "RotaryEmbedding")
        offset, cos, sin = self._tables("x", x, offset)
        out = rotary_embedding_forward(x, cos, sin, self.interleaved)        # (..., L, dim)
        self._saved = (offset, x.shape[-2])
        return out

    def backward(self, dout):
        """dx = dout rotated by −θ at the last forward's positions (no parameters)."""
        offset, length = self._saved_for_backward()
        dout = _checks.float_input("dout", dout, self.cos.dtype, "RotaryEmbedding")
        _checks.min_ndim("dout", dout, 2, f"(..., {length}, {self.dim})")
        if dout.shape[-2:] != (length, self.dim):
            raise ValueError(f"dout must have shape (..., {length}, {self.dim}) to match the "
                             f"last forward's x (..., {length}, {self.dim}); got {dout.shape}")
        _, cos, sin = self._tables("dout", dout, offset)
        return rotary_embedding_backward(dout, cos, sin, self.interleaved)   # (..., L, dim)

    def extra_repr(self):
        return (f"dim={self.dim}, max_len={self.max_len}, base={self.base}, "
                f"interleaved={self.interleaved}")
