"""scaled_dot_product_attention_with_kv_cache -- the decode path (kernels/decode.py) -- against
the float64 textbook (npattn.reference), PyTorch's SDPA and npattn's own forward engine.

One strategy draws every code path: both dtypes, 0-2 batch dims, grouped-query heads (Hkv = 1
broadcasting too), L = 1..6 new rows, caches of up to ~300 positions with few heads (so that
the keys of a head are cut into several chunks and merged by their logsumexp), cache_length
anywhere it fits, new key/value rows or none, causal or not, custom scales, E != Ev (E = 1
too) and query/key/value in any memory layout. Sometimes the chunk size is forced down
(DECODE_MIN_CHUNK, DECODE_ITEMS), so that many chunks -- some of them empty for a causal row
-- are merged. The caches live inside a larger buffer whose guard entries must never change,
and their dead positions (past the live keys) hold NaN: a kernel reading one would show it.

Tolerances are test_attention.py's (``bounds``: 4·eps·n·(|want| + scale), n the keys plus E,
the scale amplified by the scores' size): the live keys make the same attention problem, so
the same bound holds. Results compared with another approximation (PyTorch's float32, npattn's
forward engine) get twice the bound: each is within it of the truth.
"""
import contextlib
import math
import re
from dataclasses import dataclass, field
from unittest import mock

import numba
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from closeness import f64
from npattn import (reference, scaled_dot_product_attention_forward,
                    scaled_dot_product_attention_with_kv_cache)
from npattn.functional import attention as attention_module
from npattn.kernels.decode import decode_attention_kernel
from strategies import DTYPES, dtypes, layouts, lay_out, make_values
from test_attention import Case as AttentionCase, assert_bound_is_meaningful, bounds, check

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

WIDTHS = st.one_of(st.sampled_from([1, 2, 3, 16, 17, 33, 64]), st.integers(1, 20))   # E, Ev
PAD = 5                                 # guard entries on each side of a cache's buffer
GUARD = -7.25                           # their value: exact in both dtypes


# ------------------------------------------------------------------ one drawn call

def guarded(values, fill_from):
    """A C-contiguous, writeable cache holding ``values`` at positions < ``fill_from`` (dim
    -2) and NaN after them, as a view into a buffer with PAD guard entries on each side.
    Returns (cache, buffer)."""
    size = values.size
    buffer = np.full(size + 2 * PAD, GUARD, values.dtype)
    cache = buffer[PAD:PAD + size].reshape(values.shape)
    cache[...] = values
    cache[..., fill_from:, :] = np.nan                   # dead positions: never read
    assert cache.flags.c_contiguous and cache.flags.writeable
    return cache, buffer


