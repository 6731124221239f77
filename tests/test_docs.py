"""The documents kept honest, cheaply: docs/backward.md's pointers name real functions and its
identities hold; docs/architecture.md's and CONTRIBUTING.md's pointers and paths exist and the
lists they mirror (layers, tools, commands, kernel-marked test files, backward.md's sections, the
module -> test map) are the code's.

Each numeric test writes a formula exactly as the document states it and checks it, in float64,
against ``npattn.reference`` (the textbook) or against central finite differences -- so an edit
that breaks a formula in the code, or a formula in the document that the code does not follow,
fails here. No kernel runs: the whole file takes a few seconds.
"""
import ast
import math
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from npattn import reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "backward.md"
POINTER = re.compile(r"`((?:npattn|tests)/[\w/]+\.py)::([\w.]+)")
TOL = dict(rtol=1e-10, atol=1e-12)         # two float64 evaluations of one formula
FD_TOL = dict(rtol=1e-6, atol=1e-8)        # central differences, h = 1e-6 (section 12)


def doc_text():
    return DOC.read_text(encoding="utf-8")


def defined_names(path):
    """Functions defined in a module: top-level ``f`` and ``Class.method``."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


# ------------------------------------------------------------------------- the document itself

def test_every_pointer_names_an_existing_function():
    pointers = POINTER.findall(doc_text())
    assert len(pointers) >= 40, f"only {len(pointers)} file::function pointers found"
    missing = []
    for file, name in sorted(set(pointers)):
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
        elif name not in defined_names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/backward.md points at functions that do not exist: {missing}"


def test_every_functional_backward_is_derived():
    """A new ``<op>_backward`` in npattn/functional needs its section in the document."""
    pointed = {f"{file}::{name}" for file, name in POINTER.findall(doc_text())}
    for path in sorted((ROOT / "npattn" / "functional").glob("*.py")):
        for name in defined_names(path):
            if name.endswith("_backward") and not name.startswith("_"):
                pointer = f"{path.relative_to(ROOT).as_posix()}::{name}"
                assert pointer in pointed, f"docs/backward.md does not derive {pointer}"


def test_sections_are_all_there():
    headings = re.findall(r"^## (\d+)\. ", doc_text(), flags=re.M)
    assert headings == [str(i) for i in range(1, 16)], headings


# ------------------------------------------------------------------------- helpers

seeds = st.integers(0, 2**32 - 1)
small = st.integers(1, 5)


def central_differences(f, x, h=1e-6):
    """∂f/∂x for a scalar f of one float64 array, element by element (section 12)."""
    grad = np.empty_like(x)
    for j in np.ndindex(x.shape):
        keep = x[j]
        x[j] = keep + h
        up = f(x)
        x[j] = keep - h
        down = f(x)
        x[j] = keep
        grad[j] = (up - down) / (2 * h)
    return grad


def dot_with(dout, forward):
    """f(x) = Σ dout ∘ forward(x): the scalar whose gradient is backward(dout, x) (section 12)."""
    return lambda x: float(np.sum(dout * forward(x)))


def masked_scores(rng, shape, fully_masked_rows=True):
    """Scores with -inf entries and (optionally) whole rows of -inf, as attention masks make."""
    x = rng.standard_normal(shape) * 2.0
    x[rng.random(shape) < 0.25] = -np.inf
    if fully_masked_rows:
        x[rng.random(shape[:-1]) < 0.25] = -np.inf
    return x


# ------------------------------------------------------------------------- sections 1-3

@given(seed=seeds, m=small, n=small)
def test_broadcast_gradient_is_a_sum(seed, m, n):
    """Section 1: a (m, 1) + b (n,) -> y (m, n): da = Σ_j dy (dim kept), db = Σ_i dy."""
    dy = np.random.default_rng(seed).standard_normal((m, n))
    np.testing.assert_allclose(reference._sum_to_shape(dy, (m, 1)),
                               dy.sum(axis=1, keepdims=True), **TOL)
    np.testing.assert_allclose(reference._sum_to_shape(dy, (n,)), dy.sum(axis=0), **TOL)


@given(seed=seeds, lead=st.lists(small, max_size=2), fin=small, fout=small)
def test_linear_backward_formulas(seed, lead, fin, fout):
    """Section 2: dx = dout·W, dW = doutᵀ·x and db = Σ dout over the flattened rows, against
    central differences of the forward."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, fin))
    weight, bias = rng.standard_normal((fout, fin)), rng.standard_normal(fout)
    dout = rng.standard_normal((*lead, fout))
    rows_x, rows_dout = x.reshape(-1, fin), dout.reshape(-1, fout)
    doc = (dout @ weight, rows_dout.T @ rows_x, rows_dout.sum(axis=0))
    for got, want in zip(reference.linear_backward(dout, x, weight, bias), doc):
        np.testing.assert_allclose(got, want, **TOL)
    loss = dot_with(dout, lambda w: reference.linear_forward(x, w, bias))
    np.testing.assert_allclose(doc[1], central_differences(loss, weight.copy()), **FD_TOL)


