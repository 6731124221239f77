"""Variants of the GEMM engine against the engine as it is, in one process, interleaved.

    python -m benchmarks.engine_ab nopf:PREFETCH_B_ROWS=0,PREFETCH_C=False
    python -m benchmarks.engine_ab kc384:KC=384 nc1024:NC=1024 --dtype float64 --rounds 30
    python -m benchmarks.engine_ab rows6:tile=6x32 --threads 1
    python -m benchmarks.engine_ab nopf:PREFETCH_B_ROWS=0,PREFETCH_C=False --gpt baby

On a shared machine the same code can run 1.5× slower in one process than in the next, which
buries a 5 % change in the noise of separate runs (``python -m benchmarks`` compares npattn with
its peers in one run for the same reason). This compares *versions of npattn's own GEMM
engine* in one run: each variant is ``npattn/kernels/gemm.py`` with some of its module-level
constants set otherwise (``NAME=value``: the line ``NAME = ...`` becomes ``NAME = value``), or
with another register tile (``tile=MRxNR``), loaded as an engine instance of its own -- its
own module name, so its own kernels in Numba's disk cache (the variant's source is written to
``CACHE``) -- beside the engine in force, exactly as ``tiles.engine`` loads one.

Cases: the GPT's products (``SHAPES``: the baby's 768×128·128×384 and 768×512·512×128, the
6-layer's 2048×384·384×1536 and 2048×1536·1536×384), each run as the three products a linear
layer makes (x·Wᵀ, dY·W, dYᵀ·X with the bias gradient as its row sums, as linear_backward
runs them). Before timing, every variant's results are compared with the
engine's, bit for bit: a variant that changes bits says so (blocking and prefetching must not;
a tile of another shape need not). Then ``--rounds`` rounds, each timing every variant's case
once, in an order rotated from round to round. Reported per case: the engine's median, and
each variant's speedup against it (engine time / variant time; > 1: the variant is faster), of
the medians and of the best times. ``--gpt baby|six``: also whole training steps of that GPT
(``gpt_profile.train_workload``), ``tiles.engine`` handing the model each variant in turn, one
step each per round. A copy of the engine under another name (``same:KC=256``, say) measures the
harness's own bias: 0.99-1.02× on an Emerald Rapids Xeon.
"""
import argparse
import os
import re
import sys
import time

import numpy as np

#: Where the variants' sources (and, beside them, their compiled kernels) are kept
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "npattn-engine-ab")
#: (M, K, N) of the linear layers timed: x (M, K), W (N, K)
SHAPES = ((768, 128, 384), (768, 512, 128), (2048, 384, 1536), (2048, 1536, 384))


def parse_variant(text):
    """``name:NAME=value,...`` or ``name:tile=MRxNR[,...]`` -> (name, {NAME: value}, tile or
    None). ValueError naming the argument for anything else."""
    name, sep, spec = text.partition(":")
    if not sep or not name.isidentifier() or not spec:
        raise ValueError(f"variant: expected name:NAME=value[,NAME=value...] (or tile=MRxNR), "
                         f"got {text!r}")
    constants, tile = {}, None
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"variant {name!r}: expected NAME=value, got {item!r}")
        if key == "tile":
            match = re.fullmatch(r"(\d+)x(\d+)", value)
            if not match:
                raise ValueError(f"variant {name!r}: tile must be MRxNR, e.g. 6x32; got {value!r}")
            tile = (int(match.group(1)), int(match.group(2)))
        elif key.isidentifier() and key.isupper():
            constants[key] = value
        else:
            raise ValueError(f"variant {name!r}: {key!r} is not a module constant of gemm.py "
                             f"(NAME in capitals) nor 'tile'")
    return name, constants, tile


def variant_source(source, constants):
    """gemm.py's ``source`` with each module-level ``NAME = ...`` line of ``constants`` set to
    ``NAME = value`` (its comment dropped). ValueError if gemm.py has no such line."""
    for key, value in constants.items():
        pattern = re.compile(rf"^{key} = .*$", re.M)
        if len(pattern.findall(source)) != 1:
            raise ValueError(f"variant: gemm.py has no module constant {key} (one line "
                             f"'{key} = ...' at the left margin)")
        source = pattern.sub(lambda _: f"{key} = {value}", source)
    return source


def load_variant(name, constants, tile, dtype):
    """The engine instance of a variant, for ``dtype`` under the tile family in force."""
    from npattn.kernels import tiles
    isa = tiles.isa_in_force()
    source = variant_source((tiles.HERE / "gemm.py").read_text(), constants)
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"gemm_{name}.py")
    if not os.path.exists(path) or open(path).read() != source:
        with open(path, "w") as f:
            f.write(source)
    base = tiles.tile(isa, dtype, "gemm")
    return tiles.load_instance(
        f"{tiles.__package__}.gemm[{isa}-{np.dtype(dtype).name}-ab-{name}]", path,
        tiles.Tile(isa, base.dtype, *(tile or (base.mr, base.nr))))


