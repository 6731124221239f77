"""``npattn gpt train`` and ``npattn gpt sample``: a character-level GPT, trained and sampled.

``train`` reads a text, makes its vocabulary the sorted set of the characters in it (one token
per character, as nanoGPT's ``shakespeare_char``), splits the token stream 90/10 into training
and validation data, and trains :class:`npattn.models.GPT` with AdamW on random windows of
``block_size`` characters, each target the next character::

    text ──vocabulary──▶ ids (N,) ──90/10──▶ train, val
    x = train[i : i+T], y = train[i+1 : i+T+1]   for B random i (a seeded NumPy generator)
    logits, loss = model(x, y); model.backward(); AdamW.step()

It prints, every ``--eval-interval`` steps, the train and validation loss (each the mean over
``--eval-iters`` random batches, in eval mode), the training throughput in tokens/s and the
time left, and writes a checkpoint ``.npz`` then and at the end. ``sample`` loads one and prints
``--prompt`` followed by ``--max-new-tokens`` sampled characters (KV-cached ``generate``).

**The default corpus** is the text of Python's own documentation topics, the module
``pydoc_data.topics`` that ships with CPython (what ``help("assert")`` prints: the language
reference's chapters on statements, expressions, the data model...). It is on every machine
that runs npattn, with no download; it is ~450 KB of English prose with code examples (three
times nanoGPT's tiny Shakespeare), ~100 distinct characters; it does not change within a
Python release. The alternatives were smaller (``this``'s Zen: 850 characters, the LICENSE:
~14 KB and absent from some installs) or mostly code (the standard library's sources).
Its topics are joined in sorted order, so the corpus is the same text on every run of a given
Python. ``--data FILE`` takes any UTF-8 text instead.

**Checkpoints** are ``.npz`` files (NumPy's zip of ``.npy`` arrays, loadable with ``np.load``
without pickles): every entry of ``model.state_dict()`` under nanoGPT's names
(``transformer.h.0.attn.c_attn.weight``...; the tied ``lm_head.weight`` too) plus ``meta``, a
JSON string with the format tag, the GPTConfig, the vocabulary, the dtype and the run's
settings. The zip entries carry a fixed date, so the same seed gives the same file, byte for
byte. A checkpoint is written to a temporary file in the same directory, flushed to disk
(``fsync``) and renamed over the target (``os.replace``, atomic): a crash or Ctrl-C leaves the
previous checkpoint or none, never half of one. Ctrl-C during training stops at once; the
last checkpoint written (at the last evaluation) stays.

Bad input -- a missing or non-UTF-8 ``--data``, a corpus too short for ``--block-size``, a
``--prompt`` with characters outside the vocabulary, a checkpoint with missing, extra or
misshapen arrays -- is refused before anything is written, with a message naming the option
(exit status 2, as argparse's own errors).

**The learning rate** warms up linearly over the first 10 % of the steps (at most 100) to
``--lr``, then decays along a cosine to ``--lr`` / 10 at the last step, as nanoGPT's ``get_lr``
(:func:`lr_schedule`: ``npattn.optim``'s ``LinearLR`` then ``CosineAnnealingLR``).

Not yet here: gradient clipping (``nn.utils.clip_grad_norm_``).
"""
import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zipfile

import numpy as np

from ..models import GPT, GPTConfig
from ..optim import AdamW, CosineAnnealingLR, LinearLR, SequentialLR

FORMAT = "npattn-gpt-char/1"     # the checkpoint's format tag (meta["format"])
META = "meta"                    # the npz entry holding the JSON metadata
DEFAULT_CORPUS = "pydoc_data.topics"
#: A fixed zip entry date (the zip format's earliest): the same arrays give the same file.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)

#: ``npattn gpt train``'s defaults: ~15 s on 2 cores (Zen 4: 300 steps in 13.8 s, val loss 2.06).
DEFAULTS = dict(steps=300, batch_size=16, block_size=64, n_layer=2, n_head=4, n_embd=128,
                dropout=0.0, lr=2e-3, weight_decay=0.1, seed=0, eval_interval=50,
                eval_iters=8, dtype="float32")


class UsageError(Exception):
    """Bad input to a command: ``main`` prints ``<prog>: error: <message>`` and exits with 2."""


