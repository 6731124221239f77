"""``nn.LayerNorm``: normalise each sample over its trailing dims, then scale and shift."""
import math

import numpy as np

from .. import _checks
from ..functional.layer_norm import layer_norm_backward, layer_norm_forward
from . import init
from .module import Module, Parameter


class LayerNorm(Module):
    """y = (x - μ) / √(σ² + eps) ∘ weight + bias, as ``torch.nn.LayerNorm``.

    μ and σ² (biased) are each sample's mean and variance over the trailing dims
    ``normalized_shape``.

    Shapes: x (..., *normalized_shape) -> y of x's shape; weight, bias (*normalized_shape)

    ``weight`` starts at ones and ``bias`` at zeros; ``elementwise_affine=False`` makes both
    None and ``bias=False`` only the bias (PyTorch's names and rules). Without parameters any
    float dtype passes; with them, x must have theirs. ``backward(dout)`` returns dx and adds
    dweight = Σ dout ∘ x̂ and dbias = Σ dout over the samples.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *,
                 dtype=np.float32):
        super().__init__()
        self.normalized_shape = _checks.normalized_shape_value("normalized_shape",
                                                               normalized_shape)
        eps = _checks.real_float("eps", eps, "a real number >= 0")
        if not 0.0 <= eps < math.inf:                # also rejects NaN
            raise ValueError(f"eps must be a finite real number >= 0; got {eps}")
        self.eps = eps
        self.elementwise_affine = _checks.flag("elementwise_affine", elementwise_affine)
        bias = _checks.flag("bias", bias)
        dtype = _checks.float_dtype(dtype)
        if self.elementwise_affine:
            self.weight = Parameter(init.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(init.zeros(self.normalized_shape, dtype=dtype)) if bias else None
        else:
            self.weight = self.bias = None

    def _arrays(self):
        return (None if self.weight is None else self.weight.data,
                None if self.bias is None else self.bias.data)

    def forward(self, x):
        weight, bias = self._arrays()
        if weight is not None and not (type(x) is np.ndarray and x.dtype is weight.dtype):
            x = _checks.float_input("x", x, weight.dtype, "LayerNorm")
        y, stats = layer_norm_forward(x, self.normalized_shape, weight, bias, self.eps,
                                      return_stats=True)
        self._saved = (x, stats)                  # backward reuses the statistics
        return y                                                   # x's shape

    def backward(self, dout):
        x, stats = self._saved_for_backward()
        weight, bias = self._arrays()
        dx, dweight, dbias = layer_norm_backward(dout, x, self.normalized_shape, weight, bias,
                                                 self.eps, stats=stats)
        if self.weight is not None:
            self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")
