"""Modules with parameters and hand-written backward passes, named and laid out as ``torch.nn``.

Each module's ``forward`` remembers what its ``backward(dout)`` needs; ``backward`` adds each
parameter's gradient into ``parameter.grad`` and returns the input's gradient. Modules call the
functional layer (``npattn.functional``), never a kernel. ``npattn.nn.init`` holds PyTorch's
initialisers.
"""
from . import init
from .attention import MultiheadAttention, SelfAttention
from .dropout import Dropout
from .embedding import Embedding, PositionalEncoding
from .linear import Linear
from .module import Module, Parameter, Sequential
from .normalization import LayerNorm

__all__ = ["Module", "Parameter", "Sequential", "init", "Linear", "Dropout", "SelfAttention",
           "MultiheadAttention", "Embedding", "PositionalEncoding", "LayerNorm"]