# ------------------------------------------------------------------ the text and its tokens

def default_corpus():
    """(text, description) of the default corpus: Python's documentation topics (see the
    module docstring), joined in sorted topic order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise UsageError("the default corpus (Python's pydoc_data.topics) is not in this "
                         "Python installation; give a text file with --data FILE") from None
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return text, f"Python {sys.version.split()[0]}'s documentation topics ({DEFAULT_CORPUS})"


def read_text(path):
    """The UTF-8 text of ``path``; UsageError naming --data when it cannot be read or decoded."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise UsageError(f"argument --data: must be a readable text file; got {path!r} "
                         f"({error.strerror or error})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"argument --data: {path!r} must be UTF-8 text; got byte "
                         f"0x{raw[error.start]:02x} at offset {error.start}, which is not "
                         "UTF-8") from None


class Vocabulary:
    """Characters <-> token ids: id i is the i-th character of ``chars`` (sorted, distinct)."""

    def __init__(self, chars):
        self.chars = "".join(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def of(cls, text):
        return cls(sorted(set(text)))

    def __len__(self):
        return len(self.chars)

    def encode(self, text, argument="--prompt"):
        """Token ids (len(text),) int64; UsageError naming ``argument`` for unknown characters."""
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown[:10])
            raise UsageError(f"argument {argument}: every character must be in the checkpoint's "
                             f"vocabulary of {len(self)} characters; got {len(unknown)} "
                             f"outside it: {shown}{' ...' if len(unknown) > 10 else ''}")
        return np.fromiter((self.index[c] for c in text), np.int64, len(text))

    def decode(self, ids):
        return "".join(self.chars[i] for i in np.asarray(ids).ravel())


def split(ids, block_size):
    """(train, val): the first 90 % of the ids and the last 10 %; UsageError when either is too
    short for one window of ``block_size`` + 1 tokens (inputs and their next tokens)."""
    n = int(0.9 * len(ids))
    train, val = ids[:n], ids[n:]
    shortest = min(len(train), len(val))
    if shortest < block_size + 1:
        raise UsageError(f"argument --block-size: each split of the corpus must hold at least "
                         f"block_size + 1 = {block_size + 1} characters (90 % train, 10 % "
                         f"validation); got a corpus of {len(ids)} characters ({len(train)} "
                         f"train, {len(val)} validation): give a longer --data or a smaller "
                         "--block-size")
    return train, val


def get_batch(data, block_size, batch_size, rng):
    """(x, y), each (B, T) int64: B random windows of data and the same shifted by one."""
    starts = rng.integers(0, len(data) - block_size, size=batch_size)      # (B,)
    offsets = starts[:, None] + np.arange(block_size)                      # (B, T)
    return data[offsets], data[offsets + 1]


# ------------------------------------------------------------------ optimiser and schedule

def optimizer(model, lr, weight_decay, betas=(0.9, 0.99)):
    """nanoGPT's ``configure_optimizers``: AdamW, weight decay on the 2-D weights (the Linear
    weights and both embeddings) and none on the biases and LayerNorm weights. beta2 = 0.99 as
    nanoGPT's character-level config (few tokens per step)."""
    decay = [p for p in model.parameters() if p.data.ndim >= 2]
    rest = [p for p in model.parameters() if p.data.ndim < 2]
    return AdamW([{"params": decay, "weight_decay": weight_decay},
                  {"params": rest, "weight_decay": 0.0}], lr=lr, betas=betas)


