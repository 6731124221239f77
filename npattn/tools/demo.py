"""``npattn demo``: train a small attention model to reverse sequences of digits, by hand.

The model is the article's pipeline with a head on top::

    tokens (B, L) ──Embedding──▶ (B, L, E) ──+ PositionalEncoding──▶ x (B, L, E)
      ──MultiheadAttention(x, x, x)──▶ (B, L, E) ──Linear(E, 10)──▶ logits (B, L, 10)

and the task is to output the input reversed: position i must copy the digit at position
L-1-i. Nothing in a token's own embedding says where its answer is; the positional encoding
is the only clue, and attention has to learn to look from position i to position L-1-i, so a
model that trains to ~100% has learnt an attention pattern, not a lookup table.

Training is the loop PyTorch users know, written out: forward, ``cross_entropy``, then the
backward pass called module by module in reverse (``head.backward`` → ``attn.backward`` →
``pos.backward`` → ``embedding.backward``; self-attention's input gradient is
dquery + dkey + dvalue), then ``Adam.step()``. Same ``--seed``, same numbers, at any
``--threads``.
"""
import argparse
import hashlib
import time

import numpy as np

from ..functional.cross_entropy import cross_entropy, cross_entropy_backward
from .. import nn
from ..optim import Adam

VOCAB = 10  # the digits 0-9


def reversal_batch(rng, batch, length):
    """Random digit sequences (B, L) and their reversals, the targets (B, L)."""
    tokens = rng.integers(0, VOCAB, size=(batch, length))  # (B, L)
    return tokens, tokens[:, ::-1].copy()                  # (B, L), (B, L)


class ReversalModel(nn.Module):
    """Embedding + PositionalEncoding -> MultiheadAttention (self-attention) -> Linear."""

    def __init__(self, d_model=64, num_heads=4, max_len=64, dropout=0.1, *, seed=0,
                 dtype=np.float32):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.embedding = nn.Embedding(VOCAB, d_model, dtype=dtype, rng=rng)
        self.pos = nn.PositionalEncoding(d_model, max_len, dropout, dtype=dtype,
                                         seed=int(rng.integers(2**31)))
        self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True, dtype=dtype,
                                          rng=rng, seed=int(rng.integers(2**31)))
        self.head = nn.Linear(d_model, VOCAB, dtype=dtype, rng=rng)

    def forward(self, tokens):
        x = self.pos(self.embedding(tokens))                        # (B, L, E)
        a, _ = self.attn(x, x, x, need_weights=False)               # (B, L, E)
        return self.head(a)                                         # (B, L, VOCAB)

    def backward(self, dlogits):
        da = self.head.backward(dlogits)                            # (B, L, E)
        dquery, dkey, dvalue = self.attn.backward(da)               # x fed all three
        dx = self.pos.backward(dquery + dkey + dvalue)              # (B, L, E)
        self.embedding.backward(dx)                                 # tokens have no gradient


def accuracy(model, tokens, targets):
    """Token accuracy and whole-sequence accuracy of the model's argmax predictions."""
    model.eval()
    predicted = np.argmax(model(tokens), axis=-1)                   # (B, L)
    model.train()
    correct = predicted == targets
    return float(correct.mean()), float(correct.all(axis=1).mean())


