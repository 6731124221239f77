"""``npattn warmup``: compile every kernel, for float32 and float64, into Numba's disk cache.

    npattn warmup                     # both dtypes, one worker process per CPU, progress
    npattn warmup --dtype float32     # one dtype
    npattn warmup --ops linear,softmax --jobs 1   # some ops' kernels, in this process
    npattn warmup --quiet             # only errors

A kernel compiles on its first call (seconds each, minutes for all of them, cold) and is
written to Numba's disk cache, from which every later process loads it in milliseconds. Run
this once where the cache will live -- a container image's build step, a CI job before its cache
is saved -- and no process started afterwards compiles anything. The cache is where Numba puts
it: ``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` next to the kernels, else (a read-only
install) the user cache directory, ``~/.cache/numba``. The GEMM and attention engines are
compiled for the register tile in force (``npattn info`` shows it; ``NPATTN_ISA=<family> npattn
warmup``, family avx2 or avx512, warms the other's too).

How: each public op is called on tiny inputs in every form that reaches a different kernel or
kernel signature (both dtypes; bias or none; the three GEMM paths -- small dot products, packed,
many batches; every mask kind, causal, dropout, GQA, the mask's gradient...). Then every parallel
kernel of ``npattn.kernels`` is checked to hold a compiled signature for each dtype asked for:
a kernel no op reached is reported and the exit status is 1, so a new kernel without a warm-up
step cannot go unnoticed. The results of the calls are thrown away.

In parallel (``--jobs N``, default: one process per CPU): Numba compiles one kernel at a time
per process (a global lock), so the work is spread over worker processes, dearest first: each
(dtype, step) pair is one unit, except that ops sharing parallel kernels (``SHARED``) form one
unit, so that two processes do not compile the same kernel. (Measured: the attention forward
and backward in one unit per dtype, 92 s for everything on 2 CPUs; in two, 105 s -- both
processes then compile the micro-kernel and ``exp``.) Serial kernels several steps call (the GEMM micro-kernel, ``exp``...) may still be compiled in two
processes at once; Numba's cache index is a file each writer reads, extends and rewrites,
without a lock, so two processes adding different signatures to one index at once could lose
one or give both the same data file. The workers therefore take a file lock around every write
to the cache (:func:`_lock_cache_writes`). At the end this process loads every kernel from the
cache, which also checks that none is missing.
"""
import argparse
import concurrent.futures
import importlib
import multiprocessing
import os
import pkgutil
import sys
import tempfile
import time

import numba
import numpy as np

from .. import _jit
from .. import kernels as _kernels_package
from ..kernels import tiles
from .progress import float_dtypes

DTYPES = {"float32": (np.float32,), "float64": (np.float64,), "both": (np.float32, np.float64)}


def _op(name, module):
    """The public op ``name`` (from ``npattn``, or else ``npattn.functional.<module>``, or else
    ``npattn.<module>``: ``optim``'s optimisers), or None when this version has no such op."""
    import npattn
    found = getattr(npattn, name, None)
    for package in ("npattn.functional.", "npattn."):
        if found is not None:
            break
        try:
            found = getattr(importlib.import_module(f"{package}{module}"), name, None)
        except ImportError:
            pass
    return found


# ---------------------------------------------------------------------------- the steps
# One function per op: calls it (and its backward) on tiny inputs of one dtype, in every form
# that reaches a different kernel. Each returns nothing; results are discarded.

