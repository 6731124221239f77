"""Scaled dot-product attention: PyTorch's ``scaled_dot_product_attention`` and the article's
``attention(query, key, value, mask, dropout) -> (output, weights)``, on one fused engine.

    scores  = query·keyᵀ · scale  (+ float mask, or -inf where a bool mask is False)
    weights = dropout(softmax(scores))           (the article's ``p_attn``)
    output  = weights · value

Shapes: query (..., H, L, E) · key (..., Hkv, S, E) · value (..., Hkv, S, Ev) -> output
(..., H, L, Ev). The batch dims (before the head dim) broadcast; with ``enable_gqa`` query head
h reads key/value head h // (H / Hkv), as ``repeat_interleave`` would arrange it.

Call map, from the public ops down to the engine (``a -> b``: a calls b; ``a => b``: a hands
b on without calling it by name). kernels/attention.py's map goes on from the kernels to their
work items and tiles; tests/test_call_maps.py checks every name and arrow of both::

    scaled_dot_product_attention          -> _sdpa_forward
    scaled_dot_product_attention_forward  -> _sdpa_forward
    _sdpa_forward                         -> _checks.attention_args, _prepare, _run_forward,
                                             _shaped
    scaled_dot_product_attention_backward -> _checks.attention_args, _prepare, _backward_args,
                                             _normalisers, _backward
    attention                             -> _checks.attention_args, _prepare, _run_forward
    attention_backward                    -> _checks.attention_args, _prepare, _run_forward,
                                             _backward_args, _normalisers, _backward
    scaled_dot_product_attention_varlen   -> _varlen_forward
    scaled_dot_product_attention_varlen_forward -> _varlen_forward
    _varlen_forward                       -> _varlen_run, _run_forward, _packed
    scaled_dot_product_attention_varlen_backward -> _varlen_run, _normalisers, _run_backward,
                                             _sink_gradient
    _varlen_run -> _checks.varlen_args, _prepare
    _prepare    -> _stacked, _plain_layout, _layout, engine   # _plain_layout: cached, for a
                                      # call without mask, ALiBi, sinks or varlen; run.kernels:
                                      # the "attention" engine instance of the dtype's
                                      # register tile (kernels/tiles.py::engine)
    _plain_layout -> _index_map, _plain_parts
    _layout     -> _index_map, _plain_parts, _dropout_base
    _backward   -> _run_backward, _sink_gradient, _gradients
    _run_forward  -> _forward_blocks, kernels/attention.py::attention_forward_kernel
    _run_backward -> _splits, kernels/attention.py::attention_backward_kernel
    scaled_dot_product_attention_with_kv_cache -> _checks.kv_cache_args, _with_kv_cache
    _with_kv_cache -> decode_chunk   # (also called by functional/block.py's fused block)
    _with_kv_cache => decode_attention_kernel     # or its .serial
    split_heads   -> _heads_copy  # the modules' copies between packed rows and heads
    split_heads   => split_kernel                 # (through _heads_copy, or its .serial)
    merge_heads   -> merge_heads_side_by_side
    merge_heads_side_by_side -> _heads_copy
    merge_heads_side_by_side => merge_kernel      # (likewise)

Each public entry point builds one ``AttentionOptions`` (npattn/_checks.py) from its keywords;
``_checks.attention_args`` checks it once and everything below reads the checked record.

The engine (``kernels/attention.py``) streams over blocks of keys with an online softmax and
never holds the L×S matrix: the forward keeps the output and one logsumexp per row, and
backward rebuilds each block of probabilities from them. Only ``attention``, whose caller asks
for the weights, writes an L×S matrix per head.

Rules, as PyTorch's ``scaled_dot_product_attention`` (2.5+):

* a bool mask's ``True`` takes part, a float mask is added to the scaled scores; masks
  broadcast to (..., H, L, S) and are read through their broadcast shape (never expanded);
* ``is_causal``: key j is visible to query i when j <= i (top-left); ``causal_alignment=
  "bottom-right"`` makes it j <= i + S - L, the rule for decoding with a KV cache (L < S);
* ``window=(left, right)`` (Mistral's sliding window, Longformer's band): query i sees key j
  only when d - left <= j <= d + right, d = i on the diagonal of the causal alignment in force
  (i + S - L for "bottom-right"), with or without ``is_causal``; ``None`` on a side is
  unbounded. Blocks of keys outside every row's window are skipped, never computed, so time
  grows with L·(left + right), not L·S. A row the window leaves empty is a fully masked row;
* ``alibi_slopes`` (ALiBi, Press et al.), shape (H,) or (batch..., H), the query dtype: adds
  -slope_h·|d - j| to head h's scaled scores (d: query i's diagonal, as for the window),
  computed in the kernel as each block of scores is formed -- no (L, S) bias is built. The
  slopes get no gradient;
* ``softcap=c`` (Gemma 2's logit soft-capping): each scaled score s becomes c·tanh(s/c) before
  the masks and ALiBi are applied, so every score lies in (-c, c); its backward multiplies the
  scores' gradient by 1 - tanh²(s/c) (``dmask`` stays the gradient of the capped, masked
  scores);
* ``sinks`` (gpt-oss's attention sinks), shape (H,), the query dtype: a logit per head that
  joins every row's softmax denominator, weights_ij = exp(s_ij)/(exp(sink_h) + Σ_j exp(s_ij)),
  without a value: the weights of a row sum to less than 1. ``logsumexp`` includes the sink
  (log(exp(sink_h) + Σ_j exp(s_ij))), so a row whose keys are all masked gives output 0 and
  logsumexp sink_h. The backward returns the sinks' gradient, -Σ_rows weight_sink·D with
  D = rowsum(dout ∘ output), summed over the batch;
* a row whose every key is masked gives zeros and zero gradients, not NaN; NaN propagates;
* dropout zeroes weight (b, h, i, j) unless kept by ``dropout_mask((B, H, L, S), dropout_p,
  seed)`` (B: the broadcast batch dims flattened) and scales the kept ones by 1/(1-p). The
  mask depends only on the seed, which is required when dropout_p > 0: backward regenerates
  the mask from it. Softmax's gradient uses the probabilities before dropout.

Edge cases (tests/test_numerics_edges.py), in float32 and float64:

* scores of ±1e30 (a float mask of ±1e30, or a huge q·k): the running row max is subtracted
  before every exp, so output, logsumexp and gradients are the reference's. Where |logsumexp|
  is so large that rounding m + log l to it loses digits of log l (beyond 512: tied maxima
  at 1e30, or a padding row masked with -1e9 the Annotated Transformer's way), backward and
  ``attention``'s weights renormalise that row by l·exp(m - logsumexp) from forward's row max
  m and sum l (``scaled_dot_product_attention_backward`` runs the forward again for them);
* a fully masked row: output 0, logsumexp -inf, weights 0, zero gradients (above);
* one visible key j: weights exactly one-hot, output exactly value[j]; the gradients through
  the softmax (that row's dq and dmask) are 0 up to rounding: D = rowsum(dout ∘ out) and
  dout·value[j] are one sum taken in two orders;
* NaN in query row i reaches output row i (and its logsumexp) only. NaN in key j reaches
  exactly the rows that see key j: a bool mask's False or the causal mask hides it, a float
  mask's -inf does not (NaN + -inf = NaN). NaN in value j reaches the rows that see key j, in
  that column, and may reach other rows of the head (a masked weight is an exact 0, and
  0·NaN = NaN, as in PyTorch's math path) -- never a fully masked row, which stays 0;
* denormal inputs are ordinary small numbers; float32 probabilities below 1.2e-38 are 0
  (the float32 exp of kernels/exp.py returns no subnormals);
* the accumulators are the input dtype, and forward sums exp(s_j - m)·value[j] before
  dividing by l: where that sum exceeds the dtype's max -- float32 values of 1e37 over 35 or
  more keys of equal score -- the output is inf although the average is finite (use float64,
  or scale the values down). Backward's dout·valueᵀ and D are float32 sums likewise.
"""
import collections
import functools
import math

