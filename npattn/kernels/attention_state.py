"""The attention engine's arguments, grouped into records, and the one rule of which keys a
query row may see (key_start <= j < key_end).

Each record is a ``namedtuple``: Numba compiles it as a typed tuple whose fields the kernels
read by name (``scores.offset``), and ``_jit`` keys a kernel's compiled code on the type of
every field (``_jit._arg_key``), so a record whose arrays change dtype or layout gets code of
its own. The functional layer (``functional/attention.py``) builds them once per call; the
kernels pass them down unchanged, so a new score modifier is one field here, the code that
reads it (:func:`key_start` / :func:`key_end` for which keys are visible, ``mask_tile`` /
``mask_panel`` of ``kernels/attention.py`` for what happens to a visible score) and the line
of the functional layer that fills it in.

Dims as in ``kernels/attention.py``: B batch (broadcast, flattened), H query heads, Hkv
key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from collections import namedtuple

import numpy as np
from numba.extending import overload

from .._jit import OVERLOAD_OPTIONS, exact_kernel, fma_kernel, kernel
from .tanh import SMALL, series_native, tanh_slope_native

NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2

#: The operands as stacks, and which stored batch each broadcast batch b reads:
#: q (Bq, H, L, E), k (Bk, Hkv, S, E), v (Bv, Hkv, S, Ev); q_batch, k_batch, v_batch (B,)
#: int64 -- broadcasting repeats indices, never data. Batch b's own rows and keys (all int64
#: (B,)): its queries are rows q_start[b] .. q_start[b] + q_len[b] of its query stack, its keys
#: rows k_start[b] .. k_start[b] + k_len[b] of its key and value stacks, and its results (and
#: saved arrays and gradients) are those same rows of result batch out_batch[b]. Dense calls:
#: every start 0, lengths L and S, out_batch[b] = b. A packed variable-length batch (varlen):
#: B sequences in one stack (Bq = Bk = Bv = 1, L = total_q, S = total_k), the starts the
#: prefix sums cu_seqlens, out_batch[b] = 0. Within a batch every index below (i, j, the
#: window, the diagonal) counts from its own first row and key.
Inputs = namedtuple("Inputs", "q k v q_batch k_batch v_batch q_start q_len k_start k_len "
                              "out_batch")

#: How a score s = (q·scale)·k is formed and modified before the softmax, and which keys take
#: part. scale: a Python float (float64: q·scale and dk·scale are each rounded once, to the
#: dtype). mask_kind: NO_MASK, BOOL_MASK or FLOAT_MASK;
#: bool_planes / float_planes (Nm, Lm, Sm), Lm in {1, L}, Sm in {1, S}: the mask's planes, read
#: through their broadcast shape (the unused kind is one plane, never read); plane_of (B·H,)
#: int64: the plane head b·H + h reads. offset (int64): query i's diagonal is key i + offset
#: (0: top-left, S - L: bottom-right); causal (bool): keys past the diagonal are hidden;
#: window_left, window_right (int64, UNBOUNDED for no bound): only keys
#: i + offset - window_left <= j <= i + offset + window_right take part (key_start, key_end);
#: alibi (bool): slopes (B·H,) of the query dtype add -slope·|i + offset - j| to head b·H + h's
#: scaled scores (ALiBi; a one-element placeholder when off). softcap (a Python float, 0: off):
#: each scaled score s becomes softcap·tanh(s / softcap) first, before masks and bias (Gemma 2).
#: sinks (bool): sink_logits (B·H,) of the query dtype, head b·H + h's sink logit, which joins
#: every row's softmax denominator -- exp(sink) beside each exp(s_j) -- with no value (gpt-oss);
#: a one-element placeholder when off.
Scores = namedtuple("Scores", "scale mask_kind bool_planes float_planes plane_of causal offset "
                              "window_left window_right alibi slopes softcap sinks sink_logits")

#: What one head (b, h) reads of Scores (head_of): its bool and float mask planes (Lm, Sm), its
#: ALiBi slope and its sink logit.
Head = namedtuple("Head", "bool_plane float_plane slope sink")

#: Dropout of the weights: weight (b, h, i, j) is kept when
#: ``random.keep(stream, base[b] + (h·L_b + i)·S_b + j, threshold)`` (L_b, S_b: batch b's
#: q_len and k_len), and a kept one is multiplied by scale = 1 / (1 - p). threshold 0: no
#: dropout. base (B,) int64: H·Σ_{c<b} L_c·S_c, the masks (H, L_b, S_b) of the batches one
#: after the other -- dense calls: b·H·L·S, so the index is ((b·H + h)·L + i)·S + j.
#: (``stream``: the counter-based generator's key, from the seed -- kernels/random.py.)
Dropout = namedtuple("Dropout", "stream threshold scale base")

#: What the forward kernel writes: out (B, H, L, Ev); lse, row_max, row_sum (B, H, L) with
#: lse = row_max + log row_sum (row_sum before dropout); weights (B, H, L, S) when
#: store_weights (else a (1, 1, 1, 1) placeholder).
ForwardResults = namedtuple("ForwardResults", "out lse row_max row_sum weights store_weights")

#: What the backward kernel reads besides the inputs: dout, out (B, H, L, Ev), lse (B, H, L),
#: norm (B, H, L) -- each row's Σ_j exp(s_j - lse), 1 unless lse lost log l to rounding.
Saved = namedtuple("Saved", "dout out lse norm")

#: What the backward kernel writes: dq_parts (n_splits, B, H, L, E) unscaled (the caller sums
#: the splits and scales), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) per broadcast batch, and
#: dscores (B, H, L, S) -- the gradient of the masked scores -- when store_ds.
Gradients = namedtuple("Gradients", "dq_parts dk dv dscores store_ds")

#: A window side that no rule bounds: wider than any key index (key_start / key_end then lie
#: far outside 0 .. S; i + offset ± UNBOUNDED cannot overflow int64 for any array)
UNBOUNDED = 1 << 62


@kernel
def key_start(scores, i):
    """Keys j < key_start(scores, i) are hidden from query row i: i + offset - window_left
    (may be < 0: from key 0). Non-decreasing in i, so a block's first row has its smallest."""
    return i + scores.offset - scores.window_left


