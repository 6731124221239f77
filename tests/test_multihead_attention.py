"""nn.MultiheadAttention against torch.nn.MultiheadAttention, a float64 NumPy textbook and
central differences.

One strategy draws every option at once: embed_dim and num_heads, kdim/vdim (separate
projection weights), bias, add_bias_kv, add_zero_attn, batch_first, unbatched input,
self-attention (query is key is value), key_padding_mask and attn_mask (none, bool, float;
2-D and 3-D), is_causal with its causal attn_mask (which npattn may also be given as None),
need_weights, average_attn_weights, dropout in eval mode, float32 and float64, and the memory
layout of the inputs. PyTorch runs in float64 on the same (float32-representable) values and
parameters: that is the truth for both dtypes.

Tolerances follow closeness.py, element by element: n counts the terms summed along the
chain (projection, scores, weighted sum, out_proj; the rows too for parameter gradients) and
``scale`` is the same chain run on magnitudes (|x|, |W|, |dout|), multiplied by the softmax's
amplification amp = 1 + 2·max|score terms| (reference_mha). Measured worst |err|/tol over 400
examples: about 0.02 in both dtypes; a wrong index or mask gives 1e5.
"""
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, tolerance
from npattn import dropout_mask, nn, reference
from npattn.gradcheck import gradcheck_module
from strategies import dtypes, lay_out, layouts, make_values
from test_nn import Bound  # a module called with fixed keywords and a fixed dropout seed

MASK_KINDS = ("none", "bool", "float")
#: A weight below float32's smallest normal number may come out as 0: count every weight as at
#: least tiny/eps in the tolerance (as test_attention.py does).
FLOOR = np.finfo(np.float32).tiny / np.finfo(np.float32).eps


# ------------------------------------------------------------------ helpers

def first_seed(seed):
    """The dropout seed a module built with ``seed=seed`` draws on its first training forward."""
    return int(np.random.default_rng(seed).integers(2**63))


def check(got, want, *, dtype, n, scale, what):
    """closeness.assert_close with the name of what is compared in the message."""
    try:
        assert_close(got, want, dtype=dtype, n=n, scale=scale)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def to_batch_first(x, batched, batch_first):
    """(L, E), (L, N, E) or (N, L, E) -> (N, L, E)."""
    if not batched:
        return x[None]
    return x if batch_first else x.transpose(1, 0, 2)


def from_batch_first(x, batched, batch_first):
    if not batched:
        return x[0]
    return x if batch_first else x.transpose(1, 0, 2)


