"""nanoGPT's GPT (github.com/karpathy/nanoGPT, ``model.py``) on npattn's ops, every backward
written out next to its forward, as llm.c does it.

    idx (B, T) ──wte──▶ tok (B, T, C) ─┐
    arange(T) ──wpe──▶ pos (T, C) ─────┴─ + ──drop──▶ x (B, T, C)     (pos broadcast over B)
    n_layer × Block:   x = x + attn(ln_1(x))                          (pre-LayerNorm residuals)
                       x = x + mlp(ln_2(x))
    ln_f(x) ──lm_head──▶ logits (B, T, V) = ln_f(x)·wteᵀ                (lm_head is tied to wte)
    loss = mean cross-entropy(logits, targets), targets == -1 ignored

    attn(x): q, k, v = split(c_attn(x)) into nh heads (B, nh, T, hs); y = causal SDPA(q, k, v)
             with attention dropout; resid_dropout(c_proj(merge(y)))
    mlp(x):  dropout(c_proj(gelu(c_fc(x))))          (c_fc: C -> 4C, exact erf GELU)

Dims: B batch, T tokens (<= block_size), C = n_embd, nh = n_head, hs = C / nh, V = vocab_size.
Parameter names are nanoGPT's (``transformer.h.0.attn.c_attn.weight``...), so a PyTorch
nanoGPT ``state_dict`` converted to NumPy loads with ``load_state_dict`` and ours loads there.
``docs/backward.md`` section 14 derives the backward pass.
"""
import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from .. import _checks
from ..functional.gelu import gelu_backward, gelu_forward
from ..functional.block import BlockWeights, block_decode
from ..functional.attention import (merge_heads, merge_heads_side_by_side,
                                    scaled_dot_product_attention_backward,
                                    scaled_dot_product_attention_forward,
                                    scaled_dot_product_attention_with_kv_cache, split_heads)
from ..functional.cross_entropy import cross_entropy_backward, cross_entropy_forward
from ..nn import init
from ..nn.dropout import Dropout, draw_seed
from ..nn.embedding import Embedding
from ..nn.linear import Linear
from ..nn.module import Module, ModuleList, no_saving
from ..nn.normalization import LayerNorm

IGNORE_INDEX = -1              # nanoGPT's: targets equal to -1 take no part in the loss
TIED = "lm_head.weight"        # the second name of transformer.wte.weight (weight tying)
WTE = "transformer.wte.weight"


@dataclasses.dataclass
class GPTConfig:
    """nanoGPT's GPTConfig: the sizes of a GPT (GPT-2 small is ``GPTConfig(1024, 50304, 12,
    12, 768)``). ``dropout`` is the probability of every dropout (embeddings, attention,
    residual branches); ``bias`` puts a bias in every Linear and LayerNorm (False: none, as
    nanoGPT's ``bias=False``). n_embd must be divisible by n_head."""

    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        self.block_size = _checks.size("block_size", self.block_size, 1)
        self.vocab_size = _checks.size("vocab_size", self.vocab_size, 1)
        self.n_layer = _checks.size("n_layer", self.n_layer, 1)
        self.n_head = _checks.size("n_head", self.n_head, 1)
        self.n_embd = _checks.size("n_embd", self.n_embd, 1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head; got n_embd = {self.n_embd}, "
                             f"n_head = {self.n_head}")
        self.dropout = _checks.probability("dropout", self.dropout)
        self.bias = _checks.flag("bias", self.bias)