@kernel
def key_end(scores, i):
    """Keys j >= key_end(scores, i) are hidden from query row i: i + offset + window_right +
    1, and at most i + offset + 1 under causal (may be <= 0: no key). Non-decreasing in i, so
    a block's last row has its largest. Between key_start and key_end a mask may still hide
    keys; outside them the kernels skip every block and tile."""
    diagonal = i + scores.offset
    end = diagonal + scores.window_right + 1
    if scores.causal:
        end = min(end, diagonal + 1)
    return end


def batch_scores(scores, b):
    """scores as batch b's work items read it: offset is b's own, an int64 (scores.offset[b]),
    every other field as it stands. (Compiled: the overload below, which lists the fields of
    Scores whatever they are. This body runs without the JIT.)"""
    return scores._replace(offset=scores.offset[b])


@overload(batch_scores, jit_options=OVERLOAD_OPTIONS)
def _batch_scores(scores, b):
    fields = ", ".join("scores.offset[b]" if name == "offset" else f"scores.{name}"
                       for name in Scores._fields)
    namespace = {"Scores": Scores}
    exec(f"def batch_scores(scores, b):\n    return Scores({fields})", namespace)
    return namespace["batch_scores"]


@kernel
def head_of(scores, bh):
    """What head bh = b·H + h reads of scores: a Head."""
    plane = scores.plane_of[bh]     # (the unused mask is one plane: index 0)
    return Head(scores.bool_planes[plane if scores.mask_kind == BOOL_MASK else 0],
                scores.float_planes[plane if scores.mask_kind == FLOAT_MASK else 0],
                scores.slopes[bh if scores.alibi else 0],
                scores.sink_logits[bh if scores.sinks else 0])


@exact_kernel
def alibi_row(row, slope, diagonal, j0):
    """row[c] -= slope·|diagonal - (j0 + c)|: ALiBi's distance bias on the scores of keys
    j0, j0 + 1, ... of one query row whose diagonal is key `diagonal`. exact_kernel (no FMA
    contraction, product and difference each rounded as written): forward (mask_panel) and
    backward (mask_tile) form the same scores, to the bit, wherever each copy is inlined."""
    for c in range(row.shape[0]):
        row[c] = row[c] - slope * row.dtype.type(abs(diagonal - (j0 + c)))