import numpy as np

from .. import _checks
from .._checks import AttentionOptions
from ..kernels.attention_state import (BOOL_MASK, FLOAT_MASK, NO_MASK, Dropout,
                                       UNBOUNDED, ForwardResults, Gradients, Inputs, Saved,
                                       Scores)
from ..kernels.decode import SERIAL_MACS, decode_attention_kernel
from ..kernels.heads import SERIAL as HEADS_SERIAL, merge_kernel, split_kernel
from ..kernels.random import keep_threshold, kept_scale, stream_key
from ..kernels.tiles import engine

NO_BOOL = np.ones((1, 1, 1), np.bool_)      # the unused mask argument: one plane, never read
NO_FLOAT = {np.dtype(t): np.zeros((1, 1, 1), t) for t in (np.float32, np.float64)}
#: the per-head placeholder of an option that is off (ALiBi's slopes, the sink logits)
NO_HEAD_VALUES = {np.dtype(t): np.zeros(1, t) for t in (np.float32, np.float64)}
#: |logsumexp| beyond which its rounding -- up to 256 ulps at 512 -- would be a visible
#: relative error in every probability backward rebuilds as exp(s - lse). Such rows get their
#: normaliser Σ_j exp(s_j - lse) = l·exp(m - lse) from forward's row max m and row sum l (see
#: _normalisers); at ±1e30, or a float mask of -1e9 in float32, lse has lost log l entirely
#: and the normaliser is the number of tied keys. Rows this far out are rare: scores of
#: ordinary attention are far smaller, so the rerun in scaled_dot_product_attention_backward
#: costs nothing in the common case.
LSE_EXACT = {np.dtype(t): 512.0 for t in (np.float32, np.float64)}
#: The decode path (kernels/decode.py) cuts each head's keys into chunks of at least
#: DECODE_MIN_CHUNK keys, as many as make about DECODE_ITEMS work items over all heads.
DECODE_ITEMS = 8
DECODE_MIN_CHUNK = 64


#: One call's view for the engine (_prepare): ``kernels`` the attention engine of the dtype's
#: register tile; ``inputs``, ``scores``, ``dropout`` the kernels' records
#: (kernels/attention_state.py); ``shape`` the broadcast batch dims + (H, L); ``n_batch`` their
#: product B; ``out_ndim`` the rank of the caller's output.
Run = collections.namedtuple("Run", "kernels inputs scores dropout shape n_batch out_ndim")


def _prepare(args, cu_seqlens=None):
    """The kernels' view of the checked arguments (an _checks.AttentionArgs, whose options are
    the checked AttentionOptions): stacks, index
    maps, each batch's rows and keys, mask planes, dropout stream -- a Run. ``cu_seqlens``
    (cu_q, cu_k), int64: a packed variable-length batch (varlen), whose args hold the stacks
    (H, total, E) without batch dims; sequence s is then batch s of the engine, rows cu_q[s]
    .. cu_q[s + 1] and keys cu_k[s] .. cu_k[s + 1] of them, its results those rows of one
    result batch.

    Without a mask, ALiBi slopes, sinks or varlen -- every call of a GPT's training step --
    everything but the stacks and the dropout stream is a function of the shapes and options
    alone, and comes from a cache of such layouts (_plain_layout): rebuilding its dozen small
    arrays was most of this function's time."""
    batch, heads, options = args.batch, args.heads, args.options
    lead = len(batch)
    q4, k4, v4 = (_stacked(x, lead) for x in (args.query, args.key, args.value))
    dtype = q4.dtype
    if (cu_seqlens is None and options.attn_mask is None and options.alibi_slopes is None
            and options.sinks is None):                # (the record is then hashable: a key;
        index, lengths, scores, base = _plain_layout(  # dropout is not part of the layout)
            batch, heads, tuple(_stored(x, lead) for x in (args.query, args.key, args.value)),
            q4.shape[2], k4.shape[2], dtype, options._replace(dropout_p=0.0, seed=0))
    else:
        index, lengths, scores, base = _layout(args, q4, k4, cu_seqlens)
    p = options.dropout_p
    dropout = Dropout(stream=stream_key(options.seed),
                      threshold=keep_threshold(p) if p > 0 else np.uint64(0),
                      scale=kept_scale(p, dtype), base=base)
    return Run(kernels=engine("attention", dtype),
               inputs=Inputs(q4, k4, v4, *index, *lengths),
               scores=scores, dropout=dropout, shape=batch + (heads, q4.shape[2]),
               n_batch=math.prod(batch), out_ndim=args.out_ndim)


