"""GELU over the activations of a GPT MLP, forward and forward+backward, both forms.

GELU is elementwise; its GFLOP/s are nominal, counted per element as 20 FLOPs forward and 20
more backward (an erf or a tanh is a few dozen operations in any implementation). NumPy has a
tanh but no erf, so its column has the tanh form only (x·½·(1 + tanh u), PyTorch's documented
formula, with its derivative for the backward).
"""
import math

import numpy as np

import npattn

from .cases import Bench, case, impls, randn, shape, torch_forward, torch_forward_backward

DIMS = (8, 256, 1536)        # B·T rows × 4·C: the 6-layer GPT's MLP activations (bench_gpt)
DIMS_QUICK = (4, 64, 512)
FLOPS = 20                   # per element and direction: nominal
NOTE = "gelu GFLOP/s are nominal: 20 FLOPs per element forward, 20 more backward"
SQRT_2_PI = math.sqrt(2.0 / math.pi)


def numpy_tanh_parts(x):
    """(GELU, its slope) of the tanh form in x's dtype."""
    u = np.float32(SQRT_2_PI) * (x + np.float32(0.044715) * x ** 3)
    t = np.tanh(u)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.float32(SQRT_2_PI) * (
        1 + np.float32(3 * 0.044715) * x * x)
    return 0.5 * x * (1 + t), slope


def _skipped(approximate):
    return {} if approximate == "tanh" else {"NumPy": "NumPy has no erf"}


@case("gelu", sizes=[(DIMS, "none"), (DIMS, "tanh")], quick=[(DIMS_QUICK, "none"),
                                                           (DIMS_QUICK, "tanh")])
def gelu_forward(torch, dims, approximate):
    x = randn(*dims) * np.float32(2)
    numpy = (lambda: numpy_tanh_parts(x)[0]) if approximate == "tanh" else None
    return Bench(f"gelu {approximate} fwd {shape(dims)}", flops=FLOPS * math.prod(dims),
                 impls=impls(npattn=lambda: npattn.gelu(x, approximate), numpy=numpy,
                             torch=torch_forward(torch, torch and (
                                 lambda t: torch.nn.functional.gelu(t, approximate=approximate)),
                                 x)),
                 notes=[NOTE], skipped=_skipped(approximate))


@case("gelu", sizes=[(DIMS, "none"), (DIMS, "tanh")], quick=[(DIMS_QUICK, "none"),
                                                           (DIMS_QUICK, "tanh")])
def gelu_forward_backward(torch, dims, approximate):
    x, dout = randn(*dims) * np.float32(2), randn(*dims)

    def ours():
        return npattn.gelu(x, approximate), npattn.gelu_backward(dout, x, approximate)

    def numpy():
        y, slope = numpy_tanh_parts(x)
        return y, dout * slope

    return Bench(f"gelu {approximate} fwd+bwd {shape(dims)}", flops=2 * FLOPS * math.prod(dims),
                 impls=impls(npattn=ours, numpy=numpy if approximate == "tanh" else None,
                             torch=torch_forward_backward(torch, torch and (
                                 lambda t: torch.nn.functional.gelu(t, approximate=approximate)),
                                 dout, x)),
                 notes=[NOTE], skipped=_skipped(approximate))
