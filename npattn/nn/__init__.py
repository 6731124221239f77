"""Modules with parameters and hand-written backward passes, named and laid out as ``torch.nn``.

Each module's ``forward`` remembers what its ``backward(dout)`` needs; ``backward`` adds each
parameter's gradient into ``parameter.grad`` and returns the input's gradient. Modules call the
functional layer (``npattn.functional``), never a kernel.
"""
from .module import Module, Parameter, Sequential

__all__ = ["Module", "Parameter", "Sequential"]