class CausalSelfAttention(Module):
    """nanoGPT's CausalSelfAttention: nh causal heads on one fused projection.

        q, k, v = the three C-wide blocks of x·W_attnᵀ + b_attn   (c_attn, (3C, C))
        y_h     = dropout(softmax(q_h·k_hᵀ/√hs, key j <= query i)) · v_h     (fused SDPA)
        out     = resid_dropout(merge(y)·W_projᵀ + b_proj)          (c_proj, (C, C))

    Shapes: x (B, T, C) -> out (B, T, C)

    ``forward`` keeps q, k, v, y and the logsumexp (B, nh, T) for backward, never the T×T
    weights. The attention dropout seed is drawn per training forward from the module's own
    generator. ``forward(x, cache, start)`` is the same forward with a KV cache (inference,
    GPT.generate).
    """

    def __init__(self, config, *, dtype, rng, seeds):
        super().__init__()
        c = config.n_embd
        self.n_head, self.n_embd, self.dropout = config.n_head, c, config.dropout
        self.c_attn = Linear(c, 3 * c, config.bias, dtype=dtype, rng=rng)
        self.c_proj = Linear(c, c, config.bias, dtype=dtype, rng=rng)
        self.resid_dropout = Dropout(config.dropout, seed=draw_seed(seeds))
        self._generator = np.random.default_rng(draw_seed(seeds))       # attention dropout

    def _heads(self, qkv):
        b, t, width = qkv.shape
        if b == 1 and t == 1:           # one decoded token: its row already is (3, nh, hs)
            return qkv.reshape(3, 1, self.n_head, 1, width // (3 * self.n_head))   # (a view)
        return split_heads(qkv, self.n_head, True, parts=3)            # q, k, v: (3, B, nh, T, hs)

    def forward(self, x, cache=None, start=0):
        """out (B, T, C). With ``cache`` = (k, v), each (B, nh, block_size, hs) -- inference,
        in eval mode: x (B, L, C) holds positions start .. start + L - 1, the ``start`` before
        them are in the cache, and this call writes its keys and values there at its
        positions. Query i sees the cached keys and the new keys up to its own position
        (bottom-right causal alignment: key j visible iff j <= start + i). A prefill (start
        0) runs on the fused engine as without a cache; later calls on its decode path, which
        splits the cache's keys across the threads (scaled_dot_product_attention_with_kv_cache)."""
        if cache is not None and self.training:
            raise ValueError("CausalSelfAttention.forward with a KV cache is inference: call "
                             "eval() first (got a cache in training mode)")
        q, k, v = self._heads(self.c_attn(x))                       # (B, nh, T, hs) each
        if cache is None or start == 0:                 # training, or the new keys are all
            p = self.dropout if self.training else 0.0
            seed = draw_seed(self._generator) if p > 0 else None
            y, lse = scaled_dot_product_attention_forward(q, k, v, dropout_p=p, is_causal=True,
                                                          seed=seed)
            self._saved = (q, k, v, y, lse, p, seed)
            if cache is not None:
                cache[0][:, :, :k.shape[2]] = k
                cache[1][:, :, :v.shape[2]] = v
        else:
            y, _ = scaled_dot_product_attention_with_kv_cache(q, cache[0], cache[1], start, k, v,
                                                              is_causal=True)
        # (B, nh, T, hs) -> (B, T, C); for one position a view: the heads already side by side
        b, nh, t, hs = y.shape
        merged = y.reshape(b, 1, nh * hs) if t == 1 else merge_heads(y, True)
        return self.resid_dropout(self.c_proj(merged))              # (B, T, C)

    def backward(self, dout):
        """dx = [dq dk dv]·W_attn (the three heads' gradients merged side by side)."""
        q, k, v, y, lse, p, seed = self._saved_for_backward()
        # out = resid_dropout(c_proj(merge(y))): back through dropout (same mask), c_proj
        # (adds dW_proj, db_proj), then the merge undone: a relabelling, nothing summed
        dy = split_heads(self.c_proj.backward(self.resid_dropout.backward(dout)),
                         self.n_head, True)                         # (B, nh, T, hs)
        # the fused SDPA backward rebuilds each block of probabilities from lse (section 8)
        dq, dk, dv = scaled_dot_product_attention_backward(dy, q, k, v, y, lse, dropout_p=p,
                                                           is_causal=True, seed=seed)
        # q, k, v were three column blocks of one c_attn output: their gradients, merged
        # back to (B, T, C), sit side by side in the gradient of that output
        dqkv = merge_heads_side_by_side((dq, dk, dv), True)         # (B, T, 3C)
        return self.c_attn.backward(dqkv)                           # (B, T, C) from (B, T, 3C)


class MLP(Module):
    """nanoGPT's MLP: out = dropout(gelu(x·W_fcᵀ + b_fc)·W_projᵀ + b_proj), exact (erf) GELU.

    Shapes: x (B, T, C) -> h (B, T, 4C) -> out (B, T, C); c_fc.weight (4C, C),
    c_proj.weight (C, 4C)
    """

    def __init__(self, config, *, dtype, rng, seeds):
        super().__init__()
        c = config.n_embd
        self.c_fc = Linear(c, 4 * c, config.bias, dtype=dtype, rng=rng)
        self.c_proj = Linear(4 * c, c, config.bias, dtype=dtype, rng=rng)
        self.dropout = Dropout(config.dropout, seed=draw_seed(seeds))

    def forward(self, x):
        h = self.c_fc(x)                                            # (B, T, 4C)
        self._saved = h                                             # gelu's backward needs h
        return self.dropout(self.c_proj(gelu_forward(h)))           # (B, T, C)

    def backward(self, dout):
        h = self._saved_for_backward()
        dg = self.c_proj.backward(self.dropout.backward(dout))      # d gelu(h): (B, T, 4C)
        return self.c_fc.backward(gelu_backward(dg, h))             # dh = dg ∘ gelu'(h)


class Block(Module):
    """nanoGPT's Block, pre-LayerNorm: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)).

    Shapes: x (B, T, C) -> (B, T, C)
    """

    def __init__(self, config, *, dtype, rng, seeds):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype=dtype, rng=rng, seeds=seeds)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, rng=rng, seeds=seeds)

    def forward(self, x, cache=None, start=0):
        """x (B, T, C) -> (B, T, C); ``cache``, ``start``: attention's KV cache (inference,
        see CausalSelfAttention.forward)."""
        # each residual sum is added into the branch's output, a fresh array no module keeps
        # (ln_1 and ln_2 keep their inputs x and x1 for backward: those stay as they are)
        x1 = self.attn(self.ln_1(x), cache, start)
        x1 += x                                                     # x1 = x + attn(ln_1(x))
        x2 = self.mlp(self.ln_2(x1))
        x2 += x1                                                    # x2 = x1 + mlp(ln_2(x1))
        return x2

    def decode(self, x, cache, position):
        """forward(x[:, None], cache, position)[:, 0] for x (B, C), one new position per row, in
        eval mode -- generation's step, fused (functional/block.py: the same kernels on the same
        values, so the same bits, without each module's Python)."""
        if self.training or self.ln_1.eps != self.ln_2.eps:
            return self(x[:, None], cache, position)[:, 0]       # (the modules' path)
        return block_decode(x, self.decode_weights(), cache[0], cache[1], position,
                            self.attn.n_head, self.ln_1.eps)

    def decode_weights(self):
        """The block's twelve arrays as functional/block.py's BlockWeights (None for an absent
        bias)."""
        def data(param):
            return None if param is None else param.data
        attn, mlp = self.attn, self.mlp
        return BlockWeights(
            data(self.ln_1.weight), data(self.ln_1.bias), attn.c_attn.weight.data,
            data(attn.c_attn.bias), attn.c_proj.weight.data, data(attn.c_proj.bias),
            data(self.ln_2.weight), data(self.ln_2.bias), mlp.c_fc.weight.data,
            data(mlp.c_fc.bias), mlp.c_proj.weight.data, data(mlp.c_proj.bias))

    def backward(self, dout):
        """dx = dx1 + ln_1'ᵀ·attn'ᵀ·dx1 with dx1 = dout + ln_2'ᵀ·mlp'ᵀ·dout: each residual
        stream's gradient reaches both its branch and, unchanged, the stream below."""
        # x2 = x1 + mlp(ln_2(x1)): x1 is used twice, so its gradient is the sum of both uses
        # (added into the branch's gradient, a fresh array, as forward adds)
        dx1 = self.ln_2.backward(self.mlp.backward(dout))
        dx1 += dout
        # x1 = x + attn(ln_1(x)): the same rule one branch down
        dx = self.ln_1.backward(self.attn.backward(dx1))
        dx += dx1
        return dx