@dataclass
class KVCase:
    """The arguments of one call, the buffers around the caches, and the chunk overrides."""
    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    cache_length: int
    key: object = None
    value: object = None
    is_causal: bool = False
    scale: object = None
    enable_gqa: bool = False
    buffers: list = field(default_factory=list)
    min_chunk: object = None           # DECODE_MIN_CHUNK for this call (None: the default)
    items: object = None               # DECODE_ITEMS likewise
    chunks: int = 0                    # the chunks per head of the last call

    def __repr__(self):                # shapes and options, not pages of numbers
        def describe(a):
            if a is None:
                return "None"
            return (f"{a.dtype}{a.shape} strides={a.strides}"
                    f"{'' if a.flags.writeable else ' readonly'}")
        arrays = ", ".join(f"{n}={describe(getattr(self, n))}"
                           for n in ("query", "key_cache", "value_cache", "key", "value"))
        return (f"KVCase({arrays}, cache_length={self.cache_length}, is_causal="
                f"{self.is_causal}, scale={self.scale!r}, enable_gqa={self.enable_gqa}, "
                f"min_chunk={self.min_chunk}, items={self.items})")

    def _repr_pretty_(self, printer, cycle):   # Hypothesis prints this
        printer.text(repr(self))

    @property
    def dtype(self):
        return self.query.dtype

    @property
    def n_keys(self):
        """The live keys after the write."""
        return self.cache_length + (0 if self.key is None else self.query.shape[-2])

    def kwargs(self):
        return dict(is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa)

    def snapshot(self):
        """Copies of the caches and their buffers, before the call writes into them."""
        return [a.copy() for a in (self.key_cache, self.value_cache, *self.buffers)]

    def call(self):
        with contextlib.ExitStack() as stack:
            if self.min_chunk is not None:
                stack.enter_context(mock.patch.object(attention_module, "DECODE_MIN_CHUNK",
                                                      self.min_chunk))
            if self.items is not None:
                stack.enter_context(mock.patch.object(attention_module, "DECODE_ITEMS",
                                                      self.items))
            heads = math.prod(self.query.shape[:-2])
            self.chunks = -(-self.n_keys // attention_module.decode_chunk(heads, self.n_keys))
            return scaled_dot_product_attention_with_kv_cache(
                self.query, self.key_cache, self.value_cache, self.cache_length, self.key,
                self.value, **self.kwargs())

    def reference(self, before, as_f64=True):
        """(output, logsumexp, key_cache', value_cache') of the textbook, from the caches as
        they were before the call; in float64, or in the case's dtype (for the caches)."""
        kc, vc = before[:2]
        arrays = (self.query, kc, vc, self.key, self.value)
        q, kc, vc, k, v = f64(*arrays) if as_f64 else [
            None if a is None else a.copy() for a in arrays]
        with np.errstate(all="ignore"):
            return reference.scaled_dot_product_attention_with_kv_cache(
                q, kc, vc, self.cache_length, k, v, **self.kwargs())

    def attention_case(self, key_cache, value_cache):
        """The same problem as test_attention's Case: query against the live keys, aligned
        bottom-right -- what its ``bounds`` take."""
        n = self.n_keys
        out_shape = self.query.shape[:-1] + (value_cache.shape[-1],)
        return AttentionCase(self.query, key_cache[..., :n, :], value_cache[..., :n, :],
                             np.zeros(out_shape, self.dtype), is_causal=self.is_causal,
                             causal_alignment="bottom-right", scale=self.scale,
                             enable_gqa=self.enable_gqa)


@st.composite
def kv_cases(draw, kinds=("normal", "wide"), chunks=True):
    """One call of scaled_dot_product_attention_with_kv_cache, every argument drawn."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(dtypes)
    L = draw(st.one_of(st.just(1), st.integers(1, 6)))
    new = draw(st.booleans())                            # key and value given
    if draw(st.sampled_from(["small", "long"])) == "small":
        ndim = draw(st.sampled_from([0, 1, 2]))
        batch = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(ndim))
        hkv, group = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3]))
        room = draw(st.integers(0, 24))
    else:                                # few heads, many keys: several chunks per head
        ndim = draw(st.sampled_from([0, 1]))
        batch = tuple(draw(st.sampled_from([1, 2])) for _ in range(ndim))
        hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
        room = draw(st.integers(65, 300))
    if batch and draw(st.integers(0, 19)) == 0:
        batch = (0,) + batch[1:]                         # an empty batch
    smax = room + (L if new else 0)
    cache_length = draw(st.one_of(st.just(0), st.just(room), st.integers(0, room),
                                  st.integers(0, room)))
    E, Ev = draw(WIDTHS), draw(WIDTHS)
    H = hkv * group
    enable_gqa = (group > 1 and hkv > 1) or draw(st.booleans())
    q_kind = draw(st.sampled_from(kinds))
    k_kinds = kinds
    if dtype == np.float32 and q_kind == "wide":     # as test_attention's sdpa_cases: no
        k_kinds = tuple(k for k in kinds if k != "wide") or ("normal",)   # meaningful bound
    k_kind, v_kind = draw(st.sampled_from(k_kinds)), draw(st.sampled_from(kinds))

    def array(shape, kind):
        return lay_out(make_values(rng, shape, dtype, kind), draw(layouts), rng)

    key_cache, kbuf = guarded(make_values(rng, batch + (hkv, smax, E), dtype, k_kind),
                              cache_length)
    value_cache, vbuf = guarded(make_values(rng, batch + (hkv, smax, Ev), dtype, v_kind),
                                cache_length)
    case = KVCase(array(batch + (H, L, E), q_kind), key_cache, value_cache, cache_length,
                  buffers=[kbuf, vbuf], enable_gqa=enable_gqa)
    if new:
        case.key = array(batch + (hkv, L, E), k_kind)
        case.value = array(batch + (hkv, L, Ev), v_kind)
    case.is_causal = draw(st.booleans())
    factor = draw(st.none() | st.floats(-2.0, 2.0))
    case.scale = None if factor is None else factor / math.sqrt(E)
    if chunks and draw(st.integers(0, 3)) == 0:         # small chunks: many of them
        case.min_chunk = draw(st.sampled_from([1, 2, 5, 16]))
        case.items = draw(st.sampled_from([8, 64]))
    return case


def doubled(b):
    """A bound for the difference of two results that are each within ``b`` of the truth."""
    return {name: (2 * n, scale) for name, (n, scale) in b.items()}


def assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.tobytes() == want.tobytes(), \
        f"{what}: {np.sum(got.view(np.uint8) != want.view(np.uint8))} bytes differ"


# ------------------------------------------------------------------ against the textbook

@settings(max_examples=200)
@given(case=kv_cases())
def test_matches_reference_and_writes_only_the_new_rows(case):
    before = case.snapshot()
    out, lse = case.call()
    event(f"chunks per head: {'0-1' if case.chunks <= 1 else '2-9' if case.chunks < 10 else '10+'}"
          f"{' (forced small)' if case.min_chunk else ''}")
    event(f"new rows: {case.key is not None}, causal: {case.is_causal}")
    want_out, want_lse, _, _ = case.reference(before)
    _, _, want_kc, want_vc = case.reference(before, as_f64=False)
    # the caches: exactly the reference's (the new rows at cache_length, nothing else)
    assert_same_bits(case.key_cache, want_kc, "key_cache")
    assert_same_bits(case.value_cache, want_vc, "value_cache")
    n = case.n_keys
    assert_same_bits(case.key_cache[..., n:, :], before[0][..., n:, :], "key_cache past n")
    assert_same_bits(case.value_cache[..., :case.cache_length, :],
                     before[1][..., :case.cache_length, :], "value_cache before cache_length")
    for buffer, old in zip(case.buffers, before[2:]):     # the guards around the caches
        assert_same_bits(buffer[:PAD], old[:PAD], "guard before a cache")
        assert_same_bits(buffer[-PAD:], old[-PAD:], "guard after a cache")
    # output and logsumexp
    H, L, Ev = case.query.shape[-3], case.query.shape[-2], case.value_cache.shape[-1]
    assert out.shape == case.query.shape[:-3] + (H, L, Ev) and out.dtype == case.dtype
    assert lse.shape == case.query.shape[:-3] + (H, L) and lse.dtype == case.dtype
    ac = case.attention_case(want_kc, want_vc)
    b = bounds(ac)
    assert_bound_is_meaningful("output", want_out, ac, b)
    check("output", out, want_out, ac, b)
    check("logsumexp", lse, want_lse, ac, b)


@settings(max_examples=100)
@given(case=kv_cases())
def test_matches_npattn_forward_on_the_live_keys(case):
    """The docstring's promise: scaled_dot_product_attention_forward(query, key_cache[..., :n,
    :], value_cache[..., :n, :], causal_alignment="bottom-right"), to rounding."""
    before = case.snapshot()
    out, lse = case.call()
    n = case.n_keys
    fwd_out, fwd_lse = scaled_dot_product_attention_forward(
        case.query, case.key_cache[..., :n, :], case.value_cache[..., :n, :],
        causal_alignment="bottom-right", **case.kwargs())
    ac = case.attention_case(*case.reference(before, as_f64=False)[2:])
    b = doubled(bounds(ac))
    check("output", out, f64(fwd_out)[0], ac, b)
    check("logsumexp", lse, f64(fwd_lse)[0], ac, b)


# ------------------------------------------------------------------ against PyTorch

@settings(max_examples=100)
@given(case=kv_cases())
def test_matches_torch(torch, case):
    """torch.nn.functional.scaled_dot_product_attention on the live keys, with the bottom-right
    causal rule as an explicit bool mask (tril(ones(L, n), diagonal=n - L)) and GQA, in float64
    (the case's bound) and in the case's dtype (twice the bound)."""
    before = case.snapshot()
    out, _ = case.call()
    n, L = case.n_keys, case.query.shape[-2]
    q = np.ascontiguousarray(case.query)
    k = np.ascontiguousarray(case.key_cache[..., :n, :])
    v = np.ascontiguousarray(case.value_cache[..., :n, :])
    mask = (torch.tril(torch.ones(L, n, dtype=torch.bool), diagonal=n - L)
            if case.is_causal else None)
    gqa = q.shape[-3] != k.shape[-3]
    ac = case.attention_case(*case.reference(before, as_f64=False)[2:])
    b = bounds(ac)
    for dtype in sorted({np.dtype(np.float64), case.dtype}, key=str):
        tq, tk, tv = (torch.from_numpy(a.astype(dtype)) for a in (q, k, v))
        tout = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, scale=case.scale, enable_gqa=gqa)
        check("output", out, tout.numpy().astype(np.float64), ac,
              b if dtype == np.float64 else doubled(b))


# ------------------------------------------------------------------ edge cases, one by one

def make_case(dtype, batch, H, hkv, L, smax, cache_length, E, Ev, new, seed=0, **kw):
    """A KVCase of ordinary values (dead cache positions NaN)."""
    rng = np.random.default_rng(seed)
    kc, kbuf = guarded(make_values(rng, batch + (hkv, smax, E), dtype), cache_length)
    vc, vbuf = guarded(make_values(rng, batch + (hkv, smax, Ev), dtype), cache_length)
    case = KVCase(make_values(rng, batch + (H, L, E), dtype), kc, vc, cache_length,
                  buffers=[kbuf, vbuf], enable_gqa=H != hkv, **kw)
    if new:
        case.key = make_values(rng, batch + (hkv, L, E), dtype)
        case.value = make_values(rng, batch + (hkv, L, Ev), dtype)
    return case


def check_against_reference(case, out, lse, before, amplify=True):
    want_out, want_lse, want_kc, want_vc = case.reference(before)
    ac = case.attention_case(*case.reference(before, as_f64=False)[2:])
    b = bounds(ac, amplify=amplify)
    check("output", out, want_out, ac, b)
    check("logsumexp", lse, want_lse, ac, b)
    return want_out, want_lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("smax", [0, 5, 200])
def test_no_live_keys_gives_zeros_and_minus_inf(dtype, is_causal, smax):
    case = make_case(dtype, (2,), 3, 3, 4, smax, 0, 5, 3, new=False, is_causal=is_causal)
    before = case.snapshot()
    out, lse = case.call()
    assert out.shape == (2, 3, 4, 3) and lse.shape == (2, 3, 4)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    assert_same_bits(case.key_cache, before[0], "key_cache")
    assert_same_bits(case.value_cache, before[1], "value_cache")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key(dtype):
    """Causal, no new rows, cache_length < L: row i is at position cache_length - L + i, and
    the first L - cache_length rows see no key: output 0, logsumexp -inf, as the forward
    engine gives a fully masked row."""
    for smax in (2, 150):
        case = make_case(dtype, (2,), 4, 2, 5, smax, 2, 6, 3, new=False, is_causal=True)
        before = case.snapshot()
        out, lse = case.call()
        assert np.all(out[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
        assert np.all(np.isfinite(out[:, :, 3:])) and np.all(np.isfinite(lse[:, :, 3:]))
        check_against_reference(case, out, lse, before)
        case.is_causal = False                           # every row sees both keys
        out, lse = case.call()
        assert np.all(np.isfinite(lse))
        check_against_reference(case, out, lse, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunk_that_a_row_sees_nothing_of(dtype):
    """n = 129 keys of one head: chunks [0, 64), [64, 128), [128, 129). Causal with L = 6 new
    rows: rows 0..4 see none of the last chunk (its partial result is empty and must weigh 0
    in the merge), row 5 sees all of it."""
    assert attention_module.decode_chunk(1, 129) == 64
    case = make_case(dtype, (), 1, 1, 6, 140, 123, 8, 5, new=True, is_causal=True)
    before = case.snapshot()
    out, lse = case.call()
    check_against_reference(case, out, lse, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_visible_key_gives_that_value_row_exactly(dtype):
    """One key in sight: weight exactly 1, output exactly that value row (also through the
    merge of several chunks, whose others are empty for the row)."""
    # one live key, not causal
    case = make_case(dtype, (2,), 4, 2, 1, 9, 0, 5, 3, new=True)
    before = case.snapshot()
    out, lse = case.call()
    np.testing.assert_array_equal(out, np.repeat(case.value, 2, axis=1))
    check_against_reference(case, out, lse, before)
    # causal from an empty cache: row 0 sees key 0 only; several chunks (min chunk 1)
    for min_chunk in (None, 1):
        case = make_case(dtype, (), 3, 1, 4, 4, 0, 7, 6, new=True, is_causal=True,
                         min_chunk=min_chunk)
        before = case.snapshot()
        out, lse = case.call()
        np.testing.assert_array_equal(out[:, 0], np.broadcast_to(case.value[:, 0], (3, 6)))
        check_against_reference(case, out, lse, before)
    # causal, cache_length 0 in a cache of 200 positions: row 0 of 3 sees key 0 only
    case = make_case(dtype, (1,), 1, 1, 3, 200, 0, 4, 2, new=True, is_causal=True)
    before = case.snapshot()
    out, lse = case.call()
    np.testing.assert_array_equal(out[0, 0, 0], case.value[0, 0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("how", ["huge q·k", "huge scale"])
def test_huge_logits_stay_finite_and_exact(dtype, heads, how):
    """Scores of ±1e30 over 200 keys -- with 1 head, five chunks whose maxima are 1e28 apart
    (merge factors 0 or 1); with 8 heads one chunk. The scores of a row differ by far more
    than their rounding: the weights are one-hot and the output is exactly a value row."""
    rng = np.random.default_rng(12)
    B, L, S, E, Ev = 1, 3, 200, 3, 4
    case = make_case(dtype, (B,), heads, heads, L, S + 10, S - L, E, Ev, new=True, seed=12)
    q, kc = f64(case.query, case.key_cache)
    k = f64(case.key)[0]
    sign = rng.choice([-1.0, 1.0], (B, heads, L))
    t = rng.permuted(np.tile(np.arange(1, S + 1) * 0.1, (B, heads, 1)), axis=-1)   # distinct
    t *= rng.choice([-1.0, 1.0], (B, heads, S))
    if how == "huge q·k":
        q[..., 0] = sign * rng.uniform(0.5, 1.5, (B, heads, L)) * 1e15
        big, case.scale = 1e15, 1.0
    else:
        q[..., 0] = sign
        big, case.scale = 1.0, 1e30
    q[..., 1:] = 0.0
    kc[..., :S - L, 0] = t[..., :S - L] * big
    k[..., 0] = t[..., S - L:] * big
    case.query[...] = q
    case.key_cache[..., :S - L, 0] = kc[..., :S - L, 0]
    case.key[...] = k
    before = case.snapshot()
    out, lse = case.call()
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(lse).max() > 1e28
    want_out, _ = check_against_reference(case, out, lse, before, amplify=False)
    np.testing.assert_array_equal(out, want_out.astype(dtype))      # exactly one value row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keys", ["first chunk", "all"])
def test_minus_inf_scores_weigh_nothing(dtype, keys):
    """Scores of -inf (an infinite key entry, q > 0 there): as a masked key, weight 0 -- also
    where a whole chunk's scores are -inf (its partial result must be empty, not NaN from
    exp(-inf - -inf)); where every key's score is -inf, output 0 and logsumexp -inf."""
    L, S, E = 3, 200, 6
    case = make_case(dtype, (), 1, 1, L, S + 10, S - L, E, 4, new=True, seed=8)
    assert -(-S // attention_module.decode_chunk(1, S)) == 4
    case.query[..., 0] = 1.0 + np.abs(case.query[..., 0])
    stop = 64 if keys == "first chunk" else S - L
    case.key_cache[..., :stop, 0] = -np.inf
    if keys == "all":
        case.key[..., 0] = -np.inf
    before = case.snapshot()
    out, lse = case.call()
    want_out, want_lse = case.reference(before)[:2]
    if keys == "all":
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    finite_kc = np.where(np.isinf(case.key_cache), 0.0, case.key_cache).astype(dtype)
    ac = case.attention_case(finite_kc, case.value_cache)  # (bounds need finite terms)
    b = bounds(ac)
    check("output", out, want_out, ac, b)
    check("logsumexp", lse, want_lse, ac, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("where", ["new key", "cached key", "last chunk", "query", "value"])
def test_nan_reaches_only_the_rows_that_see_it(dtype, is_causal, where):
    """A NaN key reaches the query heads of its kv head that see it, in its batch, and nothing
    else; a causal row that does not see it stays finite -- also when it sits in a chunk the
    row sees part of. NaN in a query row stays in that row; NaN in a value entry reaches the
    rows that see it (the reference says where, NaN exactly where it has NaN)."""
    if where == "last chunk":                            # one head: 3 chunks, NaN in the last
        case = make_case(dtype, (), 1, 1, 5, 140, 125, 6, 4, new=True, is_causal=is_causal)
        case.key[0, 4, 2] = np.nan          # position 129: row 4 sees it, row 3 sees 128 only
        rows = [4] if is_causal else list(range(5))
    else:
        case = make_case(dtype, (2,), 4, 2, 4, 120, 100, 6, 4, new=True, is_causal=is_causal)
        rows = [2, 3] if is_causal else list(range(4))
        if where == "new key":
            case.key[1, 0, 2, 1] = np.nan                # position 102 of batch 1, kv head 0
        elif where == "cached key":
            case.key_cache[1, 0, 5, 1] = np.nan          # position 5: every row sees it
            rows = list(range(4))
        elif where == "query":
            case.query[1, 0, 2, 3] = np.nan
        else:
            case.value[1, 0, 2, 0] = np.nan
    before = case.snapshot()
    out, lse = case.call()
    expected = np.zeros(out.shape, bool)                 # where the output is NaN
    if where == "last chunk":
        expected[0, rows] = True
    elif where == "query":
        expected[1, 0, 2] = True
    elif where == "value":
        expected[1, :2, rows, 0] = True                  # that column of the rows that see it
    else:
        expected[1, :2, rows] = True                     # kv head 0 serves query heads 0, 1
    np.testing.assert_array_equal(np.isnan(out), expected)
    np.testing.assert_array_equal(np.isnan(lse), expected.any(-1) if where != "value" else
                                  np.zeros(lse.shape, bool))     # lse reads no value
    if where == "value":
        # the textbook multiplies the hidden NaN by a weight of 0 (NaN, as PyTorch's math
        # path); the kernel never reads it. Compare the rest with that entry at 0.
        clean = case.value.copy()
        clean[1, 0, 2, 0] = 0.0
        case.value = clean
        want_out, want_lse = case.reference(before)[:2]
        want_out[expected] = np.nan
        ac = case.attention_case(*case.reference(before, as_f64=False)[2:])
        b = bounds(ac)
        check("output", out, want_out, ac, b)
        check("logsumexp", lse, want_lse, ac, b)
    else:
        want_out, _ = check_against_reference(case, out, lse, before)   # NaN where it is
        assert np.isnan(want_out).any()


def run_both(case):
    out, lse = case.call()
    return out.copy(), lse.copy()


def determinism_cases():
    """Several chunks (1 head of 300 keys, GQA over 2 query heads) and one chunk (8 heads)."""
    return [make_case(np.float32, (1,), 2, 1, 3, 310, 297, 24, 20, new=True, seed=3,
                      is_causal=True, scale=0.3),
            make_case(np.float64, (2,), 4, 4, 1, 310, 299, 16, 8, new=True, seed=4),
            make_case(np.float32, (), 1, 1, 6, 300, 250, 5, 7, new=False, seed=5,
                      is_causal=True, min_chunk=1, items=64)]


def test_same_bits_at_any_thread_count():
    """The chunk split depends on the shapes only, never on the thread count: the same bits
    on 1 and 2 threads (and again on the thread count in force)."""
    threads = numba.get_num_threads()
    results = {}
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), threads}):
            numba.set_num_threads(n)
            results[n] = [run_both(c) for c in determinism_cases()]
    finally:
        numba.set_num_threads(threads)
    first = results[1]
    for n, got in results.items():
        for (o, l), (wo, wl) in zip(got, first):
            assert_same_bits(o, wo, f"output on {n} threads")
            assert_same_bits(l, wl, f"logsumexp on {n} threads")