def _linear(dtype, rng):
    linear, linear_backward = _op("linear", "linear"), _op("linear_backward", "linear")
    x = rng.standard_normal((2, 3, 8)).astype(dtype)             # (..., Fin)
    w = rng.standard_normal((6, 8)).astype(dtype)                # (Fout, Fin)
    b = rng.standard_normal(6).astype(dtype)
    y = linear(x, w, b)                                          # small dot products (their
    linear(x, w)                                                 # serial twin: few of them)
    linear(rng.standard_normal((1, 96)).astype(dtype),          # one row on every thread:
           rng.standard_normal((1000, 96)).astype(dtype))       # the parallel small dots
    linear_backward(y, x, w, b)                                  # packed GEMM, its row sums
    linear_backward(y, x, w)                                     # (the bias gradient)
    linear_backward(y, x[..., :0], w[:, :0], b)                  # no features: column sums
    xb = rng.standard_normal((64, 128)).astype(dtype)            # > SMALL multiply-adds:
    wb = rng.standard_normal((130, 128)).astype(dtype)           # the packed path in one
    linear(xb, wb, rng.standard_normal(130).astype(dtype))       # launch, x·Wᵀ
    xl = rng.standard_normal((64, 260)).astype(dtype)            # > PACKED_SMALL, few rows
    wl = rng.standard_normal((1100, 260)).astype(dtype)          # and a wide B: the packed
    linear(xl, wl, rng.standard_normal(1100).astype(dtype))      # path, 2 launches per K block


def _matmul(dtype, rng):
    matmul, matmul_backward = _op("matmul", "matmul"), _op("matmul_backward", "matmul")
    many = tiles.engine("gemm", dtype).BATCHED * numba.get_num_threads()                     # the many-batches path
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


#: The forms of scaled_dot_product_attention the warm-up calls: every mask kind, causal (both
#: alignments), dropout, GQA, scale, and the float mask's gradient.
def _sdpa_variants(bool_mask, float_mask):
    return [dict(enable_gqa=True),
            dict(attn_mask=bool_mask, is_causal=True, dropout_p=0.25, seed=3, enable_gqa=True),
            dict(attn_mask=float_mask, is_causal=True, causal_alignment="bottom-right",
                 enable_gqa=True, scale=0.5),
            dict(attn_mask=float_mask, dropout_p=0.25, seed=3, enable_gqa=True)]


def _sdpa_forward(dtype, rng):
    forward = _op("scaled_dot_product_attention_forward", "attention")
    q, k, v, bool_mask, float_mask = _attention_inputs(dtype, rng)
    for kw in _sdpa_variants(bool_mask, float_mask):
        forward(q, k, v, **kw)
    _op("scaled_dot_product_attention", "attention")(q[:, :2], k, v)
    _op("scaled_dot_product_attention_varlen", "attention")(*_varlen_inputs(q, k, v),
                                                            **_VARLEN)


#: A packed variable-length call (varlen) reaches the dense kernels, with the same signatures:
#: the warm-up calls it so that the forms are checked to need nothing more.
_VARLEN = dict(is_causal=True, causal_alignment="bottom-right", dropout_p=0.25, seed=3,
               enable_gqa=True)


def _varlen_inputs(q, k, v):
    """q (B, H, L, E), k, v (B, Hkv, S, ·) as packed sequences (total, heads, ·) and the
    cu_seqlens of B sequences of lengths L, S."""
    packed = [np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(-1, *x.shape[1::2]))
              for x in (q, k, v)]
    cu = [np.arange(q.shape[0] + 1, dtype=np.int64) * n for n in (q.shape[2], k.shape[2])]
    return (*packed, *cu)


def _sdpa_backward(dtype, rng):
    # (its own step, so that a parallel warm-up compiles it beside the forward: any finite
    # out and lse of the right shapes do -- the results are thrown away)
    backward = _op("scaled_dot_product_attention_backward", "attention")
    q, k, v, bool_mask, float_mask = _attention_inputs(dtype, rng)
    out = np.zeros(q.shape[:3] + v.shape[3:], dtype)
    lse = np.zeros(q.shape[:3], dtype)
    for kw in _sdpa_variants(bool_mask, float_mask):
        grad_mask = kw.get("attn_mask") is float_mask
        backward(np.ones_like(out), q, k, v, out, lse, mask_grad=grad_mask, **kw)
    q_p, k_p, v_p, cu_q, cu_k = _varlen_inputs(q, k, v)
    out_p = np.zeros(q_p.shape[:2] + v_p.shape[2:], dtype)
    _op("scaled_dot_product_attention_varlen_backward", "attention")(
        np.ones_like(out_p), q_p, k_p, v_p, out_p, np.zeros(q_p.shape[1::-1], dtype), cu_q,
        cu_k, **_VARLEN)


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
    _heads(dtype, rng)                          # the heads' copies around MultiheadAttention's


