"""The attention engine's exponentials as explicit vector code: ``exp(s − m)`` a row a vector.

* **Forward** (``shifted_rows``): the online softmax (``attention.py::panel_softmax``) turns a
  panel of scores into probabilities, ``e[j·W + c] = exp(pt[j·W + c] − shift[c])`` for every
  key j of the block and every query c of the panel (W = NR queries, one shift per query: its
  running max).
* **Backward** (``softmax_grad_row``): each row of a tile (one query, NR keys,
  ``attention.py::backward_tiles``) gives p = exp(s − lse)·inv, the weights w = p (∘ keep /
  (1 − p_drop)) and ds = p·(dp − D).

The arithmetic is ``exp.py``'s (``exp_one_f32`` for float32, ``exp_one`` for float64); only the
loop differs. Written as loops over the W lanes of a row (``exp.exp_shifted_f32``, and the
backward's own loop per tile row), LLVM vectorises each into two vectors of a 16-lane row and
pays the loop's set-up (overlap checks, the constants broadcast again, the remainder test) on
every row. Measured on a Zen 3 core (one thread, B1 H4 L1024 E64 float32, perf samples): the
forward's exps were 17 % of the forward, at 0.6–1.1 ns an element, where the same arithmetic
over one flat array takes 0.35–0.41; the backward's rows about 15 % of the backward. Here each
row is one ``<W x float>`` vector (two ymm registers on AVX2, one or two zmm on AVX-512): no
inner loop, the shift and the constants are vectors loaded once, and nothing is checked per
row.

The bits are the loops': the same operations in the same order, each ``a·b + c`` its fused
multiply-add, as ``fastmath={"contract"}`` fuses the scalar code (``tests/test_vector_exp.py``
compares them bit for bit over every kind of input, ``tests/attention_digest.py`` the engine's
results before and after). The coefficients are exp.py's own tuples (``SERIES``,
``SERIES_F32``).

Arrays are 1-D C-contiguous, of one float dtype (``kept``: bool); the caller keeps the elements
a call names inside them, and under ``NUMBA_BOUNDSCHECK=1`` each call checks that first and
raises IndexError. Under ``NUMBA_DISABLE_JIT=1`` the same loops run as Python.
"""
import functools

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import exp

_I64 = ir.IntType(64)


def _python_rows(width):
    """The rows as plain Python (``NUMBA_DISABLE_JIT=1``): exp.py's own loops."""
    def exp_rows(x, shift, out):
        n = x.shape[0] // width * width
        exp.exp_shifted_native(x[:n], shift[:width], out[:n])
    return exp_rows


def _splat(element, width, value):
    return ir.Constant(ir.VectorType(element, width), [ir.Constant(element, value)] * width)


def _exp_vector(builder, vector, xv, width, single):
    """exp(xv) for a vector xv <= 0, as exp.exp_one_f32 (``single``) or exp.exp_one computes
    each element: t = floor(xv·log2 e + 1/2), r = (xv − t·ln2_hi) − t·ln2_lo, 2^t from its
    bits, the Taylor series of exp(r) by Horner's rule, their product; 0 below the underflow
    bound (and for −inf), NaN through."""
    element = vector.element
    name = f"v{width}f{32 if single else 64}"

    def intrinsic_fn(base, n_args):
        return cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * n_args), f"llvm.{base}.{name}")

    fma, floor = intrinsic_fn("fma", 3), intrinsic_fn("floor", 1)

    def const(value):
        return _splat(element, width, float(value))

    if single:
        log2e, ln2_hi, ln2_lo = exp.LOG2E_F32, exp.LN2_HI_F32, exp.LN2_LO_F32
        underflow, series = exp.UNDERFLOW_F32, exp.SERIES_F32
    else:
        log2e, ln2_hi, ln2_lo = exp.LOG2E, exp.LN2_HI, exp.LN2_LO
        underflow, series = exp.UNDERFLOW, exp.SERIES
    under = builder.fcmp_ordered("<", xv, const(underflow))     # False for NaN
    t = builder.call(floor, [builder.call(fma, [xv, const(log2e), const(0.5)])])
    r = builder.call(fma, [t, const(-ln2_hi), xv])                # xv − t·ln2_hi, fused
    r = builder.call(fma, [t, const(-ln2_lo), r])
    if single:                                                    # (t + 127) << 23
        integer = ir.VectorType(ir.IntType(32), width)
        bits = builder.shl(builder.add(builder.fptosi(t, integer), _splat(ir.IntType(32), width, 127)),
                           _splat(ir.IntType(32), width, 23))
    else:                                                         # (t + SHIFTER + 1023) << 52
        integer = ir.VectorType(_I64, width)
        shifted = builder.fadd(t, const(exp.SHIFTER + 1023))
        bits = builder.shl(builder.bitcast(shifted, integer), _splat(_I64, width, 52))
    p = const(series[0])
    for coefficient in series[1:]:
        p = builder.call(fma, [p, r, const(coefficient)])
    value = builder.fmul(p, builder.bitcast(bits, vector))
    return builder.select(under, const(0.0), value)


