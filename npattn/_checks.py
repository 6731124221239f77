"""Argument checks for the functional layer: run once, before any kernel sees the data.

Policy
------
* Arrays: anything ``np.asarray`` accepts (ndarrays, views of any strides, read-only arrays,
  nested lists). The dtype must be float32 or float64 -- integer, bool, complex, float16 and
  object inputs are a ``TypeError``, as in PyTorch, and so are mixed float dtypes.
* Shapes: a wrong rank or size is a ``ValueError`` that names the argument, what was expected
  and what was given, e.g. ``weight must have shape (Fout, 512) to match x (..., 512); got
  (64, 256)``.
* What the kernels get back: C-contiguous arrays of one dtype (a copy only when the input was
  not already one).
"""
import collections
import math
import numbers
import typing

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: NumPy's own dtype objects (an array of float32 has this very object as its dtype): the fast
#: lanes compare by identity (a tenth of a µs less than ``in FLOAT_DTYPES``); any other
#: object equal to them takes the checks' long way, with the same answer
FLOAT32, FLOAT64 = FLOAT_DTYPES


# ---------------------------------------------------------------- building blocks

def converted(name, value, expected, convert=np.asarray, **options):
    """``convert(value, **options)`` (``np.asarray`` by default, ``np.array`` for a copy), or
    TypeError "<name> must be <expected>; got <type> that NumPy cannot convert (<why>)" for
    what NumPy refuses (ragged lists, strings for a float dtype...). The one place npattn turns
    a NumPy conversion error into its own wording."""
    try:
        return convert(value, **options)
    except (ValueError, TypeError) as exc:
        raise TypeError(f"{name} must be {expected}; got {type(value).__name__} that NumPy "
                        f"cannot convert ({exc})") from None


def float_array(name, value):
    """``value`` as a float32/float64 ndarray (no copy when it already is one)."""
    if type(value) is np.ndarray and value.dtype in FLOAT_DTYPES:   # the common case, at once
        return value
    if value is None:
        raise TypeError(f"{name} must be a float32 or float64 array; got None")
    arr = converted(name, value, "a float32 or float64 array")
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32 or float64; got {arr.dtype}")
    return arr


def same_dtype(name, arr, like_name, like):
    """``arr`` must have the dtype of ``like`` (npattn never mixes float32 and float64)."""
    if arr.dtype != like.dtype:
        raise TypeError(f"{name} must have dtype {like.dtype} to match {like_name}; got {arr.dtype}")


def min_ndim(name, arr, ndim, what):
    if arr.ndim < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimension{'s' * (ndim != 1)} "
                         f"{what}; got shape {arr.shape}")


def exact_shape(name, arr, expected, what):
    """``expected`` is a tuple; ``what`` says where it comes from, e.g. 'to match x (..., 512)'."""
    if arr.shape != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} {what}; got {arr.shape}")


def contiguous(*arrays):
    """C-contiguous, writeable versions of the arrays (``None`` passes through).

    Read-only inputs are copied too: Numba types a read-only array differently and would
    compile every kernel again for each mix of read-only and writeable arguments (~1 s each).
    """
    out = tuple(a if a is None or (a.flags.c_contiguous and a.flags.writeable) else
                np.ascontiguousarray(a).reshape(a.shape) if a.flags.writeable  # 0-d stays 0-d
                else np.array(a, order="C")
                for a in arrays)
    return out if len(out) > 1 else out[0]


def axis(name, dim, ndim):
    """A PyTorch-style ``dim`` (negative counts from the end) as a non-negative axis."""
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(dim).__name__}")
    span = max(ndim, 1)  # a 0-d array has one implicit axis, as in PyTorch
    if not -span <= dim < span:
        raise ValueError(f"{name} must be in [{-span}, {span - 1}] for an array with {ndim} "
                         f"dimension{'s' * (ndim != 1)}; got {dim}")
    return int(dim) % span


def real_float(name, value, what="a real number"):
    """A real number (not a bool) as a Python float; an int too large for a float (10**400)
    is a ValueError, not float()'s OverflowError."""
    if type(value) is float:                                # the common case, at once
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {what} that fits in a float; got an int of "
                         f"{len(str(abs(int(value))))} digits") from None


def probability(name, p):
    p = real_float(name, p, "a real number in [0, 1]")
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1]; got {p}")
    return p


def seed_value(name, seed):
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int in [0, 2**64); got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{name} must be an int in [0, 2**64); got {seed}")
    return seed


def shape_value(name, shape):
    """A shape as a tuple of non-negative ints; an int is a 1-D shape, as in NumPy."""
    dims = tuple(shape) if np.iterable(shape) else (shape,)
    for n in dims:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be a tuple of ints; got {shape!r}")
        if n < 0:
            raise ValueError(f"{name} must not have negative dims; got {shape!r}")
    if math.prod(int(n) for n in dims) > np.iinfo(np.intp).max:
        raise ValueError(f"{name} must have fewer than 2**63 elements; got {shape!r}")
    return tuple(int(n) for n in dims)


def broadcasts_to(shape, target):
    """Whether an array of ``shape`` broadcasts to ``target`` without enlarging it."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def window_value(name, window):
    """A sliding window: None, or (left, right) with each side an int >= 0 or None (no bound
    on that side); returned as a pair."""
    if window is None:
        return (None, None)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{name} must be None or a pair (left, right), each an int >= 0 or "
                        f"None; got {window!r}")
    for side, n in zip(("left", "right"), window):
        if n is None:
            continue
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name}'s {side} side must be an int >= 0 or None; got "
                            f"{type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name}'s {side} side must be an int >= 0 or None; got {n}")
    return tuple(None if n is None else int(n) for n in window)


def flag(name, value):
    if value is True or value is False:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


# ------------------------------------------------- the modules' arguments (nn/, init)

def generator(value, name="rng"):
    """A ``numpy.random.Generator`` from None (fresh OS entropy), an int seed or a Generator.

    A Generator is used as given (not copied): modules built from one generator draw in turn.
    """
    if isinstance(value, np.random.Generator):
        return value
    if value is None:
        return np.random.default_rng()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be None, an int seed or a numpy.random.Generator; "
                        f"got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int seed; got {value}")
    return np.random.default_rng(int(value))


def float_dtype(dtype, name="dtype"):
    """``dtype`` as np.dtype, float32 or float64 only."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be float32 or float64; got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64; got {dt}")
    return dt


