"""scaled_dot_product_attention and the article's attention(), forward and backward, against the
float64 textbook (npattn.reference) and against PyTorch's SDPA.

One strategy draws every code path at once: broadcast batch dims, grouped-query heads, L != S
(0, 1, ragged, several key blocks of 128), E != Ev (1, 3, 17, 80, ...), both dtypes, every mask
kind and broadcast shape, causal in both alignments, custom scales (negative too), seeded
dropout and any memory layout. Tolerances follow closeness.py: each result's reduction length n
and the magnitude of its terms; the error of a score (E products of |q||k|) moves every weight
of its row, so the magnitudes are multiplied by ``amp`` = 1 + 2·E·max_j |score terms|/(S + E),
and every example must check something: the output's bound stays below half its size.
"""
import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from closeness import abs64, assert_close, f64, tolerance
from npattn import (attention, attention_backward, attention_forward, dropout_mask, reference,
                    scaled_dot_product_attention, scaled_dot_product_attention_backward,
                    scaled_dot_product_attention_forward)
from npattn.functional.attention import AttentionOptions
from npattn.kernels import tiles
from strategies import DTYPES, dtypes, layouts, lay_out, make_values

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

ALIGNMENTS = ("top-left", "bottom-right")
MASK_KINDS = ("none", "bool", "float")
WIDTHS = st.one_of(st.sampled_from([1, 3, 16, 17, 64, 80, 130]), st.integers(1, 20))  # E, Ev


def block_edges():
    """Lengths just below, at and above the engine's block sizes for the tiles in force: the
    tile (MR, NR), backward's query and key blocks (BQ, BK) and forward's key block."""
    sizes = set()
    for dtype in DTYPES:
        e = tiles.engine("attention", dtype)
        sizes |= {e.MR, e.NR, 4 * e.NR, e.BQ, e.BK, e.FORWARD_BK}
    return tuple(sorted({n + d for n in sizes for d in (-1, 0, 1)}))


BLOCK_EDGES = block_edges()
BK = tiles.engine("attention", np.float32).BK


# ------------------------------------------------------------------ one drawn call

#: The options of a drawn call: npattn's AttentionOptions record, field for field (keyword
#: fields of a dataclass, so that a Case can set them one by one as it draws them).
OptionFields = dataclasses.make_dataclass(
    "OptionFields", [(name, object, dataclasses.field(default=default, kw_only=True))
                     for name, default in AttentionOptions._field_defaults.items()])


@dataclass
class Case(OptionFields):
    """The arguments of one call (arrays in their drawn dtype and layout; the options are
    AttentionOptions' fields, as keywords) and what follows."""
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    dout: np.ndarray

    def options(self):
        """The options as npattn's record."""
        return AttentionOptions(**{name: getattr(self, name) for name in AttentionOptions._fields})

    def __repr__(self):                     # shapes and options, not pages of numbers
        def describe(a):
            if a is None:
                return "None"
            return (f"{a.dtype}{a.shape} strides={a.strides}"
                    f"{'' if a.flags.writeable else ' readonly'}")
        fields = [f"{n}={describe(getattr(self, n))}" for n in ("query", "key", "value")]
        fields += [f"{n}={describe(x) if isinstance(x, np.ndarray) else repr(x)}"
                   for n, x in self.options()._asdict().items()]
        return f"{type(self).__name__}({', '.join(fields)})"

    def _repr_pretty_(self, printer, cycle):   # Hypothesis prints this
        printer.text(repr(self))

    @property
    def dtype(self):
        return self.query.dtype

    @property
    def heads(self):
        return self.query.ndim > 2

    @property
    def batch(self):
        """The broadcast batch dims (before the head dim); () for 3-D and 2-D inputs."""
        if not self.heads:
            return ()
        return np.broadcast_shapes(*(a.shape[:-3] for a in (self.query, self.key, self.value)))

    @property
    def weights_shape(self):
        """(batch..., H, L, S), or (L, S) for 2-D inputs."""
        L, S = self.query.shape[-2], self.key.shape[-2]
        return self.batch + (self.query.shape[-3], L, S) if self.heads else (L, S)

    @property
    def group(self):
        if not (self.enable_gqa and self.heads):
            return 1
        return self.query.shape[-3] // self.key.shape[-3]

    @property
    def scale_value(self):
        return 1 / math.sqrt(self.query.shape[-1]) if self.scale is None else self.scale

    def kwargs(self):
        return self.options()._asdict()

    def attention_kwargs(self):
        """attention()'s keywords (the mask and dropout_p go positionally; no enable_gqa)."""
        kw = self.kwargs()
        for name in ("attn_mask", "dropout_p", "enable_gqa"):
            del kw[name]
        return kw

    def grad_names(self, mask_grad):
        """The names of the backward's results, in its order."""
        return (("dquery", "dkey", "dvalue") + (("dsinks",) if self.sinks is not None else ())
                + (("dmask",) if mask_grad else ()))

    def keep(self):
        """The contract's keep-mask: dropout_mask((B, H, L, S), p, seed) in the weights' shape."""
        if self.dropout_p == 0:
            return None
        shape = self.weights_shape
        flat = (math.prod(shape[:-3]),) + shape[-3:] if self.heads else (1, 1) + shape
        return dropout_mask(flat, self.dropout_p, self.seed).reshape(shape)

    def mask64(self):
        m = self.attn_mask
        if m is None:
            return None
        return np.array(m, dtype=bool if m.dtype == bool else np.float64)

    def reference_kwargs(self):
        """The reference's keywords: the options in float64, seed replaced by the keep-mask."""
        kw = self.kwargs()
        del kw["seed"]
        return dict(kw, attn_mask=self.mask64(), keep=self.keep(), alibi_slopes=self.slopes64(),
                    sinks=self.sinks64())

    def slopes64(self):
        return None if self.alibi_slopes is None else f64(self.alibi_slopes)[0]

    def sinks64(self):
        return None if self.sinks is None else f64(self.sinks)[0]

    def bias(self):
        """ALiBi's float64 bias, broadcastable to weights_shape, or None."""
        if self.alibi_slopes is None:
            return None
        L, S = self.query.shape[-2], self.key.shape[-2]
        bias = reference.alibi_bias(L, S, self.slopes64(), self.causal_alignment)
        return bias if self.heads else bias.reshape(L, S)

    def visible(self):
        """(L, S) bool: the keys is_causal and window leave each query, or None for all."""
        L, S = self.query.shape[-2], self.key.shape[-2]
        if not self.is_causal and self.window is None:
            return None
        visible = np.ones((L, S), bool)
        if self.is_causal:
            visible &= reference.causal_mask(L, S, self.causal_alignment)
        if self.window is not None:
            visible &= reference.window_mask(L, S, self.window, self.causal_alignment)
        return visible

    def mask_with_visible(self):
        """mask64() with the keys visible() hides masked too and ALiBi's bias added: one
        explicit mask (float when there is a bias)."""
        mask, visible, bias = self.mask64(), self.visible(), self.bias()
        if visible is not None:
            mask = visible if mask is None else (
                mask & visible if mask.dtype == bool else mask + np.where(visible, 0.0, -np.inf))
        if bias is not None:
            mask = bias if mask is None else (
                np.where(mask, bias, -np.inf) if mask.dtype == bool else mask + bias)
        return mask

    def reference_forward(self):
        q, k, v = f64(self.query, self.key, self.value)
        with np.errstate(invalid="ignore"):
            return reference.scaled_dot_product_attention_forward(q, k, v,
                                                                  **self.reference_kwargs())

    def reference_backward(self):
        """The reference's gradients by name: dquery, dkey, dvalue, dmask (None unless the
        mask is float) and dsinks (with sinks)."""
        dout, q, k, v = f64(self.dout, self.query, self.key, self.value)
        with np.errstate(invalid="ignore"):
            grads = reference.scaled_dot_product_attention_backward(dout, q, k, v,
                                                                    **self.reference_kwargs())
        return dict(zip(("dquery", "dkey", "dvalue", "dmask", "dsinks"), grads))

    def reference_weights(self, nan_to_zero=False):
        """float64 weights before and after dropout, with kv heads repeated for GQA."""
        q, k, v = f64(self.query, self.key, self.value)
        if nan_to_zero:
            q, k, v = (np.nan_to_num(a, nan=0.0) for a in (q, k, v))
        if self.group > 1:
            k, v = (np.repeat(a, self.group, axis=-3) for a in (k, v))
        mask = self.mask_with_visible()
        options = dict(softcap=self.softcap, sinks=self.sinks64())
        _, probs = reference.attention_forward(q, k, v, mask, scale=self.scale_value, **options)
        _, weights = reference.attention_forward(q, k, v, mask, self.keep(), self.dropout_p,
                                                 self.scale_value, **options)
        shape = self.weights_shape                       # value's batch dims too
        return np.broadcast_to(probs, shape), np.broadcast_to(weights, shape)