def _stacked(x, lead_ndim):
    """x (..., [heads,] N, W) as a stack (Bx, heads, N, W): a view (x is C-contiguous)."""
    shape = (1,) * (lead_ndim + 3 - x.ndim) + x.shape            # (*batch_x, heads, N, W)
    return x.reshape((math.prod(shape[:-3]),) + shape[-3:])


def _stored(x, lead_ndim):
    """x's own batch dims, padded with 1s to the broadcast batch's rank (*batch_x)."""
    return ((1,) * (lead_ndim + 3 - x.ndim) + x.shape)[:-3]


@functools.lru_cache(maxsize=64)
def _plain_layout(batch, heads, stored, n_rows, n_keys, dtype, options):
    """_layout for a call without mask, ALiBi, sinks or varlen, from what it depends on: the
    broadcast batch, the heads, each input's stored batch dims (``stored``: _stored of q, k,
    v), L, S, the dtype and the options (an AttentionOptions without dropout). Cached: the
    arrays are read by the kernels and never written, so calls of the same shapes share them."""
    index = tuple(_index_map(s, batch) for s in stored)
    return _plain_parts(batch, heads, index, n_rows, n_keys, dtype, options)


def _index_map(stored, batch):
    """(B,) int64: the stored batch of each flattened broadcast batch -- broadcasting repeats
    indices, never data."""
    if stored == batch:
        return np.arange(math.prod(batch), dtype=np.int64)
    return np.broadcast_to(np.arange(math.prod(stored), dtype=np.int64).reshape(stored),
                           batch).flatten()                               # (a writeable copy)


def _plain_parts(batch, heads, index, n_rows, n_keys, dtype, options):
    """(index maps, per-batch lengths, Scores, dropout base) of ``options`` (an
    AttentionOptions) but its mask, ALiBi slopes and sinks."""
    n_batch = math.prod(batch)
    left, right = (UNBOUNDED if n is None else min(n, UNBOUNDED) for n in options.window)
    q_start = k_start = np.zeros(n_batch, np.int64)
    q_len, k_len = np.full(n_batch, n_rows, np.int64), np.full(n_batch, n_keys, np.int64)
    out_batch = np.arange(n_batch, dtype=np.int64)
    no_values = NO_HEAD_VALUES[dtype]
    scores = Scores(scale=options.scale, mask_kind=NO_MASK, bool_planes=NO_BOOL,
                    float_planes=NO_FLOAT[dtype],
                    plane_of=np.zeros(n_batch * heads, np.int64), causal=options.is_causal,
                    offset=k_len - q_len if options.bottom_right else np.zeros_like(q_len),
                    window_left=left, window_right=right, alibi=False, slopes=no_values,
                    softcap=0.0 if options.softcap is None else options.softcap, sinks=False,
                    sink_logits=no_values)
    return (index, (q_start, q_len, k_start, k_len, out_batch), scores,
            _dropout_base(q_len, k_len, heads))


def _dropout_base(q_len, k_len, heads):
    """Each batch's first dropout index: the batches' (H, L_b, S_b) blocks one after another."""
    sizes = q_len * k_len
    base = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=base[1:])
    return base * heads


def _layout(args, q4, k4, cu_seqlens):
    """(index maps (qi, ki, vi), per-batch lengths (q_start, q_len, k_start, k_len,
    out_batch), Scores, dropout base) of any call: what _prepare builds besides the stacks --
    _plain_parts, then what a varlen batch, a mask, ALiBi slopes and sinks change in them."""
    batch, heads, options = args.batch, args.heads, args.options
    lead = len(batch)
    dtype = q4.dtype
    index = tuple(_index_map(_stored(x, lead), batch) for x in (args.query, args.key, args.value))
    index, lengths, scores, base = _plain_parts(batch, heads, index, q4.shape[2], k4.shape[2],
                                                dtype, options)
    slope_batch = batch
    if cu_seqlens is not None:                                   # (n_seq,) each
        cu_q, cu_k = cu_seqlens
        q_len, k_len = np.diff(cu_q), np.diff(cu_k)
        n_seq = q_len.shape[0]
        index = (np.zeros(n_seq, np.int64),) * 3                 # one stack
        lengths = (cu_q[:-1].copy(), q_len, cu_k[:-1].copy(), k_len, np.zeros(n_seq, np.int64))
        scores = scores._replace(plane_of=np.zeros(n_seq * heads, np.int64),   # (B·H,): B
                                 offset=(k_len - q_len if options.bottom_right  # sequences
                                         else np.zeros_like(q_len)))
        base = _dropout_base(q_len, k_len, heads)
        slope_batch = q_len.shape
    mask = options.attn_mask
    if mask is not None:                                          # (never with varlen)
        shape = (1,) * (lead + 3 - mask.ndim) + mask.shape        # (*batch_m, Hm, Lm, Sm)
        stored = shape[:-2]
        flat = mask.reshape((math.prod(stored),) + shape[-2:])     # (Nm, Lm, Sm)
        plane_of = np.broadcast_to(np.arange(flat.shape[0], dtype=np.int64).reshape(stored),
                                   batch + (heads,)).flatten()     # (B·H,)
        if mask.dtype == np.bool_:
            scores = scores._replace(mask_kind=BOOL_MASK, bool_planes=flat, plane_of=plane_of)
        else:
            scores = scores._replace(mask_kind=FLOAT_MASK, float_planes=flat, plane_of=plane_of)
    if options.alibi_slopes is not None:                         # (B·H,)
        slopes = np.broadcast_to(options.alibi_slopes, slope_batch + (heads,))
        scores = scores._replace(alibi=True, slopes=np.ascontiguousarray(slopes).reshape(-1))
    if options.sinks is not None:                                # (B·H,)
        sinks = np.broadcast_to(options.sinks, slope_batch + (heads,))
        scores = scores._replace(sinks=True, sink_logits=np.ascontiguousarray(sinks).reshape(-1))
    return index, lengths, scores, base