@given(seed=seeds, batch=st.lists(small, min_size=1, max_size=2), m=small, k=small, n=small)
def test_matmul_folded_batch_sums_inside_the_product(seed, batch, m, k, n):
    """Section 3: with b unbatched, db = aᵀ·dout over all Ba·M rows is the sum over batches."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((*batch, m, k)), rng.standard_normal((k, n))
    dout = rng.standard_normal((*batch, m, n))
    da, db = reference.matmul_backward(dout, a, b)
    np.testing.assert_allclose(db, a.reshape(-1, k).T @ dout.reshape(-1, n), **TOL)
    np.testing.assert_allclose(da, dout @ b.T, **TOL)


@given(seed=seeds, k=small)
def test_matmul_of_two_vectors(seed, k):
    """Section 3: both 1-D is the dot product: da = dout·b, db = dout·a."""
    rng = np.random.default_rng(seed)
    a, b, dout = rng.standard_normal(k), rng.standard_normal(k), rng.standard_normal(())
    da, db = reference.matmul_backward(dout, a, b)
    np.testing.assert_allclose(da, dout * b, **TOL)
    np.testing.assert_allclose(db, dout * a, **TOL)


# ------------------------------------------------------------------------- sections 4-5

@given(seed=seeds, rows=small, c=st.integers(1, 7))
def test_softmax_backward_is_the_jacobian_product(seed, rows, c):
    """Section 4: y ∘ (dout − Σ dout∘y) equals doutᵀ·(diag(y) − y·yᵀ), row by row, masked
    entries and fully masked rows included; and each row of dx sums to 0."""
    rng = np.random.default_rng(seed)
    y = reference.softmax_forward(masked_scores(rng, (rows, c)))
    dout = rng.standard_normal((rows, c))
    jacobian = np.einsum("ni,ij->nij", y, np.eye(c)) - np.einsum("ni,nj->nij", y, y)
    want = np.einsum("ni,nij->nj", dout, jacobian)
    got = reference.softmax_backward(dout, y)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got.sum(axis=-1), 0.0, atol=1e-12)
    assert np.all(got[y == 0] == 0)                # no gradient reaches a masked position


@given(seed=seeds, rows=small, c=st.integers(1, 7))
def test_log_softmax_backward_is_the_jacobian_product(seed, rows, c):
    """Section 5: dout − exp(out)·Σ dout equals doutᵀ·(I − 1·yᵀ); a fully masked row gets 0."""
    rng = np.random.default_rng(seed)
    x = masked_scores(rng, (rows, c))
    out = reference.log_softmax_forward(x)
    y = reference.softmax_forward(x)
    dout = rng.standard_normal((rows, c))
    jacobian = np.eye(c)[None] - y[:, None, :]       # ∂z_i/∂x_j = δ_ij − y_j
    want = np.einsum("ni,nij->nj", dout, jacobian)
    masked = np.all(np.isneginf(x), axis=-1)
    want[masked] = 0.0
    np.testing.assert_allclose(reference.log_softmax_backward(dout, out), want, **TOL)


# ------------------------------------------------------------------------- sections 7-8

@st.composite
def attention_cases(draw, gqa=False):
    """One head group: q (H, L, E), k (Hkv, S, E), v (Hkv, S, Ev), dout, a mask and dropout."""
    rng = np.random.default_rng(draw(seeds))
    hkv = draw(st.integers(1, 2))
    h = hkv * (draw(st.integers(1, 3)) if gqa else 1)
    l, s, e, ev = (draw(small) for _ in range(4))
    q = rng.standard_normal((h, l, e))
    k, v = rng.standard_normal((hkv, s, e)), rng.standard_normal((hkv, s, ev))
    dout = rng.standard_normal((h, l, ev))
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if kind == "bool":                             # (L, S), broadcast over heads
        mask = rng.random((l, s)) < 0.7
        mask[rng.random(l) < 0.3] = False          # fully masked rows
    elif kind == "float":
        mask = rng.standard_normal((1, l, s))
        mask[rng.random((1, l, s)) < 0.2] = -np.inf
    p_drop = draw(st.sampled_from([0.0, 0.3]))
    keep = rng.random((h, l, s)) >= p_drop if p_drop else None
    return q, k, v, dout, mask, keep, p_drop


def probabilities(q, k, mask, scale):
    """p = softmax(s), s = scale·q·kᵀ + M: the pre-dropout probabilities (section 7)."""
    return reference.softmax_forward(reference._masked_scores(q, k, mask, scale))


@given(case=attention_cases())
def test_D_is_rowsum_of_dout_times_output(case):
    """Section 7: D_i = Σ_j p_ij·dp_ij equals Σ_c dout_ic·o_ic, with and without dropout."""
    q, k, v, dout, mask, keep, p_drop = case
    scale = 1.0 / np.sqrt(q.shape[-1])
    out, _ = reference.attention_forward(q, k, v, mask, keep, p_drop, scale)
    p = probabilities(q, k, mask, scale)
    dp = dout @ np.swapaxes(v, -1, -2)
    if keep is not None:
        dp = reference.dropout_backward(dp, keep, p_drop)
    np.testing.assert_allclose(np.sum(dout * out, axis=-1), np.sum(p * dp, axis=-1), **TOL)


def doc_attention_backward(dout, q, k, v, mask, keep, p_drop, scale, out):
    """Section 7's four steps, with D from (dout, o), as the document writes them."""
    p = probabilities(q, k, mask, scale)
    w = p if keep is None else np.where(keep, p / (1.0 - p_drop), 0.0)
    dv = np.swapaxes(w, -1, -2) @ dout                         # (1) dv = wᵀ·dout
    dw = dout @ np.swapaxes(v, -1, -2)                         #     dw = dout·vᵀ
    dp = dw if keep is None else np.where(keep, dw / (1.0 - p_drop), 0.0)   # (2)
    d = np.sum(dout * out, axis=-1, keepdims=True)             # D = rowsum(dout ∘ o)
    ds = p * (dp - d)                                          # (3)
    dq = scale * ds @ k                                        # (4)
    dk = scale * np.swapaxes(ds, -1, -2) @ q
    return dq, dk, dv, ds