def size(name, value, minimum=0):
    """A dimension argument: an int >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    return int(value)


def float_input(name, value, dtype, owner):
    """A forward argument: a float array of the module's dtype (``owner`` names the module)."""
    x = float_array(name, value)
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} to match {owner}'s parameters; got "
                        f"{x.dtype}")
    return x


def finite_real(name, value):
    """A finite real number (not a bool) as a float."""
    value = real_float(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value



# ---------------------------------------------------------------- per op

def _kernel_ready(a, dtype, shape):
    """``a`` is None, or an array of ``dtype`` and ``shape`` that the checks would pass on as it
    is (C-contiguous, aligned, writeable): the fast paths of the per-op checks below."""
    return a is None or (type(a) is np.ndarray and a.dtype is dtype and a.shape == shape
                         and a.flags.carray)


def linear_args(x, weight, bias):
    """x (..., Fin), weight (Fout, Fin), bias (Fout,) or None -> C-contiguous, one dtype."""
    dtype = x.dtype if type(x) is np.ndarray else None
    if ((dtype is FLOAT32 or dtype is FLOAT64) and type(weight) is np.ndarray
            and weight.dtype is dtype and weight.ndim == 2 and x.ndim
            and x.shape[-1] == weight.shape[1] and x.flags.carray and weight.flags.carray
            and (bias is None or (type(bias) is np.ndarray and bias.dtype is dtype
                                  and bias.shape == weight.shape[:1] and bias.flags.carray))):
        return x, weight, bias      # the common case at once: the checks below pass it as it is
    x = float_array("x", x)
    weight = float_array("weight", weight)
    same_dtype("weight", weight, "x", x)
    min_ndim("x", x, 1, "(..., Fin)")
    fin = x.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != fin:
        raise ValueError(f"weight must have shape (Fout, {fin}) to match x (..., {fin}); "
                         f"got {weight.shape}")
    if bias is not None:
        bias = float_array("bias", bias)
        same_dtype("bias", bias, "x", x)
        exact_shape("bias", bias, (weight.shape[0],), f"to match weight {weight.shape}")
    return contiguous(x, weight, bias)


def linear_backward_args(dout, x, weight, bias):
    x, weight, bias = linear_args(x, weight, bias)
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "x", x)
    exact_shape("dout", dout, x.shape[:-1] + (weight.shape[0],),
                f"(..., Fout) to match x {x.shape} and weight {weight.shape}")
    return contiguous(dout), x, weight, bias


def matmul_args(a, b):
    """Two float arrays of one dtype, each at least 1-D, whose matrix dims agree."""
    a = float_array("a", a)
    b = float_array("b", b)
    same_dtype("b", b, "a", a)
    min_ndim("a", a, 1, "for matmul")
    min_ndim("b", b, 1, "for matmul")
    ka = a.shape[-1]
    kb = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if ka != kb:
        where = "b.shape[-2]" if b.ndim > 1 else "b.shape[0]"
        raise ValueError(f"{where} must equal a.shape[-1] = {ka} (a has shape {a.shape}) for "
                         f"matmul; got b with shape {b.shape}")
    batch_a = a.shape[:-2]
    batch_b = b.shape[:-2]
    if batch_a == batch_b or not batch_b:      # (the common cases, without broadcast_shapes'
        return a, b, batch_a                   # 1.3 µs: a product of 8×8 takes 13)
    if not batch_a:
        return a, b, batch_b
    try:
        batch = np.broadcast_shapes(batch_a, batch_b)
    except ValueError:
        raise ValueError(f"the batch dims of a {batch_a} and b {batch_b} "
                         f"must broadcast; got a with shape {a.shape} and b with shape "
                         f"{b.shape}") from None
    return a, b, batch


def softmax_args(x, dim):
    x = float_array("x", x)
    return x, axis("dim", dim, x.ndim)


def softmax_backward_args(dout, out, dim):
    out = float_array("out", out)
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "out", out)
    exact_shape("dout", dout, out.shape, "to match out")
    return dout, out, axis("dim", dim, out.ndim)


def dropout_args(x, p, seed, training):
    x = float_array("x", x)
    return x, probability("p", p), seed_value("seed", seed), flag("training", training)



ALIGNMENTS = ("top-left", "bottom-right")


def gqa_heads(heads, kv_heads, enable_gqa, query, key_name, key, names, head_dim=-3):
    """The flag enable_gqa, after checking that query's ``heads`` may read ``kv_heads`` key and
    value heads: equal, or a multiple of them with enable_gqa (or kv_heads 1, which
    broadcasts). ``names``: how the messages call the kv heads' owners, possessive and plain;
    ``head_dim`` the heads' dim in query."""
    enable_gqa = flag("enable_gqa", enable_gqa)
    if heads != kv_heads:
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"query's heads (dim {head_dim}) must be a multiple of "
                             f"{names[0]}; got query {query.shape}, {key_name} {key.shape}")
        if not enable_gqa and kv_heads != 1:
            raise ValueError(f"query has {heads} heads and {names[1]} {kv_heads}: pass "
                             f"enable_gqa=True for grouped-query attention; got query "
                             f"{query.shape}, {key_name} {key.shape}")
    return enable_gqa


class AttentionOptions(typing.NamedTuple):
    """Attention's options, one record under PyTorch's keyword names (and npattn's own after
    them): each public entry point of functional/attention.py builds one from its keywords,
    attention_args checks it once, and every function below takes the checked record.

    As given: attn_mask None, a bool or a float array; dropout_p; is_causal; scale None or a
    real; enable_gqa; seed None or an int; causal_alignment "top-left" or "bottom-right";
    window None or (left, right); alibi_slopes, softcap, sinks None or their values.
    Checked (attention_args): attn_mask None or a C-contiguous bool or query-dtype array;
    dropout_p a float; is_causal, enable_gqa bools; scale a float (1/√E by default); seed an
    int (0 without dropout); causal_alignment one of ALIGNMENTS; window (left, right), each an
    int >= 0 or None; alibi_slopes None or a C-contiguous query-dtype array that broadcasts to
    (batch..., H); softcap None or a finite float > 0; sinks None or a C-contiguous query-dtype
    array (H,).
    """
    attn_mask: object = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: object = None
    enable_gqa: bool = False
    seed: object = None
    causal_alignment: str = "top-left"
    window: object = None
    alibi_slopes: object = None
    softcap: object = None
    sinks: object = None

    @property
    def bottom_right(self):
        """The diagonal of is_causal, window and ALiBi is bottom-right (i + S - L)."""
        return self.causal_alignment == "bottom-right"


