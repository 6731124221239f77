"""Packing as explicit vector code: the copies that lay out the micro-kernel's operands.

Before a product runs its register tile (``vector_tile.py``), the engines copy each operand
into the order the tile reads it (``gemm.py``: an A strip is ``kc`` rows of MR elements, a B
panel ``kc`` rows of NR; ``attention.py``: query strips and panels, key panels, value strips,
and dkᵀ, dvᵀ back into rows). Two kinds of copy do that:

* **Rows** (``copy_rows``): ``dst[d0 + r·d_step + j] = src[s0 + r·s_step + j]`` for j < W --
  the slice is already in the tile's order (a row-major B's panel, a transposed A's strip), and
  each row moves as one vector load and one vector store.
* **Transposed rows** (``transpose_rows``): ``dst[d0 + p·d_step + j] = src[s0 + j·s_step + p]``
  for j < W -- W rows of the source become the W elements of each packed row (a row-major A's
  strip: MR rows of A side by side; a transposed B's panel). Per block of L columns it loads W
  vectors of L, transposes them in registers and stores L rows of W.

Written as scalar loops, these copies moved one element per cycle: LLVM's vectoriser does not
touch a loop over a view whose inner stride it cannot see (Numba types ``b[i, k0:k1, j0:j1]`` as
an array of any layout), nor a transposition. Measured on a Zen 4 core, an A strip of 192×128
float32 took 6.8 µs to pack and B's 128×384 13.5 µs -- as much as 12 % of a baby GPT product
(M = 768, K = 128, N = 384: 375 µs on 2 threads).

**The transposition** is the perfect shuffle, applied log2(W) times to the W loaded rows
(W a power of 2; fewer rows are padded with undefined ones, never loaded):
``next[2m] = interleave_low(rows[m], rows[m + W/2])``, ``next[2m + 1] = interleave_high(...)``.
For W rows of L ≥ W elements, after log2(W) such steps the W vectors, read one after another,
are the block transposed: vector q holds columns q·L/W .. (q + 1)·L/W − 1, each as W
consecutive elements. (A 4×4 block, rows ``abcd efgh ijkl mnop``: the first step gives
``aibj ckdl emfn gohp``, the second ``aeim bfjn cgko dhlp``, its columns.) Each
interleave is one two-input shuffle, which LLVM lowers to the ISA's permutes (``vpermt2ps`` on
AVX-512; unpack and lane permutes on AVX2).

A copy moves bits: packed this way or element by element, the operands are the same, and so is
every product's result.

Arrays: ``src`` and ``dst`` are C-contiguous arrays of one dtype, of any number of
dimensions, addressed by flat element offsets (``s0``, ``d0``) and steps. The caller keeps
every element it names inside the arrays; under ``NUMBA_BOUNDSCHECK=1`` each call checks that
first and raises IndexError. Under ``NUMBA_DISABLE_JIT=1`` the same copies run as Python.
"""
import functools

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _python_packers(width):
    """The copies as plain Python (``NUMBA_DISABLE_JIT=1``), element by element."""
    def copy_rows(n, src, s0, s_step, dst, d0, d_step):
        s, d = src.reshape(-1), dst.reshape(-1)
        for r in range(n):
            d[d0 + r * d_step:d0 + r * d_step + width] = s[s0 + r * s_step:
                                                           s0 + r * s_step + width]

    def transpose_rows(n, src, s0, s_step, dst, d0, d_step):
        s, d = src.reshape(-1), dst.reshape(-1)
        for p in range(n):
            for j in range(width):
                d[d0 + p * d_step + j] = s[s0 + j * s_step + p]
    return copy_rows, transpose_rows


def _typed(n, src, s0, s_step, dst, d0, d_step):
    """Whether a call's types are the copies' own: counts and offsets integers, src and dst
    C-contiguous arrays of one dtype."""
    return (all(isinstance(v, types.Integer) for v in (n, s0, s_step, d0, d_step))
            and all(isinstance(v, types.Array) and v.layout == "C" for v in (src, dst))
            and src.dtype == dst.dtype)


def _arguments(context, builder, signature, values):
    """(element type, src data, dst data, n, s0, s_step, d0, d_step as int64) of a call, and
    the two array structures."""
    ints = [context.cast(builder, values[i], signature.args[i], types.int64)
            for i in (0, 2, 3, 5, 6)]
    src = context.make_array(signature.args[1])(context, builder, values[1])
    dst = context.make_array(signature.args[4])(context, builder, values[4])
    element = context.get_value_type(signature.args[1].dtype)
    return element, src, dst, ints


def _check_span(context, builder, array, start, step, count, extent, name):
    """IndexError unless elements start + r·step + j, r < count, j < extent, lie inside array
    (``NUMBA_BOUNDSCHECK=1`` only; nothing is read when count or extent is 0). count, extent:
    int64 values."""
    zero = ir.Constant(_I64, 0)
    last = builder.add(start, builder.mul(builder.sub(count, ir.Constant(_I64, 1)), step))
    low = builder.select(builder.icmp_signed("<", last, start), last, start)
    high = builder.add(builder.select(builder.icmp_signed(">", last, start), last, start),
                       extent)
    outside = builder.or_(builder.icmp_signed("<", low, zero),
                          builder.icmp_signed(">", high, array.nitems))
    some = builder.and_(builder.icmp_signed(">", count, zero),
                        builder.icmp_signed(">", extent, zero))
    with builder.if_then(builder.and_(some, outside), likely=False):
        context.call_conv.return_user_exc(
            builder, IndexError, (f"vector pack: {name} is not inside its array",))


