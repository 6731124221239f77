"""Dropout as ``torch.nn.functional.dropout``, with the mask drawn from a ``seed``.

Inverted dropout: during training each element is zeroed with probability ``p`` and the
survivors are scaled by 1/(1-p), so the expectation is unchanged and evaluation is the identity.
The mask is a pure function of ``(seed, shape)`` (``kernels/random.py``): backward regenerates it
instead of storing it, and it does not depend on memory layout or thread count. PyTorch draws
from its own generator, so the same ``p`` gives a different (equally distributed) mask there;
``dropout_mask`` hands ours out for comparisons.
"""
import math

import numpy as np

from .. import _checks
from ..kernels.dropout import dropout_kernel, dropout_mask_kernel
from ..kernels.random import keep_threshold, kept_scale, stream_key


def _dropout(x, p, seed):
    flat = _checks.contiguous(x).reshape(-1)               # (N,), C order: element t's index
    out = np.empty_like(flat)
    dropout_kernel(flat, stream_key(seed), keep_threshold(p), kept_scale(p, x.dtype), out)
    return out.reshape(x.shape)                            # (...)


def dropout_forward(x, p=0.5, seed=0, training=True):
    """out = x ∘ keep / (1 - p) with keep = dropout_mask(x.shape, p, seed); x when not training.

    Shapes: x (...) -> out (...), in x's dtype (the scale 1/(1-p) too). p = 1 gives zeros.
    """
    x, p, seed, training = _checks.dropout_args(x, p, seed, training)
    if not training:
        return x                                           # as PyTorch: the input itself
    return _dropout(x, p, seed)


def dropout_backward(dout, p=0.5, seed=0, training=True):
    """dx = dout ∘ keep / (1 - p): forward is linear in x, and the mask comes back from the seed.

    Shapes: dout (...) -> dx (...); ``p``, ``seed`` and ``training`` must be forward's.
    """
    dout = _checks.float_array("dout", dout)
    p = _checks.probability("p", p)
    seed = _checks.seed_value("seed", seed)
    if not _checks.flag("training", training):
        return dout
    return _dropout(dout, p, seed)


def dropout_mask(shape, p, seed):
    """The keep-mask (``True`` = kept) that dropout with this ``p`` and ``seed`` applies.

    Shapes: shape (...) -> mask (...) bool. Element ``t`` in C order is kept when
    ``keep(seed_key(seed), t, keep_threshold(p))``; see ``kernels/random.py``.
    """
    shape = _checks.shape_value("shape", shape)
    p = _checks.probability("p", p)
    seed = _checks.seed_value("seed", seed)
    mask = np.empty(math.prod(shape), dtype=np.bool_)     # (N,)
    dropout_mask_kernel(stream_key(seed), keep_threshold(p), mask)
    return mask.reshape(shape)                             # (...)


dropout = dropout_forward
