"""Every op gives bitwise the same results at any thread count (a subprocess per count)."""
import hashlib

import pytest

from test_jit import run_python

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

SCRIPT = """
import hashlib
import numpy as np
import numba
import npattn
import npattn.nn, npattn.optim
assert numba.get_num_threads() == {threads}
rng = np.random.default_rng(1)
digest = hashlib.sha256()
for dtype in (np.float32, np.float64):
    x = rng.standard_normal((3, 37, 129)).astype(dtype)
    w = rng.standard_normal((65, 129)).astype(dtype)
    b = rng.standard_normal(65).astype(dtype)
    y = npattn.linear(x, w, b)
    outs = [y, *npattn.linear_backward(y, x, w, b)]
    m = npattn.matmul(x, np.swapaxes(x, -1, -2))
    outs += [m, *npattn.matmul_backward(m, x, np.swapaxes(x, -1, -2))]
    s = npattn.softmax(x, dim=1)
    outs += [s, npattn.softmax_backward(x, s, dim=1)]
    ls = npattn.log_softmax(x, dim=-1)
    outs += [ls, npattn.log_softmax_backward(x, ls, dim=-1)]
    outs += [npattn.dropout(x, 0.25, seed=3), npattn.dropout_backward(x, 0.25, seed=3)]
    # big enough for the packed GEMM path: several row blocks and K blocks per call
    xb = rng.standard_normal((300, 600)).astype(dtype)
    wb = rng.standard_normal((90, 600)).astype(dtype)
    yb = npattn.linear(xb, wb)
    outs += [yb, *npattn.linear_backward(yb, xb, wb)[:2]]
    # attention: masks, causal, GQA, dropout; few heads so backward splits its key blocks,
    # and lengths over several blocks of both passes
    q = rng.standard_normal((1, 4, 300, 24)).astype(dtype)
    k = rng.standard_normal((1, 2, 530, 24)).astype(dtype)
    v = rng.standard_normal((1, 2, 530, 20)).astype(dtype)
    mask = np.where(rng.random((300, 530)) < 0.1, -np.inf, rng.standard_normal((300, 530)))
    kw = dict(attn_mask=mask.astype(dtype), dropout_p=0.2, is_causal=True, enable_gqa=True,
              seed=5, causal_alignment="bottom-right")
    o, lse = npattn.scaled_dot_product_attention_forward(q, k, v, **kw)
    outs += [o, lse, *npattn.scaled_dot_product_attention_backward(o, q, k, v, o, lse,
                                                                   mask_grad=True, **kw)]
    outs += list(npattn.attention(q[0, :2], k[0], v[0], is_causal=True))
    # soft cap (scores far from and near the cap: both forms of tanh) and sinks, with a window
    kw = dict(is_causal=True, enable_gqa=True, window=(100, 0), softcap=1.5,
              sinks=rng.standard_normal(4).astype(dtype))
    o, lse = npattn.scaled_dot_product_attention_forward(q, k, v, **kw)
    outs += [o, lse, *npattn.scaled_dot_product_attention_backward(o, q, k, v, o, lse, **kw)]
    # varlen: packed sequences of 0 .. 300 rows, the same heads
    qp, kp, vp = (np.ascontiguousarray(a[0].transpose(1, 0, 2)) for a in (q, k, v))
    cu_q, cu_k = np.array([0, 7, 7, 200, 300]), np.array([0, 130, 131, 400, 530])
    vkw = dict(dropout_p=0.2, is_causal=True, enable_gqa=True, seed=5,
               causal_alignment="bottom-right", window=(90, 3), softcap=1.5,
               sinks=rng.standard_normal(4).astype(dtype))
    o, lse = npattn.scaled_dot_product_attention_varlen_forward(qp, kp, vp, cu_q, cu_k, **vkw)
    outs += [o, lse, *npattn.scaled_dot_product_attention_varlen_backward(
        o, qp, kp, vp, o, lse, cu_q, cu_k, **vkw)]
    # embedding's scatter-add with many repeats, cross-entropy and layer norm over many rows
    table = rng.standard_normal((50, 33)).astype(dtype)
    idx = rng.integers(0, 50, (40, 70))
    e = npattn.embedding(idx, table, padding_idx=3)
    outs += [e, npattn.embedding_backward(e, idx, table, padding_idx=3)]
    logits = rng.standard_normal((700, 31)).astype(dtype)
    labels = rng.integers(-1, 31, 700)
    ce_kw = dict(ignore_index=-1, label_smoothing=0.1)
    outs += [npattn.cross_entropy(logits, labels, **ce_kw),
             npattn.cross_entropy_backward(np.ones((), dtype), logits, labels, **ce_kw)]
    gamma, beta = rng.standard_normal((2, 129)).astype(dtype)
    ln = npattn.layer_norm(x, 129, gamma, beta)
    outs += [ln, *npattn.layer_norm_backward(ln, x, 129, gamma, beta)]
    for approximate in ("none", "tanh"):   # 3·37·129 elements: several prange blocks
        g = npattn.gelu(x, approximate)
        outs += [g, npattn.gelu_backward(ln, x, approximate)]
    # rotary embedding, both layouts: many blocks (the parallel kernel) and one (its twin)
    theta = rng.uniform(-9, 9, (37, 64))
    cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
    for interleaved in (False, True):
        for xr in (x[..., :128], x[:1, :2, :128]):
            r = npattn.rotary_embedding(xr, cos[:xr.shape[-2]], sin[:xr.shape[-2]], interleaved)
            outs += [r, npattn.rotary_embedding_backward(xr, cos[:xr.shape[-2]],
                                                         sin[:xr.shape[-2]], interleaved)]
    # work small enough for the serial twins (one row: small_dot, layer norm, gelu) next to
    # the parallel kernels above
    row = x[0, :1]
    outs += [npattn.linear(row, w, b), npattn.layer_norm(row, 129, gamma, beta),
             npattn.gelu(row, "none"), npattn.gelu(row, "tanh")]
    # the decode path: key chunks on both threads (long cache) and its serial twin (short)
    for n_cache in (700, 20):
        kc = np.zeros((1, 2, n_cache + 2, 24), dtype)
        vc = np.zeros((1, 2, n_cache + 2, 20), dtype)
        kc[..., :n_cache, :] = rng.standard_normal((1, 2, n_cache, 24))
        vc[..., :n_cache, :] = rng.standard_normal((1, 2, n_cache, 20))
        outs += [*npattn.scaled_dot_product_attention_with_kv_cache(
            q[..., :2, :], kc, vc, n_cache, k[..., :2, :], v[..., :2, :], is_causal=True,
            enable_gqa=True), kc, vc]
    # an optimiser step: Adam's fused update on a parameter of one block (its serial twin)
    # and one of several (the parallel kernel), each weight-decay mode and amsgrad
    for optimizer, options in ((npattn.optim.Adam, dict(weight_decay=0.01, amsgrad=True)),
                               (npattn.optim.AdamW, dict(weight_decay=0.1))):
        params = [npattn.nn.Parameter(rng.standard_normal(size).astype(dtype))
                  for size in (1000, 40000)]
        opt = optimizer(params, lr=1e-2, **options)
        for _ in range(2):
            for p in params:
                p.grad = rng.standard_normal(p.data.shape).astype(dtype)
            opt.step()
        outs += [p.data for p in params]
    for o in outs:
        digest.update(np.ascontiguousarray(o).tobytes())
print(digest.hexdigest())
"""


def test_results_do_not_depend_on_thread_count_or_the_cache(tmp_path):
    """The first process compiles every kernel into an empty cache, the others load them from
    it: the bits must not depend on the thread count, nor on compiled-here versus cached."""
    cache = str(tmp_path / "numba-cache")
    digests = {n: run_python(SCRIPT.format(threads=n), NUMBA_NUM_THREADS=str(n),
                             NUMBA_CACHE_DIR=cache).strip()
               for n in (1, 2, 3)}
    assert len(set(digests.values())) == 1, digests
