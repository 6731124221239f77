"""The matrix-multiply engine: C[t] = op(A[a_index[t]]) · op(B[b_index[t]]) (+ bias) (+ C[t]).

Call map, from the functional layer's products to the register tile (``a -> b``: a calls b;
``a => b``: a hands b on -- a work item through its address, ``parallel_items(b)``, or a
kernel chosen as ``run = b.serial if ... else b``). tests/test_call_maps.py checks every name
and arrow::

    functional/linear.py::linear_forward -> tiles.gemm   # (linear_backward, matmul: the same)
    tiles.gemm     -> engine, kernels/gemm.py::gemm   # engine("gemm", dtype): this module
    gemm           -> gemm_kernel, _index, _plan, _packing_space, _small_columns
    _plan          -> _row_block, item_space    # (kept per shapes and thread count)
    gemm           => batched_gemm_kernel, small_dot_kernel    # or their .serial twins
    gemm           -> column_sum_kernel    # row_sums on the unpacked path (kernels/linear.py)
    gemm_kernel    => pack_item, rows_item    # per K block: pack B's panels, then C's rows
    pack_item      -> op_b_blocks, pack_b_panel
    rows_item      -> op_b_blocks, start_rows, pack_a_block, add_row_sums, block_product
    batched_gemm_kernel => batch_item
    batch_item     -> op_b_blocks, item_space, start_rows, pack_b_block, pack_a_block,
                      add_row_sums, block_product
    pack_b_block   -> pack_b_panel, copy_nr  # (a row-major B row by row; Bᵀ and edges by panel)
    pack_b_panel   -> copy_nr, transpose_bt  # the packing copies (vector_pack.py)
    pack_a_block   -> copy_mr, transpose_mr
    block_product  -> micro_add, micro_store, micro_kernel  # the MR×NR tile (vector_tile.py)
    small_dot_kernel -> add_four, add_eight
    add_eight      -> add_four

Every linear layer and every matrix product of npattn, forward and backward, runs here.
Dims: T output batches, M rows of C, N columns, K the inner dim; op(X) is X or Xᵀ.

The loop nest (BLIS's, with B packed one K block at a time)::

    for kb          K blocks of KC, in order             (K order fixed: the same bits at
      pack B          for every (b-matrix, NR-wide        any thread count)
                      column panel), in parallel: bp[ib, panel] = the KC×NR slice of op(B)
                      in K block kb, row-major, zero-padded
      prange          over work items (t, row block of MC rows): each owns C[t, rows, :]
        C rows        = C + (bias or 0), at kb = 0 if accumulating
        pack A        ap = the MC×kc slice of op(A), as MR-row strips, p-major
        for chunk     NC-wide column chunks of C         (KC×NC of packed B: ~L2)
          for strip   MR-row strips of the block         (ap strip: kc×MR, ~L1)
            for panel NR-wide column panels of the chunk (bp[ib, panel]: KC×NR)
              micro   tile = strip · panel               (MR×NR accumulators in registers;
                                                          a whole tile is added into C by
                                                          micro_add, an edge tile via scratch)
              C[rows, cols] += tile, clipped to C's edge (kb = 0, not accumulating: stored
                                                          as (0 + (bias or 0)) + tile, by
                                                          micro_store: STORE_FIRST)

          ┌──────── N ────────┐          A strip (kc×MR) ─┐
        ┌ ┌──┬──┬──┬──┐      │                            ▼
        M │MR│  │  │  │ ... ← C tile (MR×NR) += Σ_p a[p, 0:MR] ⊗ b[p, 0:NR]
        └ └──┴──┴──┴──┘                                    ▲
                                           B panel (kc×NR) ┘

Tile: MR×NR, one per instruction set and dtype (``tiles.py``: 8×32 float32 and 8×16 float64 on
AVX-512, 6×16 and 6×8 on AVX2, with the measurements that chose them), written as explicit
vector code (``vector_tile.py``). This module is written once
for a tile and loaded once per tile it serves (``tiles.engine("gemm", dtype)``): MR and NR are
constants of each instance, so each compiles its own kernels. KC = 256 and NC = 512: an A
strip (256×MR) stays in L1 while the chunk's B panels (256×512 float32 = 512 KiB) come from
L2; other KC (128…512) and MC (96…384) measured within ±3 % on AVX-512. MC is chosen per call
so that the work items share out evenly among the threads and an A block stays within L2.

Edges: the packed copies hold whole tiles (B zero-padded; the rows of an A strip past C's last
row hold whatever the buffer held, and their results are never stored), so the micro-kernel
never reads out of bounds; it writes its MR×NR tile to a scratch array, of which only the part
inside C is added.

Determinism: each C element is owned by one work item and summed as
``(((C or 0) + (bias or 0)) + Σ_{k in block 0}) + Σ_{k in block 1} + ...``, each block's sum in
k order, whatever the thread count or MC.

Three kernels: ``gemm_kernel`` is the nest above; ``batched_gemm_kernel`` runs the product in
one launch, its work items packing their own B a K block at a time into their own slots of a
kept buffer -- from ``BATCHED`` output batches per thread one item per batch (a batched
backward would otherwise copy a whole operand first), and otherwise one item per thread's
share of the rows, for products up to ``PACKED_SMALL`` multiply-adds (up to ``SERIAL_PACKED``
on the calling thread) and for larger ones whose items have ``ONE_LAUNCH_ROWS`` rows or whose
packed K block of B fits in ``ONE_LAUNCH_B`` bytes: each thread's B then sits in its own
core's cache, and the threads meet once per call instead of twice per K block. So
``gemm_kernel`` is left with few rows against a wide B, where packing B once for all pays.
These sum in the same order, so which one ran never shows in the bits.
``small_dot_kernel`` computes small A·Bᵀ products (the linear layer's form, up to ``SMALL``
multiply-adds) as dot products with no packing; LLVM splits each of its k loops into vector
partial sums, so its bits differ from the packed kernels' by rounding. Which of the three runs
depends on the shapes only, never on the thread count, so the result of a call is bitwise
reproducible.

Accumulator: the input dtype (float32 in float32, as OpenBLAS and PyTorch do).
"""
import threading

