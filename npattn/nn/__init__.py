"""Modules with parameters and hand-written backward passes, named and laid out as ``torch.nn``.

Each module's ``forward`` remembers what its ``backward(dout)`` needs; ``backward`` adds each
parameter's gradient into ``parameter.grad`` and returns the input's gradient. Modules call the
functional layer (``npattn.functional``), never a kernel. ``npattn.nn.init`` holds PyTorch's
initialisers, ``npattn.nn.utils`` the gradient utilities (``clip_grad_norm_``).
"""
from . import init, utils
from .activation import GELU
from .attention import MultiheadAttention, SelfAttention
from .dropout import Dropout
from .embedding import Embedding, PositionalEncoding
from .linear import Linear
from .module import Module, ModuleList, Parameter, Sequential
from .normalization import LayerNorm
from .rotary import RotaryEmbedding

__all__ = ["Module", "Parameter", "Sequential", "ModuleList", "init", "Linear", "Dropout",
           "SelfAttention", "MultiheadAttention", "Embedding", "PositionalEncoding", "LayerNorm",
           "GELU", "RotaryEmbedding", "utils"]