def reference_mha(state, case, keep=None, p=0.0, dout=None):
    """The float64 textbook of MultiheadAttention, written from PyTorch's docs, and the
    magnitudes of the terms each result sums (closeness.py's ``scale``).

    Returns a dict: ``output`` (query's layout), ``weights`` (N, H, L, S') after dropout,
    ``amp`` = 1 + 2·max over scores of Σ_d |q_d|·|k_d|/√D + |float mask| (the softmax's
    amplification of a score's error, per query row, (N, H, L, 1)) and ``scale``: for the output,
    the weights and -- given ``dout`` -- every gradient, the chain rule run on magnitudes
    (|x|, |W|, |dout|; |ds| <= p ∘ (|dp| + Σ p∘|dp|)), multiplied by amp. ``keep`` is the
    dropout keep-mask (N, H, L, S'). The causal mask covers the S original keys; bias_k/bias_v
    and the zero key (S' = S + 1 or S + 2) stay visible.
    """
    st64 = {k: np.asarray(v, np.float64) for k, v in state.items()}
    heads, e = case["num_heads"], case["embed_dim"]
    d = e // heads
    batched, bf = case["batched"], case["batch_first"]
    x_q, x_k, x_v = (to_batch_first(np.asarray(case[name], np.float64), batched, bf)
                     for name in ("query", "key", "value"))                     # (N, ·, ·)
    if "in_proj_weight" in st64:
        w_q, w_k, w_v = np.split(st64["in_proj_weight"], 3)
    else:
        w_q, w_k, w_v = (st64[f"{c}_proj_weight"] for c in "qkv")
    b_q, b_k, b_v = np.split(st64.get("in_proj_bias", np.zeros(3 * e)), 3)
    w_o, b_o = st64["out_proj.weight"], st64.get("out_proj.bias")
    n, length, n_keys = x_q.shape[0], x_q.shape[1], x_k.shape[1]

    def split(x):                                                               # (N, H, ·, D)
        return x.reshape(x.shape[0], x.shape[1], heads, d).transpose(0, 2, 1, 3)

    def merge(x):                                                               # (N, ·, E)
        return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], e)

    lin, a = reference.linear_forward, np.abs
    q, k, v = (split(lin(x, w, b)) for x, w, b in ((x_q, w_q, b_q), (x_k, w_k, b_k),
                                                   (x_v, w_v, b_v)))
    qa, ka, va = (split(lin(a(x), a(w), a(b))) for x, w, b in
                  ((x_q, w_q, b_q), (x_k, w_k, b_k), (x_v, w_v, b_v)))          # magnitudes
    extras = []
    if "bias_k" in st64:
        extras.append((st64["bias_k"], st64["bias_v"]))
    if case["add_zero_attn"]:
        extras.append((np.zeros(e), np.zeros(e)))
    for bk, bv in extras:
        ek, ev = (np.broadcast_to(b.reshape(1, heads, 1, d), (n, heads, 1, d)) for b in (bk, bv))
        k, ka = np.concatenate([k, ek], axis=2), np.concatenate([ka, a(ek)], axis=2)
        v, va = np.concatenate([v, ev], axis=2), np.concatenate([va, a(ev)], axis=2)
    added = np.zeros((n, heads, length, k.shape[2]))                          # (N, H, L, S')
    for name in ("attn_mask", "key_padding_mask"):
        m = case[name]
        if m is None:
            continue
        if name == "key_padding_mask":
            m = m.reshape(n, 1, 1, n_keys)
        elif m.ndim == 3:
            m = m.reshape(n, heads, length, n_keys)
        m = np.where(m, -np.inf, 0.0) if m.dtype == bool else np.asarray(m, np.float64)
        added[..., :n_keys] = added[..., :n_keys] + m
    if case["is_causal"]:
        later = np.arange(n_keys)[None, :] > np.arange(length)[:, None]         # (L, S)
        added[..., :n_keys] = np.where(later, -np.inf, added[..., :n_keys])
    heads_out, weights = reference.attention_forward(q, k, v, added, keep, p)  # (N, H, L, ·)
    output = lin(merge(heads_out), w_o, b_o)                                   # (N, L, E)
    terms = (qa @ np.swapaxes(ka, -1, -2)) / math.sqrt(d) + np.where(
        np.isfinite(added), a(added), 0.0)
    amp = 1.0 + 2.0 * np.max(terms, axis=-1, keepdims=True, initial=0.0)      # (N, H, L, 1)
    top = float(amp.max())
    concat_a = merge(weights @ va)                                             # |heads' output|
    scale = dict(output=top * from_batch_first(lin(concat_a, a(w_o), None if b_o is None else
                                                   a(b_o)), batched, bf),
                 weights=amp * weights + FLOOR)
    result = dict(output=from_batch_first(output, batched, bf), weights=weights, amp=top,
                  scale=scale)
    if dout is None:
        return result
    g_out = to_batch_first(a(np.asarray(dout, np.float64)), batched, bf)       # (N, L, E)
    g = split(g_out @ a(w_o))                                                  # (N, H, L, D)
    dp = g @ np.swapaxes(va, -1, -2)                                           # (N, H, L, S')
    ds = amp * weights * (dp + np.sum(weights * dp, axis=-1, keepdims=True))
    dq = merge(ds @ ka / math.sqrt(d))                                         # (N, L, E)
    dk_all = np.swapaxes(ds, -1, -2) @ qa / math.sqrt(d)                       # (N, H, S', D)
    dv_all = amp.max() * (np.swapaxes(weights, -1, -2) @ g)                    # (N, H, S', D)
    dk, dv = merge(dk_all[:, :, :n_keys]), merge(dv_all[:, :, :n_keys])        # (N, S, E)
    grads = [dq @ a(w_q), dk @ a(w_k), dv @ a(w_v)]                            # inputs' bounds
    if case["self_attention"]:
        grads = [grads[0] + grads[1] + grads[2]]
    scale["inputs"] = [from_batch_first(x, batched, bf) for x in grads]
    dw = [np.einsum("nle,nlf->ef", dg, a(x)) for dg, x in ((dq, x_q), (dk, x_k), (dv, x_v))]
    db = [dg.sum(axis=(0, 1)) for dg in (dq, dk, dv)]
    params = {"out_proj.weight": top * np.einsum("nle,nlf->ef", g_out, concat_a),
              "out_proj.bias": g_out.sum(axis=(0, 1))}
    if "in_proj_weight" in st64:
        params["in_proj_weight"] = np.concatenate(dw)
    else:
        params.update(q_proj_weight=dw[0], k_proj_weight=dw[1], v_proj_weight=dw[2])
    params["in_proj_bias"] = np.concatenate(db)
    if "bias_k" in st64:
        params["bias_k"] = dk_all[:, :, n_keys].sum(axis=0).reshape(1, 1, e)
        params["bias_v"] = dv_all[:, :, n_keys].sum(axis=0).reshape(1, 1, e)
    scale["params"] = params
    return result


# ------------------------------------------------------------------ one drawn case

