"""``npattn explain``: the seed article's dot-product attention, executed step by step.

The article ("transformer实战——点积注意力(Dot-Product Attention)到底是怎么执行的？") walks one
sentence through attention: the input X (§1.1), the matrices W^Q, W^K, W^V (§1.2.1), the first
token's output z¹ one dot product at a time (§1.2.2), the same for every token as matrix
products (§1.2.3), the batch shapes of the PyTorch code (§1.2.4), and the scaled version with
its ``attention(query, key, value, mask=None, dropout=None)`` (§2). This module runs those
steps (1-5 below) and adds what the article leaves out, the backward pass (6):

1. X = word embedding + positional encoding, one row x^t per token      :func:`step_input`
2. q^t, k^t, v^t from W^Q, W^K, W^V (nn.Linear's layout)                :func:`step_projections`
3. token 1: scores q¹·k^j, softmax, z¹ = Σ_j w_j·v^j                    :func:`step_one_token`
4. the matrix form softmax(Q·Kᵀ)·V, then /√d_k and why                 :func:`step_matrix_form`
5. the batch X (2, 5, 512), Linear(512, 64), a padding mask, dropout    :func:`step_batch`
6. the chain rule back to dX and the weights; the fused backward       :func:`step_backward`

Every number is computed twice: by npattn's fast kernels in the chosen dtype (``npattn.linear``,
``matmul``, ``softmax``, ``attention``, their ``*_backward``) and by the float64 textbook
(``npattn.reference``) from the same input values. Each step prints its formula, shapes and
numbers, then the largest difference between the two, relative to the largest reference value:
more than ``TOLERANCE_EPS`` units of the dtype's machine epsilon is a kernel bug, and
:func:`run` raises :class:`Mismatch` after the last step (``npattn explain`` exits with 1).

Each step is a function returning the values it printed, so tests can recompute them.
"""
import argparse
import math
import sys
from collections import namedtuple

import numpy as np

from .. import (attention, attention_backward, dropout_mask, linear, linear_backward, matmul,
               matmul_backward, reference, softmax, softmax_backward)

#: A fast result may differ from the float64 textbook by this many machine epsilons of its
#: dtype, relative to the largest reference value: the steps reduce over at most 512 terms,
#: and the kernels land within a few eps; a wrong formula is off by O(1).
TOLERANCE_EPS = 1000

TOKENS = ("Thinking", "Machines", "learn")   # the toy sentence of steps 1-4
D_MODEL, D_K, D_V = 4, 3, 2                  # the article's figure: 4 squares per row of X
BATCH = dict(batch_size=2, src_len=5, d_model=512, d_k=64, d_v=64)   # the article's §1.2.4
LENGTHS = (5, 3)                             # real tokens per batch sentence (then padding)
DROPOUT_P = 0.1
ARTICLE_SCORES = (2.0, 4.0, 4.0)             # §1.2.2: softmax([2, 4, 4]) = [0.0, 0.5, 0.5]
ARTICLE_WEIGHTS = (0.0, 0.5, 0.5)

_SUPERSCRIPTS = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")

Check = namedtuple("Check", "what error ok")


class Mismatch(RuntimeError):
    """npattn's fast kernels disagreed with the float64 reference beyond the dtype's tolerance.

    ``result`` is what :func:`run` would have returned; ``failed`` lists the failed checks.
    """

    def __init__(self, result):
        self.result = result
        self.failed = [c for c in result["checks"] if not c.ok]
        names = ", ".join(f"{c.what} ({c.error:.2g})" for c in self.failed)
        super().__init__(f"{len(self.failed)} of {len(result['checks'])} checks: npattn's "
                         f"{result['dtype']} kernels differ from npattn.reference beyond "
                         f"{result['tolerance']:.1e} relative: {names}")


def sup(n):
    """``n`` in superscript digits: x¹, k³."""
    return str(n).translate(_SUPERSCRIPTS)


def fmt(a, width=0):
    """Numbers rounded to 3 decimals: ``0.123`` or ``[0.063 0.468 0.468]`` (rows of a matrix are
    formatted by the caller, one line each)."""
    a = np.asarray(a, dtype=np.float64)
    cell = lambda v: f"{0.0 if abs(v) < 5e-4 else v:{width}.3f}"   # no "-0.000"
    if a.ndim == 0:
        return cell(float(a))
    return "[" + " ".join(cell(v) for v in a.reshape(-1)) + "]"


