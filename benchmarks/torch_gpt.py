"""nanoGPT's GPT written from torch.nn parts: the PyTorch peer of ``npattn.models.GPT``.

One copy, used by ``tests/test_gpt.py`` (the oracle) and ``benchmarks/bench_gpt.py`` (the
peer). The architecture is nanoGPT's ``model.py``: Embedding wte and wpe, pre-LayerNorm blocks
with an optional-bias LayerNorm, one c_attn Linear split into q, k, v,
``F.scaled_dot_product_attention(is_causal=True)``, exact ``F.gelu``, lm_head tied to wte.
Differences from nanoGPT, none of which changes a number: no dropout modules (the tests and
benchmarks run it at p = 0), no init (weights are loaded through ``load_state_dict`` under
nanoGPT's names), and ``forward`` returns every position's logits.

``decode(tokens, start, caches)`` is KV-cached inference written the way npattn's
``GPT._decode`` is: the new tokens' rows only, each layer appending its keys and values to its
cache and attending over it with ``F.scaled_dot_product_attention`` (causal for a prefill, none
needed for a single new token, which sees every cached key). :func:`greedy` is the loop
``GPT.generate(..., top_k=1)`` runs: prefill, then one token at a time.
"""


def torch_gpt(torch, cfg):
    """A fresh nanoGPT model for ``cfg`` (an npattn GPTConfig, or anything with its fields)."""
    nn, F = torch.nn, torch.nn.functional

    class LayerNorm(nn.Module):                         # nanoGPT's: the bias is optional
        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
            self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

        def _heads(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=2)
            return [z.view(b, t, cfg.n_head, c // cfg.n_head).transpose(1, 2)
                    for z in (q, k, v)]

        def _merge(self, y):
            b, _, t, _ = y.shape
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, cfg.n_embd))

        def forward(self, x):
            q, k, v = self._heads(x)
            return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))

        def decode(self, x, cache):
            q, k, v = self._heads(x)
            if cache[0] is not None:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
            # a prefill (empty cache) is causal; one new query sees every cached key
            causal = q.shape[2] > 1
            if causal and k.shape[2] != q.shape[2]:
                raise ValueError("decode: several new tokens after a prefill are not "
                                 "supported here (bottom-right causal alignment)")
            return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=causal))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
            self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias)
            self.attn = CausalSelfAttention()
            self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

        def decode(self, x, cache):
            x = x + self.attn.decode(self.ln_1(x), cache)
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList([Block() for _ in range(cfg.n_layer)]),
                ln_f=LayerNorm(cfg.n_embd, cfg.bias)))
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight          # weight tying

        def forward(self, idx, targets=None):
            t = idx.shape[1]
            pos = torch.arange(t, dtype=torch.long)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            loss = None
            if targets is not None:
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=-1)
            return logits, loss

        def decode(self, tokens, start, caches):
            """The logits (B, V) of the last of ``tokens`` (B, L) at positions start ..."""
            pos = torch.arange(start, start + tokens.shape[1], dtype=torch.long)
            x = self.transformer.wte(tokens) + self.transformer.wpe(pos)
            for block, cache in zip(self.transformer.h, caches):
                x = block.decode(x, cache)
            return self.lm_head(self.transformer.ln_f(x[:, -1]))

    return TorchGPT()


def greedy(torch, model, idx, max_new_tokens):
    """KV-cached greedy generation, (B, T + max_new_tokens) int64, within block_size (the
    benchmarks' prompts and lengths fit): prefill, then one token per step."""
    with torch.no_grad():
        caches = [[None, None] for _ in model.transformer.h]
        logits = model.decode(idx, 0, caches)
        out = [idx]
        length = idx.shape[1]
        for step in range(max_new_tokens):
            token = torch.argmax(logits, dim=-1, keepdim=True)           # (B, 1)
            out.append(token)
            if step < max_new_tokens - 1:
                logits = model.decode(token, length, caches)
                length += 1
        return torch.cat(out, dim=1)
