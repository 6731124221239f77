"""functional/block.py's block_decode -- a generated token through a GPT block, fused -- is the
modules' path, bit for bit: Block.forward(x[:, None], cache, position)[:, 0] on the same
weights and caches gives the same output and writes the same keys and values. Its one-pass
argument lane (_checks._block_decode_common) accepts only what the checks accept, and
GPT.generate runs it for every token after the prefill.
"""
from unittest import mock

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from npattn import _checks
from npattn.functional.block import BlockWeights, block_decode
from npattn.models.gpt import GPT, Block, GPTConfig

pytestmark = pytest.mark.kernel


def module_path(block, x, cache, position):
    """The modules' answer to Block.decode (what GPT._decode ran before the fused block)."""
    return block(x[:, None], cache, position)[:, 0]


@st.composite
def blocks(draw):
    """(block in eval mode, x (B, C), caches (k, v) filled up to position, position)."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    n_head = draw(st.sampled_from([1, 2, 3, 4]))
    hs = draw(st.integers(1, 12))
    batch = draw(st.integers(0, 3))                      # (0: an empty batch, shapes only)
    block_size = draw(st.integers(1, 80))
    position = draw(st.integers(0, block_size - 1))
    cfg = GPTConfig(block_size=block_size, vocab_size=5, n_layer=1, n_head=n_head,
                    n_embd=n_head * hs, bias=draw(st.booleans()))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    block = Block(cfg, dtype=np.dtype(dtype), rng=rng, seeds=rng)
    scale = draw(st.sampled_from([0.1, 1.0, 30.0]))     # 30: logits far from zero
    for param in block.parameters():                     # biases and norm weights not 0 or 1
        param.data[...] = rng.standard_normal(param.shape) * scale / np.sqrt(param.shape[-1])
    block.eval()
    x = (rng.standard_normal((batch, cfg.n_embd)) * draw(st.sampled_from([1.0, 1e3]))
         ).astype(dtype)
    caches = tuple(rng.standard_normal((batch, n_head, block_size, hs)).astype(dtype)
                   for _ in "kv")
    return block, x, caches, position


@settings(max_examples=60, deadline=None)
@given(case=blocks())
def test_block_decode_is_the_modules_path_bit_for_bit(case):
    """Both dtypes, with and without biases, 0-3 sequences, 1-4 heads of 1-12 dims, any
    position of the cache (the first too), weights and inputs far from 1: the same output bits
    and the same caches (the new key and value written at position, nothing else touched)."""
    block, x, caches, position = case
    theirs = tuple(c.copy() for c in caches)
    want = module_path(block, x, theirs, position)
    ours = tuple(c.copy() for c in caches)
    x_before = x.copy()
    got = block_decode(x, block.decode_weights(), ours[0], ours[1], position, block.attn.n_head,
                       block.ln_1.eps)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, want)
    for mine, reference in zip(ours, theirs):
        np.testing.assert_array_equal(mine, reference)
    np.testing.assert_array_equal(x, x_before)
    np.testing.assert_array_equal(block.decode(x, tuple(c.copy() for c in caches), position),
                                  want)


def call_args(block, x, caches, position):
    return [x, block.decode_weights(), caches[0], caches[1], position, block.attn.n_head,
            block.ln_1.eps]


@st.composite
def checked_calls(draw):
    """A block_decode call as generation makes it, and sometimes one change to it."""
    block, x, caches, position = draw(blocks())
    args = call_args(block, x, caches, position)
    change = draw(st.sampled_from([
        "none", "dtype", "shape", "strided", "readonly", "missing", "list", "short", "shared",
        "aliased_x", "position", "position_type", "n_head", "eps", "eps_type", "x_rank"]))
    weights = list(args[1])
    required = [i for i in range(12) if i not in _checks.BLOCK_OPTIONAL]
    i = draw(st.sampled_from([j for j in range(12) if weights[j] is not None]))
    other = np.float64 if x.dtype == np.float32 else np.float32
    if change == "dtype":
        weights[i] = weights[i].astype(other)
    elif change == "shape":
        weights[i] = np.zeros(weights[i].shape[:-1] + (weights[i].shape[-1] + 1,), x.dtype)
    elif change == "strided":
        weights[i] = np.repeat(weights[i], 2, axis=-1)[..., ::2]
    elif change == "readonly":
        weights[i] = weights[i].copy()
        weights[i].setflags(write=False)
    elif change == "missing":
        weights[draw(st.sampled_from(required))] = None
    elif change == "list":
        args[1] = weights                                # a list: the checks take it
    elif change == "short":
        weights = weights[:11]
    elif change == "shared":
        args[3] = args[2]
    elif change == "aliased_x":
        args[0] = args[2].reshape(-1)[:x.size].reshape(x.shape)
    elif change == "position":
        args[4] = draw(st.sampled_from([-1, caches[0].shape[2]]))
    elif change == "position_type":
        args[4] = np.int64(position)
    elif change == "n_head":
        args[5] = draw(st.sampled_from([0, x.shape[1] + 1, np.int64(args[5])]))
    elif change == "eps":
        args[6] = draw(st.sampled_from([-1e-5, float("nan"), float("inf")]))
    elif change == "eps_type":
        args[6] = draw(st.sampled_from([0, np.float32(1e-5)]))
    elif change == "x_rank":
        args[0] = x[:, None]
    if change != "list":
        args[1] = tuple(weights)
    return args, change


@settings(max_examples=300, deadline=None)
@given(call=checked_calls())
def test_the_common_lane_accepts_only_what_the_checks_accept(call):
    """_checks._block_decode_common returns exactly what block_decode_args' checks, one by one,
    return -- the same arrays and values -- and nothing (the checks run) for any input they
    would reject or treat otherwise; generation's own case takes it."""
    args, change = call
    fast = _checks._block_decode_common(*args)
    with mock.patch.object(_checks, "_block_decode_common", lambda *_: None):
        try:
            slow = _checks.block_decode_args(*args)
        except (TypeError, ValueError):
            slow = None
    event(f"{change}: {'lane' if fast is not None else 'checks'}")
    if change == "none":
        assert fast is not None
    if fast is None:
        return
    assert slow is not None and len(fast) == len(slow) == 5
    assert fast[0] is slow[0] and fast[2:] == slow[2:]
    assert all(type(f) is type(s) for f, s in zip(fast[2:], slow[2:]))
    assert len(fast[1]) == len(slow[1]) == 12
    assert all(f is s for f, s in zip(fast[1], slow[1]))


