"""scaled_dot_product_attention_varlen: packed batches of sequences of different lengths
(flash-attn's layout), forward and backward, against the float64 textbook
(reference.scaled_dot_product_attention_varlen_*) and against PyTorch's SDPA called once per
sequence.

The strategy draws 1-6 sequences -- or many one-token ones -- whose query and key lengths
(the same or not) include 0 and 1 and the engine's block edges, grouped-query heads, E != Ev,
both dtypes, causal in both alignments, windows, ALiBi slopes (H,) or (n_seq, H), seeded
dropout and custom scales. Each sequence is checked with test_attention's tolerances for the
dense call on it alone (its Case): a sequence is exactly that call. Sequences without
queries or keys must give zeros (and logsumexp -inf) exactly.
"""
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, strategies as st

from closeness import assert_close, f64
from npattn import (dropout_mask, reference, scaled_dot_product_attention_backward,
                    scaled_dot_product_attention_forward, scaled_dot_product_attention_varlen,
                    scaled_dot_product_attention_varlen_backward,
                    scaled_dot_product_attention_varlen_forward)
from npattn.functional.attention import AttentionOptions
from strategies import DTYPES, dtypes, make_values
from test_attention import (ALIGNMENTS, BLOCK_EDGES, Case, OptionFields,
                            assert_bound_is_meaningful, bounds, check, torch_formula,
                            window_sides)

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

SMALL = (0, 1, 2, 3, 5, 8, 17, 31)


@dataclass(repr=False)
class SequenceCase(Case):
    """One sequence of a varlen call as the dense call it is: heads as dim -3, no batch; its
    dropout keep-mask is its part of the varlen mask (``keep_s``), not one of its own seed."""
    keep_s: object = None

    def keep(self):
        return self.keep_s


@dataclass
class VarlenCase(OptionFields):
    """A packed call: its arrays, and AttentionOptions' fields as keywords (attn_mask stays
    None: varlen takes no mask)."""
    query: np.ndarray                   # (total_q, H, E)
    key: np.ndarray                     # (total_k, Hkv, E)
    value: np.ndarray                   # (total_k, Hkv, Ev)
    dout: np.ndarray                    # (total_q, H, Ev)
    cu_q: np.ndarray
    cu_k: np.ndarray

    def __repr__(self):
        return (f"VarlenCase({self.query.dtype}, q {self.query.shape}, k {self.key.shape}, "
                f"v {self.value.shape}, cu_q={self.cu_q.tolist()}, cu_k={self.cu_k.tolist()}, "
                f"dropout_p={self.dropout_p}, seed={self.seed}, causal={self.is_causal}, "
                f"{self.causal_alignment}, scale={self.scale}, gqa={self.enable_gqa}, "
                f"window={self.window}, alibi="
                f"{None if self.alibi_slopes is None else self.alibi_slopes.shape}, "
                f"softcap={self.softcap}, sinks={self.sinks})")

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    @property
    def dtype(self):
        return self.query.dtype

    @property
    def n_seq(self):
        return len(self.cu_q) - 1

    def kwargs(self):
        """The varlen call's keywords: the options but attn_mask."""
        kw = {name: getattr(self, name) for name in AttentionOptions._fields}
        del kw["attn_mask"]
        return kw

    def keep(self):
        """The contract's flat keep-mask: the sequences' (H, L_s, S_s) masks in a row."""
        if self.dropout_p == 0:
            return None
        heads = self.query.shape[1]
        n = heads * int(np.dot(np.diff(self.cu_q), np.diff(self.cu_k)))
        return dropout_mask((n,), self.dropout_p, self.seed)

    def reference_kwargs(self):
        """The reference's keywords: the options in float64, seed replaced by the keep-mask."""
        kw = self.kwargs()
        del kw["seed"]
        return dict(kw, keep=self.keep(),
                    alibi_slopes=None if self.alibi_slopes is None else f64(self.alibi_slopes)[0],
                    sinks=None if self.sinks is None else f64(self.sinks)[0])

    def sequences(self):
        """(rows, keys, SequenceCase) per sequence."""
        keep, heads, base = self.keep(), self.query.shape[1], 0
        for s in range(self.n_seq):
            rows = slice(int(self.cu_q[s]), int(self.cu_q[s + 1]))
            keys = slice(int(self.cu_k[s]), int(self.cu_k[s + 1]))
            L, S = rows.stop - rows.start, keys.stop - keys.start
            keep_s = None if keep is None else keep[base:base + heads * L * S].reshape(heads, L, S)
            base += heads * L * S
            slopes = self.alibi_slopes
            if slopes is not None and slopes.ndim == 2:
                slopes = np.ascontiguousarray(slopes[s])
            t = lambda a: np.ascontiguousarray(a.transpose(1, 0, 2))      # noqa: E731
            yield rows, keys, SequenceCase(
                t(self.query[rows]), t(self.key[keys]), t(self.value[keys]), t(self.dout[rows]),
                **dict(self.kwargs(), alibi_slopes=slopes), keep_s=keep_s)


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