class Lesson:
    """Where the walkthrough prints, and the record of every npattn-versus-reference check."""

    def __init__(self, dtype, out):
        self.dtype = np.dtype(dtype)
        self.out = out
        self.tolerance = TOLERANCE_EPS * float(np.finfo(self.dtype).eps)
        self.checks = []

    def say(self, *lines):
        for line in lines:
            print(line, file=self.out)

    def heading(self, number, title, where):
        self.say("", f"Step {number} · {title}   [{where}]", "")

    def matrix(self, label, a):
        """A small matrix in full: its label and shape, then one indented line per row."""
        a = np.asarray(a)
        self.say(f"  {label}   {tuple(a.shape)}")
        for row in a.reshape(-1, a.shape[-1]):
            self.say("      " + fmt(row, 7))

    def check(self, what, fast, want, scale=0.0):
        """Record and print max |fast - want| / max(max |want|, scale); a wrong dtype or shape
        fails too. ``scale`` is the size of the terms of a sum that cancels to ~0."""
        fast = np.asarray(fast)
        want = np.asarray(want, dtype=np.float64)
        if fast.shape != want.shape or fast.dtype != self.dtype:
            error = math.inf
            note = (f"got {fast.dtype} {fast.shape}, want {self.dtype} {want.shape}")
        else:
            diff = np.max(np.abs(fast.astype(np.float64) - want), initial=0.0)
            size = max(np.max(np.abs(want), initial=0.0), scale, np.finfo(np.float64).tiny)
            error = float(diff / size)
            error = error if math.isfinite(error) else math.inf   # NaN fails as well
            note = f"{error:.1e}" + ("  (relative to the size of its terms)" if scale else "")
        ok = error <= self.tolerance
        self.checks.append(Check(what, error, ok))
        self.say(f"    {'ok' if ok else 'MISMATCH'}  {what}: {note}")
        return error


def _cast(dtype, *arrays):
    return [np.asarray(a, dtype=dtype) for a in arrays]


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def linear_init(rng, fan_out, fan_in, dtype):
    """nn.Linear(fan_in, fan_out)'s initialisation: weight (fan_out, fan_in) and bias (fan_out,)
    uniform in ±1/√fan_in."""
    bound = 1.0 / math.sqrt(fan_in)
    return _cast(dtype, rng.uniform(-bound, bound, (fan_out, fan_in)),
                 rng.uniform(-bound, bound, fan_out))


def positional_encoding(n_positions, d_model):
    """The Transformer's sinusoids: PE(t, 2i) = sin(t / 10000^(2i/d_model)), PE(t, 2i+1) = cos(...).

    Shapes: -> (n_positions, d_model) float64
    """
    t = np.arange(n_positions)[:, None]                  # (T, 1)
    two_i = np.arange(0, d_model, 2)[None, :]            # (1, d_model/2)
    angle = t / 10000.0 ** (two_i / d_model)             # (T, d_model/2)
    pe = np.empty((n_positions, d_model))
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, :d_model // 2])
    return pe


# ------------------------------------------------------------------------- the steps

def step_input(lesson, rng):
    """X: one row per token, x^t = word embedding + positional encoding (article §1.1)."""
    lesson.heading(1, "The input X", "article §1.1")
    n = len(TOKENS)
    embedding = rng.standard_normal((n, D_MODEL))        # nn.Embedding's N(0, 1) rows
    positional = positional_encoding(n, D_MODEL)         # (T, d_model)
    x = (embedding + positional).astype(lesson.dtype)    # (T, d_model)
    lesson.say(
        f"  The sentence X = \"{' '.join(TOKENS)}\", {n} tokens. Each token's word embedding",
        f"  (字向量) and its positional encoding (位置向量) have the same width d_model = {D_MODEL},",
        "  so they add: x^t = embedding(token t) + PE(t); row t of X is x^t (not a sentence).",
        "  PE(t, 2i) = sin(t / 10000^(2i/d_model)),  PE(t, 2i+1) = cos(t / 10000^(2i/d_model))",
        "")
    lesson.matrix(f"word embeddings, one row per token ({', '.join(TOKENS)})", embedding)
    lesson.matrix(f"+ positional encodings PE(t), t = 0..{n - 1}", positional)
    lesson.matrix(f"= X ({lesson.dtype}); row t is x^t: " +
                  ", ".join(f"x{sup(t + 1)} = {token}" for t, token in enumerate(TOKENS)), x)
    return dict(tokens=TOKENS, embedding=embedding, positional=positional, x=x)