def lr_schedule(opt, steps, lr):
    """The scheduler of a ``steps``-step run at peak rate ``lr``: linear warmup over the first
    W = min(100, steps // 10) steps, then cosine decay to lr / 10 at the last step, as
    nanoGPT's ``get_lr``. Step s = 1 .. steps trains at

        lr·s/W                                               s <= W
        lr/10 + (lr - lr/10)·(1 + cos(π·(s - W)/(steps - W)))/2   s > W

    Call ``step()`` after each ``opt.step()``, as in PyTorch: the rate of training step s is
    the scheduler's value at its step e = s - 1. So the warmup is ``LinearLR`` from 1/W to 1
    over W - 1 steps (e = 0 .. W - 1 is s = 1 .. W), and the cosine (``CosineAnnealingLR``,
    T_max = steps - W) takes over at e = W - 1, where both give lr: its step e - (W - 1) is
    s - W. Without a warmup (steps < 10) the cosine alone, already one step in at s = 1.
    """
    warmup = min(100, steps // 10)
    for group in opt.param_groups:
        group["lr"] = lr
    decay = CosineAnnealingLR(opt, T_max=steps - warmup, eta_min=lr / 10)
    if warmup == 0:
        decay.step()                                    # s = 1 is the cosine's step 1
        return decay
    ramp = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return SequentialLR(opt, [ramp, decay], milestones=[warmup - 1])


def estimate_loss(model, data, block_size, batch_size, iters, rng):
    """Mean loss over ``iters`` random batches of ``data``, in eval mode (no dropout)."""
    model.eval()
    try:
        losses = [float(model(*get_batch(data, block_size, batch_size, rng))[1])
                  for _ in range(iters)]
    finally:
        model.train()
    return float(np.mean(losses))


# ------------------------------------------------------------------ checkpoints

def write_npz(file, arrays):
    """The arrays into the open binary ``file`` as an uncompressed .npz (what ``np.savez``
    writes, with a fixed entry date so that equal arrays give equal bytes)."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=ZIP_DATE)
            with archive.open(info, "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asanyarray(array), allow_pickle=False)


def atomic_write(path, arrays):
    """Write ``arrays`` to ``path`` so that ``path`` is never half-written: into a temporary file
    in the same directory, fsync'ed, then ``os.replace``'d over ``path`` (atomic on POSIX and
    Windows). On any error or KeyboardInterrupt the temporary file is removed and ``path`` is
    as it was."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)          # mkstemp's 0600 -> what open() would give
        with os.fdopen(fd, "wb") as f:
            write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:                                   # the rename itself to disk (POSIX; best effort)
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def checkpoint_arrays(model, vocab, settings):
    """The npz entries of a checkpoint: the state_dict and the JSON ``meta``."""
    meta = dict(format=FORMAT, config=dict(vars(model.config)), vocab=vocab.chars,
                dtype=np.dtype(model.transformer.wte.weight.dtype).name, **settings)
    arrays = {name: np.ascontiguousarray(a) for name, a in model.state_dict().items()}
    arrays[META] = np.array(json.dumps(meta, ensure_ascii=False, sort_keys=True))
    return arrays


def save_checkpoint(path, model, vocab, settings):
    atomic_write(path, checkpoint_arrays(model, vocab, settings))


def load_checkpoint(path, argument="--checkpoint"):
    """(model, vocab, meta) from a checkpoint; UsageError naming ``argument``, the file and the
    offending key when it is not one this command wrote for this model."""
    where = f"argument {argument}: {path!r}"
    try:
        archive = np.load(path, allow_pickle=False)
    except OSError as error:
        raise UsageError(f"argument {argument}: must be a readable file; got {path!r} "
                         f"({error.strerror or error})") from None
    except (ValueError, zipfile.BadZipFile, EOFError) as error:
        raise UsageError(f"{where} must be an .npz checkpoint of npattn gpt train; got a file "
                         f"NumPy cannot load ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise UsageError(f"{where} must be an .npz checkpoint of npattn gpt train; got a "
                         "single .npy array")
    with archive:
        if META not in archive.files:
            raise UsageError(f"{where} must hold the key {META!r} (an npattn gpt checkpoint); "
                             f"got keys {sorted(archive.files)[:5]}...")
        try:
            meta = json.loads(str(archive[META]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            config = GPTConfig(**meta["config"])
            vocab = Vocabulary(meta["vocab"])
            if len(vocab) != config.vocab_size or len(set(vocab.chars)) != len(vocab):
                raise ValueError(f"a vocabulary of {len(vocab)} characters for vocab_size "
                                 f"{config.vocab_size}")
            dtype = np.dtype(meta["dtype"])
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise UsageError(f"{where}: its key {META!r} must describe an npattn gpt model; "
                             f"got {error}") from None
        model = GPT(config, dtype=dtype, rng=0)
        expected = {name: a.shape for name, a in model.state_dict().items()}
        weights = [k for k in archive.files if k != META]
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise UsageError(f"{where} must hold the arrays of its config ({config.n_layer} "
                             f"layer(s), n_embd {config.n_embd}); got missing keys {missing}, "
                             f"unexpected keys {unexpected}")
        state = {}
        for name in expected:
            array = archive[name]
            if array.shape != expected[name] or array.dtype != dtype:
                raise UsageError(f"{where}: key {name!r} must be a {dtype} array of shape "
                                 f"{expected[name]}; got {array.dtype} {array.shape}")
            state[name] = array
    try:
        model.load_state_dict(state)
    except ValueError as error:                      # e.g. the two tied names differ
        raise UsageError(f"{where}: {error}") from None      # (its own "; got ...")
    model.eval()
    return model, vocab, meta


def fingerprint(model):
    """A short hash of every parameter's bits (equal fingerprints: bitwise-equal models)."""
    digest = hashlib.sha256()
    for name, array in model.state_dict().items():
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------ train

def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def prepare(data=None, block_size=DEFAULTS["block_size"]):
    """(text, description, vocab, train ids, val ids): everything train needs from its input,
    validated before any model is built or file written."""
    if data is None:
        text, description = default_corpus()
    else:
        text, description = read_text(data), repr(data)
    if not text:
        raise UsageError(f"argument --data: the corpus must not be empty; got {description} "
                         "with 0 characters")
    vocab = Vocabulary.of(text)
    ids = vocab.encode(text, "--data")
    train_ids, val_ids = split(ids, block_size)
    return text, description, vocab, train_ids, val_ids


def train(data=None, out="gpt.npz", steps=DEFAULTS["steps"], batch_size=DEFAULTS["batch_size"],
          block_size=DEFAULTS["block_size"], n_layer=DEFAULTS["n_layer"],
          n_head=DEFAULTS["n_head"], n_embd=DEFAULTS["n_embd"], dropout=DEFAULTS["dropout"],
          lr=DEFAULTS["lr"], weight_decay=DEFAULTS["weight_decay"], seed=DEFAULTS["seed"],
          eval_interval=DEFAULTS["eval_interval"], eval_iters=DEFAULTS["eval_iters"],
          dtype=DEFAULTS["dtype"], sample_chars=200, write=print):
    """Train a character-level GPT on ``data`` (a path; None: the default corpus) and write the
    checkpoint ``out`` at every evaluation and at the end. Returns a dict of the losses, the
    model, the vocabulary, timings and ``lrs``, each step's learning rate. Raises UsageError
    on bad input, before writing."""
    text, description, vocab, train_ids, val_ids = prepare(data, block_size)
    if os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise UsageError(f"argument --out: must be a file in an existing directory; got {out!r}")
    config = GPTConfig(block_size=block_size, vocab_size=len(vocab), n_layer=n_layer,
                       n_head=n_head, n_embd=n_embd, dropout=dropout, bias=True)
    # one seed, independent streams: weights, dropout masks, training batches, evaluation
    model = GPT(config, dtype=np.dtype(dtype), rng=np.random.default_rng([seed, 0]),
                seed=np.random.default_rng([seed, 1]))
    batches = np.random.default_rng([seed, 2])
    opt = optimizer(model, lr, weight_decay)
    schedule = lr_schedule(opt, steps, lr)
    settings = dict(corpus=description, steps=steps, batch_size=batch_size, lr=lr,
                    weight_decay=weight_decay, seed=seed)
    n_params = sum(p.data.size for p in model.parameters())
    write(f"corpus: {description}: {len(text):,} characters, vocabulary of {len(vocab)} "
          f"({len(train_ids):,} train, {len(val_ids):,} validation)")
    write(f"model: {n_layer} layer{'s' if n_layer > 1 else ''}, {n_head} heads, "
          f"n_embd {n_embd}, block {block_size}, "
          f"{n_params:,} parameters, {np.dtype(dtype).name}; {steps} steps of batch "
          f"{batch_size}, AdamW lr {lr:g} (warmup, cosine to {lr / 10:g}), seed {seed}")
    history = []
    tokens_per_step = batch_size * block_size
    start = last_time = time.perf_counter()
    train_seconds, last_step = 0.0, 0
    lrs = []                                                    # the rate of each step
    for step in range(1, steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        x, y = get_batch(train_ids, block_size, batch_size, batches)
        model.zero_grad()
        _, loss = model(x, y)
        model.backward()
        opt.step()
        schedule.step()
        if step % eval_interval == 0 or step == steps:
            now = time.perf_counter()
            train_seconds += now - last_time
            rate = (step - last_step) * tokens_per_step / max(now - last_time, 1e-9)
            evals = np.random.default_rng([seed, 3, step])
            train_loss = estimate_loss(model, train_ids, block_size, batch_size, eval_iters,
                                       evals)
            val_loss = estimate_loss(model, val_ids, block_size, batch_size, eval_iters, evals)
            save_checkpoint(out, model, vocab, dict(settings, step=step))
            elapsed = time.perf_counter() - start
            left = elapsed / step * (steps - step)
            history.append(dict(step=step, loss=float(loss), train_loss=train_loss,
                                val_loss=val_loss, tokens_per_second=rate))
            write(f"step {step:>{len(str(steps))}}/{steps}  train loss {train_loss:.4f}  "
                  f"val loss {val_loss:.4f}  {rate:,.0f} tokens/s  {_clock(elapsed)} elapsed, "
                  f"{_clock(left)} left")
            last_time, last_step = time.perf_counter(), step
    seconds = time.perf_counter() - start
    digest = fingerprint(model)
    final = history[-1]
    write(f"done: {steps} steps in {seconds:.1f} s ({steps * tokens_per_step / train_seconds:,.0f}"
          f" training tokens/s), val loss {final['val_loss']:.4f}; checkpoint {out} "
          f"(weights fingerprint {digest})")
    sample_text = None
    if sample_chars:
        prompt = "\n" if "\n" in vocab.index else vocab.chars[0]
        ids = model.generate(vocab.encode(prompt)[None], sample_chars, top_k=None, seed=seed)
        sample_text = vocab.decode(ids[0, 1:])
        write(f"a sample ({sample_chars} characters, npattn gpt sample --checkpoint {out} for "
              f"more):\n{sample_text}")
    return dict(history=history, model=model, vocab=vocab, seconds=seconds, fingerprint=digest,
                sample=sample_text, lrs=lrs)


# ------------------------------------------------------------------ sample

def sample(checkpoint, prompt=None, max_new_tokens=500, temperature=1.0, top_k=None, seed=0):
    """``prompt`` followed by ``max_new_tokens`` characters sampled from the checkpoint's
    model (the default prompt: a newline, or the vocabulary's first character without one)."""
    model, vocab, _ = load_checkpoint(checkpoint)
    if prompt is None:
        prompt = "\n" if "\n" in vocab.index else vocab.chars[0]
    if not prompt:
        raise UsageError("argument --prompt: must hold at least one character; got ''")
    ids = vocab.encode(prompt, "--prompt")
    out = model.generate(ids[None], max_new_tokens, temperature=temperature, top_k=top_k,
                         seed=seed)
    return prompt + vocab.decode(out[0, len(ids):])


# ------------------------------------------------------------------ the command line

def _int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}; got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}; got {value}")
        return value
    return parse


def _real(low, high=None, low_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            high is None or value < high)
        if not ok:
            bounds = (f"{'>' if low_open else '>='} {low:g}"
                      + ("" if high is None else f" and < {high:g}"))
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}; got {text!r}")
        return value
    return parse


def build_parser(prog="npattn gpt"):
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A character-level GPT (nanoGPT's model on npattn): train one on a text, "
                    "then sample from it.",
        epilog="examples:\n"
               f"  {prog} train                          Python's own docs, ~1-2 min\n"
               f"  {prog} train --data input.txt --steps 2000 --out shakespeare.npz\n"
               f"  {prog} sample --checkpoint gpt.npz --prompt 'The ' --max-new-tokens 300")
    commands = parser.add_subparsers(dest="action", title="commands", metavar="<command>")
    parser.commands = commands.choices            # name -> its parser (for its errors)
    d = DEFAULTS
    t = commands.add_parser("train", help="train a character-level GPT; write a checkpoint",
                            description=__doc__.split("\n\n")[1])
    t.add_argument("--data", metavar="FILE",
                   help=f"UTF-8 text to train on (default: Python's {DEFAULT_CORPUS})")
    t.add_argument("--out", metavar="CKPT.npz", default="gpt.npz",
                   help="checkpoint to write (default gpt.npz), atomically")
    t.add_argument("--steps", type=_int_at_least(1), default=d["steps"],
                   help=f"training steps (default {d['steps']})")
    t.add_argument("--batch-size", type=_int_at_least(1), default=d["batch_size"],
                   help=f"sequences per step (default {d['batch_size']})")
    t.add_argument("--block-size", type=_int_at_least(1), default=d["block_size"],
                   help=f"context length in characters (default {d['block_size']})")
    t.add_argument("--n-layer", type=_int_at_least(1), default=d["n_layer"],
                   help=f"transformer blocks (default {d['n_layer']})")
    t.add_argument("--n-head", type=_int_at_least(1), default=d["n_head"],
                   help=f"attention heads (default {d['n_head']})")
    t.add_argument("--n-embd", type=_int_at_least(1), default=d["n_embd"],
                   help=f"embedding width, a multiple of --n-head (default {d['n_embd']})")
    t.add_argument("--dropout", type=_real(0.0, 1.0), default=d["dropout"],
                   help=f"dropout probability (default {d['dropout']})")
    t.add_argument("--lr", type=_real(0.0, low_open=True), default=d["lr"],
                   help=f"peak AdamW learning rate (default {d['lr']:g})")
    t.add_argument("--weight-decay", type=_real(0.0), default=d["weight_decay"],
                   help=f"AdamW weight decay of the 2-D weights (default {d['weight_decay']})")
    t.add_argument("--seed", type=_int_at_least(0), default=d["seed"],
                   help="seeds weights, batches and dropout: same seed, same checkpoint")
    t.add_argument("--eval-interval", type=_int_at_least(1), default=d["eval_interval"],
                   help=f"steps between evaluations and checkpoints (default "
                        f"{d['eval_interval']})")
    t.add_argument("--eval-iters", type=_int_at_least(1), default=d["eval_iters"],
                   help=f"batches per loss estimate (default {d['eval_iters']})")
    t.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="Numba threads (default: all cores); results do not depend on it")
    t.add_argument("--dtype", choices=("float32", "float64"), default=d["dtype"],
                   help=f"parameter dtype (default {d['dtype']})")
    s = commands.add_parser("sample", help="print text sampled from a checkpoint",
                            description="Load a checkpoint of npattn gpt train and print the "
                                        "prompt followed by sampled characters.")
    s.add_argument("--checkpoint", metavar="CKPT.npz", required=True,
                   help="a checkpoint written by npattn gpt train")
    s.add_argument("--prompt", help="text to continue (default: a newline)")
    s.add_argument("--max-new-tokens", type=_int_at_least(0), default=500,
                   help="characters to generate (default 500)")
    s.add_argument("--temperature", type=_real(0.0, low_open=True), default=1.0,
                   help="softmax temperature, > 0 (default 1.0; lower: more conservative)")
    s.add_argument("--top-k", type=_int_at_least(1), default=None,
                   help="sample among the k likeliest characters only (1: greedy)")
    s.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="seeds the sampling: same seed, same text")
    s.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="Numba threads (default: all cores)")
    return parser


def _set_threads(parser, threads):
    if threads is None:
        return
    import numba
    most = numba.config.NUMBA_NUM_THREADS
    if threads > most:
        parser.error(f"argument --threads: must be an int in [1, {most}] (Numba's "
                     f"NUMBA_NUM_THREADS); got {threads}")
    numba.set_num_threads(threads)


def main(argv=None, prog="npattn gpt"):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.action is None:
        parser.print_help()
        return 2
    sub = f"{prog} {args.action}"
    _set_threads(parser.commands[args.action], args.threads)
    try:
        if args.action == "train":
            if args.n_embd % args.n_head:
                raise UsageError(f"argument --n-embd: must be a multiple of --n-head = "
                                 f"{args.n_head}; got {args.n_embd}")
            options = {k: v for k, v in vars(args).items() if k not in ("action", "threads")}
            try:
                train(**options)
            except KeyboardInterrupt:
                print(f"\n{sub}: interrupted; {args.out} holds the last checkpoint written "
                      "(at the last evaluation), if any", file=sys.stderr)
                return 130
        else:
            text = sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                          args.top_k, args.seed)
            sys.stdout.write(text + "\n")
    except UsageError as error:
        parser.commands[args.action].error(str(error))      # usage, message; exit status 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
