"""``npattn warmup``: compile every kernel, for float32 and float64, into Numba's disk cache.

    npattn warmup                     # both dtypes, progress on stdout
    npattn warmup --dtype float32     # one dtype
    npattn warmup --quiet             # only errors

A kernel compiles on its first call (seconds each, about a minute for all of them, cold) and is
written to Numba's disk cache, from which every later process loads it in milliseconds. Run
this once where the cache will live -- a container image's build step, a CI job before its cache
is saved -- and no process started afterwards compiles anything. The cache is where Numba puts
it: ``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` next to the kernels, else (a read-only
install) the user cache directory, ``~/.cache/numba``.

How: each public op is called on tiny inputs in every form that reaches a different kernel or
kernel signature (both dtypes; bias or none; the three GEMM paths -- small dot products, packed,
many batches; every mask kind, causal, dropout, GQA, the mask's gradient...). Then every parallel
kernel of ``npattn.kernels`` is checked to hold a compiled signature for each dtype asked for:
a kernel no op reached is reported and the exit status is 1, so a new kernel without a warm-up
step cannot go unnoticed. The results of the calls are thrown away.
"""
import argparse
import importlib
import pkgutil
import sys
import time

import numba
import numpy as np

from . import _jit
from . import kernels as _kernels_package

DTYPES = {"float32": (np.float32,), "float64": (np.float64,), "both": (np.float32, np.float64)}


def _op(name, module):
    """The public op ``name`` (from ``npattn``, or else ``npattn.functional.<module>``), or None
    when this version has no such op."""
    import npattn
    found = getattr(npattn, name, None)
    if found is None:
        try:
            found = getattr(importlib.import_module(f"npattn.functional.{module}"), name, None)
        except ImportError:
            return None
    return found


# ---------------------------------------------------------------------------- the steps
# One function per op: calls it (and its backward) on tiny inputs of one dtype, in every form
# that reaches a different kernel. Each returns nothing; results are discarded.

def _linear(dtype, rng):
    linear, linear_backward = _op("linear", "linear"), _op("linear_backward", "linear")
    x = rng.standard_normal((2, 3, 8)).astype(dtype)             # (..., Fin)
    w = rng.standard_normal((6, 8)).astype(dtype)                # (Fout, Fin)
    b = rng.standard_normal(6).astype(dtype)
    y = linear(x, w, b)                                          # small dot products
    linear(x, w)
    linear_backward(y, x, w, b)                                  # packed GEMM, column sums
    linear_backward(y, x, w)
    xb = rng.standard_normal((64, 128)).astype(dtype)            # > SMALL multiply-adds:
    wb = rng.standard_normal((130, 128)).astype(dtype)           # the packed path, x·Wᵀ
    linear(xb, wb, rng.standard_normal(130).astype(dtype))


def _matmul(dtype, rng):
    matmul, matmul_backward = _op("matmul", "matmul"), _op("matmul_backward", "matmul")
    from .kernels.gemm import BATCHED
    many = BATCHED * numba.get_num_threads()                     # the many-batches path
    for a_shape, b_shape in (((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)),
                             ((4,), (4,)), ((4,), (2, 4, 3)), ((many, 2, 3), (many, 3, 2)),
                             ((many, 2, 3), (1, 3, 2))):
        a = rng.standard_normal(a_shape).astype(dtype)
        b = rng.standard_normal(b_shape).astype(dtype)
        out = matmul(a, b)
        matmul_backward(np.ones_like(out), a, b)


def _softmax(dtype, rng):
    x = rng.standard_normal((3, 4, 5)).astype(dtype)
    for name in ("softmax", "log_softmax"):
        forward, backward = _op(name, "softmax"), _op(f"{name}_backward", "softmax")
        for dim in (-1, 1):
            y = forward(x, dim=dim)
            backward(np.ones_like(y), y, dim=dim)


def _dropout(dtype, rng):
    dropout, dropout_backward = _op("dropout", "dropout"), _op("dropout_backward", "dropout")
    x = rng.standard_normal((3, 5)).astype(dtype)
    y = dropout(x, 0.3, seed=1)
    dropout_backward(y, 0.3, seed=1)
    _op("dropout_mask", "dropout")((3, 5), 0.3, 1)


