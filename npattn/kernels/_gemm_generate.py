"""Writes ``_gemm_micro.py``: the register-tile code of every tile, as straight-line code.

    python -m npattn.kernels._gemm_generate          # rewrite it
    python -m npattn.kernels._gemm_generate --check  # exit 1 if it is out of date

Why generated: the micro-kernel keeps an MR×NR tile of C in registers for a whole K block.
Numba has no register arrays -- a local ``np.zeros((MR, NR))`` lives in memory and every update
would be a load and a store -- but it does keep scalars in registers, and LLVM's SLP vectoriser
fuses rows of scalars into SIMD registers. So each accumulator is a named scalar ``c{i}_{j}``,
each k step loads MR values of A and NR of B and does MR·NR multiply-adds, and LLVM turns each
row of NR scalars into one or more vector registers and each row of updates into
broadcast-FMAs. Writing up to 128 such accumulators by hand would be unreadable and
error-prone; this script is the readable source, its output is the compiled one.

One micro-kernel per tile shape (``micro_{MR}x{NR}``, which writes its tile to a scratch array,
and ``micro_add_{MR}x{NR}``, which adds it straight into C: the GEMM engine's full tiles) and one
lane reduction per panel width
(``lane_max_{NR}``, the attention forward's running row maximum over NR queries held in NR
named scalars, for the same reason). The tiles themselves -- which shape each instruction set
and dtype gets, and the measurements behind them -- are in ``tiles.py``; this script writes the
code of every shape listed there. The functions are named by their shape, so a kernel cached
for one shape is never served for another.

The kernel takes its strip and panel as views starting at offset 0 (the caller slices): with
an offset argument, ``ap[a_off + p·MR + i]`` might be negative as far as LLVM can tell, Numba's
negative-index wraparound then guards every load, and the SLP vectoriser gives up (measured:
~45 instead of ~230 GFLOP/s float32 on 2 threads).
"""
import pathlib
import sys

from .tiles import TILES

HERE = pathlib.Path(__file__).resolve().parent
OUTPUT = HERE / "_gemm_micro.py"


def _tile_loop(mr, nr):
    """The accumulators' start and the k loop of an MR×NR tile: ``c{i}_{j} = Σ_p ap·bp``."""
    acc = [[f"c{i}_{j}" for j in range(nr)] for i in range(mr)]
    lines = ["    zero = ap.dtype.type(0)"]
    for i in range(mr):
        lines.append(f"    {', '.join(acc[i])} = {', '.join(['zero'] * nr)}")
    lines += ["    for p in range(kc):",
              f"        a = p * {mr}",
              f"        b = p * {nr}"]
    lines += [f"        a{i} = ap[a + {i}]" for i in range(mr)]
    for j in range(nr):
        lines.append(f"        b{j} = bp[b + {j}]")
        lines += [f"        {acc[i][j]} += a{i} * b{j}" for i in range(mr)]
    return acc, lines


def micro_kernel(mr, nr):
    """Source of ``micro_{mr}x{nr}(kc, ap, bp, tile)``."""
    acc, loop = _tile_loop(mr, nr)
    lines = [
        f"def micro_{mr}x{nr}(kc, ap, bp, tile):",
        f'    """tile[i, j] = Σ_p ap[p·{mr} + i] · bp[p·{nr} + j] for i < {mr}, j < {nr}, p < kc."""',
    ] + loop
    for i in range(mr):
        lines += [f"    tile[{i}, {j}] = {acc[i][j]}" for j in range(nr)]
    return "\n".join(lines) + "\n"


def micro_add(mr, nr):
    """Source of ``micro_add_{mr}x{nr}(kc, ap, bp, c, r0, j0)``: the same sums, added straight
    into a whole tile of C (no scratch tile to store and read back). Each row of C is a view
    from column j0 on, indexed by constants -- an index ``j0 + j`` would need Numba's
    negative-index guard on every store, and the SLP vectoriser would give up."""
    acc, loop = _tile_loop(mr, nr)
    lines = [
        f"def micro_add_{mr}x{nr}(kc, ap, bp, c, r0, j0):",
        f'    """c[r0 + i, j0 + j] += Σ_p ap[p·{mr} + i] · bp[p·{nr} + j] for i < {mr}, j < {nr},',
        f'    p < kc: c (M, N) C-contiguous, the tile inside it."""',
    ] + loop
    for i in range(mr):
        lines.append(f"    row = c[r0 + {i}, j0:j0 + {nr}]")
        lines += [f"    row[{j}] += {acc[i][j]}" for j in range(nr)]
    return "\n".join(lines) + "\n"


def lane_max(nr):
    """Source of ``lane_max_{nr}(pt, n_keys, out)``."""
    names = [f"m{c}" for c in range(nr)]
    lines = [
        f"def lane_max_{nr}(pt, n_keys, out):",
        f'    """out[c] = max_j pt[j·{nr} + c] over j < n_keys, NaN ignored, for c < {nr}."""',
        "    m = pt.dtype.type(-np.inf)",
        f"    {', '.join(names)} = {', '.join(['m'] * nr)}",
        "    for j in range(n_keys):",
        f"        x = pt[j * {nr}:(j + 1) * {nr}]",
    ]
    lines += [f"        {m} = x[{c}] if x[{c}] > {m} else {m}" for c, m in enumerate(names)]
    lines += [f"    out[{c}] = {m}" for c, m in enumerate(names)]
    return "\n".join(lines) + "\n"


#: Lane widths written whatever the tiles: ``softmax.row_max`` keeps 32 running maxima.
EXTRA_LANES = (32,)


def shapes():
    """The distinct tile shapes of ``TILES`` and the lane widths to write: every panel width,
    and ``EXTRA_LANES``, sorted."""
    tiles = sorted(set(TILES.values()))
    return tiles, sorted({nr for _, nr in tiles} | set(EXTRA_LANES))


def source():
    tiles, widths = shapes()
    listed = ", ".join(f"{mr}×{nr}" for mr, nr in tiles)
    header = f'''"""GENERATED by ``python -m npattn.kernels._gemm_generate`` -- do not edit; edit the generator.

The register-tile code of every tile in ``tiles.TILES`` ({listed}), as plain Python functions:
each engine instance (``gemm.py``, ``attention.py`` loaded for one tile) compiles the ones of its
tile -- the micro-kernel with ``_jit.fma_kernel`` (fused multiply-add and nothing else), the lane
reduction with ``_jit.kernel``.
"""
import numpy as np
'''
    parts = ([header] + [micro_kernel(mr, nr) for mr, nr in tiles]
             + [micro_add(mr, nr) for mr, nr in tiles] + [lane_max(nr) for nr in widths])
    return "\n\n".join(parts)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    text = source()
    if "--check" in argv:
        stale = not OUTPUT.exists() or OUTPUT.read_text() != text
        print("out of date" if stale else "up to date")
        return 1 if stale else 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.name} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
