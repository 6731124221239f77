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

from npattn.kernels import tiles, vector_tile
from test_gemm import gemm_cases, run_gemm, forced, truth
from closeness import assert_close
from test_jit import run_python


def test_every_tile_is_listed_for_every_isa_and_dtype():
    every = {(isa, d) for isa in tiles.ISAS for d in tiles.DTYPES}
    assert set(tiles.TILES) == set(tiles.ATTENTION_TILES) == every
    for isa, dtype in every:
        gemm = tiles.engine("gemm", dtype, isa)
        attention = tiles.engine("attention", dtype, isa)
        assert (gemm.MR, gemm.NR) == tiles.TILES[isa, dtype]
        mr, nr = tiles.ATTENTION_TILES[isa, dtype]
        assert (attention.MR, attention.NR) == (mr, nr)
        assert gemm.micro_kernel is vector_tile.tiles(gemm.MR, gemm.NR, gemm.PREFETCH_B_ROWS,
                                                      gemm.PREFETCH_C)[0]
        assert attention.micro_kernel is vector_tile.tiles(mr, nr)[0]
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
                       match=r"NPATTN_ISA must be one of avx2, avx512; got 'sse2'"):
        tiles.isa_in_force()
    monkeypatch.setenv("NPATTN_ISA", "avx2")
    assert tiles.isa_in_force() == "avx2" and tiles.other_isas() == ("avx512",)


@pytest.mark.parametrize("features, family", [
    ({"avx", "avx2", "fma"}, "avx2"),
    ({"avx2", "fma", "avx512f"}, "avx512"),
])
def test_host_isa_follows_the_cpu_features(monkeypatch, features, family):
    monkeypatch.setattr(tiles, "cpu_features", lambda: features)
    assert tiles.host_isa() == family


TILE_PROBE = r"""
    import json, re, numpy as np
    from numba import njit
    from npattn.kernels import tiles, vector_tile

    def fma_loops(asm):
        # the loops that are one basic block (a label, no other label, a jump back to it)
        # and hold fused multiply-adds, most first: the first is the k loop
        blocks = re.findall(r"^(\.LBB\w+):\n(.*?)(?=^\.LBB|\Z)", asm, re.M | re.S)
        loops = [re.split(rf"^\s+j\w+\s+{re.escape(label)}$", body, flags=re.M)[0]
                 for label, body in blocks
                 if re.search(rf"^\s+j\w+\s+{re.escape(label)}$", body, re.M)]
        return sorted((body for body in loops if "vfmadd" in body),
                      key=lambda body: -body.count("vfmadd"))

    def prefetches(text):
        return len(re.findall(r"^\s+prefetch", text, re.M))

    def report(asm, mr, nr, lanes):
        loops = fma_loops(asm)
        loop = loops[0]
        fmas = re.findall(r"vfmadd\w+\s+([^\n]*)", loop)
        return dict(tile=f"{mr}x{nr}", vectors=mr * -(-nr // lanes), fmas=len(fmas),
                    zmm=sum("zmm" in f for f in fmas), ymm=sum("ymm" in f for f in fmas),
                    stack=len(re.findall(r"\(%rsp\)", loop)),
                    prefetch=prefetches(loop),   # (outside: C's, before a k loop)
                    prefetch_outside=prefetches(asm) - sum(map(prefetches, loops)))

    out = dict(isa=tiles.isa_in_force(), cpu=tiles.cpu_name(), tiles=[], exps=[])
    for dtype in (np.float32, np.float64):
        gemm = tiles.engine("gemm", dtype)
        lanes = (64 if out["isa"] == "avx512" else 32) // np.dtype(dtype).itemsize
        # the GEMM's kernel that runs the tiles, as the engine compiles it
        matrix = "Array({}, 2, 'C')".format(np.dtype(dtype).name)
        vector = "Array({}, 1, 'C')".format(np.dtype(dtype).name)
        gemm.block_product.compile(f"({vector}, {vector}, int64, {matrix}, int64, int64, "
                                   f"{matrix}, boolean, {vector})")
        asm = gemm.block_product.inspect_asm(gemm.block_product.signatures[0])
        out["tiles"].append(dict(engine="gemm", **report(asm, gemm.MR, gemm.NR, lanes)))
        # the attention engine's tile
        attention = tiles.engine("attention", dtype)
        tile = attention.micro_kernel

        @njit
        def product(kc, ap, bp, t):
            tile(kc, ap, bp, t)
        mr, nr = attention.MR, attention.NR
        product.compile(f"(int64, {vector}, {vector}, {matrix})")
        asm = product.inspect_asm(product.signatures[0])
        out["tiles"].append(dict(engine="attention", **report(asm, mr, nr, lanes)))
        # the attention engine's exps, a row a vector (vector_exp.py): the forward's row loop
        # and the backward's row, each as the engine calls it
        exp_rows, grad_row = attention.exp_rows, attention.grad_row

        @njit
        def rows(x, shift, e):
            exp_rows(x, shift, e)

        @njit
        def grad(t, dp, kept, dropped, scale, shift, inv, d, ds, w):
            grad_row(t, dp, kept, dropped, scale, shift, inv, d, ds, w)
        name = np.dtype(dtype).name
        rows.compile(f"({vector}, {vector}, {vector})")
        grad.compile(f"({vector}, {vector}, Array(bool, 1, 'C'), boolean, {name}, {name}, "
                     f"{name}, {name}, {vector}, {vector})")
        for kind, fn in (("exp_rows", rows), ("grad_row", grad)):
            asm = fn.inspect_asm(fn.signatures[0])
            fmas = re.findall(r"vfn?madd\w+\s+([^\n]*)", asm)
            loops = fma_loops(asm)
            out["exps"].append(dict(
                kind=kind, dtype=name, nr=nr, lanes=lanes, fmas=len(fmas),
                zmm=sum("zmm" in f for f in fmas), ymm=sum("ymm" in f for f in fmas),
                loop_fmas=loops[0].count("vfmadd") if loops else 0,
                loop_stack=len(re.findall(r"\(%rsp\)", loops[0])) if loops else None))
    print(json.dumps(out))
"""

