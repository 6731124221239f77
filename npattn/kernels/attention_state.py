"""The attention engine's arguments, grouped into records, the three views of them a work
item takes (batch_scores: a batch's own diagonal; head_of: a head's mask planes, slope and sink;
dropout_first: a head's first dropout index), and the records a work item keeps inside
(BlockPair, ForwardScratch, QueryBlock, KeyBlock, Scratch).

Each record is a ``namedtuple``: Numba compiles it as a typed tuple whose fields the kernels
read by name (``scores.offset``), and ``_jit`` keys a kernel's compiled code on the type of
every field (``_jit._arg_key``), so a record whose arrays change dtype or layout gets code of
its own. The functional layer (``functional/attention.py``) builds them once per call; the
kernels pass them down unchanged, so a new score modifier is one field here, its rule in
``kernels/score_modifiers.py`` (``key_start`` / ``key_end`` for which keys are visible, a
function for what happens to a visible score), the place of ``kernels/attention.py`` that
applies it (``mask_keys``, one rule for both layouts, or for a bias ``mask_panel`` and
``mask_tile``, or their neighbours) and the line of the functional layer that fills it in.

Dims as in ``kernels/attention.py``: B batch (broadcast, flattened), H query heads, Hkv
key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from collections import namedtuple

from numba.extending import overload

from .._jit import OVERLOAD_OPTIONS, kernel

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

#: What the backward kernel writes: dq_parts (n_splits, B, H, L, E), every entry (the items zero
#: their own rows first; with one split they scale dq too, else the caller sums the splits
#: and scales), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) per broadcast batch, and
#: dscores (B, H, L, S) -- the gradient of the masked scores -- when store_ds.
Gradients = namedtuple("Gradients", "dq_parts dk dv dscores store_ds")

#: A window side that no rule bounds: wider than any key index (key_start / key_end then lie
#: far outside 0 .. S; i + offset ± UNBOUNDED cannot overflow int64 for any array)
UNBOUNDED = 1 << 62


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
def dropout_first(dropout, b, h, n_rows, n_keys):
    """The dropout index of weight (0, 0) of head (b, h), whose batch has n_rows queries and
    n_keys keys: base[b] + h·L_b·S_b (weight (i, j) is i·S_b + j further on)."""
    return dropout.base[b] + h * n_rows * n_keys


@kernel
def head_of(scores, bh):
    """What head bh = b·H + h reads of scores: a Head."""
    plane = scores.plane_of[bh]     # (the unused mask is one plane: index 0)
    return Head(scores.bool_planes[plane if scores.mask_kind == BOOL_MASK else 0],
                scores.float_planes[plane if scores.mask_kind == FLOAT_MASK else 0],
                scores.slopes[bh if scores.alibi else 0],
                scores.sink_logits[bh if scores.sinks else 0])


# ------------------------------------------------------------ inside a work item: geometry
#: One query block against one key block of a head: query rows i0 .. i0 + rows and keys j0 ..
#: j0 + n_keys of the head's n_keys_all (its batch's S); first -- the dropout index of the
#: head's weight (0, 0) (dropout_first), so weight (i, j) is first + i·n_keys_all + j. The
#: forward's forward_pair and the backward's backward_pair / backward_tiles take it whole.
BlockPair = namedtuple("BlockPair", "i0 rows j0 n_keys n_keys_all first")

# ----------------------------------------------------------------- inside the forward kernel
#: A forward work item's scratch, allocated once (attention.py::forward_scratch): qp -- its
#: queries times scale as NR-query panels; ks -- one key block as MR-key strips; vs -- its
#: values as MR-column strips with a row of ones (ones_row); pt -- one panel's scores
#: transposed (key j, query c at pt[j·NR + c]), pt_tiles -- the same memory as (FORWARD_BK,
#: NR) tile rows; e -- the panel's probabilities transposed; block_max, shift, alpha, total
#: (NR,) -- per query of the panel, the block's max score, the exp's shift, the factor that
#: rescales the running sums, and (with dropout) the block's pre-dropout sum; tile (MR, NR);
#: and per row of the item m, l -- the running max and sum -- and ot (panels, Ev', NR) -- the
#: running output transposed, whose row Ev sums p (panel_softmax).
ForwardScratch = namedtuple("ForwardScratch", "qp ks vs pt pt_tiles e block_max shift alpha "
                                              "total tile m l ot")

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
#: kept (MR, NR) bool; capped (MR, NR) -- the slope of the soft cap at each score of the tile
#: (softcap_tile).
Scratch = namedtuple("Scratch", "wp dsp dsq ts tdp kept capped")
