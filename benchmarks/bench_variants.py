"""attention-variants: the fused engine's score modifiers against the dense masks they replace.

q, k, v are (B, H, L, D) = (4, 8, L, 64), float32, self-attention (S = L). The variants:

- **sliding window** ``window=(W - 1, 0)``: query i sees keys i - W + 1 .. i, W keys (Mistral's
  window of W tokens). npattn skips every block of keys outside all rows' windows, so its time
  grows with L·W, not L²/2. Baseline: npattn's full causal attention, the cost a window avoids.
- **ALiBi**, causal, ``alibi_slopes`` = 2^-(h + 1) for head h (the paper's slopes for 8 heads,
  halved): npattn adds the bias as it forms each block of scores. Baseline: npattn's causal
  attention without ALiBi, the bias's own cost.
- **soft-capping** ``softcap=30`` (Gemma 2) and **sinks** (one logit per head, gpt-oss), causal:
  npattn caps each block of scores as it forms them (and takes the cap's slope in backward),
  or adds the sink to each row's denominator. Baseline: npattn's causal attention without
  them. PyTorch's SDPA has neither: PyTorch runs the formula on the full scores (autograd
  for backward), as a user would write it.

Implementations (every one computes the same thing; their results are checked against
npattn's before timing):

- npattn: ``scaled_dot_product_attention(..., window=...)`` or ``(..., alibi_slopes=...)``;
  forward+backward is ``_forward`` then ``_backward``;
- PyTorch: ``torch.nn.functional.scaled_dot_product_attention`` given the equivalent dense
  mask -- (L, S) bool for the window, (H, L, S) float for ALiBi, the only ways PyTorch's SDPA
  expresses them -- backward by autograd;
- NumPy: the textbook of ``bench_attention.py`` with the same dense mask applied to the
  (B, H, L, S) scores (its memory is the full square; skipped past ``NUMPY_LIMIT``).

Baselines are timed in the same rounds (benchmarks/cases.py, Bench.baseline), not checked
against the others: they compute something else.

FLOPs (nominal): forward 4·B·H·L·W'·D with W' the mean number of keys a row sees; forward +
backward 3.5× that.
"""
import numpy as np

import npattn

from .bench_attention import B, D, H, _numpy_or_skip, numpy_backward
from .cases import Bench, case, impls, randn, shape, torch_forward, torch_forward_backward

WINDOWS = [(4096, 256)]
WINDOWS_QUICK = [(512, 64)]
ALIBI = [(1024,)]
ALIBI_QUICK = [(256,)]
NOTE = ("window GFLOP/s are nominal: forward 4·B·H·L·W'·D (W' the mean number of keys a row "
        "sees), forward+backward 3.5× that")


def fwd_bwd(q, k, v, dout, **fixed):
    """ours(**kw): a call of npattn's forward then backward with the keywords fixed + kw."""
    def ours(**kw):
        def run():
            out, lse = npattn.scaled_dot_product_attention_forward(q, k, v, **fixed, **kw)
            return out, npattn.scaled_dot_product_attention_backward(
                dout, q, k, v, out, lse, **fixed, **kw)
        return run
    return ours


def window_mask(length, width):
    """(L, L) bool, True where query i sees key j: i - width < j <= i."""
    return npattn.reference.window_mask(length, length, (width - 1, 0))


def numpy_forward(q, k, v, mask):
    """(output, P) as bench_attention.numpy_forward, with a dense mask: bool (-inf where
    False) or float (added)."""
    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]))
    p = (q * scale) @ np.swapaxes(k, -1, -2)                      # scores (B, H, L, S)
    if mask.dtype == bool:
        np.copyto(p, -np.inf, where=~mask)
    else:
        p += mask
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, p


def _setup(torch, length, width):
    q, k, v = (randn(B, H, length, D) for _ in range(3))
    visible = window_mask(length, width)
    flops = 4 * B * H * D * float(visible.sum())                  # Σ_i (keys row i sees)
    window = (width - 1, 0)
    tmask = torch and torch.from_numpy(visible)
    sdpa = torch and (lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=tmask))
    return q, k, v, visible, flops, window, sdpa


