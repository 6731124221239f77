"""Fused scaled dot-product attention, forward and backward (FlashAttention-2's loop nest).

Call map, from the kernels functional/attention.py calls (``_run_forward``, ``_run_backward``:
its map goes from the public ops to here) down to the tiles. ``a => b``: the parallel kernel a
runs work item b through its address (``parallel_items(b)``, ``call_body``); ``a -> b``: a calls
b. tests/test_call_maps.py checks every name and arrow::

    attention_forward_kernel  => forward_item     # prange over (b, h, block of query rows)
    forward_item   -> head_of, batch_scores, dropout_first, forward_scratch, row_at,
                      pack_lanes, key_start, key_end, forward_pair, finish_rows,
                      finish_weights
    forward_pair   -> pack_lanes, pack_columns, ones_row, key_start, key_end, micro_kernel,
                      softcap_scores, mask_panel, store_scores, panel_softmax
    mask_panel     -> every_key_visible, mask_keys, alibi_panel
    panel_softmax  -> lane_max, exp_rows, micro_kernel, keep
    finish_rows    -> join_sink
    finish_weights -> exp_nonpositive_native, keep
    attention_backward_kernel => backward_item    # prange over (b, kv head, split of keys)
    backward_item  -> batch_scores, head_of, dropout_first, key_start, key_end, row_at,
                      pack_lanes, pack_columns, pack_query_block, backward_pair,
                      unpack_columns
    pack_query_block -> pack_lanes, pack_columns
    pack_lanes     -> transpose_mr, transpose_nt    # the packing copies (vector_pack.py)
    pack_columns   -> copy_mr, copy_nr
    unpack_columns -> transpose_nt
    backward_pair  -> backward_tiles, rows_seeing, tile_add, micro_kernel, add_tile
    backward_tiles -> every_key_visible, micro_kernel, softcap_tile, mask_tile,
                      grad_row, keep_tile, transpose_mr
    mask_tile      -> every_key_visible, mask_keys, visible_keys, alibi_row
    mask_keys      -> visible_keys
    every_key_visible, visible_keys -> key_start, key_end
    keep_tile      -> keep

``micro_kernel`` and ``tile_add`` are the register tile (MR×NR, vector_tile.py: into a scratch
tile, or added straight into a matrix); the score modifiers
(``key_start``/``key_end``, ``alibi_*``, ``softcap_*``, ``join_sink``) are in
score_modifiers.py, the records (and ``batch_scores``, ``head_of``, ``dropout_first``) in
attention_state.py, ``keep`` in random.py, the exps in exp.py.

Dims: B batch (broadcast, flattened), H query heads, Hkv key/value heads (H = G·Hkv, GQA), L
queries, S keys, E query/key width, Ev value width. One (b, h) pair is a *head*.

Forward, for each work item (b, h, block of up to FORWARD_BQ query rows), streaming over
blocks of FORWARD_BK keys::

    s      = (q·scale)·kᵀ  + mask     one block of scores, never more (the micro-kernel of
                                      kernels/gemm.py, MR×NR tiles; masked entries -inf)
    m_new  = max(m, rowmax(s))        running row max
    p      = exp(s - m_new)           (kernels/exp.py); dropped entries are zeroed after the
    l      = l·exp(m - m_new) + Σ p   sum, so l is the pre-dropout denominator
    o      = o·exp(m - m_new) + (p ∘ keep / (1 - dropout_p))·v      (the micro-kernel again)
    out    = o / l,   lse = m + log l  (per row; l = 0 -- every key masked -- gives 0 and -inf)

The L×S matrix of probabilities exists only one block at a time, per thread: O(L·E) memory.
``lse`` is all backward needs to rebuild any block of probabilities exactly: p = exp(s - lse).

Backward, for each work item (b, kv head g, split of the key blocks), with the item's key
blocks packed once: for every query head of g's group, every block of BQ queries (packed
once), every key block of the item that the query block can see::

    p  = exp(s - lse) / c          recomputed, the same s as forward; c = Σ_j exp(s_j - lse)
                                   is 1 but where |lse| is so large that m + log l rounded
                                   to lse loses log l (then c = l·exp(m - lse), from forward)
    w  = p ∘ keep / (1 - dropout_p)  (the weights forward applied to v)
    dp = dout·vᵀ ∘ keep / (1 - dropout_p)
    ds = p ∘ (dp - D),  D = rowsum(dout ∘ out)  (= Σ_j p·dp: FlashAttention-2's shortcut)
    dv += wᵀ·dout,  dk += dsᵀ·q·scale,  dq += ds·k   (then dq·scale)

Each item owns its dk and dv rows outright. dq rows are shared by all key blocks: each split
adds into its own copy of dq (``dq_parts[split]``, which its item zeroes first), which the
caller sums in split order and scales -- one split when there are enough heads to keep the
threads busy, so no copy at all: then the items scale their dq rows themselves. The number
of splits depends on the shapes only, never on the thread count: the same bits everywhere.

The kernels' arguments are the records of ``kernels/attention_state.py``, passed down
unchanged: ``inputs`` (q, k, v and the broadcast index maps), ``scores`` (scale, mask, causal),
``dropout``, and what a kernel writes (``results``, ``grads``) or reads back (``saved``).
Masks are read through their broadcast shape: ``scores.bool_planes``/``float_planes`` hold
planes (Lm, Sm) with Lm in {1, L} and Sm in {1, S}, and ``scores.plane_of[b·H + h]`` says
which plane head (b, h) uses, so a (L, S) padding mask is one plane however many heads read
it. Which keys a row may see at all is one rule, ``key_start(scores, i) <= j <
key_end(scores, i)`` (causal: j <= i + offset, offset 0: top-left, PyTorch's rule, S - L:
bottom-right; a sliding window: i + offset - left <= j <= i + offset + right). Key blocks
that no query of a block can see are skipped, not computed, and so are the MR-key strips
outside those bounds in each forward panel, the backward tiles wholly outside them, and the
rows (keys) of backward's products that cannot see (be seen by) a key panel (query strip).

Dropout: weight (b, h, i, j) is kept when
``keep(dropout.stream, dropout.base[b] + (h·L + i)·S + j, dropout.threshold)``
(``kernels/random.py``; base[b] = b·H·L·S), in forward and again in backward -- no mask is
stored.

Ragged batches (varlen): batch b's queries, keys and results may be a run of rows of one
packed stack -- rows q_start[b] .. of length q_len[b], keys k_start[b] .. of length k_len[b]
(``Inputs``) -- and its diagonal offset is its own (``scores.offset[b]``). Each work item
slices its batch's rows and keys once and runs the loops above on them, with L and S its
batch's lengths: a dense call is the case of equal lengths, starts 0. No padding exists.

Layouts. Forward computes the scores transposed, MR keys × NR queries per micro-kernel tile
(a key strip times a query panel), written straight into ``pt`` (keys × NR queries): each tile
row is then a row of pᵀ as the micro-kernel's B operand reads it in oᵀ += vᵀ·pᵀ, and every
softmax step (max, exp, rescale) runs along the NR queries of a panel -- one or two vector
registers (the tile, MR×NR, is the GEMM engine's: see tiles.py). The softmax denominator comes out of the same product: the value strips carry an
extra row of ones, so oᵀ's row Ev accumulates Σ p (and its rescaling) for free. Backward
computes tiles as MR queries × NR keys and stores w and ds row by row into key panels (the B
operand of dvᵀ += doutᵀ·w and dkᵀ += qᵀ·ds, transposed back once per key block), and ds is
also transposed, in registers (``transpose_mr``), into the query strips of dq += ds·k.
Everything past a block's last row or key is packed as zero and its score is -inf, so no tile
reads outside an array and padding contributes exact zeros.

Accumulators: the input dtype (float32 in float32, as PyTorch's CPU kernels do).
"""
import math

