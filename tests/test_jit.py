"""The Numba policy of npattn._jit: options, lazy compilation, and thread safety."""
import collections
import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import npattn
from npattn import _jit
from npattn.kernels import tiles


def run_python(code, **env):
    """Run ``code`` in a fresh interpreter; a crash (abort, segfault) is a failed test."""
    full_env = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def all_kernels():
    """Every compiled entry point of npattn.kernels: parallel wrappers and serial dispatchers."""
    import importlib
    import pkgutil

    import npattn.kernels as package
    from npattn.kernels import tiles
    modules = {info.name: importlib.import_module(f"npattn.kernels.{info.name}")
               for info in pkgutil.iter_modules(package.__path__)
               if info.name not in tiles.ENGINES}          # (those: one instance per tile)
    modules.update(tiles.all_engines())
    found = {}
    for label, module in modules.items():
        for name, obj in vars(module).items():
            if isinstance(obj, (_jit.ThreadSafeKernel, numba.core.registry.CPUDispatcher)):
                found[f"{label}.{name}"] = obj
    return found


# _jit.fma_kernel (contract only): the kernels whose order of operations is the point
FMA_ONLY = {"exp_parts", "exp_one",
            "exp_nonpositive", "exp_shifted", "exp_parts_f32", "exp_one_f32", "exp_nonpositive_f32",
            "exp_shifted_f32", "exp_series", "exp_series_tail", "exp_reduce", "exp_series_short",
            "exp_one_short",
            # kernels/gelu.py: the polynomials, the Fast2Sum, and the loops that inline them
            "exp_scaled", "mills", "half_square_exp", "tail_ratio", "tanh_parts",
            "normal_forward_block", "normal_backward_block", "tanh_forward_block",
            "tanh_backward_block",
            # ... their float32 forms (FLOAT32 in kernels/gelu.py) and exp's float32 series
            "exp_series_f32", "exp_scaled_f32", "half_square_exp_f32", "mills_f32",
            "tail_ratio_f32", "normal_small_f32", "normal_parts_f32", "normal_forward_block_f32",
            "normal_backward_block_f32", "tanh_parts_f32", "tanh_forward_block_f32",
            "tanh_backward_block_f32", "tanh_finish",
            # kernels/tanh.py and the soft cap's loops that inline it
            "series_f32", "series_f64", "tanh_slope_f32", "tanh_slope_f64", "softcap_scores",
            "softcap_tile"}
# exact_kernel: no fastmath at all, so that every copy of the code gives the same bits
EXACT = {"adam_block", "alibi_row", "alibi_panel", "rotate_halves_row", "rotate_pairs_row"}


def test_fastmath_never_assumes_finite_math():
    assert not {"nnan", "ninf", "fast"} & _jit.FASTMATH
    assert _jit.FASTMATH == {"contract", "reassoc"}  # see _jit: other flags broke determinism
    assert _jit.OPTIONS["cache"] and _jit.OPTIONS["nogil"]
    assert _jit.OPTIONS["error_model"] == "numpy"


def test_every_kernel_takes_the_project_options():
    kernels = all_kernels()
    assert len(kernels) >= 6
    for name, k in kernels.items():
        dispatcher = k.dispatcher if isinstance(k, _jit.ThreadSafeKernel) else k
        expected = dict(_jit.OPTIONS)
        if dispatcher.py_func.__name__ in FMA_ONLY:
            expected["fastmath"] = {"contract"}
        elif dispatcher.py_func.__name__ in EXACT:
            expected["fastmath"] = False
        for option, value in expected.items():
            if option == "cache":  # kept apart from the target options, as the cache object
                assert not isinstance(dispatcher._cache, numba.core.caching.NullCache), name
            elif option == "pipeline_class":          # kept by the dispatcher's compiler
                assert dispatcher._compiler.pipeline_class is value, f"{name}: {option}"
            else:
                assert dispatcher.targetoptions.get(option) == value, f"{name}: {option}"