#: scaled_dot_product_attention's arguments, checked (attention_args): query, key, value
#: C-contiguous arrays of one float dtype; batch the broadcast batch dims (a tuple); heads H;
#: out_ndim the rank of the output; options the checked AttentionOptions.
AttentionArgs = collections.namedtuple("AttentionArgs",
                                       "query key value batch heads out_ndim options")


def attention_args(query, key, value, options, *, mask_name="attn_mask"):
    """Everything scaled_dot_product_attention takes, checked: the arrays and ``options`` (an
    AttentionOptions as given); returns an AttentionArgs holding the checked options.

    query (..., H, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev) -- or 2-D (L, E) etc.
    without a head dim -- of one float dtype; leading batch dims broadcast; H = Hkv, or a
    multiple of it with enable_gqa (or Hkv = 1, which broadcasts). The mask (bool, or float of
    the query dtype; ``mask_name`` in the messages) must broadcast to (batch..., H, L, S)
    without enlarging it. window: see window_value. alibi_slopes (ALiBi: one slope per head,
    (H,) or (batch..., H)): an array of the query dtype that broadcasts to (batch..., H).
    softcap: a finite real > 0, or None. sinks (one logit per head): an array (H,) of the
    query dtype.
    """
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions; got {type(options).__name__}")
    (mask, dropout_p, is_causal, scale, enable_gqa, seed, causal_alignment, window,
     alibi_slopes, softcap, sinks) = options
    query = float_array("query", query)
    key = float_array("key", key)
    value = float_array("value", value)
    same_dtype("key", key, "query", query)
    same_dtype("value", value, "query", query)
    min_ndim("query", query, 2, "(..., L, E)")
    min_ndim("key", key, 2, "(..., S, E)")
    min_ndim("value", value, 2, "(..., S, Ev)")
    n_rows, width = query.shape[-2:]
    if key.shape[-1] != width:
        raise ValueError(f"key must have shape (..., S, {width}) to match query (..., L, "
                         f"{width}); got {key.shape}")
    n_keys = key.shape[-2]
    if value.shape[-2] != n_keys:
        raise ValueError(f"value must have shape (..., {n_keys}, Ev) to match key (..., "
                         f"{n_keys}, E); got {value.shape}")
    heads = query.shape[-3] if query.ndim > 2 else 1
    kv_heads = key.shape[-3] if key.ndim > 2 else 1
    value_heads = value.shape[-3] if value.ndim > 2 else 1
    if value_heads != kv_heads:
        raise ValueError(f"value must have {kv_heads} heads (dim -3) to match key "
                         f"{key.shape}; got {value.shape}")
    enable_gqa = gqa_heads(heads, kv_heads, enable_gqa, query, "key", key,
                           ("key's and value's", "key/value"))
    try:
        batch = np.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except ValueError:
        raise ValueError(f"the batch dims (before the head dim) of query, key and value must "
                         f"broadcast; got query {query.shape}, key {key.shape}, value "
                         f"{value.shape}") from None
    full = batch + (heads, n_rows, n_keys)                       # the scores' shape
    if mask is not None:
        mask = converted(mask_name, mask, f"a bool or {query.dtype} array")
        if mask.dtype != np.bool_ and mask.dtype != query.dtype:
            raise TypeError(f"{mask_name} must have dtype bool (True = takes part) or "
                            f"{query.dtype} (added to the scores, as query); got {mask.dtype}")
        if not broadcasts_to(mask.shape, full):
            raise ValueError(f"{mask_name} must broadcast to (..., H, L, S) = {full}; got "
                             f"shape {mask.shape}")
        mask = contiguous(mask)
    if scale is not None:
        scale = real_float("scale", scale, "a real number or None")
    dropout_p = probability("dropout_p", dropout_p)
    if seed is None:
        if dropout_p > 0:
            raise ValueError(f"seed must be given when dropout_p > 0 (got dropout_p = "
                             f"{dropout_p}): backward regenerates the dropout mask from it")
        seed = 0
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}; got "
                         f"{causal_alignment!r}")
    window = window_value("window", window)
    if alibi_slopes is not None:
        alibi_slopes = converted("alibi_slopes", alibi_slopes, f"a {query.dtype} array")
        if alibi_slopes.dtype != query.dtype:
            raise TypeError(f"alibi_slopes must have dtype {query.dtype}, as query; got "
                            f"{alibi_slopes.dtype}")
        if not broadcasts_to(alibi_slopes.shape, batch + (heads,)):
            raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) or broadcast to "
                             f"(batch..., H) = {batch + (heads,)}; got {alibi_slopes.shape}")
        alibi_slopes = contiguous(alibi_slopes)
    if softcap is not None:
        softcap = real_float("softcap", softcap, "a real number > 0 or None")
        if not 0.0 < softcap < math.inf:               # also rejects NaN
            raise ValueError(f"softcap must be a finite real number > 0 (scores become "
                             f"softcap·tanh(score / softcap)) or None; got {softcap}")
    if sinks is not None:
        sinks = converted("sinks", sinks, f"a {query.dtype} array")
        if sinks.dtype != query.dtype:
            raise TypeError(f"sinks must have dtype {query.dtype}, as query; got {sinks.dtype}")
        if sinks.shape != (heads,):
            raise ValueError(f"sinks must have shape (H,) = ({heads},), one logit per query "
                             f"head; got {sinks.shape}")
        sinks = contiguous(sinks)
    query, key, value = contiguous(query, key, value)
    checked = AttentionOptions(
        attn_mask=mask, dropout_p=dropout_p, is_causal=flag("is_causal", is_causal),
        scale=(1.0 / math.sqrt(width) if width else 1.0) if scale is None else scale,
        enable_gqa=enable_gqa, seed=seed_value("seed", seed), causal_alignment=causal_alignment,
        window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    return AttentionArgs(query=query, key=key, value=value, batch=batch, heads=heads,
                         out_ndim=max(query.ndim, key.ndim, value.ndim), options=checked)


def cu_seqlens_value(name, value, total, owner):
    """The prefix sums of a packed batch's sequence lengths (flash-attn's ``cu_seqlens``): a 1-D
    int32 or int64 array of n_seq + 1 >= 1 entries, starting at 0, non-decreasing and ending at
    ``total`` (``owner``'s rows); returned as C-contiguous int64."""
    arr = index_array(name, value, "a 1-D int32 or int64 array")
    if arr.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{name} must have dtype int32 or int64; got {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D, (n_seq + 1,) with n_seq >= 0; got shape "
                         f"{arr.shape}")
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0; got {arr[0]} at position 0")
    down = np.flatnonzero(arr[1:] < arr[:-1])
    if down.size:
        i = int(down[0])
        raise ValueError(f"{name} must be non-decreasing (prefix sums of lengths); got "
                         f"{arr[i]} then {arr[i + 1]} at positions {i}, {i + 1}")
    if arr[-1] != total:
        raise ValueError(f"{name} must end at {total}, the rows of {owner} (dim 0); got "
                         f"{arr[-1]}")
    return as_int64(arr)


#: scaled_dot_product_attention_varlen's arguments, checked (varlen_args): ``attention`` the
#: AttentionArgs of the packed stacks query (H, total_q, E), key (Hkv, total_k, E), value
#: (Hkv, total_k, Ev) -- C-contiguous copies, one sequence after another along dim 1 --
#: whose alibi_slopes are (H,) or (n_seq, H); cu_q, cu_k the cu_seqlens as int64.
VarlenArgs = collections.namedtuple("VarlenArgs", "attention cu_q cu_k")


def varlen_args(query, key, value, cu_seqlens_q, cu_seqlens_k, options):
    """Everything scaled_dot_product_attention_varlen takes, checked: the arrays and
    ``options`` (an AttentionOptions as given, without attn_mask); returns a VarlenArgs.

    query (total_q, H, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev) of one float dtype
    (flash-attn's packed layout); H = Hkv, or a multiple of it with enable_gqa (or Hkv = 1);
    cu_seqlens_q, cu_seqlens_k: see cu_seqlens_value, one entry more than sequences each;
    alibi_slopes (H,) or (n_seq, H) of the query dtype; the rest (softcap, sinks (H,) too) as
    attention_args.
    """
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions; got {type(options).__name__}")
    if options.attn_mask is not None:
        raise ValueError("varlen attention takes no attn_mask (as flash-attn); got "
                         f"{type(options.attn_mask).__name__}")
    alibi_slopes = options.alibi_slopes
    query = float_array("query", query)
    key = float_array("key", key)
    value = float_array("value", value)
    same_dtype("key", key, "query", query)
    same_dtype("value", value, "query", query)
    for name, x, form in (("query", query, "(total_q, H, E)"), ("key", key, "(total_k, Hkv, E)"),
                          ("value", value, "(total_k, Hkv, Ev)")):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape {form} (packed sequences); got shape "
                             f"{x.shape}")
    total_q, heads, width = query.shape
    total_k, kv_heads = key.shape[:2]
    if key.shape[2] != width:
        raise ValueError(f"key must have shape (total_k, Hkv, {width}) to match query "
                         f"(total_q, H, {width}); got {key.shape}")
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"value must have shape ({total_k}, {kv_heads}, Ev) to match key "
                         f"{key.shape}; got {value.shape}")
    gqa_heads(heads, kv_heads, options.enable_gqa, query, "key", key,
              ("key's and value's", "key/value"), head_dim=1)
    cu_q = cu_seqlens_value("cu_seqlens_q", cu_seqlens_q, total_q, "query")
    cu_k = cu_seqlens_value("cu_seqlens_k", cu_seqlens_k, total_k, "key")
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k must have one entry per sequence of cu_seqlens_q, "
                         f"shape {cu_q.shape}; got {cu_k.shape}")
    n_seq = cu_q.shape[0] - 1
    if alibi_slopes is not None:
        alibi_slopes = converted("alibi_slopes", alibi_slopes, f"a {query.dtype} array")
        if alibi_slopes.dtype != query.dtype:
            raise TypeError(f"alibi_slopes must have dtype {query.dtype}, as query; got "
                            f"{alibi_slopes.dtype}")
        if alibi_slopes.shape not in ((heads,), (n_seq, heads)):
            raise ValueError(f"alibi_slopes must have shape (H,) = ({heads},) or (n_seq, H) = "
                             f"({n_seq}, {heads}); got {alibi_slopes.shape}")
        alibi_slopes = contiguous(alibi_slopes)
    args = attention_args(query.transpose(1, 0, 2), key.transpose(1, 0, 2),
                          value.transpose(1, 0, 2), options._replace(alibi_slopes=None))
    checked = args.options._replace(alibi_slopes=alibi_slopes)
    return VarlenArgs(args._replace(options=checked), cu_q, cu_k)


