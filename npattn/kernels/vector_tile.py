"""The register tile of every matrix product, written as explicit vector code.

The GEMM micro-kernel keeps an MR×NR tile of C in vector registers for a whole K block and
adds one outer product per k (``gemm.py``; the attention engine runs on the same tiles)::

    for p in range(kc):                     b = bp[p·NR : p·NR + NR]   (one vector row of B)
        for i in range(MR):                 acc[i] = fma(broadcast(ap[p·MR + i]), b, acc[i])

Numba has no vector types, so this module writes that loop in LLVM IR itself, from an
``@intrinsic``: each accumulator row is one LLVM vector ``<NR x float>`` (or double), each
update one ``llvm.fma`` of a broadcast element of A, the row of B, and the row's accumulator.
LLVM then maps each vector onto the machine's registers: a ``<16 x float>`` row is two ymm
registers on an AVX2 CPU and one zmm register on an AVX-512 CPU -- on Intel's as on AMD's.

Why not let LLVM's vectorisers find the vectors (as npattn did first, from MR·NR named scalars):

* **Width.** LLVM's tuning for Intel's AVX-512 cores (``skylake-avx512`` … ``graniterapids``,
  ``x86-64-v4``) sets ``prefer-256-bit``: its vectorisers then build 256-bit vectors, and an
  8×32 float32 tile needs 32 ymm accumulators and spills. The preference steers only the
  vectorisers: vectors the IR already has are legalised to the widest registers the CPU has
  (a function without a ``min-legal-vector-width`` attribute, as every Numba function is,
  may use them all). So explicit vectors give zmm code on every AVX-512 CPU, through
  llvmlite's public IR builder, without touching the process's Numba settings
  (``tests/test_tiles.py`` compiles the tile for each CPU name and reads the assembly).
* **Registers.** The SLP vectoriser's code for a 6×16 float32 tile on AVX2 (12 accumulators
  of the 16 ymm registers) spilled and ran at half speed; written as vectors it needs 12
  accumulators, 2 rows of B and one broadcast, and LLVM allocates them without a spill.

The bits are those of the scalar code it replaces: each accumulator element is
``fma(a, b, acc)`` in k order, as the scalar ``acc += a * b`` contracted to a fused
multiply-add. Results are added into C as ``c + acc`` (``tile_add``), or stored as
``(0 + bias) + acc`` (``tile_store``: the first K block, the same bits as C zeroed, the bias
added, then ``tile_add``).

The GEMM engine's tiles also prefetch (``tiles(..., prefetch_rows, prefetch_c)``; gemm.py says
what it measured); the attention engine's do not.

Under ``NUMBA_BOUNDSCHECK=1`` the tile checks its operands' sizes first and raises IndexError,
as Numba's own indexing would. Under ``NUMBA_DISABLE_JIT=1`` the same loops run as Python.
"""
import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _python_tile(mr, nr):
    """The tile as plain Python (``NUMBA_DISABLE_JIT=1``): the same sums, one element at a time
    (float32 stays float32: NumPy scalars)."""
    def tile_product(kc, ap, bp, tile):
        for i in range(mr):
            for j in range(nr):
                acc = ap.dtype.type(0)
                for p in range(kc):
                    acc = acc + ap[p * mr + i] * bp[p * nr + j]
                tile[i, j] = acc

    def tile_add(kc, ap, bp, c, r0, j0):
        out = np.empty((mr, nr), c.dtype)
        tile_product(kc, ap, bp, out)
        c[r0:r0 + mr, j0:j0 + nr] += out

    def tile_store(kc, ap, bp, c, r0, j0, bias):
        out = np.empty((mr, nr), c.dtype)
        tile_product(kc, ap, bp, out)
        zero = c.dtype.type(0)
        base = bias[j0:j0 + nr] if bias.shape[0] > 0 else np.zeros(nr, c.dtype)
        c[r0:r0 + mr, j0:j0 + nr] = (zero + base) + out
    return tile_product, tile_add, tile_store


def _operands(context, builder, signature, values, mr, nr):
    """(element type, vector type, pointer to ap's data, pointer to bp's data, kc) of a call."""
    kc, ap, bp = values[:3]
    dtype = signature.args[1].dtype
    element = context.get_value_type(dtype)
    vector = ir.VectorType(element, nr)
    a = context.make_array(signature.args[1])(context, builder, ap)
    b = context.make_array(signature.args[2])(context, builder, bp)
    if numba.config.BOUNDSCHECK:
        _check_size(context, builder, a, builder.mul(kc, ir.Constant(_I64, mr)), "ap")
        _check_size(context, builder, b, builder.mul(kc, ir.Constant(_I64, nr)), "bp")
    return element, vector, a.data, b.data


def _check_size(context, builder, array, needed, name,
                what="fewer elements than kc times its tile side"):
    size = array.nitems
    with builder.if_then(builder.icmp_signed(">", needed, size), likely=False):
        context.call_conv.return_user_exc(builder, IndexError,
                                          (f"vector tile: {name} holds {what}",))


