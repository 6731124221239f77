"""torch.matmul: a matrix product with 1-D promotion and broadcast batch dims."""
import math

import numpy as np

from .. import _checks
from ..kernels.tiles import gemm


def _operands(a, b, batch):
    """The kernels' view of ``a @ b``: stacks of matrices and which pair each output batch uses.

    Returns a3 (Ba, M, K), b3 (Bb, K, N), both C-contiguous; a_index, b_index (T,) int64, where
    output batch t is a3[a_index[t]] · b3[b_index[t]]; and the shape of the result. Broadcast
    batch dims become repeated indices, never copies. When b has no batch dims, a's batch is
    folded into M: one (Ba·M, K)·(K, N) product, T = 1.
    """
    if a.ndim == 2 and b.ndim == 2:            # the common case at once (a sixth of the time)
        a2, b2 = _checks.contiguous(a, b)
        return a2[None], b2[None], _ONE, _ONE, (a.shape[0], b.shape[1])
    a_mat = a.reshape(1, a.shape[0]) if a.ndim == 1 else a    # (..., M, K): 1-D a is a row
    b_mat = b.reshape(b.shape[0], 1) if b.ndim == 1 else b    # (..., K, N): 1-D b is a column
    m, k = a_mat.shape[-2:]
    n = b_mat.shape[-1]
    batch_a, batch_b = a_mat.shape[:-2], b_mat.shape[:-2]
    out_shape = batch + (m,) * (a.ndim > 1) + (n,) * (b.ndim > 1)  # promoted dims removed
    if not batch_b:
        a3 = _checks.contiguous(a_mat).reshape(1, math.prod(batch_a) * m, k)  # (1, Ba·M, K)
        b3 = _checks.contiguous(b_mat).reshape(1, k, n)                        # (1, K, N)
        return a3, b3, _ONE, _ONE, out_shape
    n_a, n_b = math.prod(batch_a), math.prod(batch_b)
    a3 = _checks.contiguous(a_mat).reshape(n_a, m, k)                          # (Ba, M, K)
    b3 = _checks.contiguous(b_mat).reshape(n_b, k, n)                          # (Bb, K, N)
    # flatten() always copies: a writable index keeps the kernels' signature (and compile) one
    a_index = np.broadcast_to(np.arange(n_a, dtype=np.int64).reshape(batch_a), batch).flatten()
    b_index = np.broadcast_to(np.arange(n_b, dtype=np.int64).reshape(batch_b), batch).flatten()
    return a3, b3, a_index, b_index, out_shape                                   # index (T,)


_ONE = np.zeros(1, dtype=np.int64)      # the index map of one output batch (never written)


def _sum_to(grad, batch, stored_batch, stored):
    """Undo broadcasting: grad (T, R, C) per output batch -> (stored, R, C) per stored matrix.

    The batches that used one stored matrix are summed (NumPy's sum, in a fixed order); when
    every output batch has its own matrix there is nothing to sum.
    """
    if grad.shape[0] == stored:
        return grad
    full = grad.reshape(batch + grad.shape[1:])                        # (*batch, R, C)
    lead = len(batch) - len(stored_batch)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(stored_batch)
                                      if n == 1 and batch[lead + i] != 1)
    return full.sum(axis=axes).reshape((stored,) + grad.shape[1:])     # (stored, R, C)


def matmul_forward(a, b):
    """out = a · b with torch.matmul's rules.

    out[..., m, n] = Σ_k a[..., m, k] · b[..., k, n]; both 1-D is the dot product (a 0-d
    array); a 1-D a is a row (1, K) and a 1-D b a column (K, 1), whose unit dim is removed from
    the result; the batch dims (all but the last two) broadcast.

    Shapes: a (*Ba, M, K) · b (*Bb, K, N) -> out (*broadcast(Ba, Bb), M, N)
    """
    if (type(a) is np.ndarray and type(b) is np.ndarray and a.ndim == 2 and b.ndim == 2
            and a.dtype is b.dtype and a.dtype in _checks.FLOAT_DTYPES
            and a.shape[1] == b.shape[0] and a.flags.carray and b.flags.carray):
        out = np.empty((a.shape[0], b.shape[1]), dtype=a.dtype)   # the common case at once:
        gemm(a, b, out)                             # what the checks and _operands below give
        return out                                  # it, without their 3-4 µs (n = 128: 45)
    a, b, batch = _checks.matmul_args(a, b)                   # one float dtype, K agrees
    a3, b3, a_index, b_index, out_shape = _operands(a, b, batch)
    t, m, n = a_index.shape[0], a3.shape[1], b3.shape[2]
    out = np.empty((t, m, n), dtype=a.dtype)                  # (T, M, N); folded: (1, Ba·M, N)
    gemm(a3, b3, out, a_index=a_index, b_index=b_index)
    return out.reshape(out_shape)                             # (*batch, M, N), promoted dims gone


def matmul_backward(dout, a, b):
    """Gradients of ``matmul_forward``: ``(da, db)``, shaped and typed like a and b.

    da = dout·bᵀ,  db = aᵀ·dout,  each summed over the batch dims broadcasting added or
    stretched (and with 1-D promotion undone).

    Shapes: dout (*broadcast(Ba, Bb), M, N), a (*Ba, M, K), b (*Bb, K, N) -> da (*Ba, M, K),
    db (*Bb, K, N)
    """
    a, b, batch = _checks.matmul_args(a, b)
    a3, b3, a_index, b_index, out_shape = _operands(a, b, batch)
    dout = _checks.float_array("dout", dout)
    _checks.same_dtype("dout", dout, "a", a)
    _checks.exact_shape("dout", dout, out_shape,
                        f"to match the matmul of a {a.shape} and b {b.shape}")
    t, m, n = a_index.shape[0], a3.shape[1], b3.shape[2]
    k = a3.shape[2]
    dout3 = _checks.contiguous(dout).reshape(t, m, n)         # (T, M, N); folded: (1, Ba·M, N)
    per_t = np.arange(t, dtype=np.int64)
    da = np.empty((t, m, k), dtype=a.dtype)                   # dout[t]·b[ib]ᵀ per output batch
    gemm(dout3, b3, da, a_index=per_t, b_index=b_index, trans_b=True)
    db = np.empty((t, k, n), dtype=a.dtype)                   # a[ia]ᵀ·dout[t] per output batch
    gemm(a3, dout3, db, a_index=a_index, b_index=per_t, trans_a=True)
    batch_a = a.shape[:-2] if a.ndim > 1 else ()
    batch_b = b.shape[:-2] if b.ndim > 1 else ()
    if t > 1 or batch:
        da = _sum_to(da, batch, batch_a, a3.shape[0])
        db = _sum_to(db, batch, batch_b, b3.shape[0])
    return da.reshape(a.shape), db.reshape(b.shape)


matmul = matmul_forward