def kv_cache_args(query, key_cache, value_cache, cache_length, key, value, options):
    """scaled_dot_product_attention_with_kv_cache's arguments, checked (of ``options``, an
    AttentionOptions, it takes is_causal, scale and enable_gqa): query (..., H, L, E),
    key_cache (..., Hkv, Smax, E), value_cache (..., Hkv, Smax, Ev) with the same batch dims
    (no broadcasting: a cache belongs to its sequences), the caches C-contiguous and writeable
    ndarrays (they are written in place, and read without a copy), and the new key (..., Hkv,
    L, E) and value (..., Hkv, L, Ev), both or neither, fitting at cache_length. Returns
    (query, key_cache, value_cache, key, value, n_keys, is_causal, scale): query, key and value
    C-contiguous; n_keys the live keys after the write."""
    common = _kv_cache_common(query, key_cache, value_cache, cache_length, key, value, options)
    if common is not None:
        return common
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions; got {type(options).__name__}")
    is_causal, scale, enable_gqa = options.is_causal, options.scale, options.enable_gqa
    query = float_array("query", query)
    min_ndim("query", query, 3, "(..., H, L, E)")
    lead, (heads, n_rows, width) = query.shape[:-3], query.shape[-3:]
    caches = []
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array (it is written in place); got "
                            f"{type(cache).__name__}")
        cache = float_array(name, cache)
        same_dtype(name, cache, "query", query)
        if cache.ndim != query.ndim or cache.shape[:-3] != lead:
            raise ValueError(f"{name} must have shape {lead + ('Hkv', 'Smax', '·')} to match "
                             f"query {query.shape}; got {cache.shape}")
        flags = cache.flags
        if not (flags.c_contiguous and flags.writeable):
            what = "not C-contiguous" if not flags.c_contiguous else "read-only"
            raise ValueError(f"{name} must be a C-contiguous, writeable array (it is written "
                             f"in place and read without a copy); got one that is {what}")
        caches.append(cache)
    key_cache, value_cache = caches
    if np.may_share_memory(key_cache, value_cache):
        raise ValueError("key_cache and value_cache must be separate arrays (the new keys and "
                         "values are written into them); got two that share memory")
    kv_heads, capacity = key_cache.shape[-3:-1]
    if key_cache.shape[-1] != width:
        raise ValueError(f"key_cache must have shape (..., Hkv, Smax, {width}) to match query "
                         f"(..., H, L, {width}); got {key_cache.shape}")
    if value_cache.shape[-3:-1] != (kv_heads, capacity):
        raise ValueError(f"value_cache must have shape (..., {kv_heads}, {capacity}, Ev) to "
                         f"match key_cache {key_cache.shape}; got {value_cache.shape}")
    enable_gqa = gqa_heads(heads, kv_heads, enable_gqa, query, "key_cache", key_cache,
                           ("the caches'", "the caches"))
    if (key is None) != (value is None):
        raise ValueError(f"key and value must be given together (the new entries of both "
                         f"caches) or both be None; got key "
                         f"{'None' if key is None else 'an array'} and value "
                         f"{'None' if value is None else 'an array'}")
    new = 0 if key is None else n_rows
    cache_length = int_value("cache_length", cache_length)
    if not 0 <= cache_length <= capacity - new:
        written = f", and {new} new ones are written at cache_length" if new else ""
        raise ValueError(f"cache_length must be in [0, {capacity - new}] (the caches hold "
                         f"Smax = {capacity} positions{written}); got {cache_length}")
    if key is not None:
        key = float_array("key", key)
        value = float_array("value", value)
        same_dtype("key", key, "query", query)
        same_dtype("value", value, "query", query)
        exact_shape("key", key, lead + (kv_heads, n_rows, width),
                    "(the caches' batch and heads, query's L and E)")
        exact_shape("value", value, lead + (kv_heads, n_rows, value_cache.shape[-1]),
                    "(the caches' batch and heads, query's L, value_cache's Ev)")
        key, value = contiguous(key, value)
    if scale is not None:
        scale = real_float("scale", scale, "a real number or None")
    else:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    return (contiguous(query), key_cache, value_cache, key, value, cache_length + new,
            flag("is_causal", is_causal), scale)


