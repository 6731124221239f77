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
(``transformer.h.0.attn.c_attn.weight``...; the tied ``lm_head.weight`` too), AdamW's moments
(``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>``), ``meta``, a JSON string with
the format tag (``npattn-gpt-char/2``), the GPTConfig, the vocabulary, the dtype, the run's
settings and its training state (step, the optimiser's options and steps, the learning-rate
schedule's state, the batch and dropout generators' states), and ``checksum``, the sha256 of
all the others. The zip entries carry a fixed date, so the same seed gives the same file, byte
for byte. A checkpoint is written to a temporary file in the same directory, flushed to disk
(``fsync``) and renamed over the target (``os.replace``, atomic): a crash leaves the previous
checkpoint or none, never half of one. A truncated, corrupted (checksum) or foreign file is
refused with one line naming it; format 1 files (before resuming existed) still sample.

**Resuming**: ``--resume CKPT`` continues the run of CKPT from its step to ``--steps`` (the run's
total, as nanoGPT's ``max_iters``); the run's options are taken from the file (given ones must
match), and k steps + resume + k steps write the bytes of 2k steps in one run. ``--stop-at
STEP`` ends a run early with a checkpoint (a cluster job's time limit). SIGINT (Ctrl-C) or
SIGTERM during training finishes the current step, writes a checkpoint and exits with 130 or
143; that checkpoint resumes.

**Data-parallel**: under ``mpiexec -n N`` (or ``srun``) each rank trains on its B/N rows of the
global batch of ``--batch-size`` B (every rank draws the global batch's windows from the same
generator and keeps its slice, so the run sees the batches of one process), the gradients
averaged across the ranks in a fixed order (:mod:`npattn.distributed`); only rank 0 prints,
evaluates and writes. ``--zero`` shards AdamW's moments across the ranks (ZeRO-1) with the
same results. Errors on any rank, or options that differ between ranks, stop every rank with
exit status 2 before training starts.

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
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import zipfile

import numpy as np

from .. import distributed
from ..functional.attention import attention
from ..functional.linear import linear
from ..models import GPT, GPTConfig
from ..optim import AdamW, CosineAnnealingLR, LinearLR, SequentialLR

FORMAT = "npattn-gpt-char/2"     # the checkpoint's format tag (meta["format"])
OLD_FORMATS = ("npattn-gpt-char/1",)   # loadable by sample; no training state, no checksum
META = "meta"                    # the npz entry holding the JSON metadata
CHECKSUM = "checksum"            # the npz entry holding the sha256 of all the others
OPTIMIZER = "optimizer"          # AdamW's moments: optimizer.exp_avg.<parameter name>...
MOMENTS = ("exp_avg", "exp_avg_sq")
#: The options that define a run: a resumed run takes them from the checkpoint, and refuses
#: a different value (the run would not be the one that was stopped).
RUN_OPTIONS = ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "dropout",
               "lr", "weight_decay", "seed", "dtype")
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


def digest(arrays):
    """The checkpoint's checksum: sha256 over every entry but ``checksum`` itself, in name order
    (name, dtype, shape and bytes of each), as hex."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        if name == CHECKSUM:
            continue
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def seal(arrays):
    """``arrays`` with their ``checksum`` entry (re)computed: what a checkpoint is written as."""
    arrays = {k: v for k, v in arrays.items() if k != CHECKSUM}
    arrays[CHECKSUM] = np.array(digest(arrays))
    return arrays


def _by_position(model, opt):
    """The names of ``opt``'s parameters by position (across its groups, as its state dict
    numbers them)."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [names[id(p)] for group in opt.param_groups for p in group["params"]]