def _bench(kind, length, width, flops, impls_, skipped, baseline):
    return Bench(f"attention {kind} window {width} {shape((B, H, length, D))}", flops=flops,
                 impls=impls_, notes=[NOTE], skipped=skipped, baseline=baseline,
                 rss_warmup=None)


@case("attention-variants", sizes=WINDOWS, quick=WINDOWS_QUICK)
def window_forward(torch, length, width):
    q, k, v, visible, flops, window, sdpa = _setup(torch, length, width)
    numpy, skipped = _numpy_or_skip(length, False, lambda: numpy_forward(q, k, v, visible)[0])
    return _bench("fwd", length, width, flops,
                  impls(npattn=lambda: npattn.scaled_dot_product_attention(q, k, v,
                                                                           window=window),
                        numpy=numpy, torch=torch_forward(torch, sdpa, q, k, v)),
                  skipped, ("npattn full causal attention, the same shapes",
                            lambda: npattn.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True)))


@case("attention-variants", sizes=WINDOWS, quick=WINDOWS_QUICK)
def window_forward_backward(torch, length, width):
    q, k, v, visible, flops, window, sdpa = _setup(torch, length, width)
    dout = randn(B, H, length, D)

    ours = fwd_bwd(q, k, v, dout)

    def numpy():
        out, p = numpy_forward(q, k, v, visible)
        return out, numpy_backward(dout, q, k, v, out, p)

    numpy, skipped = _numpy_or_skip(length, True, numpy)
    return _bench("fwd+bwd", length, width, 3.5 * flops,
                  impls(npattn=ours(window=window), numpy=numpy,
                        torch=torch_forward_backward(torch, sdpa, dout, q, k, v)),
                  skipped, ("npattn full causal attention fwd+bwd, the same shapes",
                            ours(is_causal=True)))


def _alibi_setup(torch, length):
    q, k, v = (randn(B, H, length, D) for _ in range(3))
    slopes = (2.0 ** -np.arange(2, H + 2)).astype(np.float32)       # (H,)
    causal = npattn.reference.causal_mask(length, length)
    mask = np.where(causal, npattn.reference.alibi_bias(length, length, slopes),
                    -np.inf).astype(np.float32)                       # (H, L, S)
    flops = 4 * B * H * D * float(causal.sum())
    tmask = torch and torch.from_numpy(mask)
    sdpa = torch and (lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=tmask))
    return q, k, v, slopes, mask, flops, sdpa


def _alibi_bench(kind, length, flops, impls_, skipped, baseline):
    return Bench(f"attention {kind} causal ALiBi {shape((B, H, length, D))}", flops=flops,
                 impls=impls_, notes=[NOTE_ALIBI], skipped=skipped, baseline=baseline)


NOTE_ALIBI = ("ALiBi GFLOP/s are nominal: forward 4·B·H·L·S·D / 2 (causal), forward+backward "
              "3.5× that")


@case("attention-variants", sizes=ALIBI, quick=ALIBI_QUICK)
def alibi_forward(torch, length):
    q, k, v, slopes, mask, flops, sdpa = _alibi_setup(torch, length)
    numpy, skipped = _numpy_or_skip(length, False, lambda: numpy_forward(q, k, v, mask)[0])
    return _alibi_bench("fwd", length, flops,
                        impls(npattn=lambda: npattn.scaled_dot_product_attention(
                                  q, k, v, is_causal=True, alibi_slopes=slopes),
                              numpy=numpy, torch=torch_forward(torch, sdpa, q, k, v)),
                        skipped, ("npattn causal attention without ALiBi, the same shapes",
                                  lambda: npattn.scaled_dot_product_attention(
                                      q, k, v, is_causal=True)))


@case("attention-variants", sizes=ALIBI, quick=ALIBI_QUICK)
def alibi_forward_backward(torch, length):
    q, k, v, slopes, mask, flops, sdpa = _alibi_setup(torch, length)
    dout = randn(B, H, length, D)

    ours = fwd_bwd(q, k, v, dout, is_causal=True)

    def numpy():
        out, p = numpy_forward(q, k, v, mask)
        return out, numpy_backward(dout, q, k, v, out, p)

    numpy, skipped = _numpy_or_skip(length, True, numpy)
    return _alibi_bench("fwd+bwd", length, 3.5 * flops,
                        impls(npattn=ours(alibi_slopes=slopes), numpy=numpy,
                              torch=torch_forward_backward(torch, sdpa, dout, q, k, v)),
                        skipped, ("npattn causal attention fwd+bwd without ALiBi, the same "
                                  "shapes", ours()))


