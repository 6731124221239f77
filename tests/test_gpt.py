"""npattn.models.GPT against nanoGPT's model written from torch.nn parts.

The PyTorch model (``benchmarks/torch_gpt.py::torch_gpt``, the one copy, which the benchmark
times as npattn's peer) is nanoGPT's ``model.py`` architecture: Embedding wte and wpe,
pre-LayerNorm blocks with an optional-bias LayerNorm, one c_attn Linear split into q, k, v,
``F.scaled_dot_product_attention(is_causal=True)``, exact ``F.gelu``, lm_head tied to wte --
torch.nn and torch.nn.functional only, no npattn code
(``test_the_oracle_is_independent_of_npattn``). Both models get the same weights through the
state_dict; logits, loss and every parameter's gradient must agree: float64 to ~1e-10
relative, float32 within a small multiple of PyTorch's own float32 error (both measured
against the float64 truth). Generation, the KV cache, bad input and a short AdamW run are
checked too. Sizes are tiny and odd on purpose.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from benchmarks.torch_gpt import torch_gpt
from npattn import optim
from npattn.models import GPT, GPTConfig

F64 = 1e-10                             # float64: relative to the array's largest entry
F32_FACTOR, F32_FLOOR = 8.0, 2e-6       # float32: <= 8x PyTorch's float32 error (+ a floor)
SMALL = GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=3, n_embd=24)


def test_the_oracle_is_independent_of_npattn():
    """The PyTorch model imports nothing (torch is passed in), so no npattn code can leak into
    the oracle through it."""
    import ast
    import pathlib
    import benchmarks.torch_gpt
    tree = ast.parse(pathlib.Path(benchmarks.torch_gpt.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == []


def random_state(model, rng):
    """Weights far from the init (so that every path carries signal): N(0, 0.3²) everywhere,
    LayerNorm weights 1 + N(0, 0.1²); the tied weight under both of its names."""
    state = {}
    for name, array in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if ".ln_" in name and name.endswith("weight"):
            state[name] = 1.0 + 0.1 * rng.standard_normal(array.shape)
        else:
            state[name] = 0.3 * rng.standard_normal(array.shape)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def to_torch(torch, state, dtype):
    return {k: torch.tensor(np.asarray(v, dtype)) for k, v in state.items()}


def torch_model(torch, cfg, state, dtype):
    model = torch_gpt(torch, cfg)
    model.load_state_dict(to_torch(torch, state, np.float64))
    return model.float() if dtype == np.float32 else model


def batch(rng, cfg, b, t, ignored=0.0):
    idx = rng.integers(0, cfg.vocab_size, size=(b, t))
    targets = rng.integers(0, cfg.vocab_size, size=(b, t))
    targets[rng.random((b, t)) < ignored] = -1
    targets[0, 0] = max(targets[0, 0], 0)                 # one counted target: a finite loss
    return idx, targets


def run_npattn(cfg, state, dtype, idx, targets, training):
    model = GPT(cfg, dtype=dtype, rng=0, seed=0)
    model.load_state_dict(state)
    model.train(training)
    model.zero_grad()
    logits, loss = model(idx, targets)
    model.backward()
    grads = {name: p.grad.copy() for name, p in model.named_parameters()}
    return logits, float(loss), grads


def run_torch(torch, cfg, state, dtype, idx, targets, training):
    model = torch_model(torch, cfg, state, dtype)
    model.train(training)
    logits, loss = model(torch.tensor(idx), torch.tensor(targets))
    loss.backward()
    grads = {name: p.grad.double().numpy() for name, p in model.named_parameters()}
    return logits.detach().double().numpy(), float(loss.detach()), grads


def rel(a, truth, floor=1e-2):
    """The largest error relative to the largest entry of truth, or to ``floor`` when that is
    smaller (n_embd = 1: every LayerNorm output is its bias, and the gradients are rounding
    noise around 0)."""
    scale = max(float(np.max(np.abs(truth))), floor)
    return float(np.max(np.abs(np.asarray(a, np.float64) - truth)) / scale)


def assert_parity(torch, cfg, seed, b, t, training, ignored=0.0):
    """npattn and PyTorch from the same weights: float64 to F64, float32 within F32_FACTOR of
    PyTorch's float32 error (both against PyTorch's float64)."""
    rng = np.random.default_rng(seed)
    state = random_state(GPT(cfg, dtype=np.float64, rng=0), rng)
    idx, targets = batch(rng, cfg, b, t, ignored)
    truth = run_torch(torch, cfg, state, np.float64, idx, targets, training)
    ours = run_npattn(cfg, state, np.float64, idx, targets, training)
    assert set(ours[2]) == set(truth[2])
    assert rel(ours[0], truth[0]) < F64
    assert rel(ours[1], truth[1]) < F64
    for name in truth[2]:
        assert rel(ours[2][name], truth[2][name]) < F64, name
    ours32 = run_npattn(cfg, state, np.float32, idx, targets, training)
    torch32 = run_torch(torch, cfg, state, np.float32, idx, targets, training)
    for what, got, peer, want in (("logits", ours32[0], torch32[0], truth[0]),
                                  ("loss", ours32[1], torch32[1], truth[1]),
                                  *((name, ours32[2][name], torch32[2][name], truth[2][name])
                                    for name in truth[2])):
        bound = F32_FACTOR * rel(peer, want) + F32_FLOOR
        assert rel(got, want) <= bound, (what, rel(got, want), rel(peer, want))


# ------------------------------------------------------------------ parity with PyTorch

@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_logits_loss_and_every_gradient_match_pytorch(torch, bias, training):
    cfg = GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=3, n_embd=24, bias=bias)
    assert_parity(torch, cfg, seed=1, b=2, t=5, training=training, ignored=0.2)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), n_layer=st.integers(1, 2), n_head=st.integers(1, 3),
       head_size=st.integers(1, 5), vocab=st.integers(2, 41), block=st.integers(1, 9),
       data=st.data())
def test_odd_sizes_match_pytorch(torch, seed, n_layer, n_head, head_size, vocab, block, data):
    """Any small shape: T <= block_size, vocab and widths that are multiples of nothing."""
    cfg = GPTConfig(block_size=block, vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                    n_embd=n_head * head_size, bias=data.draw(st.booleans(), "bias"))
    t = data.draw(st.integers(1, block), "T")
    b = data.draw(st.integers(1, 3), "B")
    assert_parity(torch, cfg, seed, b, t, training=data.draw(st.booleans(), "training"),
                  ignored=0.25)


def test_dlogits_backward_matches_pytorch(torch):
    """backward(dlogits): the gradient of a downstream loss given at the logits."""
    rng = np.random.default_rng(3)
    state = random_state(GPT(SMALL, dtype=np.float64, rng=0), rng)
    idx, _ = batch(rng, SMALL, 2, 6)
    dlogits = rng.standard_normal((2, 6, SMALL.vocab_size))
    model = GPT(SMALL, dtype=np.float64, rng=0)
    model.load_state_dict(state)
    logits, loss = model(idx)
    assert loss is None
    model.backward(dlogits)
    peer = torch_model(torch, SMALL, state, np.float64)
    want, _ = peer(torch.tensor(idx))
    want.backward(torch.tensor(dlogits))
    assert rel(logits, want.detach().numpy()) < F64
    for name, p in peer.named_parameters():
        assert rel(dict(model.named_parameters())[name].grad, p.grad.numpy()) < F64, name


def test_gradients_accumulate_over_backwards(torch):
    """Two forward/backward pairs without zero_grad add up, as loss.backward() twice does."""
    rng = np.random.default_rng(4)
    model = GPT(SMALL, dtype=np.float64, rng=1)
    first, second = batch(rng, SMALL, 2, 4), batch(rng, SMALL, 1, 7)
    expected = {}
    for idx, targets in (first, second):
        model.zero_grad()
        model(idx, targets)
        model.backward()
        for name, p in model.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad
    model.zero_grad()
    for idx, targets in (first, second):
        model(idx, targets)
        model.backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, expected[name], rtol=1e-12, atol=1e-15)


def reseed(model, seed):
    """Reset every dropout generator of the model, so that the next forward draws the same
    masks again (the dropout seeds are the generators' next draws)."""
    for i, (_, module) in enumerate(model.named_modules()):
        if "_generator" in module.__dict__:
            module._generator = np.random.default_rng([seed, i])


def test_dropout_gradient_is_the_directional_derivative():
    """With dropout 0.3 everywhere (embeddings, attention, both residual branches) and the
    masks held fixed, <grad, D> equals the central difference of the loss along a random D."""
    cfg = GPTConfig(block_size=6, vocab_size=13, n_layer=2, n_head=2, n_embd=8, dropout=0.3)
    rng = np.random.default_rng(5)
    model = GPT(cfg, dtype=np.float64, rng=2, seed=3)
    model.load_state_dict(random_state(model, rng))
    idx, targets = batch(rng, cfg, 2, 6)
    reseed(model, 7)
    logits, loss = model(idx, targets)
    model.eval()
    assert not np.allclose(model(idx)[0], logits)          # dropout did something
    model.train()
    model.zero_grad()
    reseed(model, 7)
    model(idx, targets)
    model.backward()
    params = model.parameters()
    directions = [rng.standard_normal(p.shape) for p in params]
    analytic = sum(float(np.sum(p.grad * d)) for p, d in zip(params, directions))
    h = 1e-6

    def loss_at(sign):
        for p, d in zip(params, directions):
            p.data += sign * h * d
        reseed(model, 7)
        value = float(model(idx, targets)[1])
        for p, d in zip(params, directions):
            p.data -= sign * h * d
        return value

    numeric = (loss_at(+1) - loss_at(-1)) / (2 * h)
    assert abs(analytic - numeric) <= 1e-6 * abs(numeric) + 1e-8, (analytic, numeric)


def test_same_seed_same_bits_in_training():
    cfg = GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8, dropout=0.2)
    idx, targets = batch(np.random.default_rng(6), cfg, 2, 8)
    runs = []
    for _ in range(2):
        model = GPT(cfg, rng=4, seed=9)
        losses = [float(model(idx, targets)[1]) for _ in range(2)]   # a new mask each forward
        model.backward()
        runs.append((losses, model.transformer.wte.weight.grad.copy()))
    assert runs[0][0] == runs[1][0] and runs[0][0][0] != runs[0][0][1]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_same_bits_at_any_thread_count():
    """Logits, loss, every gradient (dropout on) and seeded sampling: the same bits with 1
    thread as with all of them."""
    numba = pytest.importorskip("numba")
    cfg = GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=3, n_embd=24, dropout=0.1)
    idx, targets = batch(np.random.default_rng(17), cfg, 3, 8)
    runs, threads = [], numba.get_num_threads()
    try:
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            model = GPT(cfg, rng=7, seed=8)
            logits, loss = model(idx, targets)
            model.backward()
            runs.append([logits, loss] + [p.grad for p in model.parameters()]
                        + [model.generate(idx[:, :3], 9, top_k=5, seed=9)])
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ parameters and state

