"""Register tiles per instruction set, and the engine instances compiled for them.

The GEMM micro-kernel keeps an MR×NR tile of C in vector registers for a whole K block
(``gemm.py``), and the attention engine is built from the same kind of tile (``attention.py``).
The tile is explicit vector code (``vector_tile.py``): each of its MR rows is one LLVM vector
of NR elements, which LLVM maps onto the CPU's registers. How big a tile fits depends on the
register file:

==========  ====================  ====================================  =======================
family      registers             GEMM tile (float32 / float64)         attention tile
==========  ====================  ====================================  =======================
avx2        16 × 256-bit (ymm)    6×16 / 6×8: 12 ymm accumulators,      4×16 / 4×8: 8 ymm
                                  2 rows of B, 1 broadcast
avx512      32 × 512-bit (zmm)    8×32 / 8×16: 16 zmm accumulators      the same
==========  ====================  ====================================  =======================

The attention engine keeps 4-row tiles on AVX2: its blocks (256 and 128 keys, 128 queries) are
powers of two, which 6 does not divide, and 6-row tiles with blocks that 6 divides measured no
faster, twice (docs/architecture.md §5).

Every AVX-512 CPU gets ``avx512``, Intel's as AMD's. LLVM's tuning for Intel's AVX-512 cores
prefers 256-bit vectors (``prefer-256-bit``), but that steers only its vectorisers: the
tile's vectors are written out, so LLVM legalises them to zmm registers on every AVX-512 CPU
(``tests/test_tiles.py`` compiles the tiles for ``skylake-avx512``, ``icelake-server``,
``sapphirerapids``, ``graniterapids``, ``x86-64-v4``, ``znver4`` and ``znver5`` and reads zmm
fused multiply-adds and no spill in the k loop). An earlier family, ``avx512-ymm`` (8×16 tiles
of ymm code, for when the tile came from the SLP vectoriser and Intel's CPUs got ymm), is
retired: on an Intel Xeon (Sapphire-Rapids class, reported as ``rocketlake``), one core, KC =
256 in L1, its 8×16 float32 ymm tile ran at 101–110 GFLOP/s against 186–205 for 8×32 in zmm,
float64 43 against 82–92 (measured when the family was reviewed, 2026-12).

Measured (``benchmarks/micro_kernel.py``: one thread, a KC = 256 product in L1, GFLOP/s,
median of interleaved rounds). AVX2 on an AMD EPYC Zen 3 (``znver3``, 2 × 256-bit FMA per
cycle), the explicit vector tiles: see ``docs/architecture.md`` §5 for the table; 6×16
float32 beat 4×16 by 12–14 %, 6×8 float64 beat 4×8 by 10–15 %, and whole products on one
thread gained 15–20 % (the SLP vectoriser's 6×16 spilled and ran at half speed, which is why
4×16 was the AVX2 tile before). AVX-512 on an AMD EPYC Zen 5 (``znver5``), the SLP code of the same shape:
float32 **8×32 229**, 6×32 228, 4×32 200, 16×16 213, 12×16 196, 8×16 182; float64 **8×16
115**, 6×16 111, 12×8 105, 8×8 91. AVX-512 on an Intel Xeon of the Emerald Rapids generation
(``emeraldrapids``, 2 × 512-bit FMA per cycle), the explicit vector tiles in zmm, against the
core's FMA peak measured in the same rounds (176 / 88 GFLOP/s), 2026-12-06: float32 **8×32
173** (98 %), 6×32 176, 12×32 173, 8×16 151, 4×32 147; float64 **8×16 85** (97 %), 6×16 87,
8×8 75 -- the tiles in force are within the rounds' noise of the best, at the peak. Whole
products on 2 threads (``python -m benchmarks.engine_ab t12:tile=12x32 t6x64:tile=6x64 --gpt
baby``, each tile as an engine of its own against 8×32, interleaved): on that Xeon 12×32 was
3–4 % faster on the GPT's products, but on an AMD EPYC Zen 4, 2026-12-07, 8×32 was the faster:
12×32 0.94–1.01× its speed, 6×64 0.98–1.02×, the baby GPT's step 0.96× / 0.98× -- so 8×32
stays the one AVX-512 float32 tile.

Which family is in force: ``NPATTN_ISA=avx2|avx512`` when set, else the host's: ``avx512``
when the CPU features Numba compiles for (``NUMBA_CPU_FEATURES``, else the host's as Numba
reads them) include AVX-512F, else ``avx2``.
Every tile is correct on every x86-64 CPU: the tile decides speed, never the result's validity.

Engine instances. A tile is not a global that kernels read when they compile -- Numba's disk
cache would then serve code compiled for one tile to a process using the other. Each engine
module (``gemm.py``, ``attention.py``) is instead loaded once per (ISA, dtype) it is used for,
as its own module, ``npattn.kernels.gemm[avx2-float32]`` say, whose kernels are distinct
functions compiled for that tile, cached under that name (``_jit``'s cache key). The module
reads its tile with :func:`tile_of` while it loads. :func:`engine` returns the instance for a
dtype, loading it on first use.
"""
import contextlib
import importlib.util
import os
import pathlib
import sys
import threading
from typing import NamedTuple

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ISAS = ("avx2", "avx512")
DTYPES = ("float32", "float64")
ENGINES = ("gemm", "attention")          # the modules compiled per tile

#: ISA -> bytes of one vector register (zmm, ymm)
VECTOR_BYTES = {"avx2": 32, "avx512": 64}

