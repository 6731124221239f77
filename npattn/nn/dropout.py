"""``nn.Dropout``, with each training forward's mask drawn from the module's own generator."""
from .. import _checks
from ..functional.dropout import dropout_backward, dropout_forward
from .module import Module


def draw_seed(gen):
    """A fresh dropout seed from a module's generator: one draw per training forward."""
    return int(gen.integers(2**63))


class Dropout(Module):
    """out = x ∘ keep / (1 - p) in training mode, x in eval mode, as ``torch.nn.Dropout``.

    Shapes: x (...) -> out (...)

    The module owns ``numpy.random.Generator(seed)``; each training-mode forward with p > 0
    draws a fresh dropout seed from it (the keep-mask is a pure function of that seed and the
    shape, see ``functional/dropout.py``) and saves it, so backward regenerates the mask.
    The same ``seed`` gives bitwise the same sequence of masks. PyTorch's masks come from its
    own generator and differ.
    """

    def __init__(self, p=0.5, *, seed=None):
        super().__init__()
        self.p = _checks.probability("p", p)
        self._generator = _checks.generator(seed, "seed")

    def forward(self, x):
        x = _checks.float_array("x", x)
        if not (self.training and self.p > 0):          # x itself (a model's decode step
            self._saved = (0, False, x.shape)           # passes here: no further checks)
            return x
        seed = draw_seed(self._generator)
        self._saved = (seed, True, x.shape)
        return dropout_forward(x, self.p, seed, True)              # (...)

    def backward(self, dout):
        """dx = dout ∘ keep / (1 - p), with forward's mask; dout in eval mode."""
        seed, training, shape = self._saved_for_backward()
        dout = _checks.float_array("dout", dout)
        if dout.shape != shape:
            raise ValueError(f"dout must have shape {shape} to match forward's x; got "
                             f"{dout.shape}")
        return dropout_backward(dout, self.p, seed, training)      # (...)

    def extra_repr(self):
        return f"p={self.p}"
