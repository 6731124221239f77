"""A digest of attention's output bits: run it before and after a refactor that must not change
any bit, and compare.

    python tests/attention_digest.py            # one line per group, then the total
    python tests/attention_digest.py --verbose  # one line per case

It hashes the bytes of every result of the dense engine (no mask, bool and float masks with
mask_grad, causal in both alignments, grouped-query heads, seeded dropout, windows, ALiBi,
softcap, sinks, all together), of ``attention``/``attention_backward`` (the weights), of
varlen and of the KV-cache decode path, forward and backward, in float32 and float64; of
``nn.MultiheadAttention`` and ``nn.SelfAttention``; and of a small GPT (``npattn.models``):
forward logits and loss, every parameter gradient after backward (with dropout), and
generated tokens. The bits depend on the compile target (README), so compare digests taken
on one machine. ``digests()`` returns the {group: hex digest} dict for use in a test.
"""
import hashlib
import os
import sys

if __name__ == "__main__":              # the working tree's npattn, not an installed one
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np                      # noqa: E402

import npattn                           # noqa: E402
from npattn import nn                   # noqa: E402
from npattn.models import GPT, GPTConfig   # noqa: E402

DTYPES = (np.float32, np.float64)


def _bytes(results):
    """The bytes of a (possibly nested) tuple of arrays and scalars, with shapes and dtypes."""
    h = hashlib.sha256()
    stack = [results]
    while stack:
        x = stack.pop(0)
        if isinstance(x, (tuple, list)):
            stack[:0] = list(x)
            continue
        if x is None:
            h.update(b"None")
            continue
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.digest()


def _dense_cases(rng, dtype):
    """(name, kwargs, inputs) of scaled_dot_product_attention calls covering every option."""
    def arr(*shape):
        return rng.standard_normal(shape).astype(dtype)

    B, H, Hkv, L, S, E, Ev = 2, 4, 2, 150, 170, 24, 20
    q, k, v = arr(B, H, L, E), arr(B, H, S, E), arr(B, H, S, Ev)
    kg, vg = arr(B, Hkv, S, E), arr(B, Hkv, S, Ev)
    bool_mask = rng.random((B, 1, L, S)) < 0.8
    float_mask = arr(1, H, L, S)
    slopes = np.abs(arr(H)) * 0.1
    sinks = arr(H)
    base = (q, k, v)
    yield "plain", {}, base
    yield "bool_mask", dict(attn_mask=bool_mask), base
    yield "float_mask", dict(attn_mask=float_mask), base
    yield "causal", dict(is_causal=True), base
    yield "causal_br", dict(is_causal=True, causal_alignment="bottom-right"), base
    yield "gqa", dict(enable_gqa=True, is_causal=True), (q, kg, vg)
    yield "dropout", dict(dropout_p=0.3, seed=1234), base
    yield "window", dict(window=(40, 7)), base
    yield "window_causal_br", dict(window=(33, None), is_causal=True,
                                   causal_alignment="bottom-right"), base
    yield "alibi", dict(alibi_slopes=slopes, is_causal=True), base
    yield "softcap", dict(softcap=2.5, scale=0.7), base
    yield "sinks", dict(sinks=sinks), base
    yield "everything", dict(attn_mask=float_mask, dropout_p=0.2, seed=7, is_causal=True,
                             causal_alignment="bottom-right", window=(60, 3),
                             alibi_slopes=slopes, softcap=3.0, sinks=sinks), base
    yield "2d", dict(is_causal=True), (arr(L, E), arr(S, E), arr(S, Ev))


def _dense(rng, dtype):
    out = {}
    for name, kw, (q, k, v) in _dense_cases(rng, dtype):
        o, lse = npattn.scaled_dot_product_attention_forward(q, k, v, **kw)
        dout = rng.standard_normal(o.shape).astype(dtype)
        mask_grad = kw.get("attn_mask") is not None and kw["attn_mask"].dtype != np.bool_
        grads = npattn.scaled_dot_product_attention_backward(dout, q, k, v, o, lse, **kw,
                                                             mask_grad=mask_grad)
        out[f"sdpa/{name}"] = (o, lse, grads)
        if kw.get("enable_gqa"):
            continue
        akw = {("mask" if n == "attn_mask" else n): x for n, x in kw.items()}
        o2, w, lse2 = npattn.attention(q, k, v, **akw, return_logsumexp=True)
        g2 = npattn.attention_backward(dout, q, k, v, **akw, mask_grad=mask_grad)
        g3 = npattn.attention_backward(dout, q, k, v, **akw, output=o2, logsumexp=lse2)
        out[f"attention/{name}"] = (o2, w, lse2, g2, g3)
    return out