import numpy as np
from numba import prange

from .._jit import call_body, kernel, parallel_items, parallel_kernel, thread_count
from . import tiles, vector_pack, vector_tile
from .linear import column_sum_kernel

TILE = tiles.tile_of(__name__)   # this instance's tile (see tiles.py)
MR, NR = TILE.mr, TILE.nr

KC = 256
NC = 512      # columns per chunk in block_product (measured vs none: +3–8 % float32 n = 512…2048)
MC_MAX = 192  # rows per work item at most: an A block of 192×256 float32 is 192 KiB
#: Up to this many multiply-adds, A·Bᵀ (the linear layer's form) runs as plain dot products:
#: packing costs more than it saves there (measured: 10×64×256 9 µs vs 19 µs packed; 64×64×256
#: 28 vs 29; 64×128×256 48 vs 47). A·B and Aᵀ·B have no such fast unpacked form.
SMALL = 1 << 20
#: small_dot_kernel splits the columns when fewer pairs of rows than this, so that a decoded
#: token (one row) runs on every thread (measured on Zen 4, one row 384 · 1152×384 float32,
#: the kernel alone: 33.5 µs on 1 thread, 16 µs on 2; 1 thread was all one row had before)
SMALL_ITEMS = 8
SMALL_COLS = 64  # columns per small_dot_kernel item at least
#: Up to this many multiply-adds small_dot_kernel runs serially (its twin, the same bits): a
#: launch of the thread pool costs more than it saves (measured on Zen 4, one row 128 · 128×128:
#: 1.7 µs serial, 3.3 µs on 2 threads; 128 · 384×128: 3.7 vs 4.4; 128 · 512×128: 4.8 vs 4.9)
SERIAL_MACS = 1 << 16
BATCHED = 4  # output batches per thread from which batched_gemm_kernel takes over
#: Up to this many multiply-adds a packed product runs in one launch (batched_gemm_kernel, an
#: item per thread's rows, each packing the B it needs) instead of two launches per K block
#: (measured on Zen 3, 2 threads, µs one launch / two per K block, float32: n = 64 40 / 55,
#: 128 101 / 118, 192 205 / 224, 256 422 / 421, 512 3494 / 3033; float64 alike)
PACKED_SMALL = 1 << 23
#: Up to this many multiply-adds it runs on the calling thread (the serial twin: no launch;
#: measured as above: n = 32 35 µs against 39 in one launch, n = 64 50 against 40)
SERIAL_PACKED = 1 << 15
#: Past PACKED_SMALL, batched_gemm_kernel still runs the product in one launch, an item per
#: thread's share of the rows, each packing all of op(B) itself into its own kept space, when
#: an item has this many rows or more or one K block of packed B is at most ONE_LAUNCH_B
#: bytes (it stays in the core's L2); else gemm_kernel packs B once for all (two launches
#: per K block). Each item's B then sits in its own core's cache and the threads meet once
#: per call. Measured on Zen 4, 2 threads, one launch against two per K block, the same bits,
#: two interleaved runs: float32 n = 256 / 512 / 1024 / 2048 1.30-1.42 / 1.14-1.21 / 1.02-1.09
#: / 1.02-1.06x, the baby GPT's 768×128·128×384 1.10-1.13x, its dW (K = 768) 1.09-1.51x, the
#: 6-layer's 2048×384·384×1536 1.01-1.03x; float64 0.96-1.41x; but with few rows and a wide B
#: (items of 32-64 rows, 2-8 MiB K blocks) 0.82-0.98x. Inside a GPT step, on operands other
#: ops just wrote, the gain is smaller: the products 1.02x (baby) and 1.01x (6-layer)
ONE_LAUNCH_ROWS = 256
ONE_LAUNCH_B = 1 << 20
KEPT_SPACE = 64 << 20  # bytes of packing space each Python thread keeps between calls at most
NO_BIAS = {np.dtype(t): np.zeros(0, t) for t in (np.float32, np.float64)}  # "no bias": (0,)
NO_SUMS = {np.dtype(t): np.zeros((0, 0), t) for t in (np.float32, np.float64)}  # no row_sums