def step_projections(lesson, rng, x):
    """q^t, k^t, v^t = three nn.Linear maps of x^t, token by token (article §1.2.1, §1.2.4)."""
    lesson.heading(2, "W^Q, W^K, W^V, and q^t, k^t, v^t for every token", "article §1.2.1")
    w_q, b_q = linear_init(rng, D_K, D_MODEL, lesson.dtype)
    w_k, b_k = linear_init(rng, D_K, D_MODEL, lesson.dtype)
    w_v, b_v = linear_init(rng, D_V, D_MODEL, lesson.dtype)
    lesson.say(
        f"  W_Q = nn.Linear(d_model={D_MODEL}, d_k={D_K}), W_K = nn.Linear({D_MODEL}, {D_K}), "
        f"W_V = nn.Linear({D_MODEL}, d_v={D_V}):",
        "  each holds a weight [out_features, in_features] and a bias, and computes",
        "  output = input·weightᵀ + bias (PyTorch's layout). The article's figure draws W^Q the",
        "  other way round, with d_model rows (X·W^Q): the same matrix, transposed. d_k and d_v",
        f"  are free choices (hyperparameters); here d_k = {D_K}, d_v = {D_V}.")
    for name, w, b in (("Q", w_q, b_q), ("K", w_k, b_k), ("V", w_v, b_v)):
        lesson.matrix(f"W^{name} = W_{name}.weight", w)
        lesson.say(f"  b^{name} = W_{name}.bias = {fmt(b)}")
    lesson.say("", "  q^t = W^Q·x^t + b^Q,  k^t = W^K·x^t + b^K,  v^t = W^V·x^t + b^V",
               "  (npattn.linear, one token at a time):")
    rows = {"q": [], "k": [], "v": []}
    for t in range(len(x)):
        for name, w, b in (("q", w_q, b_q), ("k", w_k, b_k), ("v", w_v, b_v)):
            rows[name].append(linear(x[t], w, b))        # (d_k,) or (d_v,)
        lesson.say(f"  q{sup(t + 1)} = {fmt(rows['q'][t], 6)}   k{sup(t + 1)} = "
                   f"{fmt(rows['k'][t], 6)}   v{sup(t + 1)} = {fmt(rows['v'][t], 6)}")
    q, k, v = (np.stack(rows[n]) for n in "qkv")         # (T, d_k), (T, d_k), (T, d_v)
    x64 = _f64(x)[0]
    for name, fast, w, b in (("q^t", q, w_q, b_q), ("k^t", k, w_k, b_k), ("v^t", v, w_v, b_v)):
        want = np.stack([reference.linear_forward(x64[t], *_f64(w, b)) for t in range(len(x))])
        lesson.check(name, fast, want)
    return dict(w_q=w_q, b_q=b_q, w_k=w_k, b_k=b_k, w_v=w_v, b_v=b_v, q=q, k=k, v=v)


def step_one_token(lesson, proj):
    """Token 1's output z¹: scores q¹·k^j, their softmax, the weighted sum of the v^j (§1.2.2)."""
    lesson.heading(3, "Token 1's output z¹, one dot product at a time", "article §1.2.2")
    q, k, v = proj["q"], proj["k"], proj["v"]
    q64, k64, v64 = _f64(q, k, v)
    n = len(k)
    js = range(1, n + 1)
    lesson.say(f"  1-2. score_j = q¹·k^j for j = 1..{n}  (the article lists \"k¹, k², k²\": "
               "the last one is k³)")
    scores = np.stack([matmul(q[0], k[j]) for j in range(n)])   # (T,)  each a 0-d dot product
    lesson.say("  " + "   ".join(f"q¹·k{sup(j)} = {fmt(s)}" for j, s in zip(js, scores)))
    lesson.check("scores q¹·k^j", scores, [np.dot(q64[0], k64[j]) for j in range(n)])

    weights = softmax(scores)                             # (T,)
    want_weights = reference.softmax_forward(_f64(scores)[0])
    lesson.say("  3. weights = softmax(score), weight_j = exp(score_j) / Σ_i exp(score_i):",
               f"     weights = {fmt(weights)}   (they sum to {fmt(np.sum(weights))})")
    lesson.check("softmax(scores)", weights, want_weights)

    article = softmax(np.asarray(ARTICLE_SCORES, dtype=lesson.dtype))
    want_article = reference.softmax_forward(np.asarray(ARTICLE_SCORES))
    lesson.say(f"     The article's own example: softmax([2, 4, 4]) = {fmt(article)}",
               f"     It writes {list(ARTICLE_WEIGHTS)}, rounded loosely: e²/(e² + 2e⁴) = "
               f"1/(1 + 2e²) = {1 / (1 + 2 * math.e ** 2):.4f},",
               "     which is 0.1 to one decimal, not 0.0.")
    lesson.check("softmax([2, 4, 4])", article, want_article)

    weighted = weights[:, None] * v                       # (T, d_v): row j = w_j·v^j
    lesson.say("  4. each value vector times its weight:")
    for j in js:
        lesson.say(f"     w_{j}·v{sup(j)} = {fmt(weights[j - 1])} · {fmt(v[j - 1], 6)} = "
                   f"{fmt(weighted[j - 1], 6)}")
    z1 = matmul(weights, v)                               # (T,)·(T, d_v) -> (d_v,)
    want_z1 = np.sum(want_weights[:, None] * v64, axis=0)
    lesson.say(f"  5. z¹ = Σ_j w_j·v^j = {fmt(z1)}   (npattn.matmul(weights, V): the same sum)",
               "     token 1's new vector: every token's value, weighted by how well its key",
               "     matches q¹.")
    lesson.check("z¹", z1, want_z1)
    return dict(scores=scores, weights=weights, article_softmax=article, weighted=weighted,
                z1=z1)