@st.composite
def mha_cases(draw):
    """A dict of constructor options, inputs, masks, call flags and a random upstream dout."""
    dtype = np.dtype(draw(dtypes))
    heads = draw(st.integers(1, 3))
    embed_dim = heads * draw(st.integers(1, 4))
    self_attention = draw(st.booleans())
    kdim = None if self_attention else draw(st.none() | st.integers(1, 6))
    vdim = None if self_attention else draw(st.none() | st.integers(1, 6))
    batched = draw(st.integers(0, 3)) > 0
    batch_first = draw(st.booleans())
    n = draw(st.integers(1, 3)) if batched else 1
    length = draw(st.integers(1, 5))
    n_keys = length if self_attention else draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def seq(count, width):
        if not batched:
            return (count, width)
        return (n, count, width) if batch_first else (count, n, width)

    query = lay_out(make_values(rng, seq(length, embed_dim), dtype), draw(layouts), rng)
    if self_attention:
        key = value = query
    else:
        key = lay_out(make_values(rng, seq(n_keys, kdim or embed_dim), dtype), draw(layouts), rng)
        value = lay_out(make_values(rng, seq(n_keys, vdim or embed_dim), dtype), draw(layouts),
                        rng)

    def mask(kind, shape):
        if kind == "bool":
            return rng.random(shape) < 0.25                       # True = ignore
        m = rng.standard_normal(shape)
        m[rng.random(shape) < 0.2] = -np.inf
        return m.astype(dtype)

    is_causal = draw(st.booleans())
    attn_kind = draw(st.sampled_from(MASK_KINDS[1:] if is_causal else MASK_KINDS))
    attn_shape = draw(st.sampled_from([(length, n_keys),
                                       ((n * heads) if batched else heads, length, n_keys)]))
    if is_causal:                                                 # the mask the hint promises
        later = np.broadcast_to(np.arange(n_keys)[None, :] > np.arange(length)[:, None],
                                attn_shape)
        attn_mask = later.copy() if attn_kind == "bool" else np.where(later, -np.inf,
                                                                      0.0).astype(dtype)
    else:
        attn_mask = None if attn_kind == "none" else mask(attn_kind, attn_shape)
    kpm_kind = draw(st.sampled_from(MASK_KINDS))
    kpm = None if kpm_kind == "none" else mask(kpm_kind, (n, n_keys) if batched else (n_keys,))
    options = dict(embed_dim=embed_dim, num_heads=heads,
                   dropout=draw(st.sampled_from([0.0, 0.3])), bias=draw(st.booleans()),
                   add_bias_kv=draw(st.booleans()), add_zero_attn=draw(st.booleans()),
                   kdim=kdim, vdim=vdim, batch_first=batch_first)
    need_weights = draw(st.booleans())
    out_shape = query.shape
    return dict(options, dtype=dtype, batched=batched, self_attention=self_attention,
                query=query, key=key, value=value, attn_mask=attn_mask, key_padding_mask=kpm,
                is_causal=is_causal, give_causal_mask=not is_causal or draw(st.booleans()),
                need_weights=need_weights, average_attn_weights=draw(st.booleans()),
                dout=make_values(rng, out_shape, dtype), state_seed=int(rng.integers(2**32)))


def random_state(torch_module, seed, dtype):
    """Random values for every parameter (PyTorch's zero biases would hide bias bugs)."""
    rng = np.random.default_rng(seed)
    return {k: (0.5 * rng.standard_normal(tuple(v.shape))).astype(dtype)
            for k, v in torch_module.state_dict().items()}


def build(torch, case):
    """(torch module in float64 holding the case's parameters, npattn module, state)."""
    opts = {k: case[k] for k in ("embed_dim", "num_heads", "dropout", "bias", "add_bias_kv",
                                 "add_zero_attn", "kdim", "vdim", "batch_first")}
    tm = torch.nn.MultiheadAttention(**opts, dtype=torch.float64)
    state = random_state(tm, case["state_seed"], case["dtype"])
    tm.load_state_dict({k: torch.tensor(v.astype(np.float64)) for k, v in state.items()})
    ours = nn.MultiheadAttention(**opts, dtype=case["dtype"], rng=1, seed=2)
    ours.load_state_dict(state)
    return tm, ours, state


def run_torch(torch, tm, case, need_weights):
    """PyTorch's forward and backward in float64: output, weights, input grads, param grads."""
    def t(a):
        return None if a is None else torch.tensor(
            a if a.dtype == bool else np.asarray(a, np.float64))
    if case["self_attention"]:
        x = torch.tensor(np.array(case["query"], np.float64), requires_grad=True)
        q = k = v = x
        leaves = [x]
    else:
        q, k, v = (torch.tensor(np.array(case[name], np.float64), requires_grad=True)
                   for name in ("query", "key", "value"))
        leaves = [q, k, v]
    extra = case["add_bias_kv"] or case["add_zero_attn"]
    tm.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # mixed bool/float masks warn
        out, weights = tm(q, k, v, key_padding_mask=t(case["key_padding_mask"]),
                          need_weights=need_weights, attn_mask=t(case["attn_mask"]),
                          average_attn_weights=case["average_attn_weights"],
                          # PyTorch's fused path would also hide the appended bias / zero key
                          # from the early queries, unlike its need_weights path: take the hint
                          # only where its two paths agree (the mask says the same)
                          is_causal=case["is_causal"] and not extra)
    out.backward(torch.tensor(np.array(case["dout"], np.float64)))
    return (out.detach().numpy(), None if weights is None else weights.detach().numpy(),
            [leaf.grad.numpy() for leaf in leaves],
            {name: p.grad.numpy() for name, p in tm.named_parameters()})


