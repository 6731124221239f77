"""The score modifiers: everything that changes which keys a query row sees or what its scores
are before the softmax -- the causal and window bounds (key_start, key_end), ALiBi's distance
bias (alibi_row, alibi_panel), the soft cap (softcap_scores, softcap_tile) and the attention
sink's share of the denominator (join_sink). One place for each rule, read by the kernels of
``kernels/attention.py`` in both layouts: the forward's transposed panels (``mask_panel``,
``panel_softmax``, the end of ``forward_item``) and the backward's tiles (``mask_tile``,
``backward_tiles``). The options themselves arrive in the ``Scores`` record
(``kernels/attention_state.py``); the functional layer fills it in.

Forward and backward must form the same scores to the bit (backward rebuilds every weight as
exp(s - lse)): each rule is one function here, and where a rule has two layouts (ALiBi, the
soft cap), both round each element the same way (see each docstring).

Dims as in ``kernels/attention.py``.
"""
import math

import numpy as np

from .._jit import exact_kernel, fma_kernel, kernel
from .tanh import SMALL, series_native, tanh_slope_native


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


@kernel
def join_sink(row_max, row_sum, alpha, sink):
    """The attention sink joins a row's softmax denominator: l·e^m + e^sink. Returns the new
    (row max, row sum, alpha), alpha the factor e^(m - max(m, sink)) that rescales the row's
    running output (unchanged when the row and the sink are all -inf; 0 when every key is
    masked)."""
    top = max(row_max, sink)
    if top != -np.inf:
        alpha = math.exp(row_max - top)             # 0 when every key is masked
        row_sum = row_sum * alpha + math.exp(sink - top)
        row_max = top
    return row_max, row_sum, alpha