def sqrt_dk_demo(lesson, rng, widths=(D_K, 64, 512), pairs=2000):
    """Why √d_k: the variance of q·k over random unit-variance q, k is d_k; after /√d_k it is 1.
    Returns {d_k: (variance of q·k, variance of q·k/√d_k)} and, for d_k = 512, the largest
    softmax weight of one row of 5 scores without and with the scaling."""
    variances = {}
    for d in widths:
        a = rng.standard_normal((pairs, d))
        b = rng.standard_normal((pairs, d))
        dots = np.einsum("nd,nd->n", a, b)                # (pairs,)
        variances[d] = (float(np.var(dots)), float(np.var(dots / math.sqrt(d))))
    d = widths[-1]
    q, keys = rng.standard_normal(d), rng.standard_normal((5, d))
    raw = keys @ q                                        # (5,)
    peaks = (float(np.max(reference.softmax_forward(raw))),
             float(np.max(reference.softmax_forward(raw / math.sqrt(d)))))
    lesson.say("  Why divide by √d_k: q·k = Σ_i q_i·k_i adds d_k products; if the entries have",
               "  mean 0 and variance 1, the sum has variance d_k. Large scores saturate softmax",
               "  (one weight near 1, the rest near 0, gradients near 0); /√d_k brings the",
               f"  variance back to 1. Measured over {pairs} random pairs:")
    for d, (raw_var, scaled_var) in variances.items():
        lesson.say(f"     d_k = {d:>3}:  var(q·k) = {raw_var:7.1f}   var(q·k/√d_k) = "
                   f"{scaled_var:5.2f}")
    lesson.say(f"     one query against 5 keys, d_k = {d}: the largest softmax weight is "
               f"{peaks[0]:.3f} unscaled,", f"     {peaks[1]:.3f} scaled")
    return dict(variances=variances, peaks=peaks)