def test_names_init_and_tying():
    cfg = GPTConfig(block_size=16, vocab_size=50, n_layer=3, n_head=4, n_embd=64)
    model = GPT(cfg, dtype=np.float64, rng=0)
    params = dict(model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(model.parameters()) == len(params) == 2 + 12 * 3 + 2    # the tied one once
    assert "lm_head.weight" not in params
    for name, p in params.items():
        if name.endswith(".bias"):
            assert np.all(p.data == 0), name
        elif ".ln_" in name:
            assert np.all(p.data == 1), name
        else:
            want = 0.02 / math.sqrt(2 * 3) if name.endswith("c_proj.weight") else 0.02
            assert abs(p.data.std() / want - 1) < 0.1, (name, p.data.std(), want)
            assert abs(p.data.mean()) < 4 * want / math.sqrt(p.data.size), name
    again = GPT(cfg, dtype=np.float64, rng=0)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)       # rng decides


def test_state_dict_keys_are_nanogpts(torch):
    for bias in (True, False):
        cfg = GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=3, n_embd=24, bias=bias)
        ours = GPT(cfg).state_dict()
        theirs = torch_gpt(torch, cfg).state_dict()
        assert list(ours) == list(theirs)
        assert all(ours[k].shape == tuple(v.shape) for k, v in theirs.items())
        assert ours["lm_head.weight"] is ours["transformer.wte.weight"]   # one array, two names
        peer = torch_gpt(torch, cfg)
        assert len(GPT(cfg).parameters()) == len(list(peer.parameters()))


