"""A library in someone else's process: many Python threads at once, and many calls in a row.

Threads: 8 Python threads make 1,000 mixed calls each (linear, matmul, softmax, log_softmax,
dropout, attention forward and backward with masks, causal, dropout and GQA, and the other
public ops) at the same time, under the default threading layer and under ``workqueue`` (the
layer that aborts the process on concurrent launches unless npattn's lock serialises them).
Every result must be bitwise the single-threaded one, and the process must neither abort nor
hang: each run is a subprocess with a timeout.

Memory: 10,000 forward/backward calls, on shapes that change from call to call, must not grow
the resident set (beyond a small bound), Numba's count of live allocations (exact) or any
kernel's compiled signatures (no cache that grows with the shapes seen).

Knobs (environment): ``NPATTN_STRESS_THREADS`` (default 8), ``NPATTN_STRESS_CALLS`` (calls per
thread, default 1000), ``NPATTN_STRESS_MEMORY_CALLS`` (default 10000),
``NPATTN_STRESS_MEMORY_THREADS`` (Numba threads in the memory run, default 1).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
THREADS = int(os.environ.get("NPATTN_STRESS_THREADS", "8"))
CALLS = int(os.environ.get("NPATTN_STRESS_CALLS", "1000"))
MEMORY_CALLS = int(os.environ.get("NPATTN_STRESS_MEMORY_CALLS", "10000"))
MEMORY_WARMUP = 1000           # calls before the first reading: pools, caches, the allocator
MEMORY_BOUND = 5 << 20         # bytes of resident growth allowed over the remaining calls
#: Numba threads in the memory run: one by default. The kernels run the same code and allocate
#: the same buffers at any thread count (the threads test checks the allocations at all
#: threads); on a busy 2-core machine each parallel launch waits for a time slice, which made
#: the 10,000 calls take 8-25 ms each instead of 0.5 ms.
MEMORY_THREADS = os.environ.get("NPATTN_STRESS_MEMORY_THREADS", "1")


def run_script(code, timeout, **env):
    """Run ``code`` in a fresh interpreter that can import this directory's modules; return its
    stdout. An abort, a segfault or a hang (past ``timeout`` seconds) fails the test."""
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS),
                                                           os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"no result after {timeout} s (a deadlock?)\nstdout:\n{error.stdout}\n"
                    f"stderr:\n{error.stderr}")
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the workload

def varlen_calls(q, k, v):
    """The varlen forward and backward on q, k, v (B, heads, N, E) packed as sequences of
    lengths 0 .. N: (output, logsumexp, dquery, dkey, dvalue)."""
    import npattn
    qp, kp, vp = (np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(-1, *a.shape[1::2]))
                  for a in (q, k, v))
    cu_q = np.array([0, 1, qp.shape[0] // 2, qp.shape[0] - 1, qp.shape[0]])
    cu_k = np.array([0, 0, kp.shape[0] // 3, kp.shape[0] - 5, kp.shape[0]])
    kw = dict(is_causal=True, enable_gqa=True, dropout_p=0.1, seed=4)
    o, lse = npattn.scaled_dot_product_attention_varlen_forward(qp, kp, vp, cu_q, cu_k, **kw)
    return (o, lse, *npattn.scaled_dot_product_attention_varlen_backward(
        o, qp, kp, vp, o, lse, cu_q, cu_k, **kw))


def make_calls(rng, scale=0, dtype=np.float32):
    """{name: call} of the public ops, forward and backward, on small inputs drawn from
    ``rng``; each call returns a tuple of arrays. ``scale`` (0, 1, 2...) grows the shapes a
    little, so a loop can change shapes from call to call. The inputs are of ``dtype``, but for
    the calls named "float64". Ops this version lacks are left out.
    """
    import npattn
    from npattn.kernels import tiles
    BATCHED = tiles.engine("gemm", dtype).BATCHED

    dt, f64 = dtype, np.float64              # dt: the inputs' dtype
    s = scale

    def normal(shape, dtype=dt):
        return rng.standard_normal(shape).astype(dtype)

    x, w, b = normal((24 + s, 40)), normal((33, 40)), normal(33)
    dy = normal((24 + s, 33))
    xd, wd = normal((7, 5 + s, 12), f64), normal((9, 12), f64)
    a, m = normal((3, 16 + s, 20)), normal((20, 10))
    many = BATCHED * 2 + 1                                # the many-batches GEMM path
    ab, mb = normal((many, 6, 5 + s)), normal((many, 5 + s, 7))
    big_x, big_w = normal((64, 128)), normal((130, 128))  # the packed path of x·Wᵀ
    logits = normal((4, 9 + s, 31))
    q = normal((2, 4, 33 + s, 16))                        # (B, H, L, E)
    k, v = normal((2, 2, 47, 16)), normal((2, 2, 47, 12))  # GQA: Hkv = 2
    bool_mask = rng.random((33 + s, 47)) < 0.7
    float_mask = normal((4, 33 + s, 47))
    qd, kd = normal((3, 20, 8), f64), normal((3, 25 + s, 8), f64)
    masked = dict(attn_mask=bool_mask, is_causal=True, dropout_p=0.2, seed=11, enable_gqa=True)
    biased = dict(attn_mask=float_mask, causal_alignment="bottom-right", is_causal=True,
                  enable_gqa=True)
    o_m, lse_m = npattn.scaled_dot_product_attention_forward(q, k, v, **masked)
    o_b, lse_b = npattn.scaled_dot_product_attention_forward(q, k, v, **biased)
    sm = npattn.softmax(logits, dim=1)
    lsm = npattn.log_softmax(logits, dim=-1)
    calls = {
        "linear": lambda: (npattn.linear(x, w, b),),
        "linear_backward": lambda: npattn.linear_backward(dy, x, w, b),
        "linear float64": lambda: (npattn.linear(xd, wd),),
        "linear packed": lambda: (npattn.linear(big_x, big_w),),
        "matmul": lambda: (npattn.matmul(a, m),),
        "matmul_backward": lambda: npattn.matmul_backward(np.ones((3, 16 + s, 10), dt), a, m),
        "matmul many batches": lambda: (npattn.matmul(ab, mb),),
        "softmax": lambda: (npattn.softmax(logits, dim=1),),
        "softmax_backward": lambda: (npattn.softmax_backward(logits, sm, dim=1),),
        "log_softmax": lambda: (npattn.log_softmax(logits, dim=-1),),
        "log_softmax_backward": lambda: (npattn.log_softmax_backward(logits, lsm, dim=-1),),
        "dropout": lambda: (npattn.dropout(logits, 0.3, seed=5),
                            npattn.dropout_backward(logits, 0.3, seed=5)),
        "sdpa": lambda: npattn.scaled_dot_product_attention_forward(q, k, v, enable_gqa=True),
        "sdpa masked, causal, dropout": lambda: npattn.scaled_dot_product_attention_forward(
            q, k, v, **masked),
        "sdpa_backward masked, causal, dropout":
            lambda: npattn.scaled_dot_product_attention_backward(o_m, q, k, v, o_m, lse_m,
                                                                 **masked),
        "sdpa_backward float mask, mask_grad":
            lambda: npattn.scaled_dot_product_attention_backward(o_b, q, k, v, o_b, lse_b,
                                                                 mask_grad=True, **biased),
        "attention float64 causal": lambda: npattn.attention(qd, kd, kd, is_causal=True),
        "attention_backward float64 dropout": lambda: npattn.attention_backward(
            np.ones((3, 20, 8)), qd, kd, kd, dropout_p=0.1, seed=2),
    }
    if hasattr(npattn, "scaled_dot_product_attention_varlen"):
        calls["sdpa_varlen forward and backward"] = lambda: varlen_calls(q, k, v)
    if hasattr(npattn, "embedding"):
        table, idx = normal((50, 16)), rng.integers(0, 50, (4, 7 + s))
        calls["embedding"] = lambda: (npattn.embedding(idx, table),
                                      npattn.embedding_backward(np.ones((4, 7 + s, 16), dt),
                                                                idx, table, padding_idx=0))
    if hasattr(npattn, "cross_entropy"):
        scores, target = normal((12 + s, 10)), rng.integers(0, 10, 12 + s)
        calls["cross_entropy"] = lambda: (
            npattn.cross_entropy(scores, target, label_smoothing=0.1),
            npattn.cross_entropy_backward(np.array(1, dt), scores, target,
                                          label_smoothing=0.1))
    if hasattr(npattn, "layer_norm"):
        xl, gl, bl = normal((6 + s, 5, 32)), normal(32), normal(32)
        calls["layer_norm"] = lambda: (npattn.layer_norm(xl, (32,), gl, bl),
                                       *npattn.layer_norm_backward(xl, xl, (32,), gl, bl))
    if hasattr(npattn, "gelu"):
        xg = normal((5, 900 + s))                  # more than one prange block (4096)
        calls["gelu"] = lambda: (npattn.gelu(xg), npattn.gelu_backward(xg, xg),
                                 npattn.gelu(xg, "tanh"), npattn.gelu_backward(xg, xg, "tanh"))
    if hasattr(npattn, "rotary_embedding"):
        theta = rng.standard_normal((9 + s, 16))
        cr, sr = np.cos(theta).astype(dt), np.sin(theta).astype(dt)
        xr, xr1 = normal((40, 9 + s, 32)), normal((2, 9 + s, 32))   # many blocks, one block
        calls["rotary_embedding"] = lambda: (
            npattn.rotary_embedding(xr, cr, sr), npattn.rotary_embedding_backward(xr, cr, sr),
            npattn.rotary_embedding(xr1, cr, sr, True),
            npattn.rotary_embedding_backward(xr1, cr, sr, True))
    return calls


def signatures():
    """{kernel: number of compiled signatures} over every kernel of npattn.kernels."""
    from test_jit import all_kernels
    return {name: len(getattr(k, "dispatcher", k).signatures)
            for name, k in all_kernels().items()}


def fingerprint(result):
    """The exact bits of a call's outputs (dtype, shape and bytes of each)."""
    return tuple((o.dtype.str, o.shape, np.ascontiguousarray(o).tobytes())
                 for o in result if o is not None)


