"""npattn.nn: Linear, Dropout, SelfAttention, Embedding, PositionalEncoding, LayerNorm, GELU and the
initialisers, against torch.nn (in float64, on the same float32-representable values and
parameters), float64 NumPy textbooks and central differences; and the Module bookkeeping
(state_dict, load errors, train/eval, zero_grad, accumulation, Sequential, ModuleList).

Tolerances follow closeness.py: n counts the terms each result sums and ``scale`` is the same
formula run on magnitudes (|x|, |W|, |dout|), times the softmax's amplification
1 + 2·max|score terms| where there is one. MultiheadAttention has its own file.
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import abs64, assert_close, f64
from npattn import dropout_backward, dropout_forward, dropout_mask, nn, reference
from npattn.gradcheck import gradcheck_module
from strategies import dims, dtypes, lay_out, layouts, make_values, shapes

FLOOR = np.finfo(np.float32).tiny / np.finfo(np.float32).eps   # see test_attention.py


def first_seeds(seed, count=1):
    """The dropout seeds a module built with ``seed=seed`` draws on its training forwards."""
    gen = np.random.default_rng(seed)
    return [int(gen.integers(2**63)) for _ in range(count)]


def random_state(module, rng, dtype, scale=0.5):
    """Random values for every entry of module.state_dict() (zero biases would hide bugs)."""
    return {k: (scale * rng.standard_normal(v.shape)).astype(dtype)
            for k, v in module.state_dict().items()}


def to_torch(torch, state):
    return {k: torch.tensor(np.asarray(v, np.float64)) for k, v in state.items()}


class Bound(nn.Module):
    """Calls ``inner`` with fixed keywords; with ``dropout_seed``, restarts every generator of
    ``inner`` from it before each forward, so training-mode dropout repeats exactly (what
    central differences need)."""

    def __init__(self, inner, dropout_seed=None, **kwargs):
        super().__init__()
        self.inner = inner
        self.kwargs = kwargs
        self.dropout_seed = dropout_seed

    def forward(self, *inputs):
        if self.dropout_seed is not None:
            for _, module in self.inner.named_modules():
                if "_generator" in module.__dict__:
                    module._generator = np.random.default_rng(self.dropout_seed)
        return self.inner(*inputs, **self.kwargs)

    def backward(self, dout):
        return self.inner.backward(dout)


# ================================================================== Linear

@st.composite
def linear_cases(draw):
    dtype = draw(dtypes)
    lead = draw(shapes(max_ndim=3, max_dim=5))
    fin, fout = draw(dims(12)), draw(dims(12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = lay_out(make_values(rng, lead + (fin,), dtype), draw(layouts), rng)
    dout = make_values(rng, lead + (fout,), dtype)
    return dtype, x, dout, fin, fout, draw(st.booleans()), int(rng.integers(2**32))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@given(case=linear_cases())
def test_linear_matches_torch(torch, case):
    dtype, x, dout, fin, fout, bias, seed = case
    ours = nn.Linear(fin, fout, bias, dtype=dtype, rng=seed)
    tm = torch.nn.Linear(fin, fout, bias, dtype=torch.float64)
    state = random_state(ours, np.random.default_rng(seed), dtype)
    ours.load_state_dict(state)
    tm.load_state_dict(to_torch(torch, state))
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    tout = tm(tx)
    tout.backward(torch.tensor(f64(dout)[0]))
    out = ours(x)
    w, b = state["weight"], state.get("bias")
    assert_close(out, tout.detach().numpy(), dtype=dtype, n=fin + 1,
                 scale=reference.linear_forward(*abs64(x, w, b)))
    dx = ours.backward(dout)
    absd = reference.linear_backward(*abs64(dout, x, w, b))
    rows = math.prod(x.shape[:-1])
    assert_close(dx, tx.grad.numpy(), dtype=dtype, n=fout, scale=absd[0])
    assert_close(ours.weight.grad, tm.weight.grad.numpy(), dtype=dtype, n=rows, scale=absd[1])
    if bias:
        assert_close(ours.bias.grad, tm.bias.grad.numpy(), dtype=dtype, n=rows, scale=absd[2])
    else:
        assert ours.bias is None and list(ours.state_dict()) == ["weight"]


def test_linear_default_initialisation_follows_pytorch(torch):
    m = nn.Linear(256, 64, rng=0)
    bound = 1 / math.sqrt(256)                                # kaiming_uniform(a=√5)
    for p in (m.weight.data, m.bias.data):
        assert p.dtype == np.float32 and np.abs(p).max() <= bound
        assert np.abs(p).max() > 0.9 * bound and abs(p.std() - bound / math.sqrt(3)) < 0.1 * bound
    t = torch.nn.Linear(256, 64)
    assert abs(m.weight.data.std() - t.weight.detach().numpy().std()) < 0.05 * bound
    again, wide = nn.Linear(256, 64, rng=0), nn.Linear(256, 64, rng=0, dtype=np.float64)
    np.testing.assert_array_equal(m.weight.data, again.weight.data)
    np.testing.assert_array_equal(m.weight.data, wide.weight.data.astype(np.float32))
    assert not np.array_equal(m.weight.data, nn.Linear(256, 64, rng=1).weight.data)
    empty = nn.Linear(0, 3, rng=0)                            # fan_in 0: PyTorch's zero bias
    assert empty.weight.shape == (3, 0) and not empty.bias.data.any()
    np.testing.assert_array_equal(empty(np.ones((2, 0), np.float32)), np.zeros((2, 3)))


def test_article_projections():
    """The article: X (2, 5, 512), W_Q = nn.Linear(512, 64) -> Q (2, 5, 64)."""
    x = np.random.default_rng(0).standard_normal((2, 5, 512)).astype(np.float32)
    w_q = nn.Linear(512, 64, rng=0)
    q = w_q(x)
    assert q.shape == (2, 5, 64) and w_q.weight.shape == (64, 512)
    assert w_q.backward(np.ones_like(q)).shape == x.shape


# ================================================================== Dropout

@given(dtype=dtypes, shape=shapes(max_ndim=3, max_dim=7), p=st.sampled_from([0.1, 0.5, 1.0]),
       seed=st.integers(0, 2**32 - 1))
def test_dropout_draws_a_fresh_seed_each_training_forward(dtype, shape, p, seed):
    rng = np.random.default_rng(seed)
    x, dout = make_values(rng, shape, dtype), make_values(rng, shape, dtype)
    m = nn.Dropout(p, seed=seed)
    for drawn in first_seeds(seed, 2):
        out = m(x)
        np.testing.assert_array_equal(out, dropout_forward(x, p, drawn))
        np.testing.assert_array_equal(m.backward(dout), dropout_backward(dout, p, drawn))
        keep = dropout_mask(shape, p, drawn)
        assert_close(out, reference.dropout_forward(*f64(x), keep, p), dtype=dtype)


def test_dropout_eval_and_zero_probability_are_the_identity():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    m = nn.Dropout(0.5, seed=0).eval()
    assert m(x) is x and m.backward(x) is x
    zero = nn.Dropout(0.0, seed=0)
    np.testing.assert_array_equal(zero(x), x)
    m.train()
    assert (m(x) == 0).any()


def test_dropout_gradient_matches_central_differences_with_its_seed_fixed():
    x = np.random.default_rng(1).standard_normal((3, 4))
    report = gradcheck_module(Bound(nn.Dropout(0.4, seed=3), dropout_seed=3), (x,))
    assert report.ok and 0 in report.errors


# ================================================================== SelfAttention

def attention_bounds(x, state, mask, is_causal, dout, keep=None, p=0.0):
    """The article's attention on x in float64 -- (output, weights) -- and the magnitudes
    (closeness.py's scale) of the output, the weights, dx and each parameter's gradient."""
    x = np.asarray(x, np.float64)
    s = {k: np.asarray(v, np.float64) for k, v in state.items()}
    w = [(s[f"W_{c}.weight"], s.get(f"W_{c}.bias")) for c in "QKV"]
    q, k, v = (reference.linear_forward(x, *wb) for wb in w)
    qa, ka, va = (reference.linear_forward(*abs64(x, *wb)) for wb in w)
    d_k, length = q.shape[-1], q.shape[-2]
    added = np.zeros(q.shape[:-1] + (length,))
    if mask is not None:
        added = added + (np.where(mask, 0.0, -np.inf) if mask.dtype == bool
                         else np.asarray(mask, np.float64))
    if is_causal:
        added = np.where(reference.causal_mask(length, length), added, -np.inf)
    out, weights = reference.attention_forward(q, k, v, added, keep, p)
    terms = qa @ np.swapaxes(ka, -1, -2) / math.sqrt(d_k) + np.where(np.isfinite(added),
                                                                     np.abs(added), 0.0)
    amp = 1.0 + 2.0 * np.max(terms, axis=-1, keepdims=True, initial=0.0)
    top = float(amp.max(initial=1.0))
    g = np.abs(np.asarray(dout, np.float64))
    dp = g @ np.swapaxes(va, -1, -2)
    ds = amp * weights * (dp + np.sum(weights * dp, axis=-1, keepdims=True))
    grads = [ds @ ka / math.sqrt(d_k), np.swapaxes(ds, -1, -2) @ qa / math.sqrt(d_k),
             top * (np.swapaxes(weights, -1, -2) @ g)]                  # dq, dk, dv bounds
    xa = np.abs(x).reshape(-1, x.shape[-1])
    scale = dict(output=top * (weights @ va), weights=amp * weights + FLOOR,
                 dx=sum(gq @ np.abs(wb[0]) for gq, wb in zip(grads, w)))
    for c, gq in zip("QKV", grads):
        rows = gq.reshape(-1, gq.shape[-1])
        scale[f"W_{c}.weight"] = rows.T @ xa
        scale[f"W_{c}.bias"] = rows.sum(axis=0)
    return out, weights, scale


@st.composite
def self_attention_cases(draw):
    dtype = draw(dtypes)
    lead = draw(st.sampled_from([(), (1,), (3,)]))
    length, d_model = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.none() | st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = lay_out(make_values(rng, lead + (length, d_model), dtype), draw(layouts), rng)
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_shape = draw(st.sampled_from([(length, length), lead + (length, length)]))
    if kind == "bool":                                        # True = attend; key 0 always:
        mask = rng.random(mask_shape) < 0.7                  # PyTorch's softmax gives NaN
        mask[..., 0] = True                                   # for a row with no key
    elif kind == "float":
        mask = rng.standard_normal(mask_shape)
        mask[rng.random(mask_shape) < 0.2] = -np.inf
        mask[..., 0] = 0.5
        mask = mask.astype(dtype)
    else:
        mask = None
    dout = make_values(rng, lead + (length, d_v or d_k), dtype)
    return dict(dtype=dtype, x=x, d_model=d_model, d_k=d_k, d_v=d_v, bias=draw(st.booleans()),
                mask=mask, is_causal=draw(st.booleans()), dout=dout,
                seed=int(rng.integers(2**32)))


@given(case=self_attention_cases())
def test_self_attention_matches_torch(torch, case):
    """PyTorch running the article's code: Linear W_Q, W_K, W_V, then
    softmax(Q·Kᵀ/√d_k masked) · V, with autograd for every gradient."""
    dtype, x, mask = case["dtype"], case["x"], case["mask"]
    ours = nn.SelfAttention(case["d_model"], case["d_k"], case["d_v"], case["bias"],
                            dtype=dtype, rng=case["seed"])
    state = random_state(ours, np.random.default_rng(case["seed"]), dtype)
    ours.load_state_dict(state)
    layers = {c: torch.nn.Linear(case["d_model"], ours.d_v if c == "V" else ours.d_k,
                                 case["bias"], dtype=torch.float64) for c in "QKV"}
    for c, layer in layers.items():
        layer.load_state_dict(to_torch(torch, {k.split(".")[1]: v for k, v in state.items()
                                               if k.startswith(f"W_{c}.")}))
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    q, k, v = (layers[c](tx) for c in "QKV")
    scores = q @ k.transpose(-2, -1) / math.sqrt(ours.d_k)
    if mask is not None:
        tmask = torch.tensor(np.asarray(mask, bool if mask.dtype == bool else np.float64))
        scores = scores.masked_fill(~tmask, -math.inf) if mask.dtype == bool else scores + tmask
    if case["is_causal"]:
        length = x.shape[-2]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1),
                                    -math.inf)
    t_weights = torch.softmax(scores, dim=-1)
    t_out = t_weights @ v
    t_out.backward(torch.tensor(f64(case["dout"])[0]))

    out, weights = ours(x, mask, is_causal=case["is_causal"])
    dx = ours.backward(case["dout"])
    _, _, scale = attention_bounds(x, state, mask, case["is_causal"], case["dout"])
    n = case["d_model"] + 1 + ours.d_k + x.shape[-2] + 2
    rows = math.prod(x.shape[:-1])
    assert_close(out, t_out.detach().numpy(), dtype=dtype, n=n, scale=scale["output"])
    assert_close(weights, t_weights.detach().numpy(), dtype=dtype, n=n, scale=scale["weights"])
    assert_close(dx, tx.grad.numpy(), dtype=dtype, n=n + 3 * ours.d_k, scale=scale["dx"])
    for c, layer in layers.items():
        for name, param in layer.named_parameters():
            key = f"W_{c}.{name}"
            assert_close(dict(ours.named_parameters())[key].grad, param.grad.numpy(),
                         dtype=dtype, n=n + rows, scale=scale[key])


@given(dtype=dtypes, p=st.sampled_from([0.25, 0.75]), seed=st.integers(0, 2**32 - 1),
       batched=st.booleans())
def test_self_attention_dropout_weights_are_the_articles_p_attn(dtype, p, seed, batched):
    rng = np.random.default_rng(seed)
    m = nn.SelfAttention(6, 4, 3, dropout=p, dtype=dtype, rng=rng, seed=seed)
    x = make_values(rng, ((2,) if batched else ()) + (5, 6), dtype)
    out, weights = m(x)
    keep = dropout_mask(weights.shape, p, first_seeds(seed)[0])
    want_out, want_w, scale = attention_bounds(x, m.state_dict(), None, False,
                                               np.zeros(out.shape), keep, p)
    assert_close(weights, want_w, dtype=dtype, n=20, scale=scale["weights"] / (1 - p))
    assert_close(out, want_out, dtype=dtype, n=20, scale=scale["output"] / (1 - p))
    assert np.all(weights[~keep] == 0)
    m.eval()
    _, plain = m(x)
    np.testing.assert_allclose(plain.sum(axis=-1), 1.0, rtol=1e-5)   # softmax rows, no dropout


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("call", [dict(), dict(mask="float"), dict(is_causal=True)])
def test_self_attention_gradients_match_central_differences(call, training):
    rng = np.random.default_rng(0)
    m = nn.SelfAttention(3, 2, 3, dropout=0.3, dtype=np.float64, rng=rng, seed=1)
    m.load_state_dict(random_state(m, rng, np.float64))
    m.train(training)
    kwargs = dict(is_causal=call.get("is_causal", False))
    if call.get("mask") == "float":
        kwargs["mask"] = rng.standard_normal((4, 4))
    x = rng.standard_normal((2, 4, 3))
    report = gradcheck_module(Bound(m, dropout_seed=5 if training else None, **kwargs), (x,),
                              atol=1e-7, rtol=1e-5)
    assert report.ok and len(report.errors) == 1 + 6


def test_self_attention_state_dict_and_article_shapes():
    m = nn.SelfAttention(512, 64, rng=0)
    assert list(m.state_dict()) == ["W_Q.weight", "W_Q.bias", "W_K.weight", "W_K.bias",
                                    "W_V.weight", "W_V.bias"]
    assert m.W_Q.weight.shape == (64, 512)                   # the article's [d_k, d_model]
    x = np.random.default_rng(0).standard_normal((2, 5, 512)).astype(np.float32)
    out, weights = m(x)
    assert out.shape == (2, 5, 64) and weights.shape == (2, 5, 5)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-5)
    assert m.backward(np.ones_like(out)).shape == x.shape


def test_self_attention_fully_masked_row_gives_zeros():
    """npattn's contract: a query that may see no key gets a zero output row (PyTorch: NaN)."""
    m = nn.SelfAttention(4, 3, rng=0, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((3, 4))
    mask = np.ones((3, 3), bool)
    mask[1] = False                                          # query 1 sees nothing
    out, weights = m(x, mask)
    assert not out[1].any() and not weights[1].any() and out[[0, 2]].any()
    dx = m.backward(np.ones_like(out))
    assert np.isfinite(dx).all()


# ================================================================== Embedding

@st.composite
def embedding_cases(draw):
    dtype = draw(dtypes)
    n_rows, width = draw(st.integers(1, 12)), draw(dims(6))
    padding_idx = draw(st.none() | st.integers(-n_rows, n_rows - 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = draw(shapes(max_ndim=3, max_dim=6))
    indices = rng.integers(0, n_rows, size=shape)
    if indices.size and padding_idx is not None and draw(st.booleans()):
        indices.flat[0] = padding_idx % n_rows
    dout = make_values(rng, shape + (width,), dtype)
    return dtype, n_rows, width, padding_idx, indices, dout, int(rng.integers(2**32))


@given(case=embedding_cases())
def test_embedding_matches_torch(torch, case):
    dtype, n_rows, width, padding_idx, indices, dout, seed = case
    ours = nn.Embedding(n_rows, width, padding_idx, dtype=dtype, rng=seed)
    tm = torch.nn.Embedding(n_rows, width, padding_idx, dtype=torch.float64)
    assert ours.padding_idx == tm.padding_idx                 # stored non-negative, as torch
    state = random_state(ours, np.random.default_rng(seed), dtype)
    ours.load_state_dict(state)
    tm.load_state_dict(to_torch(torch, state))
    tout = tm(torch.tensor(indices))
    tout.backward(torch.tensor(f64(dout)[0]))
    out = ours(indices)
    np.testing.assert_array_equal(out, state["weight"][indices])   # a gather is exact
    assert out.dtype == dtype and ours.backward(dout) is None
    counts = np.bincount(indices.reshape(-1), minlength=n_rows)[:, None]
    scale = np.zeros((n_rows, width))
    np.add.at(scale, indices.reshape(-1), np.abs(f64(dout)[0]).reshape(indices.size, width))
    assert_close(ours.weight.grad, tm.weight.grad.numpy(), dtype=dtype, n=int(counts.max(
        initial=1)), scale=scale)
    if padding_idx is not None:
        assert not ours.weight.grad[padding_idx].any()


def test_embedding_initialisation_follows_pytorch():
    m = nn.Embedding(500, 64, padding_idx=-2, rng=0)
    assert m.padding_idx == 498 and not m.weight.data[498].any()
    w = np.delete(m.weight.data, 498, axis=0)
    assert abs(w.mean()) < 0.01 and abs(w.std() - 1) < 0.01   # N(0, 1)
    np.testing.assert_array_equal(m.weight.data, nn.Embedding(500, 64, -2, rng=0).weight.data)
    assert list(m.state_dict()) == ["weight"]


# ================================================================== PositionalEncoding

@given(d_model=st.integers(1, 33), max_len=st.integers(0, 60), dtype=dtypes)
def test_positional_encoding_table_is_the_formula(d_model, max_len, dtype):
    m = nn.PositionalEncoding(d_model, max_len, dropout=0.0, dtype=dtype)
    assert m.pe.shape == (1, max_len, d_model) and m.pe.dtype == dtype
    want = np.empty((max_len, d_model))
    for pos in range(max_len):
        for j in range(d_model):
            angle = pos / 10000 ** ((j - j % 2) / d_model)     # 2i = j rounded down to even
            want[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    # the angle pos·10000^(-2i/d) is computed another way, a few ulps of pos apart: sin and
    # cos move as much
    assert_close(m.pe[0], want, dtype=dtype, n=4, scale=np.arange(max_len)[:, None] + 1.0)


@given(dtype=dtypes, p=st.sampled_from([0.0, 0.1, 0.6]), seed=st.integers(0, 2**32 - 1),
       shape=st.sampled_from([(2, 5, 6), (5, 6), (1, 1, 6), (3, 0, 6)]))
def test_positional_encoding_adds_the_table_then_dropout(dtype, p, seed, shape):
    rng = np.random.default_rng(seed)
    m = nn.PositionalEncoding(6, 8, p, dtype=dtype, seed=seed)
    x, dout = make_values(rng, shape, dtype), make_values(rng, shape, dtype)
    summed = x + m.pe[0, :shape[-2]]
    drawn = first_seeds(seed)[0]
    out = m(x)
    if p == 0:
        np.testing.assert_array_equal(out, summed)
        np.testing.assert_array_equal(m.backward(dout), dout)
    else:
        np.testing.assert_array_equal(out, dropout_forward(summed, p, drawn))
        np.testing.assert_array_equal(m.backward(dout), dropout_backward(dout, p, drawn))
    m.eval()
    np.testing.assert_array_equal(m(x), summed)


def test_positional_encoding_state_and_limits():
    m = nn.PositionalEncoding(4, 10)
    assert list(m.state_dict()) == ["pe"] and m.parameters() == []
    with pytest.raises(ValueError, match=r"at most max_len = 10 positions.*got 11"):
        m(np.zeros((2, 11, 4), np.float32))
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, 4\).*got \(2, 3, 5\)"):
        m(np.zeros((2, 3, 5), np.float32))
    table = np.random.default_rng(0).standard_normal((1, 10, 4))
    m.load_state_dict({"pe": table})
    np.testing.assert_array_equal(m.pe, table.astype(np.float32))
    m.to(np.float64)
    assert m.pe.dtype == np.float64 and list(m.state_dict()) == ["pe"]
    assert m(np.zeros((1, 3, 4))).dtype == np.float64
    report = gradcheck_module(Bound(m.train(), dropout_seed=1), (np.ones((2, 3, 4)),))
    assert report.ok


# ================================================================== LayerNorm

@st.composite
def layer_norm_cases(draw):
    dtype = draw(dtypes)
    normalized = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    lead = draw(shapes(max_ndim=2, max_dim=4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = lay_out(make_values(rng, lead + normalized, dtype, draw(st.sampled_from(
        ["normal", "wide"]))), draw(layouts), rng)
    dout = make_values(rng, x.shape, dtype)
    as_int = len(normalized) == 1 and draw(st.booleans())
    return dict(dtype=dtype, x=x, dout=dout, shape=normalized[0] if as_int else normalized,
                affine=draw(st.booleans()), bias=draw(st.booleans()),
                eps=draw(st.sampled_from([1e-5, 1e-2])), seed=int(rng.integers(2**32)))


@given(case=layer_norm_cases())
def test_layer_norm_matches_torch(torch, case):
    dtype, x, dout = case["dtype"], case["x"], case["dout"]
    kw = dict(eps=case["eps"], elementwise_affine=case["affine"], bias=case["bias"])
    ours = nn.LayerNorm(case["shape"], **kw, dtype=dtype)
    tm = torch.nn.LayerNorm(case["shape"], **kw, dtype=torch.float64)
    assert list(ours.state_dict()) == list(tm.state_dict())
    state = random_state(ours, np.random.default_rng(case["seed"]), dtype)
    ours.load_state_dict(state)
    tm.load_state_dict(to_torch(torch, state))
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    tout = tm(tx)
    tout.backward(torch.tensor(f64(dout)[0]))
    out = ours(x)
    dx = ours.backward(dout)
    # magnitudes: x̂ = (x - μ)·rstd, |y| <= |x̂|·|w| + |b|; |dx| <= rstd·(|ĝ| + mean|ĝ| +
    # |x̂|·mean|ĝ x̂|) with ĝ = dout·w. Cancellation in x - μ costs |x|·rstd, and the rounding
    # of μ (and of σ², through rstd) mean|x|·rstd: in a row of 1e-4 ... 1.6e3 a small x̂ is off
    # by that much in any float64 implementation (this and PyTorch's differed by 170 eps of
    # the other terms' scale).
    dims_ = (case["shape"],) if isinstance(case["shape"], int) else case["shape"]
    axes = tuple(range(x.ndim - len(dims_), x.ndim))
    x64, g64 = f64(x, dout)
    width = math.prod(dims_)
    rstd = 1 / np.sqrt(x64.var(axis=axes, keepdims=True) + case["eps"])
    xhat = (np.abs(x64 - x64.mean(axis=axes, keepdims=True)) + np.abs(x64)
            + np.abs(x64).mean(axis=axes, keepdims=True)) * rstd
    w = np.abs(f64(state["weight"])[0]) if "weight" in state else 1.0
    b = np.abs(f64(state["bias"])[0]) if "bias" in state else 0.0
    ghat = np.abs(g64) * w
    assert_close(out, tout.detach().numpy(), dtype=dtype, n=width + 2, scale=xhat * w + b)
    dx_scale = rstd * (ghat + ghat.mean(axis=axes, keepdims=True)
                       + xhat * (ghat * xhat).mean(axis=axes, keepdims=True))
    assert_close(dx, tx.grad.numpy(), dtype=dtype, n=2 * width + 4, scale=dx_scale)
    rows = math.prod(x.shape[:len(x.shape) - len(dims_)])
    lead = tuple(range(x.ndim - len(dims_)))
    for name, param in tm.named_parameters():
        scale = (np.abs(g64) * xhat if name == "weight" else np.abs(g64)).sum(axis=lead)
        assert_close(dict(ours.named_parameters())[name].grad, param.grad.numpy(), dtype=dtype,
                     n=rows + width + 2, scale=scale)


def test_layer_norm_parameters_follow_pytorch():
    m = nn.LayerNorm((2, 3))
    assert list(m.state_dict()) == ["weight", "bias"] and m.weight.data.dtype == np.float32
    np.testing.assert_array_equal(m.weight.data, np.ones((2, 3)))
    np.testing.assert_array_equal(m.bias.data, np.zeros((2, 3)))
    assert list(nn.LayerNorm(4, bias=False).state_dict()) == ["weight"]
    plain = nn.LayerNorm(4, elementwise_affine=False)
    assert plain.parameters() == [] and plain.weight is None and plain.bias is None
    x = np.random.default_rng(0).standard_normal((3, 4))     # any float dtype without params
    y = plain(x)
    assert y.dtype == np.float64 and np.allclose(y.mean(-1), 0) and np.allclose(y.std(-1), 1,
                                                                               rtol=1e-4)
    assert plain.backward(np.ones_like(x)).shape == x.shape


def test_layer_norm_gradients_match_central_differences():
    rng = np.random.default_rng(0)
    m = nn.LayerNorm((2, 3), dtype=np.float64)
    m.load_state_dict(random_state(m, rng, np.float64))
    report = gradcheck_module(m, (rng.standard_normal((4, 2, 3)),), atol=1e-7, rtol=1e-5)
    assert report.ok and len(report.errors) == 3


# ================================================================== initialisers

def test_initialisers_follow_pytorch_formulas(torch):
    init = nn.init
    for nonlinearity, param in [("linear", None), ("sigmoid", None), ("tanh", None),
                                ("relu", None), ("leaky_relu", None), ("leaky_relu", 0.2),
                                ("selu", None), ("conv2d", None)]:
        assert init.calculate_gain(nonlinearity, param) == pytest.approx(
            torch.nn.init.calculate_gain(nonlinearity, param))
    for shape in [(5, 3), (4, 3, 2), (6, 2, 3, 3)]:
        assert init.fan_in_and_fan_out(shape) == \
            torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    shape = (300, 200)
    fan_in, fan_out = 200, 300
    cases = [(init.xavier_uniform(shape, 2.0, rng=0), "uniform", 2 * math.sqrt(6 / 500)),
             (init.xavier_normal(shape, rng=0), "normal", math.sqrt(2 / 500)),
             (init.kaiming_uniform(shape, a=math.sqrt(5), rng=0), "uniform",
              1 / math.sqrt(fan_in)),
             (init.kaiming_uniform(shape, mode="fan_out", nonlinearity="relu", rng=0),
              "uniform", math.sqrt(2) * math.sqrt(3 / fan_out)),
             (init.kaiming_normal(shape, nonlinearity="relu", rng=0), "normal",
              math.sqrt(2 / fan_in))]
    for w, kind, width in cases:                              # width: bound or std
        assert w.shape == shape and w.dtype == np.float32
        if kind == "uniform":
            assert np.abs(w).max() <= width and np.abs(w).max() > 0.99 * width
            assert abs(w.std() - width / math.sqrt(3)) < 0.02 * width
        else:
            assert abs(w.std() - width) < 0.02 * width and abs(w.mean()) < 0.02 * width
    np.testing.assert_array_equal(init.xavier_uniform((0, 3)), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="at least 2 dims"):
        init.xavier_uniform((5,))
    with pytest.raises(ValueError, match="mode must be 'fan_in' or 'fan_out'"):
        init.kaiming_uniform((2, 2), mode="fan")
    with pytest.raises(ValueError, match="nonlinearity"):
        init.calculate_gain("swish")


# ================================================================== Module bookkeeping

class Block(nn.Module):
    """A small model touching every module: Embedding, PositionalEncoding, SelfAttention,
    MultiheadAttention, LayerNorm, Dropout, Linear."""

    def __init__(self, rng, seed=0, dtype=np.float32):
        super().__init__()
        self.embed = nn.Embedding(11, 8, padding_idx=0, dtype=dtype, rng=rng)
        self.pos = nn.PositionalEncoding(8, 16, 0.1, dtype=dtype, seed=seed)
        self.head = nn.SelfAttention(8, 8, dropout=0.1, dtype=dtype, rng=rng, seed=seed + 1)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True, dtype=dtype,
                                         rng=rng, seed=seed + 2)
        self.norm = nn.LayerNorm(8, dtype=dtype)
        self.out = nn.Sequential(nn.Dropout(0.2, seed=seed + 3), nn.Linear(8, 5, dtype=dtype,
                                                                           rng=rng))

    def forward(self, tokens):
        x = self.pos(self.embed(tokens))
        h, _ = self.head(x)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.out(self.norm(a))

    def backward(self, dout):
        da = self.norm.backward(self.out.backward(dout))
        dh = sum(self.mha.backward(da))
        self.embed.backward(self.pos.backward(self.head.backward(dh)))


TOKENS = np.random.default_rng(0).integers(0, 11, size=(2, 6))


def test_state_dict_round_trip_reproduces_the_model_bitwise():
    a, b = Block(np.random.default_rng(0)), Block(np.random.default_rng(1))
    a.eval(), b.eval()
    state = a.state_dict()
    assert list(state) == [k for k, _ in a.named_parameters()] + ["pos.pe"]
    assert not np.array_equal(a(TOKENS), b(TOKENS))
    missing, unexpected = b.load_state_dict(state)
    assert missing == [] and unexpected == []
    np.testing.assert_array_equal(a(TOKENS), b(TOKENS))
    state["out.1.weight"][...] = 0                            # state_dict holds copies
    assert a.out[1].weight.data.any()


def test_load_state_dict_errors_name_the_key():
    m = Block(np.random.default_rng(0))
    before = m.state_dict()
    state = m.state_dict()
    del state["norm.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['norm.bias'\]"):
        m.load_state_dict(state)
    state = m.state_dict()
    state["extra.weight"] = np.zeros(2)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra.weight'\]"):
        m.load_state_dict(state)
    state = {k: np.zeros_like(v) for k, v in m.state_dict().items()}
    state["mha.in_proj_weight"] = np.zeros((24, 7))
    with pytest.raises(ValueError, match=r"state_dict\['mha.in_proj_weight'\] must have shape "
                                         r"\(24, 8\); got \(24, 7\)"):
        m.load_state_dict(state)
    for k, v in m.state_dict().items():                      # a failed load changes nothing
        np.testing.assert_array_equal(v, before[k])
    state = {"out.1.bias": np.ones(5), "nope": np.ones(1)}
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert unexpected == ["nope"] and "out.1.weight" in missing
    np.testing.assert_array_equal(m.out[1].bias.data, np.ones(5))


def test_train_and_eval_reach_every_module():
    m = Block(np.random.default_rng(0))
    assert all(sub.training for _, sub in m.named_modules())
    m.eval()
    assert not any(sub.training for _, sub in m.named_modules())
    first, again = m(TOKENS), m(TOKENS)
    np.testing.assert_array_equal(first, again)               # no dropout in eval mode
    m.train()
    assert all(sub.training for _, sub in m.named_modules())
    assert not np.array_equal(m(TOKENS), m(TOKENS))           # a fresh mask per forward


def test_same_seeds_give_bitwise_the_same_training_run():
    runs = []
    for _ in range(2):
        m = Block(np.random.default_rng(4), seed=9)
        outs = []
        for _ in range(2):
            y = m(TOKENS)
            m.zero_grad()
            m.backward(np.ones_like(y))
            outs += [y] + [p.grad.copy() for p in m.parameters()]
        runs.append(outs)
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_zero_grad_and_accumulation_over_two_backward_calls():
    m = Block(np.random.default_rng(0), dtype=np.float64).eval()
    rng = np.random.default_rng(1)
    d1, d2 = rng.standard_normal((2, 2, 6, 5))
    single = []
    for d in (d1, d2):
        m.zero_grad()
        m(TOKENS)
        m.backward(d)
        single.append([p.grad.copy() for p in m.parameters()])
    m.zero_grad()
    assert not any(p.grad.any() for p in m.parameters())
    m(TOKENS)
    m.backward(d1)
    m(TOKENS)
    m.backward(d2)
    for p, a, b in zip(m.parameters(), *single):
        np.testing.assert_allclose(p.grad, a + b, rtol=1e-12, atol=1e-14)


def test_sequential_runs_forward_in_order_and_backward_in_reverse():
    rng = np.random.default_rng(0)
    layers = [nn.Linear(4, 6, rng=rng, dtype=np.float64), nn.LayerNorm(6, dtype=np.float64),
              nn.Dropout(0.3, seed=0), nn.Linear(6, 3, rng=rng, dtype=np.float64)]
    seq = nn.Sequential(*layers).eval()
    assert len(seq) == 4 and seq[3] is layers[3] and list(seq) == layers
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight",
                                      "3.bias"]
    x = rng.standard_normal((5, 4))
    manual = x
    for layer in layers:
        manual = layer(manual)
    np.testing.assert_array_equal(seq(x), manual)
    dout = rng.standard_normal((5, 3))
    manual_dx = dout
    for layer in reversed(layers):
        manual_dx = layer.backward(manual_dx)
    np.testing.assert_array_equal(seq.backward(dout), manual_dx)
    assert gradcheck_module(seq, (x,), atol=1e-7, rtol=1e-5).ok
    assert gradcheck_module(Bound(seq.train(), dropout_seed=2), (x,), atol=1e-7, rtol=1e-5).ok
    with pytest.raises(TypeError, match="Sequential argument 1 must be a Module; got int"):
        nn.Sequential(layers[0], 3)


def test_to_float64_casts_parameters_buffers_and_inputs_follow():
    m = Block(np.random.default_rng(0)).to(np.float64)
    assert all(p.data.dtype == np.float64 == p.grad.dtype for p in m.parameters())
    assert m.pos.pe.dtype == np.float64 and "pos.pe" in m.state_dict()
    y = m(TOKENS)
    assert y.dtype == np.float64
    m.backward(np.ones_like(y))
    with pytest.raises(TypeError, match="x must have dtype float32 to match Linear's"):
        nn.Linear(2, 2)(np.ones((1, 2)))


def test_reassigning_a_buffer_keeps_it_a_buffer():
    m = nn.PositionalEncoding(4, 5)
    m.pe = np.zeros((1, 5, 4), np.float32)
    assert "pe" in m.state_dict() and not m.state_dict()["pe"].any()


@pytest.mark.parametrize("module", [
    nn.Linear(2, 3), nn.Dropout(), nn.SelfAttention(2, 2), nn.MultiheadAttention(2, 1),
    nn.Embedding(3, 2), nn.PositionalEncoding(2, 4), nn.LayerNorm(2), nn.GELU(),
    nn.RotaryEmbedding(2, 4)],
    ids=lambda m: type(m).__name__)
def test_backward_before_forward_is_a_runtime_error(module):
    with pytest.raises(RuntimeError, match=f"{type(module).__name__}.backward was called before "
                                           "forward"):
        module.backward(np.ones((1, 2), np.float32))
    assert repr(module).startswith(type(module).__name__)


# ================================================================== bad arguments

@pytest.mark.parametrize("make, error, words", [
    (lambda: nn.Linear(-1, 2), ValueError, ["in_features", ">= 0", "-1"]),
    (lambda: nn.Linear(2, 2.5), TypeError, ["out_features", "int", "float"]),
    (lambda: nn.Linear(2, 2, bias="yes"), TypeError, ["bias", "bool", "str"]),
    (lambda: nn.Linear(2, 2, dtype=np.int32), TypeError, ["dtype", "int32"]),
    (lambda: nn.Linear(2, 2, rng=1.5), TypeError, ["rng", "float"]),
    (lambda: nn.Dropout(-0.1), ValueError, ["p", "[0, 1]", "-0.1"]),
    (lambda: nn.Dropout("0.5"), TypeError, ["p", "str"]),
    (lambda: nn.Dropout(0.5, seed="s"), TypeError, ["seed", "str"]),
    (lambda: nn.SelfAttention(0, 2), ValueError, ["d_model", ">= 1", "0"]),
    (lambda: nn.SelfAttention(4, 2, d_v=0), ValueError, ["d_v", ">= 1"]),
    (lambda: nn.SelfAttention(4, 2, dropout=2), ValueError, ["dropout", "[0, 1]"]),
    (lambda: nn.Embedding(5, 2, padding_idx=5), ValueError, ["padding_idx", "[-5, 5)", "5"]),
    (lambda: nn.Embedding(5, 2, padding_idx=1.0), TypeError, ["padding_idx", "float"]),
    (lambda: nn.Embedding(5, -2), ValueError, ["embedding_dim", ">= 0", "-2"]),
    (lambda: nn.PositionalEncoding(0), ValueError, ["d_model", ">= 1"]),
    (lambda: nn.PositionalEncoding(4, max_len=-1), ValueError, ["max_len", "-1"]),
    (lambda: nn.PositionalEncoding(4, dropout=1.5), ValueError, ["dropout", "1.5"]),
    (lambda: nn.LayerNorm(()), ValueError, ["normalized_shape", "at least one dim"]),
    (lambda: nn.LayerNorm(4, eps=-1e-5), ValueError, ["eps", ">= 0"]),
    (lambda: nn.LayerNorm(4, eps="small"), TypeError, ["eps", "str"]),
    (lambda: nn.LayerNorm(4, elementwise_affine=None), TypeError, ["elementwise_affine"]),
    (lambda: nn.GELU("exact"), ValueError, ["approximate", "('none', 'tanh')", "'exact'"]),
    (lambda: nn.GELU(None), ValueError, ["approximate", "None"]),
    (lambda: nn.RotaryEmbedding(5, 8), ValueError, ["dim", "even", "5"]),
    (lambda: nn.RotaryEmbedding(4, 8, base=-1), ValueError, ["base", "> 0", "-1"]),
    (lambda: nn.RotaryEmbedding(4, 8, interleaved="no"), TypeError, ["interleaved", "bool"]),
    (lambda: nn.ModuleList([nn.Linear(2, 2), 3]), TypeError, ["modules[1]", "Module", "int"]),
    (lambda: nn.ModuleList(nn.Linear(2, 2)), TypeError, ["modules", "iterable", "Linear"]),
    (lambda: nn.ModuleList(5), TypeError, ["modules", "iterable", "int"]),
])
def test_constructors_reject_bad_arguments(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


F32 = np.ones((2, 3, 4), np.float32)


@pytest.mark.parametrize("module, args, kwargs, error, words", [
    (nn.Linear(4, 2), (F32[..., :3],), {}, ValueError, ["x", "(..., 4)", "(2, 3, 3)"]),
    (nn.Linear(4, 2), (F32.astype(np.float64),), {}, TypeError, ["x", "float32", "float64"]),
    (nn.Linear(4, 2), (np.ones(4, np.int64),), {}, TypeError, ["x", "int64"]),
    (nn.Dropout(), (np.ones(3, bool),), {}, TypeError, ["x", "bool"]),
    (nn.SelfAttention(4, 2), (F32[..., :3],), {}, ValueError, ["x", "d_model", "(2, 3, 3)"]),
    (nn.SelfAttention(4, 2), (F32,), dict(mask=np.ones((3, 2), bool)), ValueError,
     ["mask", "(2, 3, 3)", "(3, 2)"]),
    (nn.SelfAttention(4, 2), (F32,), dict(mask=np.ones((3, 3), np.int8)), TypeError,
     ["mask", "int8"]),
    (nn.Embedding(5, 2), (np.array([1.0, 2.0]),), {}, TypeError, ["indices", "float64"]),
    (nn.Embedding(5, 2), (np.array([[1, 5]]),), {}, ValueError, ["indices", "[0, 5)", "5"]),
    (nn.Embedding(5, 2), (np.array([-1]),), {}, ValueError, ["indices", "-1"]),
    (nn.PositionalEncoding(4, 2), (F32,), {}, ValueError, ["max_len = 2", "3"]),
    (nn.PositionalEncoding(4, 8), (F32[0, 0],), {}, ValueError, ["x", "(B, L, 4)", "(4,)"]),
    (nn.LayerNorm(5), (F32,), {}, ValueError, ["x", "(..., 5)", "(2, 3, 4)"]),
    (nn.LayerNorm(4), (F32.astype(np.float64),), {}, TypeError, ["x", "float32", "float64"]),
    (nn.GELU(), (np.ones(3, np.int32),), {}, TypeError, ["x", "int32"]),
    (nn.RotaryEmbedding(4, 2), (F32,), {}, ValueError, ["offset + L", "max_len = 2", "3"]),
    (nn.RotaryEmbedding(4, 8), (F32,), dict(offset=6), ValueError, ["offset", "9"]),
    (nn.RotaryEmbedding(6, 8), (F32,), {}, ValueError, ["x", "(..., L, 6)", "(2, 3, 4)"]),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None)
def test_forward_rejects_bad_arguments(module, args, kwargs, error, words):
    with pytest.raises(error) as info:
        module(*args, **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("module, x, bad, words", [
    (nn.Linear(4, 2), F32, np.ones((2, 3, 3), np.float32), ["dout", "(2, 3, 2)"]),
    (nn.Dropout(0.5, seed=0), F32, F32[0], ["dout", "(2, 3, 4)", "(3, 4)"]),
    (nn.SelfAttention(4, 2), F32, F32, ["dout", "(2, 3, 2)", "(2, 3, 4)"]),
    (nn.Embedding(5, 4), np.array([[1, 2, 3]]), F32, ["dout", "(1, 3, 4)", "(2, 3, 4)"]),
    (nn.LayerNorm(4), F32, F32[0], ["dout", "(2, 3, 4)", "(3, 4)"]),
    (nn.GELU(), F32, F32[0], ["dout", "(2, 3, 4)", "(3, 4)"]),
    (nn.RotaryEmbedding(4, 8), F32, F32[:, :2], ["dout", "(..., 3, 4)", "(2, 2, 4)"]),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None)
def test_backward_rejects_a_mismatched_dout(module, x, bad, words):
    module(x)
    with pytest.raises(ValueError) as info:
        module.backward(bad)
    for word in words:
        assert word in str(info.value)


def test_subpackages_are_attributes_after_import_npattn_and_load_only_when_used():
    """``import npattn`` then ``npattn.nn.Linear``, as with ``torch.nn``; the import itself
    does not load them (fresh interpreter: this process has them loaded already)."""
    import subprocess
    import sys
    code = ("import sys, npattn\n"
            "print(sorted(m for m in ('npattn.nn', 'npattn.optim', 'npattn.gradcheck')"
            " if m in sys.modules))\n"
            "layer = npattn.nn.Linear(3, 2)\n"
            "opt = npattn.optim.SGD(layer.parameters(), lr=0.1)\n"
            "print(type(layer).__name__, type(opt).__name__, callable(npattn.gradcheck.gradcheck))\n"
            "try:\n    npattn.no_such_thing\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "Linear SGD True", "module 'npattn' has no attribute 'no_such_thing'"]



# ================================================================== GELU

@given(dtype=dtypes, shape=shapes(max_ndim=3, max_dim=5), approximate=st.sampled_from(
    ["none", "tanh"]), seed=st.integers(0, 2**32 - 1), layout=layouts)
def test_gelu_module_matches_torch(torch, dtype, shape, approximate, seed, layout):
    rng = np.random.default_rng(seed)
    x = lay_out(make_values(rng, shape, dtype, "wide"), layout, rng)
    dout = make_values(rng, shape, dtype)
    m = nn.GELU(approximate)
    tm = torch.nn.GELU(approximate)
    assert m.parameters() == [] and list(m.state_dict()) == list(tm.state_dict()) == []
    assert repr(m) == repr(tm)
    tx = torch.tensor(f64(x)[0], requires_grad=True)
    ty = tm(tx)
    ty.backward(torch.tensor(f64(dout)[0]))
    y = m(x)
    dx = m.backward(dout)
    x64, d64 = abs64(x, dout)
    assert_close(y, ty.detach().numpy(), dtype=dtype, n=2, scale=x64)
    assert_close(dx, tx.grad.numpy(), dtype=dtype, n=4, scale=d64 * (1 + x64))
    # exactly the functional pair, on forward's x
    np.testing.assert_array_equal(y, __import__("npattn").gelu(x, approximate))
    np.testing.assert_array_equal(dx, __import__("npattn").gelu_backward(dout, x, approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_module_gradients_match_central_differences(approximate):
    rng = np.random.default_rng(1)
    report = gradcheck_module(nn.GELU(approximate), (rng.standard_normal((3, 4)) * 2,),
                              atol=1e-8, rtol=1e-6)
    assert report.ok, report


def test_gelu_module_backward_pairs_with_the_last_forward():
    m = nn.GELU()
    a, b = np.linspace(-3, 3, 6), np.linspace(2, -4, 6)
    m(a)
    m(b)
    np.testing.assert_array_equal(m.backward(np.ones(6)),
                                  __import__("npattn").gelu_backward(np.ones(6), b))


# ================================================================== ModuleList

class TorchStyleBlock(nn.Module):
    """A GPT block's names: ln_1, attn.c_attn, ln_2, mlp.c_fc, mlp.gelu, mlp.c_proj."""

    def __init__(self, width, rng, lib=nn, **kw):
        super().__init__() if lib is nn else None
        self.ln_1 = lib.LayerNorm(width, **kw)
        self.mlp = lib.Sequential(lib.Linear(width, 4 * width, **rng), lib.GELU("tanh"),
                                  lib.Linear(4 * width, width, **rng))
        self.ln_2 = lib.LayerNorm(width, **kw)


def gpt_like(width=3, layers=2, dtype=np.float64):
    """A model whose names are GPT-2's: h.0.ln_1.weight, ..., ln_f.bias."""
    model = nn.Module()
    model.h = nn.ModuleList([TorchStyleBlock(width, dict(rng=i, dtype=dtype), dtype=dtype)
                             for i in range(layers)])
    model.ln_f = nn.LayerNorm(width, dtype=dtype)
    return model


def test_module_list_names_parameters_as_pytorch(torch):
    """The same structure in PyTorch gives the same keys, in the same order, and a PyTorch
    state_dict (as NumPy arrays) loads and comes back bitwise."""
    ours = gpt_like()

    class TorchBlock(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(width)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU("tanh"),
                                           torch.nn.Linear(4 * width, width))
            self.ln_2 = torch.nn.LayerNorm(width)

    theirs = torch.nn.Module()
    theirs.h = torch.nn.ModuleList([TorchBlock(3) for _ in range(2)])
    theirs.ln_f = torch.nn.LayerNorm(3)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict())[:3] == ["h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.mlp.0.weight"]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    assert ours.load_state_dict(state) == ([], [])
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(v, state[k])
    assert repr(ours.h).startswith("ModuleList(\n  (0): TorchStyleBlock(")


def test_module_list_is_a_list():
    blocks = [nn.Linear(2, 2, rng=i, dtype=np.float64) for i in range(5)]
    ml = nn.ModuleList(blocks[:3])
    assert len(ml) == 3 and list(ml) == blocks[:3]
    assert ml[0] is blocks[0] and ml[-1] is blocks[2] and ml[np.int64(1)] is blocks[1]
    part = ml[1:]
    assert isinstance(part, nn.ModuleList) and list(part) == blocks[1:3]
    assert list(part.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert ml.append(blocks[3]) is ml and ml[3] is blocks[3]
    ml.extend([blocks[4]])
    assert list(ml) == blocks and list(ml._modules) == ["0", "1", "2", "3", "4"]
    del ml[1]                                    # the later ones are renumbered, as PyTorch
    assert list(ml) == [blocks[0]] + blocks[2:]
    assert list(ml._modules) == ["0", "1", "2", "3"] and not hasattr(ml, "4")
    assert getattr(ml, "1") is blocks[2]
    ml.insert(1, blocks[1])
    assert list(ml) == blocks
    ml.insert(100, nn.GELU())                    # as list.insert: clamped to the end
    assert isinstance(ml[5], nn.GELU)
    assert isinstance(ml.pop(), nn.GELU) and len(ml) == 5
    assert ml.pop(0) is blocks[0] and list(ml) == blocks[1:]
    ml[0] = blocks[0]
    assert ml[0] is blocks[0] and blocks[1] not in list(ml)
    del ml[1:3]
    assert list(ml) == [blocks[0], blocks[4]]
    ml += nn.ModuleList([blocks[2]])
    both = ml + nn.ModuleList([blocks[3]])
    assert list(both) == [blocks[0], blocks[4], blocks[2], blocks[3]] and len(ml) == 3
    assert list(nn.ModuleList()) == [] and len(nn.ModuleList(None)) == 0
    assert list(nn.ModuleList(nn.Sequential(*blocks[:2]))) == blocks[:2]   # its children
    assert list(nn.ModuleList(b for b in blocks[:2])) == blocks[:2]       # any iterable


def test_module_list_errors():
    ml = nn.ModuleList([nn.GELU(), nn.GELU()])
    for bad in (2, -3):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for a ModuleList "
                                             "of 2 modules"):
            ml[bad]
    with pytest.raises(TypeError, match="index must be an int or a slice; got str"):
        ml["0"]
    with pytest.raises(TypeError, match="index must be an int or a slice; got bool"):
        ml[True]
    with pytest.raises(TypeError, match="module must be a Module; got ufunc"):
        ml.append(np.tanh)
    with pytest.raises(TypeError, match="module must be a Module; got int"):
        ml[0] = 3
    with pytest.raises(TypeError, match=r"modules\[1\] must be a Module; got str"):
        ml.extend([nn.GELU(), "GELU"])
    assert len(ml) == 2                          # nothing of a refused extend was added
    with pytest.raises(TypeError, match="index must be an int; got float"):
        ml.insert(1.0, nn.GELU())
    with pytest.raises(NotImplementedError, match="ModuleList has no forward"):
        ml(np.ones(2))
    with pytest.raises(NotImplementedError, match="ModuleList has no backward"):
        ml.backward(np.ones(2))


def test_module_list_reaches_train_eval_to_zero_grad_and_gradients_flow():
    """The container's children are ordinary submodules: train/eval, to, zero_grad reach them,
    and a model that loops over the list trains (its backward loops in reverse)."""
    model = gpt_like(dtype=np.float32)
    model.eval()
    assert not any(m.training for _, m in model.named_modules())
    model.to(np.float64)
    assert all(p.data.dtype == np.float64 for p in model.parameters())

    class Loop(nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

        def backward(self, dout):
            for block in reversed(list(self.blocks)):
                dout = block.backward(dout)
            return dout

    rng = np.random.default_rng(0)
    blocks = nn.ModuleList([nn.Linear(3, 3, rng=i, dtype=np.float64) for i in range(2)])
    blocks.insert(1, nn.GELU())
    loop = Loop(blocks)
    assert [n for n, _ in loop.named_parameters()] == ["blocks.0.weight", "blocks.0.bias",
                                                      "blocks.2.weight", "blocks.2.bias"]
    assert gradcheck_module(loop, (rng.standard_normal((4, 3)),), atol=1e-7, rtol=1e-5).ok
    loop.zero_grad()
    assert not any(p.grad.any() for p in loop.parameters())


def test_no_saving_keeps_what_the_last_saving_forward_saved():
    """Inside nn.module.no_saving() a forward saves nothing: a backward pairs with the last
    forward outside it (or fails as before any forward); the flag nests and resets."""
    from npattn.nn.module import no_saving
    lin = nn.Linear(3, 2, dtype=np.float64, rng=0)
    with no_saving():
        lin(np.ones((4, 3)))
    with pytest.raises(RuntimeError, match="before forward"):
        lin.backward(np.ones((4, 2)))
    x = np.arange(6.0).reshape(2, 3)
    lin(x)
    with no_saving():
        with no_saving():
            pass
        lin(np.ones((5, 3)))                                # dropped: x stays saved
    lin.backward(np.ones((2, 2)))
    np.testing.assert_array_equal(lin.weight.grad, np.ones((2, 2)).T @ x)
    lin(np.ones((1, 3)))                                    # saving again after the context
    assert lin._saved.shape == (1, 3)
