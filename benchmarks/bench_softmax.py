"""softmax over rows, forward and forward+backward.

Softmax is memory-bound, so its GFLOP/s are nominal, counted per element: forward 5 (max,
subtract, exp, sum, scale), backward 4 (dx = y·(dout - Σ dout·y): multiply, sum, subtract,
multiply).
"""
import math

import numpy as np

import npattn

from .cases import Bench, case, impls, randn, shape, torch_forward, torch_forward_backward

ROWS = (4096, 1024)                  # e.g. the scores of 4 heads × 1024 queries over 1024 keys
ROWS_QUICK = (256, 1024)
NOTE = "softmax GFLOP/s are nominal: 5 FLOPs per element forward, 4 more backward"


def numpy_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


@case("softmax", sizes=[(ROWS,)], quick=[(ROWS_QUICK,)])
def softmax_forward(torch, dims):
    x = randn(*dims) * np.float32(4)
    return Bench(f"softmax fwd {shape(dims)}", flops=5 * math.prod(dims),
                 impls=impls(npattn=lambda: npattn.softmax(x, dim=-1),
                             numpy=lambda: numpy_softmax(x),
                             torch=torch_forward(torch, torch and (lambda t: torch.softmax(t, -1)),
                                                 x)),
                 memory=True, notes=[NOTE])


@case("softmax", sizes=[(ROWS,)], quick=[(ROWS_QUICK,)])
def softmax_forward_backward(torch, dims):
    x, dout = randn(*dims) * np.float32(4), randn(*dims)

    def ours():
        out = npattn.softmax(x, dim=-1)
        return out, npattn.softmax_backward(dout, out, dim=-1)

    def numpy():
        out = numpy_softmax(x)
        return out, out * (dout - (dout * out).sum(axis=-1, keepdims=True))

    return Bench(f"softmax fwd+bwd {shape(dims)}", flops=9 * math.prod(dims),
                 impls=impls(npattn=ours, numpy=numpy,
                             torch=torch_forward_backward(
                                 torch, torch and (lambda t: torch.softmax(t, -1)), dout, x)),
                 memory=True, notes=[NOTE])
