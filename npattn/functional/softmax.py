"""softmax and log_softmax along one dim, as ``torch.softmax`` / ``torch.log_softmax``.

One rule differs from PyTorch on purpose: a row whose every entry is -inf (a fully masked row)
gives zeros from softmax, -inf from log_softmax and zero gradients from both backwards, where
PyTorch gives NaN -- the rule PyTorch's scaled_dot_product_attention follows since 2.5, and the
one npattn's attention follows too. NaN in the input still propagates to its whole row.

Edge cases (tests/test_numerics_edges.py), in float32 and float64:

* logits of ±1e30, or anything up to the dtype's max: the row max is subtracted first, so
  every exp is of a number <= 0 -- no overflow, no NaN, the float64 reference's result;
* a row whose every entry is -inf: softmax 0, log_softmax -inf, both gradients 0 (above);
* a row with a single finite entry j: softmax exactly one-hot and its gradient exactly 0;
  log_softmax exactly 0 at j and -inf elsewhere, its gradient dout - onehot·Σ dout (exactly
  dout at the -inf entries, as PyTorch);
* a NaN, or a +inf (inf - inf), makes its whole row NaN, forward and backward (through
  dout too); every other row is bitwise what it would be without it;
* denormal inputs are ordinary small numbers. float32 results below 1.2e-38 are 0: the
  float32 exp of kernels/exp.py returns no subnormals (an absolute error < 1.2e-38);
* float32 log_softmax entries below -3.4e38 (x - max beyond float32's range) are -inf.
"""
import math

import numpy as np

from .. import _checks
from ..kernels.softmax import (log_softmax_backward_kernel, softmax_backward_kernel,
                               softmax_forward_kernel)


def _rows(a, axis):
    """``a`` with ``axis`` moved last and made C-contiguous and writeable, as rows (N, C).

    No copy when ``axis`` is already last and ``a`` is C-contiguous and writeable. A 0-d array
    is one row of one entry, as in PyTorch.
    """
    last = _checks.contiguous(np.moveaxis(np.atleast_1d(a), axis, -1))   # (..., C)
    return last.reshape(math.prod(last.shape[:-1]), last.shape[-1])       # (N, C)


def _unrows(rows, like, axis):
    """Undo :func:`_rows`: (N, C) back to the shape of ``like``, with C at ``axis`` again."""
    last = np.moveaxis(np.atleast_1d(like), axis, -1).shape                # (..., C)
    return np.moveaxis(rows.reshape(last), -1, axis).reshape(like.shape)   # like's shape


def _forward(x, dim, log):
    x, axis = _checks.softmax_args(x, dim)                   # float32/float64, axis >= 0
    rows = _rows(x, axis)                                    # (N, C)
    out = np.empty_like(rows)                                # (N, C)
    softmax_forward_kernel(rows, out, log)
    return _unrows(out, x, axis)                             # x's shape


def _backward(kernel, dout, out, dim):
    dout, out, axis = _checks.softmax_backward_args(dout, out, dim)
    rows_dout = _rows(dout, axis)                            # (N, C)
    rows_out = _rows(out, axis)                              # (N, C)
    dx = np.empty_like(rows_out)                             # (N, C)
    kernel(rows_dout, rows_out, dx)
    return _unrows(dx, out, axis)                            # out's shape


def softmax_forward(x, dim=-1):
    """softmax(x)_j = exp(x_j - m) / Σ_k exp(x_k - m) along ``dim``, with m = max_k x_k.

    Shapes: x (...) -> out (...), the dtype of x

    Subtracting the row max changes nothing mathematically and keeps every exp in [0, 1], so
    logits up to ±1e30 are fine in float32 and float64. A fully masked row (every entry -inf)
    gives zeros, not PyTorch's NaN: PyTorch SDPA's rule since 2.5. A NaN makes its row NaN. A
    0-d x (dim 0 or -1) gives 1, an empty dim gives an empty result.

    The article's example: softmax([2, 4, 4]) = [0.0634, 0.4683, 0.4683].
    """
    return _forward(x, dim, log=False)


def softmax_backward(dout, out, dim=-1):
    """Gradient of ``softmax_forward`` from its output: dx = y ∘ (dout - Σ_k dout_k y_k).

    Shapes: dout (...), out (...) -> dx (...), all one shape along ``dim``

    The Jacobian-vector product in O(row), never the C×C Jacobian. A fully masked row has
    y = 0 and so gets dx = 0 (PyTorch: NaN), as PyTorch SDPA since 2.5.
    """
    return _backward(softmax_backward_kernel, dout, out, dim)


def log_softmax_forward(x, dim=-1):
    """log_softmax(x)_j = x_j - m - log Σ_k exp(x_k - m) along ``dim``, with m = max_k x_k.

    Shapes: x (...) -> out (...), the dtype of x

    Never log(softmax(x)), which is -inf wherever softmax underflows. A fully masked row (every
    entry -inf) stays -inf, not PyTorch's NaN: the log of softmax's zeros, PyTorch SDPA's rule
    since 2.5. A NaN makes its row NaN. A 0-d x gives 0, an empty dim an empty result.
    """
    return _forward(x, dim, log=True)


def log_softmax_backward(dout, out, dim=-1):
    """Gradient of ``log_softmax_forward`` from its output: dx = dout - exp(y) ∘ Σ_k dout_k.

    Shapes: dout (...), out (...) -> dx (...), all one shape along ``dim``

    O(row), never the Jacobian. A fully masked row -- every entry of ``out`` -inf -- gets
    dx = 0 (PyTorch: NaN; the formula alone would pass dout through), as PyTorch SDPA since 2.5.
    """
    return _backward(log_softmax_backward_kernel, dout, out, dim)


softmax = softmax_forward
log_softmax = log_softmax_forward
