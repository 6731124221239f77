"""Layer normalisation as ``torch.nn.functional.layer_norm``: each sample is normalised over its
trailing ``normalized_shape`` dims to mean 0 and (biased) variance 1, then scaled and shifted.

The statistics are two-pass and, like each row's arithmetic, in float64 (``kernels/layer_norm.py``).
Forward can return them (``return_stats=True``: each sample's μ and rstd, as PyTorch's
``native_layer_norm`` returns its mean and rstd), and backward takes them (``stats=``) instead
of computing them again from ``x`` -- the same numbers either way, so the same bits. One
deviation from PyTorch: a negative ``eps`` is a ValueError (PyTorch accepts it and may return
NaN).

Edge cases (tests/test_numerics_edges.py): as the statistics are float64, float32 samples up
to float32's max (whose float32 sum or sum of squares would overflow) and samples of ±1e30
normalise as in the reference, with finite gradients; a sample of denormals has a variance far
below eps and gives ≈ (x - μ)/√eps, no NaN. A NaN or ±inf in a sample (inf - mean = NaN) makes
that sample's output and dx NaN and -- summed over samples -- dweight and dbias; the other
samples are bitwise untouched. With eps = 0 a constant sample is 0/0: NaN. As PyTorch.
"""
import math

import numpy as np

from .. import _checks
from ..kernels.layer_norm import (SERIAL_ENTRIES, layer_norm_backward_kernel,
                                  layer_norm_forward_kernel)


def _rows(x, shape):
    width = math.prod(shape)
    return x.reshape(math.prod(x.shape[:x.ndim - len(shape)]), width)   # (N, D)


def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                       return_stats=False):
    """y = (x - μ)/√(σ² + eps) ∘ weight + bias, with μ and σ² the mean and the biased variance of
    each sample over the trailing dims ``normalized_shape``.

    Shapes: x (..., *normalized_shape) · weight, bias (*normalized_shape) or None -> y of x's
    shape and dtype; with ``return_stats=True`` ``(y, (mean, rstd))``, mean and rstd =
    1/√(σ² + eps) float64 arrays of x's leading shape (...) -- hand them to
    ``layer_norm_backward(..., stats=)`` and it skips computing them again.

    A sample of zero entries has an empty result (its mean would be NaN, as in PyTorch).
    """
    x, shape, weight, bias, eps = _checks.layer_norm_args(x, normalized_shape, weight, bias, eps)
    return_stats = _checks.flag("return_stats", return_stats)
    # (a decoded token's layer norm is mostly this Python: x (1, 1, C) -> y in ~1 µs of kernel.
    # So the views are the cheapest ones: ravel() of a C-contiguous array is a view)
    rows = x if x.ndim == 2 and len(shape) == 1 else _rows(x, shape)     # (N, D)
    y = np.empty_like(x)
    lead = x.shape[:x.ndim - len(shape)]
    mean = np.empty(lead, np.float64)                         # (...) each; the kernel's (N,)
    rstd = np.empty(lead, np.float64)
    _forward_rows(rows, weight, bias, eps, y if rows is x else y.reshape(rows.shape),
                  mean.ravel(), rstd.ravel())
    return (y, (mean, rstd)) if return_stats else y


def _forward_rows(rows, weight, bias, eps, out, mean, rstd):
    """The forward's kernel on checked rows (N, D) into out (N, D), mean and rstd (N,) float64
    (views of y and the stats); weight and bias of D entries or None (also functional/block.py's
    layer norms)."""
    w = np.ones(rows.shape[1], rows.dtype) if weight is None else weight.ravel()   # (D,)
    b = np.zeros(rows.shape[1], rows.dtype) if bias is None else bias.ravel()      # (D,)
    run = (layer_norm_forward_kernel.serial if rows.size <= SERIAL_ENTRIES
           else layer_norm_forward_kernel)                    # (same bits either way)
    run(rows, w, b, eps, out, mean, rstd)


def layer_norm_backward(dout, x, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                        stats=None):
    """Gradients of ``layer_norm_forward``: ``(dx, dweight, dbias)``, None for an absent weight
    or bias. With x̂ = (x - μ)·rstd, rstd = 1/√(σ² + eps) and ĝ = dout ∘ weight, per sample:

    dx = rstd·(ĝ - mean(ĝ) - x̂ ∘ mean(ĝ ∘ x̂)),  dweight = Σ_samples dout ∘ x̂,
    dbias = Σ_samples dout

    Shapes: dout, x (..., *normalized_shape) -> dx of x's shape, dweight and dbias
    (*normalized_shape); ``stats``: the ``(mean, rstd)`` that ``layer_norm_forward(...,
    return_stats=True)`` returned for this x and eps (float64, x's leading shape), or None:
    computed here. They are not checked against x: other numbers give other gradients.

    dweight and dbias are summed in float64 in an order fixed by the number of samples alone.
    """
    dout, x, shape, weight, bias, eps, stats = _checks.layer_norm_backward_args(
        dout, x, normalized_shape, weight, bias, eps, stats)
    rows = _rows(x, shape)                                    # (N, D)
    w = np.ones(rows.shape[1], x.dtype) if weight is None else weight.reshape(-1)   # (D,)
    dx = np.empty_like(rows)                                  # (N, D)
    dweight = np.empty(rows.shape[1], x.dtype)                # (D,)
    dbias = np.empty(rows.shape[1], x.dtype)                  # (D,)
    mean, rstd = (NO_STATS, NO_STATS) if stats is None else (s.reshape(-1) for s in stats)
    layer_norm_backward_kernel(dout.reshape(rows.shape), rows, w, eps, mean, rstd, dx, dweight,
                               dbias)
    return (dx.reshape(x.shape),
            None if weight is None else dweight.reshape(shape),
            None if bias is None else dbias.reshape(shape))


NO_STATS = np.zeros(0, np.float64)   # "no saved statistics": the kernel computes them

layer_norm = layer_norm_forward