def _varlen(rng, dtype):
    out = {}
    lq, lk = np.array([0, 1, 130, 7, 64]), np.array([3, 1, 150, 0, 80])
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int64) for n in (lq, lk))
    H, Hkv, E, Ev = 4, 2, 16, 12
    q = rng.standard_normal((cq[-1], H, E)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hkv, E)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hkv, Ev)).astype(dtype)
    slopes = (np.abs(rng.standard_normal((len(lq), H))) * 0.1).astype(dtype)
    sinks = rng.standard_normal(H).astype(dtype)
    cases = {"plain": dict(enable_gqa=True),
             "causal_br_dropout": dict(enable_gqa=True, is_causal=True, dropout_p=0.25, seed=3,
                                       causal_alignment="bottom-right"),
             "window_alibi_softcap_sinks": dict(enable_gqa=True, window=(20, 2),
                                                alibi_slopes=slopes, softcap=4.0, sinks=sinks,
                                                scale=0.3)}
    for name, kw in cases.items():
        o, lse = npattn.scaled_dot_product_attention_varlen_forward(q, k, v, cq, ck, **kw)
        o1 = npattn.scaled_dot_product_attention_varlen(q, k, v, cq, ck, **kw)
        dout = rng.standard_normal(o.shape).astype(dtype)
        grads = npattn.scaled_dot_product_attention_varlen_backward(dout, q, k, v, o, lse, cq,
                                                                    ck, **kw)
        out[f"varlen/{name}"] = (o, lse, o1, grads)
    return out


def _kv_cache(rng, dtype):
    B, H, Hkv, Smax, E = 2, 4, 2, 300, 16
    kc = rng.standard_normal((B, Hkv, Smax, E)).astype(dtype)
    vc = rng.standard_normal((B, Hkv, Smax, E)).astype(dtype)
    q = rng.standard_normal((B, H, 3, E)).astype(dtype)
    kn = rng.standard_normal((B, Hkv, 3, E)).astype(dtype)
    vn = rng.standard_normal((B, Hkv, 3, E)).astype(dtype)
    o, lse = npattn.scaled_dot_product_attention_with_kv_cache(q, kc, vc, 200, kn, vn,
                                                               is_causal=True, enable_gqa=True)
    return {"kv_cache": (o, lse, kc, vc)}


def _modules(rng, dtype):
    out = {}
    mha = nn.MultiheadAttention(32, 4, dropout=0.2, batch_first=True, dtype=dtype, rng=1,
                                seed=2)
    x = rng.standard_normal((2, 40, 32)).astype(dtype)
    y, w = mha(x, x, x, is_causal=True, attn_mask=np.triu(np.ones((40, 40), bool), 1))
    dx = mha.backward(rng.standard_normal(y.shape).astype(dtype))
    out["nn/mha"] = (y, w, dx, [p.grad for p in mha.parameters()])
    y2, _ = mha(x, x, x, need_weights=False)
    dx2 = mha.backward(rng.standard_normal(y2.shape).astype(dtype))
    out["nn/mha_fused"] = (y2, dx2)
    sa = nn.SelfAttention(32, 16, dropout=0.1, dtype=dtype, rng=3, seed=4)
    y, w = sa(x, is_causal=True)
    dx = sa.backward(rng.standard_normal(y.shape).astype(dtype))
    out["nn/self_attention"] = (y, w, dx, [p.grad for p in sa.parameters()])
    return out


def _gpt(rng, dtype):
    cfg = GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
    model = GPT(cfg, dtype=dtype, rng=0, seed=1)
    idx = rng.integers(0, 50, (3, 32))
    targets = rng.integers(0, 50, (3, 32))
    logits, loss = model(idx, targets)
    model.backward()
    grads = [p.grad for p in model.parameters()]
    model.eval()
    logits_eval, _ = model(idx[:, :20])
    tokens = model.generate(idx[:, :5], 40, temperature=0.8, top_k=10, seed=5)  # past block_size
    return {"gpt": (logits, loss, grads, logits_eval, tokens)}


def digests():
    """{name: sha256 hex} per case, both dtypes."""
    out = {}
    for dtype in DTYPES:
        rng = np.random.default_rng(2026)
        parts = {}
        for group in (_dense, _varlen, _kv_cache, _modules, _gpt):
            parts.update(group(rng, dtype))
        for name, results in parts.items():
            out[f"{np.dtype(dtype).name}/{name}"] = _bytes(results).hex()
    return out


def main(argv):
    d = digests()
    groups = {}
    for name, hexd in d.items():
        if "--verbose" in argv:
            print(f"{hexd[:16]}  {name}")
        group = "/".join(name.split("/")[:2])
        groups.setdefault(group, hashlib.sha256()).update(hexd.encode())
    for group, h in groups.items():
        print(f"{h.hexdigest()[:16]}  {group}")
    total = hashlib.sha256("".join(d.values()).encode()).hexdigest()[:16]
    print(f"{total}  TOTAL ({len(d)} cases)")


if __name__ == "__main__":
    main(sys.argv[1:])