@given(case=attention_cases())
def test_attention_backward_steps(case):
    """Section 7: the four steps give reference.attention_backward's dq, dk, dv and dmask (ds
    summed to the mask's shape); masked positions get ds = 0."""
    q, k, v, dout, mask, keep, p_drop = case
    scale = 1.0 / np.sqrt(q.shape[-1])
    out, _ = reference.attention_forward(q, k, v, mask, keep, p_drop, scale)
    dq, dk, dv, ds = doc_attention_backward(dout, q, k, v, mask, keep, p_drop, scale, out)
    want = reference.attention_backward(dout, q, k, v, mask, keep, p_drop, scale)
    for got, ref in zip((dq, dk, dv), want[:3]):
        np.testing.assert_allclose(got, ref, **TOL)
    scores = reference._masked_scores(q, k, mask, scale)
    assert np.all(ds[np.isneginf(np.broadcast_to(scores, ds.shape))] == 0)
    if mask is not None and mask.dtype != bool:
        np.testing.assert_allclose(reference._sum_to_shape(ds, mask.shape), want[3], **TOL)


@given(case=attention_cases(), softcap=st.sampled_from([0.5, 3.0]),
       sink_scale=st.sampled_from([0.0, 2.0]))
@settings(max_examples=10)
def test_softcap_and_sink_gradients_by_central_differences(case, softcap, sink_scale):
    """Section 7, soft-capping and sinks: dr = ds ∘ (1 − tanh²(r/c)) gives dq, and dσ_h =
    −Σ_i π_i·D_i with π_i = exp(σ_h − lse_i), both against central differences of
    Σ dout ∘ o (and the reference's gradients against the same)."""
    q, k, v, dout, mask, _, _ = case
    if q.shape[0] != k.shape[0]:
        return                                           # (GQA draws: section's GQA test)
    rng = np.random.default_rng(q.size)
    sinks = rng.standard_normal(q.shape[0]) * sink_scale
    scale = 1.0 / np.sqrt(q.shape[-1])

    def loss(q_, sinks_):
        out, _ = reference.attention_forward(q_, k, v, mask, scale=scale, softcap=softcap,
                                             sinks=sinks_)
        return np.sum(dout * out)

    out, lse = reference.scaled_dot_product_attention_forward(q, k, v, mask, scale=scale,
                                                              softcap=softcap, sinks=sinks)
    raw = scale * q @ np.swapaxes(k, -1, -2)
    s = reference._masked_scores(q, k, mask, scale, softcap)
    with np.errstate(invalid="ignore"):
        p = np.where(np.isneginf(s), 0.0, np.exp(s - lse[..., None]))
    d = np.sum(dout * out, axis=-1)                            # D = rowsum(dout ∘ o)
    ds = p * (dout @ np.swapaxes(v, -1, -2) - d[..., None])
    dq = scale * (ds * (1 - np.tanh(raw / softcap) ** 2)) @ k   # dr = ds ∘ (1 − tanh²)
    dsinks = -np.sum(np.exp(sinks[:, None] - lse) * d, axis=-1)  # −Σ_i π_i·D_i
    h = 1e-6
    fd_q = np.zeros_like(q)
    for idx in np.ndindex(q.shape):
        e = np.zeros_like(q)
        e[idx] = h
        fd_q[idx] = (loss(q + e, sinks) - loss(q - e, sinks)) / (2 * h)
    fd_s = np.array([(loss(q, sinks + h * np.eye(len(sinks))[i])
                      - loss(q, sinks - h * np.eye(len(sinks))[i])) / (2 * h)
                     for i in range(len(sinks))])
    np.testing.assert_allclose(dq, fd_q, **FD_TOL)
    np.testing.assert_allclose(dsinks, fd_s, **FD_TOL)
    want = reference.attention_backward(dout, q, k, v, mask, scale=scale, softcap=softcap,
                                        sinks=sinks)
    np.testing.assert_allclose(want[0], dq, **TOL)
    np.testing.assert_allclose(want[4], dsinks, **TOL)


@given(case=attention_cases(gqa=True))
def test_gqa_gradients_sum_over_the_group(case):
    """Section 7: dk_g, dv_g are the sums over the G query heads that read kv head g."""
    q, k, v, dout, mask, keep, p_drop = case
    group = q.shape[0] // k.shape[0]
    scale = 0.5
    k_h, v_h = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)   # head h reads h // G
    out, _ = reference.attention_forward(q, k_h, v_h, mask, keep, p_drop, scale)
    dq, dk_h, dv_h, _ = doc_attention_backward(dout, q, k_h, v_h, mask, keep, p_drop, scale, out)
    want = reference.scaled_dot_product_attention_backward(
        dout, q, k, v, mask, keep, p_drop, scale=scale, enable_gqa=True)
    np.testing.assert_allclose(dq, want[0], **TOL)
    for got, ref in ((dk_h, want[1]), (dv_h, want[2])):
        summed = got.reshape(k.shape[0], group, *got.shape[1:]).sum(axis=1)
        np.testing.assert_allclose(summed, ref, **TOL)