# ------------------------------------------------------------------ threads

THREAD_SCRIPT = """
import gc, json, os, sys, threading, time
import numpy as np
import npattn
from numba.core.runtime import rtsys
from test_stress import fingerprint, make_calls, signatures

def live_allocations():
    gc.collect()
    stats = rtsys.get_allocation_stats()
    return stats.alloc - stats.free

n_threads, n_calls = {threads}, {calls}
calls = make_calls(np.random.default_rng(0))
names = sorted(calls)
want = {{name: fingerprint(calls[name]()) for name in names}}    # single-threaded, first
before = (live_allocations(), signatures())
errors, done = [], [0] * n_threads
barrier = threading.Barrier(n_threads)

def worker(t):
    order = np.random.default_rng(100 + t).integers(0, len(names), n_calls)
    barrier.wait()                                  # all threads start at once
    for i, j in enumerate(order):
        try:
            got = fingerprint(calls[names[j]]())
        except BaseException as error:
            errors.append(f"thread {{t}} call {{i}} {{names[j]}}: {{error!r}}")
            continue
        if got != want[names[j]]:
            errors.append(f"thread {{t}} call {{i}} {{names[j]}}: different bits")
        done[t] += 1

threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(n_threads)]
start = time.perf_counter()
for t in threads:
    t.start()
deadline = start + {timeout}
for t in threads:
    t.join(max(0.0, deadline - time.perf_counter()))
if any(t.is_alive() for t in threads):              # a deadlock: report it, do not hang
    print(json.dumps({{"hung": True, "done": done}}), flush=True)
    os._exit(3)
seconds = time.perf_counter() - start
after = (live_allocations(), signatures())
print(json.dumps({{"layer": npattn._jit.threading_layer(), "seconds": seconds,
                  "calls": sum(done), "kinds": len(names), "errors": errors[:10],
                  "n_errors": len(errors), "before": before, "after": after}}))
"""


