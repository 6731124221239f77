"""The GEMM micro-kernel alone, per register tile: how many GFLOP/s each MR×NR reaches.

    python -m benchmarks.micro_kernel                          # npattn's candidates, this CPU
    python -m benchmarks.micro_kernel --isa avx2               # AVX2 code on any x86-64 CPU
    python -m benchmarks.micro_kernel --tiles 4x16:float32,6x16:float32 --rounds 25

This is the measurement behind ``npattn/kernels/tiles.py``'s table. Each candidate is the
register tile ``npattn/kernels/vector_tile.py`` writes for that shape (explicit vectors, as the
engines compile it), called in a serial loop on one thread: a KC = 256 product whose packed A
and B (``kc·MR`` and ``kc·NR`` elements) stay in L1. So the figure is the tile's ceiling -- the GEMM's packing, cache blocking and threads come on
top (``python -m benchmarks --ops gemm`` measures the whole). Before timing, each candidate's
tile is checked against NumPy's float64 product of the same panels.

Rounds are interleaved (every candidate once per round, in turn), and the median and best of
``--rounds`` are reported: on a shared machine a slow round hits one candidate, not a column.

``--threads N`` runs each timed call on N threads at once (a ``prange`` over N, each iteration
the same loop on its own copy of the operands; Python threads calling the loops measured no
overlap): the figures are then the N cores' sum, and the peak is that of N cores busy together
-- what a product on N threads can reach at most. On a shared cloud host that need not be N
times one core's (a 2-vCPU Zen 3 measured 99-194 GF/s for the float32 tile's sum between runs
minutes apart, one core 99-100), and the one-thread figures do not show it.

The first row of each dtype is the core's **FMA peak**, measured in the same rounds: CHAINS
independent fused multiply-adds on vectors of the family's register width (zmm for avx512, ymm
for avx2), written as LLVM vectors as the tiles are, no memory access -- as many FLOPs a
cycle as the core retires, at the clock it keeps while doing so (which a CPU's nominal clock
does not tell: AVX-512 code may run slower, a boost faster). Each tile's "% of peak" is its
median against the peak's median.

``--isa avx2`` re-executes the benchmark with Numba told a Haswell-class CPU
(``NUMBA_CPU_NAME=haswell`` and AVX-512 features off): the code an AVX2-only CPU (Zen 2/3,
Haswell..Comet Lake) gets, run here -- the instruction mix and register count of that code,
on this core's execution units. ``--isa native`` (the default) compiles for the host.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from .isa import AVX2_FEATURES

#: The candidates measured when --tiles is not given: around each ISA's tiles in npattn.
DEFAULT_TILES = ("4x16:float32,5x16:float32,6x16:float32,8x16:float32,"
                 "4x32:float32,6x32:float32,8x32:float32,12x32:float32,"
                 "4x8:float64,5x8:float64,6x8:float64,8x8:float64,6x16:float64,8x16:float64")
KC = 256
CHAINS = 12   # independent FMA chains: ≥ latency (4) × FMA ports (2), ≤ 16 registers with 2 more


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro_kernel",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default=DEFAULT_TILES,
                        help="comma-separated MRxNR:dtype candidates (default: %(default)s)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="compile for the host, or for an AVX2-only CPU (default: native)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--flops", type=float, default=2e8,
                        help="floating-point operations per timed call (default 2e8)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads running each timed call at once, each on its own "
                             "operands; the figures are their sum (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.threads <= 256:
        parser.error(f"--threads must be 1..256; got {args.threads}")
    return args


def parse_tiles(text):
    """'4x16:float32,...' -> [(4, 16, 'float32'), ...], with a clear error for a bad entry."""
    out = []
    for spec in text.split(","):
        try:
            shape, dtype = spec.strip().split(":")
            mr, nr = (int(v) for v in shape.split("x"))
        except ValueError:
            raise SystemExit(f"--tiles: expected entries like 4x16:float32, got {spec!r}")
        if dtype not in ("float32", "float64") or not (1 <= mr <= 16 and 1 <= nr <= 64):
            raise SystemExit(f"--tiles: {spec!r}: dtype float32|float64, 1 ≤ MR ≤ 16, "
                             f"1 ≤ NR ≤ 64")
        out.append((mr, nr, dtype))
    return out


def reexec_for_avx2(argv):
    """Run this benchmark again with Numba targeting an AVX2-only CPU; returns its exit code."""
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES,
           "NPATTN_MICRO_REEXEC": "avx2"}
    return subprocess.call([sys.executable, "-m", "benchmarks.micro_kernel", *argv], env=env)


def build(mr, nr, dtype, np, njit):
    """(loop, ap, bp, tile): ``loop(reps, ...)`` calls the MR×NR micro-kernel ``reps`` times."""
    from npattn.kernels import vector_tile
    micro = vector_tile.tiles(mr, nr)[0]

    @njit(nogil=True)
    def loop(reps, kc, ap, bp, tile):
        for _ in range(reps):
            micro(kc, ap, bp, tile)

    # small integers: every product and partial sum is exact (|Σ| ≤ 256·8·8 < 2^24), so the
    # tile must equal the exact product bit for bit, whatever the order or FMA contraction
    rng = np.random.default_rng(mr * 100 + nr)
    ap = rng.integers(-8, 9, KC * mr).astype(dtype)
    bp = rng.integers(-8, 9, KC * nr).astype(dtype)
    tile = np.zeros((mr, nr), dtype)
    loop(1, KC, ap, bp, tile)                    # compiles, and gives the tile to check
    want = ap.reshape(KC, mr).astype(np.int64).T @ bp.reshape(KC, nr).astype(np.int64)
    if not np.array_equal(tile, want):
        i, j = np.argwhere(tile != want)[0]
        raise SystemExit(f"{mr}x{nr} {dtype}: the micro-kernel's tile[{i}, {j}] is "
                         f"{tile[i, j]}, not {want[i, j]}; not timing a wrong kernel")
    return loop, ap, bp, tile


def build_peak(dtype, np, njit):
    """(loop, flops per call of ``loop(reps, x)``): CHAINS chains of vector fused
    multiply-adds, ``reps`` steps each, on vectors one register of the family in force wide;
    the loop returns their sum (so no step is dead code)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from npattn.kernels import tiles
    lanes = tiles.VECTOR_BYTES[tiles.isa_in_force()] // np.dtype(dtype).itemsize

    @intrinsic
    def chains(typingctx, reps, x):
        def codegen(context, builder, signature, values):
            count, value = values
            element = context.get_value_type(signature.args[1])
            vector = ir.VectorType(element, lanes)
            width = "f32" if dtype == "float32" else "f64"
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vector, [vector] * 3),
                f"llvm.fma.v{lanes}{width}")
            undefined = ir.Constant(vector, ir.Undefined)
            splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
            xs = builder.shuffle_vector(
                builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0)),
                undefined, splat)
            # a = x·(1 - 2^-20): for 0 < x <= 1, acc -> acc·a + x converges (no overflow)
            shrink = ir.Constant(vector, [ir.Constant(element, 1.0 - 2.0 ** -20)] * lanes)
            a = builder.fmul(xs, shrink)
            accs = [cgutils.alloca_once_value(
                builder, builder.fmul(xs, ir.Constant(vector, [ir.Constant(element, i)] * lanes)))
                for i in range(CHAINS)]
            with cgutils.for_range(builder, count):
                for acc in accs:
                    builder.store(builder.call(fma, [builder.load(acc), a, xs]), acc)
            total = builder.load(accs[0])
            for acc in accs[1:]:
                total = builder.fadd(total, builder.load(acc))
            result = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
            for i in range(1, lanes):
                result = builder.fadd(result, builder.extract_element(
                    total, ir.Constant(ir.IntType(32), i)))
            return result
        return x(types.int64, x), codegen

    @njit(nogil=True)
    def loop(reps, x):
        return chains(reps, x)

    x = np.dtype(dtype).type(0.5)
    if not np.isfinite(loop(1000, x)):
        raise SystemExit(f"FMA peak probe ({dtype}): not finite; not timing it")
    return loop, x, 2.0 * CHAINS * lanes