def online_softmax(s, v, keep, p_drop, block):
    """Section 8's forward recurrence over key blocks: (o, lse), written as the document does."""
    rows = s.shape[0]
    m, ell = np.full(rows, -np.inf), np.zeros(rows)
    o = np.zeros((rows, v.shape[1]))
    drop = np.ones_like(s) if keep is None else keep / (1.0 - p_drop)
    for j0 in range(0, s.shape[1], block):
        sj = s[:, j0:j0 + block]
        m_new = np.maximum(m, sj.max(axis=1))
        shift = np.where(np.isneginf(m_new), 0.0, m_new)      # all masked so far: shift by 0
        alpha = np.exp(m - shift)
        e = np.exp(sj - shift[:, None])
        ell = alpha * ell + e.sum(axis=1)
        o = alpha[:, None] * o + (e * drop[:, j0:j0 + block]) @ v[j0:j0 + block]
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(ell[:, None] == 0, 0.0, o / ell[:, None])
        lse = np.where(ell == 0, -np.inf, m + np.log(ell))
    return out, lse


@given(case=attention_cases(), block=st.integers(1, 4))
def test_online_softmax_is_exact(case, block):
    """Section 8: the block recurrence gives forward's output and logsumexp, and p = exp(s − lse)
    rebuilt from lse alone is the softmax, one block at a time."""
    q, k, v, _, mask, keep, p_drop = case
    scale = 1.0 / np.sqrt(q.shape[-1])
    out, lse = reference.scaled_dot_product_attention_forward(q, k, v, mask, keep, p_drop,
                                                              scale=scale)
    scores = reference._masked_scores(q, k, mask, scale)        # (H, L, S)
    for h in range(q.shape[0]):
        got_o, got_lse = online_softmax(scores[h], v[h], None if keep is None else keep[h],
                                        p_drop, block)
        np.testing.assert_allclose(got_o, out[h], **TOL)
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(lse[h]))
        finite = np.isfinite(lse[h])
        np.testing.assert_allclose(got_lse[finite], lse[h][finite], **TOL)
        backward_lse = np.where(np.isneginf(lse[h]), np.inf, lse[h])   # masked row: +inf
        for j0 in range(0, scores.shape[-1], block):
            sj = scores[h, :, j0:j0 + block]
            p_block = np.exp(sj - backward_lse[:, None])
            want = reference.softmax_forward(scores[h])[:, j0:j0 + block]
            np.testing.assert_allclose(p_block, want, **TOL)


# ------------------------------------------------------------------------- sections 5, 9-11

@given(seed=seeds, n=small, c=st.integers(1, 5), reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.2]))
def test_cross_entropy_gradient_is_softmax_minus_target(seed, n, c, reduction, smoothing):
    """Section 5: d loss/d logits = dℓ·(softmax − ((1 − ε)·onehot + ε/C)), 0 on ignored rows,
    dℓ = dout / M for "mean" -- against the textbook and central differences of the loss."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c)) * 2.0
    target = rng.integers(0, c, size=n)
    target[rng.random(n) < 0.3] = -100                         # ignore_index
    ignored = target == -100
    dout = rng.standard_normal(n if reduction == "none" else ())
    if reduction == "none":
        dl = dout
    elif reduction == "sum":
        dl = np.full(n, float(dout))
    else:
        dl = np.full(n, float(dout) / max(np.sum(~ignored), 1))
    q = (1 - smoothing) * (np.arange(c) == target[:, None]) + smoothing / c
    doc = dl[:, None] * (reference.softmax_forward(x) - q)
    doc[ignored] = 0.0
    args = (target, -100, reduction, smoothing)
    np.testing.assert_allclose(reference.cross_entropy_backward(dout, x, *args), doc, **TOL)
    if reduction == "mean" and ignored.all():
        return                                                 # the loss is NaN: no differences
    loss = dot_with(dout, lambda x: reference.cross_entropy_forward(x, *args))
    np.testing.assert_allclose(doc, central_differences(loss, x.copy()), **FD_TOL)


@given(seed=seeds, lead=st.lists(small, min_size=1, max_size=2),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       eps=st.sampled_from([1e-5, 0.5]))
def test_layer_norm_dx_formula(seed, lead, shape, eps):
    """Section 9: dx = rstd·(g − mean(g) − x̂·mean(g∘x̂)), g = dout∘γ; dγ = Σ dout∘x̂, dβ = Σ dout
    -- against central differences of the forward and against the textbook."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, *shape))
    gamma, beta = rng.standard_normal(shape), rng.standard_normal(shape)
    dout = rng.standard_normal(x.shape)
    axes = tuple(range(len(lead), x.ndim))

    def mean(a):                                               # over the row
        return a.mean(axis=axes, keepdims=True)

    rstd = 1.0 / np.sqrt(mean((x - mean(x)) ** 2) + eps)
    xhat = (x - mean(x)) * rstd
    g = dout * gamma
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    rows = tuple(range(len(lead)))
    doc = (dx, np.sum(dout * xhat, axis=rows), np.sum(dout, axis=rows))
    for got, want in zip(reference.layer_norm_backward(dout, x, tuple(shape), gamma, beta, eps),
                         doc):
        np.testing.assert_allclose(got, want, **TOL)
    loss = dot_with(dout, lambda x: reference.layer_norm_forward(x, tuple(shape), gamma, beta,
                                                                  eps))
    np.testing.assert_allclose(dx, central_differences(loss, x.copy()), **FD_TOL)
    np.testing.assert_allclose(dx.sum(axis=axes), 0.0, atol=1e-10)


@given(seed=seeds, n=st.integers(0, 12), rows=st.integers(1, 4), e=small,
       padding=st.one_of(st.none(), st.integers(-4, 3)))
