"""Attention for a few new query rows against a long KV cache: the decode path of the
attention engine (a GPT generating one token at a time).

Dims: B batch, H query heads, Hkv key/value heads (H = G·Hkv), L new query rows (1 when
decoding token by token), n live keys of a cache of capacity Smax, E query/key width, Ev value
width. Query row i sees key j when j <= i + n - L (``causal``: the bottom-right rule, the new
rows are the last L positions) or every live key (not causal).

Why not the forward engine (kernels/attention.py): its work item is a block of query rows of
one head, computed as NR-wide query panels -- for one row, 1/NR of every tile is useful, and a
single sequence of H heads has only H items. Here the keys of each head are cut into chunks of
``chunk`` keys, and each work item (b, h, chunk) takes every new row through its chunk::

    s_j  = (q_i·scale)·k_j            for the chunk's keys j that row i sees
    m    = max_j s_j,   l = Σ_j exp(s_j - m),   o = Σ_j exp(s_j - m)·v_j     (unnormalised)

and the chunks of a row are merged by their maxima (the logsumexp merge of split-K flash
decoding)::

    M = max_c m_c,   f_c = exp(m_c - M),   out = Σ_c f_c·o_c / Σ_c f_c·l_c,
    lse = M + log Σ_c f_c·l_c

``chunk`` is chosen by the caller from the shapes only (functional/attention.py,
``decode_chunk``), never from the thread count: the merge order, and so the bits, are the same
on any number of threads. With one chunk per head the merge is skipped: f = 1 exactly, so that
is the same arithmetic.

A row that sees no key (every chunk empty) gets output 0 and logsumexp -inf, as the forward
engine gives a fully masked row; NaN in a query, key or value reaches the rows that see it.
The scores are never written anywhere but a per-item scratch of ``chunk`` entries: O(L·E)
memory per head. Accumulators: the input dtype.
"""
import math

import numpy as np
from numba import prange

from .._jit import kernel, parallel_kernel
from .exp import exp_one_native

#: Up to this many multiply-adds (B·H·L·n·(E + Ev)) the functional layer runs the kernel's
#: serial twin (the same bits): a launch of the thread pool costs more than it saves
#: (measured on Zen 4: a decoded token of 4 heads of 32 against 40 keys, 3.9 µs launched).
SERIAL_MACS = 1 << 15


@kernel
def chunk_partial(qh, kh, vh, j0, j1, first_visible, causal, scale, qs, s, part):
    # One chunk (keys j0 .. j1 of one kv head) through every new row of one query head: part
    # (L, Ev + 2) gets each row's unnormalised o, then m, then l (m -inf, l 0 and o 0 when
    # the row sees none of the chunk's keys). first_visible: the last key row 0 sees, plus 1.
    n_rows, width = qh.shape
    n_vcols = vh.shape[1]
    zero = part.dtype.type(0)
    for i in range(n_rows):
        last = min(j1, first_visible + i) if causal else j1
        for e in range(width):
            qs[e] = qh[i, e] * scale
        m = part.dtype.type(-np.inf)
        for j in range(j0, last):                   # scores, and their max (NaN ignored)
            kj = kh[j]
            d = zero
            for e in range(width):
                d += qs[e] * kj[e]
            s[j - j0] = d
            if d > m:
                m = d
        shift = zero if m == -np.inf else m         # every score -inf (or none): exp -> 0
        acc = part[i]
        acc[:] = zero
        total = zero
        for j in range(j0, last):
            p = exp_one_native(s[j - j0] - shift)
            total += p
            vj = vh[j]
            for e in range(n_vcols):
                acc[e] += p * vj[e]
        acc[n_vcols] = m
        acc[n_vcols + 1] = total


@kernel
def merge_row(parts, n_chunks, n_vcols, orow, stats):
    # The chunks' partial results of one row, parts[c] = (o_c (Ev), m_c, l_c), merged into
    # orow (Ev) and stats = (lse, row max M, row sum Σ f_c·l_c) (module docstring).
    big = parts.dtype.type(-np.inf)
    for c in range(n_chunks):
        if parts[c, n_vcols] > big:
            big = parts[c, n_vcols]
    zero = orow.dtype.type(0)
    orow[:] = zero
    total = zero
    for c in range(n_chunks):
        mc = parts[c, n_vcols]
        f = orow.dtype.type(1) if mc == big else math.exp(mc - big)   # (both -inf: 1)
        total += f * parts[c, n_vcols + 1]
        for e in range(n_vcols):
            orow[e] += f * parts[c, e]
    stats[1] = big
    stats[2] = total
    if total == 0:                                  # the row sees no key
        orow[:] = zero
        stats[0] = -np.inf
    else:                                           # (NaN flows through here)
        inv = orow.dtype.type(1) / total
        for e in range(n_vcols):
            orow[e] = orow[e] * inv
        stats[0] = big + math.log(total)


@parallel_kernel(twin=True)
def decode_attention_kernel(q, k, v, n_keys, causal, scale, chunk, out, stats, parts):
    # q (B, H, L, E) · k (B, Hkv, Smax, E) · v (B, Hkv, Smax, Ev), keys 0 .. n_keys live ->
    # out (B, H, L, Ev), stats (B, H, L, 3): each row's logsumexp, max and sum. parts (B, H,
    # n_chunks, L, Ev + 2): the chunks' partial results (module docstring).
    n_batch, n_heads, n_rows, width = q.shape
    group = n_heads // k.shape[1]
    n_vcols = v.shape[3]
    n_chunks = parts.shape[2]
    first_visible = n_keys - n_rows + 1            # causal: row i sees keys j < this + i
    for w in prange(n_batch * n_heads * n_chunks):
        b = w // (n_heads * n_chunks)
        h = w // n_chunks % n_heads
        c = w % n_chunks
        j0 = c * chunk
        j1 = min(j0 + chunk, n_keys)
        qs = np.empty(width, q.dtype)
        s = np.empty(chunk, q.dtype)
        part = parts[b, h, c]
        chunk_partial(q[b, h], k[b, h // group], v[b, h // group], j0, j1, first_visible,
                      causal, scale, qs, s, part)
        if n_chunks == 1:                           # the whole row: merge it here
            for i in range(n_rows):
                merge_row(parts[b, h, :, i], 1, n_vcols, out[b, h, i], stats[b, h, i])
    if n_chunks > 1:
        for r in prange(n_batch * n_heads * n_rows):
            b = r // (n_heads * n_rows)
            h = r // n_rows % n_heads
            i = r % n_rows
            merge_row(parts[b, h, :, i], n_chunks, n_vcols, out[b, h, i], stats[b, h, i])