@functools.cache
def shifted_rows(width):
    """``exp_rows(x, shift, out)``, callable from a kernel: ``out[j·W + c] = exp(x[j·W + c] −
    shift[c])`` for j < x.size // W and c < W (W = ``width``), in the arithmetic of the arrays'
    dtype, each x − shift <= 0 (or NaN): exp.exp_shifted_native's results, a row a vector."""
    if numba.config.DISABLE_JIT:
        return _python_rows(width)

    @intrinsic
    def exp_rows(typingctx, x, shift, out):
        arrays = (x, shift, out)
        if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
                    for a in arrays)
                and x.dtype in (types.float32, types.float64)
                and shift.dtype == x.dtype and out.dtype == x.dtype):
            return None

        def codegen(context, builder, signature, values):
            xa, sa, oa = (context.make_array(t)(context, builder, v)
                          for t, v in zip(signature.args, values))
            element = context.get_value_type(signature.args[0].dtype)
            vector = ir.VectorType(element, width)
            align = context.get_abi_sizeof(element)
            n = builder.sdiv(xa.nitems, ir.Constant(_I64, width))
            if numba.config.BOUNDSCHECK:
                for array, needed, name in ((oa, builder.mul(n, ir.Constant(_I64, width)), "out"),
                                            (sa, ir.Constant(_I64, width), "shift")):
                    with builder.if_then(builder.icmp_signed(">", needed, array.nitems),
                                         likely=False):
                        context.call_conv.return_user_exc(
                            builder, IndexError, (f"vector exp: {name} holds too few elements",))
            shift_vector = builder.load(builder.bitcast(sa.data, vector.as_pointer()),
                                        align=align)
            single = signature.args[0].dtype == types.float32
            with cgutils.for_range(builder, n) as loop:
                offset = builder.mul(loop.index, ir.Constant(_I64, width))
                source = builder.bitcast(builder.gep(xa.data, [offset]), vector.as_pointer())
                xv = builder.fsub(builder.load(source, align=align), shift_vector)
                result = _exp_vector(builder, vector, xv, width, single)
                target = builder.bitcast(builder.gep(oa.data, [offset]), vector.as_pointer())
                builder.store(result, target, align=align)
            return context.get_dummy_value()
        return types.void(x, shift, out), codegen

    return exp_rows


def _python_grad_row(width):
    """The row as plain Python (``NUMBA_DISABLE_JIT=1``): backward_tiles' loop before it."""
    def grad_row(t, dp, kept, dropped, scale, shift, inv, d, ds, w):
        zero = t.dtype.type(0)
        for c in range(width):
            pv = exp.exp_one_native(t[c] - shift) * inv
            dpc, wc = dp[c], pv
            if dropped:                                          # dropped: exactly 0
                dpc = dp[c] * scale if kept[c] else zero
                wc = pv * scale if kept[c] else zero
            ds[c] = pv * (dpc - d)
            w[c] = wc
    return grad_row


