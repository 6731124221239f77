"""npattn: a from-scratch attention engine on NumPy and Numba.

Every op comes as a pair -- ``<op>_forward`` and ``<op>_backward`` -- with the plain PyTorch
name as the forward::

    >>> import numpy as np, npattn
    >>> x = np.ones((2, 5, 512), np.float32)          # the article's batch
    >>> w_q = np.ones((64, 512), np.float32)           # nn.Linear(512, 64).weight: (out, in)
    >>> npattn.linear(x, w_q).shape
    (2, 5, 64)

``npattn.reference`` holds every formula in plain NumPy (the tests' oracle); ``npattn.models``
holds whole models (``GPT``), ``npattn.distributed`` data-parallel training on MPI. Importing
npattn compiles nothing: each kernel compiles on its first call and is cached on disk.
"""
from . import reference
from .functional.attention import (attention, attention_backward, attention_forward,
                                   scaled_dot_product_attention,
                                   scaled_dot_product_attention_backward,
                                   scaled_dot_product_attention_forward,
                                   scaled_dot_product_attention_varlen,
                                   scaled_dot_product_attention_varlen_backward,
                                   scaled_dot_product_attention_varlen_forward,
                                   scaled_dot_product_attention_with_kv_cache)
from .functional.cross_entropy import (cross_entropy, cross_entropy_backward,
                                       cross_entropy_forward)
from .functional.dropout import dropout, dropout_backward, dropout_forward, dropout_mask
from .functional.embedding import embedding, embedding_backward, embedding_forward
from .functional.gelu import gelu, gelu_backward, gelu_forward
from .functional.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from .functional.linear import linear, linear_backward, linear_forward
from .functional.matmul import matmul, matmul_backward, matmul_forward
from .functional.rotary import (rotary_embedding, rotary_embedding_backward,
                                rotary_embedding_forward)
from .functional.softmax import (log_softmax, log_softmax_backward, log_softmax_forward,
                                 softmax, softmax_backward, softmax_forward)

__version__ = "0.1.0"

#: Subpackages reachable as attributes after ``import npattn`` (``npattn.nn.Linear``, as with
#: ``torch.nn``), imported on first access (PEP 562) so that ``import npattn`` stays as fast.
SUBMODULES = ("nn", "optim", "gradcheck", "models", "distributed")


def __getattr__(name):
    if name in SUBMODULES:
        import importlib
        return importlib.import_module(f".{name}", __name__)   # also sets npattn.<name>
    raise AttributeError(f"module 'npattn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES))

__all__ = [
    "__version__", "reference", "nn", "optim", "gradcheck", "models", "distributed",
    "linear", "linear_forward", "linear_backward",
    "matmul", "matmul_forward", "matmul_backward",
    "softmax", "softmax_forward", "softmax_backward",
    "log_softmax", "log_softmax_forward", "log_softmax_backward",
    "dropout", "dropout_forward", "dropout_backward", "dropout_mask",
    "scaled_dot_product_attention", "scaled_dot_product_attention_forward",
    "scaled_dot_product_attention_backward", "scaled_dot_product_attention_with_kv_cache",
    "scaled_dot_product_attention_varlen", "scaled_dot_product_attention_varlen_forward",
    "scaled_dot_product_attention_varlen_backward",
    "attention", "attention_forward", "attention_backward",
    "embedding", "embedding_forward", "embedding_backward",
    "cross_entropy", "cross_entropy_forward", "cross_entropy_backward",
    "layer_norm", "layer_norm_forward", "layer_norm_backward",
    "gelu", "gelu_forward", "gelu_backward",
    "rotary_embedding", "rotary_embedding_forward", "rotary_embedding_backward",
]