def run_ours(ours, case):
    attn_mask = case["attn_mask"] if case["give_causal_mask"] else None
    out, weights = ours(case["query"], case["key"], case["value"],
                        key_padding_mask=case["key_padding_mask"],
                        need_weights=case["need_weights"], attn_mask=attn_mask,
                        average_attn_weights=case["average_attn_weights"],
                        is_causal=case["is_causal"])
    ours.zero_grad()
    grads = ours.backward(case["dout"])
    if case["self_attention"]:
        grads = [grads[0] + grads[1] + grads[2]]              # the caller adds the three
    return out, weights, list(grads), {name: p.grad for name, p in ours.named_parameters()}


# ------------------------------------------------------------------ against PyTorch

@given(case=mha_cases())
def test_multihead_attention_matches_torch(torch, case):
    tm, ours, state = build(torch, case)
    if case["dropout"] > 0:                                   # dropout off: the RNGs differ
        tm.eval()
        ours.eval()
    dtype = case["dtype"]
    t_out, t_w, t_grads, t_pgrads = run_torch(torch, tm, case, case["need_weights"])
    out, weights, grads, pgrads = run_ours(ours, case)
    ref = reference_mha(state, case, dout=case["dout"])
    if np.isnan(t_out).any():
        # PyTorch's need_weights path gives NaN for a query row whose keys are all masked, in
        # any head; npattn gives that head zeros -- as PyTorch's own fused path does, which
        # becomes the truth for the output and the gradients
        assert case["need_weights"]
        fully = np.all(ref["weights"] == 0, axis=-1).any(axis=1)   # (N, L): a head sees nothing
        nan_rows = np.isnan(to_batch_first(t_out, case["batched"], case["batch_first"])).any(-1)
        assert np.array_equal(nan_rows, fully)
        t_out, _, t_grads, t_pgrads = run_torch(torch, tm, case, need_weights=False)
    assert np.isfinite(out).all()
    # n: the terms summed along the chain (projection, scores, weighted sum, out_proj) and,
    # for the gradients, over the rows too
    n_keys = ref["weights"].shape[-1]
    n = (max(case["embed_dim"], case["kdim"] or 0, case["vdim"] or 0) + 1
         + case["embed_dim"] // case["num_heads"] + n_keys + case["embed_dim"] + 1)
    scale = ref["scale"]
    check(out, t_out, dtype=dtype, n=n, scale=scale["output"], what="attn_output")
    if not case["need_weights"]:
        assert weights is None and t_w is None
    else:
        want, bound = ref["weights"], scale["weights"]
        if case["average_attn_weights"]:
            want, bound = want.mean(axis=1), bound.mean(axis=1)
        if not case["batched"]:
            want, bound = want[0], bound[0]
        assert weights.shape == t_w.shape
        want = np.where(np.isfinite(t_w), t_w, want)          # PyTorch's NaN rows: the textbook
        check(weights, want, dtype=dtype, n=n, scale=bound, what="attn_weights")
    n_grad = n + max(math.prod(case["query"].shape[:-1]), math.prod(case["key"].shape[:-1]))
    for name, got, want, bound in zip(("dquery", "dkey", "dvalue"), grads, t_grads,
                                      scale["inputs"]):
        check(got, want, dtype=dtype, n=n_grad, scale=bound, what=name)
    assert list(pgrads) == list(t_pgrads)
    for name in t_pgrads:
        check(pgrads[name], t_pgrads[name], dtype=dtype, n=n_grad, scale=scale["params"][name],
              what=f"{name}.grad")


@pytest.mark.parametrize("options", [
    dict(), dict(bias=False), dict(kdim=3, vdim=5), dict(kdim=3, bias=False),
    dict(add_bias_kv=True), dict(add_bias_kv=True, add_zero_attn=True, kdim=2),
    dict(batch_first=True, dropout=0.5)])
def test_state_dict_keys_and_shapes_match_torch(torch, options):
    tm = torch.nn.MultiheadAttention(6, 3, **options)
    ours = nn.MultiheadAttention(6, 3, **options, rng=0)
    want = {k: tuple(v.shape) for k, v in tm.state_dict().items()}
    got = {k: v.shape for k, v in ours.state_dict().items()}
    assert list(got.items()) == list(want.items())            # the same keys, in the same order
    ours.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
    for k, v in tm.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy().astype(np.float32))