def _heads(dtype, rng):
    from ..functional.attention import merge_heads_side_by_side, split_heads
    for n, length in ((1, 1), (2, 2100)):                        # the serial twins, then the
        x = rng.standard_normal((n, length, 3 * 2 * 4)).astype(dtype)  # kernels: (N, L, k·H·D)
        merge_heads_side_by_side(tuple(split_heads(x, 2, True, parts=3)), True)
        merge_heads_side_by_side((split_heads(x.transpose(1, 0, 2), 2, False, parts=3)[0],),
                                 False)                           # sequence-first: strided


def _embedding(dtype, rng):
    embedding, embedding_backward = _op("embedding", "embedding"), \
        _op("embedding_backward", "embedding")
    weight = rng.standard_normal((6, 4)).astype(dtype)           # (V, E)
    indices = rng.integers(0, 6, (2, 3))                         # (...) int64
    out = embedding(indices, weight)                             # (small: the serial twin)
    embedding_backward(np.ones_like(out), indices, weight)
    embedding_backward(np.ones_like(out), indices, weight, padding_idx=0)
    embedding(rng.integers(0, 6, 100), weight)                   # past ROWS: the parallel forward


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
        y = forward(x, *args)                                    # (small: the serial twin)
        backward(np.ones_like(y), x, *args)
    forward(rng.standard_normal((40, 128)).astype(dtype), (128,))   # the parallel forward


def _gelu(dtype, rng):
    forward, backward = _op("gelu", "gelu"), _op("gelu_backward", "gelu")
    for n in (15, 5000):                       # one block (the serial twins), then several
        x = rng.standard_normal(n).astype(dtype)
        for approximate in ("none", "tanh"):   # one kernel each way: a flag, not a signature
            y = forward(x, approximate)
            backward(y, x, approximate)


def _rotary(dtype, rng):
    forward = _op("rotary_embedding", "rotary")
    backward = _op("rotary_embedding_backward", "rotary")
    theta = rng.standard_normal((20, 32))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    for lead in ((1,), (8,)):                  # one block (the serial twin), then several
        x = rng.standard_normal(lead + (20, 64)).astype(dtype)
        for interleaved in (False, True):      # a flag, not a signature
            backward(forward(x, cos, sin, interleaved), cos, sin, interleaved)


def _kv_cache(dtype, rng):
    # the decode kernel (kernels/decode.py): one signature per dtype, whatever the options --
    # new entries or none, causal or not, GQA, one chunk per head or several
    with_kv_cache = _op("scaled_dot_product_attention_with_kv_cache", "attention")
    q = rng.standard_normal((2, 4, 2, 8)).astype(dtype)           # (B, H, L, E)
    key_cache = np.zeros((2, 2, 140, 8), dtype)                   # (B, Hkv, Smax, E)
    value_cache = np.zeros((2, 2, 140, 6), dtype)                 # (B, Hkv, Smax, Ev)
    key = rng.standard_normal((2, 2, 2, 8)).astype(dtype)         # (B, Hkv, L, E)
    value = rng.standard_normal((2, 2, 2, 6)).astype(dtype)       # (B, Hkv, L, Ev)
    with_kv_cache(q, key_cache, value_cache, 3, key, value, is_causal=True, enable_gqa=True)
    with_kv_cache(q[:1, :1], key_cache[:1, :1], value_cache[:1, :1], 130)   # several chunks
    # past decode.SERIAL_MACS: the parallel kernel (the calls above run its serial twin)
    with_kv_cache(np.repeat(q, 8, axis=-1), np.repeat(key_cache, 8, axis=-1), value_cache, 138,
                  enable_gqa=True)