#: The micro-kernel's prefetches (vector_tile.tiles), AVX-512 tiles only: each k step asks for
#: the packed row of B PREFETCH_B_ROWS steps ahead, and a whole tile's rows of C are asked for
#: before its k loop. Measured on an Intel Xeon (Emerald Rapids) with `python -m
#: benchmarks.engine_ab nopf:PREFETCH_B_ROWS=0,PREFETCH_C=False` (both in one process,
#: interleaved), the GPT's products on 2 threads: 0.90-1.30× faster with them (the large shapes
#: 1.01-1.08×), float64 1.08-1.18×; 1 thread 0.98-1.03×; training steps 0.98-1.07× (baby) and
#: 1.07-1.13× (6-layer); B 16 rows ahead as 8. The AVX2 tiles on the same CPU (haswell code):
#: 0.95-1.05×, nothing to keep, so they do not prefetch. The tile alone in L1
#: (benchmarks.micro_kernel times it without prefetch) loses ~3 % to them. On Zen 4 (EPYC, 2
#: threads, one run): the large products 1.05-1.06× faster with them, 768×128·128×384 1.00×,
#: 768×512·512×128 0.94×, a 6-layer step 1.00×; kept on AMD's AVX-512 too.
PREFETCH_B_ROWS = 8 if TILE.isa == "avx512" else 0
PREFETCH_C = TILE.isa == "avx512"
#: The first K block of a product that does not accumulate stores its tiles into C as
#: (0 + bias) + tile (micro_store) instead of start_rows writing C = 0 + bias and the tiles
#: adding into it: one pass over C instead of three, the same bits. Measured on Zen 4 (EPYC,
#: 2 threads) with `python -m benchmarks.engine_ab nostore:STORE_FIRST=False`, three runs:
#: the GPT's products 0.95-1.04× as fast without it in float32 (the large shapes 0.98-1.02×),
#: 0.95-0.98× in float64; training steps 0.95× (baby) and 0.98× (6-layer) without it.
STORE_FIRST = True
#: k's per partial sum of add_row_sums: kernels/linear.py's BLOCK (the same bits as its
#: column_sum_kernel). Summing the bias gradient there instead of in a pass of its own
#: (docs/architecture.md §4.1): training steps 1.008-1.009× (baby) and 1.013× (6-layer) on
#: Zen 4, the two linear_backwards alternating step by step in one process
SUM_BLOCK = 64

#: tile (MR, NR) = ap strip (kc×MR) · bp panel (kc×NR), and the same sums added straight into
#: a whole tile of C (no scratch): explicit vector code (vector_tile.py)
micro_kernel, micro_add, micro_store = vector_tile.tiles(MR, NR, PREFETCH_B_ROWS, PREFETCH_C)
#: the packing copies (vector_pack.py): A strips of MR, B panels of NR, and a Bᵀ panel's rows
#: transposed BT at a time (one vector register of the dtype: BT rows of BT columns)
LANES = tiles.VECTOR_BYTES[TILE.isa] // np.dtype(TILE.dtype).itemsize
BT = min(NR, LANES)
copy_mr, transpose_mr = vector_pack.packers(MR, LANES)
copy_nr = vector_pack.packers(NR, LANES)[0]
transpose_bt = vector_pack.packers(BT, LANES)[1]

# The blocking follows from the tile: whole strips and panels per block and chunk.
assert NC % NR == 0 and MC_MAX % MR == 0 and NR % BT == 0, (TILE, NC, MC_MAX)
assert KC % SUM_BLOCK == 0, (KC, SUM_BLOCK)