def test_bad_arguments_name_themselves():
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=8)
    rng = np.random.default_rng(0)
    block = Block(cfg, dtype=np.dtype(np.float32), rng=rng, seeds=rng).eval()
    x = np.zeros((2, 8), np.float32)
    caches = tuple(np.zeros((2, 2, 8, 4), np.float32) for _ in "kv")
    w = block.decode_weights()

    def call(**changes):
        args = dict(x=x, weights=w, key_cache=caches[0], value_cache=caches[1], position=3,
                    n_head=2, eps=1e-5)
        args.update(changes)
        return block_decode(**args)

    with pytest.raises(ValueError, match=r"x must have shape \(B, C\)"):
        call(x=x[:, None])
    with pytest.raises(TypeError, match="weights.attn_weight must have dtype float32"):
        call(weights=w._replace(attn_weight=w.attn_weight.astype(np.float64)))
    with pytest.raises(ValueError, match=r"weights.mlp_proj_weight must have shape \(8, 32\)"):
        call(weights=w._replace(mlp_proj_weight=np.zeros((8, 31), np.float32)))
    with pytest.raises(TypeError, match="weights must be the block's 12 arrays"):
        call(weights=w[:11])
    with pytest.raises(TypeError, match="weights.attn_weight must be a float32 or float64"):
        call(weights=w._replace(attn_weight=None))
    with pytest.raises(ValueError, match=r"key_cache must have shape \(B, nh, Smax, hs\)"):
        call(key_cache=np.zeros((2, 2, 8, 5), np.float32))
    with pytest.raises(ValueError, match="must not share memory"):
        call(value_cache=caches[0])
    with pytest.raises(ValueError, match=r"position must be in \[0, Smax = 8\); got 8"):
        call(position=8)
    with pytest.raises(ValueError, match="n_head must divide x's C = 8; got 3"):
        call(n_head=3)
    with pytest.raises(ValueError, match="eps must be a finite real number >= 0; got -1.0"):
        call(eps=-1.0)
    with pytest.raises(ValueError, match="C-contiguous, writeable"):
        call(key_cache=np.zeros((2, 2, 8, 8), np.float32)[..., ::2])


def test_generate_runs_the_fused_block_after_the_prefill():
    """Every generated token but the last goes through block_decode once per layer (not the
    modules), and the tokens are the modules' tokens, sampled and greedy."""
    cfg = GPTConfig(block_size=12, vocab_size=11, n_layer=2, n_head=2, n_embd=8)
    model = GPT(cfg, dtype=np.float64, rng=3)
    idx = np.random.default_rng(4).integers(0, 11, (2, 3))
    calls = []
    import npattn.models.gpt as gpt

    def counted(*args, **kwargs):
        calls.append(args[4])                            # the position
        return block_decode(*args, **kwargs)

    with mock.patch.object(gpt, "block_decode", counted):
        fused = model.generate(idx, 6, seed=5)
    assert calls == [p for p in range(3, 8) for _ in range(cfg.n_layer)]
    with mock.patch.object(Block, "decode", module_path):
        assert np.array_equal(model.generate(idx, 6, seed=5), fused)
        greedy = model.generate(idx, 12, top_k=1)        # past block_size: crops, prefills
    assert np.array_equal(model.generate(idx, 12, top_k=1), greedy)


@pytest.mark.parametrize("length", [1, 3])
def test_an_empty_batch_runs_forward_and_generates_nothing(length):
    """idx (0, T): forward's logits are (0, T, V) and generate returns (0, T + new), through the
    prefill, the fused block steps and a crop past block_size (one position takes views of
    the heads: they must keep their shapes when there are no rows)."""
    cfg = GPTConfig(block_size=4, vocab_size=11, n_layer=1, n_head=2, n_embd=8)
    model = GPT(cfg, dtype=np.float32, rng=0)
    idx = np.zeros((0, length), np.int64)
    logits, _ = model(idx)
    assert logits.shape == (0, length, 11)
    assert model.generate(idx, 6, seed=1).shape == (0, length + 6)