def _run_forward(run, store_weights):
    """out (B, H, L, Ev), lse (B, H, L), weights (B, H, L, S) or None, and the softmax's row
    max and row sum (B, H, L) each (lse = max + log sum), from the engine."""
    q, k, v = run.inputs.q, run.inputs.k, run.inputs.v
    n_batch, heads, n_rows = run.n_batch, q.shape[1], q.shape[2]
    out = np.empty((n_batch, heads, n_rows, v.shape[3]), q.dtype)
    lse = np.empty((n_batch, heads, n_rows), q.dtype)
    row_max = np.empty_like(lse)                                     # (B, H, L)
    row_sum = np.empty_like(lse)                                     # (B, H, L)
    weights = (np.empty((n_batch, heads, n_rows, k.shape[2]), q.dtype) if store_weights
               else np.empty((1, 1, 1, 1), q.dtype))               # (unused placeholder)
    run.kernels.attention_forward_kernel(
        run.inputs, run.scores, run.dropout,
        ForwardResults(out, lse, row_max, row_sum, weights, store_weights),
        *_forward_blocks(run))
    if store_weights:                        # weights = exp(s - lse): renormalise where lse
        norm = _normalisers(lse, (row_max, row_sum))       # lost log l (exactly 1 elsewhere)
        far = norm != 1
        if far.any():
            weights[far] /= norm[far][:, None]
    return out, lse, (weights if store_weights else None), (row_max, row_sum)


