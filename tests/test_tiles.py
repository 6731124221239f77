"""Register tiles (kernels/tiles.py): which tile is in force, that each tile's engine instance
runs its own code, that every tile computes the same GEMM bits on one CPU, and that Numba's disk
cache never serves one tile's kernels to a process that forced the other.

(The full kernel suite -- the tests marked ``kernel`` -- runs under each tile in CI:
``NPATTN_ISA=<the other> python -m pytest -m kernel``.)
"""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from npattn.kernels import tiles
from test_gemm import gemm_cases, run_gemm, forced, truth
from closeness import assert_close
from test_jit import run_python


def test_every_tile_is_listed_for_every_isa_and_dtype():
    assert set(tiles.TILES) == {(isa, d) for isa in tiles.ISAS for d in tiles.DTYPES}
    for (isa, dtype), (mr, nr) in tiles.TILES.items():
        gemm = tiles.engine("gemm", dtype, isa)
        attention = tiles.engine("attention", dtype, isa)
        assert (gemm.MR, gemm.NR) == (attention.MR, attention.NR) == (mr, nr)
        assert gemm.micro_kernel.py_func.__name__ == f"micro_{mr}x{nr}"
        assert attention.micro_kernel is gemm.micro_kernel
        assert attention.lane_max.py_func.__name__ == f"lane_max_{nr}"


def test_instances_are_distinct_modules_with_distinct_kernels():
    a = tiles.engine("gemm", np.float32, "avx2")
    b = tiles.engine("gemm", np.float32, "avx512")
    assert a is not b and a.__name__ != b.__name__
    assert a.gemm_kernel.dispatcher is not b.gemm_kernel.dispatcher
    assert a.gemm_kernel.py_func.__module__ == a.__name__       # what the cache is keyed on
    assert tiles.engine("gemm", np.float32, "avx2") is a         # loaded once


def test_plain_import_of_an_engine_says_how_to_get_an_instance():
    import importlib
    with pytest.raises(ImportError, match=r"tiles\.engine\('gemm', dtype\)"):
        importlib.import_module("npattn.kernels.gemm")


def test_npattn_isa_is_checked(monkeypatch):
    monkeypatch.setattr(tiles, "_isa", None)
    monkeypatch.setenv("NPATTN_ISA", "sse2")
    with pytest.raises(ValueError,
                       match=r"NPATTN_ISA must be one of avx2, avx512, avx512-ymm; got 'sse2'"):
        tiles.isa_in_force()
    monkeypatch.setenv("NPATTN_ISA", "avx2")
    assert tiles.isa_in_force() == "avx2" and tiles.other_isas() == ("avx512", "avx512-ymm")


@pytest.mark.parametrize("features, name, family", [
    ({"avx", "avx2", "fma"}, "znver3", "avx2"),
    ({"avx", "avx2", "fma"}, "haswell", "avx2"),
    ({"avx2", "fma", "avx512f"}, "znver4", "avx512"),
    ({"avx2", "fma", "avx512f"}, "znver5", "avx512"),
    ({"avx2", "fma", "avx512f"}, "sapphirerapids", "avx512-ymm"),
    ({"avx2", "fma", "avx512f"}, "x86-64-v4", "avx512-ymm"),
])
def test_host_isa_follows_the_cpu_features_and_name(monkeypatch, features, name, family):
    monkeypatch.setattr(tiles, "cpu_features", lambda: features)
    monkeypatch.setattr(tiles, "cpu_name", lambda: name)
    assert tiles.host_isa() == family


VECTOR_PROBE = r"""
    import json, re, numpy as np
    from numba import njit
    from npattn.kernels import tiles
    @njit(fastmath={"contract"})
    def axpy(a, x, y):
        for i in range(y.shape[0]):
            y[i] += a * x[i]
    x = np.ones(1000, np.float32)
    axpy.compile("(float32, float32[::1], float32[::1])")
    asm = axpy.inspect_asm(axpy.signatures[0])
    fma = re.findall(r"vfmadd\w+\s+([^\n]*)", asm)
    print(json.dumps(dict(isa=tiles.host_isa(), cpu=tiles.cpu_name(),
                          zmm=sum("zmm" in f for f in fma), ymm=sum("ymm" in f for f in fma))))
"""
#: The AVX-512 features of the CPUs below, for LLVM (code is only generated, never run).
AVX512_FEATURES = ("+sse4.2,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+avx512f,+avx512dq,+avx512bw,"
                   "+avx512vl,+avx512cd")