def _attention_inputs(dtype, rng):
    q = rng.standard_normal((2, 4, 5, 8)).astype(dtype)          # (B, H, L, E)
    k = rng.standard_normal((2, 2, 7, 8)).astype(dtype)          # (B, Hkv, S, E)
    v = rng.standard_normal((2, 2, 7, 6)).astype(dtype)          # (B, Hkv, S, Ev)
    bool_mask = rng.random((5, 7)) < 0.8                         # (L, S), broadcast
    float_mask = rng.standard_normal((4, 5, 7)).astype(dtype)    # (H, L, S)
    return q, k, v, bool_mask, float_mask


def _sdpa(dtype, rng):
    forward = _op("scaled_dot_product_attention_forward", "attention")
    backward = _op("scaled_dot_product_attention_backward", "attention")
    q, k, v, bool_mask, float_mask = _attention_inputs(dtype, rng)
    variants = [dict(enable_gqa=True),
                dict(attn_mask=bool_mask, is_causal=True, dropout_p=0.25, seed=3,
                     enable_gqa=True),
                dict(attn_mask=float_mask, is_causal=True, causal_alignment="bottom-right",
                     enable_gqa=True, scale=0.5),
                dict(attn_mask=float_mask, dropout_p=0.25, seed=3, enable_gqa=True)]
    for kw in variants:
        out, lse = forward(q, k, v, **kw)
        grad_mask = kw.get("attn_mask") is float_mask
        backward(np.ones_like(out), q, k, v, out, lse, mask_grad=grad_mask, **kw)
    _op("scaled_dot_product_attention", "attention")(q[:, :2], k, v)


def _attention(dtype, rng):
    attention, attention_backward = _op("attention", "attention"), \
        _op("attention_backward", "attention")
    q, k, v, bool_mask, float_mask = _attention_inputs(dtype, rng)
    q = q[:, :2]                                                 # H = Hkv: no GQA here
    for kw in (dict(), dict(mask=bool_mask, dropout_p=0.25, seed=3, is_causal=True),
               dict(mask=float_mask[:2], causal_alignment="bottom-right", is_causal=True)):
        out, _ = attention(q, k, v, **kw)
        grad_mask = kw.get("mask") is not None and kw["mask"].dtype != np.bool_
        attention_backward(np.ones_like(out), q, k, v, mask_grad=grad_mask, **kw)


def _embedding(dtype, rng):
    embedding, embedding_backward = _op("embedding", "embedding"), \
        _op("embedding_backward", "embedding")
    weight = rng.standard_normal((6, 4)).astype(dtype)           # (V, E)
    indices = rng.integers(0, 6, (2, 3))                         # (...) int64
    out = embedding(indices, weight)
    embedding_backward(np.ones_like(out), indices, weight)
    embedding_backward(np.ones_like(out), indices, weight, padding_idx=0)


def _cross_entropy(dtype, rng):
    forward = _op("cross_entropy", "cross_entropy")
    backward = _op("cross_entropy_backward", "cross_entropy")
    for x_shape, t_shape in (((4, 5), (4,)), ((2, 5, 3), (2, 3)), ((5,), ())):
        x = rng.standard_normal(x_shape).astype(dtype)           # classes on axis 1 (0 if 1-D)
        target = rng.integers(0, 5, t_shape)
        for reduction in ("mean", "sum", "none"):
            kw = dict(reduction=reduction, label_smoothing=0.1)
            loss = forward(x, target, **kw)
            backward(np.ones_like(loss), x, target, **kw)


def _layer_norm(dtype, rng):
    forward, backward = _op("layer_norm", "layer_norm"), _op("layer_norm_backward", "layer_norm")
    x = rng.standard_normal((3, 2, 4)).astype(dtype)
    w = rng.standard_normal((2, 4)).astype(dtype)
    b = rng.standard_normal((2, 4)).astype(dtype)
    for args in (((4,),), ((2, 4), w, b)):
        y = forward(x, *args)
        backward(np.ones_like(y), x, *args)


#: (name shown, the op it needs, its module in npattn.functional, the step)
STEPS = [("linear", "linear", "linear", _linear),
         ("matmul", "matmul", "matmul", _matmul),
         ("softmax, log_softmax", "softmax", "softmax", _softmax),
         ("dropout", "dropout", "dropout", _dropout),
         ("scaled_dot_product_attention", "scaled_dot_product_attention", "attention", _sdpa),
         ("attention", "attention", "attention", _attention),
         ("embedding", "embedding", "embedding", _embedding),
         ("cross_entropy", "cross_entropy", "cross_entropy", _cross_entropy),
         ("layer_norm", "layer_norm", "layer_norm", _layer_norm)]