def step_matrix_form(lesson, rng, x, proj, token):
    """Q, K, V for all tokens at once; Z = softmax(Q·Kᵀ)·V, then the scaled version (§1.2.3, §2)."""
    lesson.heading(4, "Every token at once: the matrix form", "article §1.2.3 and §2")
    w = {n: (proj[f"w_{n}"], proj[f"b_{n}"]) for n in "qkv"}
    x64 = _f64(x)[0]
    lesson.say("  Stack the q^t into the query matrix Q (查询矩阵), the k^t into K (键矩阵), the v^t",
               "  into V (值矩阵): one nn.Linear call each. Rows = tokens, as in X.")
    big = {}
    for name in "QKV":
        big[name] = linear(x, *w[name.lower()])           # (T, d_k) or (T, d_v)
        lesson.matrix(f"{name} = X·W_{name}ᵀ + b_{name}", big[name])
        lesson.check(f"{name}", big[name], reference.linear_forward(x64, *_f64(*w[name.lower()])))
        lesson.check(f"{name} rows = the {name.lower()}^t of step 2", big[name],
                     proj[name.lower()])
    q, k, v = big["Q"], big["K"], big["V"]
    q64, k64, v64 = (reference.linear_forward(x64, *_f64(*w[n])) for n in "qkv")

    lesson.say("", "  Dot-product attention (§1): scores = Q·Kᵀ, weights = softmax(scores, "
               "dim=-1), Z = weights·V")
    scores = matmul(q, k.T)                               # (T, T): [i, j] = q^i·k^j
    lesson.matrix("scores = Q·Kᵀ   (row i: q^i against every key)", scores)
    want_scores = q64 @ k64.T
    lesson.check("Q·Kᵀ", scores, want_scores)
    weights = softmax(scores, dim=-1)                     # (T, T)
    want_weights = reference.softmax_forward(want_scores, dim=-1)
    lesson.matrix(f"weights = softmax(scores, dim=-1)   (row sums {fmt(weights.sum(axis=-1))})",
                  weights)
    lesson.check("softmax(Q·Kᵀ)", weights, want_weights)
    z = matmul(weights, v)                                # (T, d_v)
    lesson.matrix("Z = weights·V   (row t: token t's output z^t)", z)
    lesson.check("Z", z, want_weights @ v64)
    lesson.say(f"  Row 1 of Z = {fmt(z[0])}, z¹ of step 3 = {fmt(token['z1'])}:")
    lesson.check("Z[0] = z¹", z[0], _f64(token["z1"])[0])

    lesson.say("", "  Scaled dot-product attention (缩放点积注意力, §2): scores = Q·Kᵀ/√d_k")
    demo = sqrt_dk_demo(lesson, rng)
    root = np.asarray(math.sqrt(D_K), dtype=lesson.dtype)
    scaled = matmul(q, k.T) / root                        # (T, T)
    want_scaled = want_scores / math.sqrt(D_K)
    scaled_weights = softmax(scaled, dim=-1)              # (T, T)
    scaled_z = matmul(scaled_weights, v)                  # (T, d_v)
    lesson.matrix(f"scores = Q·Kᵀ/√{D_K}", scaled)
    lesson.check("Q·Kᵀ/√d_k", scaled, want_scaled)
    lesson.matrix("weights = softmax(scores, dim=-1)", scaled_weights)
    want_scaled_weights = reference.softmax_forward(want_scaled, dim=-1)
    lesson.check("softmax(Q·Kᵀ/√d_k)", scaled_weights, want_scaled_weights)
    lesson.matrix("Z = weights·V", scaled_z)
    want_z, want_fused_weights = reference.attention_forward(q64, k64, v64)
    lesson.check("Z (scaled)", scaled_z, want_z)

    lesson.say("", "  The same in one call: npattn.attention(Q, K, V) -> (Z, weights), the fused",
               "  engine (an online softmax over blocks of keys; it writes the T×T weights only",
               "  because this function returns them). With scale=1 it is the unscaled §1 form:")
    fused_z, fused_weights = attention(q, k, v)
    lesson.check("attention(Q, K, V) Z", fused_z, want_z)
    lesson.check("attention(Q, K, V) weights", fused_weights, want_fused_weights)
    unscaled_z, _ = attention(q, k, v, scale=1.0)
    lesson.say(f"  attention(Q, K, V, scale=1)[0] row 1 = {fmt(unscaled_z[0])} = z¹")
    lesson.check("attention(scale=1) row 1 = z¹", unscaled_z[0], _f64(token["z1"])[0])
    return dict(Q=q, K=k, V=v, scores=scores, weights=weights, Z=z, scaled_scores=scaled,
                scaled_weights=scaled_weights, scaled_Z=scaled_z, fused_Z=fused_z,
                fused_weights=fused_weights, unscaled_fused_Z=unscaled_z, sqrt_dk=demo)