@pytest.mark.parametrize("layer", ["default", "workqueue"])
def test_threads_hammering_every_op_get_the_single_threaded_bits(layer):
    """8 Python threads × 1,000 mixed calls at once: no abort, no deadlock, the same bits as
    the single-threaded calls made first; afterwards no Numba allocation is left alive and no
    kernel has gained a signature. ``default`` is whatever Numba picks here (tbb, omp, else
    workqueue); ``workqueue`` aborts the process without npattn's lock."""
    env = {} if layer == "default" else {"NUMBA_THREADING_LAYER": layer}
    result = last_json(run_script(THREAD_SCRIPT.format(threads=THREADS, calls=CALLS, timeout=400),
                                  timeout=600, NUMBA_NRT_STATS="1", **env))
    assert result["n_errors"] == 0, result["errors"]
    assert result["calls"] == THREADS * CALLS
    assert result["after"] == result["before"]      # live Numba allocations, signatures
    assert result["kinds"] >= 18
    if layer != "default":
        assert result["layer"] == layer
    print(f"\n{layer} ({result['layer']}): {result['calls']} calls of {result['kinds']} kinds on "
          f"{THREADS} threads in {result['seconds']:.1f} s")


# ------------------------------------------------------------------ memory

MEMORY_SCRIPT = """
import gc, json, os
import numba
import numpy as np
import npattn
from numba.core.runtime import rtsys
from test_stress import make_calls, signatures

page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def live_allocations():
    stats = rtsys.get_allocation_stats()
    return stats.alloc - stats.free

# a few scales of every call: the shapes change from call to call, and each set of inputs is
# drawn once (the inputs are not what is measured)
workloads = [make_calls(np.random.default_rng(scale), scale) for scale in range(4)]
names = sorted(workloads[0])
kept = []                                    # the planted leak, when asked for

def run(n, offset):
    for i in range(offset, offset + n):
        out = workloads[i % len(workloads)][names[i // len(workloads) % len(names)]]()
        if {leak}:                           # ~1 KiB a call: 256 entries of an output
            kept.append(out[0].ravel()[:256].copy())

run({warmup}, 0)
gc.collect()
before = dict(rss=rss(), live=live_allocations(), signatures=signatures())
run({calls} - {warmup}, {warmup})
gc.collect()
after = dict(rss=rss(), live=live_allocations(), signatures=signatures())
print(json.dumps(dict(before=before, after=after, kinds=len(names), calls={calls})))
"""