# ---------------------------------------------------------- soft-capping and sinks (formulas)

SOFTCAP = 30.0          # Gemma 2's attention cap
OPTIONS = [(1024, "softcap"), (1024, "sinks")]
OPTIONS_QUICK = [(256, "softcap"), (256, "sinks")]
NOTE_FORMULA = ("soft-capping and sinks have no PyTorch SDPA form: PyTorch runs their formula "
                "(q·kᵀ·scale, c·tanh(s/c), the causal -inf, a sink column, softmax, ·v) on "
                "the full (B, H, L, S) scores, backward by autograd; GFLOP/s nominal as ALiBi's")


def _option_setup(torch, length, option):
    """Inputs, npattn's keyword for the option (softcap or sinks), and PyTorch's formula
    f(q, k, v[, sinks]) (None without torch)."""
    q, k, v = (randn(B, H, length, D) for _ in range(3))
    causal = npattn.reference.causal_mask(length, length)
    flops = 4 * B * H * D * float(causal.sum())
    sinks = (np.random.default_rng(5).standard_normal(H) * 2).astype(np.float32)   # (H,)
    kw = dict(softcap=SOFTCAP) if option == "softcap" else dict(sinks=sinks)
    extra = () if option == "softcap" else (sinks,)
    formula = None
    if torch:
        hidden = torch.from_numpy(~causal)

        def formula(q_, k_, v_, *sinks_):
            s = (q_ @ k_.transpose(-1, -2)) * (1 / np.sqrt(D))
            if option == "softcap":
                s = SOFTCAP * torch.tanh(s / SOFTCAP)
            s = s.masked_fill(hidden, -np.inf)
            if sinks_:
                column = sinks_[0].reshape(H, 1, 1).expand(s.shape[:-1] + (1,))
                p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            return p @ v_
    return q, k, v, kw, extra, flops, formula


def _option_numpy(q, k, v, option, sinks):
    """The formula in NumPy, forward: (B, H, L, S) scores and all."""
    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]))
    s = (q * scale) @ np.swapaxes(k, -1, -2)
    if option == "softcap":
        s = np.float32(SOFTCAP) * np.tanh(s / np.float32(SOFTCAP))
    np.copyto(s, -np.inf, where=~npattn.reference.causal_mask(q.shape[-2], k.shape[-2]))
    top = s.max(axis=-1, keepdims=True)
    if option == "sinks":
        top = np.maximum(top, sinks[:, None, None])
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    if option == "sinks":
        total += np.exp(sinks[:, None, None] - top)
    return (p / total) @ v


def _option_bench(kind, length, option, flops, impls_, skipped, baseline):
    return Bench(f"attention {kind} causal {option} {shape((B, H, length, D))}", flops=flops,
                 impls=impls_, notes=[NOTE_FORMULA], skipped=skipped, baseline=baseline)


@case("attention-variants", sizes=OPTIONS, quick=OPTIONS_QUICK)
def option_forward(torch, length, option):
    q, k, v, kw, extra, flops, formula = _option_setup(torch, length, option)
    numpy, skipped = _numpy_or_skip(length, False, lambda: _option_numpy(
        q, k, v, option, kw.get("sinks")))
    return _option_bench("fwd", length, option, flops,
                         impls(npattn=lambda: npattn.scaled_dot_product_attention(
                                   q, k, v, is_causal=True, **kw),
                               numpy=numpy, torch=torch_forward(torch, formula, q, k, v, *extra)),
                         skipped, (f"npattn causal attention without {option}, the same shapes",
                                   lambda: npattn.scaled_dot_product_attention(
                                       q, k, v, is_causal=True)))


@case("attention-variants", sizes=OPTIONS, quick=OPTIONS_QUICK)
def option_forward_backward(torch, length, option):
    q, k, v, kw, extra, flops, formula = _option_setup(torch, length, option)
    dout = randn(B, H, length, D)

    ours = fwd_bwd(q, k, v, dout, is_causal=True)

    return _option_bench("fwd+bwd", length, option, 3.5 * flops,
                         impls(npattn=ours(**kw), numpy=None,
                               torch=torch_forward_backward(torch, formula, dout, q, k, v,
                                                            *extra)),
                         {"NumPy": "no NumPy backward of the formula here (the forward case "
                                   "times NumPy's)"},
                         (f"npattn causal attention fwd+bwd without {option}, the same shapes",
                          ours()))