def _vector_at(builder, data, offset, vector):
    """A pointer to the vector of elements data[offset ...]."""
    return builder.bitcast(builder.gep(data, [offset]), vector.as_pointer())


def _interleave(builder, low, high, length, upper):
    """The two-input shuffle [low[h], high[h], low[h + 1], high[h + 1], ...] from h = 0 (or from
    h = length / 2 when ``upper``): the perfect shuffle's halves."""
    start = length // 2 if upper else 0
    mask = [index for h in range(start, start + length // 2) for index in (h, length + h)]
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, length), mask))


@functools.cache
def packers(width, lanes):
    """``(copy_rows, transpose_rows)`` for rows of ``width`` elements, callable from a kernel;
    ``lanes``: the elements of one vector register of the dtype they will be used for (16
    float32 on AVX-512): the transposition works on blocks of max(lanes, W') columns, W' the
    power of 2 at or above ``width``.

    * ``copy_rows(n, src, s0, s_step, dst, d0, d_step)``: for r < n, j < width:
      ``dst[d0 + r·d_step + j] = src[s0 + r·s_step + j]``.
    * ``transpose_rows(n, src, s0, s_step, dst, d0, d_step)``: for p < n, j < width:
      ``dst[d0 + p·d_step + j] = src[s0 + j·s_step + p]``.
    """
    if numba.config.DISABLE_JIT:
        return _python_packers(width)
    padded = 1 << (width - 1).bit_length()
    block = max(lanes, padded)             # columns per transposed block

    @intrinsic
    def copy_rows(typingctx, n, src, s0, s_step, dst, d0, d_step):
        if not _typed(n, src, s0, s_step, dst, d0, d_step):
            return None

        def codegen(context, builder, signature, values):
            element, src, dst, (n, s0, s_step, d0, d_step) = _arguments(
                context, builder, signature, values)
            if numba.config.BOUNDSCHECK:
                wide = ir.Constant(_I64, width)
                _check_span(context, builder, src, s0, s_step, n, wide, "src")
                _check_span(context, builder, dst, d0, d_step, n, wide, "dst")
            vector = ir.VectorType(element, width)
            align = context.get_abi_sizeof(element)
            with cgutils.for_range(builder, n) as loop:
                r = loop.index
                row = builder.load(_vector_at(builder, src.data,
                                              builder.add(s0, builder.mul(r, s_step)), vector),
                                   align=align)
                builder.store(row, _vector_at(builder, dst.data,
                                              builder.add(d0, builder.mul(r, d_step)), vector),
                              align=align)
            return context.get_dummy_value()
        return types.void(n, src, s0, s_step, dst, d0, d_step), codegen

    @intrinsic
    def transpose_rows(typingctx, n, src, s0, s_step, dst, d0, d_step):
        if not _typed(n, src, s0, s_step, dst, d0, d_step):
            return None

        def codegen(context, builder, signature, values):
            element, src, dst, (n, s0, s_step, d0, d_step) = _arguments(
                context, builder, signature, values)
            if numba.config.BOUNDSCHECK:
                # the source: `width` rows s_step apart, n elements each; the destination:
                # n rows of `width`
                wide = ir.Constant(_I64, width)
                _check_span(context, builder, src, s0, s_step, wide, n, "src")
                _check_span(context, builder, dst, d0, d_step, n, wide, "dst")
            vector = ir.VectorType(element, block)
            piece = ir.VectorType(element, width)
            align = context.get_abi_sizeof(element)
            undefined = ir.Constant(vector, ir.Undefined)
            per_vector = block // padded            # columns each transposed vector holds
            n_blocks = builder.sdiv(n, ir.Constant(_I64, block))
            with cgutils.for_range(builder, n_blocks) as loop:
                p0 = builder.mul(loop.index, ir.Constant(_I64, block))
                rows = [builder.load(_vector_at(builder, src.data, builder.add(
                            builder.add(s0, builder.mul(ir.Constant(_I64, j), s_step)), p0),
                            vector), align=align)
                        for j in range(width)] + [undefined] * (padded - width)
                for _ in range(padded.bit_length() - 1):          # log2(W') perfect shuffles
                    half = padded // 2
                    rows = [_interleave(builder, rows[m // 2], rows[m // 2 + half], block,
                                        upper=m % 2 == 1) for m in range(padded)]
                for q, transposed in enumerate(rows):
                    for c in range(per_vector):
                        mask = ir.Constant(ir.VectorType(_I32, width),
                                           [c * padded + j for j in range(width)])
                        packed = builder.shuffle_vector(transposed, undefined, mask)
                        p = builder.add(p0, ir.Constant(_I64, q * per_vector + c))
                        target = builder.add(d0, builder.mul(p, d_step))
                        builder.store(packed, _vector_at(builder, dst.data, target, piece),
                                      align=align)
            done = builder.mul(n_blocks, ir.Constant(_I64, block))
            with cgutils.for_range_slice(builder, done, n, ir.Constant(_I64, 1)) as (p, _):
                for j in range(width):                # the last columns, one at a time
                    source = builder.add(builder.add(s0, builder.mul(ir.Constant(_I64, j),
                                                                     s_step)), p)
                    target = builder.add(builder.add(d0, builder.mul(p, d_step)),
                                         ir.Constant(_I64, j))
                    builder.store(builder.load(builder.gep(src.data, [source])),
                                  builder.gep(dst.data, [target]))
            return context.get_dummy_value()
        return types.void(n, src, s0, s_step, dst, d0, d_step), codegen

    return copy_rows, transpose_rows