def test_state_dict_round_trips_both_ways(torch):
    rng = np.random.default_rng(8)
    idx, _ = batch(rng, SMALL, 2, 8)
    # npattn -> PyTorch: PyTorch computes our logits from our weights, tied included
    ours = GPT(SMALL, dtype=np.float64, rng=3)
    peer = torch_gpt(torch, SMALL)
    peer.load_state_dict(to_torch(torch, ours.state_dict(), np.float64))   # strict
    assert peer.lm_head.weight is peer.transformer.wte.weight
    assert rel(ours(idx)[0], peer(torch.tensor(idx))[0].detach().numpy()) < F64
    # PyTorch -> npattn, from PyTorch's own state_dict (its random init)
    peer = torch_gpt(torch, SMALL)
    model = GPT(SMALL, dtype=np.float64, rng=4)
    missing, unexpected = model.load_state_dict(
        {k: v.numpy() for k, v in peer.state_dict().items()})
    assert missing == unexpected == []
    np.testing.assert_array_equal(model.lm_head.weight.data, peer.lm_head.weight.detach().numpy())
    assert rel(model(idx)[0], peer(torch.tensor(idx))[0].detach().numpy()) < F64
    # npattn -> npattn: the same bits, and float64 weights load into a float32 model
    copy = GPT(SMALL, dtype=np.float64, rng=5)
    copy.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(copy(idx)[0], model(idx)[0])
    small = GPT(SMALL, dtype=np.float32, rng=5)
    small.load_state_dict(model.state_dict())
    assert small.transformer.wte.weight.dtype == np.float32