def sum_to(x, shape):
    """Sum x over the dims that broadcasting to x's shape added or stretched from ``shape``."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


def bounds(case, amplify=True):
    """(n, scale) of every result, for assert_close's 4·eps·n·(|want| + scale).

    n counts the terms summed (over S for output rows, over L and the broadcast copies for
    dkey, ...) plus E and Ev for the products inside; scale is the sum of the terms' magnitudes,
    computed with |q|, |k|, |v|, |dout| and the float64 weights. ``amplify=False`` drops the
    ``amp`` factor: right when each weight is exact (0 or 1), as with huge logits.
    """
    q, k, v, dout = (np.nan_to_num(a, nan=0.0) for a in
                     abs64(case.query, case.key, case.value, case.dout))
    group = case.group
    if group > 1:
        k, v = (np.repeat(a, group, axis=-3) for a in (k, v))
    s = abs(case.scale_value)
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    terms = s * (q @ np.swapaxes(k, -1, -2))             # |scale|·|q_i|·|k_j| (batch..., H, L, S)
    mask = case.mask64()
    if mask is not None and mask.dtype != bool:
        terms = terms + np.where(np.isinf(mask), 0.0, np.abs(mask))
    if case.bias() is not None:
        terms = terms + np.abs(case.bias())
    terms = np.broadcast_to(terms, case.weights_shape)
    top = terms.max(axis=-1, keepdims=True, initial=0.0)  # (..., L, 1)
    if case.sinks is not None:      # a sink shifts every score by (up to) itself: its rounding
        sink = np.abs(np.nan_to_num(case.sinks64(), neginf=0.0))
        top = np.maximum(top, sink.reshape(-1, 1, 1) if case.heads else sink.reshape(1, 1))
    # a score's error (E products: E·eps·top) moves its row's weights by that relative
    # amount, next to the S + E of the sums themselves: (S + E)·amp = S + E + 2·E·top
    amp = 1 + 2 * top * E / max(S + E, 1) if amplify else np.ones_like(top)
    probs, weights = case.reference_weights(nan_to_zero=True)
    keep = case.keep()
    # A weight below the dtype's smallest normal number may come out as 0 (an absolute error
    # up to `tiny`, which n·eps·|want| cannot cover): count every weight as at least tiny/eps.
    floor = np.finfo(case.dtype).tiny / np.finfo(case.dtype).eps
    probs = probs + floor
    weights = weights + (floor if keep is None else
                         reference.dropout_forward(np.full(weights.shape, floor), keep,
                                                   case.dropout_p))

    def kv_heads(x):                                     # (batch..., H, ·, ·) -> Hkv heads
        if group == 1:
            return x
        return x.reshape(*x.shape[:-3], x.shape[-3] // group, group, *x.shape[-2:]).sum(-3)

    def copies(shape):                         # query heads (batch..., H) per input (..., H or Hkv)
        full = math.prod(case.weights_shape[:-2])
        return max(full // max(math.prod(shape), 1), 1)

    dprobs = dout @ np.swapaxes(v, -1, -2)               # |dout_i|·|v_j|  (..., L, S)
    if keep is not None:
        dprobs = reference.dropout_forward(dprobs, keep, case.dropout_p)
    dscores = probs * (dprobs + np.sum(probs * dprobs, axis=-1, keepdims=True)) * amp
    b = {
        "output": (S + E, (weights * amp) @ v),
        "logsumexp": (S + E, 1 + top[..., 0]),
        "weights": (S + E, weights * amp),
        "dquery": (S * copies(case.query.shape[:-2]) + E + Ev,
                   sum_to(s * (dscores @ k), case.query.shape)),
        "dkey": (L * copies(case.key.shape[:-2]) + S + E + Ev,
                 sum_to(kv_heads(s * (np.swapaxes(dscores, -1, -2) @ q)), case.key.shape)),
        "dvalue": (L * copies(case.value.shape[:-2]) + S + E,
                   sum_to(kv_heads(np.swapaxes(weights * amp, -1, -2) @ dout),
                          case.value.shape)),
    }
    if mask is not None and mask.dtype != bool:
        b["dmask"] = (math.prod(case.weights_shape) // max(mask.size, 1) + S + E + Ev,
                      sum_to(np.broadcast_to(dscores, case.weights_shape), mask.shape))
    if case.sinks is not None:       # -Σ p_sink·D: p_sink = exp(sink - lse) carries lse's error
        _, lse = case.reference_forward()                                   # (..., [H,] L)
        sink = case.sinks64()
        with np.errstate(invalid="ignore"):
            p_sink = np.nan_to_num(np.exp((sink[:, None] if case.heads else sink) - lse))
        d = np.sum(dout * ((weights * amp) @ v), axis=-1)                   # |D| (..., [H,] L)
        terms = np.broadcast_to(p_sink * d * (1 + top[..., 0]), lse.shape)
        heads = sink.shape[0]
        b["dsinks"] = (L * copies(sink.shape) + S + E + Ev,
                       terms.reshape(math.prod(terms.shape[:-1]) // heads, heads,
                                     terms.shape[-1]).sum(axis=(0, 2)))
    return b


def check(name, got, want, case, b):
    n, scale = b[name]
    assert_close(got, want, dtype=case.dtype, n=n, scale=scale)


def assert_bound_is_meaningful(name, want, case, b, fraction=1.0):
    """Every example checks something: the largest tolerance of ``name`` is below ``fraction``
    of its largest |want| -- a bound above the results themselves would accept anything. (Not
    lower than the results: large logits legitimately amplify float32 score errors, and a
    draw with scores ~E·|q|·|k| large gets a bound of about half its outputs.) Exempt
    only results that are 0, or made of weights below the dtype's resolution (< tiny/eps: the
    floor ``bounds`` gives every weight), which the dtype cannot represent to begin with.

    One kind of draw is ill-conditioned rather than unchecked: huge logits that amplify the
    score errors (the bound's ``amp``) together with values whose weighted sum cancels, e.g.
    a softcap of 0.05 over scores ~1e3 with nearly uniform weights of ±v. The float32 truth
    itself is then uncertain by more than the result; such draws are discarded (``assume``),
    provided the bound is still below the unamplified sum of the terms' magnitudes
    (Σ_j w_j·|v_j|) -- a bound above even that is a wrong bound, and fails."""
    n, scale = b[name]
    want = np.asarray(want, dtype=np.float64)
    finite = np.isfinite(want)
    biggest = np.abs(want[finite]).max(initial=0.0)
    vmax = np.abs(np.nan_to_num(f64(case.value)[0], nan=0.0)).max(initial=0.0)
    floor = np.finfo(case.dtype).tiny / np.finfo(case.dtype).eps
    if biggest <= floor * max(vmax, 1.0):
        return
    tol = np.broadcast_to(tolerance(case.dtype, n, scale, want), want.shape)[finite].max()
    if tol >= fraction * biggest:
        terms = np.broadcast_to(bounds(case, amplify=False)[name][1], want.shape)[finite].max()
        assert tol < fraction * terms, (
            f"{name}: tolerance {tol:.3g} is not below {fraction} x max|want| = {biggest:.3g}, "
            f"nor below the terms' magnitude {terms:.3g}: this example would check nothing")
        assume(False)        # ill-conditioned (see above): the draw is not counted


def named_grads(case, grads):
    """(name, got, reference) for each of a backward's results (dmask included when there)."""
    want = case.reference_backward()
    names = case.grad_names(mask_grad=len(grads) > 3 + (case.sinks is not None))
    assert len(grads) == len(names)
    return [(name, got, want[name]) for name, got in zip(names, grads)]


# ------------------------------------------------------------------ the strategy

def lengths(max_value):
    """L or S: 1 often, sometimes 0 (nothing to attend to / no queries), block edges, else up
    to max."""
    edges = [n for n in BLOCK_EDGES if n <= max_value]
    return st.one_of(st.just(1), st.integers(1, max_value), st.integers(1, max_value),
                     st.sampled_from(edges) if edges else st.integers(1, max_value),
                     st.integers(0, 19).map(lambda r: 0 if r == 0 else 2))


@st.composite
def batch_dims(draw, max_ndim, max_dim):
    """Batch dims of query, key and value that broadcast together, e.g. (2, 1), (3,) and (2, 3)."""
    ndim = min(draw(st.sampled_from([1, 2, 0])), max_ndim)
    full = [min(draw(st.sampled_from([2, 1, 3])), max_dim) for _ in range(ndim)]
    if full and draw(st.integers(0, 19)) == 0:
        full[0] = 0                                      # an empty batch
    out = []
    for _ in range(3):
        mine = [n if draw(st.integers(0, 2)) else 1 for n in full]
        out.append(tuple(mine[draw(st.integers(0, len(mine))):]))
    return out


@st.composite
def mask_shapes(draw, target):
    """A shape that broadcasts to ``target`` = (batch..., H, L, S), e.g. (L, S), (B, 1, 1, S)."""
    L, S = target[-2:]
    named = [(L, S), (1, S), (L, 1), (S,), target]
    shape = draw(st.sampled_from(named + ["random"]))
    if shape != "random":
        return shape
    dims = [n if draw(st.booleans()) else 1 for n in target]
    return tuple(dims[draw(st.integers(0, len(dims) - 1)):])      # at least 1-D


def window_sides(L, S):
    """window=(left, right): unbounded, zero-width, narrow, about a block, wider than S."""
    side = st.one_of(st.none(), st.just(0), st.integers(0, 6), st.integers(0, max(L, S) + 2),
                     st.sampled_from([BK - 1, BK, 10**12]))
    return st.tuples(side, side)


@st.composite
def sdpa_cases(draw, masks=MASK_KINDS, dropout=True, gqa=True, kinds=("normal", "wide"),
               windows=True, alibi=True, softcap=True, sinks=True):
    """One call of scaled_dot_product_attention: every argument, any layout, and a dout."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(dtypes)
    size = draw(st.sampled_from(["small", "small", "small", "medium", "large"]))
    if size == "small":
        L, S, max_ndim, max_dim, max_hkv = draw(lengths(24)), draw(lengths(24)), 2, 3, 3
    elif size == "medium":                               # straddles 16, 64 and 128
        L, S, max_ndim, max_dim, max_hkv = draw(lengths(140)), draw(lengths(140)), 1, 2, 2
    else:                                                # several key or query blocks
        L, S, max_ndim, max_dim, max_hkv = draw(lengths(300)), draw(lengths(300)), 1, 1, 1
        S = S if S > BK else draw(st.integers(BK + 1, 300))
        if draw(st.booleans()):
            L, S = S, L
    E, Ev = draw(WIDTHS), draw(WIDTHS)

    def array(shape, kind=None):
        values = make_values(rng, shape, dtype, kind or draw(st.sampled_from(kinds)))
        return lay_out(values, draw(layouts), rng)

    if draw(st.integers(0, 9)) == 0:                     # 2-D: no head dim
        q_shape, k_shape, v_shape = (L, E), (S, E), (S, Ev)
        enable_gqa = False
    else:
        hkv = min(draw(st.sampled_from([2, 1, 3])), max_hkv)
        group = draw(st.sampled_from([2, 1, 3])) if gqa else 1
        if size == "large":
            group = min(group, 2)
        enable_gqa = group > 1 or (gqa and draw(st.booleans()))
        qb, kb, vb = draw(batch_dims(max_ndim, max_dim))
        q_shape = qb + (hkv * group, L, E)
        k_shape, v_shape = kb + (hkv, S, E), vb + (hkv, S, Ev)
    q_kind = draw(st.sampled_from(kinds))
    k_kinds = kinds
    if dtype == np.float32 and q_kind == "wide":
        # wide q and wide k make scores of ~1e6·E whose float32 rounding (~0.1·E) moves every
        # weight by O(1): no bound below the outputs themselves exists, so float32 keeps one
        # side ordinary (scores up to ~1e4 still test large logits; float64 draws both wide)
        k_kinds = tuple(kind for kind in kinds if kind != "wide") or ("normal",)
    case = Case(array(q_shape, q_kind), array(k_shape, draw(st.sampled_from(k_kinds))),
                array(v_shape), None)
    case.dout = array(case.weights_shape[:-1] + (Ev,), "normal")
    case.enable_gqa = enable_gqa

    kind = draw(st.sampled_from(masks))
    if kind != "none":
        shape = draw(mask_shapes(case.weights_shape))
        if kind == "bool":
            mask = rng.random(shape) < 0.75
            mask[rng.random(shape[:-1]) < 0.15] = False  # whole rows masked
        else:
            mask = make_values(rng, shape, dtype, "masked")  # -inf entries and -inf rows
        case.attn_mask = lay_out(mask, draw(layouts), rng)
    if dropout and draw(st.booleans()):
        case.dropout_p = draw(st.one_of(st.sampled_from([0.1, 0.5, 0.9, 1.0]),
                                        st.floats(0.0, 1.0)))
        case.seed = draw(st.integers(0, 2**64 - 1))
    elif draw(st.booleans()):
        case.seed = draw(st.integers(0, 2**64 - 1))      # a seed without dropout changes nothing
    case.is_causal = draw(st.booleans())
    case.causal_alignment = draw(st.sampled_from(ALIGNMENTS))   # ignored unless causal/window
    if windows and draw(st.integers(0, 2)) == 0:
        case.window = draw(window_sides(L, S))
    if alibi and case.heads and draw(st.integers(0, 2)) == 0:
        heads = case.query.shape[-3]
        shape = draw(st.sampled_from([(heads,), case.batch + (heads,), (1,)]))
        case.alibi_slopes = lay_out(rng.uniform(0.0, draw(st.sampled_from([0.05, 1.0, 8.0])),
                                                shape).astype(dtype), draw(layouts), rng)
    if softcap and draw(st.integers(0, 2)) == 0:
        case.softcap = draw(st.sampled_from([0.05, 1.0, 5.0, 50.0]) | st.floats(0.01, 1e3))
    if sinks and draw(st.integers(0, 2)) == 0:
        heads = case.query.shape[-3] if case.heads else 1
        spread = draw(st.sampled_from([1.0, 5.0, 40.0]))
        logits = rng.normal(0.0, spread, heads)
        if draw(st.integers(0, 4)) == 0:
            logits[rng.random(heads) < 0.5] = -np.inf        # a sink of -inf: no sink
        case.sinks = lay_out(logits.astype(dtype), draw(layouts), rng)
    factor = draw(st.none() | st.floats(-2.0, 2.0))
    case.scale = None if factor is None else factor / math.sqrt(E)
    return case


# ------------------------------------------------------------------ against the textbook

@given(case=sdpa_cases())
def test_forward_matches_reference(case):
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    want_out, want_lse = case.reference_forward()
    b = bounds(case)
    assert_bound_is_meaningful("output", want_out, case, b)
    check("output", out, want_out, case, b)
    check("logsumexp", lse, want_lse, case, b)
    only = scaled_dot_product_attention(case.query, case.key, case.value, **case.kwargs())
    check("output", only, want_out, case, b)


@given(case=sdpa_cases(), mask_grad=st.booleans(), layout=layouts)
def test_backward_matches_reference(case, mask_grad, layout):
    float_mask = case.attn_mask is not None and case.attn_mask.dtype != bool
    mask_grad = mask_grad and float_mask
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    rng = np.random.default_rng(0)
    out, lse = lay_out(out, layout, rng), lay_out(lse, layout, rng)  # forward's, in any layout
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs(), mask_grad=mask_grad)
    names = case.grad_names(mask_grad)
    assert len(grads) == len(names)
    want = case.reference_backward()
    b = bounds(case)
    for name, got in zip(names, grads):
        check(name, got, want[name], case, b)


@given(case=sdpa_cases(gqa=False), mask_grad=st.booleans())
def test_attention_matches_reference(case, mask_grad):
    """The article's attention(): weights after dropout (its p_attn), and its backward."""
    float_mask = case.attn_mask is not None and case.attn_mask.dtype != bool
    mask_grad = mask_grad and float_mask
    args = (case.query, case.key, case.value, case.attn_mask, case.dropout_p)
    out, weights = attention(*args, **case.attention_kwargs())
    want_out, _ = case.reference_forward()
    _, want_weights = case.reference_weights()
    b = bounds(case)
    assert_bound_is_meaningful("output", want_out, case, b)
    check("output", out, want_out, case, b)
    check("weights", weights, want_weights, case, b)
    grads = attention_backward(case.dout, *args, **case.attention_kwargs(), mask_grad=mask_grad)
    names = case.grad_names(mask_grad)
    assert len(grads) == len(names)
    want = case.reference_backward()
    for name, got in zip(names, grads):
        check(name, got, want[name], case, b)
    assert attention_forward is attention
    # the logsumexp kept from forward: the same results, bit for bit, without a second forward
    out2, weights2, lse = attention(*args, **case.attention_kwargs(), return_logsumexp=True)
    assert_identical(out2, out)
    assert_identical(weights2, weights)
    _, want_lse = scaled_dot_product_attention_forward(*args, **case.attention_kwargs())
    assert_identical(lse, want_lse)
    kept = attention_backward(case.dout, *args, **case.attention_kwargs(), mask_grad=mask_grad,
                              output=out2, logsumexp=lse)
    for got, want in zip(kept, grads, strict=True):
        assert_identical(got, want)


def assert_identical(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_with_the_kept_logsumexp_runs_no_forward(monkeypatch, dtype):
    """attention(..., return_logsumexp=True) hands attention_backward what it needs: the
    backward then launches the backward kernel only (without them, the forward first)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)).astype(dtype) for _ in range(3))
    dout = rng.standard_normal((2, 3, 9, 8)).astype(dtype)
    engine = tiles.engine("attention", dtype)
    launches = []
    for name in ("attention_forward_kernel", "attention_backward_kernel"):
        kernel = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _k=kernel, _n=name: (launches.append(_n),
                                                                         _k(*a))[1])
    out, _, lse = attention(q, k, v, is_causal=True, return_logsumexp=True)
    launches.clear()
    attention_backward(dout, q, k, v, is_causal=True, output=out, logsumexp=lse)
    assert launches == ["attention_backward_kernel"]
    launches.clear()
    attention_backward(dout, q, k, v, is_causal=True)
    assert launches == ["attention_forward_kernel", "attention_backward_kernel"]


# ------------------------------------------------------------------ against PyTorch

@given(case=sdpa_cases(dropout=False))
def test_matches_torch(torch, case):
    """torch.nn.functional.scaled_dot_product_attention and autograd, in float64, no dropout.

    PyTorch refuses is_causal together with a mask, only aligns top-left, and gives NaN for
    is_causal with a scale <= 0 (it scales its causal bias: 0·-inf), so those become one
    explicit mask. Its GQA path mishandles
    batch dims that only key or value broadcast (wrong output shape) and it rejects a 1-D mask,
    so inputs and mask are expanded to the full batch first (autograd sums the gradients
    back). GQA itself and the scale go to PyTorch as they are. Fully masked rows: PyTorch 2.5+
    gives zero outputs and gradients too. Soft-capping and sinks, which PyTorch's SDPA has not,
    go through torch_formula: their formulas in PyTorch's operations, and its autograd.
    """
    q, k, v, dout = f64(case.query, case.key, case.value, case.dout)
    mask = case.mask64()
    formula = case.softcap is not None or case.sinks is not None
    explicit = formula or case.window is not None or case.alibi_slopes is not None or (
        case.is_causal and (mask is not None or case.causal_alignment == "bottom-right"
                            or (case.scale is not None and case.scale <= 0)))
    if explicit:                        # a window or ALiBi is always a dense mask for PyTorch
        mask = case.mask_with_visible()
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tmask = None if mask is None else torch.tensor(mask, requires_grad=mask.dtype != bool)
    tsinks = None if case.sinks is None else torch.tensor(case.sinks64(), requires_grad=True)
    full = [tq, tk, tv]
    if case.heads:
        full = [t.expand(case.batch + t.shape[-3:]) for t in full]
    full_mask = None if tmask is None else tmask.expand(case.weights_shape)  # PyTorch wants >= 2-D
    if formula:
        tout = torch_formula(torch, *full, full_mask, case.scale_value, case.group,
                             case.softcap, tsinks)
    else:
        tout = torch.nn.functional.scaled_dot_product_attention(
            *full, attn_mask=full_mask, is_causal=case.is_causal and not explicit,
            scale=case.scale, enable_gqa=case.enable_gqa)
    tout.backward(torch.tensor(dout))

    b = bounds(case)
    float_mask = case.attn_mask is not None and case.attn_mask.dtype != bool  # (not ALiBi's)
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    check("output", out, tout.detach().numpy(), case, b)
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs(), mask_grad=float_mask)
    def grad(t):                            # None when nothing flowed back (S = 0, L = 0)
        return np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy()

    want = dict(dquery=grad(tq), dkey=grad(tk), dvalue=grad(tv))
    if tsinks is not None:
        want["dsinks"] = grad(tsinks)
    if float_mask:
        want["dmask"] = sum_to(grad(tmask), case.attn_mask.shape)
    names = case.grad_names(float_mask)
    assert len(grads) == len(names)
    for name, got in zip(names, grads):
        check(name, got, want[name], case, b)


def torch_formula(torch, q, k, v, mask, scale, group, softcap, sinks):
    """Attention with soft-capping and sinks in PyTorch's operations (differentiable): scores
    = q·kᵀ·scale, capped (softcap·tanh(s/softcap)), masked (bool: -inf where False; float:
    added), a column of sinks (H,) beside them, a softmax that gives a row of -inf zeros (as
    npattn and SDPA do; torch.softmax would give NaN), the sink column dropped, ·v."""
    if group > 1:
        k, v = (torch.repeat_interleave(t, group, dim=-3) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    if sinks is not None:
        column = sinks.reshape(-1, 1, 1) if s.ndim >= 3 else sinks.reshape(1, 1)
        s = torch.cat([s, column.expand(s.shape[:-1] + (1,))], dim=-1)
    if s.shape[-1] == 0:                                  # no key and no sink: output 0
        return s @ v
    top = s.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


# ------------------------------------------------------------------ the article

def test_the_articles_three_token_example():
    """The article's first token: q¹·kʲ/√d_k = 2, 4, 4, softmax([2, 4, 4]) = [0.0634, 0.4683,
    0.4683] (the article rounds it to [0.0, 0.5, 0.5]), output = Σ_j weight_j·vʲ."""
    d_k = 4
    q = np.array([[1.0, 0.0, 0.0, 0.0]]) * math.sqrt(d_k)
    k = np.array([[2.0, 1, 0, 0], [4.0, 0, 1, 0], [4.0, 0, 0, 1]])
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    for dtype in DTYPES:
        args = [a.astype(dtype) for a in (q, k, v)]
        out, weights = attention(*args)
        assert out.dtype == weights.dtype == dtype
        assert out.shape == (1, 2) and weights.shape == (1, 3)
        np.testing.assert_array_equal(np.round(weights[0].astype(np.float64), 4),
                                      [0.0634, 0.4683, 0.4683])
        assert_close(weights[0], np.exp([2.0, 4, 4]) / np.exp([2.0, 4, 4]).sum(), dtype=dtype, n=3)
        assert_close(out[0], weights[0].astype(np.float64) @ v, dtype=dtype, n=3)
        out2, lse = scaled_dot_product_attention_forward(*args)
        assert_close(out2, out.astype(np.float64), dtype=dtype, n=3)
        assert_close(lse, [math.log(math.exp(2) + 2 * math.exp(4))], dtype=dtype, n=3, scale=4)


# ------------------------------------------------------------------ edge cases, one by one

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["bool", "float", "bottom-right", "no keys", "window",
                                 "window left"])
def test_fully_masked_rows_give_zeros_not_nan(dtype, how):
    rng = np.random.default_rng(11)
    B, H, L, S, E, Ev = 2, 3, 6, 0 if how == "no keys" else 4, 5, 3
    case = Case(*(make_values(rng, s, dtype) for s in
                  ((B, H, L, E), (B, H, S, E), (B, H, S, Ev), (B, H, L, Ev))))
    masked = np.zeros((B, H, L), bool)
    if how == "bool":
        case.attn_mask = rng.random((B, 1, L, S)) < 0.7
        case.attn_mask[:, :, [1, 4]] = False
        case.attn_mask[:, :, [0, 2, 3, 5], 0] = True
        masked[:, :, [1, 4]] = True
    elif how == "float":
        case.attn_mask = make_values(rng, (H, L, S), dtype)
        case.attn_mask[1, [0, 5]] = -np.inf
        masked[:, 1, [0, 5]] = True
    elif how == "bottom-right":                          # L > S: the first L - S see no key
        case.is_causal, case.causal_alignment = True, "bottom-right"
        masked[:, :, :L - S] = True
    elif how == "window":                  # diagonal i - 2: rows 0, 1 lie left of every key
        case.window, case.causal_alignment = (0, 0), "bottom-right"
        masked[:, :, :L - S] = True
    elif how == "window left":             # keys j >= i - 1: row 5 lies right of every key
        case.window = (1, None)
        masked[:, :, 5] = True
    else:
        masked[:] = True
    mask_grad = how == "float"
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs(), mask_grad=mask_grad)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[masked] == 0) and np.all(np.isneginf(lse[masked]))
    assert np.all(np.isfinite(lse[~masked]))
    assert np.all(grads[0][masked] == 0)
    for g in grads:
        assert np.all(np.isfinite(g))
    if mask_grad:
        assert np.all(grads[3][1, [0, 5]] == 0)
    b = bounds(case)
    for name, got, want in zip(("output", "logsumexp"), (out, lse), case.reference_forward()):
        check(name, got, want, case, b)
    for name, got, want in named_grads(case, grads):
        check(name, got, want, case, b)
    _, weights = attention(case.query, case.key, case.value, case.attn_mask,
                           **case.attention_kwargs())
    assert np.all(weights[masked] == 0) and not np.isnan(weights).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_window_is_the_mask_it_describes_bit_for_bit(dtype):
    """Windows that hide nothing are no window; a window with right side 0 is the causal
    mask; any window is the bool mask reference.window_mask builds -- the same bits, forward
    and backward, over several key blocks (the blocks outside every window are skipped, the
    mask's are computed and contribute exact zeros)."""
    rng = np.random.default_rng(16)
    L, S = 300, 400
    q, k, v, dout = (make_values(rng, s, dtype) for s in
                     ((2, 2, L, 24), (2, 1, S, 24), (2, 1, S, 8), (2, 2, L, 8)))

    def run(**kw):
        out, lse = scaled_dot_product_attention_forward(q, k, v, enable_gqa=True, **kw)
        grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                      enable_gqa=True, **kw)
        mask = kw.pop("attn_mask", None)
        _, weights = attention(q[:, :1], k, v, mask, **kw)
        return out, lse, *grads, weights

    def same(a, b):
        for x, y in zip(a, b, strict=True):
            assert_identical(x, y)

    for align in ALIGNMENTS:
        full = run(causal_alignment=align)
        same(run(causal_alignment=align, window=(S + L, S + L)), full)
        same(run(causal_alignment=align, window=(None, 10**15)), full)
        causal = run(causal_alignment=align, is_causal=True)
        same(run(causal_alignment=align, window=(None, 0)), causal)
        same(run(causal_alignment=align, window=(None, 5), is_causal=True), causal)
        for window in ((40, 3), (0, 0), (200, None), (None, 130), (7, 260)):
            band = run(causal_alignment=align, window=window)
            assert not np.array_equal(band[0], full[0])
            same(band, run(causal_alignment=align,
                           attn_mask=reference.window_mask(L, S, window, align)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_is_the_float_mask_of_its_bias_bit_for_bit(dtype):
    """ALiBi computed in the kernel gives the bits of the (L, S) float mask it replaces:
    slope·|d - j| is one rounding in the dtype either way. Zero slopes are no ALiBi; with a
    window and both alignments, over several key blocks, forward and backward."""
    rng = np.random.default_rng(17)
    L, S, H = 300, 400, 4
    q, k, v, dout = (make_values(rng, s, dtype) for s in
                     ((2, H, L, 24), (2, 2, S, 24), (2, 2, S, 8), (2, H, L, 8)))
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(dtype)          # the paper's 1/2, 1/4, ...

    def run(**kw):
        out, lse = scaled_dot_product_attention_forward(q, k, v, enable_gqa=True, **kw)
        return (out, lse, *scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                                 enable_gqa=True, **kw))

    for align in ALIGNMENTS:
        for window in (None, (50, 7)):
            kw = dict(causal_alignment=align, window=window)
            bias = reference.alibi_bias(L, S, slopes, align).astype(dtype)     # (H, L, S)
            got = run(alibi_slopes=slopes, **kw)
            for x, y in zip(got, run(attn_mask=bias, **kw)):
                assert_identical(x, y)
            assert not np.array_equal(got[0], run(**kw)[0])
            for x, y in zip(run(alibi_slopes=np.zeros((2, H), dtype), **kw), run(**kw)):
                assert_identical(x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sink_of_minus_inf_is_no_sink_bit_for_bit(dtype):
    """exp(-inf) joins each denominator as an exact 0: every result has the bits of the call
    without sinks, and the sinks' gradient is 0 -- with a mask, causal, GQA and dropout, over
    several key blocks. A finite sink changes the output (the premise)."""
    rng = np.random.default_rng(23)
    L, S, H = 200, 300, 4
    q, k, v, dout = (make_values(rng, s, dtype) for s in
                     ((2, H, L, 24), (2, 2, S, 24), (2, 2, S, 8), (2, H, L, 8)))
    mask = rng.random((L, S)) < 0.8
    kw = dict(attn_mask=mask, is_causal=True, causal_alignment="bottom-right", dropout_p=0.2,
              seed=5, enable_gqa=True)

    def run(**more):
        out, lse = scaled_dot_product_attention_forward(q, k, v, **kw, **more)
        return (out, lse, *scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw,
                                                                 **more))

    plain = run()
    got = run(sinks=np.full(H, -np.inf, dtype))
    assert len(got) == len(plain) + 1
    for x, y in zip(got[:5], plain):
        assert_identical(x, y)
    assert np.array_equal(got[5], np.zeros(H, dtype))
    assert not np.array_equal(run(sinks=np.zeros(H, dtype))[0], plain[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_take_the_weight_of_masked_rows_and_of_huge_logits(dtype):
    """A row whose keys are all masked gives output 0 and logsumexp = its sink (log(e^sink)),
    with zero gradients; a sink of 1e30 takes every row's whole weight: output 0, logsumexp
    1e30, every gradient 0. Both against the reference."""
    rng = np.random.default_rng(29)
    B, H, L, S, E, Ev = 2, 3, 6, 9, 5, 4
    case = Case(*(make_values(rng, s, dtype) for s in
                  ((B, H, L, E), (B, H, S, E), (B, H, S, Ev), (B, H, L, Ev))))
    case.attn_mask = rng.random((B, 1, L, S)) < 0.7
    case.attn_mask[:, :, [1, 4]] = False
    case.sinks = rng.standard_normal(H).astype(dtype)
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs())
    assert np.all(out[:, :, [1, 4]] == 0)
    assert np.array_equal(lse[:, :, [1, 4]], np.broadcast_to(case.sinks[:, None], (B, H, 2)))
    assert np.all(grads[0][:, :, [1, 4]] == 0)
    b = bounds(case)
    for name, got, want in zip(("output", "logsumexp"), (out, lse), case.reference_forward()):
        check(name, got, want, case, b)
    for name, got, want in named_grads(case, grads):
        check(name, got, want, case, b)

    case.attn_mask, case.sinks = None, np.array([1e30, 0.0, -1e30], dtype)
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs())
    assert np.all(out[:, 0] == 0) and np.all(lse[:, 0] == dtype(1e30))
    assert np.all(grads[0][:, 0] == 0) and grads[3][0] == 0
    for g in grads:
        assert np.all(np.isfinite(g))
    b = bounds(case)
    for name, got, want in zip(("output", "logsumexp"), (out, lse), case.reference_forward()):
        check(name, got, want, case, b)
    for name, got, want in named_grads(case, grads):
        check(name, got, want, case, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_bounds_huge_logits(dtype):
    """Scores of ±1e30 capped at 20: the softmax sees scores in [-20, 20] and matches the
    reference; the cap's slope there is 0, so no gradient flows through a saturated score
    (and none is NaN)."""
    rng = np.random.default_rng(31)
    B, H, L, S, E, Ev = 2, 2, 5, 7, 3, 4
    q = make_values(rng, (B, H, L, E), dtype) * dtype(1e15)
    k = make_values(rng, (B, H, S, E), dtype) * dtype(1e15)
    v, dout = make_values(rng, (B, H, S, Ev), dtype), make_values(rng, (B, H, L, Ev), dtype)
    case = Case(q, k, v, dout)
    case.softcap, case.scale = 20.0, 1.0
    out, lse = scaled_dot_product_attention_forward(q, k, v, **case.kwargs())
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **case.kwargs())
    assert np.all(np.abs(lse) <= 20 + np.log(S) + 1e-3)
    want_out, want_lse = case.reference_forward()
    assert_close(out, want_out, dtype=dtype, n=S + E, scale=(f64(np.abs(v))[0]).max())
    assert_close(lse, want_lse, dtype=dtype, n=S + E, scale=20.0)
    for g in grads:
        assert np.all(np.isfinite(g))
    want = case.reference_backward()
    assert_close(grads[2], want["dvalue"], dtype=dtype, n=L + S + E,
                 scale=np.abs(f64(dout)[0]).sum(axis=-2, keepdims=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits_stay_finite_and_exact(dtype):
    """Scores of ±1e30 (q, k ~ 1e15), which overflow any unshifted exp. In each row the scores
    differ by >= 1e28 (far above their rounding), so the weights are exactly one-hot."""
    rng = np.random.default_rng(12)
    B, H, L, S, E, Ev = 2, 2, 5, 7, 3, 4
    q, k = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, S, E))
    q[..., 0] = rng.choice([-1.0, 1.0], (B, H, L)) * rng.uniform(0.5, 1.5, (B, H, L)) * 1e15
    t = rng.permuted(np.tile(np.arange(1, S + 1) * 0.1, (B, H, 1)), axis=-1)   # distinct
    k[..., 0] = t * rng.choice([-1.0, 1.0], (B, H, S)) * 1e15                 # |t| distinct
    case = Case(q.astype(dtype), k.astype(dtype), *(make_values(rng, s, dtype) for s in
                                                    ((B, H, S, Ev), (B, H, L, Ev))), scale=1.0)
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(lse).max() > 1e28
    probs, _ = case.reference_weights()
    assert np.all((probs == 0) | (probs == 1))           # the construction works
    want_out, want_lse = case.reference_forward()
    b = bounds(case, amplify=False)
    check("output", out, want_out, case, b)
    check("logsumexp", lse, want_lse, case, b)
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs())
    for name, got, want in named_grads(case, grads):
        assert np.isfinite(got).all()
        check(name, got, want, case, b)
    _, weights = attention(case.query, case.key, case.value, scale=1.0)
    np.testing.assert_array_equal(weights, probs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_nan_propagates(dtype, where):
    """A NaN reaches what depends on it (as the textbook says) and nothing else."""
    rng = np.random.default_rng(13)
    case = Case(*(make_values(rng, s, dtype) for s in
                  ((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3), (2, 2, 5, 3))))
    getattr(case, where)[1, 0, 2, 1] = np.nan
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value)
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse)
    want_out, want_lse = case.reference_forward()
    assert np.isnan(want_out).any() and not np.isnan(want_out).all()
    b = bounds(case)
    check("output", out, want_out, case, b)
    check("logsumexp", lse, want_lse, case, b)
    for name, got, want in named_grads(case, grads):
        check(name, got, want, case, b)                  # NaN at the same places