import numpy as np
from numba import prange

from .._jit import call_body, kernel, parallel_items, thread_count
from . import _lane_max, tiles, vector_exp, vector_pack, vector_tile
from .attention_state import (BOOL_MASK, FLOAT_MASK, NO_MASK, BlockPair, ForwardScratch,
                              KeyBlock, QueryBlock, Scratch, batch_scores, dropout_first,
                              head_of)
from .score_modifiers import (alibi_panel, alibi_row, join_sink, key_end, key_start,
                              softcap_scores, softcap_tile)
from .exp import exp_nonpositive_native
from .random import keep

# This module is written once for a register tile and loaded once per tile (tiles.engine):
# its micro-kernel is the GEMM engine's kind of tile (vector_tile.py), of the attention shape.
TILE = tiles.tile_of(__name__)
MR, NR = TILE.mr, TILE.nr
micro_kernel, tile_add = vector_tile.tiles(MR, NR)[:2]

FORWARD_BK = 256   # keys per forward block (a multiple of NR and MR; measured vs 64 and 128:
                   # +5 % / +13 % at L = 1024: fewer rescales, fewer passes per score)
FORWARD_BQ = 1024  # query rows per forward work item at most (any multiple of NR: a row's
                   # result does not depend on it, so it may shrink to keep threads busy). Each
                   # key block is packed once per item: 256 -> 1024 rows measured +6-8 %
BQ = 128          # query rows per backward block (a multiple of MR)
BK = 128          # keys per backward block (a multiple of NR and of MR)
WORK_ITEMS = 8  # backward splits dq when fewer (batch, kv head) pairs than this (see caller)
CHUNK = 4       # backward: key blocks (of one item) swept per pass over the query blocks; their
                # packed k, v and dk, dv (~0.3 MiB at E = 64, float32) stay in L2

# The geometry the loops rely on, for the tile in force: whole strips (MR) and panels (NR) per
# block, and a forward panel never wider than its item.
assert FORWARD_BK % MR == 0 and FORWARD_BK % NR == 0, (TILE, FORWARD_BK)
assert FORWARD_BQ % NR == 0 and BQ % MR == 0, (TILE, FORWARD_BQ, BQ)
assert BK % MR == 0 and BK % NR == 0, (TILE, BK)