def _kv_cache_common(query, key_cache, value_cache, cache_length, key, value, options):
    """kv_cache_args' answer for the case a decoded token gives it -- 4-D (B, H, L, E) arrays,
    C-contiguous, writeable and aligned, of one dtype; new keys and values; as many heads as
    the caches; an int cache_length that fits; bool flags; scale None or a float -- in one
    expression (~2.5 µs instead of 7: a 6-layer GPT runs it 6 times per token); None for
    anything else, which kv_cache_args then checks one by one. It accepts only what those
    checks accept, and returns what they return (tests/test_kv_cache.py compares the two)."""
    if not (type(options) is AttentionOptions and type(query) is np.ndarray
            and type(key_cache) is np.ndarray and type(value_cache) is np.ndarray
            and type(key) is np.ndarray and type(value) is np.ndarray
            and type(cache_length) is int and query.ndim == 4):
        return None
    is_causal, scale = options.is_causal, options.scale
    dtype, (batch, heads, n_rows, width) = query.dtype, query.shape
    kb, kv_heads, capacity, kw = key_cache.shape if key_cache.ndim == 4 else (-1,) * 4
    if not (dtype in FLOAT_DTYPES and key_cache.dtype is dtype and value_cache.dtype is dtype
            and key.dtype is dtype and value.dtype is dtype
            and kb == batch and kv_heads == heads and kw == width and value_cache.ndim == 4
            and value_cache.shape[:3] == (batch, heads, capacity)
            and key.shape == (batch, heads, n_rows, width)
            and value.shape == (batch, heads, n_rows, value_cache.shape[3])
            and 0 <= cache_length <= capacity - n_rows
            and (is_causal is True or is_causal is False)
            and (options.enable_gqa is True or options.enable_gqa is False)
            and (scale is None or type(scale) is float)
            and query.flags.carray and key_cache.flags.carray and value_cache.flags.carray
            and key.flags.carray and value.flags.carray
            and not np.may_share_memory(key_cache, value_cache)):
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    return (query, key_cache, value_cache, key, value, cache_length + n_rows, is_causal,
            scale)


BLOCK_OPTIONAL = frozenset((0, 1, 3, 5, 6, 7, 9, 11))   # a block's biases and norm weights