@pytest.mark.parametrize("dtype", DTYPES)
def test_bottom_right_rows_are_the_last_rows_of_full_causal_attention(dtype):
    """What a KV cache relies on: the last n queries, aligned bottom-right to all S keys, get
    what they got as the last n rows of top-left causal attention over L = S queries."""
    rng = np.random.default_rng(14)
    S = 150
    q, k, v = (make_values(rng, s, dtype) for s in ((2, 3, S, 17), (2, 3, S, 17), (2, 3, S, 9)))
    full = scaled_dot_product_attention(q, k, v, is_causal=True)
    for n in (1, 7, 130):
        last = scaled_dot_product_attention(q[..., -n:, :], k, v, is_causal=True,
                                            causal_alignment="bottom-right")
        case = Case(q[..., -n:, :], k, v, np.zeros((2, 3, n, 9), dtype), is_causal=True,
                    causal_alignment="bottom-right")
        check("output", last, f64(full[..., -n:, :])[0], case, bounds(case))
    top = scaled_dot_product_attention(q[..., :1, :], k, v, is_causal=True)   # sees key 0 only
    assert_close(top, np.broadcast_to(f64(v[..., :1, :])[0], top.shape), dtype=dtype, n=1)


def test_long_rows_in_float32():
    """Longer than Hypothesis draws: many key blocks, ragged ends, a (1, S) float mask and a
    bottom-right causal mask, in float32."""
    rng = np.random.default_rng(15)
    L, S = 257, 1031
    case = Case(*(make_values(rng, s, np.float32) for s in
                  ((2, L, 64), (2, S, 64), (2, S, 48), (2, L, 48))),
                attn_mask=make_values(rng, (1, S), np.float32),
                is_causal=True, causal_alignment="bottom-right")
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs(), mask_grad=True)
    b = bounds(case)
    for name, got, want in zip(("output", "logsumexp"), (out, lse), case.reference_forward()):
        check(name, got, want, case, b)
    for name, got, want in named_grads(case, grads):
        check(name, got, want, case, b)