@pytest.mark.parametrize("cpu", ["znver4", "znver5", "skylake-avx512", "icelake-server",
                                 "sapphirerapids", "graniterapids", "x86-64-v4"])
def test_the_avx512_family_matches_the_registers_llvm_uses(cpu):
    """For each AVX-512 CPU name, LLVM's own vectorisation of a loop decides: zmm code for the
    avx512 family (8×32 float32 fits 32 zmm), ymm code for avx512-ymm (8×32 would spill)."""
    probe = json.loads(run_python(VECTOR_PROBE, NUMBA_CPU_NAME=cpu,
                                  NUMBA_CPU_FEATURES=AVX512_FEATURES))
    assert probe["cpu"] == cpu and probe["zmm"] + probe["ymm"] > 0, probe
    assert probe["isa"] == ("avx512" if probe["zmm"] else "avx512-ymm"), probe


def test_using_switches_the_engine_and_restores_it():
    before = tiles.isa_in_force()
    with tiles.using(tiles.other_isas()[0]):
        assert tiles.engine("gemm", np.float64).TILE.isa != before
    assert tiles.engine("gemm", np.float64).TILE.isa == before


@settings(max_examples=30, deadline=None)
@given(case=gemm_cases())
def test_every_tile_gives_the_same_gemm_bits(case):
    """Each C element is summed in k order in K blocks of KC, whatever the tile: on one CPU
    every tile gives the same bits (and each is within float tolerance of float64)."""
    *args, path = case
    a, b, c = args[:3]
    results = {}
    for isa in tiles.ISAS:
        with tiles.using(isa), forced(path):
            results[isa] = run_gemm(*args)
    want, scale = truth(*args)
    k = b.shape[2] if args[7] else b.shape[1]
    for isa, got in results.items():
        assert_close(got, want, dtype=a.dtype, n=k + 2, scale=scale)
    for isa in tiles.ISAS[1:]:
        np.testing.assert_array_equal(results[isa], results[tiles.ISAS[0]])


CACHE_PROBE = """
    import json, numpy as np, npattn
    from npattn.kernels import tiles
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 300)).astype(np.float32)
    b = rng.standard_normal((300, 50)).astype(np.float32)
    c = npattn.matmul(a, b)                          # the packed path: the micro-kernel
    gemm = tiles.engine("gemm", np.float32)
    stats = {name: (sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))
             for name, k in (("micro", gemm.micro_kernel),
                             ("loop", gemm.gemm_kernel.dispatcher),
                             ("rows", gemm.rows_item))}
    print(json.dumps(dict(isa=tiles.isa_in_force(), micro=gemm.micro_kernel.py_func.__name__,
                          stats=stats, bits=c.tobytes().hex()[:64])))
"""


def test_the_cache_never_serves_one_tiles_kernels_to_the_other(tmp_path):
    """A process whose cache holds the avx512 tile's kernels, forced to avx2, compiles and runs
    avx2's own kernels (4×16); the next avx2 process loads them; the bits agree."""
    cache = dict(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    first = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx512", **cache))
    other = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx2", **cache))
    again = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx2", **cache))
    assert (first["isa"], first["micro"]) == ("avx512", "micro_8x32")
    assert (other["isa"], other["micro"]) == ("avx2", "micro_4x16")
    for name, (hits, misses) in other["stats"].items():
        assert misses >= 1 and hits == 0, f"{name}: avx2 was served from avx512's cache"
    for name, (hits, misses) in again["stats"].items():
        # (the micro-kernel is compiled into its callers: a process whose callers all come
        # from the cache need not load it at all)
        assert misses == 0, f"{name}: avx2's own cache entry was not used"
        assert hits >= 1 or name == "micro", f"{name}: avx2's own cache entry was not used"
    assert first["bits"] == other["bits"] == again["bits"]