@exact_kernel
def alibi_panel(pt, lanes, n_keys, slope, diagonal, j0):
    """alibi_row for a panel of scores stored transposed, pt[j·lanes + c] for key j0 + j and
    the query whose diagonal is diagonal + c: each element as alibi_row rounds it (the same
    bits), the loop running along the lanes (contiguous: it vectorises)."""
    for j in range(n_keys):
        for c in range(lanes):
            pt[j * lanes + c] = pt[j * lanes + c] - slope * pt.dtype.type(
                abs(diagonal + c - (j0 + j)))


@fma_kernel
def softcap_scores(x, cap):
    """x[k] = cap·tanh(x[k] / cap) for scores x (n,) (the forward's panels), x / cap taken as
    x·(1/cap) (1/cap rounded once to the dtype). First y in place, counting the |y| >= SMALL
    (NaN too); with none, tanh's series alone (the bits the full form selects there, at about
    half its cost). The same bits as softcap_tile gives the same score in backward (tanh.py:
    one way to fuse each multiply-add)."""
    c = x.dtype.type(cap)
    inv = x.dtype.type(1.0 / cap)
    small = x.dtype.type(SMALL)
    far = 0
    for k in range(x.shape[0]):
        y = x[k] * inv
        x[k] = y
        far += not abs(y) < small
    if far == 0:
        for k in range(x.shape[0]):
            y = x[k]
            x[k] = c * np.copysign(series_native(abs(y)), y)
    else:
        for k in range(x.shape[0]):
            t, _ = tanh_slope_native(x[k])
            x[k] = c * t


@fma_kernel
def softcap_tile(tile, slope, cap):
    """softcap_scores for a backward tile (MR, NR), and the cap's derivative at each score,
    d(cap·tanh(s/cap))/ds = 1 - tanh²(s/cap), into slope (MR, NR)."""
    c = tile.dtype.type(cap)
    inv = tile.dtype.type(1.0 / cap)
    small = tile.dtype.type(SMALL)
    one = tile.dtype.type(1)
    far = 0
    for r in range(tile.shape[0]):
        row = tile[r]
        for k in range(row.shape[0]):
            y = row[k] * inv
            row[k] = y
            far += not abs(y) < small
    for r in range(tile.shape[0]):
        row, srow = tile[r], slope[r]
        if far == 0:
            for k in range(row.shape[0]):
                y = row[k]
                t = np.copysign(series_native(abs(y)), y)
                row[k] = c * t
                srow[k] = one - t * t
        else:
            for k in range(row.shape[0]):
                t, d = tanh_slope_native(row[k])
                row[k] = c * t
                srow[k] = d


# ---------------------------------------------------------------- inside the backward kernel
#: One query block packed for backward_pair (rows i0 .. i0 + rows, padded to whole MR strips):
#: qs, dos -- q·scale and dout as MR-query strips; qc, doc -- qᵀ and doutᵀ as column strips
#: over the queries; per row lse (+inf where fully masked or padding, so p = 0), inv (1 / its
#: normaliser) and d = rowsum(dout ∘ out).
QueryBlock = namedtuple("QueryBlock", "qs dos qc doc lse inv d")

#: One key block packed for backward_pair: kt, vt -- k and v as NR-key panels (the
#: micro-kernel's B operand of s = q·kᵀ and dout·vᵀ); kp -- k as NR-column panels over the
#: keys (B operand of dq += ds·k).
KeyBlock = namedtuple("KeyBlock", "kt vt kp")

#: A backward work item's scratch, allocated once: wp, dsp -- w and ds of one block pair as key
#: panels; dsq -- ds as query strips; ts, tdp (MR, NR) -- one tile of scores and of dout·vᵀ;
#: kept (MR, NR) bool; x, p (MR·NR,) -- s - lse and its exp; capped (MR, NR) -- the slope of
#: the soft cap at each score of the tile (softcap_tile).
Scratch = namedtuple("Scratch", "wp dsp dsq ts tdp kept x p capped")