def determinism_case(layout="contiguous"):
    """GQA, a broadcast float mask with -inf, causal, dropout and E != Ev, in some layout."""
    rng = np.random.default_rng(16)
    arrays = [make_values(rng, s, np.float32) for s in
              ((2, 4, 37, 24), (2, 2, 141, 24), (2, 2, 141, 20), (2, 4, 37, 20), (1, 37, 141))]
    arrays[4][arrays[4] < -1.5] = -np.inf
    arrays = [lay_out(a, layout, np.random.default_rng(17)) for a in arrays]
    return Case(*arrays[:4], attn_mask=arrays[4], dropout_p=0.25, seed=2**63 + 5,
                is_causal=True, causal_alignment="bottom-right", enable_gqa=True, scale=0.3)


def run(case):
    out, lse = scaled_dot_product_attention_forward(case.query, case.key, case.value,
                                                    **case.kwargs())
    grads = scaled_dot_product_attention_backward(case.dout, case.query, case.key, case.value,
                                                  out, lse, **case.kwargs(), mask_grad=True)
    return [out, lse, *grads]


def test_same_call_twice_gives_the_same_bits():
    first, second = run(determinism_case()), run(determinism_case())
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()


@st.composite
def option_sequences(draw):
    """Shapes (batch dims broadcasting or not) and a sequence of 2-5 calls on them, each with
    its own score options: what the layout cache of _prepare is keyed on."""
    batch_q = draw(st.sampled_from([(), (2,), (1, 2), (2, 1)]))
    batch_k = draw(st.sampled_from([batch_q, (1,), ()]))
    heads, L, S, E = (draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.integers(1, 40)),
                      draw(st.sampled_from([4, 8, 16])))
    options = st.fixed_dictionaries({
        "is_causal": st.booleans(),
        "causal_alignment": st.sampled_from(["top-left", "bottom-right"]),
        "scale": st.none() | st.sampled_from([0.1, 0.5, 2.0]),
        "window": st.none() | st.tuples(st.integers(0, 8), st.integers(0, 8)),
        "softcap": st.none() | st.sampled_from([1.0, 5.0]),
        "dropout_p": st.sampled_from([0.0, 0.0, 0.5]),
        "seed": st.integers(0, 3)})
    calls = draw(st.lists(options, min_size=2, max_size=5))
    return batch_q, batch_k, heads, L, S, E, calls