def _block_shapes(width, hidden):
    """The shapes of a block's twelve arrays (functional/block.py's BlockWeights) for C = width
    and the MLP's F = hidden."""
    return ((width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
            (width,), (width,), (hidden, width), (hidden,), (width, hidden), (width,))


def _block_decode_common(x, weights, key_cache, value_cache, position, n_head, eps):
    """block_decode_args' answer for the case generation gives it -- every array an ndarray of
    x's dtype, C-contiguous, writeable and aligned, of its shape; ints and a float -- in one pass
    (a GPT runs it once per layer per token); None for anything else, which block_decode_args
    then checks one by one. It accepts only what those checks accept, and returns what they
    return (tests/test_block_decode.py compares the two)."""
    if not (type(x) is np.ndarray and (x.dtype is FLOAT32 or x.dtype is FLOAT64)
            and x.ndim == 2 and x.flags.carray and type(n_head) is int
            and type(position) is int and type(eps) is float and isinstance(weights, tuple)
            and len(weights) == 12 and type(key_cache) is np.ndarray
            and type(value_cache) is np.ndarray and type(weights[8]) is np.ndarray
            and weights[8].ndim == 2):
        return None
    dtype, (batch, width) = x.dtype, x.shape
    if not (n_head >= 1 and width % n_head == 0 and 0.0 <= eps < math.inf):
        return None
    if weights[2] is None or weights[4] is None or weights[10] is None:   # (8: an array)
        return None                             # (the products' weights are never optional)
    for w, shape in zip(weights, _block_shapes(width, weights[8].shape[0])):
        if w is not None and not (type(w) is np.ndarray and w.dtype is dtype
                                  and w.shape == shape and w.flags.carray):
            return None
    shape = key_cache.shape
    if not (key_cache.dtype is dtype and value_cache.dtype is dtype and key_cache.ndim == 4
            and shape[:2] == (batch, n_head) and shape[3] == width // n_head
            and value_cache.shape == shape and 0 <= position < shape[2]
            and key_cache.flags.carray and value_cache.flags.carray
            and not np.may_share_memory(key_cache, value_cache)
            and not np.may_share_memory(key_cache, x)
            and not np.may_share_memory(value_cache, x)):
        return None
    return x, tuple(weights), n_head, position, eps


def block_decode_args(x, weights, key_cache, value_cache, position, n_head, eps):
    """functional/block.py's arguments: x (B, C) float; ``weights`` the block's twelve arrays
    (BlockWeights' order and shapes, any bias or layer-norm weight None) of x's dtype; the caches
    (B, nh, Smax, C/nh) C-contiguous, writeable, of x's dtype, neither sharing memory with the
    other or with x; position an int in [0, Smax); n_head an int >= 1 dividing C; eps a finite
    real >= 0. Returns (x C-contiguous, the twelve arrays C-contiguous, n_head, position, eps)."""
    common = _block_decode_common(x, weights, key_cache, value_cache, position, n_head, eps)
    if common is not None:
        return common
    x = float_array("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must have shape (B, C): one new position per row; got {x.shape}")
    batch, width = x.shape
    n_head = size("n_head", n_head, 1)
    if width % n_head:
        raise ValueError(f"n_head must divide x's C = {width}; got {n_head}")
    if not isinstance(weights, (tuple, list)) or len(weights) != 12:
        got = (f"a {type(weights).__name__} of {len(weights)}"
               if isinstance(weights, (tuple, list)) else type(weights).__name__)
        raise TypeError(f"weights must be the block's 12 arrays (functional.block.BlockWeights); "
                        f"got {got}")
    fc = weights[8]
    hidden = fc.shape[0] if isinstance(fc, np.ndarray) and fc.ndim == 2 else None
    if hidden is None:
        raise ValueError(f"weights.fc_weight must be a (F, {width}) array; got "
                         f"{getattr(fc, 'shape', type(fc).__name__)}")
    shapes = _block_shapes(width, hidden)
    names = ("ln_1_weight", "ln_1_bias", "attn_weight", "attn_bias", "attn_proj_weight",
             "attn_proj_bias", "ln_2_weight", "ln_2_bias", "fc_weight", "fc_bias",
             "mlp_proj_weight", "mlp_proj_bias")
    checked = []
    for i, (name, value, shape) in enumerate(zip(names, weights, shapes)):
        if value is None and i in BLOCK_OPTIONAL:
            checked.append(None)
            continue
        arr = float_array(f"weights.{name}", value)
        same_dtype(f"weights.{name}", arr, "x", x)
        exact_shape(f"weights.{name}", arr, shape, f"to match x (B, {width})")
        checked.append(contiguous(arr))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if type(cache) is not np.ndarray:
            raise TypeError(f"{name} must be a NumPy array (it is written in place); got "
                            f"{type(cache).__name__}")
        same_dtype(name, cache, "x", x)
        if cache.ndim != 4 or cache.shape[:2] != (batch, n_head) or cache.shape[3] != width // n_head:
            raise ValueError(f"{name} must have shape (B, nh, Smax, hs) = ({batch}, {n_head}, "
                             f"Smax, {width // n_head}) to match x {x.shape} and n_head "
                             f"{n_head}; got {cache.shape}")
        if not (cache.flags.c_contiguous and cache.flags.writeable and cache.flags.aligned):
            raise ValueError(f"{name} must be a C-contiguous, writeable array (it is written in "
                             f"place)")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"value_cache must have key_cache's shape {key_cache.shape}; got "
                         f"{value_cache.shape}")
    if np.may_share_memory(key_cache, value_cache) or any(
            np.may_share_memory(cache, x) for cache in (key_cache, value_cache)):
        raise ValueError("key_cache, value_cache and x must not share memory (the caches are "
                         "written in place)")
    position = int_value("position", position)
    if not 0 <= position < key_cache.shape[2]:
        raise ValueError(f"position must be in [0, Smax = {key_cache.shape[2]}); got {position}")
    eps = real_float("eps", eps, "a real number >= 0")
    if not 0.0 <= eps < math.inf:                    # also rejects NaN
        raise ValueError(f"eps must be a finite real number >= 0; got {eps}")
    return contiguous(x), tuple(checked), n_head, position, eps


# ---------------------------------------------------------------- embedding, cross-entropy, norm

INT64_RANGE = (-2**63, 2**63 - 1)


def int_value(name, value, what="an int"):
    """A Python or NumPy integer (not a bool) as an int."""
    if type(value) is int:                                  # the common case, at once
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    return int(value)


def index_array(name, value, what="an integer array"):
    """``value`` as an integer ndarray: bool and float arrays are a ``TypeError``."""
    if type(value) is np.ndarray and value.dtype.kind in "iu":    # the common case, at once
        return value
    if value is None:
        raise TypeError(f"{name} must be {what}; got None")
    arr = converted(name, value, what)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be {what}; got dtype {arr.dtype}")
    return arr


def indices_in_range(name, arr, stop, what, allowed=None):
    """Every entry of the integer array ``arr`` in [0, stop) (or equal to ``allowed``).

    A ``ValueError`` names the first offending value in C order and its position, e.g.
    ``indices must be in [0, 10) (weight has 10 rows); got 12 at position (1, 2)``.
    """
    if arr.size <= 16:
        if all(0 <= v < stop for v in arr.ravel().tolist()):
            return    # a decoded token's index: in Python, a fifth of the array expressions
    elif arr.min() >= 0 and arr.max() < stop:
        return        # the common case: two reductions, a third of the masks' cost
    bad = (arr < 0) | (arr >= stop)
    if allowed is not None:
        bad &= arr != allowed
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])    # () for a 0-d array
        raise ValueError(f"{name} must be in [0, {stop}) {what}; got {arr[pos]} at position "
                         f"{pos}")