def checkpoint_arrays(model, vocab, settings, training=None):
    """The npz entries of a checkpoint: the state_dict, the JSON ``meta`` and the checksum.

    ``training`` (what a resumed run needs) is ``optimizer``: the AdamW state dict
    (``Optimizer.state_dict()``'s layout, whole moments), ``names``: its parameters' names by
    position (``_by_position``), ``schedule``: the scheduler's state
    dict, ``batches``: the batch generator's ``bit_generator.state``, ``generators``: each
    module's dropout generator state, ``world_size``. The moments become the entries
    ``optimizer.exp_avg.<parameter name>`` and ``optimizer.exp_avg_sq.<name>``; the rest is
    JSON in ``meta["training"]`` (floats written by Python's repr: read back exactly)."""
    meta = dict(format=FORMAT, config=dict(vars(model.config)), vocab=vocab.chars,
                dtype=np.dtype(model.transformer.wte.weight.dtype).name, **settings)
    arrays = {name: np.ascontiguousarray(a) for name, a in model.state_dict().items()}
    if training is not None:
        training = dict(training)
        opt = training.pop("optimizer")
        names = training.pop("names")                                 # position -> name
        steps = {}
        for position in sorted(opt["state"]):         # one order, however it was gathered
            entry = opt["state"][position]
            steps[names[position]] = entry["step"]
            for key in MOMENTS:
                arrays[f"{OPTIMIZER}.{key}.{names[position]}"] = np.ascontiguousarray(entry[key])
        training["optimizer"] = dict(
            steps=steps, param_groups=[{k: (list(v) if isinstance(v, tuple) else v)
                                        for k, v in g.items()} for g in opt["param_groups"]])
        meta["training"] = training
    arrays[META] = np.array(json.dumps(meta, ensure_ascii=False, sort_keys=True))
    return seal(arrays)


def save_checkpoint(path, model, vocab, settings, training=None):
    atomic_write(path, checkpoint_arrays(model, vocab, settings, training))