@functools.cache
def softmax_grad_row(width):
    """``grad_row(t, dp, kept, dropped, scale, shift, inv, d, ds, w)``, callable from a kernel:
    one row of the attention backward's tile (``attention.py::backward_tiles``) for c < W
    (W = ``width``): the probability p = exp(t[c] − shift)·inv, the weight w[c] = p and
    ds[c] = p·(dp[c] − d) -- with ``dropped``, w[c] = p·scale and dp[c]·scale where kept[c],
    exactly 0 where not. t, dp, ds, w: 1-D C-contiguous of one float dtype, W elements or more;
    kept: 1-D C-contiguous bool; shift, inv, d, scale: scalars of the dtype. One vector of W,
    no loop: the scalar loop it replaces set up a vectorised loop of two vectors per row."""
    if numba.config.DISABLE_JIT:
        return _python_grad_row(width)

    @intrinsic
    def grad_row(typingctx, t, dp, kept, dropped, scale, shift, inv, d, ds, w):
        rows = (t, dp, ds, w)
        if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
                    and a.dtype == t.dtype for a in rows)
                and t.dtype in (types.float32, types.float64)
                and isinstance(kept, types.Array) and kept.ndim == 1 and kept.layout == "C"
                and kept.dtype == types.boolean and isinstance(dropped, types.Boolean)
                and all(isinstance(s, types.Float) for s in (scale, shift, inv, d))):
            return None
        signature = types.void(t, dp, kept, dropped, t.dtype, t.dtype, t.dtype, t.dtype, ds, w)

        def codegen(context, builder, signature, values):
            args = signature.args
            ta, dpa, ka, da, wa = (context.make_array(args[i])(context, builder, values[i])
                                   for i in (0, 1, 2, 8, 9))
            element = context.get_value_type(args[0].dtype)
            vector = ir.VectorType(element, width)
            align = context.get_abi_sizeof(element)
            if numba.config.BOUNDSCHECK:
                for array, name in ((ta, "t"), (dpa, "dp"), (ka, "kept"), (da, "ds"),
                                    (wa, "w")):
                    with builder.if_then(builder.icmp_signed(">", ir.Constant(_I64, width),
                                                             array.nitems), likely=False):
                        context.call_conv.return_user_exc(
                            builder, IndexError, (f"vector exp: {name} holds too few elements",))

            def load(array, kind=vector):
                return builder.load(builder.bitcast(array.data, kind.as_pointer()),
                                    align=align if kind is vector else 1)

            def splat(value):
                undefined = ir.Constant(vector, ir.Undefined)
                one = builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0))
                return builder.shuffle_vector(one, undefined,
                                              ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                          [0] * width))
            dropped, scale, shift, inv, d = values[3:8]
            single = args[0].dtype == types.float32
            pv = builder.fmul(_exp_vector(builder, vector, builder.fsub(load(ta), splat(shift)),
                                          width, single), splat(inv))
            dpv = load(dpa)
            flags = load(ka, ir.VectorType(ir.IntType(8), width))
            keep = builder.icmp_unsigned("!=", flags, ir.Constant(flags.type, [0] * width))
            zero = _splat(element, width, 0.0)
            scales = splat(scale)
            flag = context.cast(builder, dropped, args[3], types.boolean)
            dpv = builder.select(flag, builder.select(keep, builder.fmul(dpv, scales), zero), dpv)
            wv = builder.select(flag, builder.select(keep, builder.fmul(pv, scales), zero), pv)
            ds = builder.fmul(pv, builder.fsub(dpv, splat(d)))
            builder.store(ds, builder.bitcast(da.data, vector.as_pointer()), align=align)
            builder.store(wv, builder.bitcast(wa.data, vector.as_pointer()), align=align)
            return context.get_dummy_value()
        return signature, codegen

    return grad_row