@st.composite
def varlen_cases(draw, dropout=True, many=None):
    dtype = draw(dtypes)
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    heads = kv_heads * group
    E, Ev = draw(st.sampled_from([1, 3, 16, 17, 64])), draw(st.sampled_from([1, 4, 16, 33]))
    many = draw(st.booleans()) if many is None else many
    length = st.one_of(st.sampled_from(SMALL), st.sampled_from(BLOCK_EDGES[:12]),
                       st.integers(0, 300))
    if many:                            # many one-token sequences (a decode batch)
        n_seq = draw(st.integers(8, 40))
        lq = [1] * n_seq
        lk = draw(st.one_of(st.just([1] * n_seq),
                            st.lists(st.integers(0, 9), min_size=n_seq, max_size=n_seq)))
    else:
        n_seq = draw(st.integers(1, 6))
        lq = draw(st.lists(length, min_size=n_seq, max_size=n_seq))
        lk = lq if draw(st.booleans()) else draw(
            st.lists(length, min_size=n_seq, max_size=n_seq))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tq, tk = sum(lq), sum(lk)
    alibi = draw(st.sampled_from(["none", "heads", "sequences"]))
    p = draw(st.sampled_from([0.0, 0.0, 0.3])) if dropout else 0.0
    return VarlenCase(
        make_values(rng, (tq, heads, E), dtype), make_values(rng, (tk, kv_heads, E), dtype),
        make_values(rng, (tk, kv_heads, Ev), dtype), make_values(rng, (tq, heads, Ev), dtype),
        cumulative(lq).astype(draw(st.sampled_from([np.int32, np.int64]))), cumulative(lk),
        dropout_p=p, seed=draw(st.integers(0, 2**32)) if p else None,
        is_causal=draw(st.booleans()), causal_alignment=draw(st.sampled_from(ALIGNMENTS)),
        scale=draw(st.one_of(st.none(), st.floats(-1.0, 1.0).filter(lambda x: abs(x) > 1e-3))),
        enable_gqa=group > 1 or draw(st.booleans()),
        window=draw(st.one_of(st.none(), window_sides(max(lq, default=0), max(lk, default=0)))),
        alibi_slopes=None if alibi == "none" else make_values(
            rng, (heads,) if alibi == "heads" else (n_seq, heads), dtype) * 0.2,
        softcap=draw(st.sampled_from([None, None, 0.5, 20.0])),
        sinks=None if (spread := draw(st.sampled_from([None, None, 1.0, 10.0]))) is None
        else (rng.standard_normal(heads) * spread).astype(dtype))


def assert_empty(rows, keys, out, lse, grads=None, sinks=None):
    """A sequence without queries has nothing; one without keys zeros and lse -inf (with
    sinks: each head's sink)."""
    if keys.stop == keys.start:
        empty_lse = -np.inf if sinks is None else sinks[:, None]
        assert np.all(out[rows] == 0) and np.all(lse[:, rows] == empty_lse)
        if grads is not None:
            assert np.all(grads[0][rows] == 0)


