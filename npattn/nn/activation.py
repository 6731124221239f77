"""``nn.GELU``: the activation of GPT-2's (and BERT's) feed-forward blocks."""
from .. import _checks
from ..functional.gelu import gelu_backward, gelu_forward
from .module import Module


class GELU(Module):
    """GELU(x) = x·Φ(x), Φ the standard normal CDF (``approximate="none"``) or PyTorch's tanh
    approximation ½·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (``"tanh"``, GPT-2's), as
    ``torch.nn.GELU``.

    Shapes: x (...) -> out (...), any float dtype (no parameters)

    ``forward`` keeps x (backward recomputes Φ from it); ``backward(dout)`` returns
    dx = dout ∘ (Φ(x) + x·Φ'(x)).
    """

    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = _checks.approximation("approximate", approximate)

    def forward(self, x):
        x = _checks.float_array("x", x)
        out = gelu_forward(x, self.approximate)                     # (...)
        self._saved = x
        return out

    def backward(self, dout):
        x = self._saved_for_backward()
        return gelu_backward(dout, x, self.approximate)             # (...)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"
