"""Attention you can see: the pictures of ``npattn explain --plot DIR`` and ``npattn gpt sample
--attention-map FILE.png``.

matplotlib is not a dependency of npattn: it comes with the ``plot`` extra
(``pip install "npattn[plot]"``, or ``pip install matplotlib``). :func:`require` is called
before any work, and without matplotlib the commands exit with status 2 and one line saying
which extra to install. The figures are drawn on ``matplotlib.figure.Figure`` objects (no
pyplot, no global backend state) and written as PNG.
"""
import math
import pathlib
import sys

import numpy as np

EXTRA = 'pip install "npattn[plot]"'


class PlotUnavailable(RuntimeError):
    """matplotlib cannot be imported; the message names the extra that brings it."""


def require(option):
    """matplotlib's Figure class, or PlotUnavailable naming ``option`` and the extra."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(f"{option} draws with matplotlib, which is not installed: "
                              f"{EXTRA} (the plot extra)") from None
    return Figure


def exit_status(option, prog):
    """For a command's option that draws: None when matplotlib imports, else 2 after one line
    on stderr naming the extra -- checked before any work, so nothing is computed or written."""
    try:
        require(option)
    except PlotUnavailable as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    return None


def _label(char):
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(char, char)


def _heatmap(ax, values, rows, cols, title, cmap="viridis", annotate=True, vmin=None, vmax=None):
    """One matrix as a heatmap, its entries written in when it is small enough to read."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    image = ax.imshow(np.where(np.isfinite(values), values, np.nan), cmap=cmap,
                      vmin=vmin if vmin is not None else (finite.min() if finite.size else 0),
                      vmax=vmax if vmax is not None else (finite.max() if finite.size else 1))
    ax.set_title(title, fontsize=9)
    if rows is not None and len(rows) <= 64:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    if cols is not None and len(cols) <= 64:
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=90 if len(cols) > 8 else 0)
    if annotate and values.size <= 64:
        middle = (finite.min() + finite.max()) / 2 if finite.size else 0
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.2f}" if np.isfinite(v) else "−∞", ha="center", va="center",
                    fontsize=7, color="black" if np.isfinite(v) and v > middle else "white")
    return image


def explain_figures(result, directory):
    """The walkthrough's matrix form (step 4) as pictures in ``directory``: the scores, the
    softmax weights and the output, each unscaled (the article's §1) beside scaled (§2); and
    the batch's masked weights (step 5). Returns the paths written."""
    Figure = require("--plot")
    from .explain import TOKENS
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    m = result["matrix"]
    tokens = list(TOKENS)
    dims = [f"v{j + 1}" for j in range(m["Z"].shape[1])]
    pages = [
        ("1-scores.png", "scores: q^i·k^j for query i (rows) and key j (columns)",
         [(m["scores"], tokens, tokens, "Q·Kᵀ (article §1)", "coolwarm", {}),
          (m["scaled_scores"], tokens, tokens, "Q·Kᵀ/√d_k (article §2)", "coolwarm", {})]),
        ("2-weights.png", "softmax(scores, dim=-1): how much query i looks at key j (rows sum to 1)",
         [(m["weights"], tokens, tokens, "softmax(Q·Kᵀ)", "viridis", dict(vmin=0, vmax=1)),
          (m["scaled_weights"], tokens, tokens, "softmax(Q·Kᵀ/√d_k)", "viridis",
           dict(vmin=0, vmax=1))]),
        ("3-output.png", "Z = weights·V: token t's output z^t (row t)",
         [(m["Z"], tokens, dims, "softmax(Q·Kᵀ)·V", "coolwarm", {}),
          (m["scaled_Z"], tokens, dims, "softmax(Q·Kᵀ/√d_k)·V", "coolwarm", {})]),
    ]
    batch = result.get("batch", {})
    masked = batch.get("masked_weights")
    if masked is not None:
        n = masked.shape[-1]
        positions = [str(i + 1) for i in range(n)]
        pages.append(("4-batch-weights.png",
                      "the batch (step 5): padding-masked attention weights, one sentence each",
                      [(masked[b], positions, positions, f"sentence {b + 1}", "viridis",
                        dict(vmin=0, vmax=1)) for b in range(masked.shape[0])]))
    written = []
    for name, title, panels in pages:
        fig = Figure(figsize=(4.2 * len(panels), 4.2), layout="constrained")
        fig.suptitle(title, fontsize=10)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, (values, rows, cols, sub, cmap, limits) in zip(axes, panels):
            image = _heatmap(ax, values, rows, cols, sub, cmap, **limits)
            fig.colorbar(image, ax=ax, shrink=0.8)
        path = directory / name
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def attention_map(weights, text, path, title):
    """Every head's weights (H, T, T) over the characters ``text`` (T of them) as one PNG: a
    grid of heatmaps, query position down, key position across."""
    Figure = require("--attention-map")
    weights = np.asarray(weights, dtype=np.float64)
    heads, length = weights.shape[0], weights.shape[-1]
    labels = [_label(c) for c in text]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    side = 3.2 if length <= 64 else 4.0
    fig = Figure(figsize=(side * cols + 0.8, side * rows + 0.6), layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.set_axis_off()
            continue
        image = _heatmap(ax, weights[h], labels, labels, f"head {h}", "viridis",
                         annotate=False, vmin=0, vmax=1)
    fig.colorbar(image, ax=axes, shrink=0.6, label="weight (query row → key column)")
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110)
    return path