def measure_memory(leak=False):
    """{before, after: {rss, live, signatures}, kinds, calls} of the memory script; the
    resident set in bytes, ``live`` = Numba's allocations not yet freed."""
    result = last_json(run_script(
        MEMORY_SCRIPT.format(calls=MEMORY_CALLS, warmup=MEMORY_WARMUP, leak=leak), timeout=600,
        NUMBA_NRT_STATS="1", NUMBA_NUM_THREADS=MEMORY_THREADS))
    before, after = result["before"], result["after"]
    result["growth"] = after["rss"] - before["rss"]
    print(f"\n{'planted leak: ' * leak}RSS {before['rss'] / 2**20:.1f} MiB after {MEMORY_WARMUP} "
          f"calls, {after['rss'] / 2**20:.1f} MiB after {result['calls']} "
          f"({result['growth'] / 2**20:+.2f} MiB); live Numba allocations {before['live']} -> "
          f"{after['live']}")
    return result


def test_ten_thousand_calls_do_not_grow_memory():
    """10,000 forward/backward calls (every op, shapes changing from call to call): after the
    first 1,000, the resident set grows less than 5 MiB, Numba's live allocations do not
    change (exact: no kernel leaks a buffer) and no kernel gains a compiled signature (no
    cache grows with the shapes seen)."""
    result = measure_memory()
    before, after = result["before"], result["after"]
    assert result["kinds"] >= 18
    assert after["signatures"] == before["signatures"]
    assert after["live"] == before["live"]
    assert result["growth"] < MEMORY_BOUND, \
        f"resident set grew by {result['growth'] / 2**20:.2f} MiB"


def test_the_memory_test_sees_a_planted_leak():
    """The same measurement with ~1 KiB kept per call (a copy of part of each output, in a
    list): the resident set must grow past the bound, or the bound proves nothing."""
    result = measure_memory(leak=True)
    assert result["growth"] >= MEMORY_BOUND, \
        f"a leak of ~{(MEMORY_CALLS - MEMORY_WARMUP) >> 10} MiB grew the resident set by only " \
        f"{result['growth'] / 2**20:.2f} MiB"
