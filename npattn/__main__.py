"""``python -m npattn``: the article's attention, run on npattn's kernels, forward and backward.

X (2, 5, 512) -- a batch of 2 sentences of 5 tokens, d_model = 512 -- goes through
W_Q, W_K, W_V = Linear(512, 64); then scores = Q·Kᵀ/√d_k, weights = softmax(scores),
Z = weights·V. Each step prints its shape, and the result is checked against the float64
textbook in ``npattn.reference``. The backward pass is the chain rule written out with the
ops' ``*_backward`` pairs.
"""
import argparse
import math
import sys
import time

import numpy as np

import npattn
from npattn import reference


def _step(label, array):
    print(f"  {label:<34} {str(array.shape):<14} {array.dtype}")


def article(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    batch, src_len, d_model, d_k, d_v = 2, 5, 512, 64, 64
    x = rng.standard_normal((batch, src_len, d_model)).astype(dtype)
    bound = 1.0 / math.sqrt(d_model)  # nn.Linear's initialisation range
    params = {name: (rng.uniform(-bound, bound, (d_out, d_model)).astype(dtype),
                     rng.uniform(-bound, bound, d_out).astype(dtype))
              for name, d_out in (("W_Q", d_k), ("W_K", d_k), ("W_V", d_v))}

    print("The article's dot-product attention on npattn's kernels")
    print("  softmax([2, 4, 4]) =", np.round(npattn.softmax(np.array([2.0, 4.0, 4.0])), 3),
          "(the article rounds this to [0.0, 0.5, 0.5])")
    print("forward:")
    _step("X  [batch, src_len, d_model]", x)
    q = npattn.linear(x, *params["W_Q"]); _step("Q = X·W_Qᵀ + b", q)
    k = npattn.linear(x, *params["W_K"]); _step("K = X·W_Kᵀ + b", k)
    v = npattn.linear(x, *params["W_V"]); _step("V = X·W_Vᵀ + b", v)
    k_t = np.swapaxes(k, -1, -2)
    scores = npattn.matmul(q, k_t) / np.asarray(math.sqrt(d_k), dtype)
    _step("scores = Q·Kᵀ/√d_k", scores)
    weights = npattn.softmax(scores, dim=-1); _step("weights = softmax(scores)", weights)
    z = npattn.matmul(weights, v); _step("Z = weights·V", z)

    print("backward (a random upstream gradient dZ):")
    dz = rng.standard_normal(z.shape).astype(dtype)
    dweights, dv = npattn.matmul_backward(dz, weights, v)
    dscores = npattn.softmax_backward(dweights, weights, dim=-1)
    dq, dk_t = npattn.matmul_backward(dscores / np.asarray(math.sqrt(d_k), dtype), q, k_t)
    dk = np.swapaxes(dk_t, -1, -2)
    dx = np.zeros_like(x)
    for name, d in (("W_Q", dq), ("W_K", dk), ("W_V", dv)):
        dx_part, dweight, dbias = npattn.linear_backward(d, x, *params[name])
        dx += dx_part
        _step(f"d{name}", dweight)
    _step("dX", dx)

    print("the same attention on the fused engine (npattn.attention: one kernel, no L×S "
          "matrix but the weights it returns):")
    z_fused, weights_fused = npattn.attention(q, k, v)
    _step("Z, weights = attention(Q, K, V)", z_fused)
    dq_fused, dk_fused, dv_fused = npattn.attention_backward(dz, q, k, v)
    _step("dQ, dK, dV = attention_backward", dq_fused)
    fused = max(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30) for a, b in
                ((z_fused, z), (weights_fused, weights), (dq_fused, dq), (dk_fused, dk),
                 (dv_fused, dv)))
    print(f"  max relative difference from the step-by-step kernels: {fused:.2e}")

    x64 = x.astype(np.float64)
    p64 = {n: tuple(a.astype(np.float64) for a in wb) for n, wb in params.items()}
    q64, k64, v64 = (reference.linear_forward(x64, *p64[n]) for n in ("W_Q", "W_K", "W_V"))
    z64, _ = reference.attention_forward(q64, k64, v64)
    grads64 = reference.attention_backward(dz.astype(np.float64), q64, k64, v64)[:3]
    dx64 = sum(reference.linear_backward(d, x64, *p64[name])[0]
               for name, d in zip(("W_Q", "W_K", "W_V"), grads64))
    err = max(np.max(np.abs(z - z64)), np.max(np.abs(dx - dx64)) / np.max(np.abs(dx64)))
    print(f"max |Z - Z_float64| = {np.max(np.abs(z - z64)):.2e}, "
          f"max |dX - dX_float64| / max |dX_float64| = "
          f"{np.max(np.abs(dx - dx64)) / np.max(np.abs(dx64)):.2e}  (npattn.reference)")
    return max(err, fused)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npattn", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    err = article(args.seed, np.dtype(args.dtype))
    print(f"done in {time.perf_counter() - start:.1f} s (the first run compiles the kernels)")
    tol = 1e-4 if args.dtype == "float32" else 1e-10
    return 0 if err < tol else 1


if __name__ == "__main__":
    sys.exit(main())