# ---------------------------------------------------------------- packed variable-length batches

VARLEN = [(16, 64, 1024)]       # sequences, shortest, longest
VARLEN_QUICK = [(4, 16, 128)]
NOTE_VARLEN = ("varlen: sequences of lengths drawn once (seed 0) in [shortest, longest], "
               "self-attention, H = 8, D = 64; PyTorch runs the padded batch (B = sequences, "
               "L = the longest) with a bool padding mask, and only the valid rows are kept; "
               "GFLOP/s nominal: forward 4·H·D·Σ L_s², forward+backward 3.5× that")


def _varlen_setup(torch, n_seq, shortest, longest):
    lengths = np.random.default_rng(0).integers(shortest, longest + 1, n_seq)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total, top = int(cu[-1]), int(lengths.max())
    q, k, v, dout = (randn(total, H, D) for _ in range(4))             # packed (total, H, D)

    def padded(x):                                                    # (n_seq, H, Lmax, D)
        out = np.zeros((n_seq, H, top, D), np.float32)
        for s in range(n_seq):
            out[s, :, :lengths[s]] = x[cu[s]:cu[s + 1]].transpose(1, 0, 2)
        return out

    flops = 4 * H * D * float(np.sum(lengths.astype(np.float64) ** 2))
    torch_fns = None
    if torch:
        valid = torch.from_numpy(np.arange(top)[None, :] < lengths[:, None])   # (n_seq, Lmax)
        mask = valid[:, None, None, :]                                # keys: (n_seq, 1, 1, S)

        def packed(t):                                                # -> (total, H, D)
            return torch.cat([t[s, :, :lengths[s]].transpose(0, 1) for s in range(n_seq)])

        def forward(q_, k_, v_):
            return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)

        torch_fns = (forward, packed, [padded(x) for x in (q, k, v, dout)])
    return q, k, v, dout, cu, flops, torch_fns


def _varlen_bench(kind, n_seq, shortest, longest, flops, impls_):
    return Bench(f"attention {kind} varlen {n_seq} sequences of {shortest}..{longest} "
                 f"{shape((H, D))}", flops=flops, impls=impls_, notes=[NOTE_VARLEN])


@case("attention-variants", sizes=VARLEN, quick=VARLEN_QUICK)
def varlen_forward(torch, n_seq, shortest, longest):
    q, k, v, _, cu, flops, torch_fns = _varlen_setup(torch, n_seq, shortest, longest)
    ours = lambda: npattn.scaled_dot_product_attention_varlen(q, k, v, cu, cu)   # noqa: E731
    theirs = None
    if torch_fns:
        forward, packed, (tq, tk, tv, _) = torch_fns
        call = torch_forward(torch, forward, tq, tk, tv)
        theirs = lambda: packed(call())                               # noqa: E731
    return _varlen_bench("fwd", n_seq, shortest, longest, flops,
                         impls(npattn=ours, numpy=None, torch=theirs))


@case("attention-variants", sizes=VARLEN, quick=VARLEN_QUICK)
def varlen_forward_backward(torch, n_seq, shortest, longest):
    q, k, v, dout, cu, flops, torch_fns = _varlen_setup(torch, n_seq, shortest, longest)

    def ours():
        out, lse = npattn.scaled_dot_product_attention_varlen_forward(q, k, v, cu, cu)
        return out, npattn.scaled_dot_product_attention_varlen_backward(dout, q, k, v, out, lse,
                                                                        cu, cu)
    theirs = None
    if torch_fns:
        forward, packed, (tq, tk, tv, tdout) = torch_fns
        call = torch_forward_backward(torch, forward, tdout, tq, tk, tv)

        def theirs():
            out, grads = call()
            return packed(out), tuple(packed(g) for g in grads)
    return _varlen_bench("fwd+bwd", n_seq, shortest, longest, 3.5 * flops,
                         impls(npattn=ours, numpy=None, torch=theirs))