def _adam(dtype, rng):
    # Adam's fused update (kernels/adam.py), used by optim.Adam and optim.AdamW: a parameter
    # of one BLOCK or less (the serial twin) and a larger one (the parallel kernel)
    from npattn import nn, optim
    from npattn.kernels.adam import BLOCK
    params = [nn.Parameter(rng.standard_normal(n).astype(dtype)) for n in (10, BLOCK + 1)]
    for p in params:
        p.grad = np.ones_like(p.data)
    optim.AdamW(params, amsgrad=True).step()


#: (name shown, the op it needs, its module in npattn.functional, the step), dearest first: a
#: parallel warm-up hands them out in this order.
STEPS = [("scaled_dot_product_attention", "scaled_dot_product_attention", "attention",
          _sdpa_forward),
         ("scaled_dot_product_attention backward", "scaled_dot_product_attention", "attention",
          _sdpa_backward),
         ("linear", "linear", "linear", _linear),
         ("matmul", "matmul", "matmul", _matmul),
         ("softmax, log_softmax", "softmax", "softmax", _softmax),
         ("layer_norm", "layer_norm", "layer_norm", _layer_norm),
         ("cross_entropy", "cross_entropy", "cross_entropy", _cross_entropy),
         ("dropout", "dropout", "dropout", _dropout),
         ("gelu", "gelu", "gelu", _gelu),
         ("rotary_embedding", "rotary_embedding", "rotary", _rotary),
         ("attention with a KV cache", "scaled_dot_product_attention_with_kv_cache",
          "attention", _kv_cache),
         ("Adam, AdamW", "AdamW", "optim", _adam),
         ("embedding", "embedding", "embedding", _embedding),
         ("attention", "attention", "attention", _attention)]       # (with the first: SHARED)


#: Ops whose steps reach the same parallel kernels: warmed in one unit (one process).
SHARED = (("scaled_dot_product_attention", "attention"), ("linear", "matmul"))


# ---------------------------------------------------------------------------- the kernels

def _kernel_modules():
    """(label, module) for every module of npattn.kernels; an engine compiled per register tile
    (tiles.ENGINES) appears as its instances for the tile in force, one per dtype, labelled
    like ``gemm[avx2-float32]``."""
    for info in pkgutil.iter_modules(_kernels_package.__path__):
        if not info.name.startswith("_") and info.name not in tiles.ENGINES:  # (generator,
            yield info.name, importlib.import_module(f"npattn.kernels.{info.name}")  # source)
    for name in tiles.ENGINES:
        for dtype in tiles.DTYPES:
            module = tiles.engine(name, dtype)
            yield module.__name__.rpartition(".")[2], module


def _kernel_objects(kind):
    """{"module.name": obj} of the objects of type ``kind`` in the modules of npattn.kernels
    (one name per object: a kernel another module imports is listed where it is defined)."""
    found, seen = {}, set()
    for label, module in _kernel_modules():
        for name, obj in vars(module).items():
            if isinstance(obj, kind) and id(obj) not in seen:
                found[f"{label}.{name}"] = obj
                seen.add(id(obj))
    return found


def _instance_dtype(name):
    """The dtype an engine instance's kernel serves ("gemm[avx2-float32].x" -> "float32"), or
    None for a kernel of a plain module (it serves every dtype)."""
    module = name.rpartition(".")[0]
    return module[:-1].rpartition("-")[2] if module.endswith("]") else None


def parallel_kernels():
    """{"module.name": ThreadSafeKernel} of every parallel kernel in ``npattn.kernels``."""
    return _kernel_objects(_jit.ThreadSafeKernel)


def dispatchers():
    """{"module.name": Numba dispatcher} of every kernel in ``npattn.kernels``: the serial
    ones and the cached dispatcher of each parallel one."""
    found = {name: k.dispatcher for name, k in parallel_kernels().items()}
    for name, d in _kernel_objects(numba.core.registry.CPUDispatcher).items():
        if all(d is not other for other in found.values()):
            found[name] = d
    return found