def test_embedding_gradient_is_a_scatter_add(seed, n, rows, e, padding):
    """Section 10: dW[r] = Σ_{n : idx_n = r} dout[n] in ascending n, the padding row zero."""
    rng = np.random.default_rng(seed)
    padding = None if padding is None or not -rows <= padding < rows else padding
    indices = rng.integers(0, rows, size=n)
    weight, dout = rng.standard_normal((rows, e)), rng.standard_normal((n, e))
    doc = np.zeros((rows, e))
    for i in range(n):                                         # the serial loop, in order
        doc[indices[i]] += dout[i]
    if padding is not None:
        doc[padding] = 0.0
    got = reference.embedding_backward(dout, indices, weight, padding)
    np.testing.assert_allclose(got, doc, **TOL)


def split_heads(x, heads):
    """(L, N, E) -> (N, H, L, D): section 11's step 2."""
    length, n, width = x.shape
    return x.reshape(length, n, heads, width // heads).transpose(1, 2, 0, 3)


def merge_heads(x):
    """(N, H, L, D) -> (L, N, E): section 11's step 4."""
    n, heads, length, width = x.shape
    return x.transpose(2, 0, 1, 3).reshape(length, n, heads * width)


def mha_forward(x, in_w, in_b, out_w, out_b, heads):
    """torch.nn.MultiheadAttention's self-attention, steps 1-5 of section 11, from the textbook."""
    e = x.shape[-1]
    q, k, v = (split_heads(reference.linear_forward(x, in_w[i * e:(i + 1) * e],
                                                    in_b[i * e:(i + 1) * e]), heads)
               for i in range(3))
    a, _ = reference.scaled_dot_product_attention_forward(q, k, v)
    return reference.linear_forward(merge_heads(a), out_w, out_b)


@given(seed=seeds, length=st.integers(1, 3), n=st.integers(1, 2), heads=st.integers(1, 2),
       d=st.integers(1, 2))
def test_multihead_self_attention_chain(seed, length, n, heads, d):
    """Section 11: the chain back through out-projection, heads, SDPA and in-projection, with
    dx = dquery + dkey + dvalue = [dq dk dv]·in_proj_weight -- against central differences."""
    rng = np.random.default_rng(seed)
    e = heads * d
    x = rng.standard_normal((length, n, e))
    in_w, in_b = rng.standard_normal((3 * e, e)), rng.standard_normal(3 * e)
    out_w, out_b = rng.standard_normal((e, e)), rng.standard_normal(e)
    dout = rng.standard_normal((length, n, e))
    q, k, v = (split_heads(reference.linear_forward(x, in_w[i * e:(i + 1) * e],     # 1, 2
                                                    in_b[i * e:(i + 1) * e]), heads)
               for i in range(3))
    a, _ = reference.scaled_dot_product_attention_forward(q, k, v)
    da, dout_w, _ = reference.linear_backward(dout, merge_heads(a), out_w, out_b)       # 5
    dq, dk, dv, _ = reference.scaled_dot_product_attention_backward(
        split_heads(da, heads), q, k, v)                                                # 4, 3
    dqkv = np.concatenate([merge_heads(g) for g in (dq, dk, dv)], axis=-1)             # 2
    dx = dqkv @ in_w                                           # 1: [dq dk dv]·in_proj_weight
    din_w = dqkv.reshape(-1, 3 * e).T @ x.reshape(-1, e)
    loss = dot_with(dout, lambda x: mha_forward(x, in_w, in_b, out_w, out_b, heads))
    np.testing.assert_allclose(dx, central_differences(loss, x.copy()), **FD_TOL)
    loss = dot_with(dout, lambda w: mha_forward(x, w, in_b, out_w, out_b, heads))
    np.testing.assert_allclose(din_w, central_differences(loss, in_w.copy()), **FD_TOL)
    loss = dot_with(dout, lambda w: mha_forward(x, in_w, in_b, w, out_b, heads))
    np.testing.assert_allclose(dout_w, central_differences(loss, out_w.copy()), **FD_TOL)


# ------------------------------------------------------------------------- section 13

@given(seed=seeds, n=st.integers(1, 12), approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_backward_formulas(seed, n, approximate):
    """Section 13: dx = dout ∘ (Φ + x·Φ'), Φ' = φ or ½(1 − tanh²u)·u' -- the document's
    formulas against the textbook and against central differences; and the rewritten forms
    (½·erfc(−x/√2), 1/(1 + exp(−2u)), 2Φ(1 − Φ)) equal the documented ones."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 3.0
    dout = rng.standard_normal(n)
    erf = np.vectorize(math.erf)
    if approximate == "none":
        cdf = 0.5 * (1 + erf(x / math.sqrt(2)))
        dcdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        np.testing.assert_allclose(cdf, 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2)),
                                   **TOL)
    else:
        u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        cdf = 0.5 * (1 + np.tanh(u))
        dcdf = 0.5 * (1 - np.tanh(u) ** 2) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)
        np.testing.assert_allclose(cdf, 1 / (1 + np.exp(-2 * u)), **TOL)
        np.testing.assert_allclose(0.5 * (1 - np.tanh(u) ** 2), 2 * cdf * (1 - cdf), **TOL)
    np.testing.assert_allclose(reference.gelu_forward(x, approximate), x * cdf, **TOL)
    dx = dout * (cdf + x * dcdf)
    np.testing.assert_allclose(reference.gelu_backward(dout, x, approximate), dx, **TOL)
    loss = dot_with(dout, lambda x: reference.gelu_forward(x, approximate))
    np.testing.assert_allclose(dx, central_differences(loss, x.copy()), **FD_TOL)


_erf = np.vectorize(math.erf)


def gelu(h):
    return 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))


def gelu_slope(h):
    """gelu'(h) = Φ(h) + h·φ(h) (section 14)."""
    cdf = 0.5 * (1.0 + _erf(h / math.sqrt(2.0)))
    return cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)


def gpt_split(x, heads):
    """(B, T, C) -> (B, nh, T, hs)."""
    b, t, c = x.shape
    return x.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3)


