"""attention: scaled dot-product attention, forward and forward+backward, causal or not.

q, k, v are (B, H, L, D) = (4, 8, L, 64), float32, self-attention (S = L). Implementations:

- npattn: ``scaled_dot_product_attention`` forward; forward+backward is
  ``scaled_dot_product_attention_forward`` (output, logsumexp) then ``..._backward``;
- PyTorch: ``torch.nn.functional.scaled_dot_product_attention``, backward by autograd;
- NumPy: the textbook, the (B, H, L, S) scores materialised: (q·scale)·kᵀ, the causal mask
  written in as -inf, softmax in place, ·v. Its backward keeps the probabilities P of the
  forward: dv = Pᵀ·dout, dP = dout·vᵀ, dS = P∘(dP - rowsum(dout∘out)) (the same as
  rowsum(dP∘P), with no third L×S array), dq = dS·k·scale, dk = dSᵀ·q·scale. It needs one
  B·H·L·S array forward and two forward+backward; a case whose estimate exceeds
  ``NUMPY_LIMIT`` (or half the available memory) skips NumPy and says so.

FLOPs (nominal, the same for every implementation): forward 4·B·H·L·S·D (q·kᵀ and P·v); the
backward 2.5× that (recomputing q·kᵀ, then dv, dP, dq, dk: FlashAttention's count), so
forward+backward is 3.5×; causal cases count half. The NumPy version computes the full square
either way (and does not recompute q·kᵀ).

Full runs also measure each implementation's peak resident memory in a fresh process
(``benchmarks/memory.py``) for L ≥ ``RSS_FROM``, against the bytes of q, k, v and the output.
"""
import math

import numpy as np

import npattn

from .cases import Bench, case, impls, randn, shape, torch_forward, torch_forward_backward
from .report import fmt_bytes

B, H, D = 4, 8, 64
LENGTHS = (128, 512, 1024, 2048, 4096)
LENGTHS_QUICK = (128, 512)
RSS_FROM = 1024                       # full runs: peak RSS in a fresh process from this L up
WARMUP_L = 256                        # the memory child's warm-up call (compiles, loads caches)
NUMPY_LIMIT = 8 * 2**30               # skip NumPy when its L×S arrays would need more
NOTE = ("attention GFLOP/s are nominal: forward 4·B·H·L·S·D, forward+backward 3.5× that, "
        "causal half; NumPy computes the full L×S square (causal too)")

SIZES = [(n, c) for n in LENGTHS for c in (False, True)]
SIZES_QUICK = [(n, c) for n in LENGTHS_QUICK for c in (False, True)]


# ------------------------------------------------------------------------ NumPy, the textbook

def numpy_forward(q, k, v, is_causal):
    """(output, P): P = softmax(q·kᵀ·scale, masked) materialised, (B, H, L, S)."""
    length, keys = q.shape[-2], k.shape[-2]
    scale = q.dtype.type(1 / math.sqrt(q.shape[-1]))
    p = (q * scale) @ np.swapaxes(k, -1, -2)                      # scores (B, H, L, S)
    if is_causal:                                                 # key j visible iff j <= i
        np.copyto(p, -np.inf, where=np.triu(np.ones((length, keys), bool), 1))
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, p                                               # (B, H, L, Ev), P


def numpy_backward(dout, q, k, v, out, p):
    """(dq, dk, dv) from the forward's P (overwritten: it is not needed afterwards)."""
    scale = q.dtype.type(1 / math.sqrt(q.shape[-1]))
    dv = np.swapaxes(p, -1, -2) @ dout                            # (B, H, S, Ev)
    ds = dout @ np.swapaxes(v, -1, -2)                            # dP (B, H, L, S)
    ds -= (dout * out).sum(axis=-1, keepdims=True)                # = rowsum(dP∘P)
    ds *= p                                                       # dS, the scores' gradient
    dq = (ds @ k) * scale                                         # (B, H, L, E)
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale                    # (B, H, S, E)
    return dq, dk, dv


def numpy_bytes(length, backward, itemsize=4):
    """Estimated peak of the NumPy version: its L×S arrays (1 forward, 2 with the backward)."""
    return (2 if backward else 1) * B * H * length * length * itemsize


def numpy_limit():
    """``NUMPY_LIMIT``, or half of the memory available now if that is less (Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(NUMPY_LIMIT, int(line.split()[1]) * 1024 // 2)
    except OSError:
        pass
    return NUMPY_LIMIT


# ------------------------------------------------------------------------ the cases

def _inputs(length):
    return randn(B, H, length, D), randn(B, H, length, D), randn(B, H, length, D)


def _label(kind, length, is_causal):
    return f"attention {kind}{' causal' if is_causal else ''} {shape((B, H, length, D))}"


def _bench(kind, length, is_causal, flops, impls_, skipped):
    return Bench(_label(kind, length, is_causal), flops=flops / (2 if is_causal else 1),
                 impls=impls_, plot=("attention", kind + (" causal" if is_causal else ""), length),
                 notes=[NOTE], skipped=skipped,
                 rss_warmup=(WARMUP_L, is_causal) if length >= RSS_FROM else None,
                 operand_bytes=4 * B * H * length * D * 4)        # q, k, v, output: float32


def _numpy_or_skip(length, backward, fn):
    need, limit = numpy_bytes(length, backward), numpy_limit()
    if need > limit:
        return None, {"NumPy": f"its L×S arrays would need ~{fmt_bytes(need)} "
                               f"> the {fmt_bytes(limit)} limit"}
    return fn, {}


@case("attention", sizes=SIZES, quick=SIZES_QUICK)
def attention_forward(torch, length, is_causal):
    q, k, v = _inputs(length)
    numpy, skipped = _numpy_or_skip(length, False, lambda: numpy_forward(q, k, v, is_causal)[0])
    sdpa = torch and (lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
        q_, k_, v_, is_causal=is_causal))
    return _bench("fwd", length, is_causal, 4 * B * H * length * length * D,
                  impls(npattn=lambda: npattn.scaled_dot_product_attention(
                            q, k, v, is_causal=is_causal),
                        numpy=numpy, torch=torch_forward(torch, sdpa, q, k, v)),
                  skipped)


@case("attention", sizes=SIZES, quick=SIZES_QUICK)
def attention_forward_backward(torch, length, is_causal):
    q, k, v = _inputs(length)
    dout = randn(B, H, length, D)

    def ours():
        out, lse = npattn.scaled_dot_product_attention_forward(q, k, v, is_causal=is_causal)
        return out, npattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                                 is_causal=is_causal)

    def numpy():
        out, p = numpy_forward(q, k, v, is_causal)
        return out, numpy_backward(dout, q, k, v, out, p)

    numpy, skipped = _numpy_or_skip(length, True, numpy)
    sdpa = torch and (lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
        q_, k_, v_, is_causal=is_causal))
    return _bench("fwd+bwd", length, is_causal, 3.5 * 4 * B * H * length * length * D,
                  impls(npattn=ours, numpy=numpy,
                        torch=torch_forward_backward(torch, sdpa, dout, q, k, v)),
                  skipped)