# ---------------------------------------------------------------------------- the kernels

def parallel_kernels():
    """{"module.name": ThreadSafeKernel} of every parallel kernel in ``npattn.kernels``."""
    found = {}
    for info in pkgutil.iter_modules(_kernels_package.__path__):
        if info.name.startswith("_"):                            # generator, generated source
            continue
        module = importlib.import_module(f"npattn.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, _jit.ThreadSafeKernel):
                found[f"{info.name}.{name}"] = obj
    return found


def _float_dtypes(signature):
    """The float dtype names of a signature's array arguments."""
    return {str(t.dtype) for t in signature
            if isinstance(t, numba.types.Array) and isinstance(t.dtype, numba.types.Float)}


def missing(kernels, dtypes):
    """["module.name (dtype)"] of the kernels without a compiled signature for a dtype asked
    for (a kernel that takes no float array needs one signature of any kind)."""
    wanted = {np.dtype(d).name for d in dtypes}
    gaps = []
    for name, k in sorted(kernels.items()):
        signatures = k.dispatcher.signatures
        if not signatures:
            gaps.append(f"{name} (never called)")
            continue
        have = set().union(*(_float_dtypes(s) for s in signatures))
        if have:
            gaps += [f"{name} ({d})" for d in sorted(wanted - have)]
    return gaps


def _counts(kernels):
    """(signatures loaded from the disk cache, signatures compiled) over the kernels."""
    hits = sum(sum(k.dispatcher.stats.cache_hits.values()) for k in kernels.values())
    misses = sum(sum(k.dispatcher.stats.cache_misses.values()) for k in kernels.values())
    return hits, misses


def warmup(dtypes=(np.float32, np.float64), report=print):
    """Call every op on tiny inputs of each dtype, so that each kernel is compiled and written
    to Numba's disk cache (or loaded from it). ``report(line)`` gets the progress.

    Returns ``(timings, gaps)``: [(dtype name, step name, seconds, CPU seconds)] and the
    kernels no step reached (see :func:`missing`; empty when all is warm).
    """
    kernels = parallel_kernels()
    timings = []
    for dtype in dtypes:
        name = np.dtype(dtype).name
        rng = np.random.default_rng(0)
        for label, op, module, step in STEPS:
            if _op(op, module) is None:                          # not in this version
                continue
            start, cpu = time.perf_counter(), time.process_time()
            step(dtype, rng)
            seconds = time.perf_counter() - start
            timings.append((name, label, seconds, time.process_time() - cpu))
            report(f"  {name:8} {label:30} {seconds:7.2f} s")
    return timings, missing(kernels, dtypes)


def cache_directories(kernels=None):
    """The directories Numba caches npattn's kernels in ([] when caching is unavailable)."""
    kernels = parallel_kernels() if kernels is None else kernels
    return sorted({k.dispatcher.stats.cache_path for k in kernels.values()} - {None})


def main(argv=None, prog="npattn warmup"):
    """``npattn warmup``: returns the exit status (0: every kernel is in the disk cache)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Compile every npattn kernel ahead of time into Numba's disk cache "
                    "(for container images and CI caches), so no later process compiles.")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="both",
                        help="the dtypes to compile for (default: both)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)

    def say(line):
        if not args.quiet:
            print(line, flush=True)

    if not _jit.slp_enabled():
        print("npattn warmup: NUMBA_SLP_VECTORIZE=0 is set, and npattn never writes a kernel "
              "compiled without SLP to the disk cache (npattn/_jit.py): unset it to warm up",
              file=sys.stderr)
        return 1
    kernels = parallel_kernels()
    directories = cache_directories(kernels)
    if not directories:
        print("npattn warmup: no writable cache directory (npattn's package directory, "
              "NUMBA_CACHE_DIR and the user cache directory are all read-only or unset): "
              "kernels compile in each process; nothing to warm", file=sys.stderr)
        return 1
    dtypes = DTYPES[args.dtype]
    say(f"npattn warmup: {len(kernels)} kernels, {' and '.join(np.dtype(d).name for d in dtypes)}"
        f", into {', '.join(directories)}")
    start = time.perf_counter()
    timings, gaps = warmup(dtypes, say)
    hits, misses = _counts(kernels)
    say(f"npattn warmup: {time.perf_counter() - start:.1f} s: {misses} kernel signatures "
        f"compiled, {hits} already in the cache")
    if gaps:
        print("npattn warmup: no op reached these kernels, which will compile on first use: "
              + ", ".join(gaps), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
