"""linear: y = x·Wᵀ + b, forward and forward+backward, with nn.Linear's weight layout.

FLOPs: forward 2·N·Fin·Fout (N rows: the leading dims of x flattened); the backward's
dx = dout·W and dW = doutᵀ·x are two more products of that size (db, a column sum, is not
counted), so forward+backward is 6·N·Fin·Fout.
"""
import math

import npattn

from .cases import Bench, case, impls, randn, shape, torch_forward, torch_forward_backward

ARTICLE = ((2, 5, 512), 64)          # the article's X [batch, src_len, d_model] → W_Q
LAYER = ((8, 512, 512), 2048)        # a transformer MLP's first layer
LAYER_QUICK = ((2, 64, 512), 256)


def _inputs(x_dims, fout):
    return randn(*x_dims), randn(fout, x_dims[-1]), randn(fout)   # x, weight (Fout, Fin), bias


@case("linear", sizes=[ARTICLE, LAYER], quick=[ARTICLE, LAYER_QUICK])
def linear_forward(torch, x_dims, fout):
    x, weight, bias = _inputs(x_dims, fout)
    return Bench(f"linear fwd {shape(x_dims)}→{fout}",
                 flops=2 * math.prod(x_dims) * fout,
                 impls=impls(npattn=lambda: npattn.linear(x, weight, bias),
                             numpy=lambda: x @ weight.T + bias,
                             torch=torch_forward(torch, torch and torch.nn.functional.linear,
                                                 x, weight, bias)),
                 memory=True)


@case("linear", sizes=[LAYER], quick=[LAYER_QUICK])
def linear_forward_backward(torch, x_dims, fout):
    x, weight, bias = _inputs(x_dims, fout)
    dout = randn(*x_dims[:-1], fout)                                # (..., Fout)

    def ours():
        out = npattn.linear(x, weight, bias)
        return out, npattn.linear_backward(dout, x, weight, bias)

    def numpy():
        out = x @ weight.T + bias                                   # (..., Fout)
        rows, drows = x.reshape(-1, x.shape[-1]), dout.reshape(-1, fout)  # (N, Fin), (N, Fout)
        return out, (drows @ weight).reshape(x.shape), drows.T @ rows, drows.sum(0)

    return Bench(f"linear fwd+bwd {shape(x_dims)}→{fout}",
                 flops=6 * math.prod(x_dims) * fout,
                 impls=impls(npattn=ours, numpy=numpy,
                             torch=torch_forward_backward(
                                 torch, torch and torch.nn.functional.linear, dout,
                                 x, weight, bias)),
                 memory=True)
