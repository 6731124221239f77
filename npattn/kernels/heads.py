"""Attention heads moved between the packed layout and one block per head: the copies that
``split_heads`` and ``merge_heads`` (functional/attention.py) make around every attention call.

Dims: N batch, L positions, k parts (the GPT's fused projection: q, k and v, k = 3; one
array: k = 1), H heads of D columns each.

    packed (N, L, k·H·D)   row (n, l): part 0's heads side by side, then part 1's, ...
    heads  (k, N, H, L, D) C-contiguous: each head's L×D block in one piece, as the
                           attention engine reads it

    heads[i, n, h, l, d] = packed[n, l, (i·H + h)·D + d]     (split_kernel)
    packed[n, l, (i·H + h)·D + d] = heads[i, n, h, l, d]     (merge_kernel)

(a call may move parts first .. first + k - 1 of a wider packed array: merge_heads_side_by_side
writes its arrays one by one into one C-contiguous result, which keeps the rows' stride known
to the compiler and the copies vectorised)

NumPy makes the same copy through a transposed view, element by element on one thread
(measured on Zen 4: the GPT's q, k and v from (12, 64, 384) float32 in 69 µs, from (8, 256,
1152) in 600 µs; here, 2 threads, 24 and 162 µs). No arithmetic: the copies move bits.
"""
from numba import prange

from .._jit import kernel, parallel_kernel

#: Up to this many elements the serial twin runs (a decoded token's heads: no launch)
SERIAL = 1 << 14


@kernel
def item_head(w, n_batch, n_heads, first, width):
    # Work item w's (part, batch, head) and the head's first column in packed: each item owns
    # one head's L rows of D columns in both arrays
    i = w // (n_batch * n_heads)
    return i, w // n_heads % n_batch, w % n_heads, ((first + i) * n_heads + w % n_heads) * width


@kernel
def copy_row(src, dst):
    # dst[:] = src: one row of a head (D elements, contiguous in both: vectorised)
    for e in range(dst.shape[0]):
        dst[e] = src[e]


@parallel_kernel(twin=True)
def split_kernel(packed, heads, first):
    # heads (k, N, H, L, D) <- parts first .. first + k - 1 of packed (N, L, K·H·D), any
    # strides (a transposed view for sequence-first layouts; read-only is fine)
    for w in prange(heads.shape[0] * heads.shape[1] * heads.shape[2]):
        i, b, h, col = item_head(w, heads.shape[1], heads.shape[2], first, heads.shape[4])
        for t in range(heads.shape[3]):
            copy_row(packed[b, t, col:col + heads.shape[4]], heads[i, b, h, t])


@parallel_kernel(twin=True)
def merge_kernel(heads, packed, first):
    # parts first .. first + k - 1 of packed (N, L, K·H·D) <- heads (k, N, H, L, D): the
    # reverse of split_kernel (two kernels, as a read-only input may only be read)
    for w in prange(heads.shape[0] * heads.shape[1] * heads.shape[2]):
        i, b, h, col = item_head(w, heads.shape[1], heads.shape[2], first, heads.shape[4])
        for t in range(heads.shape[3]):
            copy_row(heads[i, b, h, t], packed[b, t, col:col + heads.shape[4]])