def as_int64(arr):
    """An integer array already checked to lie in int64's range, as C-contiguous, writeable
    int64 (see :func:`contiguous` for why writeable)."""
    return contiguous(np.asarray(arr, dtype=np.int64))


def embedding_args(indices, weight, padding_idx):
    """indices (...) integer in [0, V), weight (V, E) float, padding_idx None or in [-V, V).

    Returns indices as C-contiguous int64, weight C-contiguous, and padding_idx as -1 (none) or
    a row in [0, V) (a negative one counts from the end, as in PyTorch).
    """
    weight = float_array("weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape (num_embeddings, embedding_dim); got "
                         f"{weight.shape}")
    n_rows = weight.shape[0]
    indices = index_array("indices", indices)
    indices_in_range("indices", indices, n_rows, f"(weight has {n_rows} rows)")
    if padding_idx is None:
        padding_idx = -1
    else:
        padding_idx = int_value("padding_idx", padding_idx, "an int or None")
        if not -n_rows <= padding_idx < n_rows:
            raise ValueError(f"padding_idx must be in [{-n_rows}, {n_rows}) for weight with "
                             f"{n_rows} rows; got {padding_idx}")
        padding_idx %= n_rows
    return as_int64(indices), contiguous(weight), padding_idx


def embedding_backward_args(dout, indices, weight, padding_idx):
    indices, weight, padding_idx = embedding_args(indices, weight, padding_idx)
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "weight", weight)
    exact_shape("dout", dout, indices.shape + weight.shape[1:],
                f"(indices.shape + (embedding_dim,)) to match indices {indices.shape} and "
                f"weight {weight.shape}")
    return contiguous(dout), indices, weight, padding_idx


REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_args(input, target, ignore_index, reduction, label_smoothing):
    """input (C,), (N, C) or (N, C, d1, ...) float; target (), (N,) or (N, d1, ...) integer
    class indices in [0, C) or equal to ignore_index.

    Returns input and target as given (the functional layer moves the class axis), ignore_index
    as an int, reduction and label_smoothing checked.
    """
    input = float_array("input", input)
    min_ndim("input", input, 1, "(C,), (N, C) or (N, C, d1, ...)")
    if target is not None:
        try:
            arr = np.asarray(target)
        except (ValueError, TypeError):              # ragged: index_array names it below
            arr = np.asarray(None)
        if np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"target must hold class indices (an integer array): class "
                            f"probabilities are not supported; got dtype {arr.dtype}")
    target = index_array("target", target, "an integer array of class indices")
    n_classes = input.shape[1 if input.ndim > 1 else 0]
    expected = () if input.ndim == 1 else (input.shape[0],) + input.shape[2:]
    exact_shape("target", target, expected,
                f"(input's shape without its class dim 1) to match input {input.shape}")
    ignore_index = int_value("ignore_index", ignore_index)
    if not INT64_RANGE[0] <= ignore_index <= INT64_RANGE[1]:
        raise ValueError(f"ignore_index must fit in int64; got {ignore_index}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    label_smoothing = probability("label_smoothing", label_smoothing)
    indices_in_range("target", target, n_classes,
                     f"(input has {n_classes} classes) or equal ignore_index = {ignore_index}",
                     allowed=ignore_index)
    return input, target, ignore_index, reduction, label_smoothing


def cross_entropy_backward_args(dout, input, target, ignore_index, reduction, label_smoothing):
    args = cross_entropy_args(input, target, ignore_index, reduction, label_smoothing)
    input, target = args[:2]
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "input", input)
    if reduction == "none":
        exact_shape("dout", dout, target.shape, "(target's shape, for reduction='none')")
    else:
        exact_shape("dout", dout, (), f"(0-d, for reduction={reduction!r})")
    return (dout,) + args


def normalized_shape_value(name, normalized_shape):
    """PyTorch's ``normalized_shape``: an int or a non-empty sequence of non-negative ints."""
    if type(normalized_shape) is tuple and normalized_shape and all(
            type(n) is int and n >= 0 for n in normalized_shape):
        return normalized_shape                             # the common case, at once
    if isinstance(normalized_shape, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or a tuple of ints; got bool")
    if isinstance(normalized_shape, numbers.Integral):
        dims = (normalized_shape,)
    elif isinstance(normalized_shape, (tuple, list)) or (
            isinstance(normalized_shape, np.ndarray) and normalized_shape.ndim == 1):
        dims = tuple(normalized_shape)
    else:
        raise TypeError(f"{name} must be an int or a tuple of ints; got "
                        f"{type(normalized_shape).__name__}")
    for n in dims:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an int or a tuple of ints; got {normalized_shape!r}")
        if n < 0:
            raise ValueError(f"{name} must not have negative dims; got {normalized_shape!r}")
    if not dims:
        raise ValueError(f"{name} must have at least one dim (the trailing dims of x to "
                         f"normalise); got {normalized_shape!r}")
    return tuple(int(n) for n in dims)


def layer_norm_args(x, normalized_shape, weight, bias, eps):
    """x (..., *normalized_shape) float; weight and bias of shape normalized_shape or None;
    eps a finite real >= 0. Returns x, weight, bias C-contiguous, the shape and eps."""
    shape = normalized_shape_value("normalized_shape", normalized_shape)
    dtype = x.dtype if type(x) is np.ndarray else None
    if ((dtype is FLOAT32 or dtype is FLOAT64) and x.flags.carray
            and x.ndim >= len(shape) and x.shape[x.ndim - len(shape):] == shape
            and _kernel_ready(weight, dtype, shape) and _kernel_ready(bias, dtype, shape)
            and type(eps) is float and 0.0 <= eps < math.inf):
        return x, shape, weight, bias, eps      # the common case at once: as the checks below
    x = float_array("x", x)
    if x.ndim < len(shape) or x.shape[x.ndim - len(shape):] != shape:
        dims = ", ".join(str(n) for n in shape)
        raise ValueError(f"x must have shape (..., {dims}) to match normalized_shape "
                         f"{shape}; got {x.shape}")
    if weight is not None:
        weight = float_array("weight", weight)
        same_dtype("weight", weight, "x", x)
        exact_shape("weight", weight, shape, "(normalized_shape)")
    if bias is not None:
        bias = float_array("bias", bias)
        same_dtype("bias", bias, "x", x)
        exact_shape("bias", bias, shape, "(normalized_shape)")
    eps = real_float("eps", eps, "a real number >= 0")
    if not (0.0 <= eps < math.inf):                  # also rejects NaN
        raise ValueError(f"eps must be a finite real number >= 0; got {eps}")
    x, weight, bias = contiguous(x, weight, bias)
    return x, shape, weight, bias, eps


def layer_norm_backward_args(dout, x, normalized_shape, weight, bias, eps, stats=None):
    x, shape, weight, bias, eps = layer_norm_args(x, normalized_shape, weight, bias, eps)
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "x", x)
    exact_shape("dout", dout, x.shape, "to match x")
    if stats is not None:
        lead = x.shape[:x.ndim - len(shape)]
        pair = isinstance(stats, (tuple, list))
        if not pair or len(stats) != 2:
            got = f"a {type(stats).__name__} of {len(stats)}" if pair else type(stats).__name__
            raise TypeError(f"stats must be the (mean, rstd) pair layer_norm_forward returned "
                            f"(return_stats=True) or None; got {got}")
        checked = []
        for name, value in zip(("stats[0] (mean)", "stats[1] (rstd)"), stats):
            value = converted(name, value, "a float64 array")
            if value.dtype != np.float64:
                raise TypeError(f"{name} must have dtype float64 (layer_norm_forward's "
                                f"statistics); got {value.dtype}")
            exact_shape(name, value, lead, "(x's leading dims)")
            checked.append(value)
        stats = contiguous(*checked)
    return contiguous(dout), x, shape, weight, bias, eps, stats


