"""GELU as ``torch.nn.functional.gelu``: x·Φ(x), Φ the standard normal CDF, exact
(``approximate="none"``) or with PyTorch's tanh approximation (``approximate="tanh"``, GPT-2's).

Both forms are computed in forms without cancellation in the tails (``kernels/gelu.py``):
float64 in float64 arithmetic, float32 in float32 arithmetic but for the tanh form's steps
whose rounding would show (its u and 1/(1 + e), in float64). float32 results stay
within a few ulps of the float64 truth, relatively also where GELU is tiny (x ≪ 0), which
PyTorch's float32 is not, and no further from it than PyTorch's float32 anywhere (a test
measures both).

Edge cases, where npattn gives the mathematical limits (tests/test_numerics_edges.py):
GELU(+inf) = +inf and GELU(−inf) = −0, with slopes 1 and 0 (dx = dout and 0·dout). PyTorch
2.13's CPU kernels give NaN for −inf (0·inf) -- and for +inf in float32 with the exact form --
and NaN slopes at ±inf. Large finite |x| (±1e30, float64's ±1e300) give x and −0 with slopes
1 and 0 (PyTorch's float32 tanh-form slope is NaN at ±1e30, where its x³ overflows). NaN
propagates to its own element and nowhere else.
"""
import numpy as np

from .. import _checks
from ..kernels.gelu import BLOCK, gelu_backward_kernel, gelu_forward_kernel


def _sized(kernel, n):
    """The kernel, or its serial twin (the same bits) for a single block of work: one prange
    iteration is not worth a launch of the thread pool."""
    return kernel.serial if n <= BLOCK else kernel


def gelu_forward(x, approximate="none"):
    """GELU(x) = x·Φ(x) elementwise, with Φ(x) = ½·(1 + erf(x/√2)) ("none") or
    ½·(1 + tanh(√(2/π)·(x + 0.044715·x³))) ("tanh").

    Shapes: x (...) -> out (...), in x's dtype
    """
    x, tanh_form = _checks.gelu_args(x, approximate)
    out = np.empty_like(x)                                 # (...)
    _sized(gelu_forward_kernel, x.size)(x.reshape(-1), tanh_form, out.reshape(-1))
    return out


def gelu_backward(dout, x, approximate="none"):
    """dx = dout ∘ (Φ(x) + x·Φ'(x)) -- Φ' = φ, the normal density, for "none"; for "tanh",
    ½·(1 − tanh²(u))·√(2/π)·(1 + 3·0.044715·x²) -- with x and ``approximate`` forward's.

    Shapes: dout, x (...) -> dx (...)
    """
    dout, x, tanh_form = _checks.gelu_backward_args(dout, x, approximate)
    dx = np.empty(x.size, x.dtype)                         # (N,)
    _sized(gelu_backward_kernel, dx.size)(dout.reshape(-1), x.reshape(-1), tanh_form, dx)
    return dx.reshape(x.shape)                             # (...)


gelu = gelu_forward
