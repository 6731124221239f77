"""``npattn gpt train`` / ``npattn gpt sample`` (npattn/tools/gpt.py): checkpoints that load and
sample, the same bits from the same seed, the default corpus, atomic writes, and bad input
refused with exit status 2 and nothing written.

Models here are tiny (1 layer, n_embd 8, a few steps): these test the command, not learning.
"""
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from npattn.tools import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--steps", "4", "--eval-interval", "2", "--eval-iters", "1", "--n-layer", "1",
        "--n-head", "2", "--n-embd", "8", "--block-size", "8", "--batch-size", "2"]
CORPUS = "the cat sat on the mat. a dog ate the hat!\n" * 30


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


def train(capsys, data, out, *extra):
    """``npattn gpt train`` in this process; returns its stdout."""
    assert gpt.main(["train", "--data", str(data), "--out", str(out), *TINY, *extra]) == 0
    return capsys.readouterr().out


def sample(capsys, checkpoint, *extra):
    assert gpt.main(["sample", "--checkpoint", str(checkpoint), *extra]) == 0
    return capsys.readouterr().out


def refused(capsys, argv):
    """Run ``npattn gpt <argv>``, which must exit with status 2; returns its stderr."""
    with pytest.raises(SystemExit) as caught:
        gpt.main(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ train, then sample

def test_train_writes_a_checkpoint_that_sample_loads(capsys, corpus, tmp_path):
    out = tmp_path / "model.npz"
    printed = train(capsys, corpus, out)
    lines = printed.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["2/4", "4/4"]
    for line in steps:
        for word in ("train loss", "val loss", "tokens/s", "elapsed", "left"):
            assert word in line, line
    assert any(line.startswith("done: 4 steps") for line in lines)

    model, vocab, meta = gpt.load_checkpoint(out)
    assert vocab.chars == "".join(sorted(set(CORPUS)))
    assert meta["format"] == gpt.FORMAT and meta["step"] == 4 and meta["seed"] == 0
    assert meta["config"] == dict(block_size=8, vocab_size=len(vocab), n_layer=1, n_head=2,
                                  n_embd=8, dropout=0.0, bias=True)
    with np.load(out, allow_pickle=False) as archive:             # plain NumPy reads it
        moments = {f"optimizer.{key}.{name}" for key in ("exp_avg", "exp_avg_sq")
                   for name, _ in model.named_parameters()}
        assert set(archive.files) == set(model.state_dict()) | {gpt.META, gpt.CHECKSUM} | moments
        for name, array in model.state_dict().items():
            np.testing.assert_array_equal(archive[name], array)
    assert f"fingerprint {gpt.fingerprint(model)}" in printed

    text = sample(capsys, out, "--prompt", "the ", "--max-new-tokens", "37")
    assert text.endswith("\n")
    text = text[:-1]
    assert text.startswith("the ") and len(text) == 4 + 37
    assert set(text) <= set(vocab.chars)
    # the printed text is the model's own generate, decoded with the stored vocabulary
    ids = model.generate(vocab.encode("the ")[None], 37, seed=0)
    assert text == vocab.decode(ids[0])


def test_same_seed_same_checkpoint_bytes_and_same_sample(capsys, corpus, tmp_path):
    first, again, other = (tmp_path / f"{n}.npz" for n in ("first", "again", "other"))
    train(capsys, corpus, first)
    train(capsys, corpus, again)
    train(capsys, corpus, other, "--seed", "1")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    a = sample(capsys, first, "--seed", "5", "--max-new-tokens", "60")
    b = sample(capsys, again, "--seed", "5", "--max-new-tokens", "60")
    c = sample(capsys, first, "--seed", "6", "--max-new-tokens", "60")
    assert a == b and a != c


def test_vocabulary_round_trip_and_windows():
    vocab = gpt.Vocabulary.of("banana split")
    assert vocab.chars == " abilnpst"
    ids = vocab.encode("split a banana")
    assert ids.dtype == np.int64 and ids.tolist()[:5] == [7, 6, 4, 3, 8]
    assert vocab.decode(ids) == "split a banana"
    data = np.arange(100, dtype=np.int64)
    x, y = gpt.get_batch(data, 7, 5, np.random.default_rng(0))
    assert x.shape == y.shape == (5, 7)
    np.testing.assert_array_equal(y, x + 1)                        # each target: the next one
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)           # contiguous windows
    train_ids, val_ids = gpt.split(data, 7)
    assert len(train_ids) == 90 and val_ids[0] == 90