def test_import_compiles_nothing():
    out = run_python("""
        import numba, npattn, importlib, pkgutil
        import npattn.kernels as package
        from npattn.kernels import tiles
        compiled = []
        modules = [importlib.import_module("npattn.kernels." + info.name)
                   for info in pkgutil.iter_modules(package.__path__)
                   if info.name not in tiles.ENGINES]
        for module in modules + list(tiles.all_engines().values()):
            for name, obj in vars(module).items():
                d = getattr(obj, "dispatcher", obj)
                if isinstance(d, numba.core.registry.CPUDispatcher) and d.signatures:
                    compiled.append(name)
        print("compiled:", compiled)
    """)
    assert "compiled: []" in out


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_concurrent_calls_from_python_threads(layer):
    """Numba's workqueue layer aborts the process when two threads launch a parallel kernel at
    once; npattn's guard serialises them. With any layer, results are the single-thread bits."""
    run_python("""
        import threading
        import numpy as np
        import npattn
        rng = np.random.default_rng(0)
        x = rng.standard_normal((64, 96)).astype(np.float32)
        w = rng.standard_normal((80, 96)).astype(np.float32)
        q = rng.standard_normal((2, 3, 40, 16)).astype(np.float32)
        o, lse = npattn.scaled_dot_product_attention_forward(q, q, q, is_causal=True)
        calls = [lambda: npattn.linear(x, w),
                 lambda: npattn.softmax(x, dim=-1),
                 lambda: npattn.matmul(x, x.T),
                 lambda: npattn.linear_backward(np.ones((64, 80), np.float32), x, w)[1],
                 lambda: npattn.dropout(x, 0.3, seed=7),
                 lambda: npattn.scaled_dot_product_attention(q, q, q, is_causal=True),
                 lambda: npattn.scaled_dot_product_attention_backward(
                     o, q, q, q, o, lse, is_causal=True)[1]]
        want = [c() for c in calls]
        errors = []
        def worker(t):
            for i in range(150):
                j = (t + i) % len(calls)
                if not np.array_equal(calls[j](), want[j]):
                    errors.append((t, i))
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors[:5]
        print("layer", npattn._jit.threading_layer())
    """, NUMBA_THREADING_LAYER=layer)


def test_threading_layer_is_reported_once_launched():
    npattn.softmax([[1.0, 2.0]])
    assert _jit.threading_layer() in {"tbb", "omp", "workqueue"}


# ---------------------------------------------------------------- parallel_items (ItemKernel)

@_jit.kernel
def _add_item(w, out, step):
    out[w] += step


@_jit.parallel_items(_add_item)
def _add_all(item, out, step):
    for w in numba.prange(out.shape[0]):
        _jit.call_body(item, (np.int64(w), out, step))


_Record = collections.namedtuple("_Record", "values shift")


@_jit.kernel
def _record_item(w, out, record):
    out[w] = record.values[w] + record.shift


@_jit.parallel_items(_record_item)
def _record_all(item, out, record):
    for w in numba.prange(out.shape[0]):
        _jit.call_body(item, (np.int64(w), out, record))


def test_a_record_argument_gets_code_for_its_field_types():
    """A namedtuple argument (the attention engine's records) is keyed by the types of its
    fields, not its class alone: code compiled for int64 fields must not read float64 ones
    (it read their bits as integers before the key looked inside)."""
    out = np.zeros(4)
    _record_all(out, _Record(np.arange(4, dtype=np.int64), 1))
    assert out.tolist() == [1, 2, 3, 4]
    _record_all(out, _Record(np.arange(4, dtype=np.float64) / 2, 0.25))
    assert out.tolist() == [0.25, 0.75, 1.25, 1.75]
    _record_all(out, _Record(np.arange(4, dtype=np.float64)[::-1], 0.0))   # another layout
    assert out.tolist() == [3, 2, 1, 0]
    assert len(_record_all.dispatcher.signatures) == 3


def _address_types(kernel):
    """The types of the loop's first parameter (a body's address), one per compiled version."""
    return [signature[0] for signature in kernel.dispatcher.signatures]


def _libraries(library):
    """The names of a compiled library and of every library linked into it, recursively."""
    names = {library.name}
    for linked in getattr(library, "_linking_libraries", ()):
        names |= _libraries(linked)
    return names


def _defines(loop, body):
    """Whether the loop's code, compiled for each of its versions' signatures, links the code
    of ``body``. Compiled afresh: a version loaded from the disk cache keeps no such record."""
    fresh = numba.njit(parallel=True, **{**_jit.OPTIONS, "cache": False})(loop.py_func)
    for signature in loop.signatures:
        fresh.compile(signature)
        if body.py_func.__qualname__ in _libraries(fresh.overloads[signature].library):
            return True
    return False


@_jit.parallel_kernel
def _add_all_linked(out, step):
    for w in numba.prange(out.shape[0]):
        _add_item(np.int64(w), out, step)