# ---------------------------------------------------------------- gelu

APPROXIMATIONS = ("none", "tanh")


def approximation(name, value):
    """GELU's ``approximate``: "none" (the exact erf form) or "tanh", as PyTorch spells them."""
    if not isinstance(value, str) or value not in APPROXIMATIONS:
        raise ValueError(f"{name} must be one of {APPROXIMATIONS}; got {value!r}")
    return value


def gelu_args(x, approximate):
    """x float of any shape -> x C-contiguous, and whether the tanh form is asked for."""
    x = float_array("x", x)
    tanh_form = approximation("approximate", approximate) == "tanh"
    return contiguous(x), tanh_form


def gelu_backward_args(dout, x, approximate):
    x, tanh_form = gelu_args(x, approximate)
    dout = float_array("dout", dout)
    same_dtype("dout", dout, "x", x)
    exact_shape("dout", dout, x.shape, "to match x")
    return contiguous(dout), x, tanh_form


# ---------------------------------------------------------------- rotary embedding

def rotary_args(x, cos, sin, interleaved, name="x"):
    """x (..., L, E) float with E even; cos, sin (L, E/2) of x's dtype; interleaved a bool.
    ``name``: what x is called (``dout`` for the backward). Returns x, cos, sin C-contiguous
    and the flag."""
    x = float_array(name, x)
    min_ndim(name, x, 2, "(..., L, E)")
    length, width = x.shape[-2:]
    if width % 2:
        raise ValueError(f"{name} must have an even last dim E (pairs of entries are rotated); "
                         f"got shape {x.shape}")
    tables = []
    for table_name, table in (("cos", cos), ("sin", sin)):
        table = float_array(table_name, table)
        same_dtype(table_name, table, name, x)
        exact_shape(table_name, table, (length, width // 2),
                    f"(L, E/2) to match {name} (..., {length}, {width})")
        tables.append(table)
    x, cos, sin = contiguous(x, *tables)
    return x, cos, sin, flag("interleaved", interleaved)


def rotary_backward_args(dout, cos, sin, interleaved):
    return rotary_args(dout, cos, sin, interleaved, name="dout")


def rotary_positions(name, x, dim, offset, max_len, owner):
    """A RotaryEmbedding's input (..., L, dim) at positions offset .. offset + L − 1 of its
    tables: checks the shape and offset + L <= max_len; returns offset as an int."""
    min_ndim(name, x, 2, f"(..., L, {dim})")
    if x.shape[-1] != dim:
        raise ValueError(f"{name} must have shape (..., L, {dim}) to match {owner}'s dim; got "
                         f"{x.shape}")
    offset = int_value("offset", offset, "an int >= 0")
    if offset < 0:
        raise ValueError(f"offset must be an int >= 0; got {offset}")
    length = x.shape[-2]
    if offset + length > max_len:
        raise ValueError(f"offset + L must be at most max_len = {max_len} ({name} has L = "
                         f"{length} positions, dim -2); got offset = {offset}, offset + L = "
                         f"{offset + length}")
    return offset


# ---------------------------------------------------------------- models (npattn.models)

def token_ids(name, value, vocab_size, block_size=None):
    """``value`` as token ids (B, T): integers in [0, vocab_size), T >= 1 and, when
    ``block_size`` is given, T <= block_size. Returns C-contiguous int64."""
    ids = index_array(name, value, "an integer array of token ids (B, T)")
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (B, T) (a batch of token sequences); got "
                         f"{ids.shape}")
    if ids.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one token per sequence (T >= 1); got "
                         f"shape {ids.shape}")
    if block_size is not None and ids.shape[1] > block_size:
        raise ValueError(f"{name} must have T <= block_size = {block_size} tokens (dim 1); "
                         f"got {ids.shape[1]} in shape {ids.shape}")
    indices_in_range(name, ids, vocab_size, f"(vocab_size = {vocab_size})")
    return as_int64(ids)


def token_targets(name, value, shape, vocab_size, ignore_index):
    """Next-token targets of ``shape`` (B, T): integers in [0, vocab_size) or ``ignore_index``.
    Returns C-contiguous int64."""
    targets = index_array(name, value, "an integer array of token ids (B, T)")
    exact_shape(name, targets, shape, "to match idx")
    indices_in_range(name, targets, vocab_size,
                     f"(vocab_size = {vocab_size}) or equal ignore_index = {ignore_index}",
                     allowed=ignore_index)
    return as_int64(targets)


def positive_real(name, value):
    """A finite real number > 0 (not a bool) as a float."""
    value = real_float(name, value, "a real number > 0")
    if not 0.0 < value < math.inf:                   # also rejects NaN
        raise ValueError(f"{name} must be a finite real number > 0; got {value}")
    return value