def test_tied_weight_loads_consistently():
    model = GPT(SMALL, dtype=np.float64, rng=0)
    state = GPT(SMALL, dtype=np.float64, rng=1).state_dict()
    tied = state["transformer.wte.weight"]
    # either name alone (strict=False) loads the one Parameter
    for key in ("transformer.wte.weight", "lm_head.weight"):
        partial = {k: v for k, v in state.items()
                   if k not in ("transformer.wte.weight", "lm_head.weight")}
        partial[key] = tied + 1.0
        missing, _ = model.load_state_dict(partial, strict=False)
        assert missing == [k for k in ("transformer.wte.weight", "lm_head.weight") if k != key]
        np.testing.assert_array_equal(model.lm_head.weight.data, tied + 1.0)
        assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\]"):
        model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})
    before = model.transformer.wte.weight.data.copy()
    clash = dict(state, **{"lm_head.weight": tied + 1.0})
    with pytest.raises(ValueError, match=r"state_dict\['lm_head.weight'\] must equal"):
        model.load_state_dict(clash)
    np.testing.assert_array_equal(model.transformer.wte.weight.data, before)   # nothing copied


def test_to_keeps_the_tie():
    model = GPT(SMALL, rng=0).to(np.float64)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.dtype == np.float64


# ------------------------------------------------------------------ generation