#: (ISA, dtype) -> (MR, NR), the GEMM engine's register tile (see the module docstring)
TILES = {
    ("avx2", "float32"): (6, 16),
    ("avx2", "float64"): (6, 8),
    ("avx512", "float32"): (8, 32),
    ("avx512", "float64"): (8, 16),
}

#: (ISA, dtype) -> (MR, NR), the attention engine's: 4 rows on AVX2 (its blocks are powers of 2)
ATTENTION_TILES = {
    **TILES,
    ("avx2", "float32"): (4, 16),
    ("avx2", "float64"): (4, 8),
}

#: engine -> its table
ENGINE_TILES = {"gemm": TILES, "attention": ATTENTION_TILES}


class Tile(NamedTuple):
    isa: str
    dtype: str
    mr: int
    nr: int

    def __str__(self):
        return f"{self.isa} {self.dtype} {self.mr}×{self.nr}"


def tile(isa, dtype, name="gemm"):
    """The Tile of engine ``name`` for an ISA and a dtype."""
    dtype = np.dtype(dtype).name
    return Tile(isa, dtype, *ENGINE_TILES[name][isa, dtype])


def cpu_features():
    """The CPU features Numba compiles for: ``NUMBA_CPU_FEATURES`` if set, else the host's (as
    Numba reads them from LLVM, without AVX under ``NUMBA_ENABLE_AVX=0``)."""
    import numba
    from numba.core import codegen
    features = numba.config.CPU_FEATURES or codegen.get_host_cpu_features()
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def cpu_name():
    """The CPU name Numba compiles for: ``NUMBA_CPU_NAME`` if set, else the host's (LLVM's)."""
    import numba
    from numba.core import codegen
    name = numba.config.CPU_NAME
    return codegen.ll.get_host_cpu_name() if name in (None, "host") else name


def host_isa():
    """The tile family this CPU calls for: its vector registers."""
    return "avx512" if "avx512f" in cpu_features() else "avx2"


_lock = threading.RLock()       # loading is re-entrant: attention's instance loads gemm's
_isa = None                     # the ISA in force, decided on first use
_engines = {}                   # (name, isa, dtype) -> module
_called = {}                    # engine()'s arguments as given -> module (emptied by using())
_loading = {}                   # module name -> Tile, while it loads


def isa_in_force():
    """``NPATTN_ISA`` if set (checked), else :func:`host_isa`; decided once per process."""
    global _isa
    if _isa is None:
        forced = os.environ.get("NPATTN_ISA")
        if forced is not None and forced not in ISAS:
            raise ValueError(f"NPATTN_ISA must be one of {', '.join(ISAS)}; got {forced!r}")
        _isa = forced or host_isa()
    return _isa


def other_isas():
    """The tile families not in force (CI runs the kernel tests again under each)."""
    return tuple(isa for isa in ISAS if isa != isa_in_force())


@contextlib.contextmanager
def using(isa):
    """Run the block with ``isa``'s tiles in force (tests); restores the previous choice."""
    global _isa
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}; got {isa!r}")
    with _lock:
        previous, _isa = isa_in_force(), isa
        _called.clear()
    try:
        yield
    finally:
        with _lock:
            _isa = previous
            _called.clear()


def engine(name, dtype, isa=None):
    """The instance of engine module ``name`` ("gemm" or "attention") for ``dtype``'s tile of
    ``isa`` (default: the ISA in force), loaded on first use. Loading compiles nothing."""
    module = _called.get((name, dtype, isa))   # every matrix product asks: one look-up
    if module is None:
        chosen = isa or isa_in_force()
        key = (name, chosen, np.dtype(dtype).name)
        module = _engines.get(key)
        if module is None:
            with _lock:
                module = _engines.get(key) or _load(*key)
        _called[name, dtype, isa] = module
    return module


def _load(name, isa, dtype):
    module = load_instance(f"{__package__}.{name}[{isa}-{dtype}]", HERE / f"{name}.py",
                           tile(isa, dtype, name))
    _engines[name, isa, dtype] = module
    return module


def load_instance(module_name, path, module_tile):
    """The engine module at ``path`` loaded as ``module_name`` for ``module_tile`` (a Tile):
    what :func:`engine` does once per (engine, ISA, dtype), and what ``benchmarks.engine_ab``
    does for a variant of gemm.py (a name of its own: kernels of its own in the disk cache)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = __package__               # its relative imports are the kernels'
    _loading[module_name] = module_tile
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        del _loading[module_name]
    return module


def tile_of(module_name):
    """For an engine module while it loads: its Tile. Imported any other way (``import
    npattn.kernels.gemm``) it has none, and this says how to get an instance."""
    try:
        return _loading[module_name]
    except KeyError:
        name = module_name.rpartition('.')[2]
        raise ImportError(
            f"{module_name} is compiled per register tile: get an instance with "
            f"npattn.kernels.tiles.engine({name!r}, dtype), or call it through npattn's "
            f"functions (the call map at the top of npattn/kernels/{name}.py shows the "
            f"way)") from None


def all_engines():
    """{module name: module} of every engine instance of every tile (loading each: cheap, no
    compile) -- for tools that enumerate kernels (warmup, tests)."""
    for name in ENGINES:
        for isa, dtype in TILES:
            engine(name, dtype, isa)
    return {module.__name__: module for module in _engines.values()}


def gemm(a, b, c, **options):
    """``gemm.gemm`` of the engine instance for c's dtype under the tile in force (the
    functional layer's entry point to every matrix product)."""
    return engine("gemm", c.dtype).gemm(a, b, c, **options)
