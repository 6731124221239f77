"""matmul: square GEMM (the engine's yardstick, plotted) and batched products, fwd and fwd+bwd.

FLOPs: a (M, K)·(K, N) product is 2·M·K·N; its backward is two more products of that size
(da = dout·bᵀ, db = aᵀ·dout), so forward+backward is 3× the forward.
"""
import numpy as np

import npattn

from .cases import (Bench, case, impls, randn, shape, short, torch_forward,
                    torch_forward_backward)

GEMM_SIZES = (128, 256, 512, 1024, 2048)
BMM = ((32, 512, 64), (32, 64, 512))          # [B, M, K]·[B, K, N]: attention's Q·Kᵀ per head
BMM_QUICK = ((4, 128, 64), (4, 64, 128))


@case("gemm", sizes=[(n, dt) for dt in ("float32", "float64") for n in GEMM_SIZES],
      quick=[(128, "float32"), (128, "float64")])
def gemm(torch, n, dtype):
    a, b = randn(n, n, dtype=dtype), randn(n, n, dtype=dtype)
    return Bench(f"gemm {short(dtype)} n={n}", flops=2 * n**3,
                 impls=impls(npattn=lambda: npattn.matmul(a, b),
                             numpy=lambda: a @ b,
                             torch=torch_forward(torch, torch and torch.matmul, a, b)),
                 plot=("gemm", short(dtype), n))


def _bmm_label(kind, a_dims, b_dims):
    return f"bmm {kind} {shape(a_dims)}·{shape(b_dims)}"


@case("bmm", sizes=[BMM], quick=[BMM_QUICK])
def bmm_forward(torch, a_dims, b_dims):
    a, b = randn(*a_dims), randn(*b_dims)
    batch, m, k = a_dims
    return Bench(_bmm_label("fwd", a_dims, b_dims), flops=2 * batch * m * k * b_dims[2],
                 impls=impls(npattn=lambda: npattn.matmul(a, b),
                             numpy=lambda: a @ b,
                             torch=torch_forward(torch, torch and torch.bmm, a, b)),
                 memory=True)


@case("bmm", sizes=[BMM], quick=[BMM_QUICK])
def bmm_forward_backward(torch, a_dims, b_dims):
    a, b = randn(*a_dims), randn(*b_dims)
    batch, m, k = a_dims
    dout = randn(batch, m, b_dims[2])                               # (B, M, N)

    def ours():
        out = npattn.matmul(a, b)
        return out, npattn.matmul_backward(dout, a, b)

    def numpy():
        out = a @ b                                                 # (B, M, N)
        return out, dout @ np.swapaxes(b, 1, 2), np.swapaxes(a, 1, 2) @ dout

    return Bench(_bmm_label("fwd+bwd", a_dims, b_dims), flops=6 * batch * m * k * b_dims[2],
                 impls=impls(npattn=ours, numpy=numpy,
                             torch=torch_forward_backward(torch, torch and torch.bmm, dout, a, b)),
                 memory=True)