def greedy_without_cache(forward, idx, new, block_size):
    """nanoGPT's loop with top_k=1: the whole cropped context again at every step."""
    seq = np.array(idx)
    for _ in range(new):
        logits = forward(seq[:, -block_size:])               # (B, T, V)
        seq = np.concatenate([seq, np.argmax(logits[:, -1], axis=-1)[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("prompt, new", [(3, 4), (3, 11), (10, 3), (8, 1)])
def test_greedy_with_the_cache_equals_without(dtype, prompt, new):
    """Within block_size (3 + 4 <= 8), across it (3 + 11: cropped and re-prefilled for the
    last 6 steps), a prompt longer than block_size (cropped at once), and at the edge."""
    model = GPT(SMALL, dtype=dtype, rng=0)
    model.load_state_dict(random_state(model, np.random.default_rng(9)))
    model.train()
    idx = np.random.default_rng(10).integers(0, SMALL.vocab_size, (3, prompt))
    got = model.generate(idx, new, top_k=1)
    assert got.shape == (3, prompt + new) and got.dtype == np.int64
    np.testing.assert_array_equal(got[:, :prompt], idx)
    model.eval()
    want = greedy_without_cache(lambda x: model(x)[0], idx, new, SMALL.block_size)
    np.testing.assert_array_equal(got, want)
    assert model.generate(idx, new, top_k=1, seed=0).tolist() == got.tolist()


def test_greedy_equals_pytorchs(torch):
    state = random_state(GPT(SMALL, dtype=np.float64, rng=0), np.random.default_rng(11))
    model = GPT(SMALL, dtype=np.float64, rng=0)
    model.load_state_dict(state)
    peer = torch_model(torch, SMALL, state, np.float64).eval()
    idx = np.random.default_rng(12).integers(0, SMALL.vocab_size, (2, 5))
    with torch.no_grad():
        want = greedy_without_cache(lambda x: peer(torch.tensor(x))[0].numpy(), idx, 9,
                                    SMALL.block_size)
    np.testing.assert_array_equal(model.generate(idx, 9, top_k=1), want)


def test_sampling_is_seeded_and_respects_top_k():
    model = GPT(SMALL, dtype=np.float64, rng=0)
    model.load_state_dict(random_state(model, np.random.default_rng(13)))
    idx = np.random.default_rng(14).integers(0, SMALL.vocab_size, (4, 2))
    a = model.generate(idx, 10, temperature=1.5, seed=21)
    b = model.generate(idx, 10, temperature=1.5, seed=21)
    c = model.generate(idx, 10, temperature=1.5, seed=22)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    top3 = model.generate(idx, 10, top_k=3, seed=23)
    model.eval()
    for step in range(idx.shape[1], top3.shape[1]):
        logits = model(top3[:, max(0, step - SMALL.block_size):step])[0][:, -1]   # (B, V)
        allowed = np.argsort(-logits, axis=-1)[:, :3]
        assert all(top3[r, step] in allowed[r] for r in range(top3.shape[0])), step
    picks = model.generate(np.zeros((200, 1), np.int64), 1, seed=24)[:, 1]
    assert len(set(picks.tolist())) > 3                     # temperature 1: not greedy
    greedy = model.generate(idx, 4, top_k=1)
    np.testing.assert_array_equal(model.generate(idx, 4, temperature=5e-324, seed=25), greedy)
    flat = model.generate(np.zeros((400, 1), np.int64), 1, temperature=1e300, seed=26)[:, 1]
    assert len(set(flat.tolist())) > 30                     # uniform over the 37 tokens


def test_generate_keeps_the_mode_and_what_backward_needs():
    model = GPT(SMALL, dtype=np.float64, rng=0)
    idx, targets = batch(np.random.default_rng(15), SMALL, 2, 5)
    model(idx, targets)
    model.backward()
    want = [p.grad.copy() for p in model.parameters()]
    model.zero_grad()
    model(idx, targets)
    model.generate(idx, 5)                                  # between forward and backward
    assert model.training and all(m.training for _, m in model.named_modules())
    model.backward()
    for p, g in zip(model.parameters(), want):
        np.testing.assert_array_equal(p.grad, g)
    np.testing.assert_array_equal(model.generate(idx, 0), idx)


def test_decoding_is_forward_with_a_cache():
    """generate runs the blocks' own forward: with a cache and no_saving, one row at a time,
    it gives forward's last logits up to rounding; a cache in training mode is refused."""
    model = GPT(SMALL, dtype=np.float64, rng=0).eval()
    idx, _ = batch(np.random.default_rng(16), SMALL, 2, 6)
    want = model(idx)[0][:, -1]
    block_size, hs = SMALL.block_size, SMALL.n_embd // SMALL.n_head
    caches = [tuple(np.zeros((2, SMALL.n_head, block_size, hs)) for _ in "kv")
              for _ in model.transformer.h]
    model._decode(idx[:, :3], 0, caches)                                  # prefill
    for t in range(3, 6):
        got = model._decode(idx[:, t:t + 1], t, caches)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    model.train()
    with pytest.raises(ValueError, match="with a KV cache is inference: call eval"):
        model.transformer.h[0].attn(np.zeros((2, 1, SMALL.n_embd)), caches[0], 3)


# ------------------------------------------------------------------ training

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adamw_training_tracks_pytorch(torch, dtype):
    """40 AdamW steps from the same weights on the same batches: the final loss within 1 %
    of PyTorch's identical loop, and the loss has come down."""
    cfg = GPTConfig(block_size=8, vocab_size=13, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg, dtype=dtype, rng=6)
    state = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    peer = torch_model(torch, cfg, state, dtype)
    ours = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(peer.parameters(), lr=3e-3, weight_decay=0.1)
    rng = np.random.default_rng(16)
    losses = []
    for _ in range(40):
        idx = rng.integers(0, cfg.vocab_size, (4, 8))
        targets = (idx * 3 + 1) % cfg.vocab_size             # a learnable map
        model.zero_grad()
        _, loss = model(idx, targets)
        model.backward()
        ours.step()
        theirs.zero_grad()
        _, peer_loss = peer(torch.tensor(idx), torch.tensor(targets))
        peer_loss.backward()
        theirs.step()
        losses.append((float(loss), float(peer_loss.detach())))
    assert losses[-1][0] < 0.8 * losses[0][0]
    assert abs(losses[-1][0] - losses[-1][1]) <= 0.01 * losses[-1][1], losses[-5:]


# ------------------------------------------------------------------ bad input

def bad_calls(model):
    good = np.zeros((2, 3), np.int64)
    return [
        (lambda: model(good.astype(np.float32)), TypeError, r"idx must be an integer array"),
        (lambda: model(np.zeros(3, np.int64)), ValueError, r"idx must have shape \(B, T\)"),
        (lambda: model(np.zeros((2, 0), np.int64)), ValueError, r"idx must hold at least one"),
        (lambda: model(np.zeros((1, 9), np.int64)), ValueError,
         r"idx must have T <= block_size = 8 .*; got 9"),
        (lambda: model(good + 37), ValueError, r"idx must be in \[0, 37\) .*; got 37"),
        (lambda: model(good - 1), ValueError, r"idx must be in \[0, 37\) .*; got -1"),
        (lambda: model(good, good[:, :2]), ValueError, r"targets must have shape \(2, 3\)"),
        (lambda: model(good, good - 2), ValueError, r"targets must be in \[0, 37\) .*; got -2"),
        (lambda: model(good, good * 1.0), TypeError, r"targets must be an integer array"),
        (lambda: model.generate(good, -1), ValueError, r"max_new_tokens must be an int >= 0"),
        (lambda: model.generate(good, 1.0), TypeError, r"max_new_tokens must be an int"),
        (lambda: model.generate(good, 1, temperature=0), ValueError,
         r"temperature must be a finite real number > 0; got 0.0"),
        (lambda: model.generate(good, 1, temperature=math.nan), ValueError, r"temperature"),
        (lambda: model.generate(good, 1, temperature="1"), TypeError, r"temperature"),
        (lambda: model.generate(good, 1, top_k=0), ValueError, r"top_k must be an int >= 1"),
        (lambda: model.generate(good, 1, seed="x"), TypeError, r"seed must be None, an int"),
        (lambda: model.generate(good + 40, 1), ValueError, r"idx must be in \[0, 37\)"),
        (lambda: model.generate(np.zeros((2, 0), np.int64), 1), ValueError, r"idx must hold"),
        (lambda: GPTConfig(8, 37, 2, 3, 25), ValueError, r"n_embd must be divisible by n_head"),
        (lambda: GPTConfig(8, 0, 2, 3, 24), ValueError, r"vocab_size must be an int >= 1"),
        (lambda: GPTConfig(0, 37, 2, 3, 24), ValueError, r"block_size must be an int >= 1"),
        (lambda: GPTConfig(8, 37, 2, 3, 24, dropout=1.5), ValueError, r"dropout must be in"),
        (lambda: GPTConfig(8, 37, 2, 3, 24, bias="yes"), TypeError, r"bias must be a bool"),
        (lambda: GPT(dict(block_size=8)), TypeError, r"config must be a GPTConfig; got dict"),
        (lambda: GPT(SMALL, dtype=np.int32), TypeError, r"dtype must be float32 or float64"),
        (lambda: GPT(SMALL, seed=-1), ValueError, r"seed must be a non-negative int"),
        (lambda: model.load_state_dict([]), TypeError, r"state_dict must be a mapping"),
    ]


def test_bad_input_names_the_argument():
    model = GPT(SMALL, rng=0)
    for call, error, message in bad_calls(model):
        with pytest.raises(error, match=message) as info:
            call()
        assert "; got " in str(info.value), str(info.value)


def test_backward_needs_a_forward_and_a_loss():
    model = GPT(SMALL, rng=0)
    with pytest.raises(RuntimeError, match="before forward"):
        model.backward()
    logits, _ = model(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="dlogits must be given when forward had no targets"):
        model.backward()
    with pytest.raises(ValueError, match=r"dlogits must have shape \(2, 3, 37\)"):
        model.backward(np.zeros((2, 3, 36), np.float32))
    with pytest.raises(TypeError, match=r"dlogits must have dtype float32"):
        model.backward(np.zeros((2, 3, 37), np.float64))
    assert all(np.all(p.grad == 0) for p in model.parameters())    # nothing was added