@given(case=option_sequences(), dtype=dtypes)
def test_calls_of_one_shape_with_other_options_get_their_own_layout(case, dtype):
    """_prepare caches the index maps and score record of calls without a mask, ALiBi, sinks
    or varlen by their shapes and options: a call must give the bits it gives with the cache
    empty, whatever calls of the same shapes (other options) came before it."""
    from npattn.functional import attention as functional
    batch_q, batch_k, heads, L, S, E, calls = case
    rng = np.random.default_rng(5)
    q = make_values(rng, batch_q + (heads, L, E), dtype)
    k, v = (make_values(rng, batch_k + (heads, S, E), dtype) for _ in range(2))
    dout = make_values(rng, np.broadcast_shapes(batch_q, batch_k) + (heads, L, E), dtype)

    def both(kw):
        out, lse = scaled_dot_product_attention_forward(q, k, v, **kw)
        return [out, lse, *scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)]

    fresh = []
    for kw in calls:                       # each call alone: computed with the cache empty
        functional._plain_layout.cache_clear()
        fresh.append(both(kw))
    for i in (*range(len(calls)), *reversed(range(len(calls)))):   # then one after another
        for a, b in zip(both(calls[i]), fresh[i]):
            assert a.tobytes() == b.tobytes(), calls[i]