def gpt_merge(x):
    """(B, nh, T, hs) -> (B, T, C)."""
    b, heads, t, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, heads * hs)


def gpt_forward(p, idx, targets, heads):
    """Section 14's forward, one block, no dropout, from the textbook: (loss, what backward
    needs)."""
    r = reference
    t, c, v = idx.shape[1], p["wte"].shape[1], p["wte"].shape[0]
    ln = lambda x, name: r.layer_norm_forward(x, (c,), p[name + "w"], p[name + "b"])  # noqa: E731
    x0 = r.embedding_forward(idx, p["wte"]) + p["wpe"][:t]                 # pos broadcast
    a = ln(x0, "ln1")
    qkv = r.linear_forward(a, p["attn_w"], p["attn_b"])                    # (B, T, 3C)
    q, k, vv = (gpt_split(qkv[..., i * c:(i + 1) * c], heads) for i in range(3))
    y, _ = r.scaled_dot_product_attention_forward(q, k, vv, is_causal=True)
    x1 = x0 + r.linear_forward(gpt_merge(y), p["proj_w"], p["proj_b"])      # residual 1
    m = ln(x1, "ln2")
    h = r.linear_forward(m, p["fc_w"], p["fc_b"])
    x2 = x1 + r.linear_forward(gelu(h), p["mp_w"], p["mp_b"])               # residual 2
    z = ln(x2, "lnf")
    logits = r.linear_forward(z, p["wte"])                                 # tied lm_head
    loss = r.cross_entropy_forward(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-1)
    return float(loss), dict(x0=x0, a=a, q=q, k=k, v=vv, y=y, x1=x1, m=m, h=h, x2=x2, z=z,
                             logits=logits)


def gpt_backward(p, idx, targets, heads, s):
    """Section 14's steps 1-6, as the document writes them: d wte, d wpe, d W_attn."""
    r = reference
    c, v = p["wte"].shape[1], p["wte"].shape[0]
    ln_dx = lambda d, x, name: r.layer_norm_backward(d, x, (c,), p[name + "w"],   # noqa: E731
                                                     p[name + "b"])[0]
    dlogits = r.cross_entropy_backward(1.0, s["logits"].reshape(-1, v), targets.reshape(-1),
                                       ignore_index=-1).reshape(s["logits"].shape)      # 1
    dz, dwte_head, _ = r.linear_backward(dlogits, s["z"], p["wte"])                    # 2
    dx2 = ln_dx(dz, s["x2"], "lnf")                                                    # 3
    dg, _, _ = r.linear_backward(dx2, gelu(s["h"]), p["mp_w"], p["mp_b"])              # 4: mlp
    dm, _, _ = r.linear_backward(dg * gelu_slope(s["h"]), s["m"], p["fc_w"], p["fc_b"])
    dx1 = dx2 + ln_dx(dm, s["x1"], "ln2")                                  # residual: dx +
    dmerged, _, _ = r.linear_backward(dx1, gpt_merge(s["y"]), p["proj_w"], p["proj_b"])
    dq, dk, dv, _ = r.scaled_dot_product_attention_backward(
        gpt_split(dmerged, heads), s["q"], s["k"], s["v"], is_causal=True)
    dqkv = np.concatenate([gpt_merge(g) for g in (dq, dk, dv)], axis=-1)   # [dq dk dv]
    da, dattn_w, _ = r.linear_backward(dqkv, s["a"], p["attn_w"], p["attn_b"])
    dx0 = dx1 + ln_dx(da, s["x0"], "ln1")                                  # residual: dx +
    dwte = dwte_head + r.embedding_backward(dx0, idx, p["wte"])            # 6: both uses
    dwpe = np.zeros_like(p["wpe"])
    dwpe[:idx.shape[1]] = dx0.sum(axis=0)                                  # sum over batch
    return dict(wte=dwte, wpe=dwpe, attn_w=dattn_w)


@settings(max_examples=5)
@given(seed=seeds, b=st.integers(1, 2), t=st.integers(1, 3), heads=st.integers(1, 2))
def test_gpt_backward_chain(seed, b, t, heads):
    """Section 14: the chain through the tied lm_head, the residual streams, the split heads
    and the position embedding (summed over the batch) against central differences."""
    rng = np.random.default_rng(seed)
    c, v, block = 2 * heads, 5, 4
    shapes = dict(wte=(v, c), wpe=(block, c), attn_w=(3 * c, c), attn_b=(3 * c,),
                  proj_w=(c, c), proj_b=(c,), fc_w=(4 * c, c), fc_b=(4 * c,), mp_w=(c, 4 * c),
                  mp_b=(c,), **{f"{n}{k}": (c,) for n in ("ln1", "ln2", "lnf") for k in "wb"})
    p = {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}
    for n in ("ln1", "ln2", "lnf"):
        p[n + "w"] += 1.0
    idx, targets = rng.integers(0, v, (b, t)), rng.integers(-1, v, (b, t))
    targets[0, 0] = max(targets[0, 0], 0)                  # one counted target
    loss, saved = gpt_forward(p, idx, targets, heads)
    doc = gpt_backward(p, idx, targets, heads, saved)
    for name, grad in doc.items():
        def loss_of(w, name=name):
            return gpt_forward(dict(p, **{name: w}), idx, targets, heads)[0]
        # Richardson's extrapolation of two central differences (error O(h^4), not O(h^2)):
        # with C = 2 a LayerNorm normalises two numbers, and near a tie its third derivative
        # is large enough that one central difference misses by 5e-6 of a gradient of ~100.
        # Its rounding (~1e-14 of the loss over h) is the same for every entry: the absolute
        # tolerance follows the array's largest entry, not each entry's own size.
        coarse = central_differences(loss_of, p[name].copy())
        fine = central_differences(loss_of, p[name].copy(), h=5e-7)
        want = (4 * fine - coarse) / 3
        np.testing.assert_allclose(grad, want, rtol=FD_TOL["rtol"],
                                   atol=1e-7 * max(1.0, np.abs(want).max()), err_msg=name)