def test_a_parallel_items_loop_calls_its_body_through_an_address():
    """The loop is compiled for its body's address (an int64, so that a call unboxes nothing
    but arrays and numbers) and never links the body's code, once for each new combination
    of argument types; each version calls the body compiled for exactly its types."""
    out = np.zeros(6)
    _add_all(out, 1)
    _add_all(out[::2], 2)                         # another layout: another version
    _add_all(out, np.float32(0.5))                # another type of step
    _add_all(out, 3)                              # known types: no new version
    assert np.array_equal(out, [6.5, 4.5] * 3)
    assert _address_types(_add_all) == [numba.types.int64] * 3
    assert len(_add_item.signatures) == 3
    assert not _defines(_add_all, _add_item)
    _add_all_linked(out, 1)                       # the check can fail: a plain call links
    assert _defines(_add_all_linked, _add_item)


def test_the_engines_call_their_work_items_through_an_address():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(dtype) for _ in range(3))
        v.flags.writeable = False                 # a read-only input is another version
        out, lse = npattn.scaled_dot_product_attention_forward(q, k, v)
        npattn.scaled_dot_product_attention_backward(out, q, k, v, out, lse)
        npattn.matmul(rng.standard_normal((64, 300)).astype(dtype),    # gemm_kernel's A·B
                      rng.standard_normal((300, 1100)).astype(dtype))  # (few rows, wide B)
        npattn.matmul(rng.standard_normal((30, 40)).astype(dtype),     # batched_gemm_kernel's
                      rng.standard_normal((40, 70)).astype(dtype))     # (a small product)
    for dtype in (np.float32, np.float64):
        attention = tiles.engine("attention", dtype)
        gemm = tiles.engine("gemm", dtype)
        for kernel in (attention.attention_forward_kernel, attention.attention_backward_kernel,
                       gemm.gemm_kernel, gemm.batched_gemm_kernel):
            assert isinstance(kernel, _jit.ItemKernel)
            assert set(_address_types(kernel)) == {numba.types.int64}
            assert len(kernel.dispatcher.signatures) >= 1
            assert not any(_defines(kernel, item) for item in kernel.items)


# ------------------------------------------------------------------ serial twins

