"""Cross-entropy loss with class-index targets, as ``torch.nn.functional.cross_entropy``.

The classes are on axis 1 of ``input`` (axis 0 of a 1-D input); ``target`` holds one class index
per position. Log-softmax and the negative log-likelihood run fused in one kernel pass per row,
in float64 (``kernels/cross_entropy.py``); the result is rounded to ``input``'s dtype once.

Matches PyTorch, on purpose also where it gives NaN: a row whose every logit is -inf (the
log-softmax of such a row is NaN there too), and reduction="mean" when every target is ignored
(0/0). One difference: an ignored position is never read, so its gradient is 0 even when its
logits hold a NaN or are all -inf (PyTorch: NaN there). Only class indices are supported:
class-probability targets are a TypeError; per-class ``weight`` is not taken.

Edge cases (tests/test_numerics_edges.py): logits of ±1e30, and float32 logits up to float32's
max (whose float32 sum would overflow), are handled in float64 and give the reference's loss;
a loss beyond float32's max is inf. A row with one finite logit: loss exactly 0 and gradient
exactly 0 when the target is that class; loss +inf, gradient -1 at the target and +1 at the
finite class, when the target's logit is -inf (as PyTorch). Denormal logits give log C. A NaN
reaches only its own row's loss and gradient (and "mean" or "sum" of them).
"""
import math

import numpy as np

from .. import _checks
from ..kernels.cross_entropy import (cross_entropy_backward_kernel, cross_entropy_forward_kernel,
                                     ordered_sum)


def _rows(input, target, ignore_index):
    """input as rows (M, C) with the classes last, C-contiguous; target as (M,) int64 with
    ignore_index mapped to -1, the kernels' mark for an ignored row (any negative target is
    one: a negative ignore_index, the default -100, needs no mapping)."""
    classes_last = np.moveaxis(input, 1, -1) if input.ndim > 2 else input   # (N, d..., C)
    rows = _checks.contiguous(classes_last)
    rows = rows.reshape(math.prod(rows.shape[:-1]), rows.shape[-1])          # (M, C)
    target = _checks.as_int64(target)                         # in [0, C) or ignore_index
    if ignore_index >= 0:
        target = np.where(target == ignore_index, -1, target)
    return rows, target.reshape(-1)                           # (M,) int64


def cross_entropy_forward(input, target, *, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0):
    """loss = (1 - ε)·(-log p_t) + ε·mean_c(-log p_c), with log p = log_softmax(input) along the
    classes, t the target class and ε = label_smoothing; 0 where target == ignore_index.

    Shapes: input (C,), (N, C) or (N, C, d1, ...) · target (), (N,) or (N, d1, ...) integer
    -> loss of target's shape (reduction="none") or 0-d ("mean", "sum"), input's dtype

    "mean" divides the sum by the number of targets that are not ignored (NaN when there are
    none, as PyTorch); "sum" of no terms is 0. The sum over rows is accumulated in float64.
    """
    input, target, ignore_index, reduction, label_smoothing = _checks.cross_entropy_args(
        input, target, ignore_index, reduction, label_smoothing)
    rows, flat = _rows(input, target, ignore_index)           # (M, C), (M,)
    loss = np.empty(flat.shape[0], dtype=np.float64)          # (M,)
    cross_entropy_forward_kernel(rows, flat, label_smoothing, loss)
    with np.errstate(over="ignore"):              # a loss beyond float32's range is inf
        if reduction == "none":
            return loss.astype(input.dtype).reshape(target.shape)  # target's shape
        total = ordered_sum(loss)
        if reduction == "mean":
            count = np.count_nonzero(flat >= 0)
            total = total / count if count else math.nan
        return np.array(total, dtype=input.dtype)             # 0-d


def cross_entropy_backward(dout, input, target, *, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0):
    """Gradient of ``cross_entropy_forward`` with respect to ``input``:

    dinput_c = g·(p_c - (1 - ε)·[c = t] - ε/C) along the classes, 0 where the target is ignored,
    with g = dout ("sum"), dout / (number of targets not ignored) ("mean") or dout at that
    position ("none").

    Shapes: dout () for "mean"/"sum" or target's shape for "none", input's dtype; input, target
    and the keywords as forward -> dinput of input's shape
    """
    dout, input, target, ignore_index, reduction, label_smoothing = \
        _checks.cross_entropy_backward_args(dout, input, target, ignore_index, reduction,
                                            label_smoothing)
    rows, flat = _rows(input, target, ignore_index)           # (M, C), (M,)
    if reduction == "none":
        grad = dout.astype(np.float64).reshape(-1)            # (M,)
    else:
        g = float(dout)
        if reduction == "mean":
            count = np.count_nonzero(flat >= 0)
            g = g / count if count else 0.0                   # no target counts: all rows ignored
        grad = np.full(flat.shape[0], g)                      # (M,)
    drows = np.empty_like(rows)                               # (M, C)
    cross_entropy_backward_kernel(grad, rows, flat, label_smoothing, drows)
    if input.ndim <= 2:
        return drows.reshape(input.shape)
    classes_last = (input.shape[0],) + input.shape[2:] + (input.shape[1],)
    return np.moveaxis(drows.reshape(classes_last), -1, 1)    # input's shape


cross_entropy = cross_entropy_forward