# ------------------------------------------------------------------------- section 15

def rotation_matrix(theta):
    """R(θ) = [[cos θ, −sin θ], [sin θ, cos θ]] for every angle: (..., 2, 2) (section 15)."""
    c, s = np.cos(theta), np.sin(theta)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)


@given(seed=seeds, lead=st.lists(small, max_size=2), length=small, h=small,
       interleaved=st.booleans())
def test_rotary_backward_is_the_rotation_by_minus_theta(seed, lead, length, h, interleaved):
    """Section 15: the forward is R(θ) on each pair; the backward, R(θ)ᵀ = R(−θ) on dout's
    pair, equals the textbook and central differences; and R(θ_i)q·R(θ_j)k = qᵀ·R(θ_j − θ_i)·k."""
    rng = np.random.default_rng(seed)
    theta = rng.uniform(-10, 10, (length, h))
    cos, sin = np.cos(theta), np.sin(theta)
    x, dout = rng.standard_normal((2, *lead, length, 2 * h))
    pair = [slice(0, None, 2), slice(1, None, 2)] if interleaved else [slice(0, h), slice(h, None)]

    def pairs(v):                                              # (..., L, h, 2): (a, b)
        return np.stack([v[..., pair[0]], v[..., pair[1]]], -1)

    def unpairs(p):
        out = np.empty(p.shape[:-2] + (2 * h,))
        out[..., pair[0]], out[..., pair[1]] = p[..., 0], p[..., 1]
        return out

    rot = rotation_matrix(theta)                               # (L, h, 2, 2)
    out = unpairs(np.einsum("lkij,...lkj->...lki", rot, pairs(x)))
    np.testing.assert_allclose(reference.rotary_embedding_forward(x, cos, sin, interleaved),
                               out, **TOL)
    dx = unpairs(np.einsum("lkji,...lkj->...lki", rot, pairs(dout)))       # R(θ)ᵀ·g
    np.testing.assert_allclose(dx, unpairs(np.einsum("lkij,...lkj->...lki",
                                                     rotation_matrix(-theta), pairs(dout))),
                               **TOL)                                      # = R(−θ)·g
    np.testing.assert_allclose(reference.rotary_embedding_backward(dout, cos, sin, interleaved),
                               dx, **TOL)
    loss = dot_with(dout, lambda v: reference.rotary_embedding_forward(v, cos, sin, interleaved))
    np.testing.assert_allclose(dx, central_differences(loss, x.copy()), **FD_TOL)
    q, k = rng.standard_normal((2, 2))                         # one pair, two positions
    i, j = rng.uniform(-10, 10, 2)
    np.testing.assert_allclose((rotation_matrix(i) @ q) @ (rotation_matrix(j) @ k),
                               q @ rotation_matrix(j - i) @ k, **TOL)



# ------------------------------------------------------------------------- the other documents
#
# docs/architecture.md and CONTRIBUTING.md point into the code and mirror lists of it (the
# layers, the tools, the kernel-marked test files, the module -> test map). Each pointer must
# name a definition that exists and each list must be the code's, so the prose cannot drift.

ARCHITECTURE = ROOT / "docs" / "architecture.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
ANY_POINTER = re.compile(r"`((?:npattn|tests|benchmarks)/[\w/]+\.py)::([\w.]+)")
PATH = re.compile(r"`((?:npattn|tests|benchmarks|docs)/[\w/]*(?:\.py|\.md|/))`")


def top_level_names(path):
    """What a ``path::name`` pointer may name: a top-level function, class or assigned name
    (constants, aliases), or ``Class.member`` (a method, nested class or class attribute)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(f"{node.name}.{t.id}" for t in targets
                                 if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def missing_pointers(text):
    missing = []
    for file, name in sorted(set(ANY_POINTER.findall(text))):
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
        elif name not in top_level_names(path):
            missing.append(f"{file}::{name}")
    return missing


def section(text, heading):
    """The text from the line ``heading`` to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level} ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def strip_parentheses(text):
    out, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0:
            out.append(char)
        depth -= char == ")" and depth > 0
    return "".join(out)


def library_modules():
    """Every module of the library: each ``.py`` under npattn/ but ``__main__.py`` and the
    subpackages' ``__init__.py`` (npattn/__init__.py, the public names, counts)."""
    package = ROOT / "npattn"
    return sorted(p.relative_to(ROOT).as_posix() for p in package.rglob("*.py")
                  if p.name != "__main__.py" and (p.name != "__init__.py" or p.parent == package))


def tool_modules():
    return sorted(p.stem for p in (ROOT / "npattn" / "tools").glob("*.py")
                  if p.name != "__init__.py")


@pytest.mark.parametrize("doc", [ARCHITECTURE, CONTRIBUTING], ids=lambda p: p.name)
def test_every_pointer_of_the_doc_names_a_definition(doc):
    text = doc.read_text(encoding="utf-8")
    assert len(ANY_POINTER.findall(text)) >= 20
    missing = missing_pointers(text)
    assert not missing, f"{doc.name} points at definitions that do not exist: {missing}"


