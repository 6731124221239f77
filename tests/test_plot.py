"""Attention you can see (npattn/tools/plot.py): ``npattn explain --plot DIR`` and ``npattn gpt
sample --attention-map FILE.png`` write PNGs that show something, and without matplotlib both
options exit with status 2 and one line naming the extra to install.

matplotlib comes with the test extra (setup.cfg), so a missing matplotlib fails here rather
than skipping the feature.
"""
import pathlib
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from npattn.tools import explain, gpt, plot

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--steps", "2", "--eval-interval", "2", "--eval-iters", "1", "--n-layer", "2",
        "--n-head", "3", "--n-embd", "12", "--block-size", "16", "--batch-size", "2"]


def assert_a_picture(path, min_side=200):
    """A PNG of some size with more than a handful of colours: something was drawn."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    assert min(pixels.shape[:2]) >= min_side, pixels.shape
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(2), axis=0)
    assert len(colours) > 20, f"{path.name}: only {len(colours)} colours"


def test_explain_plot_writes_the_steps(tmp_path, capsys):
    """The four pictures, each something drawn; and drawn from the run's numbers: another seed
    gives other weights, and another weights picture."""
    out = tmp_path / "steps" / "here"                     # made, parents too
    assert explain.main(["--plot", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["1-scores.png", "2-weights.png", "3-output.png", "4-batch-weights.png"]
    printed = capsys.readouterr().out
    for name in names:
        assert_a_picture(out / name)
        assert f"wrote {out / name}" in printed
    other = tmp_path / "seed1"
    assert explain.main(["--seed", "1", "--plot", str(other)]) == 0
    assert (other / "2-weights.png").read_bytes() != (out / "2-weights.png").read_bytes()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpt")
    data = work / "corpus.txt"
    data.write_text("the cat sat on the mat. a dog ate the hat!\n" * 30, encoding="utf-8")
    out = work / "model.npz"
    assert gpt.main(["train", "--data", str(data), "--out", str(out), *TINY]) == 0
    return out


def test_sample_draws_every_head_of_a_layer(checkpoint, tmp_path, capsys):
    capsys.readouterr()
    png = tmp_path / "map.png"
    assert gpt.main(["sample", "--checkpoint", str(checkpoint), "--prompt", "the ",
                     "--max-new-tokens", "20", "--attention-map", str(png),
                     "--attention-layer", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the ") and f"wrote {png}" in out
    assert_a_picture(png)
    other = tmp_path / "other.png"                         # the same text, block 1's weights
    assert gpt.main(["sample", "--checkpoint", str(checkpoint), "--prompt", "the ",
                     "--max-new-tokens", "20", "--attention-map", str(other)]) == 0
    assert capsys.readouterr().out.startswith(out.splitlines()[0])
    assert other.read_bytes() != png.read_bytes()


def test_the_map_is_the_causal_softmax_of_the_layer(checkpoint):
    """attention_weights: rows sum to 1, nothing above the diagonal, and block 0's weights are
    the textbook's softmax(q·kᵀ/√hs) of its input."""
    model, vocab, _ = gpt.load_checkpoint(checkpoint)
    idx = vocab.encode("the cat sat")[None]
    mode = model.training
    weights = gpt.attention_weights(model, idx, 1)
    n_head, t = model.config.n_head, idx.shape[1]
    assert weights.shape == (n_head, t, t)
    np.testing.assert_allclose(weights.sum(axis=-1), 1, rtol=1e-5)
    assert np.all(np.triu(weights, 1) == 0)
    assert model.training == mode                           # restored
    block = model.transformer.h[0]
    model.eval()
    x = block.ln_1(model.transformer.wte(idx) + model.transformer.wpe(np.arange(t)))
    c, hs = model.config.n_embd, model.config.n_embd // n_head
    qkv = x.astype(np.float64) @ block.attn.c_attn.weight.data.T + block.attn.c_attn.bias.data
    q, k = (qkv[0, :, i * c:(i + 1) * c].reshape(t, n_head, hs).transpose(1, 0, 2)
            for i in range(2))
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hs) + np.triu(np.full((t, t), -np.inf), 1)
    want = np.exp(scores - scores.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(gpt.attention_weights(model, idx, 0), want, atol=2e-5)


def test_a_layer_past_the_model_is_refused(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        gpt.main(["sample", "--checkpoint", str(checkpoint), "--attention-map",
                  str(tmp_path / "x.png"), "--attention-layer", "2"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --attention-layer: must be in [0, 2)" in err and "got 2" in err
    assert not (tmp_path / "x.png").exists()


WITHOUT_MATPLOTLIB = """
import sys
sys.path.insert(0, {root!r})
sys.modules["matplotlib"] = None          # import matplotlib raises ImportError
from npattn.tools import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["explain", "--plot", "{tmp}/steps"],
                                  ["gpt", "sample", "--checkpoint", "{tmp}/absent.npz",
                                   "--attention-map", "{tmp}/map.png"]],
                         ids=["explain --plot", "gpt sample --attention-map"])
def test_without_matplotlib_one_line_and_status_2(tmp_path, argv):
    argv = [a.format(tmp=tmp_path) for a in argv]
    child = subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB.format(root=str(ROOT)),
                            *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert child.returncode == 2, child.stderr
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1, child.stderr
    assert 'pip install "npattn[plot]"' in lines[0] and "matplotlib" in lines[0], lines
    assert child.stdout == ""
    assert list(tmp_path.iterdir()) == []                  # nothing written, nothing run


def test_the_map_draws_the_weights_it_is_given(tmp_path):
    """Same title and text, other weights: another picture (a map that ignored its weights, or
    drew one head only, would not change)."""
    rng = np.random.default_rng(0)
    weights = rng.random((3, 6, 6))
    weights /= weights.sum(-1, keepdims=True)
    other = weights.copy()
    other[2] = other[2, :, ::-1]                          # the last head only
    first = plot.attention_map(weights, "ab c\nd", tmp_path / "a.png", "title")
    second = plot.attention_map(other, "ab c\nd", tmp_path / "b.png", "title")
    assert_a_picture(first)
    assert first.read_bytes() != second.read_bytes()
