"""Embedding lookup as ``torch.nn.functional.embedding``: each index picks a row of ``weight``.

``padding_idx`` does not change the lookup; it only keeps its row's gradient zero (PyTorch's
rule), so a padding token's embedding never trains. A negative ``padding_idx`` counts from the
end of ``weight``'s rows, as in PyTorch.
"""
import math

import numpy as np

from .. import _checks
from ..kernels.embedding import ROWS, embedding_backward_kernel, embedding_forward_kernel


def embedding_forward(indices, weight, padding_idx=None):
    """out = weight[indices]: row ``indices[...]`` of the table, for every index.

    Shapes: indices (...) integer · weight (V, E) -> out (..., E), weight's dtype

    Every index must lie in [0, V): anything else is a ValueError naming the first offending
    value, raised before the kernel runs (no negative indexing from the end, as in PyTorch).
    """
    indices, weight, _ = _checks.embedding_args(indices, weight, padding_idx)
    flat = indices.reshape(-1)                                # (N,) int64
    out = np.empty((flat.shape[0], weight.shape[1]), dtype=weight.dtype)   # (N, E)
    # one work item (ROWS indices or fewer, a decoded token's): on this thread, no launch
    run = embedding_forward_kernel.serial if flat.shape[0] <= ROWS else embedding_forward_kernel
    run(flat, weight, out)
    return out.reshape(indices.shape + (weight.shape[1],))   # (..., E)


def embedding_backward(dout, indices, weight, padding_idx=None):
    """Gradient of ``embedding_forward`` with respect to ``weight``: a scatter-add.

    dweight[v] = Σ_{positions p with indices[p] = v} dout[p]; dweight[padding_idx] = 0.

    Shapes: dout (..., E), indices (...) integer, weight (V, E) -> dweight (V, E)

    Summed in weight's dtype, in the C order of ``indices``: the same bits as that serial loop,
    at any thread count (``kernels/embedding.py``). ``weight`` gives the shape and dtype only.
    """
    dout, indices, weight, padding_idx = _checks.embedding_backward_args(dout, indices, weight,
                                                                         padding_idx)
    n = math.prod(indices.shape)
    rows = dout.reshape(n, weight.shape[1])                   # (N, E)
    dweight = np.empty_like(weight)                           # (V, E)
    embedding_backward_kernel(rows, indices.reshape(n), padding_idx, dweight)
    return dweight


embedding = embedding_forward