class Transformer(Module):
    """nanoGPT's ``transformer`` ModuleDict: the modules whose names start with
    ``transformer.`` (wte, wpe, drop, h, ln_f). A container; GPT runs them."""

    def __init__(self, config, *, dtype, rng, seeds):
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.n_embd, dtype=dtype, rng=rng)
        self.wpe = Embedding(config.block_size, config.n_embd, dtype=dtype, rng=rng)
        self.drop = Dropout(config.dropout, seed=draw_seed(seeds))
        # registered as h.0, h.1, ... (nanoGPT's names); GPT runs the blocks itself
        self.h = ModuleList([Block(config, dtype=dtype, rng=rng, seeds=seeds)
                             for _ in range(config.n_layer)])
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias, dtype=dtype)


class GPT(Module):
    """nanoGPT's GPT language model (see the module docstring for the graph).

    Shapes: idx (B, T) integer token ids in [0, vocab_size), 1 <= T <= block_size, and
    targets (B, T) in [0, vocab_size) or -1 (ignored) -> logits (B, T, vocab_size), loss ()

    ``model(idx, targets=None)`` returns ``(logits, loss)``: the logits of every position
    (nanoGPT returns only the last one's without targets; here always all of them), and the
    mean cross-entropy over the targets that are not -1, or None without targets.
    ``model.backward(dlogits=None)`` after a forward ADDS every parameter's gradient into its
    ``.grad``: of that forward's loss, or of a downstream loss whose gradient with respect to
    the logits is ``dlogits`` (B, T, vocab_size).

    Parameters (nanoGPT's names and initialisation, drawn from ``rng``: None, an int seed or
    a numpy Generator): every Linear weight and both embeddings N(0, 0.02²), every
    ``c_proj.weight`` N(0, (0.02/√(2·n_layer))²) (the residual branches' outputs, so the
    residual stream's variance does not grow with depth), biases 0, LayerNorm weights 1.
    ``lm_head.weight`` IS ``transformer.wte.weight`` (weight tying: one Parameter, whose
    gradient is the sum of its two uses); ``parameters()`` yields it once, ``state_dict()``
    holds it under both names (one array, as PyTorch's), and ``load_state_dict`` requires the
    two to be equal when both are given.

    Dropout (``config.dropout``) applies in training mode to the embeddings' sum, to the
    attention weights (inside the fused SDPA) and to both residual branches, with seeds drawn
    from generators seeded once from ``seed``: the same seed gives bitwise the same run (the
    masks are npattn's, not PyTorch's).
    """

    def __init__(self, config, *, dtype=np.float32, rng=None, seed=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig; got {type(config).__name__}")
        self.config = config
        dtype = _checks.float_dtype(dtype)
        gen = _checks.generator(rng)
        seeds = _checks.generator(seed, "seed")
        self.transformer = Transformer(config, dtype=dtype, rng=gen, seeds=seeds)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False, dtype=dtype, rng=gen)
        self.lm_head.weight = self.transformer.wte.weight          # tied: one Parameter
        # nanoGPT's _init_weights and the scaled c_proj init, replacing the modules' own
        std, proj_std = 0.02, 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                param.data[...] = 0
            elif ".ln_" not in name:                                # LayerNorm weights stay 1
                param.data[...] = init.normal(
                    param.shape, 0.0, proj_std if name.endswith("c_proj.weight") else std,
                    rng=gen, dtype=dtype)

    # -------------------------------------------------------------- state
    def state_dict(self):
        """nanoGPT's keys -> copies; ``lm_head.weight`` is the same array as
        ``transformer.wte.weight`` (as in PyTorch's state_dict of the tied model)."""
        state = super().state_dict()
        state[TIED] = state[WTE]
        return state

    def load_state_dict(self, state_dict, strict=True):
        """As ``Module.load_state_dict``, with the tied weight under either name or both:
        both given must be equal; with ``strict=False`` either one alone loads the Parameter.
        Returns ``(missing, unexpected)`` key lists."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays; got "
                            f"{type(state_dict).__name__}")
        expected = [name for name, _ in self.named_parameters()] + [TIED]
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if _checks.flag("strict", strict) and (missing or unexpected):
            raise ValueError(f"state_dict does not match GPT: missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        state = dict(state_dict)
        tied = state.pop(TIED, None)
        if tied is not None and WTE in state:
            a = _checks.converted(f"state_dict[{WTE!r}]", state[WTE], "a float array")
            b = _checks.converted(f"state_dict[{TIED!r}]", tied, "a float array")
            if a.shape == b.shape and not np.array_equal(a, b):
                raise ValueError(f"state_dict[{TIED!r}] must equal state_dict[{WTE!r}] (the "
                                 f"two names of one tied weight); got different arrays")
        elif tied is not None:
            state[WTE] = tied
        super().load_state_dict(state, strict=False)
        return missing, unexpected

    # -------------------------------------------------------------- forward and backward
    def forward(self, idx, targets=None):
        """``(logits, loss)``; see the class docstring."""
        cfg, tr = self.config, self.transformer
        idx = _checks.token_ids("idx", idx, cfg.vocab_size, cfg.block_size)      # (B, T)
        if targets is not None:
            targets = _checks.token_targets("targets", targets, idx.shape, cfg.vocab_size,
                                            IGNORE_INDEX)
        b, t = idx.shape
        logits = self.lm_head(tr.ln_f(self._blocks(idx)))           # (B, T, V) = ln_f(x)·wteᵀ
        loss = None
        if targets is not None:
            loss = cross_entropy_forward(logits.reshape(b * t, cfg.vocab_size),
                                         targets.reshape(b * t), ignore_index=IGNORE_INDEX)
        self._saved = (logits, targets)
        return logits, loss

    def backward(self, dlogits=None):
        """Adds every parameter's gradient; returns None (token ids have no gradient)."""
        logits, targets = self._saved_for_backward()
        b, t, v = logits.shape
        if dlogits is None:
            if targets is None:
                raise ValueError("dlogits must be given when forward had no targets (there is "
                                 "no loss to differentiate); got None")
            # loss = mean over the counted targets of -log softmax(logits)[target]
            dlogits = cross_entropy_backward(np.ones((), logits.dtype), logits.reshape(b * t, v),
                                             targets.reshape(b * t),
                                             ignore_index=IGNORE_INDEX).reshape(b, t, v)
        else:
            dlogits = _checks.float_input("dlogits", dlogits, logits.dtype, "GPT")
            _checks.exact_shape("dlogits", dlogits, logits.shape,
                                "to match forward's logits (B, T, vocab_size)")
        tr = self.transformer
        # logits = ln_f(x)·wteᵀ: d ln_f(x) = dlogits·wte, and lm_head adds
        # dlogitsᵀ·ln_f(x) into wte.grad: the first of the tied weight's two uses
        dx = tr.ln_f.backward(self.lm_head.backward(dlogits))       # (B, T, C)
        for block in reversed(list(tr.h)):                          # last block first
            dx = block.backward(dx)
        demb = tr.drop.backward(dx)                                 # d(tok + pos): (B, T, C)
        # tok = wte[idx]: its gradient scatter-adds into wte.grad (the second use)
        tr.wte.backward(demb)
        # pos (T, C) was broadcast over the batch: its gradient is the sum over the batch
        tr.wpe.backward(demb.sum(axis=0))
        return None

    def _blocks(self, idx, start=0, caches=None):
        """x (B, T, C) after the blocks, for token ids idx (B, T) at positions start .. start +
        T - 1: forward's trunk, and generation's with every layer's KV cache."""
        tr = self.transformer
        tok = tr.wte(idx)                                           # (B, T, C)
        pos = tr.wpe(np.arange(start, start + idx.shape[1]))        # (T, C), shared by the batch
        x = tr.drop(tok + pos)                                      # (B, T, C)
        for block, cache in zip(tr.h, caches or [None] * len(tr.h)):
            x = block(x, cache, start)
        return x

    # -------------------------------------------------------------- generation
    def _decode(self, tokens, start, caches):
        """The logits (B, V) of the last of ``tokens`` (B, L) at positions start .. start+L-1:
        forward's trunk on only these L rows, saving nothing for backward (their keys and
        values go to the caches), then ln_f and lm_head on the last row alone."""
        tr = self.transformer
        with no_saving():
            if tokens.shape[1] == 1 and start > 0 and not self.training:   # one new token:
                # the embeddings' sum (tok + pos, as _blocks adds them; drop is off in eval),
                # then each block's fused step (Block.decode)
                x = tr.wte.weight.data[tokens[:, 0]] + tr.wpe.weight.data[start]   # (B, C)
                for block, cache in zip(tr.h, caches):
                    x = block.decode(x, cache, start)
            else:
                x = self._blocks(tokens, start, caches)[:, -1]      # (B, C): the last row
            return self.lm_head(tr.ln_f(x))                         # (B, V): the next token

    @staticmethod
    def _sample(logits, temperature, top_k, rng):
        """One token id per row (B,) from softmax(logits / temperature) restricted to the
        top_k largest logits (ties at the k-th included, as nanoGPT's filter), in float64."""
        z = logits.astype(np.float64)                               # (B, V)
        # the row max subtracted before dividing: z <= 0 with the max exactly 0, so that no
        # temperature overflows (softmax and the top_k order do not change)
        with np.errstate(over="ignore"):                            # -inf: probability 0
            z = (z - z.max(axis=-1, keepdims=True)) / temperature
        n = z.shape[-1]
        if top_k is not None and top_k < n:
            kth = np.partition(z, n - top_k, axis=-1)[:, n - top_k, None]   # (B, 1)
            z[z < kth] = -np.inf
        # (the ufuncs' own methods: a token's sampling is a dozen calls on 65 numbers, and
        # np.cumsum / np.count_nonzero(axis=) cost two to three times as much in Python)
        p = np.exp(z)                                               # unnormalised, max 1
        cdf = np.add.accumulate(p, axis=-1)                         # (B, V)
        u = rng.random(z.shape[0]) * cdf[:, -1]                     # (B,) uniform in [0, Σp)
        choice = (cdf <= u[:, None]).sum(axis=-1)                   # first cdf above u
        last = n - 1 - (p[:, ::-1] > 0).argmax(axis=-1)             # never a token of p = 0
        return np.minimum(choice, last).astype(np.int64)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=None):
        """idx (B, T) followed by ``max_new_tokens`` sampled tokens: (B, T + max_new_tokens).

        Each new token is drawn from softmax(logits / temperature) of the last position,
        restricted to the ``top_k`` largest logits when given (``top_k=1``: greedy), with
        ``numpy.random.default_rng(seed)`` (an int seed, a Generator or None): the same seed
        gives the same tokens. Runs in eval mode (no dropout) and leaves the mode as it was.

        KV cache: every layer gets a key and a value cache (B, nh, block_size, hs), allocated
        once; a prefill pass runs the context through the blocks (on the fused engine) and
        writes its keys and values there; each new token then runs only its own row through
        the blocks, writing its key and value at its position and attending over the cache
        (scaled_dot_product_attention_with_kv_cache: the cache's keys split across the
        threads, merged by logsumexp) -- the prefix is not recomputed, nor copied. Context longer than block_size: as nanoGPT, the model sees only the last
        block_size tokens; once the sequence exceeds block_size, every further step crops it
        to the last block_size tokens and runs a fresh prefill over them (the learned
        positions of the kept tokens shift by one each step, so the cached keys and values
        are no longer theirs). idx may be longer than block_size (cropped at once).
        """
        cfg, tr = self.config, self.transformer
        idx = _checks.token_ids("idx", idx, cfg.vocab_size)                  # (B, T), any T
        max_new_tokens = _checks.size("max_new_tokens", max_new_tokens)
        temperature = _checks.positive_real("temperature", temperature)
        if top_k is not None:
            top_k = _checks.size("top_k", top_k, 1)
        rng = _checks.generator(seed, "seed")
        block_size, training = cfg.block_size, self.training
        out = [idx[:, i] for i in range(idx.shape[1])]              # the tokens, column by column
        if max_new_tokens == 0:
            return idx
        self.eval()
        try:
            hs = cfg.n_embd // cfg.n_head                           # every layer's (k, v) cache
            caches = [tuple(np.empty((idx.shape[0], cfg.n_head, block_size, hs),
                                     tr.wte.weight.dtype) for _ in "kv") for _ in tr.h]
            context = idx[:, -block_size:]
            logits = self._decode(context, 0, caches)               # prefill
            length = context.shape[1]                               # tokens in the cache
            for step in range(max_new_tokens):
                token = self._sample(logits, temperature, top_k, rng)   # (B,)
                out.append(token)
                if step == max_new_tokens - 1:
                    break                                           # no forward for the last
                if length < block_size:                             # the new row only
                    logits = self._decode(token[:, None], length, caches)
                    length += 1
                else:                                               # crop, prefill again
                    context = np.stack(out[-block_size:], axis=1)   # (B, block_size)
                    logits = self._decode(context, 0, caches)
        finally:
            self.train(training)
        return np.stack(out, axis=1)                                # (B, T + max_new_tokens)

    def extra_repr(self):
        c = self.config
        return (f"block_size={c.block_size}, vocab_size={c.vocab_size}, n_layer={c.n_layer}, "
                f"n_head={c.n_head}, n_embd={c.n_embd}, dropout={c.dropout}, bias={c.bias}")
