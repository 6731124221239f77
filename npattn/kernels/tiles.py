"""Register tiles per instruction set, and the engine instances compiled for them.

The GEMM micro-kernel keeps an MR×NR tile of C in vector registers for a whole K block
(``gemm.py``), and the attention engine is built from the same tiles (``attention.py``). How
big a tile fits depends on the register file:

==========  ======================  ======================================================
family      registers LLVM uses     tile (float32 / float64), accumulators in registers
==========  ======================  ======================================================
avx2        16 × 256-bit (ymm)      4×16 / 4×8: 8 ymm accumulators, 2 B rows, broadcasts
avx512      32 × 512-bit (zmm)      8×32 / 8×16: 16 zmm accumulators, 2 B rows, broadcasts
avx512-ymm  32 × 256-bit (ymm)      8×16 / 8×16: 16 (float32) or 32 (float64) ymm
==========  ======================  ======================================================

The family is the register file LLVM compiles for, which is not only the instruction set: on
an AVX-512 CPU LLVM emits 512-bit vectors for AMD's (``znver4``, ``znver5``) but prefers
256-bit vectors for Intel's (``skylake-avx512`` … ``graniterapids``, and ``x86-64-v4``):
checked by compiling a loop for each of those CPU names (``tests/test_tiles.py``). An 8×32
float32 tile compiled to ymm code needs 32 accumulators and spills, so Intel's AVX-512 CPUs get
``avx512-ymm``, whose tiles were measured on one.

Measured (``benchmarks/micro_kernel.py``: one thread, a KC = 256 product in L1, GFLOP/s,
median of 15 interleaved rounds). AVX2 code (LLVM told ``haswell`` features, 16 ymm) on an
Intel Xeon (model 167, 2 × 256-bit FMA per cycle, the class of Zen 2/3): float32 3×16 43,
4×16 45, 5×16 48, 6×16 34, 8×16 25 -- from 6×16 on, LLVM's register allocator spills; float64
3×8 22, 4×8 24, 5×8 25, 6×8 17, 3×16 25, 4×16 14, 8×16 8.5. The powers of two are taken
(4×16, 4×8: within noise of the best, and every block size of the engines stays a multiple
of them). AVX-512 on an AMD EPYC Zen 5 (znver5), one thread, 15 rounds: float32 **8×32 229**,
6×32 228, 4×32 200, 16×16 213, 12×16 196, 8×16 182, 12×32 136 (spills), 14×32 119; float64
**8×16 115**, 6×16 111, 12×8 105, 8×8 91. In whole products on 2 threads, 8×32 against 8×16
(interleaved, one process): n = 512 1.17×, 1024 1.20×, 2048 1.15×, linear [8,512,512]→2048
1.05×, attention forward L = 1024 1.12× (causal 1.11×); n = 128 0.79×.

Which family is in force: ``NPATTN_ISA=avx2|avx512|avx512-ymm`` when set, else the host's:
``avx2`` unless the CPU features Numba compiles for (``NUMBA_CPU_FEATURES``, else the host's as
Numba reads them) include AVX-512F; then ``avx512`` when the CPU name LLVM compiles for
(``NUMBA_CPU_NAME``, else the host's) is AMD's (``znver*``), else ``avx512-ymm``. (Measured on
an Intel AVX-512 CPU, model 167, ymm code: float32 8×16 38.5 vs 4×16 34, float64 8×16 16.5 vs
4×8 17.)
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
ISAS = ("avx2", "avx512", "avx512-ymm")
DTYPES = ("float32", "float64")
ENGINES = ("gemm", "attention")          # the modules compiled per tile

#: (ISA, dtype) -> (MR, NR), the register tile (see the module docstring for the measurements)
TILES = {
    ("avx2", "float32"): (4, 16),
    ("avx2", "float64"): (4, 8),
    ("avx512", "float32"): (8, 32),
    ("avx512", "float64"): (8, 16),
    ("avx512-ymm", "float32"): (8, 16),
    ("avx512-ymm", "float64"): (8, 16),
}

#: CPU names (as LLVM has them) for which LLVM vectorises AVX-512 code with 512-bit registers;
#: for the other AVX-512 CPUs (Intel's) it prefers 256-bit vectors (see the module docstring).
ZMM_CPU_PREFIXES = ("znver",)


class Tile(NamedTuple):
    isa: str
    dtype: str
    mr: int
    nr: int

    def __str__(self):
        return f"{self.isa} {self.dtype} {self.mr}×{self.nr}"


def tile(isa, dtype):
    """The Tile of an ISA and a dtype."""
    dtype = np.dtype(dtype).name
    return Tile(isa, dtype, *TILES[isa, dtype])


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
    """The tile family this CPU calls for: its vector registers, as LLVM will use them."""
    if "avx512f" not in cpu_features():
        return "avx2"
    return "avx512" if cpu_name().startswith(ZMM_CPU_PREFIXES) else "avx512-ymm"


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
    module_name = f"{__package__}.{name}[{isa}-{dtype}]"
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    module.__package__ = __package__               # its relative imports are the kernels'
    _loading[module_name] = tile(isa, dtype)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        del _loading[module_name]
    _engines[name, isa, dtype] = module
    return module


def tile_of(module_name):
    """For an engine module while it loads: its Tile. Imported any other way (``import
    npattn.kernels.gemm``) it has none, and this says how to get an instance."""
    try:
        return _loading[module_name]
    except KeyError:
        raise ImportError(
            f"{module_name} is compiled per register tile: get an instance with "
            f"npattn.kernels.tiles.engine({module_name.rpartition('.')[2]!r}, dtype)") from None


def sibling(module_name, name):
    """From an engine module while it loads: engine ``name``'s instance for the same tile."""
    t = tile_of(module_name)
    return engine(name, t.dtype, t.isa)


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
