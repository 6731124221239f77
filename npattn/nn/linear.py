"""``nn.Linear``: y = x·Wᵀ + b, with PyTorch's parameter names, layout and initialisation."""
import math

import numpy as np

from .. import _checks
from ..functional.linear import linear_backward, linear_forward
from . import init
from .module import Module, Parameter


class Linear(Module):
    """y = x·Wᵀ + b over the last axis of x, as ``torch.nn.Linear``.

    Shapes: x (..., in_features) -> y (..., out_features); weight (out_features, in_features),
    bias (out_features,)

    Parameters ``weight`` and ``bias`` (None when ``bias=False``) start as PyTorch's do:
    U(-1/√in_features, 1/√in_features), both drawn from ``rng`` (None, an int seed or a
    numpy Generator), the weight first. The article's ``W_Q = nn.Linear(d_model, d_k)``
    is ``Linear(d_model, d_k)``: its weight is (d_k, d_model), and Q = X·W_Qᵀ.

    ``forward`` keeps a reference to x for ``backward`` (do not overwrite x in between).
    """

    def __init__(self, in_features, out_features, bias=True, *, dtype=np.float32,
                 rng=None):
        super().__init__()
        self.in_features = _checks.size("in_features", in_features)
        self.out_features = _checks.size("out_features", out_features)
        bias = _checks.flag("bias", bias)
        dtype = _checks.float_dtype(dtype)
        gen = _checks.generator(rng)
        shape = (self.out_features, self.in_features)
        self.weight = Parameter(init.kaiming_uniform(shape, a=math.sqrt(5), rng=gen,
                                                     dtype=dtype))
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        self.bias = (Parameter(init.uniform((self.out_features,), -bound, bound, rng=gen,
                                            dtype=dtype)) if bias else None)

    def forward(self, x):
        weight = self.weight.data
        if not (type(x) is np.ndarray and x.dtype is weight.dtype and x.ndim
                and x.shape[-1] == self.in_features):   # (else the checks, and their errors)
            x = _checks.float_input("x", x, weight.dtype, "Linear")
            if x.ndim < 1 or x.shape[-1] != self.in_features:
                raise ValueError(f"x must have shape (..., {self.in_features}) to match "
                                 f"in_features; got {x.shape}")
        self._saved = x
        return linear_forward(x, weight, None if self.bias is None else
                              self.bias.data)                      # (..., out_features)

    def backward(self, dout):
        """dx = dout·W; adds dweight = Σ doutᵀ·x and dbias = Σ dout (over all leading dims)."""
        x = self._saved_for_backward()
        dx, dweight, dbias = linear_backward(dout, x, self.weight.data,
                                             None if self.bias is None else self.bias.data)
        self.weight.accumulate(dweight)
        if self.bias is not None:
            self.bias.accumulate(dbias)
        return dx                                                   # (..., in_features)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