def read_checkpoint(path, argument="--checkpoint"):
    """(meta, arrays) of a checkpoint file, its format and checksum checked; UsageError naming
    ``argument`` and the file, with what is wrong, for anything else (a missing, truncated,
    corrupted or foreign file). Checkpoints of format 1 (no checksum, no training state)
    load too: ``meta["format"]`` says which it is."""
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
        try:                            # a damaged entry fails its zip CRC or its .npy header
            arrays = {name: archive[name] for name in archive.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
            raise UsageError(f"{where} is damaged (truncated or corrupted): "
                             f"{' '.join(str(error).split())}") from None
    try:
        meta = json.loads(str(arrays[META]))
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, expected a JSON object")
        if meta.get("format") not in (FORMAT, *OLD_FORMATS):
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    except (ValueError, TypeError) as error:
        raise UsageError(f"{where}: its key {META!r} must describe an npattn gpt model; "
                         f"got {error}") from None
    if meta["format"] == FORMAT:
        if CHECKSUM not in arrays:
            raise UsageError(f"{where} must hold its checksum (key {CHECKSUM!r}); got none")
        if str(arrays[CHECKSUM]) != digest(arrays):
            raise UsageError(f"{where} is corrupted: its checksum does not match its contents "
                             f"(stored {str(arrays[CHECKSUM])[:16]}..., computed "
                             f"{digest(arrays)[:16]}...)")
    return meta, arrays


def _model_of(meta, arrays, where):
    """The GPT of a checkpoint's meta and arrays, checked; UsageError naming ``where``."""
    try:
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
    weights = [k for k in arrays if k not in (META, CHECKSUM)
               and not k.startswith(OPTIMIZER + ".")]
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise UsageError(f"{where} must hold the arrays of its config ({config.n_layer} "
                         f"layer(s), n_embd {config.n_embd}); got missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    state = {}
    for name in expected:
        array = arrays[name]
        if array.shape != expected[name] or array.dtype != dtype:
            raise UsageError(f"{where}: key {name!r} must be a {dtype} array of shape "
                             f"{expected[name]}; got {array.dtype} {array.shape}")
        state[name] = array
    try:
        model.load_state_dict(state)
    except ValueError as error:                      # e.g. the two tied names differ
        raise UsageError(f"{where}: {error}") from None      # (its own "; got ...")
    return model, vocab


def load_checkpoint(path, argument="--checkpoint"):
    """(model, vocab, meta) from a checkpoint; UsageError naming ``argument``, the file and the
    offending key when it is not one this command wrote for this model."""
    meta, arrays = read_checkpoint(path, argument)
    model, vocab = _model_of(meta, arrays, f"argument {argument}: {path!r}")
    model.eval()
    return model, vocab, meta


def training_state(meta, arrays, model, opt, where):
    """The state dict of ``opt`` (``model``'s AdamW) stored in a checkpoint;
    UsageError naming ``where`` when the file holds none (format 1) or a damaged one."""
    if meta["format"] != FORMAT or "training" not in meta:
        raise UsageError(f"{where} holds no training state (format {meta['format']!r}, "
                         f"written before npattn could resume): it cannot be resumed; "
                         "npattn gpt sample still loads it")
    training = meta["training"]
    try:
        saved = training["optimizer"]
        state = {}
        params = dict(model.named_parameters())
        for position, name in enumerate(_by_position(model, opt)):
            param = params[name]
            if name not in saved["steps"]:
                continue
            entry = {"step": float(saved["steps"][name])}
            for key in MOMENTS:
                array = arrays[f"{OPTIMIZER}.{key}.{name}"]
                if array.shape != param.data.shape or array.dtype != param.data.dtype:
                    raise ValueError(f"{OPTIMIZER}.{key}.{name} is {array.dtype} "
                                     f"{array.shape}, expected {param.data.dtype} "
                                     f"{param.data.shape}")
                entry[key] = array
            state[position] = entry
        return {"state": state, "param_groups": saved["param_groups"]}
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"{where}: its training state is incomplete ({error})") from None


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


class StopSignals:
    """SIGINT and SIGTERM, while training: the first one received is remembered (``signum``)
    instead of interrupting, so that the loop can finish its step and write a checkpoint.
    Restores the previous handlers on exit. Outside the main thread (where Python cannot set
    handlers) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def _handler(self, signum, frame):
        self.signum = self.signum or signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def agree(world, error, options=None):
    """Every rank's verdict before anything collective: raises UsageError on every rank when
    any rank has an ``error`` (the lowest rank's, naming it when not rank 0), or when the
    ranks' ``options`` differ (naming the first that does). A collective call: every rank must
    make it, in the same order, so that no rank waits forever for one that gave up."""
    reports = world.allgather_object((None if error is None else str(error), options))
    for rank, (message, _) in enumerate(reports):
        if message is not None:
            raise UsageError(message if rank == 0 else f"{message} (on rank {rank})")
    first = reports[0][1] or {}
    for rank, (_, theirs) in enumerate(reports[1:], 1):
        for key in sorted(set(first) | set(theirs or {})):
            if first.get(key) != (theirs or {}).get(key):
                raise UsageError(f"argument --{key.replace('_', '-')}: every rank must be given "
                                 f"the same value; got {first.get(key)!r} on rank 0 and "
                                 f"{(theirs or {}).get(key)!r} on rank {rank}")


def resume_options(path, given):
    """``given`` (option -> value or None) completed from the checkpoint ``path``: options
    left out take the checkpoint's values (--data too); a run option (RUN_OPTIONS) given
    with another value is a UsageError, as is a checkpoint that cannot be resumed."""
    meta, _ = read_checkpoint(path, "--resume")
    where = f"argument --resume: {path!r}"
    if meta["format"] != FORMAT or "training" not in meta:
        raise UsageError(f"{where} holds no training state (format {meta['format']!r}, "
                         f"written before npattn could resume): it cannot be resumed; "
                         "npattn gpt sample still loads it")
    try:
        saved = {**{k: meta["config"][k] for k in ("block_size", "n_layer", "n_head",
                                                   "n_embd", "dropout")},
                 **{k: meta[k] for k in ("steps", "batch_size", "lr", "weight_decay", "seed",
                                         "dtype")}}
        data = meta["data"]
    except (KeyError, TypeError) as error:
        raise UsageError(f"{where}: its key {META!r} lacks the run's options ({error})") from None
    options = dict(given)
    for name in RUN_OPTIONS:
        if options.get(name) is None:
            options[name] = saved[name]
        elif options[name] != saved[name]:
            raise UsageError(f"argument --{name.replace('_', '-')}: {path!r} was trained with "
                             f"{saved[name]!r}; got {options[name]!r} (leave it out to continue "
                             "the run as it was)")
    if options.get("data") is None:
        options["data"] = data
    return options


def train(data=None, out="gpt.npz", steps=DEFAULTS["steps"], batch_size=DEFAULTS["batch_size"],
          block_size=DEFAULTS["block_size"], n_layer=DEFAULTS["n_layer"],
          n_head=DEFAULTS["n_head"], n_embd=DEFAULTS["n_embd"], dropout=DEFAULTS["dropout"],
          lr=DEFAULTS["lr"], weight_decay=DEFAULTS["weight_decay"], seed=DEFAULTS["seed"],
          eval_interval=DEFAULTS["eval_interval"], eval_iters=DEFAULTS["eval_iters"],
          dtype=DEFAULTS["dtype"], sample_chars=200, write=print, resume=None, zero=False,
          stop_at=None, world=None):
    """Train a character-level GPT on ``data`` (a path; None: the default corpus) and write the
    checkpoint ``out`` at every evaluation and at the end. Returns a dict of the losses, the
    model, the vocabulary, timings, ``lrs`` (each step's learning rate) and ``stopped`` (the
    signal that stopped the run, 0 if none). Raises UsageError on bad input, before writing.

    ``resume``: a checkpoint of this run to continue from its step (model, AdamW moments,
    schedule, batch and dropout generators). ``stop_at``: stop after this step (a checkpoint is
    written; ``steps`` stays the run's length). SIGINT/SIGTERM stop the run at the next step
    boundary the same way. ``world``: the communicator (default ``distributed.init()``): with
    N ranks each trains on its B/N rows of the global batch, only rank 0 writes; ``zero``
    shards AdamW's state (ZeRO-1).
    """
    world = distributed.init() if world is None else world
    rank, size = world.rank, world.size
    if rank != 0:
        write = _silent
    error = None
    try:                 # everything that can refuse the input, on every rank, then agree
        if batch_size % size:
            raise UsageError(f"argument --batch-size: must be divisible by the number of ranks "
                             f"{size} (each rank trains on batch_size / {size} sequences of the "
                             f"global batch); got {batch_size}")
        text, description, vocab, train_ids, val_ids = prepare(data, block_size)
        if os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise UsageError(f"argument --out: must be a file in an existing directory; got "
                             f"{out!r}")
        config = GPTConfig(block_size=block_size, vocab_size=len(vocab), n_layer=n_layer,
                           n_head=n_head, n_embd=n_embd, dropout=dropout, bias=True)
        # one seed, independent streams: weights, dropout masks, training batches, evaluation
        model = GPT(config, dtype=np.dtype(dtype), rng=np.random.default_rng([seed, 0]),
                    seed=np.random.default_rng([seed, 1]))
        batches = np.random.default_rng([seed, 2])
        opt = optimizer(model, lr, weight_decay)
        schedule = lr_schedule(opt, steps, lr)
        text_digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        first, opt_state = 1, None
        if resume is not None:
            done, opt_state = _resume(resume, model, vocab, text_digest, schedule, batches)
            first = done + 1
            if stop_at is not None and stop_at < first:
                raise UsageError(f"argument --stop-at: must be after the checkpoint's step "
                                 f"{first - 1}; got {stop_at}")
    except UsageError as caught:
        error = caught
    agree(world, error)
    settings = dict(corpus=description, data=data, data_sha256=text_digest, steps=steps,
                    batch_size=batch_size, lr=lr, weight_decay=weight_decay, seed=seed)
    ddp = distributed.DistributedDataParallel(model, world=world)
    sharded = distributed.ZeroRedundancyOptimizer(opt, ddp) if zero else None
    stepper = sharded or opt
    if opt_state is not None:
        stepper.load_state_dict(opt_state)
    n_params = sum(p.data.size for p in model.parameters())
    write(f"corpus: {description}: {len(text):,} characters, vocabulary of {len(vocab)} "
          f"({len(train_ids):,} train, {len(val_ids):,} validation)")
    write(f"model: {n_layer} layer{'s' if n_layer > 1 else ''}, {n_head} heads, "
          f"n_embd {n_embd}, block {block_size}, "
          f"{n_params:,} parameters, {np.dtype(dtype).name}; {steps} steps of batch "
          f"{batch_size}, AdamW lr {lr:g} (warmup, cosine to {lr / 10:g}), seed {seed}")
    if size > 1:
        write(f"data-parallel: {world.name}, {batch_size // size} sequences per rank"
              f"{', ZeRO-1 sharded AdamW' if zero else ''}")
    if first > 1:
        write(f"resumed from {resume} at step {first - 1}")

    def checkpoint(step):                      # collective under ZeRO: every rank calls it
        training = dict(optimizer=stepper.state_dict(), names=_by_position(model, opt),
                        schedule=schedule.state_dict(),
                        batches=batches.bit_generator.state,
                        generators={path: m._generator.bit_generator.state
                                    for path, m in model.named_modules()
                                    if hasattr(m, "_generator")},
                        world_size=size)
        if rank == 0:
            save_checkpoint(out, model, vocab, dict(settings, step=step), training)

    history = []
    rows = batch_size // size                                   # this rank's rows
    tokens_per_step = batch_size * block_size
    start = last_time = time.perf_counter()
    train_seconds, last_step, step = 0.0, first - 1, first - 1
    lrs = []                                                    # the rate of each step
    last = steps if stop_at is None else min(stop_at, steps)
    with StopSignals() as signals:
        for step in range(first, last + 1):
            lrs.append(opt.param_groups[0]["lr"])
            x, y = get_batch(train_ids, block_size, batch_size, batches)   # the global batch
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
            model.zero_grad()
            _, loss = model(x, y)
            ddp.backward()
            stepper.step()
            schedule.step()
            stopped = world.flag(signals.signum)        # all ranks stop at the same step
            if stopped or (step == last and last < steps):
                checkpoint(step)
                how = (f"stopped by {signal.Signals(stopped).name}" if stopped
                       else "stopped (--stop-at)")
                write(f"{how} after step {step}/{steps}; checkpoint {out} (continue with "
                      f"--resume {out})")
                return dict(history=history, model=model, vocab=vocab, stopped=stopped,
                            step=step, lrs=lrs, fingerprint=fingerprint(model), ddp=ddp,
                            optimizer=stepper)
            if step % eval_interval == 0 or step == steps:
                checkpoint(step)
                if rank != 0:
                    continue
                now = time.perf_counter()
                train_seconds += now - last_time
                rate = (step - last_step) * tokens_per_step / max(now - last_time, 1e-9)
                evals = np.random.default_rng([seed, 3, step])
                train_loss = estimate_loss(model, train_ids, block_size, batch_size,
                                           eval_iters, evals)
                val_loss = estimate_loss(model, val_ids, block_size, batch_size, eval_iters,
                                         evals)
                elapsed = time.perf_counter() - start
                left = elapsed / (step - first + 1) * (steps - step)
                history.append(dict(step=step, loss=float(loss), train_loss=train_loss,
                                    val_loss=val_loss, tokens_per_second=rate))
                write(f"step {step:>{len(str(steps))}}/{steps}  train loss {train_loss:.4f}  "
                      f"val loss {val_loss:.4f}  {rate:,.0f} tokens/s  {_clock(elapsed)} "
                      f"elapsed, {_clock(left)} left")
                last_time, last_step = time.perf_counter(), step
    seconds = time.perf_counter() - start
    digest_ = fingerprint(model)
    result = dict(history=history, model=model, vocab=vocab, seconds=seconds,
                  fingerprint=digest_, sample=None, lrs=lrs, stopped=0, step=step, ddp=ddp,
                  optimizer=stepper)
    if rank != 0:
        return result
    final = history[-1]
    write(f"done: {steps} steps in {seconds:.1f} s "
          f"({(steps - first + 1) * tokens_per_step / max(train_seconds, 1e-9):,.0f}"
          f" training tokens/s), val loss {final['val_loss']:.4f}; checkpoint {out} "
          f"(weights fingerprint {digest_})")
    if sample_chars:
        prompt = "\n" if "\n" in vocab.index else vocab.chars[0]
        ids = model.generate(vocab.encode(prompt)[None], sample_chars, top_k=None, seed=seed)
        result["sample"] = vocab.decode(ids[0, 1:])
        write(f"a sample ({sample_chars} characters, npattn gpt sample --checkpoint {out} for "
              f"more):\n{result['sample']}")
    return result


def _silent(*args, **kwargs):
    pass


def _resume(path, model, vocab, text_digest, schedule, batches):
    """Load the training state of checkpoint ``path`` into the fresh ``model``, ``schedule``
    and ``batches`` of the same run; returns (its step, the optimiser's state dict)."""
    where = f"argument --resume: {path!r}"
    meta, arrays = read_checkpoint(path, "--resume")
    saved, saved_vocab = _model_of(meta, arrays, where)
    if saved_vocab.chars != vocab.chars or saved.config != model.config:
        raise UsageError(f"{where} is a model of another configuration or vocabulary (its "
                         f"config {vars(saved.config)}, {len(saved_vocab)} characters); got "
                         f"{vars(model.config)}, {len(vocab)} characters")
    if saved.transformer.wte.weight.dtype != model.transformer.wte.weight.dtype:
        raise UsageError(f"{where} holds {meta['dtype']} weights; got --dtype "
                         f"{model.transformer.wte.weight.dtype}")
    if meta.get("data_sha256") not in (None, text_digest):
        raise UsageError(f"argument --data: must be the corpus {where} was trained on "
                         f"({meta.get('corpus')}); got a text whose sha256 differs")
    state = training_state(meta, arrays, model, schedule.optimizer, where)
    try:
        training = meta["training"]
        model.load_state_dict(saved.state_dict())
        schedule.load_state_dict(training["schedule"])
        batches.bit_generator.state = training["batches"]
        for name, module in model.named_modules():
            if hasattr(module, "_generator"):
                module._generator.bit_generator.state = training["generators"][name]
        step = int(meta["step"])
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"{where}: its training state is incomplete ({error})") from None
    return step, state


# ------------------------------------------------------------------ sample

def sample(checkpoint, prompt=None, max_new_tokens=500, temperature=1.0, top_k=None, seed=0,
           attention_map=None, attention_layer=None):
    """``prompt`` followed by ``max_new_tokens`` characters sampled from the checkpoint's
    model (the default prompt: a newline, or the vocabulary's first character without one).
    With ``attention_map`` (a .png path), also draws every head's attention weights of block
    ``attention_layer`` (default: the last) over the text's last ``block_size`` characters."""
    model, vocab, _ = load_checkpoint(checkpoint)
    n_layer = model.config.n_layer
    if attention_layer is not None and not 0 <= attention_layer < n_layer:
        raise UsageError(f"argument --attention-layer: must be in [0, {n_layer}) (the "
                         f"checkpoint's n_layer is {n_layer}); got {attention_layer}")
    if prompt is None:
        prompt = "\n" if "\n" in vocab.index else vocab.chars[0]
    if not prompt:
        raise UsageError("argument --prompt: must hold at least one character; got ''")
    ids = vocab.encode(prompt, "--prompt")
    out = model.generate(ids[None], max_new_tokens, temperature=temperature, top_k=top_k,
                         seed=seed)
    text = prompt + vocab.decode(out[0, len(ids):])
    if attention_map is not None:
        layer = n_layer - 1 if attention_layer is None else attention_layer
        window = out[:, -model.config.block_size:]                      # (1, T)
        weights = attention_weights(model, window, layer)               # (nh, T, T)
        from . import plot
        plot.attention_map(weights, vocab.decode(window[0]), attention_map,
                           f"block {layer}'s attention, every head, over the sampled text "
                           f"({window.shape[1]} characters; row: query, column: key)")
    return text


def attention_weights(model, idx, layer):
    """The causal attention weights (nh, T, T) of block ``layer`` of ``model`` on the token ids
    ``idx`` (1, T), in eval mode: the block's attention input is caught during a forward, and
    its q and k give softmax(q·kᵀ/√hs) with keys after the query masked (npattn.attention)."""
    attn = model.transformer.h[layer].attn
    caught = {}
    forward = attn.forward

    def catch(x, *cache):                   # (Block passes its cache arguments through)
        caught["x"] = x                                                   # (1, T, C)
        return forward(x, *cache)
    was_training = model.training
    object.__setattr__(attn, "forward", catch)
    try:
        model.eval()
        model(idx)
    finally:
        del attn.__dict__["forward"]
        model.train(was_training)
    x = caught["x"]
    c, nh = attn.n_embd, attn.n_head
    bias = None if attn.c_attn.bias is None else attn.c_attn.bias.data
    qkv = linear(x, attn.c_attn.weight.data, bias)                       # (1, T, 3C)
    q, k, v = (qkv[..., i * c:(i + 1) * c].reshape(1, -1, nh, c // nh).transpose(0, 2, 1, 3)
               for i in range(3))                                        # (1, nh, T, hs)
    _, weights = attention(q, k, v, is_causal=True)                      # (1, nh, T, T)
    return weights[0]


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
    t.add_argument("--steps", type=_int_at_least(1), default=None,
                   help=f"training steps (default {d['steps']})")
    t.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help=f"sequences per step (default {d['batch_size']})")
    t.add_argument("--block-size", type=_int_at_least(1), default=None,
                   help=f"context length in characters (default {d['block_size']})")
    t.add_argument("--n-layer", type=_int_at_least(1), default=None,
                   help=f"transformer blocks (default {d['n_layer']})")
    t.add_argument("--n-head", type=_int_at_least(1), default=None,
                   help=f"attention heads (default {d['n_head']})")
    t.add_argument("--n-embd", type=_int_at_least(1), default=None,
                   help=f"embedding width, a multiple of --n-head (default {d['n_embd']})")
    t.add_argument("--dropout", type=_real(0.0, 1.0), default=None,
                   help=f"dropout probability (default {d['dropout']})")
    t.add_argument("--lr", type=_real(0.0, low_open=True), default=None,
                   help=f"peak AdamW learning rate (default {d['lr']:g})")
    t.add_argument("--weight-decay", type=_real(0.0), default=None,
                   help=f"AdamW weight decay of the 2-D weights (default {d['weight_decay']})")
    t.add_argument("--seed", type=_int_at_least(0), default=None,
                   help="seeds weights, batches and dropout: same seed, same checkpoint")
    t.add_argument("--eval-interval", type=_int_at_least(1), default=d["eval_interval"],
                   help=f"steps between evaluations and checkpoints (default "
                        f"{d['eval_interval']})")
    t.add_argument("--eval-iters", type=_int_at_least(1), default=d["eval_iters"],
                   help=f"batches per loss estimate (default {d['eval_iters']})")
    t.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="Numba threads (default: all cores, shared among the ranks on one "
                        "machine under mpiexec); results do not depend on it")
    t.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help=f"parameter dtype (default {d['dtype']})")
    t.add_argument("--resume", metavar="CKPT.npz",
                   help="continue the run of this checkpoint from its step to --steps (its "
                        "options are the run's: leave them out, or give the same values)")
    t.add_argument("--stop-at", type=_int_at_least(1), default=None, metavar="STEP",
                   help="stop after this step with a checkpoint (the run stays --steps long: "
                        "continue it with --resume)")
    t.add_argument("--zero", action="store_true",
                   help="under mpiexec: shard AdamW's state across the ranks (ZeRO-1); same "
                        "results, 1/N of the optimizer memory per rank")
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
    s.add_argument("--attention-map", metavar="FILE.png", default=None,
                   help="also draw every head's attention weights of one block over the "
                        "sampled text (needs matplotlib: pip install \"npattn[plot]\")")
    s.add_argument("--attention-layer", type=_int_at_least(0), default=None, metavar="L",
                   help="the block --attention-map draws (default: the last)")
    return parser


def _set_threads(parser, threads):
    import numba
    if threads is None:
        # under mpiexec, the ranks of one machine share its cores (n ranks × all cores each
        # would oversubscribe them, and OpenMP-style barriers spin on a busy core)
        local = distributed.local_ranks()
        if local > 1:
            numba.set_num_threads(max(1, numba.config.NUMBA_NUM_THREADS // local))
        return
    most = numba.config.NUMBA_NUM_THREADS
    if threads > most:
        parser.error(f"argument --threads: must be an int in [1, {most}] (Numba's "
                     f"NUMBA_NUM_THREADS); got {threads}")
    numba.set_num_threads(threads)


def main(argv=None, prog="npattn gpt"):
    if distributed.launched_rank() != 0:      # under mpiexec only rank 0 prints
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return _main(argv, prog)
    return _main(argv, prog)


def _train_options(args):
    """train()'s keyword arguments from the parsed options: the checkpoint's run options when
    resuming (resume_options), otherwise DEFAULTS for those left out."""
    given = {k: v for k, v in vars(args).items() if k not in ("action", "threads")}
    if args.resume is not None:
        options = resume_options(args.resume, given)
    else:
        options = {k: DEFAULTS[k] if v is None and k in DEFAULTS else v
                   for k, v in given.items()}
    if options["n_embd"] % options["n_head"]:
        raise UsageError(f"argument --n-embd: must be a multiple of --n-head = "
                         f"{options['n_head']}; got {options['n_embd']}")
    return options


def _main(argv, prog):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.action is None:
        parser.print_help()
        return 2
    sub = f"{prog} {args.action}"
    _set_threads(parser.commands[args.action], args.threads)
    world = None
    try:
        if args.action == "train":
            try:
                world = distributed.init()
            except RuntimeError as error:
                raise UsageError(str(error)) from None
            error, options = None, None
            try:
                options = _train_options(args)
            except UsageError as caught:
                error = caught
            # every rank must run the same command: the options as given, threads aside
            agree(world, error, {k: v for k, v in vars(args).items() if k != "threads"})
            try:
                result = train(**options, world=world)
            except KeyboardInterrupt:
                print(f"\n{sub}: interrupted; {args.out} holds the last checkpoint written, "
                      "if any", file=sys.stderr)
                return 130
            if result["stopped"]:
                return 128 + result["stopped"]        # 130 for SIGINT, 143 for SIGTERM
        else:
            if args.attention_map is not None:
                from . import plot
                status = plot.exit_status("--attention-map", sub)   # before any work
                if status is not None:
                    return status
            text = sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                          args.top_k, args.seed, args.attention_map, args.attention_layer)
            sys.stdout.write(text + "\n")
            if args.attention_map is not None:
                sys.stdout.write(f"wrote {args.attention_map}\n")
    except UsageError as error:
        parser.commands[args.action].error(str(error))      # usage, message; exit status 2
    except Exception:
        if world is not None and world.size > 1:   # one rank's failure ends the whole job
            traceback.print_exc(file=sys.__stderr__)
            world.abort(1)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