def _forward_blocks(run):
    """(block_rows, n_qb) of attention_forward_kernel: rows per work item, by the batches'
    mean length (kernels.forward_block_rows), and work items per head -- the query blocks of
    the longest batch (a shorter batch's extra items do nothing)."""
    q_len = run.inputs.q_len
    n = q_len.shape[0]
    if n == 0:
        return run.kernels.FORWARD_BQ, 0
    rows = run.kernels.forward_block_rows(n * run.inputs.q.shape[1], -(-int(q_len.sum()) // n))
    return rows, -(-int(q_len.max()) // rows)


def _normalisers(lse, stats):
    """Σ_j exp(s_j - lse) per row (B, H, L), in lse's dtype: exactly 1 where |lse| <=
    LSE_EXACT (backward's exp(s - lse) is then a probability as it stands), else l·exp(m -
    lse) from forward's row max m and row sum l: ``stats``, or a function that runs the
    forward for them, called only when such a row exists."""
    norm = np.ones_like(lse)
    far = np.abs(lse) > LSE_EXACT[lse.dtype]          # (NaN: False; ±inf: True, for now)
    if not far.any():                                 # the common case: one pass over lse
        return norm
    far &= np.isfinite(lse)
    if far.any():
        row_max, row_sum = stats() if callable(stats) else stats
        with np.errstate(all="ignore"):
            norm[far] = row_sum[far] * np.exp(np.float64(row_max[far]) - lse[far])
    return norm


def _caller_shape(run, tail):
    """The caller's shape of a (B, H, L) + tail result: batch... + (H, L) + tail, without the
    head dim when every input was 2-D."""
    full = run.shape + tail                                       # (*batch, H, L, *tail)
    return full[len(full) - (run.out_ndim - 1 + len(tail)):]


def _shaped(x, run):
    """A (B, H, L, ...) result in the caller's shape (see _caller_shape)."""
    return x.reshape(_caller_shape(run, x.shape[3:]))


def _sum_to(grad, shape):
    """Undo broadcasting: sum ``grad`` over the dims that broadcasting added or stretched."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(lead))) if lead else grad
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True) if stretched else grad


def _splits(run):
    """How many copies of dq the backward adds into: enough work items (B·Hkv·splits) to keep
    the threads busy when there are few heads. A function of the shapes only (never of the
    thread count), so the sums -- and bits -- are the same everywhere."""
    kernels = run.kernels
    k_len = run.inputs.k_len
    n_kb = -(-int(k_len.max(initial=0)) // kernels.BK)          # (the longest batch's keys)
    items = k_len.shape[0] * run.inputs.k.shape[1]
    return max(1, min(n_kb, -(-kernels.WORK_ITEMS // max(items, 1))))


def _run_backward(run, dout, out, lse, norm, *, store_ds):
    """dq (B, H, L, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) per broadcast batch, and the
    gradient of the masked scores (B, H, L, S) when store_ds. ``norm`` (B, H, L): each row's
    Σ_j exp(s_j - lse) (_normalisers)."""
    q, k, v = run.inputs.q, run.inputs.k, run.inputs.v
    n_batch, heads, n_rows = run.n_batch, q.shape[1], q.shape[2]
    dq_parts = np.empty((_splits(run), n_batch, heads, n_rows, q.shape[3]), q.dtype)  # (zeroed
                                                                   # by the kernel's items)
    dk = np.empty((n_batch,) + k.shape[1:], q.dtype)
    dv = np.empty((n_batch,) + v.shape[1:], q.dtype)
    dscores = (np.zeros((n_batch, heads, n_rows, k.shape[2]), q.dtype) if store_ds
               else np.empty((1, 1, 1, 1), q.dtype))
    run.kernels.attention_backward_kernel(run.inputs, run.scores, run.dropout,
                                          Saved(dout, out, lse, norm),
                                          Gradients(dq_parts, dk, dv, dscores, store_ds))
    if dq_parts.shape[0] == 1:                      # the kernel scaled its one split
        dq = dq_parts[0]
    else:
        dq = dq_parts.sum(axis=0)                     # in split order
        dq *= q.dtype.type(run.scores.scale)
    return dq, dk, dv, (dscores if store_ds else None)


def _sink_gradient(sinks, dout, out, lse, norm):
    """The sink logits' gradient (H,): -Σ over batch and rows of p_sink·D, with p_sink =
    exp(sink - lse)/norm the weight the sink took in each row and D = rowsum(dout ∘ out)
    (docs/backward.md, section 7). sinks (H,); dout, out (B, H, L, Ev); lse, norm (B, H, L)."""
    d = np.einsum("bhlv,bhlv->bhl", dout, out, dtype=np.float64)             # (B, H, L)
    with np.errstate(over="ignore", invalid="ignore"):
        p_sink = np.exp(sinks.astype(np.float64)[:, None] - lse) / norm      # (B, H, L)
    p_sink[np.isneginf(lse)] = 0.0          # (rows with no key and a sink of -inf)
    return -(p_sink * d).sum(axis=(0, 2)).astype(lse.dtype)                # (H,)


def _gradients(args, run, dq, dk, dv, dscores, dsinks=None):
    """Each gradient in its input's shape (summed over broadcast batch dims; dk, dv over the
    query heads that shared a key/value head), then dsinks and dmask when computed."""
    batch = run.shape[:-2]
    grads = []
    for x, g in ((args.query, dq), (args.key, dk), (args.value, dv)):
        g = g.reshape(batch + g.shape[1:])                       # (*batch, heads, N, W)
        grads.append(_sum_to(g, (1,) * (len(batch) + 3 - x.ndim) + x.shape).reshape(x.shape))
    if dsinks is not None:
        grads.append(dsinks)
    if dscores is not None:
        mask = args.options.attn_mask
        full = dscores.reshape(batch + dscores.shape[1:])        # (*batch, H, L, S)
        grads.append(np.asarray(_sum_to(full, mask.shape)).reshape(mask.shape))  # 0-d: an array
    return tuple(grads)


def _backward(args, run, dout, out, lse, norm, *, mask_grad):
    """The gradients in their inputs' shapes (_gradients) from the checked, stacked dout, out,
    lse and the normalisers: the kernel, and the sinks' gradient when there are sinks."""
    dq, dk, dv, dscores = _run_backward(run, dout, out, lse, norm, store_ds=mask_grad)
    sinks = args.options.sinks
    dsinks = _sink_gradient(sinks, dout, out, lse, norm) if sinks is not None else None
    return _gradients(args, run, dq, dk, dv, dscores, dsinks=dsinks)


def _backward_args(dout, output, logsumexp, args, run, *, mask_name, mask_grad):
    """dout and output as (B, H, L, Ev), logsumexp as (B, H, L): checked against the shapes
    forward gave for these arguments, one dtype, C-contiguous."""
    q, v = run.inputs.q, run.inputs.v
    stacked = (run.n_batch, q.shape[1], q.shape[2])                # (B, H, L)
    arrays = []
    for name, x, tail in (("dout", dout, (v.shape[3],)), ("output", output, (v.shape[3],)),
                          ("logsumexp", logsumexp, ())):
        x = _checks.float_array(name, x)
        _checks.same_dtype(name, x, "query", args.query)
        _checks.exact_shape(name, x, _caller_shape(run, tail),
                            "to match forward's for these query, key and value")
        arrays.append(_checks.contiguous(x).reshape(stacked + tail))
    if _checks.flag("mask_grad", mask_grad):
        mask = args.options.attn_mask
        if mask is None or mask.dtype == np.bool_:
            raise ValueError(f"mask_grad=True needs a float {mask_name} (a bool mask has no "
                             f"gradient); got {'None' if mask is None else 'a bool mask'}")
    return arrays


def _sdpa_forward(query, key, value, options):
    """scaled_dot_product_attention_forward on its record: ``(output, logsumexp)`` in the
    caller's shapes. ``options``: an AttentionOptions as given."""
    args = _checks.attention_args(query, key, value, options)
    run = _prepare(args)
    out, lse, _, _ = _run_forward(run, store_weights=False)
    return _shaped(out, run), _shaped(lse, run)


def scaled_dot_product_attention_forward(query, key, value, attn_mask=None, dropout_p=0.0,
                                         is_causal=False, scale=None, enable_gqa=False, *,
                                         seed=None, causal_alignment="top-left", window=None,
                                         alibi_slopes=None, softcap=None, sinks=None):
    """``(output, logsumexp)``: attention's output and, per query row, log Σ_j exp(score_ij).

    Shapes: query (..., H, L, E) · key (..., Hkv, S, E) · value (..., Hkv, S, Ev) ->
    output (..., H, L, Ev), logsumexp (..., H, L)

    ``logsumexp`` (-inf for a fully masked row) is all backward needs besides the inputs:
    it rebuilds any block of weights as exp(score - logsumexp). ``scale`` defaults to 1/√E.
    """
    return _sdpa_forward(query, key, value, AttentionOptions(
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, seed=None,
                                 causal_alignment="top-left", window=None, alibi_slopes=None,
                                 softcap=None, sinks=None):
    """softmax(query·keyᵀ·scale + mask) · value, as ``torch.nn.functional.
    scaled_dot_product_attention`` (see the module docstring for the rules).

    Shapes: query (..., H, L, E) · key (..., Hkv, S, E) · value (..., Hkv, S, Ev) ->
    output (..., H, L, Ev)
    """
    return _sdpa_forward(query, key, value, AttentionOptions(
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))[0]


def scaled_dot_product_attention_backward(dout, query, key, value, output, logsumexp,
                                          attn_mask=None, dropout_p=0.0, is_causal=False,
                                          scale=None, enable_gqa=False, *, seed=None,
                                          causal_alignment="top-left", window=None,
                                          alibi_slopes=None, softcap=None, sinks=None,
                                          mask_grad=False):
    """Gradients ``(dquery, dkey, dvalue)``, then ``dsinks`` when ``sinks`` is given, and
    ``dmask`` last when ``mask_grad`` is True.

    Shapes: dout, output (..., H, L, Ev) · logsumexp (..., H, L) and forward's arguments ->
    dquery, dkey, dvalue in the shapes of query, key, value; dsinks (H,); dmask in the shape
    of attn_mask

    With w = dropout(p), p = softmax(s), s = q·kᵀ·scale + mask and D = rowsum(dout ∘ output):
    dv = wᵀ·dout,  ds = p ∘ (dropout(dout·vᵀ) - D),  dq = ds·k·scale,  dk = dsᵀ·q·scale,
    dmask = ds (summed over the dims the mask was broadcast along; needs a float mask).
    Each block of p is rebuilt from ``logsumexp``; forward's arguments must be passed again.
    """
    args = _checks.attention_args(query, key, value, AttentionOptions(
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))
    run = _prepare(args)
    dout, output, lse = _backward_args(dout, output, logsumexp, args, run,
                                       mask_name="attn_mask", mask_grad=mask_grad)
    norm = _normalisers(lse, lambda: _run_forward(run, store_weights=False)[3])
    return _backward(args, run, dout, output, lse, norm, mask_grad=mask_grad)


def attention(query, key, value, mask=None, dropout_p=0.0, *, scale=None, is_causal=False,
              seed=None, causal_alignment="top-left", window=None, alibi_slopes=None,
              softcap=None, sinks=None, return_logsumexp=False):
    """The article's ``attention``: ``(output, weights)`` with weights = dropout(softmax(
    query·keyᵀ/√d_k + mask)), the article's ``p_attn``, and output = weights · value.

    Shapes: query (..., L, E) · key (..., S, E) · value (..., S, Ev) -> output (..., L, Ev),
    weights (..., L, S)  (with heads: (..., H, L, E) etc., as scaled_dot_product_attention)

    The same engine as scaled_dot_product_attention; only here is the L×S matrix of weights
    written, because the caller asked for it. ``mask``: bool (True = attend) or float (added).
    ``return_logsumexp=True`` returns ``(output, weights, logsumexp)``, logsumexp (..., L):
    hand output and logsumexp to attention_backward and it skips running the forward again.
    """
    args = _checks.attention_args(query, key, value, AttentionOptions(
        attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, seed=seed,
        causal_alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks), mask_name="mask")
    run = _prepare(args)
    out, lse, weights, _ = _run_forward(run, store_weights=True)
    if _checks.flag("return_logsumexp", return_logsumexp):
        return _shaped(out, run), _shaped(weights, run), _shaped(lse, run)
    return _shaped(out, run), _shaped(weights, run)


def attention_backward(dout, query, key, value, mask=None, dropout_p=0.0, *, scale=None,
                       is_causal=False, seed=None, causal_alignment="top-left", window=None,
                       alibi_slopes=None, softcap=None, sinks=None, mask_grad=False,
                       output=None, logsumexp=None):
    """Gradients of ``attention``'s output: ``(dquery, dkey, dvalue)`` (then ``dsinks`` and
    ``dmask``, as scaled_dot_product_attention_backward).

    Shapes: dout (..., L, Ev) and forward's arguments -> dquery, dkey, dvalue (dsinks, dmask)
    in the shapes of query, key, value (sinks, mask); output (..., L, Ev), logsumexp (..., L)

    The engine of scaled_dot_product_attention_backward, which rebuilds the weights from the
    logsumexp: pass ``output`` and ``logsumexp`` from ``attention(..., return_logsumexp=
    True)``, or neither and the fused forward runs again for them. The gradient flows
    through the pre-dropout probabilities -- at dropped positions too -- not through the
    returned weights.
    """
    args = _checks.attention_args(query, key, value, AttentionOptions(
        attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, seed=seed,
        causal_alignment=causal_alignment, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks), mask_name="mask")
    run = _prepare(args)
    if (output is None) != (logsumexp is None):
        given, missing = ("output", "logsumexp") if logsumexp is None else ("logsumexp",
                                                                               "output")
        raise ValueError(f"attention_backward needs output and logsumexp together (both "
                         f"from attention(..., return_logsumexp=True)) or neither; got "
                         f"{given} without {missing}")
    if output is None:
        out, lse, _, stats = _run_forward(run, store_weights=False)
        output, logsumexp = _shaped(out, run), _shaped(lse, run)
    else:
        stats = lambda: _run_forward(run, store_weights=False)[3]   # noqa: E731 (rare rows)
    dout, out, lse = _backward_args(dout, output, logsumexp, args, run, mask_name="mask",
                                    mask_grad=mask_grad)
    return _backward(args, run, dout, out, lse, _normalisers(lse, stats), mask_grad=mask_grad)


attention_forward = attention


def _varlen_run(query, key, value, cu_seqlens_q, cu_seqlens_k, options):
    """The checked arguments of a varlen call (their AttentionArgs) and the engine's Run:
    sequence s is batch s, in one stack per operand. ``options``: an AttentionOptions as
    given (no attn_mask)."""
    args, cu_q, cu_k = _checks.varlen_args(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                           options)
    return args, _prepare(args, (cu_q, cu_k))


def _packed(x):
    """A stack (1, heads, total, W) of the engine as the packed (total, heads, W)."""
    return np.ascontiguousarray(x[0].transpose(1, 0, 2))


def _varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, options):
    """scaled_dot_product_attention_varlen_forward on its record: ``(output, logsumexp)``."""
    _, run = _varlen_run(query, key, value, cu_seqlens_q, cu_seqlens_k, options)
    out, lse, _, _ = _run_forward(run, store_weights=False)
    return _packed(out), lse[0]


def scaled_dot_product_attention_varlen_forward(query, key, value, cu_seqlens_q,
                                                cu_seqlens_k, dropout_p=0.0, is_causal=False,
                                                scale=None, enable_gqa=False, *, seed=None,
                                                causal_alignment="top-left", window=None,
                                                alibi_slopes=None, softcap=None, sinks=None):
    """``(output, logsumexp)`` of a packed batch of sequences of different lengths
    (flash-attn's ``flash_attn_varlen_func`` layout).

    Shapes: query (total_q, H, E) · key (total_k, Hkv, E) · value (total_k, Hkv, Ev) ·
    cu_seqlens_q, cu_seqlens_k (n_seq + 1,) int32 or int64 -> output (total_q, H, Ev),
    logsumexp (H, total_q)

    Sequence s is query rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] against keys and values
    cu_seqlens_k[s] .. cu_seqlens_k[s + 1]: exactly scaled_dot_product_attention_forward on
    that sequence alone (heads as dim -3), its L_s queries and S_s keys counted from its own
    start -- the causal diagonal (bottom-right: i + S_s - L_s), the window and ALiBi's
    distance are per sequence; sequences never see each other and nothing is padded.
    ``alibi_slopes`` (H,) or (n_seq, H); ``softcap`` and ``sinks`` (H,) as there. A sequence
    without keys gives zero output rows and logsumexp -inf (its sink, with sinks). Dropout
    keeps weight (s, h, i, j) by ``dropout_mask((H·Σ_t L_t·S_t,), dropout_p, seed)`` at
    base_s + (h·L_s + i)·S_s + j, base_s = H·Σ_{t<s} L_t·S_t -- the sequences' (H, L_s, S_s)
    masks one after the other. No attention mask (as flash-attn).
    """
    return _varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, AttentionOptions(
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))


def scaled_dot_product_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                        dropout_p=0.0, is_causal=False, scale=None,
                                        enable_gqa=False, *, seed=None,
                                        causal_alignment="top-left", window=None,
                                        alibi_slopes=None, softcap=None, sinks=None):
    """Attention over a packed batch of sequences of different lengths: the output of
    scaled_dot_product_attention_varlen_forward (see there for the rules).

    Shapes: query (total_q, H, E) · key (total_k, Hkv, E) · value (total_k, Hkv, Ev) ·
    cu_seqlens_q, cu_seqlens_k (n_seq + 1,) -> output (total_q, H, Ev)
    """
    return _varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, AttentionOptions(
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))[0]