@pytest.mark.parametrize("layout", ["fortran", "transposed", "sliced", "negative", "readonly"])
def test_layout_does_not_change_the_bits(layout):
    rng = np.random.default_rng(6)
    for case in determinism_cases():
        want = run_both(case)              # (the second call writes the same rows again)
        case.query = lay_out(case.query, layout, rng)
        if case.key is not None:
            case.key, case.value = (lay_out(a, layout, rng) for a in (case.key, case.value))
        for got, w in zip(run_both(case), want):
            assert_same_bits(got, w, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_chunk_or_several_agree_to_rounding(dtype, is_causal):
    """The same rows through one chunk per head and through many: each within the bound of the
    textbook. Through the public op (8 heads make 8 work items and no split, 1 head is cut into
    64-key chunks) and through the kernel itself with chunks of 1, 2, 7, 64 and n keys; any
    chunk of n keys or more is the single-chunk arithmetic, bit for bit."""
    rng = np.random.default_rng(7)
    L, n, E, Ev = 4, 300, 12, 10
    q = make_values(rng, (1, 8, L, E), dtype)
    kc = make_values(rng, (1, 8, n, E), dtype)
    vc = make_values(rng, (1, 8, n, Ev), dtype)
    assert attention_module.decode_chunk(8, n) == n
    assert attention_module.decode_chunk(1, n) == 64
    many = KVCase(q, kc.copy(), vc.copy(), n, is_causal=is_causal)
    before = many.snapshot()
    out8, lse8 = many.call()
    want_out, want_lse = check_against_reference(many, out8, lse8, before)
    ac = many.attention_case(kc, vc)
    b = bounds(ac)
    for h in range(8):                                   # each head alone: 5 chunks
        one = KVCase(q[:, h:h + 1].copy(), kc[:, h:h + 1].copy(), vc[:, h:h + 1].copy(), n,
                     is_causal=is_causal)
        out1, lse1 = one.call()
        sub = many.attention_case(kc, vc)
        sub.query, sub.key, sub.value = one.query, one.key_cache, one.value_cache
        sub.dout = sub.dout[:, h:h + 1]
        bh = bounds(sub)
        check("output", out1, want_out[:, h:h + 1], sub, bh)
        check("logsumexp", lse1, want_lse[:, h:h + 1], sub, bh)
        check("output", out1, f64(out8[:, h:h + 1])[0], sub, doubled(bh))
    scale = 1.0 / math.sqrt(E)
    single = None
    for chunk in (1, 2, 7, 64, n, n + 5):
        n_chunks = -(-n // chunk)
        out = np.empty((1, 8, L, Ev), dtype)
        stats = np.empty((1, 8, L, 3), dtype)
        parts = np.empty((1, 8, n_chunks, L, Ev + 2), dtype)
        decode_attention_kernel(q, kc, vc, n, is_causal, scale, chunk, out, stats, parts)
        check("output", out, want_out, ac, b)
        check("logsumexp", stats[..., 0], want_lse, ac, b)
        if chunk >= n:
            single = single or (out.copy(), stats[..., 0].copy())
            assert_same_bits(out, single[0], f"chunk {chunk}")
            assert_same_bits(stats[..., 0], single[1], f"chunk {chunk}")
            assert_same_bits(out, out8, "the public op's single chunk")
            assert_same_bits(stats[..., 0], lse8, "the public op's single chunk")


def test_accepts_lists_numpy_ints_and_a_broadcast_kv_head():
    """cache_length as a NumPy int, query/key/value as nested lists (float64), one kv head for
    several query heads without enable_gqa (it broadcasts, as in scaled_dot_product_attention)."""
    case = make_case(np.float64, (2,), 3, 1, 2, 12, 6, 4, 5, new=True, is_causal=True)
    case.enable_gqa = False
    before = case.snapshot()
    want = run_both(case)
    check_against_reference(case, *want, before)
    kc, vc = before[0].copy(), before[1].copy()
    got = scaled_dot_product_attention_with_kv_cache(
        case.query.tolist(), kc, vc, np.int8(6), case.key.tolist(), case.value.tolist(),
        is_causal=np.bool_(True), scale=None)
    for g, w in zip(got, want):
        assert_same_bits(g, w, "lists and NumPy scalars")
    assert_same_bits(kc, case.key_cache, "key_cache")
    assert_same_bits(vc, case.value_cache, "value_cache")


# ------------------------------------------------------------------ bad input

Q = np.ones((2, 4, 3, 5))                   # (B, H, L, E)
KC, VC = np.zeros((2, 2, 10, 5)), np.zeros((2, 2, 10, 7))   # (B, Hkv, Smax, E / Ev)
K, V = np.ones((2, 2, 3, 5)), np.ones((2, 2, 3, 7))         # (B, Hkv, L, E / Ev)
SAME = np.zeros((2, 2, 10, 5))              # one array passed as both caches
WIDE = np.zeros((2, 2, 10, 12))             # its last dim cut into the two caches


def read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def strided(a):
    """A non-contiguous view holding a's values (every other position of dim -2)."""
    base = np.zeros(a.shape[:-2] + (2 * a.shape[-2], a.shape[-1]), a.dtype)
    view = base[..., ::2, :]
    view[...] = a
    return view


BAD_INPUT = [                 # the arguments changed, the error, the words of the message
    (lambda: dict(query=Q.astype(np.int64)), TypeError, "query"),
    (lambda: dict(query=Q.astype(np.float16)), TypeError, "query"),
    (lambda: dict(query=None), TypeError, "query"),
    (lambda: dict(query=np.ones((3, 5))), ValueError, "query"),
    (lambda: dict(query=Q.astype(np.float32)), TypeError, "key_cache.*query"),
    (lambda: dict(key_cache=KC.tolist()), TypeError, "key_cache.*NumPy array"),
    (lambda: dict(value_cache=VC.tolist()), TypeError, "value_cache.*NumPy array"),
    (lambda: dict(key_cache=None), TypeError, "key_cache"),
    (lambda: dict(key_cache=KC.astype(np.int64)), TypeError, "key_cache"),
    (lambda: dict(value_cache=VC.astype(np.complex128)), TypeError, "value_cache"),
    (lambda: dict(key_cache=KC.astype(np.float32)), TypeError, "key_cache.*float64"),
    (lambda: dict(value_cache=VC.astype(np.float32)), TypeError, "value_cache.*float64"),
    (lambda: dict(key_cache=read_only(KC)), ValueError, "key_cache.*read-only"),
    (lambda: dict(value_cache=read_only(VC)), ValueError, "value_cache.*read-only"),
    (lambda: dict(key_cache=np.asfortranarray(KC)), ValueError, "key_cache.*C-contiguous"),
    (lambda: dict(key_cache=strided(KC)), ValueError, "key_cache.*C-contiguous"),
    (lambda: dict(value_cache=strided(VC)), ValueError, "value_cache.*C-contiguous"),
    (lambda: dict(key_cache=np.zeros((3, 2, 10, 5))), ValueError, "key_cache"),   # batch
    (lambda: dict(key_cache=np.zeros((2, 10, 5))), ValueError, "key_cache"),      # no batch
    (lambda: dict(key_cache=np.zeros((1, 2, 2, 10, 5))), ValueError, "key_cache"),
    (lambda: dict(value_cache=np.zeros((3, 2, 10, 7))), ValueError, "value_cache"),
    (lambda: dict(key_cache=np.zeros((2, 2, 10, 4))), ValueError, "key_cache"),   # E 4 vs 5
    (lambda: dict(value_cache=np.zeros((2, 1, 10, 7))), ValueError, "value_cache"),  # Hkv
    (lambda: dict(value_cache=np.zeros((2, 2, 9, 7))), ValueError, "value_cache"),   # Smax
    (lambda: dict(key_cache=np.zeros((2, 3, 10, 5)), value_cache=np.zeros((2, 3, 10, 7)),
                  key=None, value=None), ValueError, "query.*multiple"),        # 4 % 3
    (lambda: dict(key_cache=np.zeros((2, 0, 10, 5)), value_cache=np.zeros((2, 0, 10, 7)),
                  key=None, value=None), ValueError, "query.*multiple"),        # Hkv = 0
    (lambda: dict(enable_gqa=False), ValueError, "enable_gqa"),                 # 4 vs 2 heads
    (lambda: dict(enable_gqa=1), TypeError, "enable_gqa"),
    (lambda: dict(value=None), ValueError, "key and value"),
    (lambda: dict(key=None), ValueError, "key and value"),
    (lambda: dict(cache_length=-1), ValueError, "cache_length"),
    (lambda: dict(cache_length=8), ValueError, r"cache_length.*\[0, 7\]"),      # 8 + 3 > 10
    (lambda: dict(cache_length=11, key=None, value=None), ValueError,
     r"cache_length.*\[0, 10\]"),
    (lambda: dict(cache_length=2**70), ValueError, "cache_length"),
    (lambda: dict(cache_length=4.0), TypeError, "cache_length"),
    (lambda: dict(cache_length=np.float64(4)), TypeError, "cache_length"),
    (lambda: dict(cache_length=True), TypeError, "cache_length"),
    (lambda: dict(cache_length=np.bool_(True)), TypeError, "cache_length"),
    (lambda: dict(cache_length="4"), TypeError, "cache_length"),
    (lambda: dict(cache_length=None), TypeError, "cache_length"),
    (lambda: dict(key=np.ones((2, 2, 4, 5))), ValueError, "key"),               # L 4 vs 3
    (lambda: dict(key=np.ones((2, 2, 3, 4))), ValueError, "key"),               # E 4 vs 5
    (lambda: dict(key=np.ones((2, 4, 3, 5))), ValueError, "key"),               # Hkv 4 vs 2
    (lambda: dict(key=np.ones((3, 5))), ValueError, "key"),
    (lambda: dict(value=np.ones((2, 2, 3, 6))), ValueError, "value"),           # Ev 6 vs 7
    (lambda: dict(value=np.ones((2, 2, 2, 7))), ValueError, "value"),           # L 2 vs 3
    (lambda: dict(key=K.astype(np.int32)), TypeError, "key"),
    (lambda: dict(key=K.astype(np.float32)), TypeError, "key.*float64"),
    (lambda: dict(value=V.astype(np.float32)), TypeError, "value.*float64"),
    (lambda: dict(key=[[1.0], [1.0, 2.0]]), TypeError, "key"),                  # ragged
    (lambda: dict(scale="1"), TypeError, "scale"),
    (lambda: dict(scale=True), TypeError, "scale"),
    (lambda: dict(scale=1j), TypeError, "scale"),
    (lambda: dict(is_causal=1), TypeError, "is_causal"),
    (lambda: dict(is_causal=None), TypeError, "is_causal"),
    (lambda: dict(key_cache=SAME, value_cache=SAME), ValueError,               # E = Ev: one
     "key_cache and value_cache.*separate"),                                   # array for both
    (lambda: dict(key_cache=WIDE[..., :5], value_cache=WIDE[..., 5:]), ValueError,
     "C-contiguous"),                                                          # halves of one
]


@pytest.mark.parametrize("change, error, words", BAD_INPUT,
                         ids=[f"{i}-{words.split('.')[0].split(' ')[0]}" for i, (_, _, words)
                              in enumerate(BAD_INPUT)])
def test_rejects_bad_input_and_leaves_the_caches_alone(change, error, words):
    args = dict(query=Q, key_cache=KC.copy(), value_cache=VC.copy(), cache_length=4, key=K,
                value=V, is_causal=True, enable_gqa=True)
    args.update(change())
    before = {n: np.array(args[n], copy=True) for n in ("key_cache", "value_cache")
              if isinstance(args[n], np.ndarray)}
    with pytest.raises(error) as info:
        scaled_dot_product_attention_with_kv_cache(**args)
    assert re.search(words, str(info.value)), str(info.value)
    for name, old in before.items():
        assert np.array_equal(args[name], old), f"{name} written by a call that raised"


def test_the_bad_input_base_call_is_valid():
    """The arguments BAD_INPUT changes one at a time are valid as they are."""
    kc, vc = KC.copy(), VC.copy()
    out, lse = scaled_dot_product_attention_with_kv_cache(Q, kc, vc, 4, K, V, is_causal=True,
                                                          enable_gqa=True)
    assert out.shape == (2, 4, 3, 7) and lse.shape == (2, 4, 3)
    assert np.all(kc[..., 4:7, :] == 1) and np.all(kc[..., 7:, :] == 0)
    assert np.all(vc[..., :4, :] == 0) and np.all(vc[..., 4:7, :] == 1)


PERTURBATIONS = ("none", "dtype", "shape", "strided", "readonly", "shared", "length",
                 "length_type", "flag_type", "scale_type", "rank", "no_new")


@st.composite
def checked_calls(draw):
    """The arguments a decoded token passes kv_cache_args (4-D, C-contiguous, one dtype, new
    keys and values, an int cache_length that fits), with one thing changed or not."""
    dtype = draw(dtypes)
    b, h, n, e, ev = (draw(st.integers(1, 3)) for _ in range(5))
    smax = draw(st.integers(n, n + 6))
    arrays = {"query": (b, h, n, e), "key_cache": (b, h, smax, e), "value_cache": (b, h, smax, ev),
              "key": (b, h, n, e), "value": (b, h, n, ev)}
    args = {name: np.zeros(shape, dtype) for name, shape in arrays.items()}
    args["cache_length"] = draw(st.integers(0, smax - n))
    options = {"is_causal": draw(st.booleans()), "scale": draw(st.none() | st.just(0.5)),
               "enable_gqa": draw(st.booleans())}
    change = draw(st.sampled_from(PERTURBATIONS))
    name = draw(st.sampled_from(sorted(arrays)))
    if change == "dtype":
        args[name] = args[name].astype(np.float64 if dtype == np.float32 else np.float32)
    elif change == "shape":
        shape = list(arrays[name])
        shape[draw(st.integers(0, 3))] += 1
        args[name] = np.zeros(shape, dtype)
    elif change == "strided":
        args[name] = np.zeros(arrays[name][:-1] + (2 * arrays[name][-1],), dtype)[..., ::2]
    elif change == "readonly":
        args[name].setflags(write=False)
    elif change == "shared":
        args["value_cache"] = args["key_cache"] if e == ev else args["key_cache"][..., :ev]
    elif change == "length":
        args["cache_length"] = draw(st.sampled_from([-1, smax - n + 1]))
    elif change == "length_type":
        args["cache_length"] = draw(st.sampled_from([np.int64, float]))(args["cache_length"])
    elif change == "flag_type":
        options[draw(st.sampled_from(["is_causal", "enable_gqa"]))] = np.bool_(True)
    elif change == "scale_type":
        options["scale"] = draw(st.sampled_from([2, np.float32(0.5), np.float64(0.5)]))
    elif change == "rank":
        args[name] = args[name][None]
    elif change == "no_new":
        args["key"] = args["value"] = None
    return args, options, change


@settings(max_examples=1000, deadline=None)
@given(call=checked_calls())
def test_the_decode_checks_common_lane_accepts_only_what_the_checks_accept(call):
    """_checks._kv_cache_common (the decoded token's case in one expression) returns exactly
    what kv_cache_args' checks, one by one, return -- the same arrays, flags and scale -- and
    nothing (the checks run) for any input they would reject or treat otherwise; the token's
    own case takes it."""
    from npattn import _checks
    from npattn.functional.attention import AttentionOptions
    args, options, change = call
    values = (args["query"], args["key_cache"], args["value_cache"], args["cache_length"],
              args["key"], args["value"], AttentionOptions(**options))
    fast = _checks._kv_cache_common(*values)
    with mock.patch.object(_checks, "_kv_cache_common", lambda *_: None):
        try:
            slow = _checks.kv_cache_args(*values)
        except (TypeError, ValueError):
            slow = None
    event(f"{change}: {'lane' if fast is not None else 'checks'}")
    if change == "none":
        assert fast is not None
    if fast is not None:
        assert slow is not None and len(fast) == len(slow)
        for got, want in zip(fast, slow):
            assert got is want if isinstance(want, np.ndarray) or want is None else (
                type(got) is type(want) and got == want), (got, want)