def missing(kernels, dtypes, ops=None):
    """["module.name (dtype)"] of the kernels without a compiled signature for a dtype asked
    for (a kernel that takes no float array needs one signature of any kind). With ``ops``
    (a subset of the steps ran) only the kernels that did get a signature are checked."""
    asked = {np.dtype(d).name for d in dtypes}
    gaps = []
    for name, k in sorted(kernels.items()):
        only = _instance_dtype(name)
        if only is not None and only not in asked:
            continue
        wanted = asked if only is None else {only}
        signatures = k.dispatcher.signatures
        if k.twin and signatures and not k.serial_signatures:   # (a step ran its kernel)
            gaps.append(f"{name} (its serial twin)")
        if not signatures and ops is not None:
            continue
        if not signatures:
            gaps.append(f"{name} (never called)")
            continue
        have = set().union(*(float_dtypes(s) for s in signatures))
        if have:
            gaps += [f"{name} ({d})" for d in sorted(wanted - have)]
    return gaps


def _counts(kernels):
    """(signatures loaded from the disk cache, signatures compiled) over the kernels."""
    hits = sum(sum(k.dispatcher.stats.cache_hits.values()) for k in kernels.values())
    misses = sum(sum(k.dispatcher.stats.cache_misses.values()) for k in kernels.values())
    return hits, misses


def _steps(ops=None):
    """STEPS this version has, those of ``ops`` (op names) only if given."""
    return [s for s in STEPS if _op(s[1], s[2]) is not None and (ops is None or s[1] in ops)]


def _run_steps(dtype, steps, report):
    """Run ``steps`` for one dtype: [(dtype name, step name, seconds, CPU seconds)]."""
    name = np.dtype(dtype).name
    rng = np.random.default_rng(0)
    timings = []
    for label, _, _, step in steps:
        start, cpu = time.perf_counter(), time.process_time()
        step(dtype, rng)
        seconds = time.perf_counter() - start
        timings.append((name, label, seconds, time.process_time() - cpu))
        if report is not None:
            report(f"  {name:8} {label:38} {seconds:7.2f} s")
    return timings


def _units(dtypes, steps):
    """[(dtype name, [step])]: the work of a parallel warm-up in STEPS order (dearest first),
    for each dtype: one unit per step, except that the steps of a SHARED group form one."""
    groups = []
    for step in steps:
        shared = [ops for ops in SHARED if step[1] in ops]
        if not shared:
            groups.append([step])
        elif not any(s[1] in shared[0] for g in groups for s in g):
            groups.append([s for s in steps if s[1] in shared[0]])
    return [(np.dtype(d).name, g) for g in groups for d in dtypes]


_locked_to = None    # the lock file this worker process's cache writes take, once installed