def _twin_cases(dtype, rng):
    """(kernel, args builder) for every parallel kernel whose serial twin a caller uses
    (ThreadSafeKernel.serial): shapes around and past the sizes the callers switch at."""
    from npattn.kernels.adam import DECOUPLED, adam_kernel
    from npattn.kernels.decode import decode_attention_kernel
    from npattn.kernels.gelu import gelu_backward_kernel, gelu_forward_kernel
    from npattn.kernels.layer_norm import layer_norm_forward_kernel
    gemm = tiles.engine("gemm", dtype)
    f = lambda *shape: rng.standard_normal(shape).astype(dtype)       # noqa: E731
    for m, n, k in [(1, 384, 128), (2, 128, 128), (3, 65, 37), (1, 1152, 384)]:
        one = np.zeros(1, np.int64)
        yield gemm.small_dot_kernel, lambda m=m, n=n, k=k, one=one: (
            f(1, m, k), f(1, n, k), np.empty((1, m, n), dtype), f(n), one, one, False,
            gemm._small_columns(-(-m // 2), n)), (2,)
    for rows, width in [(1, 128), (3, 384), (40, 100)]:
        yield layer_norm_forward_kernel, lambda r=rows, w=width: (
            f(r, w), f(w), f(w), 1e-5, np.empty((r, w), dtype), np.empty(r), np.empty(r)), \
            (4, 5, 6)
    for size in [17, 512, 4096, 9000]:
        yield gelu_forward_kernel, lambda s=size: (f(s) * 4, False, np.empty(s, dtype)), (2,)
        yield gelu_backward_kernel, lambda s=size: (f(s), f(s) * 4, True,
                                                    np.empty(s, dtype)), (3,)
    from npattn.kernels.rotary import rotary_kernel
    for rows, length, width in [(3, 3, 8), (64, 16, 64), (150, 50, 66)]:
        for interleaved, inverse in [(False, False), (True, True)]:
            yield rotary_kernel, lambda r=rows, n=length, w=width, i=interleaved, v=inverse: (
                f(r, w), f(n, w // 2), f(n, w // 2), i, v, np.empty((r, w), dtype)), (5,)
    from npattn.kernels.embedding import ROWS, embedding_forward_kernel
    for n_idx in [1, ROWS, 3 * ROWS + 1]:
        yield embedding_forward_kernel, lambda n=n_idx: (
            rng.integers(-2, 70, n), f(65, 24), np.empty((n, 24), dtype)), (2,)
    t = dtype.type
    for size in [100, 16384, 40000]:
        yield adam_kernel, lambda s=size: (f(s), f(s), f(s), np.abs(f(s)), np.abs(f(s)),
                                           t(0.999), t(0.1), t(0.1), t(0.99), t(0.01), t(1e-8),
                                           t(0.003), t(0.3), DECOUPLED, True, False), (0, 2, 3, 4)
    for heads, rows, keys, chunk in [(4, 1, 40, 64), (6, 1, 200, 100), (2, 3, 130, 64)]:
        yield decode_attention_kernel, lambda h=heads, r=rows, n=keys, c=chunk: (
            f(1, h, r, 32), f(1, h, 256, 32), f(1, h, 256, 20), n, True, 0.2, c,
            np.empty((1, h, r, 20), dtype), np.empty((1, h, r, 3), dtype),
            np.empty((1, h, -(-n // c), r, 22), dtype)), (7, 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_serial_twins_give_the_kernels_bits(dtype):
    """A caller may run a kernel's serial twin for small work (the launch would cost more):
    the twin is the same source without ``parallel``, and must give bitwise the same outputs,
    so which one ran never shows."""
    rng = np.random.default_rng(7)
    for kernel, build, outputs in _twin_cases(np.dtype(dtype), rng):
        args = build()
        twin = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
        kernel(*args)
        kernel.serial(*twin)
        for i in outputs:
            assert np.array_equal(args[i], twin[i], equal_nan=True), (kernel.__name__, i)


def test_without_the_width_attribute_the_kernels_compile_narrower_and_info_says_why(tmp_path):
    """If llvmlite stops carrying the function attribute "prefer-vector-width"="512" (here its
    printer drops attributes it does not list), npattn notices at import (_jit.FULL_WIDTH),
    compiles its kernels without it -- correct results, a cache directory of their own -- and
    ``npattn info`` says so. (Compiled for an Intel CPU name, where it decides the width.)"""
    out = run_python("""
        import json
        from llvmlite.ir import values
        listed = values.FunctionAttributes._to_list
        def printer_without_strings(self, ret_type):
            return [a for a in listed(self, ret_type) if not a.startswith('"')]
        values.FunctionAttributes._to_list = printer_without_strings
        import numpy as np, npattn
        from npattn import _jit
        from npattn.tools import info
        x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
        y = npattn.softmax(x, dim=-1)
        e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
        widths = info.vector_widths()
        print(json.dumps(dict(reason=_jit.FULL_WIDTH, key=_jit.cache_key(),
                              error=float(np.abs(y - e / e.sum(-1, keepdims=True)).max()),
                              loops=_jit.loop_vector_register(), note=widths["note"])))
    """, NUMBA_CPU_NAME="sapphirerapids", NUMBA_CACHE_DIR=str(tmp_path))
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["reason"] == "llvmlite does not print the attribute", probe
    assert probe["key"].endswith("-narrow"), probe
    assert probe["error"] < 1e-6, probe
    assert probe["loops"] == "ymm", probe                 # Intel's tuning, not lifted
    assert "could not give its loops" in probe["note"] and probe["reason"] in probe["note"]


def test_with_the_width_attribute_the_cache_key_is_plain():
    assert _jit.FULL_WIDTH is None
    assert not _jit.cache_key().endswith("-narrow")


def test_thread_count_is_the_calling_threads_get_num_threads():
    """_jit.thread_count() (read from the pool, without get_num_threads' locks) answers what
    numba.get_num_threads() answers: after set_num_threads, and per Python thread (the count is
    thread-local), so that gemm's plans (kept per thread count) and attention's block rows follow
    a caller's set_num_threads."""
    import threading
    before = numba.get_num_threads()
    seen = []
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS, 1):
            numba.set_num_threads(n)
            seen.append((_jit.thread_count(), numba.get_num_threads(), n))

            def other():
                seen.append((_jit.thread_count(), numba.get_num_threads(), None))
            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
    finally:
        numba.set_num_threads(before)
    assert all(fast == slow and want in (None, slow) for fast, slow, want in seen), seen
