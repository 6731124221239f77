"""How close npattn's float32 results are to the float64 truth, next to PyTorch's float32.

    python -m benchmarks.accuracy

Both float32 implementations get the same float32 inputs; the truth is ``npattn.reference`` in
float64 on those inputs. The error of an entry is measured in units of
``eps32 · (|want| + scale)``, where ``scale`` is the magnitude of the terms the entry sums
(``|a|·|b|`` for a product; 0 for softmax's outputs, whose error is relative to each entry;
1 for log_softmax's; the magnitudes of the terms of dx for the backwards; Σ_j p_ij·|v_j| for
attention's output; the largest gradient entry for attention's gradients, i.e. normwise): the
unit in which summation error bounds are written. The table gives the median and the maximum
over every entry of every output.
"""
import argparse

import numpy as np

import npattn
from npattn import reference

EPS32 = float(np.finfo(np.float32).eps)


def _torch_grads(torch, forward, dout, *inputs):
    """PyTorch float32 autograd: the gradients of ``forward(*inputs)`` for upstream ``dout``."""
    ts = [torch.from_numpy(np.array(i)).requires_grad_() for i in inputs]
    forward(*ts).backward(torch.from_numpy(dout))
    return tuple(t.grad.numpy() for t in ts)


def cases(rng, torch):
    """Yield (label, npattn result, PyTorch result or None, truth, scale) for each case."""
    f32 = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    f64 = lambda *arrays: [np.asarray(a, np.float64) for a in arrays]  # noqa: E731
    a64 = lambda *arrays: [np.abs(np.asarray(a, np.float64)) for a in arrays]  # noqa: E731
    tt = (lambda *arrays: [torch.from_numpy(a) for a in arrays]) if torch else None
    F = torch.nn.functional if torch else None

    for x, w, b in ((f32(2, 5, 512), f32(64, 512), f32(64)),
                    (f32(8, 128, 512), f32(512, 512), f32(512))):
        shape = f"[{','.join(map(str, x.shape))}]→{w.shape[0]}"
        yield (f"linear fwd {shape}", (npattn.linear(x, w, b),),
               torch and (F.linear(*tt(x, w, b)).numpy(),),
               (reference.linear_forward(*f64(x, w, b)),),
               (reference.linear_forward(*a64(x, w, b)),))
        dout = f32(*x.shape[:-1], w.shape[0])
        yield (f"linear bwd {shape}", npattn.linear_backward(dout, x, w, b),
               torch and _torch_grads(torch, F.linear, dout, x, w, b),
               reference.linear_backward(*f64(dout, x, w, b)),
               reference.linear_backward(*a64(dout, x, w, b)))

    a, bm = f32(8, 128, 64), f32(8, 64, 128)
    dout = f32(8, 128, 128)
    yield ("matmul fwd [8,128,64]·[8,64,128]", (npattn.matmul(a, bm),),
           torch and (torch.matmul(*tt(a, bm)).numpy(),),
           (reference.matmul_forward(*f64(a, bm)),), (reference.matmul_forward(*a64(a, bm)),))
    yield ("matmul bwd [8,128,64]·[8,64,128]", npattn.matmul_backward(dout, a, bm),
           torch and _torch_grads(torch, torch.matmul, dout, a, bm),
           reference.matmul_backward(*f64(dout, a, bm)),
           reference.matmul_backward(*a64(dout, a, bm)))

    logits, dout = f32(256, 1024, s=10.0), f32(256, 1024)
    y64 = {"softmax": reference.softmax_forward(*f64(logits)),
           "log_softmax": reference.log_softmax_forward(*f64(logits))}
    fwd_scale = {"softmax": np.full(logits.shape, np.finfo(np.float32).tiny),  # relative error
                 "log_softmax": np.ones(logits.shape)}
    d64 = np.abs(dout.astype(np.float64))
    p64 = np.exp(y64["log_softmax"])
    bwd_scale = {"softmax": p64 * (d64 + (d64 * p64).sum(-1, keepdims=True)),  # |terms| of dx
                 "log_softmax": d64 + p64 * d64.sum(-1, keepdims=True)}
    for name in ("softmax", "log_softmax"):
        ours_fwd = getattr(npattn, name)
        theirs = getattr(torch, name) if torch else None
        yield (f"{name} fwd [256,1024], σ=10", (ours_fwd(logits),),
               torch and (theirs(tt(logits)[0], -1).numpy(),),
               (y64[name],), (fwd_scale[name],))
        # backward from each implementation's own forward output, against the exact chain
        yield (f"{name} bwd [256,1024]",
               (getattr(npattn, f"{name}_backward")(dout, ours_fwd(logits)),),
               torch and _torch_grads(torch, lambda t: theirs(t, -1), dout, logits),
               (getattr(reference, f"{name}_backward")(*f64(dout), y64[name]),),
               (bwd_scale[name],))

    q, k, v, dout = (f32(2, 4, 256, 64) for _ in range(4))
    for causal in (False, True):
        label = "attention " + ("causal " if causal else "") + "[2,4,256,64]"
        mask = np.tril(np.ones((256, 256), bool)) if causal else None
        out64, weights64 = reference.attention_forward(*f64(q, k, v), mask=mask)
        scale_out = weights64 @ np.abs(v.astype(np.float64))      # |terms| of each output
        yield (f"{label} fwd", (npattn.scaled_dot_product_attention(q, k, v, is_causal=causal),),
               torch and (F.scaled_dot_product_attention(*tt(q, k, v), is_causal=causal)
                          .numpy(),),
               (out64,), (scale_out,))
        ours = npattn.scaled_dot_product_attention_forward(q, k, v, is_causal=causal)
        want = reference.attention_backward(*f64(dout, q, k, v), mask=mask)[:3]
        yield (f"{label} bwd",
               npattn.scaled_dot_product_attention_backward(dout, q, k, v, *ours,
                                                            is_causal=causal),
               torch and _torch_grads(torch, lambda *t: F.scaled_dot_product_attention(
                   *t, is_causal=causal), dout, q, k, v),
               want, [np.full(w.shape, np.abs(w).max()) for w in want])  # normwise


def error_units(got, want, scale):
    errs = [np.abs(np.asarray(g, np.float64) - w) / (EPS32 * (np.abs(w) + s))
            for g, w, s in zip(got, want, scale) if w is not None]
    flat = np.concatenate([e[np.isfinite(e)].ravel() for e in errs])
    return float(np.median(flat)), float(np.max(flat))


def measure(seed=0):
    """[(label, (median, max) for npattn, (median, max) for PyTorch or None)]."""
    try:
        import torch
    except ImportError:
        torch = None
    rows = []
    for label, ours, theirs, want, scale in cases(np.random.default_rng(seed), torch):
        rows.append((label, error_units(ours, want, scale),
                     theirs and error_units(theirs, want, scale)))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("| case | npattn fp32 error, median / max | PyTorch fp32 error, median / max |")
    print("|---|---|---|")
    for label, ours, theirs in measure(args.seed):
        t = "n/a" if theirs is None else f"{theirs[0]:.3f} / {theirs[1]:.2f}"
        print(f"| {label} | {ours[0]:.3f} / {ours[1]:.2f} | {t} |")
    print("\nUnits: eps32·(|want| + scale); scale = |a|·|b| for products, 0 for softmax outputs "
          "(relative error), 1 for log_softmax outputs, |terms of dx| for the backwards.")


if __name__ == "__main__":
    main()