def test_fully_masked_rows_give_zeros_where_torch_gives_nan(torch):
    """Batch 1's keys are all padding, and head 1 of batch 0 may not look at any key from
    query 2: PyTorch's need_weights path returns NaN rows there, npattn (like PyTorch's fused
    path) zero head outputs, so attn_output's row is out_proj.bias, and finite gradients."""
    e, heads, n, length, n_keys = 4, 2, 2, 3, 3
    tm = torch.nn.MultiheadAttention(e, heads, batch_first=True, dtype=torch.float64)
    rng = np.random.default_rng(5)
    state = {k: rng.standard_normal(tuple(v.shape)) for k, v in tm.state_dict().items()}
    tm.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    ours = nn.MultiheadAttention(e, heads, batch_first=True, dtype=np.float64)
    ours.load_state_dict(state)
    x = rng.standard_normal((n, length, e))
    kpm = np.zeros((n, n_keys), bool)
    kpm[1] = True                                             # batch 1 sees no key at all
    attn_mask = np.zeros((n * heads, length, n_keys), bool)
    attn_mask[1, 2] = True                                    # batch 0, head 1, query 2
    dout = rng.standard_normal((n, length, e))
    got, weights = ours(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask,
                        average_attn_weights=False)
    grads = ours.backward(dout)
    np.testing.assert_array_equal(got[1], np.broadcast_to(state["out_proj.bias"], (length, e)))
    assert np.all(weights[1] == 0) and np.all(weights[0, 1, 2] == 0)
    assert all(np.isfinite(g).all() for g in grads)
    assert all(np.isfinite(p.grad).all() for p in ours.parameters())

    tx = torch.tensor(x, requires_grad=True)
    nan_out, _ = tm(tx, tx, tx, key_padding_mask=torch.tensor(kpm),
                    attn_mask=torch.tensor(attn_mask), need_weights=True)
    nan_rows = torch.isnan(nan_out).any(-1).numpy()
    assert nan_rows[1].all() and nan_rows[0, 2] and nan_rows.sum() == length + 1
    finite = ~nan_rows
    np.testing.assert_allclose(got[finite], nan_out.detach().numpy()[finite], rtol=1e-12,
                               atol=1e-12)
    fused, _ = tm(tx, tx, tx, key_padding_mask=torch.tensor(kpm),
                  attn_mask=torch.tensor(attn_mask), need_weights=False)
    fused.backward(torch.tensor(dout))
    np.testing.assert_allclose(got, fused.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sum(grads), tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    for name, p in tm.named_parameters():
        np.testing.assert_allclose(dict(ours.named_parameters())[name].grad, p.grad.numpy(),
                                   rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ dropout, seeds, modes

@given(dtype=dtypes, need_weights=st.booleans(), batch_first=st.booleans(),
       add_zero_attn=st.booleans(), p=st.sampled_from([0.2, 0.5, 0.9]),
       seed=st.integers(0, 2**32 - 1))
def test_training_dropout_matches_reference_with_its_seed(dtype, need_weights, batch_first,
                                                          add_zero_attn, p, seed):
    """In training mode the weights are dropped by dropout_mask((N, H, L, S'), p, s), s the
    first draw of Generator(seed), and the output uses the dropped weights (PyTorch's rule)."""
    e, heads, n, length, n_keys = 6, 2, 2, 3, 5
    rng = np.random.default_rng(seed)
    ours = nn.MultiheadAttention(e, heads, dropout=p, add_zero_attn=add_zero_attn,
                                 batch_first=batch_first, kdim=3, dtype=dtype, rng=rng, seed=seed)
    shape = (lambda count, w: (n, count, w)) if batch_first else (lambda count, w: (count, n, w))
    case = dict(embed_dim=e, num_heads=heads, batched=True, batch_first=batch_first,
                add_zero_attn=add_zero_attn, query=make_values(rng, shape(length, e), dtype),
                key=make_values(rng, shape(n_keys, 3), dtype),
                value=make_values(rng, shape(n_keys, e), dtype),
                key_padding_mask=rng.random((n, n_keys)) < 0.3, attn_mask=None, is_causal=False,
                self_attention=False)
    out, weights = ours(case["query"], case["key"], case["value"],
                        key_padding_mask=case["key_padding_mask"], need_weights=need_weights,
                        average_attn_weights=False)
    total = n_keys + add_zero_attn
    keep = dropout_mask((n, heads, length, total), p, first_seed(seed))
    ref = reference_mha(ours.state_dict(), case, keep, p)
    n = 3 * e + total + 2
    check(out, ref["output"], dtype=dtype, n=n, scale=ref["scale"]["output"], what="output")
    if need_weights:
        check(weights, ref["weights"], dtype=dtype, n=n, scale=ref["scale"]["weights"],
              what="weights")
        assert np.all((weights == 0) >= ~keep)               # every dropped weight is zero
    else:
        assert weights is None


def test_same_seed_same_run_bitwise():
    """Same rng and seed -> the same weights and, step after step, the same dropout masks."""
    def run(seed):
        m = nn.MultiheadAttention(8, 2, dropout=0.4, rng=7, seed=seed)
        x = np.random.default_rng(3).standard_normal((5, 2, 8)).astype(np.float32)
        outs = []
        for _ in range(3):
            out, w = m(x, x, x)
            grads = m.backward(np.ones_like(out))
            outs += [out, w, *grads, *(p.grad.copy() for p in m.parameters())]
        return outs
    a, b, c = run(11), run(11), run(12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])                     # another seed, another mask
    assert not np.array_equal(a[0], a[0 + len(a) // 3])       # a fresh mask each forward


def test_eval_mode_turns_dropout_off():
    m = nn.MultiheadAttention(8, 4, dropout=0.5, rng=0, seed=0)
    plain = nn.MultiheadAttention(8, 4, rng=0)
    x = np.random.default_rng(1).standard_normal((3, 2, 8)).astype(np.float32)
    m.eval()
    assert not m.training and not m.out_proj.training
    got, w = m(x, x, x)
    want, w_plain = plain(x, x, x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(w, w_plain)
    m.train()
    dropped, _ = m(x, x, x)
    assert not np.array_equal(dropped, want)


# ------------------------------------------------------------------ gradients by differences



# What PyTorch cannot check: training-mode dropout (another generator) and is_causal without
# an attn_mask (PyTorch raises); the rest of the options are held to PyTorch's autograd above.
GRADCHECK_CASES = [                     # (constructor options, call options, unbatched)
    (dict(kdim=3, vdim=2, bias=False), dict(need_weights=False, is_causal=True), True),
    (dict(dropout=0.3), dict(need_weights=False, training=True), False),
    (dict(dropout=0.3, add_zero_attn=True, add_bias_kv=True, batch_first=True),
     dict(training=True, attn_mask="bool", key_padding_mask="float"), False),
    (dict(dropout=0.3), dict(training=True, attn_mask="float3", is_causal=True), True),
]


@pytest.mark.parametrize("options, call, unbatched", GRADCHECK_CASES)
def test_gradients_match_central_differences(options, call, unbatched):
    """Input and parameter gradients of small modules, dropout included (its seed fixed)."""
    e, heads, n, length, n_keys = 2, 2, 2, 2, 3
    rng = np.random.default_rng(0)
    m = nn.MultiheadAttention(e, heads, **options, dtype=np.float64, rng=rng, seed=0)
    for p in m.parameters():                                  # no zero biases
        p.data[...] = 0.5 * rng.standard_normal(p.shape)
    training = call.get("training", False)
    m.train(training)
    bf = options.get("batch_first", False)

    def seq(count, width):
        if unbatched:
            return (count, width)
        return (n, count, width) if bf else (count, n, width)
    kwargs = dict(need_weights=call.get("need_weights", True),
                  is_causal=call.get("is_causal", False))
    if call.get("key_padding_mask") == "float":
        kpm = rng.standard_normal((n_keys,) if unbatched else (n, n_keys))
        kpm[..., 1] = -np.inf
        kwargs["key_padding_mask"] = kpm
    if call.get("attn_mask") == "float3":
        kwargs["attn_mask"] = rng.standard_normal(((heads if unbatched else n * heads), length,
                                                   n_keys))
    elif call.get("attn_mask") == "bool":
        mask = rng.random((length, n_keys)) < 0.3
        mask[:, 0] = False
        kwargs["attn_mask"] = mask
    inputs = (rng.standard_normal(seq(length, e)),
              rng.standard_normal(seq(n_keys, m.kdim)),
              rng.standard_normal(seq(n_keys, m.vdim)))
    module = Bound(m, dropout_seed=5 if training else None, **kwargs)
    if training:                                              # the mask drops something
        total = n_keys + options.get("add_bias_kv", False) + options.get("add_zero_attn", False)
        keep = dropout_mask((1 if unbatched else n, heads, length, total), 0.3, first_seed(5))
        assert not keep.all() and keep.any()
    report = gradcheck_module(module, inputs, atol=1e-7, rtol=1e-5)
    assert report.ok and len(report.errors) == 3 + len(m.parameters())


def test_self_attention_gradient_is_the_sum_of_the_three():
    """x fed as query, key and value: gradcheck of x -> attn(x, x, x) against dq + dk + dv."""
    m = nn.MultiheadAttention(4, 2, dtype=np.float64, rng=0)

    class SelfAttend(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = m

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

        def backward(self, dout):
            return sum(self.attn.backward(dout))

    x = np.random.default_rng(1).standard_normal((3, 2, 4))
    assert gradcheck_module(SelfAttend(), (x,), atol=1e-7, rtol=1e-5).ok


def test_gradients_accumulate_over_two_backward_calls():
    m = nn.MultiheadAttention(4, 2, rng=0, dtype=np.float64)
    rng = np.random.default_rng(2)
    x1, x2 = rng.standard_normal((2, 3, 2, 4))
    d1, d2 = rng.standard_normal((2, 3, 2, 4))
    singles = []
    for x, d in ((x1, d1), (x2, d2)):
        m.zero_grad()
        m(x, x, x)
        m.backward(d)
        singles.append([p.grad.copy() for p in m.parameters()])
    m.zero_grad()
    m(x1, x1, x1)
    m.backward(d1)
    m(x2, x2, x2)
    m.backward(d2)
    for p, a, b in zip(m.parameters(), *singles):
        np.testing.assert_allclose(p.grad, a + b, rtol=1e-13, atol=1e-15)
    m.zero_grad()
    assert all(not p.grad.any() for p in m.parameters())


# ------------------------------------------------------------------ other properties

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch_first", [False, True])
def test_need_weights_does_not_change_output_or_gradients(dtype, batch_first):
    rng = np.random.default_rng(int(batch_first))
    m = nn.MultiheadAttention(6, 3, batch_first=batch_first, dtype=dtype, rng=rng)
    shape = (2, 4, 6) if batch_first else (4, 2, 6)          # N = 2, L = 4
    x = make_values(rng, shape, dtype)
    kpm = rng.random((2, 4)) < 0.3
    dout = make_values(rng, shape, dtype)
    results = []
    for need_weights in (True, False):
        m.zero_grad()
        out, _ = m(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        results.append([out, *m.backward(dout), *(p.grad.copy() for p in m.parameters())])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance(dtype, 40, np.max(np.abs(b))))


@pytest.mark.parametrize("extra", [dict(), dict(add_bias_kv=True), dict(add_zero_attn=True)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_without_attn_mask_applies_the_causal_mask(extra, need_weights):
    """PyTorch raises for is_causal=True without attn_mask; npattn applies the top-left causal
    mask (key j visible to query i iff j <= i), the appended bias / zero key staying visible."""
    m = nn.MultiheadAttention(4, 2, dtype=np.float64, rng=0, **extra)
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((3, 2, 4)), rng.standard_normal((5, 2, 4))
    causal = np.arange(5)[None, :] > np.arange(3)[:, None]    # (L, S), True = not allowed
    got, w_got = m(q, kv, kv, is_causal=True, need_weights=need_weights)
    want, w_want = m(q, kv, kv, attn_mask=causal, need_weights=need_weights)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    case = dict(embed_dim=4, num_heads=2, batched=True, batch_first=False, query=q, key=kv,
                value=kv, add_zero_attn=extra.get("add_zero_attn", False), attn_mask=None,
                key_padding_mask=None, is_causal=True, self_attention=False)
    np.testing.assert_allclose(got, reference_mha(m.state_dict(), case)["output"], rtol=1e-12,
                               atol=1e-13)
    if need_weights:
        np.testing.assert_allclose(w_got, w_want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("need_weights", [True, False])
def test_empty_sequences_and_batches(need_weights):
    """L = 0, N = 0 give empty results; S = 0 leaves every query without a key: zero heads,
    so each output row is out_proj.bias."""
    m = nn.MultiheadAttention(4, 2, rng=0)
    m.out_proj.bias.data[...] = np.arange(4)
    for length, n, n_keys in ((0, 2, 3), (3, 0, 3), (3, 2, 0)):
        q = np.ones((length, n, 4), np.float32)
        kv = np.ones((n_keys, n, 4), np.float32)
        out, weights = m(q, kv, kv, need_weights=need_weights)
        assert out.shape == (length, n, 4)
        assert weights is None if not need_weights else weights.shape == (n, length, n_keys)
        np.testing.assert_array_equal(out, np.broadcast_to(np.arange(4), out.shape)
                                      if n_keys == 0 else out)
        grads = m.backward(np.ones_like(out))
        assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_default_initialisation_follows_pytorch():
    e, kdim = 64, 32
    m = nn.MultiheadAttention(e, 4, add_bias_kv=True, rng=0)
    w = m.in_proj_weight.data
    bound = math.sqrt(6 / (e + 3 * e))                        # xavier_uniform on (3E, E)
    assert w.dtype == np.float32 and np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound
    assert not m.in_proj_bias.data.any() and not m.out_proj.bias.data.any()
    out_bound = 1 / math.sqrt(e)                              # nn.Linear's kaiming_uniform(√5)
    assert out_bound * 0.95 < np.abs(m.out_proj.weight.data).max() <= out_bound
    assert abs(m.bias_k.data.std() - math.sqrt(2 / (2 * e))) < 0.3 * math.sqrt(1 / e)
    sep = nn.MultiheadAttention(e, 4, kdim=kdim, vdim=kdim, rng=0)
    assert sep.in_proj_weight is None
    assert np.abs(sep.k_proj_weight.data).max() <= math.sqrt(6 / (e + kdim))
    assert np.abs(sep.q_proj_weight.data).max() <= math.sqrt(6 / (2 * e))
    again = nn.MultiheadAttention(e, 4, add_bias_kv=True, rng=0)
    assert all(np.array_equal(a, b) for a, b in zip(m.state_dict().values(),
                                                    again.state_dict().values()))
    wide = nn.MultiheadAttention(e, 4, add_bias_kv=True, rng=0, dtype=np.float64)
    for a, b in zip(m.state_dict().values(), wide.state_dict().values()):
        np.testing.assert_array_equal(a, b.astype(np.float32))   # one draw, two roundings


# ------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(embed_dim=6, num_heads=4), ValueError, ["embed_dim", "divisible", "num_heads"]),
    (dict(embed_dim=0, num_heads=1), ValueError, ["embed_dim", ">= 1", "0"]),
    (dict(embed_dim=4, num_heads=0), ValueError, ["num_heads", ">= 1"]),
    (dict(embed_dim=4.0, num_heads=2), TypeError, ["embed_dim", "int", "float"]),
    (dict(embed_dim=4, num_heads=2, dropout=1.5), ValueError, ["dropout", "[0, 1]", "1.5"]),
    (dict(embed_dim=4, num_heads=2, kdim=0), ValueError, ["kdim"]),
    (dict(embed_dim=4, num_heads=2, batch_first=1), TypeError, ["batch_first", "bool"]),
    (dict(embed_dim=4, num_heads=2, dtype=np.float16), TypeError, ["dtype", "float16"]),
    (dict(embed_dim=4, num_heads=2, rng="seed"), TypeError, ["rng", "Generator", "str"]),
    (dict(embed_dim=4, num_heads=2, seed=-1), ValueError, ["seed", "-1"]),
])
def test_constructor_rejects_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        nn.MultiheadAttention(**kwargs)
    for word in words:
        assert word in str(info.value)


X = np.zeros((3, 2, 4), np.float32)                          # (L, N, E)


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((X[..., :3], X, X), {}, ValueError, ["query", "4", "(3, 2, 3)"]),
    ((X, X[..., :3], X), {}, ValueError, ["key", "kdim", "(3, 2, 3)"]),
    ((X, X, X[:2]), {}, ValueError, ["value", "sequence and batch", "(2, 2, 4)"]),
    ((X, X[:, :1], X[:, :1]), {}, ValueError, ["key", "batch size 2"]),
    ((X[0, 0], X[0, 0], X[0, 0]), {}, ValueError, ["query", "(L, N, E)", "(4,)"]),
    ((X, X[0], X[0]), {}, ValueError, ["key", "3-D"]),
    ((X.astype(np.float64), X, X), {}, TypeError, ["query", "float32", "float64"]),
    ((X, X, X.astype(np.int32)), {}, TypeError, ["value", "int32"]),
    ((X, X, X), dict(attn_mask=np.zeros((3, 4), bool)), ValueError,
     ["attn_mask", "(3, 3)", "(2 * 2, 3, 3)", "(3, 4)"]),
    ((X, X, X), dict(attn_mask=np.zeros((3, 3, 3), bool)), ValueError, ["attn_mask"]),
    ((X, X, X), dict(attn_mask=np.zeros((3, 3), np.float64)), TypeError,
     ["attn_mask", "float32", "float64"]),
    ((X, X, X), dict(attn_mask=np.zeros((3, 3), np.int64)), TypeError, ["attn_mask", "int64"]),
    ((X, X, X), dict(key_padding_mask=np.zeros((3, 2), bool)), ValueError,
     ["key_padding_mask", "(2, 3)", "(3, 2)"]),
    ((X[:, 0], X[:, 0], X[:, 0]), dict(key_padding_mask=np.zeros((1, 3), bool)), ValueError,
     ["key_padding_mask", "(3,)"]),
    ((X, X, X), dict(need_weights=None), TypeError, ["need_weights", "bool"]),
    ((X, X, X), dict(is_causal="yes"), TypeError, ["is_causal", "bool"]),
])
def test_forward_rejects_bad_arguments(args, kwargs, error, words):
    m = nn.MultiheadAttention(4, 2, rng=0)
    with pytest.raises(error) as info:
        m(*args, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_backward_checks_its_argument_and_order():
    m = nn.MultiheadAttention(4, 2, rng=0)
    with pytest.raises(RuntimeError, match="backward was called before forward"):
        m.backward(X)
    m(X, X, X)
    with pytest.raises(ValueError, match=r"dout must have shape \(3, 2, 4\).*got \(3, 2, 3\)"):
        m.backward(X[..., :3])
    with pytest.raises(TypeError, match="dout must have dtype float32"):
        m.backward(X.astype(np.float64))


def _numpy_heads(x, heads, batch_first):
    """NumPy's split of (N, L, H·D) (or (L, N, H·D)) into (N, H, L, D), through a view."""
    packed = x if batch_first else x.transpose(1, 0, 2)
    n, length, width = packed.shape
    return packed.reshape(n, length, heads, width // heads).transpose(0, 2, 1, 3)


@given(dtype=dtypes, n=st.integers(0, 3), heads=st.integers(1, 4), length=st.integers(0, 70),
       width=st.integers(1, 6), k=st.integers(1, 3), batch_first=st.booleans(), layout=layouts,
       seed=st.integers(0, 2**32 - 1))
def test_heads_split_and_merged_are_numpys_transposes(dtype, n, heads, length, width, k,
                                                      batch_first, layout, seed):
    """split_heads (k parts side by side: the GPT's fused q, k, v) and merge_heads_side_by_side
    (their gradients back into one array) are NumPy's reshapes and transposes, element for
    element (kernels/heads.py: a parallel copy, or its serial twin for few elements), from
    inputs of any memory layout, into C-contiguous arrays; merging the split gives the input."""
    from npattn.functional.attention import merge_heads, merge_heads_side_by_side, split_heads
    rng = np.random.default_rng(seed)
    lead = (n, length) if batch_first else (length, n)
    x = make_values(rng, lead + (k * heads * width,), dtype)
    parts = split_heads(lay_out(x, layout, rng), heads, batch_first, parts=k)
    parts = parts if k > 1 else parts[None]
    assert parts.shape == (k, n, heads, length, width) and parts.flags.c_contiguous
    c = heads * width
    for i in range(k):
        np.testing.assert_array_equal(parts[i], _numpy_heads(x[..., i * c:(i + 1) * c], heads,
                                                             batch_first))
        merged = merge_heads(lay_out(parts[i], layout, rng), batch_first)
        np.testing.assert_array_equal(merged, x[..., i * c:(i + 1) * c])
    got = merge_heads_side_by_side([lay_out(p, layout, rng) for p in parts], batch_first)
    np.testing.assert_array_equal(got, x)
    assert got.dtype == dtype and got.flags.c_contiguous
