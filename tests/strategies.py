"""Hypothesis strategies: shapes, dtypes, memory layouts and values for every op's tests.

Values come from a NumPy generator seeded by Hypothesis (fast for whole arrays, and it still
shrinks); what Hypothesis chooses directly is everything that changes the code path: the
dtype, every dim (0 and 1 included), the layout of each input in memory and the kind of values
(ordinary, tiny, huge logits up to ±1e30, -inf entries and fully masked rows, NaN).
"""
import numpy as np
from hypothesis import strategies as st

DTYPES = (np.float32, np.float64)
dtypes = st.sampled_from(DTYPES)

#: How an input sits in memory. Kernels only ever see C-contiguous data, so each of these
#: exercises the functional layer's canonicalisation.
LAYOUTS = ("contiguous", "fortran", "transposed", "sliced", "negative", "readonly")
layouts = st.sampled_from(LAYOUTS)


def dims(max_value=9, min_value=0):
    """One dim; 0 and 1 are drawn often since they are where the edge cases live."""
    return st.one_of(st.sampled_from([v for v in (0, 1) if v >= min_value]),
                     st.integers(min_value, max_value))


def shapes(min_ndim=0, max_ndim=4, max_dim=9, min_dim=0):
    return st.lists(dims(max_dim, min_dim), min_size=min_ndim, max_size=max_ndim).map(tuple)


@st.composite
def broadcastable_batches(draw, max_ndim=3, max_dim=4):
    """Two batch shapes that broadcast against each other, e.g. (3, 1, 4) and (5, 1)."""
    full = draw(st.lists(dims(max_dim), max_size=max_ndim))
    a, b = [], []
    for n in full:
        stretched = draw(st.sampled_from(["neither", "a", "b"]))  # which side holds a 1
        a.append(1 if stretched == "a" else n)
        b.append(1 if stretched == "b" else n)
    drop = draw(st.integers(0, len(full)))  # leading dims one side leaves out
    if draw(st.booleans()):
        a = a[drop:]
    else:
        b = b[drop:]
    return tuple(a), tuple(b)


def make_values(rng, shape, dtype, kind="normal"):
    """Random values of one kind, as a C-contiguous array."""
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "tiny":
        x = rng.standard_normal(shape) * 1e-20
    elif kind == "wide":  # magnitudes spread over many decades
        x = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, size=shape)
    elif kind == "huge":  # logits up to ±1e30, which overflow any unshifted exp
        x = rng.standard_normal(shape) * 1e30
    elif kind == "masked":  # -inf entries and whole rows of -inf, as attention masks make
        x = rng.standard_normal(shape) * 3.0
        x = np.asarray(x)
        x[rng.random(shape) < 0.3] = -np.inf
        if x.ndim:
            x[rng.random(shape[:-1]) < 0.25] = -np.inf   # whole rows along the last axis
    elif kind == "nan":
        x = np.asarray(rng.standard_normal(shape))
        x[rng.random(shape) < 0.1] = np.nan
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(x, dtype=dtype).reshape(shape)  # keeps 0-d as 0-d


def lay_out(data, layout, rng):
    """A view with the same values as ``data`` but the given memory layout."""
    if layout == "contiguous" or data.ndim == 0:
        return data
    if layout == "fortran":
        return np.asfortranarray(data)
    if layout == "transposed":
        perm = rng.permutation(data.ndim)
        base = np.ascontiguousarray(data.transpose(perm))
        return base.transpose(np.argsort(perm))
    if layout == "sliced":
        base = np.zeros(tuple(2 * n + 1 for n in data.shape), dtype=data.dtype)
        view = base[tuple(slice(1, None, 2) for _ in data.shape)]
        view[...] = data
        return view
    if layout == "negative":
        axis = int(rng.integers(data.ndim))
        flip = tuple(slice(None, None, -1) if i == axis else slice(None) for i in range(data.ndim))
        base = np.ascontiguousarray(data[flip])
        return base[flip]
    if layout == "readonly":
        view = data.copy()
        view.flags.writeable = False
        return view
    raise ValueError(layout)


@st.composite
def arrays(draw, shape, dtype, kinds=("normal",)):
    """An array of the given shape and dtype, in a drawn layout, with drawn-kind values."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(kinds))
    layout = draw(layouts)
    return lay_out(make_values(rng, shape, dtype, kind), layout, rng)