@pytest.mark.parametrize("layout", ["fortran", "transposed", "sliced", "negative", "readonly"])
def test_layout_does_not_change_the_bits(layout):
    """Kernels only ever see C-contiguous copies, so the memory layout cannot change a bit."""
    want = run(determinism_case())
    for a, b in zip(run(determinism_case(layout)), want):
        assert a.tobytes() == b.tobytes()


def test_dropout_depends_only_on_the_seed():
    rng = np.random.default_rng(18)
    q, k, v = (make_values(rng, s, np.float64) for s in ((2, 2, 16, 8), (2, 2, 16, 8),
                                                          (2, 2, 16, 8)))
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=7)
    b = scaled_dot_product_attention(q.copy(), k.copy(), v.copy(), dropout_p=0.5, seed=7)
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.5, seed=8)
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, c)
    # the zeros of attention()'s weights are exactly the documented keep-mask's drops
    for seed in (7, 2**64 - 1):
        _, weights = attention(q, k, v, None, 0.5, seed=seed)
        np.testing.assert_array_equal(weights != 0, dropout_mask((2, 2, 16, 16), 0.5, seed))


def test_accepts_lists_and_numpy_scalars():
    rng = np.random.default_rng(21)
    q, k, v, dout = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3), (2, 3, 3)))
    mask = rng.random((3, 5)) < 0.8
    kw = dict(dropout_p=0.2, is_causal=True, scale=0.7, causal_alignment="bottom-right")
    out, lse = scaled_dot_product_attention_forward(q, k, v, mask, seed=5, **kw)
    got, got_lse = scaled_dot_product_attention_forward(q.tolist(), k.tolist(), v.tolist(),
                                                        mask.tolist(), seed=np.uint64(5),
                                                        **dict(kw, dropout_p=np.float64(0.2)))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)
    grads = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, mask, seed=5, **kw)
    got = scaled_dot_product_attention_backward(dout.tolist(), q.tolist(), k.tolist(),
                                                v.tolist(), out.tolist(), lse.tolist(),
                                                mask.tolist(), seed=5, **kw)
    for g, w in zip(got, grads):
        np.testing.assert_array_equal(g, w)