def spread_tile(loop, n, numba):
    """``loop`` (build's) run by n threads at once, thread i on row i of stacked operands."""
    @numba.njit(parallel=True, nogil=True)
    def spread(reps, kc, aps, bps, tiles):
        for i in numba.prange(n):
            loop(reps, kc, aps[i], bps[i], tiles[i])
    return spread


def spread_peak(loop, n, numba):
    """``loop`` (build_peak's) run by n threads at once; returns their sum."""
    @numba.njit(parallel=True, nogil=True)
    def spread(reps, x):
        total = x - x
        for i in numba.prange(n):
            total += loop(reps, x)
        return total
    return spread


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    candidates = parse_tiles(args.tiles)
    if args.isa == "avx2" and os.environ.get("NPATTN_MICRO_REEXEC") != "avx2":
        return reexec_for_avx2(argv)

    import llvmlite.binding
    import numba
    import numpy as np
    from numba import njit

    from .machine import cpu_model, git_commit

    numba.set_num_threads(1)
    cases = []
    for mr, nr, dtype in candidates:
        loop, ap, bp, tile = build(mr, nr, dtype, np, njit)
        reps = max(1, int(args.flops / (2 * mr * nr * KC)))
        cases.append((f"{mr}×{nr}", dtype, loop, reps, ap, bp, tile, 2.0 * mr * nr * KC * reps))
    peaks = {}
    for dtype in dict.fromkeys(d for *_, d in candidates):
        loop, x, per_step = build_peak(dtype, np, njit)
        peaks[dtype] = (loop, x, max(1, int(args.flops / per_step)), per_step)
    rates = {(name, dtype): [] for name, dtype, *_ in cases}
    peak_rates = {dtype: [] for dtype in peaks}
    n = args.threads
    if n > numba.config.NUMBA_NUM_THREADS:
        raise SystemExit(f"--threads {n}: Numba has {numba.config.NUMBA_NUM_THREADS} threads "
                         f"(NUMBA_NUM_THREADS)")
    if n > 1:                                    # each thread the loop on its own operands
        numba.set_num_threads(n)
        cases = [(name, dtype, spread_tile(loop, n, numba), reps,
                  *(np.stack([v] * n) for v in (ap, bp, tile)), flops)
                 for name, dtype, loop, reps, ap, bp, tile, flops in cases]
        peaks = {dtype: (spread_peak(loop, n, numba), x, reps, per_step)
                 for dtype, (loop, x, reps, per_step) in peaks.items()}
    for _ in range(args.rounds):
        for dtype, (loop, x, reps, per_step) in peaks.items():
            start = time.perf_counter()
            loop(reps, x)
            peak_rates[dtype].append(n * per_step * reps / (time.perf_counter() - start) / 1e9)
        for name, dtype, loop, reps, ap, bp, tile, flops in cases:
            start = time.perf_counter()
            loop(reps, KC, ap, bp, tile)
            rates[name, dtype].append(n * flops / (time.perf_counter() - start) / 1e9)

    target = (f"AVX2 code (NUMBA_CPU_NAME={os.environ.get('NUMBA_CPU_NAME')}, AVX-512 off)"
              if os.environ.get("NPATTN_MICRO_REEXEC") == "avx2" else
              f"native code (LLVM CPU {llvmlite.binding.get_host_cpu_name()})")
    where = "one thread" if n == 1 else f"{n} threads at once, their sum"
    print(f"GEMM micro-kernel, KC = {KC}, {where}, GFLOP/s over {args.rounds} interleaved "
          f"rounds\n{cpu_model()}; {target}; Numba {numba.__version__}; commit {git_commit()}\n"
          f"command: python -m benchmarks.micro_kernel {' '.join(argv)}\n")
    print("| tile | dtype | median GFLOP/s | best GFLOP/s | % of peak |\n|---|---|---:|---:|---:|")
    for dtype, values in peak_rates.items():
        peak = statistics.median(values)
        print(f"| FMA peak ({CHAINS} chains) | {dtype} | {peak:.1f} | {max(values):.1f} | 100 |")
        for (name, dt), values in rates.items():
            if dt == dtype:
                print(f"| {name} | {dtype} | {statistics.median(values):.1f} | "
                      f"{max(values):.1f} | {100 * statistics.median(values) / peak:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