def linear_products(engine, x, w, d):
    """The three products of a linear layer on ``engine``: y = x·Wᵀ, dx = dY·W, dW = dYᵀ·x and
    with it the bias gradient db = Σ_rows dY, as ``linear_backward`` runs them."""
    y = np.empty((x.shape[0], w.shape[0]), x.dtype)
    dx = np.empty_like(x)
    dw = np.empty_like(w)
    db = np.empty(w.shape[0], w.dtype)
    engine.gemm(x, w, y, trans_b=True)
    engine.gemm(d, w, dx)
    engine.gemm(d, x, dw, trans_a=True, row_sums=db)
    return y, dx, dw, db


def interleaved(functions, rounds):
    """{name: [seconds per call]} of ``functions`` ({name: f}), each called once per round in an
    order rotated from round to round."""
    names = list(functions)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            functions[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratios(times, base):
    """(median, best) speedup of each variant against ``base``: base time / variant time."""
    return {name: (np.median(times[base]) / np.median(t), min(times[base]) / min(t))
            for name, t in times.items() if name != base}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="name:NAME=value[,...] or name:tile=MRxNR")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    parser.add_argument("--gpt", choices=("baby", "six"), help="also whole GPT training steps")
    parser.add_argument("--shapes", default=None,
                        help="MxKxN,... of the linear layers timed (default: SHAPES)")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive count, got {args.rounds}")
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(n) for n in item.split("x")) for item in args.shapes.split(",")]
        except ValueError:
            shapes = [()]
        if any(len(shape) != 3 or min(shape) < 1 for shape in shapes):
            parser.error(f"--shapes: expected MxKxN[,MxKxN...] of positive sizes, got "
                         f"{args.shapes!r}")
    import numba

    from npattn.kernels import tiles
    if args.threads:
        numba.set_num_threads(args.threads)
    dtype = np.dtype(args.dtype)
    engines = {"engine": tiles.engine("gemm", dtype)}
    for name, constants, tile in variants:
        engines[name] = load_variant(name, constants, tile, dtype)
    print(f"# GEMM engine variants, {tiles.isa_in_force()} {dtype.name}, "
          f"{numba.get_num_threads()} threads, {args.rounds} rounds, interleaved in one process")
    print()
    print("| case | engine median | " + " | ".join(f"{n}: median (best)" for n in engines
                                                    if n != "engine") + " |")
    print("|---|---:|" + "---:|" * (len(engines) - 1))
    rng = np.random.default_rng(0)
    for m, k, n in shapes:
        x, w, d = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (n, k), (m, n)))
        want = linear_products(engines["engine"], x, w, d)
        notes = []
        for name, engine in engines.items():
            got = linear_products(engine, x, w, d)
            if not all(np.array_equal(a, b) for a, b in zip(got, want)):
                worst = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                            for a, b in zip(got, want))
                if worst > 1e-4 if dtype == np.float32 else worst > 1e-12:
                    sys.exit(f"{name} disagrees with the engine on {m}×{k}·{k}×{n} "
                             f"(relative {worst:.2e}): not timed")
                notes.append(f"{name}: other bits")
        times = interleaved({name: (lambda e=engine: linear_products(e, x, w, d))
                             for name, engine in engines.items()}, args.rounds)
        cells = " | ".join(f"{a:.3f}× ({b:.3f}×)" for a, b in ratios(times, "engine").values())
        label = f"{m}×{k}·{k}×{n} x·Wᵀ, dY·W, dYᵀ·X" + (f" ({'; '.join(notes)})" if notes else "")
        print(f"| {label} | {np.median(times['engine']) * 1e3:.2f} ms | {cells} |")
    if args.gpt:
        from .bench_gpt import BABY, SIX
        from .gpt_profile import train_workload
        original = tiles.engine
        try:
            steps = _switched_steps(tiles, dtype, engines, BABY if args.gpt == "baby" else SIX,
                                    train_workload)
            times = interleaved(steps, args.rounds)
        finally:
            tiles.engine = original
        cells = " | ".join(f"{a:.3f}× ({b:.3f}×)" for a, b in ratios(times, "engine").values())
        print(f"| GPT {args.gpt} training step | {np.median(times['engine']) * 1e3:.2f} ms | "
              f"{cells} |")
    print()
    print("Speedup: the engine's time / the variant's (> 1: the variant is faster), of the "
          "medians and (in brackets) of the best times.")


def _switched_steps(tiles, dtype, engines, sizes, train_workload):
    """{name: one training step with ``tiles.engine`` handing out that engine for dtype} (the
    caller puts ``tiles.engine`` back)."""
    chosen = {"engine": engines["engine"]}
    original = tiles.engine

    def engine(name, wanted, isa=None):
        if name == "gemm" and isa is None and np.dtype(wanted) == dtype:
            return chosen["engine"]
        return original(name, wanted, isa)
    tiles.engine = engine
    step = train_workload(sizes)

    def run(e):
        chosen["engine"] = e
        step()
    for e in engines.values():          # every variant's kernels compiled before timing
        run(e)
    return {name: (lambda e=e: run(e)) for name, e in engines.items()}


if __name__ == "__main__":
    main()