def train(steps=1000, length=12, batch=64, d_model=64, num_heads=4, lr=3e-3, seed=0,
          eval_size=2000, log_every=100, out=print):
    """Train a ReversalModel; returns a dict of the losses, accuracies and timings."""
    model = ReversalModel(d_model, num_heads, max_len=max(length, 1), seed=seed)
    optimizer = Adam(model.parameters(), lr=lr)
    data = np.random.default_rng([seed, 1])                         # the training stream
    held_out = reversal_batch(np.random.default_rng([seed, 2]), eval_size, length)
    n_params = sum(p.data.size for p in model.parameters())
    out(f"reverse {length} digits: d_model={d_model}, heads={num_heads}, batch={batch}, "
        f"{steps} steps of Adam(lr={lr} decaying to {lr / 10:g}), {n_params:,} parameters, seed {seed}")
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, targets = reversal_batch(data, batch, length)
        logits = model(tokens)                                      # (B, L, VOCAB)
        flat = logits.reshape(-1, VOCAB)                            # (B·L, VOCAB)
        loss = cross_entropy(flat, targets.reshape(-1))
        dflat = cross_entropy_backward(np.ones((), flat.dtype), flat, targets.reshape(-1))
        model.zero_grad()
        model.backward(dflat.reshape(logits.shape))
        optimizer.param_groups[0]["lr"] = lr * (1 - 0.9 * (step - 1) / max(steps - 1, 1))
        optimizer.step()                                            # lr decays linearly to lr/10
        losses.append(float(loss))
        if step % log_every == 0 or step == steps:
            token_acc, _ = accuracy(model, *held_out)
            out(f"  step {step:>5}/{steps}  loss {np.mean(losses[-log_every:]):.4f}  "
                f"held-out token accuracy {token_acc:7.2%}  {time.perf_counter() - start:6.1f} s")
    seconds = time.perf_counter() - start
    token_acc, seq_acc = accuracy(model, *held_out)
    example = held_out[0][:1]
    predicted = np.argmax(model.eval()(example), axis=-1)
    out(f"  e.g. input {''.join(map(str, example[0]))} -> "
        f"{''.join(map(str, predicted[0]))} (target {''.join(map(str, example[0, ::-1]))})")
    out(f"held-out accuracy over {eval_size} new sequences: {token_acc:.2%} of tokens, "
        f"{seq_acc:.2%} of whole sequences; training took {seconds:.1f} s")
    digest = fingerprint(model)
    out(f"trained weights fingerprint {digest} (the same for the same seed, at any --threads; "
        f"it depends on {compile_target()})")
    return dict(losses=losses, token_accuracy=token_acc, sequence_accuracy=seq_acc,
                seconds=seconds, model=model, fingerprint=digest)


def fingerprint(model):
    """A short hash of every parameter's bits: equal fingerprints mean bitwise-equal models."""
    digest = hashlib.sha256()
    for name, array in model.state_dict().items():
        digest.update(name.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def compile_target():
    """What the fingerprint depends on besides the seed: the CPU the kernels were compiled for
    (Numba's target name and whether it has AVX-512, which decides how LLVM vectorises the
    reductions that ``reassoc`` lets it reorder) and the register tiles in force. The tiles
    change no bits that were measured (README, The demo, measured), but are named to be sure."""
    import numba
    from ..kernels import tiles
    if numba.config.DISABLE_JIT:
        return "NumPy's scalar arithmetic: NUMBA_DISABLE_JIT=1 compiles nothing"
    features = tiles.cpu_features()
    vectors = "AVX-512" if "avx512f" in features else "AVX2" if "avx2" in features else "no AVX2"
    return (f"the compile target {tiles.cpu_name()} ({vectors}), {tiles.isa_in_force()} tiles: "
            f"README, The demo, measured")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="npattn demo",
        description="Train Embedding + PositionalEncoding -> MultiheadAttention -> Linear to "
                    "reverse digit sequences with npattn's hand-written backward passes.")
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seeds weights, data and dropout")
    parser.add_argument("--threads", type=int, default=None,
                        help="Numba threads (default: all cores); results do not depend on it")
    parser.add_argument("--length", type=int, default=12, help="sequence length (default 12)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--min-accuracy", type=float, default=0.99,
                        help="exit with status 1 when held-out token accuracy is below this")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import numba
        numba.set_num_threads(args.threads)
    result = train(steps=args.steps, length=args.length, batch=args.batch, lr=args.lr,
                   seed=args.seed)
    if result["token_accuracy"] < args.min_accuracy:
        print(f"below the target of {args.min_accuracy:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