def test_dropout_without_seed_raises():
    rng = np.random.default_rng(19)
    q, k, v, dout = (rng.standard_normal((1, 2, 3, 4)) for _ in range(4))
    out, lse = scaled_dot_product_attention_forward(q, k, v)
    calls = [lambda: scaled_dot_product_attention(q, k, v, dropout_p=0.1),
             lambda: scaled_dot_product_attention_forward(q, k, v, dropout_p=0.1),
             lambda: scaled_dot_product_attention_backward(dout, q, k, v, out, lse, dropout_p=0.1),
             lambda: attention(q, k, v, None, 0.1),
             lambda: attention_backward(dout, q, k, v, None, 0.1)]
    for call in calls:
        with pytest.raises(ValueError, match="seed"):
            call()
    scaled_dot_product_attention(q, k, v, dropout_p=0.0)          # p = 0 needs no seed


def test_dropout_p_one_drops_everything():
    rng = np.random.default_rng(20)
    q, k, v, dout = (rng.standard_normal((2, 3, 4)) for _ in range(4))
    out, lse = scaled_dot_product_attention_forward(q, k, v, dropout_p=1.0, seed=3)
    assert np.all(out == 0) and np.isfinite(lse).all()            # lse is before dropout
    dq, dk, dv = scaled_dot_product_attention_backward(dout, q, k, v, out, lse, dropout_p=1.0,
                                                        seed=3)
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


# ------------------------------------------------------------------ bad input

Q, K, V = np.ones((2, 4, 3, 5)), np.ones((2, 2, 6, 5)), np.ones((2, 2, 6, 7))
OUT, LSE, DOUT = np.ones((2, 4, 3, 7)), np.ones((2, 4, 3)), np.ones((2, 4, 3, 7))


def sdpa(query=Q, key=K, value=V, **kw):
    return scaled_dot_product_attention_forward(query, key, value, **{"enable_gqa": True, **kw})


def sdpa_backward(dout=DOUT, output=OUT, logsumexp=LSE, **kw):
    return scaled_dot_product_attention_backward(dout, Q, K, V, output, logsumexp,
                                                 **{"enable_gqa": True, **kw})