@kernel
def pack_b_panel(b, ib, trans_b, k0, kc, j0, cols, panel):
    # panel (KC·NR,) <- the kc×NR slice of op(B) at (k0, j0), row-major, zero-padded past C's
    # last column (rows past kc are never read). A whole panel is copied as vectors
    # (vector_pack.py); an edge panel element by element, through views that start at 0 (an
    # offset index would need Numba's negative-index guard on every access).
    if cols == NR and trans_b:                       # op(B)[k, j] = b[ib, j, k]: NR rows of
        n_inner = b.shape[2]                         # b side by side, BT at a time
        first = (ib * b.shape[1] + j0) * n_inner + k0
        for q in range(NR // BT):
            transpose_bt(kc, b, first + q * BT * n_inner, n_inner, panel, q * BT, NR)
        return
    if cols == NR:                                   # op(B)[k, j] = b[ib, k, j]: kc rows of
        n_cols = b.shape[2]                          # NR, one vector each
        copy_nr(kc, b, (ib * b.shape[1] + k0) * n_cols + j0, n_cols, panel, 0, NR)
        return
    for p in range(kc):
        row = panel[p * NR:(p + 1) * NR]
        for j in range(cols, NR):
            row[j] = 0
    if trans_b:
        src = b[ib, j0:j0 + cols, k0:k0 + kc]
        for j in range(cols):
            for p in range(kc):
                panel[p * NR + j] = src[j, p]
    else:
        src = b[ib, k0:k0 + kc, j0:j0 + cols]
        for p in range(kc):
            for j in range(cols):
                panel[p * NR + j] = src[p, j]


@kernel
def pack_b_block(b, ib, trans_b, k0, kc, n_cols, panels):
    # every panel of op(B)'s K block at k0 for n_cols columns: panels[(panel·KC + p)·NR + j]
    # (batch_item's packing). A row-major B is read row by row, each row once and in order;
    # panel by panel, each row is touched once per panel, and on a B that is not in cache
    # (a batched product's operands) that cost up to 1.6x the item's time (Zen 3, one
    # thread: 32 products of 64×512·512×512, 23.3 against 18.7 ms). An op(B) = Bᵀ is packed
    # panel by panel: each panel's source rows are whole rows of b.
    n_panels = (n_cols + NR - 1) // NR
    whole = n_cols // NR if not trans_b else 0
    if whole:                                        # row p's whole panels: one vector each
        row0 = (ib * b.shape[1] + k0) * b.shape[2]
        for p in range(kc):
            copy_nr(whole, b, row0 + p * b.shape[2], NR, panels, p * NR, KC * NR)
    for panel in range(whole, n_panels):
        j0 = panel * NR
        pack_b_panel(b, ib, trans_b, k0, kc, j0, min(NR, n_cols - j0),
                     panels[panel * KC * NR:(panel + 1) * KC * NR])


@kernel
def pack_a_block(a, ia, trans_a, r0, rows, k0, kc, ap):
    # ap <- rows r0 .. r0 + rows of op(A), columns k0 .. k0 + kc, as MR-row strips: strip s
    # holds ap[(s * kc + p) * MR + i]. Rows past the block's end keep stale values: their
    # results are never stored. A whole strip is copied as vectors (vector_pack.py).
    for s in range((rows + MR - 1) // MR):
        strip = ap[s * kc * MR:(s + 1) * kc * MR]
        valid = min(MR, rows - s * MR)
        if valid == MR and trans_a:                  # op(A)[m, k] = a[ia, k, m]: kc rows of
            n_rows = a.shape[2]                      # MR, one vector each
            copy_mr(kc, a, (ia * a.shape[1] + k0) * n_rows + r0 + s * MR, n_rows, strip, 0, MR)
        elif valid == MR:                            # op(A)[m, k] = a[ia, m, k]: MR rows of
            n_inner = a.shape[2]                     # a side by side
            transpose_mr(kc, a, (ia * a.shape[1] + r0 + s * MR) * n_inner + k0, n_inner,
                         strip, 0, MR)
        elif trans_a:
            src = a[ia, k0:k0 + kc, r0 + s * MR:r0 + s * MR + valid]
            for p in range(kc):
                for i in range(valid):
                    strip[p * MR + i] = src[p, i]
        else:
            src = a[ia, r0 + s * MR:r0 + s * MR + valid, k0:k0 + kc]
            for i in range(valid):
                for p in range(kc):
                    strip[p * MR + i] = src[i, p]


@kernel
def add_row_sums(a, ia, trans_a, r0, rows, k0, kc, ap, sums, first):
    # sums[i] (+)= Σ_p op(A)[r0 + i, k0 + p] for the block's rows i < rows and its kc k's,
    # while the block is in cache -- the row sums of op(A) at the cost of a pass over L1/L2
    # instead of one over A (a linear layer's bias gradient Σ_rows dout, during its weight
    # gradient doutᵀ·x). `first`: the first K block (the sums start at 0). Summed as
    # kernels/linear.py's column_sum_kernel sums: SUM_BLOCK k's apart, each block's sum then
    # added, k in order -- the same bits (KC is a multiple of SUM_BLOCK, so the blocks fall
    # alike). With trans_a (doutᵀ) the rows of op(A) lie side by side in a's rows, which
    # pack_a_block just read: the sums run along them, a vector over the block's rows per k,
    # as column_sum_kernel's do. Else (op(A) = a) from the packed strips, MR rows side by
    # side per k (a short loop: that case is not the linear layer's).
    zero = sums.dtype.type(0)
    if first:
        sums[:] = zero
    part = np.empty(rows, sums.dtype)
    for p0 in range(0, kc, SUM_BLOCK):
        p1 = min(p0 + SUM_BLOCK, kc)
        part[:] = zero
        if trans_a:
            for p in range(k0 + p0, k0 + p1):
                row = a[ia, p, r0:r0 + rows]     # (a 1-D view: indexing a[ia, p, r0 + i]
                for i in range(rows):            # instead ran 8x slower, not vectorised)
                    part[i] += row[i]
        else:
            for s in range((rows + MR - 1) // MR):
                valid = min(MR, rows - s * MR)
                for p in range(p0, p1):
                    for i in range(valid):
                        part[s * MR + i] += ap[(s * kc + p) * MR + i]
        for i in range(rows):
            sums[i] += part[i]


@kernel
def start_rows(ct, r0, rows, bias, accumulate):
    # C rows r0 .. r0 + rows start as (C or 0) + (bias or 0)
    zero = ct.dtype.type(0)
    has_bias = bias.shape[0] > 0
    for i in range(rows):
        crow = ct[r0 + i]
        for j in range(crow.shape[0]):
            crow[j] = (crow[j] if accumulate else zero) + (bias[j] if has_bias else zero)


@kernel
def block_product(ap, panels, kc, ct, r0, rows, out, store, bias):
    # ct[r0 .. r0 + rows, :] += (packed A block) · (packed K block of op(B), all panels), or
    # with `store` (the first K block of a product that does not accumulate), ct's rows =
    # (0 + (bias or 0)) + that product, whatever they held: start_rows' sums, in one pass.
    # NC-wide column chunks, strips outside panels: the strip stays in L1 across a chunk's
    # panels, the chunk's panels (KC×NC) in L2, and C's rows are walked left to right.
    n_cols = ct.shape[1]
    n_panels = (n_cols + NR - 1) // NR
    zero = ct.dtype.type(0)
    has_bias = bias.shape[0] > 0
    for q0 in range(0, n_panels, NC // NR):
        for s in range((rows + MR - 1) // MR):
            for panel in range(q0, min(q0 + NC // NR, n_panels)):
                j0 = panel * NR
                cols = min(NR, n_cols - j0)
                bpanel = panels[panel * KC * NR:(panel + 1) * KC * NR]
                if cols == NR and rows - s * MR >= MR:    # a whole tile: added in registers
                    if store:
                        micro_store(kc, ap[s * kc * MR:], bpanel, ct, r0 + s * MR, j0, bias)
                    else:
                        micro_add(kc, ap[s * kc * MR:], bpanel, ct, r0 + s * MR, j0)
                    continue
                micro_kernel(kc, ap[s * kc * MR:], bpanel, out)  # an edge tile: via scratch
                for i in range(min(MR, rows - s * MR)):  # the part inside C
                    crow = ct[r0 + s * MR + i, j0:j0 + cols]
                    for j in range(cols):
                        if store:
                            crow[j] = (zero + (bias[j0 + j] if has_bias else zero)) + out[i, j]
                        else:
                            crow[j] += out[i, j]


@kernel
def op_b_blocks(b, trans_b, n_cols):
    # (K, its blocks of KC, the panels of NR columns) of op(B) for n_cols columns of C
    n_inner = b.shape[2] if trans_b else b.shape[1]
    return n_inner, (n_inner + KC - 1) // KC, (n_cols + NR - 1) // NR


@kernel
def pack_item(w, kb, a, b, c, bias, sums, a_index, b_index, trans_a, trans_b, accumulate, mc, bp):
    # Work item w of gemm_kernel's packing loop for K block kb: packed panel w of that block of
    # op(B) for every b-matrix, bp[(ib · n_panels + panel) · KC · NR + p · NR + j]
    n_cols = c.shape[2]
    n_inner, n_kb, n_panels = op_b_blocks(b, trans_b, n_cols)
    panel_size = KC * NR
    j0 = (w % n_panels) * NR
    pack_b_panel(b, w // n_panels, trans_b, kb * KC, min(KC, n_inner - kb * KC), j0,
                 min(NR, n_cols - j0), bp[w * panel_size:(w + 1) * panel_size])


@kernel
def rows_item(w, kb, a, b, c, bias, sums, a_index, b_index, trans_a, trans_b, accumulate, mc, bp):
    # Work item w of gemm_kernel's product loop for K block kb: C[t, i0:i0 + rows] += its
    # packed A block times the packed block of op(B) (at kb = 0 the rows start as (C or 0) +
    # (bias or 0): start_rows, or block_product's stores)
    n_batch, n_rows, n_cols = c.shape
    n_inner, n_kb, n_panels = op_b_blocks(b, trans_b, n_cols)
    panel_size = KC * NR
    n_mb = (n_rows + mc - 1) // mc
    t = w // n_mb
    i0 = (w % n_mb) * mc
    rows = min(mc, n_rows - i0)
    ap = np.empty(mc * KC, c.dtype)             # the packed A block of this item
    out = np.empty((MR, NR), c.dtype)           # one micro-kernel tile (edges)
    store = kb == 0 and STORE_FIRST and not accumulate
    if kb == 0 and not store:
        start_rows(c[t], i0, rows, bias, accumulate)
    kc = min(KC, n_inner - kb * KC)
    pack_a_block(a, a_index[t], trans_a, i0, rows, kb * KC, kc, ap)
    if sums.shape[0] > 0:
        add_row_sums(a, a_index[t], trans_a, i0, rows, kb * KC, kc, ap, sums[t, i0:i0 + rows],
                     kb == 0)
    first = b_index[t] * n_panels * panel_size
    block_product(ap, bp[first:first + n_panels * panel_size], kc, c[t], i0, rows, out, store,
                  bias)


@parallel_items(pack_item, rows_item, indices=2)
def gemm_kernel(pack, block, a, b, c, bias, sums, a_index, b_index, trans_a, trans_b, accumulate,
                mc, bp):
    # a (Ba, M, K), or (Ba, K, M) if trans_a · b (Bb, K, N), or (Bb, N, K) if trans_b
    # -> c (T, M, N); bias (N,) or (0,) for none; sums (T, M): each row's Σ_k op(A)[t][i, k]
    # (add_row_sums), or (0, 0) for none; bp: packing space for one K block of op(B),
    # all b-matrices. One K block at a time: first that block of op(B) is packed, each item
    # (pack_item, passed as `pack`) owning one panel; then each item (rows_item, as `block`)
    # adds its block of mc rows of one C[t] times it. The packed block (KC×N per b-matrix)
    # stays in the shared cache for the products that read it right after.
    n_batch, n_rows, n_cols = c.shape
    n_inner, n_kb, n_panels = op_b_blocks(b, trans_b, n_cols)
    n_mb = (n_rows + mc - 1) // mc
    need = b.shape[0] * n_panels * KC * NR             # one K block of op(B), every b-matrix
    if bp.shape[0] < need:                             # a space too small: one of its own
        bp = np.empty(need, c.dtype)                   # (packing never runs past it)
    for kb in range(n_kb):
        k = np.int64(kb)
        for w in prange(b.shape[0] * n_panels):
            call_body(pack, (np.int64(w), k, a, b, c, bias, sums, a_index, b_index, trans_a,
                             trans_b, accumulate, mc, bp))
        for w in prange(n_batch * n_mb):
            call_body(block, (np.int64(w), k, a, b, c, bias, sums, a_index, b_index, trans_a,
                              trans_b, accumulate, mc, bp))


@kernel
def item_space(n_cols, mc):
    # elements of batch_item's packing space: one K block of op(B) for n_cols columns of C
    # (whole panels), then an A block of mc rows
    return (n_cols + NR - 1) // NR * KC * NR + mc * KC


@kernel
def batch_item(w, a, b, c, bias, sums, a_index, b_index, trans_a, trans_b, accumulate, mc,
               item_rows, space):
    # Work item w of batched_gemm_kernel: rows w·item_rows .. of one C[t] (all of them when
    # item_rows >= M), in blocks of mc rows; it packs the K blocks of op(B) it needs itself,
    # into its own slot w of `space` (item_space elements each), or into a buffer of its own
    # when `space` is empty or has no whole slot w
    n_batch, n_rows, n_cols = c.shape
    n_inner, n_kb, n_panels = op_b_blocks(b, trans_b, n_cols)
    n_items = (n_rows + item_rows - 1) // item_rows
    t = w // n_items
    r0 = (w % n_items) * item_rows
    r1 = min(r0 + item_rows, n_rows)
    panel_size = KC * NR
    size = item_space(n_cols, mc)
    fits = space.shape[0] >= (w + 1) * size      # (else, or empty: a buffer of its own --
    slot = space[w * size:(w + 1) * size] if fits else np.empty(size, c.dtype)  # never past it)
    panels = slot[:n_panels * panel_size]
    ap = slot[n_panels * panel_size:]
    out = np.empty((MR, NR), c.dtype)
    store = STORE_FIRST and not accumulate and n_kb > 0    # the first K block stores
    if not store:
        start_rows(c[t], r0, r1 - r0, bias, accumulate)
    for kb in range(n_kb):
        k0 = kb * KC
        kc = min(KC, n_inner - k0)
        pack_b_block(b, b_index[t], trans_b, k0, kc, n_cols, panels)
        for i0 in range(r0, r1, mc):
            rows = min(mc, r1 - i0)
            pack_a_block(a, a_index[t], trans_a, i0, rows, k0, kc, ap)
            if sums.shape[0] > 0:
                add_row_sums(a, a_index[t], trans_a, i0, rows, k0, kc, ap,
                             sums[t, i0:i0 + rows], kb == 0)
            block_product(ap, panels, kc, c[t], i0, rows, out, store and kb == 0, bias)


@parallel_items(batch_item, twin=True)
def batched_gemm_kernel(item, a, b, c, bias, sums, a_index, b_index, trans_a, trans_b, accumulate,
                        mc, item_rows, space):
    # The same product in one launch, each work item (batch_item) owning item_rows rows of one
    # C[t] and packing the K blocks of B it needs, one at a time, into a buffer that stays in
    # cache. For many output batches (an item per C[t]: instead of packing all of B up front --
    # for a batched backward, a copy of a 32 MiB operand) and for small products (an item per
    # block of rows: one launch instead of two per K block; B packed once per item). The sums
    # run in the same order as gemm_kernel's: the same bits.
    n_items = c.shape[0] * ((c.shape[1] + item_rows - 1) // item_rows)
    for w in prange(n_items):
        call_body(item, (np.int64(w), a, b, c, bias, sums, a_index, b_index, trans_a, trans_b,
                         accumulate, mc, item_rows, space))


@kernel
def add_four(crow, n0, stop, s0, s1, s2, s3):
    # crow[n0 .. min(n0 + 4, stop)] += (s0, s1, s2, s3): columns at or past `stop` belong to
    # another work item (or lie past the row), and are left alone
    width = min(4, stop - n0)
    crow[n0] += s0
    if width > 1:
        crow[n0 + 1] += s1
    if width > 2:
        crow[n0 + 2] += s2
    if width > 3:
        crow[n0 + 3] += s3


@kernel
def add_eight(crow, n0, stop, s0, s1, s2, s3, s4, s5, s6, s7):
    # crow[n0 .. min(n0 + 8, stop)] += (s0, ..., s7), as add_four
    add_four(crow, n0, stop, s0, s1, s2, s3)
    if n0 + 4 < stop:
        add_four(crow, n0 + 4, stop, s4, s5, s6, s7)


@parallel_kernel(twin=True)
def small_dot_kernel(a, b, c, bias, a_index, b_index, accumulate, cols):
    # C = A·Bᵀ for small problems, unpacked: each C element is a dot product of two contiguous
    # rows. A 2×4 block of C at a time shares each load (6 loads per 8 multiply-adds instead of
    # 2 per 1; measured on the article's 10×512·512×64: 6.6 µs vs 9.4 µs for 1×4); LLVM
    # vectorises each k loop into partial sums. a (Ba, M, K) · b (Bb, N, K) -> c (T, M, N).
    # Work items: (batch, pair of rows, block of `cols` columns, a multiple of 4) -- column
    # blocks let one row (a decoded token's x·Wᵀ) use every thread. Each element's sum is the
    # same code whichever item computes it, so `cols` never changes the bits. A row alone (a
    # decoded token's, or an odd last row) runs 1×8 blocks instead of a 2×4 block with itself:
    # the same eight k loops, half the work (one row 128 · 384×128, Zen 3: 3.9 against
    # 5.7 µs), and the same vector partial sums -- the same bits as in a pair (tested).
    n_batch, n_rows, n_cols = c.shape
    n_inner = a.shape[2]
    has_bias = bias.shape[0] > 0
    zero = c.dtype.type(0)
    n_pairs = (n_rows + 1) // 2
    n_blocks = (n_cols + cols - 1) // cols
    for w in prange(n_batch * n_pairs * n_blocks):  # each owns C[t, m:m + 2, j0:j1]
        t = w // (n_pairs * n_blocks)
        m = (w // n_blocks % n_pairs) * 2
        j0 = (w % n_blocks) * cols
        j1 = min(j0 + cols, n_cols)
        rows = min(2, n_rows - m)
        at = a[a_index[t]]
        a0 = at[m]
        a1 = at[m + rows - 1]                       # (a row alone: not read)
        bt = b[b_index[t]]
        for i in range(rows):                       # C starts as (C or 0) + (bias or 0)
            crow = c[t, m + i]
            for n in range(j0, j1):
                crow[n] = (crow[n] if accumulate else zero) + (bias[n] if has_bias else zero)
        c0 = c[t, m]
        if rows == 1:                               # a row alone: 1×8 blocks
            last = n_cols - 1                       # past the last column: recomputed, unstored
            for n0 in range(j0, j1, 8):
                b0, b1, b2, b3 = bt[n0], bt[min(n0 + 1, last)], bt[min(n0 + 2, last)], \
                    bt[min(n0 + 3, last)]
                b4, b5, b6, b7 = bt[min(n0 + 4, last)], bt[min(n0 + 5, last)], \
                    bt[min(n0 + 6, last)], bt[min(n0 + 7, last)]
                s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
                for k in range(n_inner):
                    x0 = a0[k]
                    s0 += x0 * b0[k]
                    s1 += x0 * b1[k]
                    s2 += x0 * b2[k]
                    s3 += x0 * b3[k]
                    s4 += x0 * b4[k]
                    s5 += x0 * b5[k]
                    s6 += x0 * b6[k]
                    s7 += x0 * b7[k]
                add_eight(c0, n0, j1, s0, s1, s2, s3, s4, s5, s6, s7)
            continue
        c1 = c[t, m + 1]                            # a pair of rows: 2×4 blocks
        for n0 in range(j0, j1, 4):
            n1 = min(n0 + 1, n_cols - 1)            # past the last column: recomputed, unstored
            n2 = min(n0 + 2, n_cols - 1)
            n3 = min(n0 + 3, n_cols - 1)
            b0, b1, b2, b3 = bt[n0], bt[n1], bt[n2], bt[n3]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero
            for k in range(n_inner):
                x0 = a0[k]
                x1 = a1[k]
                s00 += x0 * b0[k]
                s01 += x0 * b1[k]
                s02 += x0 * b2[k]
                s03 += x0 * b3[k]
                s10 += x1 * b0[k]
                s11 += x1 * b1[k]
                s12 += x1 * b2[k]
                s13 += x1 * b3[k]
            add_four(c0, n0, n_cols, s00, s01, s02, s03)
            add_four(c1, n0, n_cols, s10, s11, s12, s13)


def gemm(a, b, c, *, bias=None, a_index=None, b_index=None, trans_a=False, trans_b=False,
         accumulate=False, row_sums=None):
    """Run the engine: c[t] (=|+=) op(a[a_index[t]]) · op(b[b_index[t]]) (+ bias).

    The functional layer's entry point; its arguments are already checked and C-contiguous.
    a, b: 3-D stacks of matrices (or 2-D: one matrix); c: (T, M, N) (or (M, N)), written in
    place. a_index, b_index: int64 (T,), default 0..T-1 (or all 0 when a stack holds one
    matrix). row_sums: None, or a C-contiguous array of c's dtype shaped as c without its
    last dim, (T, M) (or (M,)), written with each row's Σ_k op(a[a_index[t]])[i, k], summed
    block by block as A is packed (add_row_sums; the bits of kernels/linear.py's
    column_sum_kernel); it needs N > 0 unless M or K is 0. Allocates the packing space and
    picks the row-block size MC (neither changes the result's bits).
    """
    # (every line here counts: a decoded token's products are mostly this Python. a[None] is
    # the view a reshape would give, at a sixth of its cost)
    a3 = a[None] if a.ndim == 2 else a
    b3 = b[None] if b.ndim == 2 else b
    c3 = c[None] if c.ndim == 2 else c
    n_batch, n_rows, n_cols = c3.shape
    if n_batch == 1:
        a_index = _ONE_BATCH if a_index is None else a_index
        b_index = _ONE_BATCH if b_index is None else b_index
    else:
        a_index = _index(a_index, a3.shape[0], n_batch)
        b_index = _index(b_index, b3.shape[0], n_batch)
    n_inner = b3.shape[2] if trans_b else b3.shape[1]
    if n_inner == 0 or c.size == 0:                 # an empty sum: C is the bias, or zero
        if not accumulate:
            c[...] = 0 if bias is None else bias
        elif bias is not None:
            c += bias
        if row_sums is not None and row_sums.size:
            if n_inner:
                raise ValueError(f"row_sums needs a product with columns; got C of shape "
                                 f"{c.shape} from an inner dim of {n_inner}")
            row_sums[...] = 0
        return c
    bias = NO_BIAS[c.dtype] if bias is None else bias
    sums = NO_SUMS[c.dtype] if row_sums is None else row_sums.reshape(n_batch, n_rows)
    work = n_batch * n_rows * n_cols * n_inner
    if trans_b and not trans_a and work <= SMALL:
        if work <= SERIAL_MACS:                 # one thread: the columns need no split
            small_dot_kernel.serial(a3, b3, c3, bias, a_index, b_index, accumulate, n_cols)
        else:
            small_dot_kernel(a3, b3, c3, bias, a_index, b_index, accumulate,
                             _small_columns(n_batch * -(-n_rows // 2), n_cols))
        for t in range(n_batch if row_sums is not None else 0):   # (nothing packed here:
            column_sum_kernel(np.ascontiguousarray(a3[a_index[t]].T), sums[t])  # its sums)
        return c
    key = (n_batch, n_rows, n_cols, n_inner, b3.shape[0], c.itemsize, thread_count())
    one_launch, mc, item_rows, size = _plans.get(key) or _plan(key)
    if one_launch:
        space = (_packing_space(size, c.dtype) if size * c.itemsize <= KEPT_SPACE
                 else NO_BIAS[c.dtype])         # (empty: each item allocates its own)
        run = batched_gemm_kernel.serial if work <= SERIAL_PACKED else batched_gemm_kernel
        run(a3, b3, c3, bias, sums, a_index, b_index, trans_a, trans_b, accumulate, mc,
            item_rows, space)
        return c
    gemm_kernel(a3, b3, c3, bias, sums, a_index, b_index, trans_a, trans_b, accumulate, mc,
                _packing_space(size, c.dtype))
    return c


_plans = {}    # a packed product's shapes and thread count -> _plan's answer (a few µs each)
MAX_PLANS = 4096


def _plan(key):
    """(one launch?, MC, rows per item, elements of packing space) of a packed product, a
    function of its ``key`` -- (T, M, N, K, b-matrices stored, itemsize, threads): the shapes
    and the thread count alone, none of which changes the bits -- kept in ``_plans``: a small
    product's Python is most of its time (n = 128: 45 µs in all)."""
    n_batch, n_rows, n_cols, n_inner, b_stored, itemsize, threads = key
    work = n_batch * n_rows * n_cols * n_inner
    if n_batch >= BATCHED * threads:
        item_rows = n_rows
    else:
        item_rows = _row_block(n_rows, n_batch, threads, n_rows)
    if (n_batch >= BATCHED * threads or work <= PACKED_SMALL or item_rows >= ONE_LAUNCH_ROWS
            or -(-n_cols // NR) * NR * KC * itemsize <= ONE_LAUNCH_B):
        mc = _row_block(item_rows, 1, 1, MC_MAX)
        n_items = n_batch * -(-n_rows // item_rows)
        plan = True, mc, item_rows, n_items * item_space(n_cols, mc)
    else:
        packed_b = b_stored * -(-n_cols // NR) * KC * NR     # one K block of op(B)
        plan = False, _row_block(n_rows, n_batch, threads, MC_MAX), n_rows, packed_b
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


_spaces = threading.local()    # each Python thread's packing space: {dtype: array}


def _packing_space(size, dtype):
    """``size`` elements of ``dtype`` for the packed B of one call: the calling thread's buffer,
    kept between calls up to ``KEPT_SPACE`` bytes, so that a product does not fault in fresh
    pages each time (measured on Zen 4: 6–12 % of a product's time was packing B, partly
    page faults on a new buffer per call). One per Python thread: calls from several threads
    never share one."""
    spaces = getattr(_spaces, "arrays", None)
    if spaces is None:
        spaces = _spaces.arrays = {}
    space = spaces.get(dtype)
    if space is None or space.size < size:
        space = np.empty(size, dtype)
        if space.nbytes <= KEPT_SPACE:
            spaces[dtype] = space
    return space[:size]


def _small_columns(n_pairs, n_cols):
    """Columns per small_dot_kernel work item: all of them when there are SMALL_ITEMS pairs of
    rows or more, else a multiple of 4 that makes about SMALL_ITEMS items, at least
    SMALL_COLS wide. A function of the shapes only (it never changes the bits anyway)."""
    if n_pairs >= SMALL_ITEMS:
        return n_cols
    blocks = -(-SMALL_ITEMS // n_pairs)
    return max(SMALL_COLS, 4 * -(-n_cols // (4 * blocks)))


def _row_block(n_rows, n_batch, threads, most):
    """Rows per block, a whole number of strips, at most ``most`` (rounded up to whole strips):
    a work item's rows (most = n_rows: as many as the threads allow), or MC, the rows packed
    at a time (most = MC_MAX).

    The work items (n_batch × row blocks) are shared out among the threads statically, so
    their count is made a multiple of the thread count where the rows allow: 3 items on 2
    threads leave one thread idle a third of the time (measured: n = 512, 131 vs 170 GFLOP/s).
    """
    strips = -(-n_rows // MR)
    blocks = -(-n_rows // most)
    while (n_batch * blocks) % threads and blocks < strips:
        blocks += 1
    return MR * -(-strips // blocks)


_ONE_BATCH = np.zeros(1, np.int64)   # the index map of one matrix (never written)


def _index(index, stored, n_batch):
    if index is not None:
        return index
    if n_batch == 1:
        return _ONE_BATCH
    if stored == 1:
        return np.zeros(n_batch, np.int64)
    return np.arange(n_batch, dtype=np.int64)