def _accumulate(builder, element, vector, a, b, kc, mr, nr, prefetch_rows):
    """The k loop: MR accumulator vectors of NR, each ``fma(broadcast(a[p·MR + i]), b_row,
    acc)``, k in order. Returns the MR final vectors."""
    width = "f32" if isinstance(element, ir.FloatType) else "f64"
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{nr}{width}")
    zero = ir.Constant(vector, [ir.Constant(element, 0.0)] * nr)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(mr)]   # (SROA: registers)
    splat = ir.Constant(ir.VectorType(_I32, nr), [0] * nr)
    undefined = ir.Constant(vector, ir.Undefined)
    align = 4 if width == "f32" else 8
    with cgutils.for_range(builder, kc) as loop:
        p = loop.index
        row = builder.gep(b, [builder.mul(p, ir.Constant(_I64, nr))])
        if prefetch_rows:
            _prefetch(builder, builder.gep(row, [ir.Constant(_I64, prefetch_rows * nr)]),
                      nr * (4 if width == "f32" else 8), write=False)
        b_row = builder.load(builder.bitcast(row, vector.as_pointer()), align=align)
        first = builder.mul(p, ir.Constant(_I64, mr))
        for i in range(mr):
            x = builder.load(builder.gep(a, [builder.add(first, ir.Constant(_I64, i))]))
            xs = builder.shuffle_vector(builder.insert_element(undefined, x, ir.Constant(_I32, 0)),
                                        undefined, splat)
            builder.store(builder.call(fma, [xs, b_row, builder.load(accs[i])]), accs[i])
    return [builder.load(acc) for acc in accs], align


def _row_pointer(context, builder, arr, item, row, column, vector):
    """A pointer to arr[row, column] (``arr`` a 2-D array structure, ``item`` its element size)
    as a pointer to a vector: the row's elements from ``column`` on are contiguous."""
    strides = cgutils.unpack_tuple(builder, arr.strides, 2)
    offset = builder.add(builder.mul(row, strides[0]),
                         builder.mul(column, ir.Constant(_I64, item)))
    address = builder.add(builder.ptrtoint(arr.data, _I64), offset)
    return builder.inttoptr(address, vector.as_pointer())


def _is_matrix(value):
    return isinstance(value, types.Array) and value.ndim == 2 and value.layout == "C"


def _prefetch(builder, pointer, size, write):
    """``llvm.prefetch`` of every 64-byte line of ``size`` bytes from ``pointer`` into L1: a
    hint, which never faults, so it may point past the end of an array."""
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32,
                                                        _I32]), "llvm.prefetch.p0i8")
    start = builder.bitcast(pointer, ir.IntType(8).as_pointer())
    for line in range(0, size, 64):
        builder.call(function, [builder.gep(start, [ir.Constant(_I64, line)]),
                                ir.Constant(_I32, int(write)), ir.Constant(_I32, 3),
                                ir.Constant(_I32, 1)])


def _tile_in_c(kc, ap, bp, c, r0, j0):
    """Whether tile_add's (and tile_store's first six) argument types are what it takes."""
    return (isinstance(kc, types.Integer) and isinstance(ap, types.Array)
            and isinstance(bp, types.Array) and _is_matrix(c)
            and isinstance(r0, types.Integer) and isinstance(j0, types.Integer))


def _into_c(mr, nr, prefetch_rows, prefetch_c, context, builder, signature, values):
    """The code of ``tile_add`` (6 arguments: ``c += tile``) and ``tile_store`` (7, the last
    the bias: ``c = (0 + (bias or 0)) + tile``)."""
    element, vector, a, b = _operands(context, builder, signature, values, mr, nr)
    kc, c, r0, j0 = values[0], values[3], values[4], values[5]
    r0 = context.cast(builder, r0, signature.args[4], types.int64)
    j0 = context.cast(builder, j0, signature.args[5], types.int64)
    arr = context.make_array(signature.args[3])(context, builder, c)
    if numba.config.BOUNDSCHECK:
        n_rows, n_cols = cgutils.unpack_tuple(builder, arr.shape, 2)
        outside = builder.or_(
            builder.or_(builder.icmp_signed("<", r0, ir.Constant(_I64, 0)),
                        builder.icmp_signed("<", j0, ir.Constant(_I64, 0))),
            builder.or_(
                builder.icmp_signed(">", builder.add(r0, ir.Constant(_I64, mr)), n_rows),
                builder.icmp_signed(">", builder.add(j0, ir.Constant(_I64, nr)), n_cols)))
        with builder.if_then(outside, likely=False):
            context.call_conv.return_user_exc(
                builder, IndexError, ("vector tile: the tile is not inside c",))
    item = context.get_abi_sizeof(element)
    store = len(values) == 7    # tile_store: every tile row starts from 0 + bias, not from C
    if store:
        zero = ir.Constant(vector, [ir.Constant(element, 0.0)] * nr)
        bias = context.make_array(signature.args[6])(context, builder, values[6])
        n_bias = cgutils.unpack_tuple(builder, bias.shape, 1)[0]
        row0 = cgutils.alloca_once_value(builder, zero)
        with builder.if_then(builder.icmp_signed(">", n_bias, ir.Constant(_I64, 0))):
            if numba.config.BOUNDSCHECK:
                _check_size(context, builder, bias, builder.add(j0, ir.Constant(_I64, nr)),
                            "bias", "fewer elements than the tile's last column")
            pointer = builder.bitcast(builder.gep(bias.data, [j0]), vector.as_pointer())
            builder.store(builder.load(pointer, align=item), row0)
        base = builder.fadd(zero, builder.load(row0))    # 0 + bias, as gemm.start_rows sums
    for i in range(mr if prefetch_c else 0):
        _prefetch(builder, _row_pointer(context, builder, arr, item,
                                        builder.add(r0, ir.Constant(_I64, i)), j0, vector),
                  nr * item, write=True)
    rows, align = _accumulate(builder, element, vector, a, b, kc, mr, nr, prefetch_rows)
    for i, row in enumerate(rows):
        pointer = _row_pointer(context, builder, arr, item,
                               builder.add(r0, ir.Constant(_I64, i)), j0, vector)
        start = base if store else builder.load(pointer, align=align)
        builder.store(builder.fadd(start, row), pointer, align=align)
    return context.get_dummy_value()