BAD_INPUT = [                               # call, error, a word the message must contain
    (lambda: sdpa(query=Q.astype(np.int64)), TypeError, "query"),
    (lambda: sdpa(query=Q.astype(np.float16)), TypeError, "query"),
    (lambda: sdpa(query=Q.astype(np.complex128)), TypeError, "query"),
    (lambda: sdpa(key=K.astype(np.float32)), TypeError, "key"),
    (lambda: sdpa(value=V.astype(bool)), TypeError, "value"),
    (lambda: sdpa(value=V.astype(np.float32)), TypeError, "value"),
    (lambda: sdpa(attn_mask=np.ones((3, 6), np.int64)), TypeError, "attn_mask"),
    (lambda: sdpa(attn_mask=np.ones((3, 6), np.float32)), TypeError, "attn_mask"),
    (lambda: sdpa(query=np.ones(5)), ValueError, "query"),
    (lambda: sdpa(key=np.ones((2, 2, 6, 4))), ValueError, "key"),       # E: 4 vs 5
    (lambda: sdpa(value=np.ones((2, 2, 5, 7))), ValueError, "value"),   # S: 5 vs 6
    (lambda: sdpa(value=np.ones((2, 1, 6, 7))), ValueError, "value"),   # Hkv: 1 vs 2
    (lambda: sdpa(key=np.ones((2, 3, 6, 5)), value=np.ones((2, 3, 6, 7))),
     ValueError, "key|query"),                                          # 4 % 3 != 0
    (lambda: sdpa(enable_gqa=False), ValueError, "enable_gqa|key"),     # H 4 != Hkv 2
    (lambda: sdpa(key=np.ones((3, 2, 6, 5)), value=np.ones((3, 2, 6, 7))),
     ValueError, "key|query"),                                          # batch 2 vs 3
    (lambda: sdpa(is_causal=True, causal_alignment="bottom_right"), ValueError,
     "causal_alignment"),
    (lambda: sdpa(attn_mask=np.ones((4, 6), bool)), ValueError, "attn_mask"),     # L: 4 vs 3
    (lambda: sdpa(attn_mask=np.ones((3, 2, 4, 3, 6))), ValueError, "attn_mask"),  # widens batch
    (lambda: sdpa(dropout_p=1.5, seed=0), ValueError, "dropout_p"),
    (lambda: sdpa(dropout_p=-0.1, seed=0), ValueError, "dropout_p"),
    (lambda: sdpa(dropout_p=0.5, seed=-1), ValueError, "seed"),
    (lambda: sdpa(dropout_p=0.5, seed=2**64), ValueError, "seed"),
    (lambda: sdpa_backward(attn_mask=np.ones((3, 6), bool), mask_grad=True),
     (TypeError, ValueError), "mask_grad|attn_mask"),
    (lambda: sdpa_backward(mask_grad=True), (TypeError, ValueError), "mask_grad|attn_mask"),
    (lambda: sdpa_backward(dout=np.ones((2, 4, 3, 6))), ValueError, "dout"),
    (lambda: sdpa_backward(dout=DOUT.astype(np.float32)), TypeError, "dout"),
    (lambda: sdpa_backward(output=np.ones((2, 4, 3, 6))), ValueError, "output"),
    (lambda: sdpa_backward(logsumexp=np.ones((2, 4, 4))), ValueError, "logsumexp"),
    (lambda: sdpa_backward(logsumexp=LSE.astype(np.float32)), TypeError, "logsumexp"),
    (lambda: attention(Q, Q, Q, np.ones((3, 3), np.int32)), TypeError, "mask"),
    (lambda: attention(Q.astype(np.int32), Q, Q), TypeError, "query"),
    (lambda: attention_backward(DOUT, Q, K, V), ValueError, "key|query"),  # H != Hkv
    (lambda: attention_backward(DOUT, Q, Q, Q, output=OUT), ValueError, "logsumexp"),
    (lambda: attention_backward(DOUT, Q, Q, Q, logsumexp=LSE), ValueError, "output"),
    (lambda: attention_backward(DOUT[..., :5], Q, Q, Q, output=OUT[..., :5],
                                logsumexp=LSE[..., :2]), ValueError, "logsumexp"),
    (lambda: attention(Q, Q, Q, return_logsumexp="yes"), TypeError, "return_logsumexp"),
    (lambda: sdpa(window=(-1, 3)), ValueError, "window's left side.*-1"),
    (lambda: sdpa(window=(2, -5)), ValueError, "window's right side.*-5"),
    (lambda: sdpa(window=4), TypeError, "window.*pair"),
    (lambda: sdpa(window=(1, 2, 3)), TypeError, "window.*pair"),
    (lambda: sdpa(window=(1.5, 2)), TypeError, "window's left side.*float"),
    (lambda: sdpa(window=(True, 2)), TypeError, "window's left side.*bool"),
    (lambda: sdpa_backward(window=(0, -1)), ValueError, "window's right side"),
    (lambda: attention(Q, Q, Q, window=(None, -2)), ValueError, "window's right side"),
    (lambda: attention_backward(DOUT, Q, Q, Q, window="10"), TypeError, "window"),
    (lambda: sdpa(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes.*\(4,\).*\(3,\)"),
    (lambda: sdpa(alibi_slopes=np.ones((3, 4))), ValueError, "alibi_slopes"),   # batch 2
    (lambda: sdpa(alibi_slopes=np.ones((4, 1))), ValueError, "alibi_slopes"),
    (lambda: sdpa(alibi_slopes=np.ones(4, np.float32)), TypeError, "alibi_slopes.*float32"),
    (lambda: sdpa(alibi_slopes=np.ones(4, np.int64)), TypeError, "alibi_slopes"),
    (lambda: sdpa(alibi_slopes="slopes"), TypeError, "alibi_slopes"),
    (lambda: sdpa_backward(alibi_slopes=np.ones(5)), ValueError, "alibi_slopes"),
    (lambda: attention(Q, Q, Q, alibi_slopes=np.ones((2, 2))), ValueError, "alibi_slopes"),
    (lambda: sdpa(softcap=0), ValueError, r"softcap.*> 0.*got 0"),
    (lambda: sdpa(softcap=-2.5), ValueError, r"softcap.*got -2.5"),
    (lambda: sdpa(softcap=math.nan), ValueError, "softcap.*nan"),
    (lambda: sdpa(softcap=math.inf), ValueError, "softcap.*finite.*inf"),
    (lambda: sdpa(softcap="30"), TypeError, "softcap.*str"),
    (lambda: sdpa(softcap=True), TypeError, "softcap.*bool"),
    (lambda: sdpa_backward(softcap=-1.0), ValueError, "softcap"),
    (lambda: attention(Q, Q, Q, softcap=0.0), ValueError, "softcap"),
    (lambda: sdpa(sinks=np.ones(3)), ValueError, r"sinks.*\(4,\).*\(3,\)"),
    (lambda: sdpa(sinks=np.ones((2, 4))), ValueError, r"sinks.*\(2, 4\)"),   # no batch dims
    (lambda: sdpa(sinks=np.ones(1)), ValueError, "sinks"),                    # no broadcast
    (lambda: sdpa(sinks=np.ones(4, np.float32)), TypeError, "sinks.*float32"),
    (lambda: sdpa(sinks="sinks"), TypeError, "sinks"),
    (lambda: sdpa_backward(sinks=np.ones(5)), ValueError, "sinks"),
    (lambda: attention(Q, Q, Q, sinks=np.ones(2)), ValueError, "sinks"),
]


@pytest.mark.parametrize("call, error, words", BAD_INPUT,
                         ids=[f"{i}-{words.split('|')[0]}" for i, (_, _, words) in
                              enumerate(BAD_INPUT)])
def test_rejects_bad_input(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert re.search(words, str(info.value)), str(info.value)