#: The CPU features handed to LLVM with each CPU name (code is only generated, never run).
AVX512_FEATURES = ("+sse4.2,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+avx512f,+avx512dq,+avx512bw,"
                   "+avx512vl,+avx512cd")
AVX2_FEATURES = "+sse4.2,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,-avx512f"


@pytest.mark.parametrize("cpu, features, isa", [
    *((cpu, AVX512_FEATURES, "avx512") for cpu in (
        "skylake-avx512", "icelake-server", "sapphirerapids", "graniterapids", "x86-64-v4",
        "znver4", "znver5")),
    ("haswell", AVX2_FEATURES, "avx2"),
    ("znver3", AVX2_FEATURES, "avx2"),
])
def test_the_tiles_run_at_full_width_on_every_cpu(cpu, features, isa, tmp_path):
    """Compiled for each CPU name (in a child process, code generated, never run), the k loop
    of every register tile -- the GEMM's, inside the kernel that runs it, and the attention
    engine's -- is fused multiply-adds on the widest registers the CPU has: zmm on every
    AVX-512 CPU, Intel's included (whose LLVM tuning prefers ymm in vectorised loops), ymm
    under AVX2; one per accumulator vector; and no stack access (no spill, no reload). The
    GEMM's AVX-512 tile prefetches (B in its k loop, C before it) and no other tile does. The
    attention engine's exps (vector_exp.py: the forward's rows, the backward's row) are wide
    fused multiply-adds too, the forward's row loop without stack access."""
    probe = json.loads(run_python(TILE_PROBE, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
                                  NUMBA_CACHE_DIR=str(tmp_path)))
    assert (probe["cpu"], probe["isa"]) == (cpu, isa), probe
    wide, narrow = ("zmm", "ymm") if isa == "avx512" else ("ymm", "zmm")
    for tile in probe["tiles"]:
        assert tile[wide] == tile["fmas"] and tile[narrow] == 0, (cpu, tile)
        assert tile["fmas"] % tile["vectors"] == 0 and tile["fmas"] >= tile["vectors"], (cpu, tile)
        assert tile["stack"] == 0, (cpu, tile)
        # the GEMM's AVX-512 k loop asks for B's rows ahead, and its tile for C's rows before
        # the loop (gemm.PREFETCH_*: measured faster there); the others prefetch nothing
        prefetches = tile["engine"] == "gemm" and isa == "avx512"
        assert (tile["prefetch"] > 0) == prefetches, (cpu, tile)
        assert (tile["prefetch_outside"] > 0) == prefetches, (cpu, tile)
    # the attention engine's exps: every fused multiply-add on the wide registers, as many
    # per step as the row has vectors (exp.py's Horner steps, each a multiple of them); the
    # forward's rows in one loop of their own, which on AVX-512 neither spills nor reloads.
    # (Under AVX2 exp's constants, the shift and a row outgrow the 16 ymm registers: the loop
    # re-reads hoisted constants from the stack -- float32, 4 loads among 20 fused
    # multiply-adds per row -- and float64, with its 14 series coefficients, also spills two
    # temporaries per row; not asserted there)
    assert len(probe["exps"]) == 4, probe["exps"]
    for exps in probe["exps"]:
        vectors = -(-exps["nr"] // exps["lanes"])
        assert exps[wide] == exps["fmas"] > 0 and exps[narrow] == 0, (cpu, exps)
        assert exps["fmas"] % vectors == 0, (cpu, exps)
        if exps["kind"] == "exp_rows":
            assert exps["loop_fmas"] >= 8 * vectors, (cpu, exps)   # the series, in the loop
            assert exps["loop_stack"] == 0 or isa == "avx2", (cpu, exps)


LOOP_PROBE = r"""
    import json, re
    from npattn import _jit
    from npattn.kernels import tiles
    from npattn.kernels.gelu import gelu_forward_kernel

    def registers(asm):
        # the vector registers of the floating-point arithmetic (multiplies, adds, FMAs)
        ops = re.findall(r"^\s+v(?:fmadd|fnmadd|mul|add|sub)\w*p[sd]\s+([^\n]*)", asm, re.M)
        return {r: sum(r in o for o in ops) for r in ("zmm", "ymm")}

    gelu_forward_kernel.dispatcher.compile("(Array(float32, 1, 'C'), boolean, "
                                           "Array(float32, 1, 'C'))")
    gelu = gelu_forward_kernel.dispatcher.inspect_asm(gelu_forward_kernel.signatures[0])
    print(json.dumps(dict(cpu=tiles.cpu_name(), full_width=_jit.FULL_WIDTH,
                          npattn=_jit.loop_vector_register(),
                          numba=_jit.loop_vector_register(npattns=False),
                          gelu=registers(gelu))))
"""


@pytest.mark.parametrize("cpu, features, isa", [
    *((cpu, AVX512_FEATURES, "avx512") for cpu in (
        "skylake-avx512", "icelake-server", "sapphirerapids", "graniterapids", "x86-64-v4",
        "znver4")),
    ("haswell", AVX2_FEATURES, "avx2"),
])
def test_the_other_loops_run_at_full_width_on_every_cpu(cpu, features, isa, tmp_path):
    """The loops LLVM vectorises in npattn's kernels (not the tiles) use the widest registers
    too: compiled for each CPU name in a child process, a plain loop of npattn's and GELU's
    parallel kernel (its prange body, compiled apart by Numba, and the helpers it calls) do
    their arithmetic in zmm on every AVX-512 CPU -- where on Intel's the same loop compiled by
    Numba's own compiler is ymm (LLVM's prefer-256-bit tuning, which npattn's
    "prefer-vector-width"="512" lifts: _jit.FullWidthCompiler) -- and in ymm under AVX2."""
    probe = json.loads(run_python(LOOP_PROBE, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
                                  NUMBA_CACHE_DIR=str(tmp_path)))
    assert probe["cpu"] == cpu and probe["full_width"] is None, probe
    wide, narrow = ("zmm", "ymm") if isa == "avx512" else ("ymm", "zmm")
    assert probe["npattn"] == wide, probe
    if cpu != "znver4" and isa == "avx512":
        assert probe["numba"] == "ymm", probe     # Intel's tuning: what the attribute lifts
    gelu = probe["gelu"]
    assert gelu[wide] > 0 and gelu[wide] >= 4 * gelu[narrow], probe


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
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 1100)).astype(np.float32)
    c = npattn.matmul(a, b)                          # gemm_kernel: few rows, a wide B
    gemm = tiles.engine("gemm", np.float32)
    stats = {name: (sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))
             for name, k in (("block", gemm.block_product),
                             ("loop", gemm.gemm_kernel.dispatcher),
                             ("rows", gemm.rows_item))}
    print(json.dumps(dict(isa=tiles.isa_in_force(), tile=f"{gemm.MR}x{gemm.NR}",
                          stats=stats, bits=c.tobytes().hex()[:64])))
"""


def test_the_cache_never_serves_one_tiles_kernels_to_the_other(tmp_path):
    """A process whose cache holds the avx512 tile's kernels, forced to avx2, compiles and runs
    avx2's own kernels (6×16); the next avx2 process loads them; the bits agree."""
    cache = dict(NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    first = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx512", **cache))
    other = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx2", **cache))
    again = json.loads(run_python(CACHE_PROBE, NPATTN_ISA="avx2", **cache))
    assert (first["isa"], first["tile"]) == ("avx512", "8x32")
    assert (other["isa"], other["tile"]) == ("avx2", "6x16")
    for name, (hits, misses) in other["stats"].items():
        assert misses >= 1 and hits == 0, f"{name}: avx2 was served from avx512's cache"
    for name, (hits, misses) in again["stats"].items():
        # (block_product is compiled into its caller: a process whose callers all come from
        # the cache need not load it at all)
        assert misses == 0, f"{name}: avx2's own cache entry was not used"
        assert hits >= 1 or name == "block", f"{name}: avx2's own cache entry was not used"
    assert first["bits"] == other["bits"] == again["bits"]