@functools.cache
def tiles(mr, nr, prefetch_rows=0, prefetch_c=False):
    """``(tile_product, tile_add, tile_store)`` for an MR×NR tile, each callable from a kernel:

    * ``tile_product(kc, ap, bp, tile)``: ``tile[i, j] = Σ_p ap[p·MR + i] · bp[p·NR + j]`` for
      i < MR, j < NR, p < kc; ap and bp 1-D views starting at the strip and the panel, tile
      an (MR, NR) C-contiguous array.
    * ``tile_add(kc, ap, bp, c, r0, j0)``: the same sums added into ``c[r0 + i, j0 + j]``;
      c (M, N) C-contiguous, the whole tile inside it.
    * ``tile_store(kc, ap, bp, c, r0, j0, bias)``: the same sums stored into the tile of C as
      ``(0 + bias[j0 + j]) + tile`` (bias (N,) C-contiguous, or (0,) for none: ``0 + tile``),
      whatever C held -- the bits of ``gemm.start_rows`` followed by ``tile_add``, without
      reading C or writing it twice (the first K block of a product that does not accumulate).

    ``prefetch_rows`` > 0: each k step also asks for B's row ``prefetch_rows`` steps ahead
    (``llvm.prefetch`` into L1, every 64-byte line of it); ``prefetch_c``: ``tile_add`` and
    ``tile_store`` ask for their MR rows of C, for writing, before the k loop, so that they
    arrive while it runs.
    Hints only: the same bits, and a prefetch never faults, so one past an array's end is
    harmless (the k loop's last rows ask for the next panel's first).
    """
    if numba.config.DISABLE_JIT:
        return _python_tile(mr, nr)

    @intrinsic
    def tile_product(typingctx, kc, ap, bp, tile):
        if not (isinstance(kc, types.Integer) and isinstance(ap, types.Array)
                and isinstance(bp, types.Array) and isinstance(tile, types.Array)
                and tile.ndim == 2):
            return None

        def codegen(context, builder, signature, values):
            element, vector, a, b = _operands(context, builder, signature, values, mr, nr)
            t = context.make_array(signature.args[3])(context, builder, values[3])
            if numba.config.BOUNDSCHECK:
                _check_size(context, builder, t, ir.Constant(_I64, mr * nr), "tile")
            rows, align = _accumulate(builder, element, vector, a, b, values[0], mr, nr,
                                      prefetch_rows)
            contiguous = signature.args[3].layout == "C"
            for i, row in enumerate(rows):
                if contiguous:
                    target = builder.gep(t.data, [ir.Constant(_I64, i * nr)])
                    builder.store(row, builder.bitcast(target, vector.as_pointer()), align=align)
                    continue
                for j in range(nr):          # a view of unknown layout: element by element
                    target = cgutils.get_item_pointer(context, builder, signature.args[3], t,
                                                      [ir.Constant(_I64, i), ir.Constant(_I64, j)])
                    builder.store(builder.extract_element(row, ir.Constant(_I32, j)), target)
            return context.get_dummy_value()
        return types.void(kc, ap, bp, tile), codegen

    @intrinsic
    def tile_add(typingctx, kc, ap, bp, c, r0, j0):
        if _tile_in_c(kc, ap, bp, c, r0, j0):
            return types.void(kc, ap, bp, c, r0, j0), into_c
        return None

    @intrinsic
    def tile_store(typingctx, kc, ap, bp, c, r0, j0, bias):
        if (_tile_in_c(kc, ap, bp, c, r0, j0) and isinstance(bias, types.Array)
                and bias.ndim == 1 and bias.layout == "C" and bias.dtype == c.dtype):
            return types.void(kc, ap, bp, c, r0, j0, bias), into_c
        return None

    into_c = functools.partial(_into_c, mr, nr, prefetch_rows, prefetch_c)
    return tile_product, tile_add, tile_store