def _lock_cache_writes(lock_path):
    """Make every write to Numba's cache index by a kernel of this process hold an exclusive
    lock on ``lock_path`` (see the module docstring); once per process (a flock taken twice
    by one process through two open files waits for itself). False where that cannot be done
    (no fcntl; a Numba whose cache objects look different)."""
    global _locked_to
    if _locked_to is not None:
        return _locked_to == lock_path
    try:
        import fcntl
    except ImportError:
        return False
    _locked_to = lock_path
    for d in dispatchers().values():
        index = getattr(getattr(d, "_cache", None), "_cache_file", None)   # NullCache: none
        if index is None:
            continue
        if not callable(getattr(index, "save", None)):
            return False

        def save(key, data, _save=index.save):
            with open(lock_path, "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    return _save(key, data)
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
        index.save = save
    return True


def _warm_unit(dtype_name, step_names, lock_path):
    """In a worker process: run the steps named (one dtype), cache writes under the lock.
    Returns (timings, signatures compiled)."""
    if not _lock_cache_writes(lock_path):
        raise RuntimeError("cannot lock Numba's cache index in this Numba version")
    steps = [s for s in STEPS if s[0] in step_names]
    before = _counts(parallel_kernels())[1]            # (a worker may run several units)
    timings = _run_steps(np.dtype(dtype_name), steps, None)
    return timings, _counts(parallel_kernels())[1] - before


def default_jobs():
    """One worker process per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                       # (not on every platform)
        return os.cpu_count() or 1


def warmup(dtypes=(np.float32, np.float64), report=print, jobs=1, ops=None):
    """Call every op (of ``ops``, if given) on tiny inputs of each dtype, so that each kernel
    is compiled and written to Numba's disk cache (or loaded from it), in ``jobs`` processes.
    ``report(line)`` gets the progress: a line per step as it ends.

    Returns ``(timings, gaps, compiled, processes)``: [(dtype name, step name, seconds, CPU
    seconds)], the kernels no step reached (see :func:`missing`; empty when all is warm), the
    number of kernel signatures compiled (the rest came from the cache) and the number of
    worker processes used (0: all ran in this one).
    """
    kernels = parallel_kernels()
    steps = _steps(ops)
    units = _units(dtypes, steps)
    lock = None
    if jobs > 1 and len(units) > 1:
        try:
            import fcntl  # noqa: F401  (where there is none, run serially)
            handle, lock = tempfile.mkstemp(prefix="npattn-warmup-", suffix=".lock")
            os.close(handle)
        except ImportError:
            pass
    if lock is None:
        timings = [t for d in dtypes for t in _run_steps(d, steps, report)]
        return timings, missing(kernels, dtypes, ops), _counts(kernels)[1], 0
    timings, compiled, processes = [], 0, min(jobs, len(units))
    try:
        context = multiprocessing.get_context("spawn")  # (a forked OpenMP runtime can hang)
        with concurrent.futures.ProcessPoolExecutor(processes, context) as pool:
            futures = [pool.submit(_warm_unit, name, [s[0] for s in group], lock)
                       for name, group in units]
            for future in concurrent.futures.as_completed(futures):
                try:
                    done, n = future.result()
                except concurrent.futures.process.BrokenProcessPool as error:
                    report(f"  a worker process died ({error}): the rest compiles here")
                    break
                compiled += n
                timings += done
                for name, label, seconds, _ in done:
                    report(f"  {name:8} {label:38} {seconds:7.2f} s")
    finally:
        os.unlink(lock)
    finished = {t[:2] for t in timings}
    for d in dtypes:              # here: load every kernel from the cache (or compile what a
        for step in steps:        # dead worker left), which also checks they are all there
            unfinished = (np.dtype(d).name, step[0]) not in finished
            timings += [t for t in _run_steps(d, [step], report if unfinished else None)
                        if unfinished]
    order = {(np.dtype(d).name, s[0]): i for i, (d, s) in
             enumerate((d, s) for d in dtypes for s in steps)}
    timings.sort(key=lambda t: order[t[:2]])
    return timings, missing(kernels, dtypes, ops), compiled + _counts(kernels)[1], processes


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
    parser.add_argument("--jobs", "-j", type=int, default=default_jobs(), metavar="N",
                        help="worker processes compiling at once (default: the number of "
                             f"CPUs, here {default_jobs()}; 1: all in this process)")
    parser.add_argument("--ops", metavar="OP,OP", type=lambda text: text.split(","),
                        help="only these ops' kernels (default: all): "
                             + ", ".join(s[1] for s in STEPS))
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    unknown = sorted(set(args.ops or ()) - {s[1] for s in STEPS})
    if unknown:
        parser.error(f"--ops: unknown op {', '.join(unknown)}; expected some of "
                     + ", ".join(s[1] for s in STEPS))

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
    timings, gaps, compiled, processes = warmup(dtypes, say, jobs=args.jobs, ops=args.ops)
    hits, _ = _counts(kernels)
    where = f" in {processes} processes" if processes else ""
    say(f"npattn warmup: {time.perf_counter() - start:.1f} s{where}: {compiled} kernel "
        f"signatures compiled, {hits} " + ("loaded from the cache here afterwards" if where
                                          else "already in the cache"))
    if gaps:
        print("npattn warmup: no op reached these kernels, which will compile on first use: "
              + ", ".join(gaps), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