@given(case=varlen_cases())
def test_varlen_forward_and_backward_match_reference(case):
    out, lse = scaled_dot_product_attention_varlen_forward(case.query, case.key, case.value,
                                                           case.cu_q, case.cu_k, **case.kwargs())
    assert out.shape == case.query.shape[:2] + case.value.shape[2:] and out.dtype == case.dtype
    assert lse.shape == case.query.shape[1::-1] and lse.dtype == case.dtype
    grads = scaled_dot_product_attention_varlen_backward(case.dout, case.query, case.key,
                                                         case.value, out, lse, case.cu_q,
                                                         case.cu_k, **case.kwargs())
    assert len(grads) == 3 + (case.sinks is not None)
    for g, x in zip(grads, (case.query, case.key, case.value, case.sinks)):
        assert g.shape == x.shape and g.dtype == case.dtype
    q, k, v, dout = f64(case.query, case.key, case.value, case.dout)
    with np.errstate(invalid="ignore"):
        want_out, want_lse = reference.scaled_dot_product_attention_varlen_forward(
            q, k, v, case.cu_q, case.cu_k, **case.reference_kwargs())
        want_grads = reference.scaled_dot_product_attention_varlen_backward(
            dout, q, k, v, case.cu_q, case.cu_k, **case.reference_kwargs())
    sink_bound = (1, 0.0)
    for rows, keys, seq in case.sequences():
        if rows.stop == rows.start:                       # keys no query sees: exactly 0
            assert np.all(grads[1][keys] == 0) and np.all(grads[2][keys] == 0)
        if rows.stop == rows.start or keys.stop == keys.start:
            assert_empty(rows, keys, out, lse, grads, case.sinks)
            continue
        b = bounds(seq)
        check("output", out[rows].transpose(1, 0, 2), want_out[rows].transpose(1, 0, 2), seq, b)
        check("logsumexp", lse[:, rows], want_lse[:, rows], seq, b)
        assert_bound_is_meaningful("output", want_out[rows].transpose(1, 0, 2), seq, b, 0.5)
        for name, got, want, part in zip(("dquery", "dkey", "dvalue"), grads, want_grads,
                                         (rows, keys, keys)):
            check(name, got[part].transpose(1, 0, 2), want[part].transpose(1, 0, 2), seq, b)
        if case.sinks is not None:
            n, scale = b["dsinks"]
            sink_bound = (max(sink_bound[0], n), sink_bound[1] + scale)
    if case.sinks is not None:                # the sequences' sums, added
        assert_close(grads[3], want_grads[3], dtype=case.dtype, n=sink_bound[0] + case.n_seq,
                     scale=sink_bound[1])


@given(case=varlen_cases(dropout=False))
def test_varlen_matches_torch_per_sequence(torch, case):
    """PyTorch's SDPA and autograd in float64 on each sequence alone, with the causal mask,
    the window and ALiBi as one explicit mask (PyTorch aligns causal top-left only); with
    soft-capping or sinks, their formula in PyTorch (test_attention.torch_formula), the
    sinks' gradient summed over the sequences by autograd."""
    out, lse = scaled_dot_product_attention_varlen_forward(case.query, case.key, case.value,
                                                           case.cu_q, case.cu_k, **case.kwargs())
    grads = scaled_dot_product_attention_varlen_backward(case.dout, case.query, case.key,
                                                         case.value, out, lse, case.cu_q,
                                                         case.cu_k, **case.kwargs())
    tsinks = None if case.sinks is None else torch.tensor(f64(case.sinks)[0],
                                                          requires_grad=True)
    sink_bound = (1, 0.0)
    for rows, keys, seq in case.sequences():
        if rows.stop == rows.start or keys.stop == keys.start:
            assert_empty(rows, keys, out, lse, grads, case.sinks)
            continue
        if case.sinks is not None:
            n, scale = bounds(seq)["dsinks"]
            sink_bound = (max(sink_bound[0], n), sink_bound[1] + scale)
        q, k, v, dout = f64(seq.query, seq.key, seq.value, seq.dout)
        mask = seq.mask_with_visible()
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        tmask = None if mask is None else torch.tensor(mask)
        if case.softcap is not None or case.sinks is not None:
            tout = torch_formula(torch, tq, tk, tv, tmask, seq.scale_value, seq.group,
                                 case.softcap, tsinks)
        else:
            tout = torch.nn.functional.scaled_dot_product_attention(
                tq, tk, tv, attn_mask=tmask, scale=seq.scale, enable_gqa=seq.enable_gqa)
        tout.backward(torch.tensor(dout))
        b = bounds(seq)
        check("output", out[rows].transpose(1, 0, 2), tout.detach().numpy(), seq, b)
        for name, got, t, part in zip(("dquery", "dkey", "dvalue"), grads, (tq, tk, tv),
                                      (rows, keys, keys)):
            want = np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy()
            check(name, got[part].transpose(1, 0, 2), want, seq, b)
    if tsinks is not None:
        want = np.zeros(tsinks.shape) if tsinks.grad is None else tsinks.grad.numpy()
        assert_close(grads[3], want, dtype=case.dtype, n=sink_bound[0] + case.n_seq,
                     scale=sink_bound[1])


def assert_identical(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g, w, equal_nan=True)