def scaled_dot_product_attention_varlen_backward(dout, query, key, value, output, logsumexp,
                                                 cu_seqlens_q, cu_seqlens_k, dropout_p=0.0,
                                                 is_causal=False, scale=None,
                                                 enable_gqa=False, *, seed=None,
                                                 causal_alignment="top-left", window=None,
                                                 alibi_slopes=None, softcap=None, sinks=None):
    """Gradients ``(dquery, dkey, dvalue)`` of scaled_dot_product_attention_varlen, and
    ``dsinks`` (H,) last when ``sinks`` is given.

    Shapes: dout, output (total_q, H, Ev) · logsumexp (H, total_q) and forward's arguments
    -> dquery (total_q, H, E), dkey (total_k, Hkv, E), dvalue (total_k, Hkv, Ev)

    scaled_dot_product_attention_backward's formulas, per sequence; each block of weights is
    rebuilt from ``logsumexp``, so forward's arguments (seed included) must be passed again.
    """
    args, run = _varlen_run(query, key, value, cu_seqlens_q, cu_seqlens_k, AttentionOptions(
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        seed=seed, causal_alignment=causal_alignment, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks))
    heads, total_q = args.heads, args.query.shape[1]
    packed = (total_q, heads, args.value.shape[2])
    arrays = []
    for name, x, shape in (("dout", dout, packed), ("output", output, packed),
                           ("logsumexp", logsumexp, (heads, total_q))):
        x = _checks.float_array(name, x)
        _checks.same_dtype(name, x, "query", args.query)
        _checks.exact_shape(name, x, shape, "to match forward's for these query, key and value")
        arrays.append(_checks.contiguous(x.transpose(1, 0, 2) if x.ndim == 3 else x)[None])
    dout, out, lse = arrays                            # (1, H, total_q, Ev) ×2, (1, H, total_q)
    norm = _normalisers(lse, lambda: _run_forward(run, store_weights=False)[3])
    dq, dk, dv, _ = _run_backward(run, dout, out, lse, norm, store_ds=False)
    grads = (_packed(dq), _packed(dk), _packed(dv))
    sinks = args.options.sinks
    if sinks is None:
        return grads
    return grads + (_sink_gradient(sinks, dout, out, lse, norm),)