def step_batch(lesson, rng, seed):
    """The article's batch: X (2, 5, 512) through Linear(512, 64), attention with a padding mask
    and with dropout (§1.2.4, §2.2)."""
    lesson.heading(5, "A batch, as the PyTorch code runs it", "article §1.2.4 and §2.2")
    b, s, d_model, d_k, d_v = (BATCH[n] for n in ("batch_size", "src_len", "d_model", "d_k",
                                                  "d_v"))
    x = rng.standard_normal((b, s, d_model)).astype(lesson.dtype)
    params = {n: linear_init(rng, d_out, d_model, lesson.dtype)
              for n, d_out in (("q", d_k), ("k", d_k), ("v", d_v))}
    x64 = _f64(x)[0]
    p64 = {n: _f64(*wb) for n, wb in params.items()}
    lesson.say(f"  X [batch_size, src_len, d_model] = {list(x.shape)}: {b} sentences of {s} "
               "tokens.",
               f"  W_Q = nn.Linear({d_model}, {d_k}) treats X as {b}·{s} = {b * s} independent "
               f"{d_model}-vectors,",
               f"  each multiplied by W_Qᵀ: Q = W_Q(X) is [{b}, {s}, {d_k}].")
    big = {n: linear(x, *params[n]) for n in "qkv"}       # (b, s, d_k|d_v)
    want = {n: reference.linear_forward(x64, *p64[n]) for n in "qkv"}
    rows = linear(x.reshape(b * s, d_model), *params["q"])   # (10, d_k)
    lesson.say(f"  Q = W_Q(X) {big['q'].shape}   K = W_K(X) {big['k'].shape}   "
               f"V = W_V(X) {big['v'].shape}")
    for n in "qkv":
        lesson.check(n.upper(), big[n], want[n])
    lesson.check(f"W_Q(X.reshape({b * s}, {d_model})).reshape({b}, {s}, {d_k}) = Q",
                 rows.reshape(b, s, d_k), big["q"])
    q, k, v = big["q"], big["k"], big["v"]
    q64, k64, v64 = want["q"], want["k"], want["v"]

    lesson.say("", "  The article's attention(query, key, value), line by line on npattn's ops:")
    root = np.asarray(math.sqrt(d_k), dtype=lesson.dtype)
    scores = matmul(q, np.swapaxes(k, -1, -2)) / root     # (b, s, s)
    weights = softmax(scores, dim=-1)                     # (b, s, s)
    z = matmul(weights, v)                                # (b, s, d_v)
    lesson.say(f"  scores  = matmul(query, key.transpose(-2, -1)) / √d_k  {scores.shape}",
               f"  weights = softmax(scores, dim=-1)                      {weights.shape}",
               f"  Z       = matmul(weights, value)                       {z.shape}")
    want_scores = (q64 @ np.swapaxes(k64, -1, -2)) / math.sqrt(d_k)
    want_z, want_weights = reference.attention_forward(q64, k64, v64)
    lesson.check("scores", scores, want_scores)
    lesson.check("weights", weights, want_weights)
    lesson.check("Z", z, want_z)
    fused_z, fused_weights = attention(q, k, v)
    lesson.say("  and in one call: Z, weights = npattn.attention(Q, K, V)")
    lesson.check("attention Z", fused_z, want_z)
    lesson.check("attention weights", fused_weights, want_weights)

    lesson.say("", "  The article's function takes mask and dropout but never uses them, and "
               "returns",
               "  matmul(p_attn, value) with p_attn undefined: in the Annotated Transformer it "
               "is the",
               "  weights after dropout, and masked scores are filled with -1e9 where mask == 0.",
               "  npattn.attention(query, key, value, mask, dropout_p, seed=...) does both and "
               "returns",
               "  (output, p_attn). Its boolean mask uses True = attend, so pass mask != 0;",
               "  masked scores become -inf (a row with every key masked gives zeros, not NaN).")
    lengths = np.asarray(LENGTHS)
    mask01 = (np.arange(s)[None, None, :] < lengths[:, None, None]).astype(np.int64)
    mask01 = np.broadcast_to(mask01, (b, s, s))           # (batch, query_len, key_len)
    mask = mask01 != 0
    masked_z, masked_weights = attention(q, k, v, mask)
    last = len(lengths) - 1
    lesson.say(f"  Padding: sentence {last + 1} has {lengths[last]} real tokens, then "
               f"{s - lengths[last]} padding. mask[{last}, 0] = {mask01[last, 0].tolist()}",
               f"  weights[{last}, 0] = {fmt(masked_weights[last, 0])}   (no weight on "
               "padding)")
    want_masked_z, want_masked_weights = reference.attention_forward(q64, k64, v64, mask)
    lesson.check("attention(mask) Z", masked_z, want_masked_z)
    lesson.check("attention(mask) weights", masked_weights, want_masked_weights)

    keep = dropout_mask((b, s, s), DROPOUT_P, seed)       # what attention's dropout keeps
    drop_z, drop_weights = attention(q, k, v, mask, DROPOUT_P, seed=seed)
    lesson.say(f"  Dropout p = {DROPOUT_P}, seed {seed}: each weight is zeroed with probability "
               "p, the rest",
               "  scaled by 1/(1-p); the keep-mask is a function of the seed alone "
               "(npattn.dropout_mask),",
               "  so backward regenerates it.",
               f"  p_attn[0, 0] = {fmt(drop_weights[0, 0])}   (row sum "
               f"{fmt(drop_weights[0, 0].sum())}; {int((~keep).sum())} of {keep.size} weights "
               "dropped)")
    want_drop_z, want_drop_weights = reference.attention_forward(q64, k64, v64, mask, keep,
                                                                 DROPOUT_P)
    lesson.check("attention(mask, dropout) Z", drop_z, want_drop_z)
    lesson.check("attention(mask, dropout) p_attn", drop_weights, want_drop_weights)
    return dict(x=x, params=params, Q=q, K=k, V=v, scores=scores, weights=weights, Z=z,
                fused_Z=fused_z, fused_weights=fused_weights, mask=mask, masked_Z=masked_z,
                masked_weights=masked_weights, keep=keep, dropout_p=DROPOUT_P, seed=seed,
                dropout_Z=drop_z, dropout_weights=drop_weights)