def dense_of(packed, n_seq):
    """(n_seq·T, heads, W) packed, equal lengths T -> (n_seq, heads, T, W)."""
    total, heads, width = packed.shape
    return np.ascontiguousarray(packed.reshape(n_seq, total // max(n_seq, 1), heads,
                                               width).transpose(0, 2, 1, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_seq, L, S, options", [
    (1, 37, 300, dict(is_causal=True, causal_alignment="bottom-right")),
    (1, 200, 129, dict(dropout_p=0.4, seed=3, window=(20, 5))),
    (1, 1, 1, {}),
    (3, 64, 130, dict(dropout_p=0.2, seed=11, is_causal=True, alibi_slopes="heads")),
    (4, 129, 17, dict(window=(3, None), causal_alignment="bottom-right")),
])
def test_equal_lengths_are_the_dense_call_bit_for_bit(dtype, n_seq, L, S, options):
    """Sequences of one length are a dense batch: the same bits, forward and backward,
    dropout included (the varlen mask's layout is the dense one's then)."""
    rng = np.random.default_rng(L * S)
    H, Hkv, E, Ev = 4, 2, 24, 40
    q = make_values(rng, (n_seq * L, H, E), dtype)
    k = make_values(rng, (n_seq * S, Hkv, E), dtype)
    v = make_values(rng, (n_seq * S, Hkv, Ev), dtype)
    dout = make_values(rng, (n_seq * L, H, Ev), dtype)
    kw = dict(options, enable_gqa=True)
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = make_values(rng, (H,), dtype)
    cu_q, cu_k = cumulative([L] * n_seq), cumulative([S] * n_seq)
    out, lse = scaled_dot_product_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    grads = scaled_dot_product_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                         **kw)
    dq, dk, dv = (dense_of(a, n_seq) for a in (q, k, v))
    d_out, d_lse = scaled_dot_product_attention_forward(dq, dk, dv, **kw)
    d_grads = scaled_dot_product_attention_backward(dense_of(dout, n_seq), dq, dk, dv, d_out,
                                                    d_lse, **kw)
    assert_identical([dense_of(out, n_seq), dense_of(lse.T[:, :, None], n_seq)[..., 0]],
                     [d_out, d_lse])
    assert_identical([dense_of(g, n_seq) for g in grads], d_grads)
    assert np.array_equal(scaled_dot_product_attention_varlen(q, k, v, cu_q, cu_k, **kw), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequences_never_see_each_other(dtype):
    """Changing one sequence's keys, values or queries changes no other sequence's results."""
    rng = np.random.default_rng(5)
    lq, lk = [30, 0, 140, 1, 9], [50, 4, 131, 0, 9]
    cu_q, cu_k = cumulative(lq), cumulative(lk)
    q, k, v = (make_values(rng, (n, 4, 16), dtype) for n in (sum(lq), sum(lk), sum(lk)))
    kw = dict(is_causal=True, causal_alignment="bottom-right", enable_gqa=False)
    out, lse = scaled_dot_product_attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    k2, v2, q2 = k.copy(), v.copy(), q.copy()
    k2[cu_k[2]:cu_k[3]] *= 3
    v2[cu_k[2]:cu_k[3]] += 1
    q2[cu_q[2]:cu_q[3]] = np.nan
    out2, lse2 = scaled_dot_product_attention_varlen_forward(q2, k2, v2, cu_q, cu_k, **kw)
    other = np.ones(sum(lq), bool)
    other[cu_q[2]:cu_q[3]] = False
    assert np.array_equal(out[other], out2[other]) and np.array_equal(lse[:, other],
                                                                       lse2[:, other])
    first = cu_q[2] + lq[2] - lk[2]                       # bottom-right: 9 rows see nothing
    assert np.all(out2[cu_q[2]:first] == 0) and np.isnan(out2[first:cu_q[3]]).all()
    assert np.all(out[cu_q[3]:cu_q[4]] == 0)               # the sequence without keys


def test_no_sequences_and_empty_totals():
    q = np.zeros((0, 2, 8))
    for cu in ([0], [0, 0, 0]):
        out, lse = scaled_dot_product_attention_varlen_forward(q, q, q, cu, cu)
        assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
        grads = scaled_dot_product_attention_varlen_backward(out, q, q, q, out, lse, cu, cu)
        assert all(g.shape == (0, 2, 8) for g in grads)


# ------------------------------------------------------------------ bad arguments

Q, K, V = np.ones((6, 4, 5)), np.ones((9, 2, 5)), np.ones((9, 2, 7))
CQ, CK = np.array([0, 2, 6]), np.array([0, 4, 9])
OUT, LSE = np.ones((6, 4, 7)), np.ones((4, 6))


def varlen(query=Q, key=K, value=V, cu_q=CQ, cu_k=CK, **kw):
    return scaled_dot_product_attention_varlen_forward(query, key, value, cu_q, cu_k,
                                                       **{"enable_gqa": True, **kw})


def varlen_backward(dout=OUT, output=OUT, logsumexp=LSE, cu_q=CQ, cu_k=CK, **kw):
    return scaled_dot_product_attention_varlen_backward(dout, Q, K, V, output, logsumexp, cu_q,
                                                        cu_k, **{"enable_gqa": True, **kw})


BAD_INPUT = [                               # call, error, a pattern the message must match
    (lambda: varlen(query=Q.astype(np.int64)), TypeError, "query"),
    (lambda: varlen(key=K.astype(np.float32)), TypeError, "key"),
    (lambda: varlen(query=Q[None]), ValueError, r"query.*\(total_q, H, E\)"),
    (lambda: varlen(value=V[0]), ValueError, r"value.*\(total_k, Hkv, Ev\)"),
    (lambda: varlen(key=np.ones((9, 2, 4))), ValueError, "key"),
    (lambda: varlen(value=np.ones((8, 2, 7))), ValueError, "value"),
    (lambda: varlen(key=np.ones((9, 3, 5)), value=np.ones((9, 3, 7))), ValueError, "heads"),
    (lambda: varlen(enable_gqa=False), ValueError, "enable_gqa"),
    (lambda: varlen(cu_q=[0, 2, 6.0]), TypeError, "cu_seqlens_q.*float64"),
    (lambda: varlen(cu_q=np.array([0, 2, 6], np.int16)), TypeError, "cu_seqlens_q.*int16"),
    (lambda: varlen(cu_k=np.array([0, 4, 9], np.uint64)), TypeError, "cu_seqlens_k.*uint64"),
    (lambda: varlen(cu_q=None), TypeError, "cu_seqlens_q"),
    (lambda: varlen(cu_q=np.array([[0, 2, 6]])), ValueError, r"cu_seqlens_q.*1-D.*\(1, 3\)"),
    (lambda: varlen(cu_q=np.array([], np.int64)), ValueError, r"cu_seqlens_q.*\(0,\)"),
    (lambda: varlen(cu_q=[1, 2, 6]), ValueError, "cu_seqlens_q must start at 0; got 1"),
    (lambda: varlen(cu_q=[0, 7, 6]), ValueError,
     "cu_seqlens_q must be non-decreasing.*7 then 6 at positions 1, 2"),
    (lambda: varlen(cu_k=[0, 5, 4, 9]), ValueError, "cu_seqlens_k must be non-decreasing"),
    (lambda: varlen(cu_q=[0, 2, 5]), ValueError, "cu_seqlens_q must end at 6.*got 5"),
    (lambda: varlen(cu_k=[0, 4, 10]), ValueError, "cu_seqlens_k must end at 9.*got 10"),
    (lambda: varlen(cu_k=[0, 9]), ValueError, r"cu_seqlens_k.*\(3,\).*\(2,\)"),
    (lambda: varlen(cu_q=[0, -1, 6]), ValueError, "cu_seqlens_q must be non-decreasing"),
    (lambda: varlen(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes.*\(4,\).*\(2, 4\)"),
    (lambda: varlen(softcap=0.0), ValueError, "softcap.*> 0"),
    (lambda: varlen(softcap="2"), TypeError, "softcap"),
    (lambda: varlen(sinks=np.ones(3)), ValueError, r"sinks.*\(4,\).*\(3,\)"),
    (lambda: varlen(sinks=np.ones((2, 4))), ValueError, "sinks"),
    (lambda: varlen(alibi_slopes=np.ones((3, 4))), ValueError, "alibi_slopes"),
    (lambda: varlen(alibi_slopes=np.ones(4, np.float32)), TypeError, "alibi_slopes"),
    (lambda: varlen(dropout_p=0.5), ValueError, "seed"),
    (lambda: varlen(window=(-1, 2)), ValueError, "window"),
    (lambda: varlen(causal_alignment="bottom"), ValueError, "causal_alignment"),
    (lambda: varlen(scale="x"), TypeError, "scale"),
    (lambda: varlen_backward(dout=np.ones((6, 4, 6))), ValueError, r"dout.*\(6, 4, 7\)"),
    (lambda: varlen_backward(output=OUT.astype(np.float32)), TypeError, "output"),
    (lambda: varlen_backward(logsumexp=np.ones((6, 4))), ValueError, r"logsumexp.*\(4, 6\)"),
    (lambda: varlen_backward(cu_q=[0, 3, 2]), ValueError, "cu_seqlens_q"),
]


@pytest.mark.parametrize("call, error, pattern", BAD_INPUT,
                         ids=[f"{i}" for i in range(len(BAD_INPUT))])
def test_rejects_bad_input(call, error, pattern):
    with pytest.raises(error) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)