def documented_lr(step, steps, lr):
    """The module docstring's schedule, in closed form: warmup linear to lr over the first
    W = min(100, steps // 10) steps (step counts from 1), then cosine to lr / 10 at the last."""
    warmup = min(100, steps // 10)
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / (steps - warmup)
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - lr / 10)


@given(steps=st.integers(1, 2500), lr=st.floats(1e-6, 10.0))
@example(steps=1, lr=2e-3).via("no warmup, one step: lr / 10 at once")
@example(steps=15, lr=2e-3).via("a warmup of 1: the cosine from step 0 (milestone 0)")
@example(steps=200, lr=2e-3).via("a warmup of 20")
@example(steps=2000, lr=2e-3).via("the warmup capped at 100")
def test_the_lr_schedule_warms_up_then_decays_to_a_tenth(steps, lr):
    """lr_schedule, stepped as train() steps it, against the closed form; and its shape."""
    from npattn.nn import Parameter
    opt = gpt.AdamW([Parameter(np.zeros(3))], lr=1.0)
    schedule = gpt.lr_schedule(opt, steps, lr)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])                  # what opt.step() would use
        schedule.step()
    want = [documented_lr(s, steps, lr) for s in range(1, steps + 1)]
    assert rates == pytest.approx(want, rel=1e-12, abs=0)      # PyTorch's recursion: rounding
    warmup = min(100, steps // 10)
    if warmup:
        assert rates[0] == pytest.approx(lr / warmup, rel=1e-12)
        assert rates[warmup - 1] == pytest.approx(lr, rel=1e-12)           # the peak
        assert all(b > a for a, b in zip(rates[:warmup], rates[1:warmup]))   # up
    assert all(b < a for a, b in zip(rates[warmup:], rates[warmup + 1:]))     # then down
    assert rates[-1] == pytest.approx(lr / 10, rel=1e-12)


def test_train_uses_the_schedule(capsys, corpus, tmp_path):
    """The rates train() trained with, step by step (20 steps: a warmup of 2)."""
    result = gpt.train(str(corpus), str(tmp_path / "m.npz"), steps=20, batch_size=2,
                       block_size=8, n_layer=1, n_head=2, n_embd=8, eval_interval=20,
                       eval_iters=1, sample_chars=0)
    want = [documented_lr(s, 20, gpt.DEFAULTS["lr"]) for s in range(1, 21)]
    assert result["lrs"] == pytest.approx(want, rel=1e-12, abs=0)


def test_weight_decay_on_the_two_dimensional_weights_only():
    from npattn.models import GPT, GPTConfig
    model = GPT(GPTConfig(8, 11, 2, 2, 8), rng=0)
    opt = gpt.optimizer(model, 1e-3, 0.1)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.data.ndim == 2 for p in decayed["params"])
    assert all(p.data.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert len(decayed["params"]) == 2 + 2 * 4                     # wte, wpe; 4 Linears a block


def test_the_default_corpus_ships_with_python():
    text, description = gpt.default_corpus()
    assert len(text) >= 200_000 and "pydoc_data.topics" in description
    assert text == gpt.default_corpus()[0]                         # the same text every time
    _, _, vocab, train_ids, val_ids = gpt.prepare(None, 64)
    assert len(vocab) >= 60 and " " in vocab.index and "\n" in vocab.index
    assert len(train_ids) == int(0.9 * len(text)) and len(train_ids) + len(val_ids) == len(text)


def test_the_command_is_registered_and_runs_end_to_end(corpus, tmp_path):
    """``python -m npattn gpt ...`` as a user runs it: train, sample, and an exit status of 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "cli.npz"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "npattn", "gpt", *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)

    done = run("train", "--data", str(corpus), "--out", str(out), *TINY)
    assert done.returncode == 0, done.stderr
    done = run("sample", "--checkpoint", str(out), "--prompt", "a", "--max-new-tokens", "9")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout) == 1 + 9 + 1 and done.stdout.startswith("a")
    done = run("sample", "--checkpoint", str(out), "--prompt", "Z")
    assert done.returncode == 2 and "argument --prompt" in done.stderr


# ------------------------------------------------------------------ atomic checkpoints

def _crashing_writer(error):
    def write(file, arrays):                 # half a checkpoint, then the crash
        file.write(b"PK\x03\x04" + b"\0" * 1000)
        raise error
    return write


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_crash_while_saving_leaves_the_old_checkpoint(capsys, corpus, tmp_path, monkeypatch,
                                                        error):
    out = tmp_path / "model.npz"
    train(capsys, corpus, out)
    before = out.read_bytes()
    model, vocab, meta = gpt.load_checkpoint(out)
    monkeypatch.setattr(gpt, "write_npz", _crashing_writer(error))
    with pytest.raises(type(error)):
        gpt.save_checkpoint(out, model, vocab, {})
    assert out.read_bytes() == before                              # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "model.npz"]
    fresh = tmp_path / "fresh.npz"
    with pytest.raises(type(error)):
        gpt.save_checkpoint(fresh, model, vocab, {})
    assert not fresh.exists()                                      # none, rather than half
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "model.npz"]


def test_an_interrupt_outside_the_loop_keeps_the_last_checkpoint(capsys, corpus, tmp_path,
                                                                monkeypatch):
    """A KeyboardInterrupt that is not a signal at a step (here: raised by an evaluation) still
    exits 130 with the last checkpoint, written before that evaluation."""
    out = tmp_path / "model.npz"
    evaluations = []
    real = gpt.estimate_loss

    def interrupted(*args):
        evaluations.append(1)
        if len(evaluations) > 2:                       # the second evaluation (step 4)
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(gpt, "estimate_loss", interrupted)
    assert gpt.main(["train", "--data", str(corpus), "--out", str(out), *TINY]) == 130
    assert "interrupted" in capsys.readouterr().err
    _, _, meta = gpt.load_checkpoint(out)
    assert meta["step"] == 4                           # written before its evaluation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "model.npz"]


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_the_step_boundary_and_the_checkpoint_resumes(
        capsys, corpus, tmp_path, monkeypatch, signum, status):
    """SIGINT/SIGTERM during step 3 of 4: the step finishes, a checkpoint of step 3 is written,
    exit 130/143; resuming it gives the bytes of the run that was never stopped."""
    whole = tmp_path / "whole.npz"
    train(capsys, corpus, whole)
    out = tmp_path / "model.npz"
    calls, real = [], gpt.get_batch

    def signalled(*args):                              # steps 1, 2, step 2's evaluation (2)
        calls.append(1)
        if len(calls) == 5:                            # step 3's batch
            os.kill(os.getpid(), signum)
        return real(*args)

    monkeypatch.setattr(gpt, "get_batch", signalled)
    argv = ["train", "--data", str(corpus), "--out", str(out), *TINY]
    def handlers():
        return [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]

    before = handlers()                  # not assumed: SIGINT is SIG_IGN in a background job
    assert gpt.main(argv) == status
    printed = capsys.readouterr().out
    assert f"stopped by {signal.Signals(signum).name} after step 3/4" in printed
    assert gpt.load_checkpoint(out)[2]["step"] == 3
    assert handlers() == before                                              # restored
    monkeypatch.undo()
    assert gpt.main(["train", "--out", str(out), "--resume", str(out), "--eval-interval", "2",
                     "--eval-iters", "1"]) == 0     # the run's options come from the file
    assert "resumed from" in capsys.readouterr().out
    assert out.read_bytes() == whole.read_bytes()


# ------------------------------------------------------------------ bad input

def _bad_data(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café au lait, ".encode("latin-1") * 50)
    (tmp_path / "short.txt").write_text("abcdefghijklmnop", encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    return [
        (["--data", str(tmp_path / "missing.txt")],
         r"argument --data: must be a readable text file; got .*missing"),
        (["--data", str(tmp_path / "latin1.txt")], r"argument --data: .* must be UTF-8 text; "
                                                   r"got byte 0xe9 at offset 3"),
        (["--data", str(tmp_path / "empty.txt")], r"argument --data: the corpus must not be "
                                                  r"empty"),
        (["--data", str(tmp_path / "short.txt")], r"argument --block-size: each split .* "
                                                  r"block_size \+ 1 = 9 .*got a corpus of 16"),
    ]


def test_bad_training_input_exits_2_and_writes_nothing(capsys, corpus, tmp_path):
    cases = _bad_data(tmp_path) + [
        (["--data", str(corpus), "--n-embd", "10", "--n-head", "4"],
         r"argument --n-embd: must be a multiple of --n-head = 4; got 10"),
        (["--data", str(corpus), "--steps", "0"], r"argument --steps: must be an int >= 1; got 0"),
        (["--data", str(corpus), "--lr", "-1"], r"argument --lr: must be a finite number > 0"),
        (["--data", str(corpus), "--dropout", "1"], r"argument --dropout: .*< 1; got '1'"),
        (["--data", str(corpus), "--dropout", "nan"], r"argument --dropout: .*; got 'nan'"),
        (["--data", str(corpus), "--threads", "100000"], r"argument --threads: must be an int in"),
        (["--data", str(corpus), "--dtype", "float16"], r"argument --dtype: invalid choice"),
    ]
    files = sorted(p.name for p in tmp_path.iterdir())
    for extra, message in cases:
        out = tmp_path / "model.npz"
        argv = ["train", *TINY[:2], "--block-size", "8", "--out", str(out), *extra]
        err = refused(capsys, argv)
        assert re.search(message, err), (extra, err)
        assert "got" in err or "invalid choice" in err, err       # (argparse's own wording)
        assert sorted(p.name for p in tmp_path.iterdir()) == files, extra     # nothing written
    err = refused(capsys, ["train", "--data", str(corpus), "--out",
                           str(tmp_path / "no" / "such" / "dir.npz"), *TINY])
    assert "argument --out: must be a file in an existing directory" in err


def _tampered(tmp_path, good, edit, name, seal=True):
    """A copy of the checkpoint ``good`` with its arrays changed by ``edit(arrays)``, and its
    checksum recomputed (``seal``), so that the checks behind the checksum are reached."""
    with np.load(good, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    edit(arrays)
    path = tmp_path / name
    with open(path, "wb") as f:
        gpt.write_npz(f, gpt.seal(arrays) if seal else arrays)
    return path


def _meta(arrays, **changes):
    meta = json.loads(str(arrays[gpt.META]))
    meta.update(changes)
    arrays[gpt.META] = np.array(json.dumps(meta))


def test_bad_sampling_input_exits_2(capsys, corpus, tmp_path):
    good = tmp_path / "good.npz"
    train(capsys, corpus, good)
    wte = "transformer.wte.weight"
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with zipfile.ZipFile(tmp_path / "other.npz", "w") as z:
        z.writestr("x.npy", b"")
    cases = [
        (tmp_path / "absent.npz", [],
         r"argument --checkpoint: must be a readable file; got .*absent.npz"),
        (tmp_path / "text.npz", [], r"text.npz' must be an .npz checkpoint .*; got a file"),
        (tmp_path / "single.npy", [], r"single.npy' must be an .npz checkpoint .*; got a single"),
        (_tampered(tmp_path, good, lambda a: a.pop(gpt.META), "nometa.npz"), [],
         r"must hold the key 'meta'"),
        (_tampered(tmp_path, good, lambda a: a.pop("transformer.h.0.mlp.c_fc.bias"),
                   "missing.npz"), [],
         r"missing.npz' must hold the arrays of its config .*; got missing keys "
         r"\['transformer.h.0.mlp.c_fc.bias'\], unexpected keys \[\]"),
        (_tampered(tmp_path, good, lambda a: a.update(extra=np.zeros(2)), "extra.npz"), [],
         r"unexpected keys \['extra'\]"),
        (_tampered(tmp_path, good, lambda a: a.update({wte: a[wte][:-1]}), "shape.npz"), [],
         r"shape.npz': key 'transformer.wte.weight' must be a float32 array of shape "
         r"\(\d+, 8\); got float32 \(\d+, 8\)"),
        (_tampered(tmp_path, good, lambda a: _meta(a, config={"n_layer": 2}), "config.npz"), [],
         r"config.npz': its key 'meta' must describe an npattn gpt model; got"),
        (_tampered(tmp_path, good, lambda a: _meta(a, vocab="ab"), "vocab.npz"), [],
         r"vocab.npz': its key 'meta' .*; got a vocabulary of 2 characters for vocab_size"),
        (_tampered(tmp_path, good, lambda a: _meta(a, format="other/9"), "format.npz"), [],
         r"its key 'meta' must describe an npattn gpt model; got format 'other/9'"),
        (_tampered(tmp_path, good, lambda a: a.update({wte: a[wte] + 1}), "untied.npz"), [],
         r"untied.npz': state_dict\['lm_head.weight'\] must equal"),
        (good, ["--prompt", "the Cat"], r"argument --prompt: every character must be in the "
                                        r"checkpoint's vocabulary .*got 1 outside it: 'C'"),
        (good, ["--prompt", ""], r"argument --prompt: must hold at least one character"),
        (good, ["--temperature", "0"], r"argument --temperature: must be a finite number > 0"),
        (good, ["--top-k", "0"], r"argument --top-k: must be an int >= 1; got 0"),
        (good, ["--max-new-tokens", "x"], r"argument --max-new-tokens: must be an int >= 0; "
                                          r"got 'x'"),
    ]
    for path, extra, message in cases:
        err = refused(capsys, ["sample", "--checkpoint", str(path), *extra])
        assert re.search(message, err), (path.name, extra, err)
        assert "got" in err


def test_stop_at_then_resume_gives_the_bytes_of_one_run(capsys, corpus, tmp_path):
    """k steps + --resume + k steps == 2k steps, byte for byte: model, AdamW moments, step,
    schedule position, batch sampler and dropout generators all restored (dropout on, so the
    dropout generators matter)."""
    whole, part = tmp_path / "whole.npz", tmp_path / "part.npz"
    train(capsys, corpus, whole, "--dropout", "0.1")
    printed = train(capsys, corpus, part, "--dropout", "0.1", "--stop-at", "3")
    assert "stopped (--stop-at) after step 3/4" in printed
    assert gpt.load_checkpoint(part)[2]["step"] == 3
    assert gpt.main(["train", "--out", str(part), "--resume", str(part)]) == 0
    assert part.read_bytes() == whole.read_bytes()


def test_bad_resume_input_exits_2_with_one_line(capsys, corpus, tmp_path):
    good = tmp_path / "good.npz"
    train(capsys, corpus, good)
    data = good.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[:len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF                    # inside some array's bytes
    (tmp_path / "flipped.npz").write_bytes(bytes(flipped))
    (tmp_path / "text.npz").write_text("not a zip")
    wte = "transformer.wte.weight"

    def old_format(arrays):                            # what npattn wrote before resume
        for key in [k for k in arrays if k.startswith("optimizer.") or k == gpt.CHECKSUM]:
            del arrays[key]
        _meta(arrays, format="npattn-gpt-char/1", training=None)

    other = tmp_path / "other.txt"
    other.write_text(CORPUS.upper(), encoding="utf-8")
    cases = [
        (tmp_path / "truncated.npz", [], r"truncated.npz'.*(cannot load|damaged)"),
        (tmp_path / "flipped.npz", [], r"flipped.npz'.*(cannot load|damaged|corrupted)"),
        (tmp_path / "text.npz", [], r"text.npz' must be an .npz checkpoint"),
        (_tampered(tmp_path, good, lambda a: a.update({wte: a[wte] * 2}), "unsealed.npz",
                   seal=False), [],
         r"unsealed.npz' is corrupted: its checksum does not match its contents"),
        (_tampered(tmp_path, good, old_format, "old.npz", seal=False), [],
         r"old.npz' holds no training state .*it cannot be resumed; npattn gpt sample still"),
        (good, ["--n-layer", "2"], r"argument --n-layer: .*good.npz' was trained with 1; got 2"),
        (good, ["--dtype", "float64"], r"argument --dtype: .* with 'float32'; got 'float64'"),
        (good, ["--data", str(other)], r"argument --resume: .*another configuration or "
                                       r"vocabulary"),
        (good, ["--stop-at", "2"], r"argument --stop-at: must be after the checkpoint's step 4"),
    ]
    for path, extra, message in cases:
        err = refused(capsys, ["train", "--out", str(tmp_path / "new.npz"), "--resume",
                               str(path), *extra])
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert re.search(message, errors[0]), (path.name, extra, err)
        assert not (tmp_path / "new.npz").exists()
    # the old format still samples
    assert sample(capsys, tmp_path / "old.npz", "--max-new-tokens", "5")