def step_backward(lesson, rng, batch):
    """The chain rule from dZ back to dX and the three Linears' weights, with the ``*_backward``
    pairs; then the fused attention_backward (not in the article)."""
    lesson.heading(6, "The backward pass: from dZ to dX, dW_Q, dW_K, dW_V", "not in the article")
    x, params = batch["x"], batch["params"]
    q, k, v, weights = batch["Q"], batch["K"], batch["V"], batch["weights"]
    d_k = q.shape[-1]
    dz = rng.standard_normal(batch["Z"].shape).astype(lesson.dtype)   # (b, s, d_v)
    x64, dz64 = _f64(x, dz)
    p64 = {n: _f64(*wb) for n, wb in params.items()}
    q64, k64, v64 = (reference.linear_forward(x64, *p64[n]) for n in "qkv")
    k64_t = np.swapaxes(k64, -1, -2)
    weights64 = reference.softmax_forward((q64 @ k64_t) / math.sqrt(d_k), dim=-1)
    lesson.say("  A loss L gives dZ = ∂L/∂Z (here random, of Z's shape); each op's *_backward "
               "turns the",
               "  gradient of its output into the gradients of its inputs:")

    k_t = np.swapaxes(k, -1, -2)
    dweights, dv = matmul_backward(dz, weights, v)
    dweights64, dv64 = reference.matmul_backward(dz64, weights64, v64)
    lesson.say(f"  Z = weights·V          -> dweights = dZ·Vᵀ {dweights.shape}, "
               f"dV = weightsᵀ·dZ {dv.shape}")
    lesson.check("dweights", dweights, dweights64)
    lesson.check("dV", dv, dv64)
    dscores = softmax_backward(dweights, weights, dim=-1)
    dscores64 = reference.softmax_backward(dweights64, weights64, dim=-1)
    lesson.say(f"  weights = softmax(s)   -> ds = weights ∘ (dweights - Σ_j dweights_j·"
               f"weights_j) {dscores.shape}")
    lesson.check("dscores", dscores, dscores64)
    root = np.asarray(math.sqrt(d_k), dtype=lesson.dtype)
    dq, dk_t = matmul_backward(dscores / root, q, k_t)
    dk = np.swapaxes(dk_t, -1, -2)
    dq64, dk64_t = reference.matmul_backward(dscores64 / math.sqrt(d_k), q64, k64_t)
    dk64 = np.swapaxes(dk64_t, -1, -2)
    lesson.say(f"  s = Q·Kᵀ/√d_k          -> dQ = ds·K/√d_k {dq.shape}, "
               f"dK = dsᵀ·Q/√d_k {dk.shape}")
    lesson.check("dQ", dq, dq64)
    lesson.check("dK", dk, dk64)

    lesson.say("  Q = X·W_Qᵀ + b_Q etc.  -> dX = dQ·W_Q + dK·W_K + dV·W_V,",
               "                            dW_Q = Σ_rows dQᵀ·X, db_Q = Σ_rows dQ, and so on")
    dx = np.zeros_like(x)
    dx64 = np.zeros_like(x64)
    grads = {}
    for n, d, d64 in (("q", dq, dq64), ("k", dk, dk64), ("v", dv, dv64)):
        dx_part, dweight, dbias = linear_backward(d, x, *params[n])
        dx64_part, dweight64, dbias64 = reference.linear_backward(d64, x64, *p64[n])
        dx += dx_part
        dx64 += dx64_part
        grads[f"dW_{n.upper()}"], grads[f"db_{n.upper()}"] = dweight, dbias
        lesson.say(f"     dW_{n.upper()} {dweight.shape}  first entries {fmt(dweight[0, :4])}")
        lesson.check(f"dW_{n.upper()}", dweight, dweight64)
        terms = float(np.max(np.sum(np.abs(d64), axis=(0, 1))))   # Σ_rows |dout|
        lesson.check(f"db_{n.upper()}", dbias, dbias64, scale=terms)
        if n == "k":
            lesson.say(f"     db_K = {fmt(dbias[:4])}...: zero but for rounding (max |db_K| "
                       f"{np.max(np.abs(dbias)):.0e}). b_K adds",
                       "     q^i·b_K to every score of row i, and softmax ignores what is added "
                       "to a whole row.")
    lesson.say(f"     dX {dx.shape}")
    lesson.check("dX", dx, dx64)

    lesson.say("", "  The fused engine's backward: npattn.attention_backward(dZ, Q, K, V) "
               "recomputes the",
               "  weights block by block from one logsumexp per row instead of storing them:")
    fused = attention_backward(dz, q, k, v)
    for name, got, want in zip(("dQ", "dK", "dV"), fused, (dq64, dk64, dv64)):
        lesson.check(f"attention_backward {name}", got, want)
    mask, keep, p, seed = batch["mask"], batch["keep"], batch["dropout_p"], batch["seed"]
    lesson.say(f"  and with the padding mask and dropout (p = {p}, seed {seed}); the keep-mask "
               "is regenerated:")
    fused_masked = attention_backward(dz, q, k, v, mask, p, seed=seed)
    want_masked = reference.attention_backward(dz64, q64, k64, v64, mask, keep, p)[:3]
    for name, got, want in zip(("dQ", "dK", "dV"), fused_masked, want_masked):
        lesson.check(f"attention_backward(mask, dropout) {name}", got, want)
    return dict(dZ=dz, dweights=dweights, dV=dv, dscores=dscores, dQ=dq, dK=dk, dX=dx, **grads,
                fused=fused, fused_masked=fused_masked)