def decode_chunk(n_heads, n_keys):
    """Keys per chunk of the decode path for n_heads (b, h) pairs and n_keys live keys: a
    function of the shapes only, so the merge order -- and the bits -- never depend on the
    thread count."""
    splits = -(-DECODE_ITEMS // max(n_heads, 1))
    return max(DECODE_MIN_CHUNK, -(-n_keys // splits))


def scaled_dot_product_attention_with_kv_cache(query, key_cache, value_cache, cache_length,
                                               key=None, value=None, *, is_causal=False,
                                               scale=None, enable_gqa=False):
    """``(output, logsumexp)`` of L new query rows against a KV cache -- the decode step of a
    generating transformer -- after writing the new ``key`` and ``value`` rows (if given) into
    the caches in place at positions cache_length .. cache_length + L (as flash-attn's
    ``flash_attn_with_kvcache``).

    Shapes: query (..., H, L, E) · key_cache (..., Hkv, Smax, E) · value_cache (..., Hkv,
    Smax, Ev) · key (..., Hkv, L, E) · value (..., Hkv, L, Ev) -> output (..., H, L, Ev),
    logsumexp (..., H, L)

    The live keys are the first n = cache_length (+ L with key and value) of each cache. With
    ``is_causal``, query row i is at position n - L + i and sees keys j <= n - L + i (the
    bottom-right rule of ``scaled_dot_product_attention``'s ``causal_alignment``); without
    it every live key. The result is that of scaled_dot_product_attention_forward(query,
    key_cache[..., :n, :], value_cache[..., :n, :], is_causal=is_causal, causal_alignment=
    "bottom-right", ...), computed without copying the caches, by a kernel made for few rows:
    each head's keys are cut into chunks (by the shapes only), computed apart on every thread
    and merged by their logsumexp (kernels/decode.py). The caches are C-contiguous, writeable
    arrays of query's dtype with query's batch dims (no broadcasting). Inference only: for a
    gradient, scaled_dot_product_attention_backward takes the same arguments as a plain call.
    """
    (query, key_cache, value_cache, key, value, n_keys, causal,
     scale) = _checks.kv_cache_args(query, key_cache, value_cache, cache_length, key, value,
                                    AttentionOptions(is_causal=is_causal, scale=scale,
                                                     enable_gqa=enable_gqa))
    return _with_kv_cache(query, key_cache, value_cache, key, value, n_keys, causal, scale)


def _with_kv_cache(query, key_cache, value_cache, key, value, n_keys, causal, scale):
    """scaled_dot_product_attention_with_kv_cache after its checks (``_checks.kv_cache_args``'
    results: n_keys live keys with the new ones, scale a float); also the attention of
    functional/block.py's fused block, which checks its own arguments."""
    # (a decoded token runs this once per layer: the 4-D case, the engine's own layout, takes
    # no reshapes)
    if query.ndim == 4:                                   # (B, H, L, E)
        q4, k4, v4 = query, key_cache, value_cache
    else:                                                 # (..., H, L, E): the batch dims as one
        n_batch = math.prod(query.shape[:-3])
        q4 = query.reshape((n_batch,) + query.shape[-3:])               # (B, H, L, E)
        k4 = key_cache.reshape((n_batch,) + key_cache.shape[-3:])       # (B, Hkv, Smax, E)
        v4 = value_cache.reshape((n_batch,) + value_cache.shape[-3:])   # (B, Hkv, Smax, Ev)
    n_batch, heads, n_rows, width = q4.shape
    if key is not None:                                   # the new entries, in place
        key_cache[..., n_keys - n_rows:n_keys, :] = key
        value_cache[..., n_keys - n_rows:n_keys, :] = value
    n_vcols = v4.shape[3]
    dtype = query.dtype
    out = np.empty(query.shape[:-1] + (n_vcols,), dtype)                # (..., H, L, Ev)
    stats = np.empty((n_batch, heads, n_rows, 3), dtype)                # lse, max, sum
    chunk = decode_chunk(n_batch * heads, n_keys)
    n_chunks = max(1, -(-n_keys // chunk))
    parts = np.empty((n_batch, heads, n_chunks, n_rows, n_vcols + 2), dtype)
    work = n_batch * heads * n_rows * n_keys * (width + n_vcols)
    run = decode_attention_kernel.serial if work <= SERIAL_MACS else decode_attention_kernel
    run(q4, k4, v4, n_keys, causal, scale, chunk, out.reshape(q4.shape[:3] + (n_vcols,)),
        stats, parts)
    return out, stats[:, :, :, 0].reshape(query.shape[:-1])          # (..., H, L)


# ------------------------------------------------------------------ the heads' layouts

def split_heads(x, heads, batch_first, parts=1):
    """(N, L, parts·H·D) when batch_first, else (L, N, parts·H·D) -> (N, H, L, D), C-contiguous:
    head h is columns h·D .. (h+1)·D - 1 (MultiheadAttention's, and the GPT's heads). With
    ``parts`` > 1 each row holds that many such blocks side by side (the GPT's fused q, k, v)
    and the result is a (parts, N, H, L, D) array, part i the heads of block i."""
    packed = x if batch_first else x.transpose(1, 0, 2)                  # (N, L, parts·H·D)
    n, length, width = packed.shape
    out = np.empty((parts, n, heads, length, width // (parts * heads)), x.dtype)
    _heads_copy(split_kernel, packed, out, 0, out.size)
    return out if parts > 1 else out[0]                                  # (N, H, L, D)


def merge_heads(x, batch_first):
    """(N, H, L, D) -> (N, L, H·D) when batch_first, else (L, N, H·D): heads side by side."""
    return merge_heads_side_by_side((x,), batch_first)


def merge_heads_side_by_side(xs, batch_first):
    """merge_heads of each of ``xs`` (k arrays (N, H, L, D)), side by side: (N, L, k·H·D) when
    batch_first, else (L, N, k·H·D) -- ``np.concatenate([merge_heads(x, ...) for x in xs],
    axis=-1)`` with each element copied once instead of twice (the GPT's dq, dk, dv into the
    gradient of its fused q, k, v projection). C-contiguous."""
    n, heads, length, width = xs[0].shape
    lead = (n, length) if batch_first else (length, n)
    out = np.empty(lead + (len(xs) * heads * width,), xs[0].dtype)
    packed = out if batch_first else out.transpose(1, 0, 2)              # (N, L, k·H·D)
    for i, x in enumerate(xs):
        _heads_copy(merge_kernel, np.ascontiguousarray(x)[None], packed, i, x.size)
    return out


def _heads_copy(kernel, src, dst, first, size):
    """kernels/heads.py's split_kernel or merge_kernel (parts first .. of a packed (N, L,
    K·H·D) array and ``size`` elements of heads (k, N, H, L, D)); its serial twin for a few
    elements (a decoded token's)."""
    (kernel.serial if size <= HEADS_SERIAL else kernel)(src, dst, first)