def forward_block_rows(n_heads, n_rows):
    """Query rows per forward work item (Python, once per call): FORWARD_BQ, or fewer --
    whole panels of NR -- when (heads × blocks) would leave a thread idle. Each row's result is
    the same whatever block holds it, so this may depend on the thread count."""
    threads = thread_count()
    rows = FORWARD_BQ
    while rows > NR and n_heads * -(-n_rows // rows) < 2 * threads:
        rows //= 2
    return rows


#: The packing copies (vector_pack.py): rows of MR or NR elements moved as vectors, and MR or
#: NT rows (NT: one vector register of the dtype, at most NR) transposed in registers
LANES = tiles.VECTOR_BYTES[TILE.isa] // np.dtype(TILE.dtype).itemsize
NT = min(NR, LANES)
copy_mr, transpose_mr = vector_pack.packers(MR, LANES)
copy_nr = vector_pack.packers(NR, LANES)[0]
transpose_nt = vector_pack.packers(NT, LANES)[1]
assert NR % NT == 0, (TILE, NT)


@kernel
def row_at(x, i, h, r):
    # The flat offset of x[i, h, r, 0] in a C-contiguous stack x (B, H, N, W): where the rows
    # of head (i, h) that the packing copies read start
    return ((i * x.shape[1] + h) * x.shape[2] + r) * x.shape[3]


@kernel
def pack_lanes(x, first, rows, lanes, factor, out):
    # out[(s·W + p)·lanes + r] = x.flat[first + (s·lanes + r)·W + p]·factor for x a
    # C-contiguous stack of rows of W = x.shape[-1]: `rows` rows from flat offset `first` (one
    # head's, row_at) as groups of `lanes` rows, p-major -- query strips (lanes = MR) for the
    # micro-kernel's A operand, or key panels of kᵀ / vᵀ (lanes = NR) for its B operand. A
    # whole group is transposed as vectors (vector_pack.py) and then scaled in place (the same
    # rounding as scaling each element as it is copied); the last group element by element,
    # its rows past `rows` zero.
    width = x.shape[-1]
    whole = rows // lanes
    for s in range(whole):
        src = first + s * lanes * width
        if lanes == MR:
            transpose_mr(width, x, src, width, out, s * width * MR, MR)
        else:
            for part in range(0, NR, NT):
                transpose_nt(width, x, src + part * width, width, out, s * width * NR + part,
                             NR)
    if factor != 1.0:
        for e in range(whole * width * lanes):
            out[e] = out[e] * factor
    if whole * lanes == rows:
        return
    flat = x.reshape(x.size)
    zero = out.dtype.type(0)
    group = out[whole * width * lanes:(whole + 1) * width * lanes]
    for r in range(lanes):
        if whole * lanes + r < rows:
            src = first + (whole * lanes + r) * width
            for p in range(width):
                group[p * lanes + r] = flat[src + p] * factor
        else:
            for p in range(width):
                group[p * lanes + r] = zero


@kernel
def pack_columns(x, first, rows, lanes, capacity, out):
    # out[(c·capacity + p)·lanes + j] = x.flat[first + p·W + c·lanes + j] for x a C-contiguous
    # stack of rows of W = x.shape[-1]: `rows` rows from flat offset `first` as groups of
    # `lanes` columns, p running over the rows -- v as MR-column strips for oᵀ += vᵀ·pᵀ, or k,
    # dout and q as NR-column panels for backward's products. A whole group's rows are copied
    # as vectors (vector_pack.py); the last group element by element, its columns past W zero.
    width = x.shape[-1]
    whole = width // lanes
    for c in range(whole):
        if lanes == MR:
            copy_mr(rows, x, first + c * MR, width, out, c * capacity * MR, MR)
        else:
            copy_nr(rows, x, first + c * NR, width, out, c * capacity * NR, NR)
    if whole * lanes == width:
        return
    flat = x.reshape(x.size)
    zero = out.dtype.type(0)
    cols = width - whole * lanes
    group = out[whole * capacity * lanes:(whole + 1) * capacity * lanes]
    for p in range(rows):
        src = first + p * width + whole * lanes
        dst = group[p * lanes:(p + 1) * lanes]
        for j in range(cols):
            dst[j] = flat[src + j]
        for j in range(cols, lanes):
            dst[j] = zero


@kernel
def unpack_columns(t, n_keys, x, first, factor):
    # x.flat[first + j·W + c] = t[c, j]·factor for j < n_keys, c < W = x.shape[-1]: a key
    # block's dkᵀ or dvᵀ (t (W', BK), C-contiguous) back into n_keys rows of the C-contiguous
    # stack x from flat offset `first`. NT rows of t at a time are transposed as vectors
    # (vector_pack.py) and then scaled in place (the same rounding as scaling each element as
    # it is copied); the last rows of t element by element.
    width = x.shape[-1]
    step = t.shape[1]
    whole = width // NT * NT
    for c0 in range(0, whole, NT):
        transpose_nt(n_keys, t, c0 * step, step, x, first + c0, width)
    flat = x.reshape(x.size)
    for j in range(n_keys):
        for c in range(whole, width):
            flat[first + j * width + c] = t[c, j]
    if factor != 1.0:                 # (over a slice from 0: an index from `first` on may be
        block = flat[first:first + n_keys * width]   # negative for all LLVM knows, and
        for e in range(block.shape[0]):              # Numba's wraparound test per element
            block[e] = block[e] * factor             # kept this loop scalar)


@kernel
def every_key_visible(scores, i0, n_rows, j0, n_keys):
    # Whether rows i0 .. i0 + n_rows all see keys j0 .. j0 + n_keys unchanged: no mask, no
    # bias, and the keys inside every row's key_start .. key_end (the first row has the
    # smallest key_end, the last the largest key_start). The masking's common case: nothing
    # to do.
    return (scores.mask_kind == NO_MASK and not scores.alibi
            and j0 + n_keys <= key_end(scores, i0) and j0 >= key_start(scores, i0 + n_rows - 1))


@kernel
def visible_keys(scores, i, j0, n):
    # (lo, visible): keys j0 + lo .. j0 + visible of j0 .. j0 + n lie inside query row i's
    # key_start .. key_end (none when lo >= visible)
    return max(key_start(scores, i) - j0, 0), max(min(n, key_end(scores, i) - j0), 0)


@kernel
def mask_keys(x, n_rows, n, i0, j0, scores, head):
    # x[r, j] (r < n_rows, j < x.shape[1]), the scaled score of query row i0 + r and key j0 +
    # j, becomes -inf where that key does not take part: past the last key (j >= n: padding),
    # a False in a bool mask, or outside the row's key_start .. key_end (window, causal
    # diagonal); a float mask is added. head: the head's mask planes (Lm, Sm), read through
    # their broadcast shape (head_of). The one masking rule of both layouts, compiled for each:
    # x is a backward tile (mask_tile: C order) or a forward panel seen as queries × keys
    # (mask_panel: the transpose of its key-major rows, F order). (Called once per row, with
    # the records by value, it cost backward 10-20 % with a mask or ALiBi.)
    minus_inf = x.dtype.type(-np.inf)
    width = x.shape[1]
    for r in range(n_rows):
        i = i0 + r
        row = x[r]
        lo, visible = visible_keys(scores, i, j0, n)
        if scores.mask_kind == BOOL_MASK:
            bplane = head.bool_plane
            mrow = bplane[i if bplane.shape[0] > 1 else 0]
            if mrow.shape[0] == 1:
                if not mrow[0]:
                    visible = 0
            else:
                for j in range(lo, visible):
                    if not mrow[j0 + j]:
                        row[j] = minus_inf
        elif scores.mask_kind == FLOAT_MASK:
            fplane = head.float_plane
            frow = fplane[i if fplane.shape[0] > 1 else 0]
            if frow.shape[0] == 1:
                for j in range(lo, visible):
                    row[j] += frow[0]
            else:
                for j in range(lo, visible):
                    row[j] += frow[j0 + j]
        for j in range(min(lo, visible)):
            row[j] = minus_inf
        for j in range(visible, width):
            row[j] = minus_inf


@kernel
def mask_tile(tile, i0, rows, j0, cols, scores, head):
    # mask_keys on a backward tile: tile[r, c] is the scaled score of query i0 + r and key
    # j0 + c; rows past `rows` and keys past `cols` are padding (-inf). Then ALiBi's bias on
    # each row's keys inside its bounds (a masked one stays -inf).
    if rows >= MR and cols >= NR and every_key_visible(scores, i0, MR, j0, NR):
        return
    cols = min(cols, NR)
    n_rows = min(rows, MR)
    mask_keys(tile, n_rows, cols, i0, j0, scores, head)
    tile[n_rows:] = tile.dtype.type(-np.inf)
    if scores.alibi:
        for r in range(n_rows):
            lo, visible = visible_keys(scores, i0 + r, j0, cols)
            if lo < visible:
                alibi_row(tile[r, lo:visible], head.slope, i0 + r + scores.offset, j0 + lo)


@kernel
def keep_tile(kept, stream, threshold, first, n_keys):
    # kept[r, c] = whether weight `first + r·n_keys + c` survives dropout. `first` is the
    # dropout index of the tile's (0, 0) element; rows are n_keys apart.
    for r in range(MR):
        for c in range(NR):
            kept[r, c] = keep(stream, first + r * n_keys + c, threshold)


@kernel
def add_tile(tile, dst, r0, rows, c0, width):
    # dst[r0 + r, c0 + c] += tile[r, c] for the part of the tile inside dst's rows r0 .. r0 +
    # rows and columns c0 .. width
    cols = min(NR, width - c0)
    for r in range(min(MR, rows)):
        drow = dst[r0 + r, c0:c0 + cols]
        for c in range(cols):
            drow[c] += tile[r, c]


@kernel
def mask_panel(pt, n_keys, i0, rows, j0, scores, head):
    # mask_keys on a forward panel, seen as queries × keys (the transpose of its rows):
    # pt[j·NR + c] is the scaled score of query i0 + c and key j0 + j (j < n_keys). Queries
    # past `rows` are padding: left alone (but for the bias, harmless). Then ALiBi's bias
    # across the lanes.
    if every_key_visible(scores, i0, NR, j0, n_keys):
        return
    mask_keys(pt[:n_keys * NR].reshape(n_keys, NR).T, min(NR, rows), n_keys, i0, j0, scores,
              head)
    if scores.alibi:             # after the -inf (which it keeps), across the lanes: vectorised
        alibi_panel(pt, NR, n_keys, head.slope, i0 + scores.offset, j0)


#: out[c] = max_j pt[j·NR + c] over j < n_keys, NaN ignored, for the NR lanes (generated by
#: _lane_max_generate for each panel width). The NR running maxima are named scalars, which LLVM
#: keeps in registers: held in an array (out[c] = max(out[c], x)) they go through memory on
#: every step, because LLVM cannot rule out that out and pt overlap -- measured 9× slower
#: (0.28 vs 0.03 ns per element).
lane_max = kernel(getattr(_lane_max, f"lane_max_{NR}"))
#: e[j·NR + c] = exp(pt[j·NR + c] - shift[c]): each row of a panel one vector of NR
#: (vector_exp.py; exp.exp_shifted_native's bits, without its inner loop's set-up per row)
exp_rows = vector_exp.shifted_rows(NR)
#: one row of a backward tile: p = exp(s - lse)·inv, w = p (∘ keep·scale), ds = p·(dp - D)
#: (vector_exp.py: one vector of NR keys, the bits of the scalar loop it replaced)
grad_row = vector_exp.softmax_grad_row(NR)


@kernel
def panel_softmax(fs, pn, lo, n_keys, first, n_all_keys, dropout):
    # Query panel pn (NR queries) of the item through keys lo .. n_keys of one key block (the
    # keys before lo are hidden from every query of the panel: not computed). fs
    # (ForwardScratch): fs.pt holds the panel's masked scores transposed, pt[j·NR + c] for key
    # j and query c; fs.m, fs.l the running max and sum; fs.ot[pn] (Ev', NR) the running
    # output transposed, whose row Ev (ones_row) sums p; fs.vs the block's values as MR-column
    # strips, plus that row of ones. Every loop below runs along the NR queries: one vector of
    # float32. With dropout, the ones row would sum the dropped probabilities: the pre-dropout
    # sum goes to l instead. `first` is the dropout index of the panel's (key 0, query 0)
    # weight; queries are n_all_keys apart.
    pt, e, vs, tile, ot = fs.pt, fs.e, fs.vs, fs.tile, fs.ot[pn]
    m, l = fs.m[pn * NR:(pn + 1) * NR], fs.l[pn * NR:(pn + 1) * NR]
    block_max, shift, alpha = fs.block_max, fs.shift, fs.alpha
    zero = ot.dtype.type(0)
    lane_max(pt[lo * NR:], n_keys - lo, block_max)
    for c in range(NR):
        new = max(m[c], block_max[c])
        shift[c] = zero if new == -np.inf else new  # every key so far masked: exp(-inf) = 0
        alpha[c] = math.exp(m[c] - shift[c])        # 0 when m was -inf
        m[c] = new
    a, n = lo * NR, n_keys * NR
    exp_rows(pt[a:n], shift, e[a:n])             # e = exp(s - shift), a row a vector
    if dropout.threshold > 0:
        total = fs.total
        total[:] = zero
        for j in range(lo, n_keys):
            for c in range(NR):
                total[c] += e[j * NR + c]
        for c in range(NR):
            l[c] = l[c] * alpha[c] + total[c]       # the pre-dropout denominator
        for j in range(lo, n_keys):
            for c in range(NR):
                kept = keep(dropout.stream, first + c * n_all_keys + j, dropout.threshold)
                e[j * NR + c] = e[j * NR + c] * dropout.scale if kept else zero
    for r0 in range(0, ot.shape[0], MR):   # oᵀ = oᵀ·alpha + vᵀ·pᵀ, MR value columns at a time
        micro_kernel(n_keys - lo, vs[r0 * FORWARD_BK + lo * MR:], e[a:], tile)
        for r in range(MR):
            orow = ot[r0 + r]
            for c in range(orow.shape[0]):  # (NR, read from the array: see finish_rows)
                orow[c] = orow[c] * alpha[c] + tile[r, c]


@kernel
def ones_row(vs, row, n_keys):
    # Make row `row` of the value strips vs (column `row` of v) all ones for keys < n_keys, and
    # the strip's rows after it zero, so that oᵀ += vᵀ·pᵀ also sums p: the softmax denominator
    # for free, on the micro-kernel. (The rows after it are padding, which pack_columns zeroes
    # only when they share a strip with v's last columns.)
    strip = vs[(row // MR) * FORWARD_BK * MR:(row // MR + 1) * FORWARD_BK * MR]
    lane = row % MR
    one = vs.dtype.type(1)
    zero = vs.dtype.type(0)
    for p in range(n_keys):
        strip[p * MR + lane] = one
        for r in range(lane + 1, MR):
            strip[p * MR + r] = zero


@kernel
def finish_weights(wh, i0, rows, begin, end, lseh, dropout, first):
    # wh rows i0 .. i0 + rows hold masked scores for keys begin .. end: turn them into the
    # weights exp(s - lse) (∘ keep / (1 - p)); keys outside were never visible: 0. `first` is
    # the dropout index of the head's weight (0, 0).
    n_keys_all = wh.shape[1]
    zero = wh.dtype.type(0)
    x = np.empty(max(end - begin, 0), wh.dtype)
    for r in range(rows):
        i = i0 + r
        wrow = wh[i]
        shift = lseh[i] if lseh[i] != -np.inf else wh.dtype.type(np.inf)
        for j in range(x.shape[0]):
            x[j] = wrow[begin + j] - shift
        exp_nonpositive_native(x, wrow[begin:begin + x.shape[0]])
        if dropout.threshold > 0:
            for j in range(begin, begin + x.shape[0]):
                kept = keep(dropout.stream, first + i * n_keys_all + j, dropout.threshold)
                wrow[j] = wrow[j] * dropout.scale if kept else zero
        wrow[:begin] = zero
        wrow[begin + x.shape[0]:] = zero


@kernel
def forward_scratch(like, n_panels, width, n_vcols):
    # A forward work item's scratch (ForwardScratch), of like's dtype, for n_panels query
    # panels of a head of E = width, Ev = n_vcols: one key block's strips, one panel's scores
    # and probabilities, and every panel's running max, sum and output.
    dtype = like.dtype
    vcols = (n_vcols + 1 + MR - 1) // MR * MR             # Ev + 1 rounded up to whole strips
    pt = np.empty(FORWARD_BK * NR, dtype)
    stats = np.empty((4, NR), dtype)
    return ForwardScratch(np.empty(n_panels * width * NR, dtype),          # qp
                          np.empty((FORWARD_BK // MR) * width * MR, dtype),  # ks
                          np.empty(vcols * FORWARD_BK, dtype),               # vs
                          pt, pt.reshape(FORWARD_BK, NR),                    # pt, pt_tiles
                          np.empty(FORWARD_BK * NR, dtype),                  # e
                          stats[0], stats[1], stats[2], stats[3],
                          np.empty((MR, NR), dtype),                         # tile
                          np.full(n_panels * NR, -np.inf, dtype),            # m
                          np.zeros(n_panels * NR, dtype),                    # l
                          np.zeros((n_panels, vcols, NR), dtype))            # ot


@kernel
def store_scores(wh, at, c0, lo, n_vis, pt):
    # (store_weights) query panel c0's masked scores against key block `at` into wh's rows,
    # for now (finish_weights turns them into weights); keys before lo and from n_vis on were
    # not computed: -inf
    for c in range(min(NR, at.rows - c0)):
        wrow = wh[at.i0 + c0 + c, at.j0:at.j0 + at.n_keys]
        wrow[:lo] = -np.inf
        for j in range(lo, n_vis):
            wrow[j] = pt[j * NR + c]
        wrow[n_vis:] = -np.inf


@kernel
def forward_pair(k, v, k_first, v_first, at, scores, head, dropout, wh, store_weights, fs):
    # The item's query block (rows at.i0 .. at.i0 + at.rows, packed in fs.qp) against one key
    # block (keys at.j0 .. at.j0 + at.n_keys of the head whose keys and values start at flat
    # offsets k_first of k and v_first of v): pack the block's keys and values, then for each
    # NR-query panel its scoresᵀ (tiles of MR keys × NR queries, written straight into fs.pt),
    # the soft cap, the mask and bias, the stored scores, and one online-softmax step.
    width, vwidth = k.shape[3], v.shape[3]
    i0, rows, j0, n_keys = at.i0, at.rows, at.j0, at.n_keys
    pt = fs.pt
    pack_lanes(k, k_first + j0 * width, n_keys, MR, 1.0, fs.ks)
    pack_columns(v, v_first + j0 * vwidth, n_keys, MR, FORWARD_BK, fs.vs)
    ones_row(fs.vs, vwidth, n_keys)
    for pn in range((rows + NR - 1) // NR):
        c0 = pn * NR
        # keys lo .. n_vis: those any query of the panel (padding included) may see, from a
        # whole MR-key strip
        n_vis = max(min(n_keys, key_end(scores, i0 + c0 + NR - 1) - j0), 0)
        lo = min(max(key_start(scores, i0 + c0) - j0, 0) // MR * MR, n_vis)
        for js in range(lo, n_vis, MR):                   # scoresᵀ = k·(q·scale)ᵀ
            micro_kernel(width, fs.ks[js * width:], fs.qp[c0 * width:],
                         fs.pt_tiles[js:js + MR])
        if scores.softcap > 0:                            # before masks and bias
            softcap_scores(pt[lo * NR:n_vis * NR], scores.softcap)
        mask_panel(pt[lo * NR:], n_vis - lo, i0 + c0, rows - c0, j0 + lo, scores, head)
        if store_weights:
            store_scores(wh, at, c0, lo, n_vis, pt)
        if n_vis > lo:                                    # (the rest are -inf)
            panel_softmax(fs, pn, lo, n_vis, at.first + (i0 + c0) * at.n_keys_all + j0,
                          at.n_keys_all, dropout)


@kernel
def finish_rows(oh, lseh, mh, lh, i0, rows, scores, head, dropout, fs):
    # The item's rows i0 .. i0 + rows done: out = o·alpha / l, lse = m + log l, and row_max,
    # row_sum (the sink joins the denominator here: join_sink; alpha = 1 without one). l is the
    # ones row of oᵀ, or with dropout the pre-dropout sum panel_softmax kept. l = 0 (every key
    # masked, no sink) gives 0 and -inf; NaN flows through. Per NR-query panel: the rows'
    # statistics (scalar), then o·alpha / l in place along the panel's NR queries (one vector
    # division per value column, not one scalar division per entry: at L = 64, E = 32 the
    # scalar form was 10 % of the forward), then each row copied out of the transposed panel.
    n_vcols = oh.shape[1]
    ones = n_vcols                                         # the row of oᵀ that sums p
    dtype = oh.dtype
    zero = dtype.type(0)
    one = dtype.type(1)
    m, l = fs.m, fs.l
    num, den = fs.shift, fs.alpha                          # (NR,) each; free once the key
    for pn in range((rows + NR - 1) // NR):                # blocks are done
        panel = fs.ot[pn]
        n_rows = min(NR, rows - pn * NR)
        for c in range(NR):
            num[c] = zero                                  # padding queries: 0 / 1
            den[c] = one
        for c in range(n_rows):
            r = pn * NR + c
            i = i0 + r
            if dropout.threshold == 0:
                l[r] = panel[ones, c]
            row_max, row_sum, alpha = m[r], l[r], one
            if scores.sinks:             # the sink joins the denominator: l·e^m + e^sink
                row_max, row_sum, alpha = join_sink(row_max, row_sum, alpha, head.sink)
            mh[i] = row_max
            lh[i] = row_sum
            if row_sum == 0:                               # every key masked (no sink)
                lseh[i] = -np.inf                          # (its row of out: 0, below)
            else:                                          # (NaN flows through here)
                num[c] = alpha
                den[c] = row_sum
                lseh[i] = row_max + math.log(row_sum)
        for col in range(n_vcols):         # (the trip count read from the array, not the
            prow = panel[col]              # constant NR: LLVM unrolled a 32-trip loop fully
            for c in range(prow.shape[0]):  # and left 32 scalar divisions; this way it
                prow[c] = prow[c] * num[c] / den[c]   # vectorises, checking the overlap)
        for c in range(n_rows):
            orow = oh[i0 + pn * NR + c]
            if lh[i0 + pn * NR + c] == 0:                  # exactly 0, whatever v holds
                orow[:] = zero
            else:
                for col in range(n_vcols):
                    orow[col] = panel[col, c]


@kernel
def forward_item(w, inputs, all_scores, dropout, results, block_rows, n_qb):
    # Work item w of attention_forward_kernel: query rows i0 .. i0 + rows of one head,
    # qh (L, E), kh (S, E), vh (S, Ev) -> oh (L, Ev), lseh (L,), the softmax's row max mh and
    # (pre-dropout) row sum lh (L,) with lse = m + log l, and, if store_weights, wh (L, S).
    # Rows, keys and results are batch b's own (Inputs: q_start, q_len, k_start, k_len,
    # out_batch); its query blocks are items t < its own count of the n_qb per head (the most
    # of any batch): the rest do nothing. Three steps: pack the queries, one forward_pair per
    # key block the rows can see, finish_rows (and finish_weights). (One function with the
    # loop's arguments: each level of calls is optimised again where it is linked -- see
    # _jit.ItemKernel.)
    q, k, v = inputs.q, inputs.k, inputs.v
    store_weights = results.store_weights
    n_heads = results.lse.shape[1]
    bh = w // n_qb
    b = bh // n_heads
    h = bh % n_heads
    n_rows = inputs.q_len[b]
    n_blocks = (n_rows + block_rows - 1) // block_rows
    t = w % n_qb                                   # zig-zag: under causal masking block t
    if t >= n_blocks:
        return
    qb = t // 2 if t % 2 == 0 else n_blocks - 1 - t // 2   # costs ~t: pair cheap with dear
    i0 = qb * block_rows
    rows = min(block_rows, n_rows - i0)
    head = head_of(all_scores, bh)
    scores = batch_scores(all_scores, b)
    group = n_heads // k.shape[1]
    q0, k0, ob = inputs.q_start[b], inputs.k_start[b], inputs.out_batch[b]
    q1, k1 = q0 + n_rows, k0 + inputs.k_len[b]
    k_first = row_at(k, inputs.k_batch[b], h // group, k0)     # the head's rows (flat)
    v_first = row_at(v, inputs.v_batch[b], h // group, k0)
    oh, lseh = results.out[ob, h, q0:q1], results.lse[ob, h, q0:q1]
    mh, lh = results.row_max[ob, h, q0:q1], results.row_sum[ob, h, q0:q1]
    wh = results.weights[b if store_weights else 0, h if store_weights else 0]
    n_keys_all = k1 - k0
    first = dropout_first(dropout, b, h, n_rows, n_keys_all)
    fs = forward_scratch(oh, (rows + NR - 1) // NR, k.shape[3], v.shape[3])
    pack_lanes(q, row_at(q, inputs.q_batch[b], h, q0 + i0), rows, NR, scores.scale, fs.qp)
    # keys before `begin` (its block) or at or past `end` are hidden from every row of the
    # block (key_start, key_end): not computed
    end = min(n_keys_all, max(key_end(scores, i0 + rows - 1), 0))
    begin = min(max(key_start(scores, i0), 0), end) // FORWARD_BK * FORWARD_BK
    for j0 in range(begin, end, FORWARD_BK):
        forward_pair(k, v, k_first, v_first, BlockPair(i0, rows, j0, min(FORWARD_BK, n_keys_all - j0),
                                       n_keys_all, first),
                     scores, head, dropout, wh, store_weights, fs)
    finish_rows(oh, lseh, mh, lh, i0, rows, scores, head, dropout, fs)
    if store_weights:
        finish_weights(wh, i0, rows, begin, end, lseh, dropout, first)


@parallel_items(forward_item)
def attention_forward_kernel(item, inputs, scores, dropout, results, block_rows, n_qb):
    # inputs, scores, dropout -> results (records: attention_state.py). Each work item
    # (forward_item, passed as `item`) owns block_rows rows of one head (b, h); n_qb items
    # per head, the most query blocks of any batch (forward_blocks).
    n_batch, n_heads = inputs.q_len.shape[0], results.lse.shape[1]
    for w in prange(n_batch * n_heads * n_qb):
        call_body(item, (np.int64(w), inputs, scores, dropout, results, block_rows, n_qb))


@kernel
def backward_tiles(qb, kb, at, scores, head, dropout, sc, dsh, store_ds):
    # Every MR×NR tile (MR queries × NR keys) of one (query block, key block) pair `at`
    # (BlockPair): scores and dout·vᵀ by the micro-kernel, then p, w and ds (module
    # docstring). w and ds are stored row by row into key panels (sc.wp, sc.dsp: [(panel·BQ
    # + i)·NR + c], queries i as p -- the B operand of dvᵀ += doutᵀ·w and dkᵀ += qᵀ·ds), and
    # ds transposed into query strips (sc.dsq, for dq += ds·k). p = exp(s - lse)·inv with qb's
    # per-row lse, inv and d (see QueryBlock).
    i0, rows, j0, n_keys, n_keys_all = at.i0, at.rows, at.j0, at.n_keys, at.n_keys_all
    width = kb.kt.shape[0] // BK
    vwidth = kb.vt.shape[0] // BK
    n_strips = (rows + MR - 1) // MR
    lse_r, inv_r, d_r = qb.lse, qb.inv, qb.d
    wp, dsp, dsq, ts, tdp, kept, capped = sc
    clear = every_key_visible(scores, i0, rows, j0, n_keys)  # no tile of the pair is masked
    for s in range(n_strips):                                # (the common case: then a whole
        r0 = s * MR                                          # tile skips mask_tile's call)
        for c0 in range(0, n_keys, NR):
            panel = (c0 // NR) * BQ * NR
            if (j0 + c0 >= key_end(scores, i0 + r0 + MR - 1)        # every key of the tile
                    or j0 + c0 + NR <= key_start(scores, i0 + r0)):  # is hidden:
                for r in range(MR):                                 # p = w = ds = 0
                    for c in range(NR):
                        dsp[panel + (r0 + r) * NR + c] = 0
                        wp[panel + (r0 + r) * NR + c] = 0
                        dsq[(s * BK + c0 + c) * MR + r] = 0
                continue
            micro_kernel(width, qb.qs[r0 * width:], kb.kt[c0 * width:], ts)
            if scores.softcap > 0:                         # before masks and bias, as forward
                softcap_tile(ts, sc.capped, scores.softcap)
            if not (clear and r0 + MR <= rows and c0 + NR <= n_keys):
                mask_tile(ts, i0 + r0, rows - r0, j0 + c0, n_keys - c0, scores, head)
            micro_kernel(vwidth, qb.dos[r0 * vwidth:], kb.vt[c0 * vwidth:], tdp)
            if dropout.threshold > 0:
                keep_tile(kept, dropout.stream, dropout.threshold,
                          at.first + (i0 + r0) * n_keys_all + j0 + c0, n_keys_all)
            dropped = dropout.threshold > 0
            for r in range(MR):                  # p, w, ds: one row a vector (vector_exp.py)
                row = panel + (r0 + r) * NR
                grad_row(ts[r], tdp[r], kept[r], dropped, dropout.scale, lse_r[r0 + r],
                         inv_r[r0 + r], d_r[r0 + r], dsp[row:row + NR], wp[row:row + NR])
            if store_ds:                                   # the gradient of the masked scores
                for r in range(min(MR, rows - r0)):
                    out = dsh[i0 + r0 + r, j0 + c0:j0 + min(n_keys, c0 + NR)]
                    for c in range(out.shape[0]):
                        out[c] = dsp[panel + (r0 + r) * NR + c]
            if scores.softcap > 0:                         # ... and through the cap: that of
                for r in range(MR):                        # q·kᵀ·scale, for dq and dk
                    drow = dsp[panel + (r0 + r) * NR:panel + (r0 + r + 1) * NR]
                    for c in range(NR):
                        drow[c] = drow[c] * capped[r, c]
            # ds transposed into the query strip: dsq[(s·BK + c0 + c)·MR + r] = the tile's
            # ds[r, c] (its MR rows of NR, transposed in registers: vector_pack.py)
            transpose_mr(NR, dsp, panel + r0 * NR, NR, dsq, (s * BK + c0) * MR, MR)


@kernel
def rows_seeing(scores, i0, rows, k0, k1):
    # (r0, r1): rows i0 + r0 .. i0 + r1 of the block i0 .. i0 + rows are those that may see
    # a key of k0 .. k1 (key_end(i) > k0 and key_start(i) < k1) -- a contiguous range, as
    # both bounds are non-decreasing in i. Every row, for attention without causal or window.
    r0 = 0
    while r0 < rows and key_end(scores, i0 + r0) <= k0:
        r0 += 1
    r1 = rows
    while r1 > r0 and key_start(scores, i0 + r1 - 1) >= k1:
        r1 -= 1
    return r0, r1


@kernel
def backward_pair(qb, kb, at, dqh, dkt, dvt, scores, head, dropout, dsh, store_ds, sc):
    # One query block (rows at.i0 .. at.i0 + at.rows, packed: qb) against one key block (keys
    # at.j0 .. at.j0 + at.n_keys, packed: kb): dkt, dvt (E', BK), (Ev', BK) accumulate the key
    # block's gradients transposed; dqh (L, E) gets ds·k. Each product runs over the rows
    # (keys) that can see (be seen by) its keys (rows) only: the rest of w and ds is exactly 0.
    backward_tiles(qb, kb, at, scores, head, dropout, sc, dsh, store_ds)
    i0, rows, j0, n_keys = at.i0, at.rows, at.j0, at.n_keys
    width = dqh.shape[1]
    n_strips = (rows + MR - 1) // MR
    ts = sc.ts
    for c0 in range(0, n_keys, NR):                        # dvᵀ += doutᵀ·w, dkᵀ += qᵀ·ds
        panel = (c0 // NR) * BQ * NR
        p0, p1 = rows_seeing(scores, i0, rows, j0 + c0, j0 + c0 + NR)
        if p1 <= p0:
            continue
        for r0 in range(0, dvt.shape[0], MR):              # (whole tiles: E', Ev' whole
            tile_add(p1 - p0, qb.doc[r0 * BQ + p0 * MR:], sc.wp[panel + p0 * NR:], dvt, r0,
                     c0)                                   # strips, BK whole panels)
        for r0 in range(0, dkt.shape[0], MR):
            tile_add(p1 - p0, qb.qc[r0 * BQ + p0 * MR:], sc.dsp[panel + p0 * NR:], dkt, r0, c0)
    for s in range(n_strips):                              # dq += ds·k
        k0 = min(max(key_start(scores, i0 + s * MR) - j0, 0), n_keys)   # the keys the
        k1 = min(max(key_end(scores, i0 + s * MR + MR - 1) - j0, k0), n_keys)  # strip sees
        if k1 <= k0:
            continue
        for c0 in range(0, width, NR):
            ds_strip = sc.dsq[(s * BK + k0) * MR:]
            k_panel = kb.kp[(c0 // NR) * BK * NR + k0 * NR:]
            if s * MR + MR <= rows and c0 + NR <= width:   # a whole tile: added in registers
                tile_add(k1 - k0, ds_strip, k_panel, dqh, i0 + s * MR, c0)
            else:
                micro_kernel(k1 - k0, ds_strip, k_panel, ts)
                add_tile(ts, dqh, i0 + s * MR, rows - s * MR, c0, width)


@kernel
def pack_query_block(q, q_first, dout, d_first, doh, oh, lseh, normh, i0, rows, scale, qb):
    # The query block's operands for backward_pair, packed once into qb (QueryBlock) and used
    # against every key block: q·scale and dout as query strips, qᵀ and doutᵀ as column
    # strips over queries (the head's rows of q and dout start at flat offsets q_first and
    # d_first; doh are those of dout); per row its logsumexp (+inf where fully masked or
    # padding, so p = 0), 1 / its normaliser normh -- Σ_j exp(s_j - lse), 1 unless |lse| is so
    # large that its rounding swallowed log l (the caller's _normalisers) -- and D = dout·out.
    q_at = q_first + i0 * q.shape[3]
    d_at = d_first + i0 * dout.shape[3]
    pack_lanes(q, q_at, rows, MR, scale, qb.qs)
    pack_lanes(dout, d_at, rows, MR, 1.0, qb.dos)
    pack_columns(q, q_at, rows, MR, BQ, qb.qc)
    pack_columns(dout, d_at, rows, MR, BQ, qb.doc)
    lse_r, inv_r, d_r = qb.lse, qb.inv, qb.d
    inf = q.dtype.type(np.inf)
    for r in range((rows + MR - 1) // MR * MR):
        if r < rows:
            lse_i = lseh[i0 + r]
            lse_r[r] = inf if lse_i == -np.inf else lse_i
            inv_r[r] = q.dtype.type(1) / normh[i0 + r]
            total = q.dtype.type(0)
            for c in range(doh.shape[1]):
                total += doh[i0 + r, c] * oh[i0 + r, c]
            d_r[r] = total
        else:
            lse_r[r] = inf
            inv_r[r] = 1
            d_r[r] = 0


@kernel
def zero_rows(x, zero):
    # x[:] = 0 for x (rows, W), one head's dq rows (the item's own: zeroed in its thread, in
    # its cache, not by the caller beforehand)
    for r in range(x.shape[0]):
        row = x[r]
        for c in range(row.shape[0]):
            row[c] = zero


@kernel
def scale_rows(x, factor):
    # x *= factor for x (rows, W): dq·scale once its key blocks are all added
    for r in range(x.shape[0]):
        row = x[r]
        for c in range(row.shape[0]):
            row[c] = row[c] * factor


@kernel
def backward_item(w, inputs, all_scores, dropout, saved, grads):
    # Work item w of attention_backward_kernel: it owns dk, dv of its key blocks and
    # dq_parts[split] of its heads, in batch b's own rows and keys (as forward_item)
    q, k, v = inputs.q, inputs.k, inputs.v
    lse, store_ds = saved.lse, grads.store_ds
    n_splits = grads.dq_parts.shape[0]
    n_heads = lse.shape[1]
    n_kv = k.shape[1]
    width = k.shape[3]
    vwidth = v.shape[3]
    wcols = (width + MR - 1) // MR * MR                   # E and Ev rounded up to whole strips
    vcols = (vwidth + MR - 1) // MR * MR
    group = n_heads // n_kv
    dtype = q.dtype
    b = w // (n_kv * n_splits)
    g = (w // n_splits) % n_kv
    split = w % n_splits
    scores = batch_scores(all_scores, b)
    n_rows, n_keys_all = inputs.q_len[b], inputs.k_len[b]
    q0, k0, ob = inputs.q_start[b], inputs.k_start[b], inputs.out_batch[b]
    q1, k1 = q0 + n_rows, k0 + n_keys_all
    n_kb = (n_keys_all + BK - 1) // BK
    qb = QueryBlock(np.empty(BQ * width, dtype), np.empty(BQ * vwidth, dtype),
                    np.empty(wcols * BQ, dtype), np.empty(vcols * BQ, dtype),
                    np.empty(BQ, dtype), np.empty(BQ, dtype), np.empty(BQ, dtype))
    sc = Scratch(np.empty(BK * BQ, dtype), np.empty(BK * BQ, dtype), np.empty(BQ * BK, dtype),
                 np.empty((MR, NR), dtype), np.empty((MR, NR), dtype),
                 np.empty((MR, NR), np.bool_), np.empty((MR, NR), dtype))
    k_first = row_at(k, inputs.k_batch[b], g, k0)       # the kv head's rows (flat)
    v_first = row_at(v, inputs.v_batch[b], g, k0)
    n_own = (n_kb - split + n_splits - 1) // n_splits   # key blocks split, split + n_splits..
    kt = np.empty((n_own, (BK // NR) * width * NR), dtype)           # each packed once
    vt = np.empty((n_own, (BK // NR) * vwidth * NR), dtype)
    kp = np.empty((n_own, ((width + NR - 1) // NR) * BK * NR), dtype)
    dkt = np.zeros((n_own, wcols, BK), dtype)           # their dk and dv, transposed
    dvt = np.zeros((n_own, vcols, BK), dtype)
    for h in range(g * group, (g + 1) * group):          # this split's dq rows start at 0
        zero_rows(grads.dq_parts[split, ob, h, q0:q1], dtype.type(0))
    for o in range(n_own):
        j0 = (split + o * n_splits) * BK
        n_keys = min(BK, n_keys_all - j0)
        pack_lanes(k, k_first + j0 * width, n_keys, NR, 1.0, kt[o])
        pack_lanes(v, v_first + j0 * vwidth, n_keys, NR, 1.0, vt[o])
        pack_columns(k, k_first + j0 * width, n_keys, NR, BK, kp[o])
    for o0 in range(0, n_own, CHUNK):             # CHUNK key blocks at a time stay in L2
        for h in range(g * group, (g + 1) * group):
            bh = b * n_heads + h
            head = head_of(all_scores, bh)
            q_first = row_at(q, inputs.q_batch[b], h, q0)
            d_first = row_at(saved.dout, ob, h, q0)
            doh = saved.dout[ob, h, q0:q1]
            dqh = grads.dq_parts[split, ob, h, q0:q1]
            dsh = grads.dscores[b if store_ds else 0, h if store_ds else 0]
            first = dropout_first(dropout, b, h, n_rows, n_keys_all)
            o1 = min(o0 + CHUNK, n_own)
            for i0 in range(0, n_rows, BQ):
                rows = min(BQ, n_rows - i0)
                start = key_start(scores, i0)           # no row of the block sees a key
                last = key_end(scores, i0 + rows - 1)   # before start or at or past last
                if ((split + o0 * n_splits) * BK >= last
                        or (split + (o1 - 1) * n_splits) * BK + BK <= start):
                    continue
                pack_query_block(q, q_first, saved.dout, d_first, doh,
                                 saved.out[ob, h, q0:q1], lse[ob, h, q0:q1],
                                 saved.norm[ob, h, q0:q1], i0, rows, scores.scale, qb)
                for o in range(o0, o1):
                    j0 = (split + o * n_splits) * BK
                    if j0 >= last or j0 + BK <= start:
                        continue
                    at = BlockPair(i0, rows, j0, min(BK, n_keys_all - j0), n_keys_all, first)
                    backward_pair(qb, KeyBlock(kt[o], vt[o], kp[o]), at, dqh, dkt[o], dvt[o],
                                  scores, head, dropout, dsh, store_ds, sc)
    if n_splits == 1:                             # one split: dq = its part·scale, here, in
        scale = dtype.type(scores.scale)          # the dtype (as the caller's dq *= scale)
        for h in range(g * group, (g + 1) * group):
            scale_rows(grads.dq_parts[0, ob, h, q0:q1], scale)
    dk_first = row_at(grads.dk, ob, g, k0)
    dv_first = row_at(grads.dv, ob, g, k0)
    for o in range(n_own):                        # dk (scaled) and dv: transposed back
        j0 = (split + o * n_splits) * BK
        n_keys = min(BK, n_keys_all - j0)
        unpack_columns(dkt[o], n_keys, grads.dk, dk_first + j0 * width, scores.scale)
        unpack_columns(dvt[o], n_keys, grads.dv, dv_first + j0 * vwidth, 1.0)


@parallel_items(backward_item)
def attention_backward_kernel(item, inputs, scores, dropout, saved, grads):
    # inputs, scores, dropout as forward, saved -> grads (records: attention_state.py). Each
    # work item (backward_item, passed as `item`) owns the dk and dv of its key blocks of one
    # (b, kv head) and dq_parts[split] of that head's query heads.
    n_splits = grads.dq_parts.shape[0]
    n_batch, n_kv = inputs.q_len.shape[0], inputs.k.shape[1]
    for w in prange(n_batch * n_kv * n_splits):
        call_body(item, (np.int64(w), inputs, scores, dropout, saved, grads))