@pytest.mark.parametrize("doc", [ARCHITECTURE, CONTRIBUTING], ids=lambda p: p.name)
def test_every_path_of_the_doc_exists(doc):
    paths = set(PATH.findall(doc.read_text(encoding="utf-8")))
    written = ("benchmarks/results/",)          # made by a run, not in the repository
    missing = sorted(p for p in paths if not (ROOT / p).exists() and p not in written)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_the_import_rules_table_is_the_layering_tests():
    """architecture §2's table holds tests/test_layering.py::ALLOWED row by row."""
    from test_layering import ALLOWED
    text = section(ARCHITECTURE.read_text(encoding="utf-8"), "## 2. Which imports are allowed")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`npattn"):
            continue
        module = re.findall(r"`([\w.*]+)`", cells[0])[0].removesuffix(".*")
        rows[module] = {name.removesuffix(".*") for name in
                        re.findall(r"`([\w.*]+)`", strip_parentheses(cells[1]))}
    assert rows == ALLOWED, ("docs/architecture.md §2's table and tests/test_layering.py::"
                             f"ALLOWED differ: table {rows}, ALLOWED {ALLOWED}")


def test_the_layer_diagram_names_every_layer_and_tool():
    """§1's diagram shows every rule of ALLOWED (its top-level module or package) and every
    tool; §1's table and §2's people row list every tool module."""
    from test_layering import ALLOWED
    text = ARCHITECTURE.read_text(encoding="utf-8")
    layers = section(text, "## 1. The layers")
    diagram = layers.split("```")[1]
    for rule in ALLOWED:
        name = rule.split(".")[1]
        package = (ROOT / "npattn" / name).is_dir()
        tail = "/" if package else r"(\.py)?(?![\w/])"
        assert re.search(r"(?<![\w/])" + re.escape(name) + tail, diagram), \
            f"the layer diagram of §1 lacks {name}{'/' if package else ''}"
    people = next(line for line in diagram.splitlines() if line.lstrip().startswith("people"))
    people += diagram.splitlines()[diagram.splitlines().index(people) + 1]   # its second line
    table_row = next(line for line in layers.splitlines() if line.startswith("| `npattn/tools/`"))
    rules = section(text, "## 2. Which imports are allowed")
    people_rule = next(line for line in rules.splitlines() if "the people layer" in line)
    for tool in tool_modules():
        assert re.search(rf"\b{tool}\b", people), f"the layer diagram's tools lack {tool}"
        assert f"`{tool}.py`" in table_row, f"§1's table row of npattn/tools/ lacks {tool}.py"
        assert f"`{tool}`" in people_rule, f"§2's people layer row lacks {tool}"


def test_the_commands_table_names_every_command():
    from npattn.tools.cli import COMMANDS
    text = section(ARCHITECTURE.read_text(encoding="utf-8"), "## 11. The commands")
    for name, (module, _) in COMMANDS.items():
        assert f"`npattn {name}" in text, f"§11's table lacks npattn {name}"
        assert f"`{module.replace('.', '/')}.py`" in text, f"§11's table lacks {module}"


def test_kernel_marked_files_are_listed():
    """CONTRIBUTING's list of the test files marked ``kernel`` is the files that are."""
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"^pytestmark = .*pytest\.mark\.kernel",
                                 p.read_text(encoding="utf-8"), flags=re.M))
    text = CONTRIBUTING.read_text(encoding="utf-8")
    listed = text[text.index("carry `pytestmark = pytest.mark.kernel`"):]
    listed = sorted(re.findall(r"`(test_\w+\.py)`", listed[:listed.index(")")]))
    assert len(marked) >= 9
    assert listed == marked, f"CONTRIBUTING lists {listed}; the files marked kernel are {marked}"


def test_contributing_counts_the_backward_sections():
    headings = re.findall(r"^## (\d+)\. ", doc_text(), flags=re.M)
    count = re.search(r"The sections are\s+numbered 1–(\d+)",
                      CONTRIBUTING.read_text(encoding="utf-8"))
    assert count and int(count.group(1)) == len(headings), \
        f"CONTRIBUTING says backward.md has sections 1–{count and count.group(1)}; " \
        f"it has {len(headings)}"


def test_every_module_maps_to_its_tests():
    """CONTRIBUTING's module -> test-file map: every library module has a row, every row a
    module, and each test file named exists and names the module or something it defines."""
    text = section(CONTRIBUTING.read_text(encoding="utf-8"), "## Which tests test which module")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`npattn/"):
            rows[cells[0].strip("`")] = re.findall(r"`(tests/test_\w+\.py)`",
                                                   strip_parentheses(cells[1]))
    modules = library_modules()
    assert sorted(rows) == modules, (
        f"modules without a row: {sorted(set(modules) - set(rows))}; "
        f"rows without a module: {sorted(set(rows) - set(modules))}")
    for module, test_files in rows.items():
        assert test_files, f"{module} maps to no test file"
        path = ROOT / module
        words = {"npattn"} if path.name == "__init__.py" else {path.stem, path.stem.lstrip("_")}
        words |= {n for n in top_level_names(path) if not n.startswith("_") and "." not in n
                  and len(n) > 3}
        for test_file in test_files:
            assert (ROOT / test_file).is_file(), f"{module} maps to {test_file}: no such file"
            source = (ROOT / test_file).read_text(encoding="utf-8")
            assert any(re.search(rf"\b{re.escape(w)}\b", source) for w in words), \
                f"{test_file} names nothing of {module}"
