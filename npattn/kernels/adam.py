"""Adam's and AdamW's update of one parameter, fused: one pass over its elements instead of a
dozen whole-array NumPy operations, each with its own temporary. Dims: N elements (the
parameter flattened; its gradient and moments alike).

Per element, in the order torch.optim's single-tensor Adam evaluates it (npattn/optim.py has
the pseudocode), every hyperparameter rounded to the parameter's dtype first, as NumPy and
PyTorch round a Python float that multiplies an array::

    g  = -grad if maximize else grad
    θ  = θ·(1 - lr·λ)                      AdamW (decoupled decay), when λ != 0
    g  = g + λ·θ                           Adam (L2 penalty), when λ != 0
    m  = m + (1 - β1)·(g - m)              (a lerp towards g)
    v  = v·β2 + (1 - β2)·g·g
    vmax = max(vmax, v), v = vmax          amsgrad
    θ  = θ - (step_size·m) / (√v / √(1 - β2^t) + ε),   step_size = lr / (1 - β1^t)

The caller computes step_size and √(1 - β2^t) in float64, once per step. Every operation is
rounded as written (``exact_kernel``: no fused multiply-add), so the update gives NumPy's bits
for the same expression, and the same bits however LLVM optimises the copy that runs --
compiled in this process or loaded from the disk cache (``_jit.exact_kernel`` says why that
needed it). Accumulator: none (no reduction).
"""
import math

from numba import prange

from .._jit import exact_kernel, parallel_kernel

BLOCK = 16384  # elements per prange iteration; a parameter of one BLOCK or less runs serially


NO_DECAY, L2_PENALTY, DECOUPLED = 0, 1, 2   # weight decay: none, Adam's, AdamW's


@exact_kernel
def adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, start, stop, decay_factor,
               weight_decay, beta1_rest, beta2, beta2_rest, eps, step_size, correction2,
               decay, amsgrad, maximize):
    # The update of elements start .. stop (module docstring); the scalars are in the dtype
    # already. Slices from 0: an index that may be negative makes LLVM gather (gelu.py).
    param, grad = param[start:stop], grad[start:stop]
    exp_avg, exp_avg_sq = exp_avg[start:stop], exp_avg_sq[start:stop]
    vmax = max_exp_avg_sq[start:stop] if amsgrad else max_exp_avg_sq[0:0]
    for i in range(param.shape[0]):
        g = -grad[i] if maximize else grad[i]
        p = param[i]
        if decay == DECOUPLED:
            p = p * decay_factor
        elif decay == L2_PENALTY:
            g = g + weight_decay * p
        m = exp_avg[i] + beta1_rest * (g - exp_avg[i])
        v = exp_avg_sq[i] * beta2 + (beta2_rest * g) * g
        exp_avg[i] = m
        exp_avg_sq[i] = v
        if amsgrad:                                 # NumPy's maximum: NaN if either is
            if vmax[i] > v or vmax[i] != vmax[i]:
                v = vmax[i]
            vmax[i] = v
        param[i] = p - (step_size * m) / (math.sqrt(v) / correction2 + eps)


@parallel_kernel(twin=True)
def adam_kernel(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, decay_factor, weight_decay,
                beta1_rest, beta2, beta2_rest, eps, step_size, correction2, decay, amsgrad,
                maximize):
    # param, grad, exp_avg, exp_avg_sq (N,), max_exp_avg_sq (N,) with amsgrad (else (0,)):
    # one Adam/AdamW step, in place. decay: NO_DECAY, L2_PENALTY (Adam's g + weight_decay·θ)
    # or DECOUPLED (AdamW's θ·decay_factor).
    n = param.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):   # each iteration owns one block
        adam_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, blk * BLOCK,
                   min(blk * BLOCK + BLOCK, n), decay_factor, weight_decay, beta1_rest, beta2,
                   beta2_rest, eps, step_size, correction2, decay, amsgrad, maximize)
