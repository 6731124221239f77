"""Token and position embeddings: ``nn.Embedding`` and the Annotated Transformer's sinusoidal
``PositionalEncoding``. The article's input is their sum: each token's vector plus its
position's vector (the same width, so they add)."""
import math

import numpy as np

from .. import _checks
from ..functional.embedding import embedding_backward, embedding_forward
from . import init
from .dropout import Dropout
from .module import Module, Parameter


class Embedding(Module):
    """out = weight[indices], as ``torch.nn.Embedding``: a learned vector per token id.

    Shapes: indices (...) integer in [0, num_embeddings) -> out (..., embedding_dim);
    weight (num_embeddings, embedding_dim)

    ``weight`` starts N(0, 1) (drawn from ``rng``), as PyTorch's, with the ``padding_idx`` row
    zeroed; that row's gradient stays zero, so a padding token's vector never trains. A
    negative ``padding_idx`` counts from the end and is stored non-negative, as PyTorch does.
    ``backward(dout)`` returns None (indices have no gradient) and adds the weight's gradient:
    dweight[v] = Σ of dout over the positions whose index is v.
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, *, dtype=np.float32,
                 rng=None):
        super().__init__()
        self.num_embeddings = _checks.size("num_embeddings", num_embeddings)
        self.embedding_dim = _checks.size("embedding_dim", embedding_dim)
        if padding_idx is not None:
            padding_idx = _checks.int_value("padding_idx", padding_idx, "an int or None")
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx must be in [{-self.num_embeddings}, "
                                 f"{self.num_embeddings}) (num_embeddings = "
                                 f"{self.num_embeddings}); got {padding_idx}")
            padding_idx %= self.num_embeddings
        self.padding_idx = padding_idx
        weight = init.normal((self.num_embeddings, self.embedding_dim), rng=_checks.generator(rng),
                             dtype=_checks.float_dtype(dtype))
        if padding_idx is not None:
            weight[padding_idx] = 0
        self.weight = Parameter(weight)

    def forward(self, indices):
        indices = np.array(_checks.index_array("indices", indices))   # a copy for backward
        self._saved = indices
        return embedding_forward(indices, self.weight.data, self.padding_idx)   # (..., E)

    def backward(self, dout):
        """Adds dweight (the scatter-add of dout by index); returns None."""
        indices = self._saved_for_backward()
        self.weight.accumulate(embedding_backward(dout, indices, self.weight.data,
                                                  self.padding_idx))
        return None

    def extra_repr(self):
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def sinusoidal_table(max_len, d_model):
    """pe[pos, 2i] = sin(pos / 10000^(2i/d_model)), pe[pos, 2i+1] = cos(pos / 10000^(2i/d_model)),
    in float64. Shapes: -> (max_len, d_model)"""
    position = np.arange(max_len, dtype=np.float64)[:, None]                  # (max_len, 1)
    inv_freq = np.exp(np.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))  # (⌈d/2⌉,)
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2] = np.sin(position * inv_freq)
    pe[:, 1::2] = np.cos(position * inv_freq[:d_model // 2])                 # odd d_model too
    return pe


class PositionalEncoding(Module):
    """out = dropout(x + pe[:, :L]): the Annotated Transformer's fixed sinusoidal positions.

        pe[0, pos, 2i]   = sin(pos / 10000^(2i / d_model))
        pe[0, pos, 2i+1] = cos(pos / 10000^(2i / d_model))

    Shapes: x (B, L, d_model) (or (L, d_model)) -> out of x's shape; pe (1, max_len, d_model)

    This is the article's first step: a token's input vector is its word embedding plus its
    position's vector (same width, so they add), and attention then sees where each token is.
    ``pe`` is a persistent buffer (in ``state_dict()``, as PyTorch's ``register_buffer``), not
    a parameter. The Annotated Transformer also multiplies the embedding by √d_model before
    this sum; that belongs to the embedding step (its ``Embeddings.forward``, or the caller:
    ``pos(embedding(tokens) * math.sqrt(d_model))``), not here. ``dropout`` (the
    probability) applies in training mode, the seed drawn per forward from
    ``numpy.random.Generator(seed)`` by the ``dropout`` sub-module. L > max_len is a
    ValueError. ``backward(dout)`` returns dx = dropout's backward of dout.
    """

    def __init__(self, d_model, max_len=5000, dropout=0.1, *, dtype=np.float32, seed=None):
        super().__init__()
        self.d_model = _checks.size("d_model", d_model, 1)
        self.max_len = _checks.size("max_len", max_len)
        self.dropout = Dropout(_checks.probability("dropout", dropout), seed=seed)
        table = sinusoidal_table(self.max_len, self.d_model)[None]             # (1, max_len, d)
        self.register_buffer("pe", table.astype(_checks.float_dtype(dtype)))

    def forward(self, x):
        x = _checks.float_input("x", x, self.pe.dtype, "PositionalEncoding")
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, L, {self.d_model}) or (L, {self.d_model}) "
                             f"to match d_model; got {x.shape}")
        length = x.shape[-2]
        if length > self.max_len:
            raise ValueError(f"x must have at most max_len = {self.max_len} positions (dim -2); "
                             f"got {length} in shape {x.shape}")
        self._saved = x.shape
        return self.dropout(x + self.pe[0, :length])                          # x's shape

    def backward(self, dout):
        """dx = dout ∘ keep / (1 - p): the sum passes dout through, dropout masks it."""
        self._saved_for_backward()
        return self.dropout.backward(dout)

    def extra_repr(self):
        return f"d_model={self.d_model}, max_len={self.max_len}"