# ------------------------------------------------------------------------- the whole lesson

def _dtype_arg(dtype):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64; got {dtype!r}")
    return dt


def run(seed=0, dtype=np.float32, out=None, strict=True):
    """Print the walkthrough to ``out`` (default sys.stdout) and return its numbers.

    Returns a dict: one entry per step ("input", "projections", "token", "matrix", "batch",
    "backward"), each the dict its step function returned; "checks", the list of
    ``Check(what, error, ok)``; "max_discrepancy", the largest relative error; "tolerance";
    "dtype"; "ok". With ``strict`` a failed check raises :class:`Mismatch` after the last step.
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    lesson = Lesson(_dtype_arg(dtype), sys.stdout if out is None else out)
    rng = np.random.default_rng(seed)
    lesson.say(f"The article's dot-product attention, step by step: npattn's {lesson.dtype} "
               "kernels against",
               f"the float64 textbook npattn.reference (seed {seed}; numbers rounded to 3 "
               "decimals).",
               "Each \"ok  <what>: <e>\" line checks one result: e = max |npattn - reference| / "
               "max |reference|",
               f"must stay within {TOLERANCE_EPS} {lesson.dtype} epsilons ({lesson.tolerance:.1e})"
               "; \"MISMATCH\" marks a kernel bug.")
    result = {}
    result["input"] = step_input(lesson, rng)
    result["projections"] = step_projections(lesson, rng, result["input"]["x"])
    result["token"] = step_one_token(lesson, result["projections"])
    result["matrix"] = step_matrix_form(lesson, rng, result["input"]["x"],
                                        result["projections"], result["token"])
    result["batch"] = step_batch(lesson, rng, seed)
    result["backward"] = step_backward(lesson, rng, result["batch"])
    checks = lesson.checks
    worst = max(c.error for c in checks)
    result.update(checks=checks, max_discrepancy=worst, tolerance=lesson.tolerance,
                  dtype=lesson.dtype, ok=all(c.ok for c in checks))
    lesson.say("")
    if result["ok"]:
        lesson.say(f"All {len(checks)} checks agree: the largest difference between npattn "
                   f"({lesson.dtype}) and the float64",
                   f"reference is {worst:.1e} of the reference's magnitude "
                   f"(tolerance {TOLERANCE_EPS} eps = {lesson.tolerance:.1e}).")
    else:
        failed = [c.what for c in checks if not c.ok]
        lesson.say(f"MISMATCH: {len(failed)} of {len(checks)} checks exceed the {lesson.dtype} "
                   f"tolerance {lesson.tolerance:.1e}: {', '.join(failed)}")
        if strict:
            raise Mismatch(result)
    return result


def _utf8_safe(stream):
    """Print the lesson's √, ᵀ and · even where the terminal's encoding lacks them."""
    try:
        "√ᵀ·∘Σ字".encode(stream.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def build_parser(prog="npattn explain"):
    parser = argparse.ArgumentParser(
        prog=prog, description="The seed article's dot-product attention, executed step by "
        "step: every formula with its shapes and numbers, computed by npattn's kernels and by "
        "the float64 reference (npattn.reference), and checked. Exits with 1 if they disagree.")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random embeddings, weights and dropout (default 0)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype of npattn's kernels (default float32)")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="also draw the steps as PNGs in DIR: the scores, the softmax "
                             "weights as a heatmap, the output, the batch's masked weights "
                             "(needs matplotlib: pip install \"npattn[plot]\")")
    return parser


def main(argv=None, prog="npattn explain"):
    args = build_parser(prog).parse_args(argv)
    if args.seed < 0:
        build_parser(prog).error(f"--seed must be non-negative; got {args.seed}")
    if args.plot is not None:
        from . import plot
        status = plot.exit_status("--plot", prog)      # before any work: one line, status 2
        if status is not None:
            return status
    _utf8_safe(sys.stdout)
    result = run(args.seed, np.dtype(args.dtype), strict=False)
    if args.plot is not None:
        for path in plot.explain_figures(result, args.plot):
            print(f"wrote {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
