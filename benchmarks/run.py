"""npattn against NumPy and PyTorch, case by case, from one run.

    python -m benchmarks                      # every case: a few minutes
    python -m benchmarks --quick              # smallest sizes, few rounds: seconds
    python -m benchmarks --ops gemm,linear    # some ops only (--list shows them)
    python -m benchmarks --ops attention --no-memory   # attention, times only
    python -m benchmarks --ops gpt-distributed  # data-parallel GPT on MPI (bench_distributed.py)

Prints progress, then one Markdown table (and, in full runs or with ``--memory``, one of the
peak resident memory of the cases that ask for it, each implementation in a fresh process);
writes results.md, results.json (machine, environment, raw times), gemm.png and attention.png
to --out (default benchmarks/results/). ``benchmarks/timing.py`` says how a case is timed,
``benchmarks/cases.py`` how to add one.

The environment is set before NumPy loads, so the suite re-executes itself when it must change
it, and says what it changed:

- ``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` are removed: they force OpenBLAS onto another
  kernel than the one it detects for this CPU, and NumPy is compared as a user gets it. (The
  effect depends on the CPU: Haswell's kernel ran at ~0.55× SkylakeX's on the 2-core AMD Zen 5
  machines the project was planned on; on a Zen 4 VM, n = 1024, at 1.10× in fp32 and 0.87× in fp64.)
- ``OPENBLAS_THREAD_TIMEOUT=14`` is set (``--keep-pools`` leaves it alone). After each call,
  OpenBLAS's idle workers spin for 2^28 cycles (~0.1 s) before they sleep, and on a 2-core
  machine a Numba or PyTorch kernel started meanwhile waits for time slices: an alternating
  pair of small calls cost 8.4 ms instead of 0.41 ms (``benchmarks/pools.py``; every run
  reports that probe with and without the setting). With 2^14 cycles (~6 µs) the pair costs
  what its two calls cost, and NumPy's own steady state is unchanged (n = 128…1024, fp32 and
  fp64, best of 6 runs each: within 1 %; 2^4 cost +12 µs per small product).

GNU OpenMP's pools (Numba's ``omp`` layer, PyTorch) spin ~10 ms after a kernel; rather than
shorten that spin (it keeps their back-to-back calls fast), ``benchmarks/timing.py`` pauses
before each timed call.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from .isa import AVX2_ENV, ISAS

#: Variables that force OpenBLAS onto a kernel other than the one it picks for this CPU.
BLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
#: OpenBLAS's idle workers spin 2^14 cycles (~6 µs) before sleeping, instead of 2^28: long
#: enough to bridge back-to-back BLAS calls, short enough to be asleep when another pool runs.
#: (OMP_WAIT_POLICY=PASSIVE was measured too: it slowed Numba's and PyTorch's small kernels.)
POOL_SETTINGS = {"OPENBLAS_THREAD_TIMEOUT": "14"}
WHY = {"OPENBLAS_CORETYPE": "forces an OpenBLAS kernel other than this CPU's",
       "OPENBLAS_L2_SIZE": "overrides the cache size OpenBLAS blocks for",
       "OPENBLAS_THREAD_TIMEOUT": "idle OpenBLAS workers sleep after ~6 µs instead of ~0.1 s"}
#: Set in the re-executed process: the JSON of the environment changes, {name: [old, new]}.
REEXEC_MARK = "NPATTN_BENCH_ENV_CHANGES"
RESULTS = Path(__file__).resolve().parent / "results"

FULL = dict(rounds=21, target=0.05, max_case_seconds=45.0, probe_seconds=0.3, settle=0.015)
QUICK = dict(rounds=3, target=0.005, max_case_seconds=5.0, probe_seconds=0.05, settle=0.015)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smallest sizes, few rounds: a smoke run of seconds")
    parser.add_argument("--ops", help="comma-separated ops to run (e.g. gemm,linear)")
    parser.add_argument("--impls", help="comma-separated implementations (npattn,numpy,pytorch)")
    parser.add_argument("--rounds", type=int, help="timed rounds per case (full 21, quick 3)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    parser.add_argument("--keep-pools", action="store_true",
                        help="leave OpenBLAS's thread timeout as the environment has it")
    parser.add_argument("--cold", action="store_true",
                        help="compile every kernel afresh (an empty Numba cache directory), so "
                             "first calls show the true compile time")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before each case, wait up to SECONDS for other processes to leave "
                             "the CPUs (on a shared machine)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="measure the peak resident memory of each implementation in a fresh "
                             "process, for the cases that ask for it (default: in full runs, "
                             "not in --quick; benchmarks/memory.py)")
    parser.add_argument("--isa", choices=ISAS, default="native",
                        help="native: each implementation as it runs on this CPU; avx2: all of "
                             "them as on an AVX2-only CPU, on this CPU's cores (benchmarks/isa.py)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    return parser.parse_args(argv)


def wanted_environment(env, keep_pools, isa="native"):
    """(the environment to run in, its changes {name: (old, new)}); None means unset."""
    want = {k: v for k, v in env.items() if k not in BLAS_OVERRIDES}
    if not keep_pools:
        want.update(POOL_SETTINGS)
    if isa == "avx2":
        want.update({name: value for name, (value, _) in AVX2_ENV.items()})
    changes = {k: (env.get(k), want.get(k)) for k in sorted(set(env) | set(want))
               if env.get(k) != want.get(k)}
    return want, changes


def prepare_environment(argv, keep_pools, isa="native"):
    """Re-execute this suite in the environment it needs (before NumPy is imported), once.

    Returns the changes made, {name: (old, new)}.
    """
    if REEXEC_MARK in os.environ:                     # we are the re-executed process
        return {k: tuple(v) for k, v in json.loads(os.environ.pop(REEXEC_MARK)).items()}
    want, changes = wanted_environment(os.environ, keep_pools, isa)
    if not changes:
        return {}
    if "numpy" in sys.modules:
        print("warning: NumPy was imported before the suite could set its environment; "
              "re-executing anyway", file=sys.stderr)
    want[REEXEC_MARK] = json.dumps(changes)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *argv], want)


def describe_changes(changes):
    if not changes:
        return ["environment: as given (no OpenBLAS override set, pool setting already in place "
                "or --keep-pools)"]
    lines = ["environment: re-executed with"]
    for name, (old, new) in changes.items():
        now = f"{name} unset" if new is None else f"{name}={new}"
        was = "unset" if old is None else repr(old)
        avx2_value, avx2_why = AVX2_ENV.get(name, (None, None))
        why = avx2_why if new is not None and new == avx2_value else WHY.get(name, "")
        lines.append(f"  {now} (was {was}): {why}")
    return lines


def selected(cases, ops, quick):
    """[(op, make, size)] of the registered cases, filtered by --ops."""
    known = sorted({c.op for c in cases})
    wanted = set(known) if not ops else {o.strip() for o in ops.split(",") if o.strip()}
    unknown = wanted - set(known)
    if unknown:
        raise SystemExit(f"unknown op(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    return [(c.op, c.make, size) for c in cases if c.op in wanted
            for size in (c.quick if quick else c.sizes)]


def probe_pools(changes, seconds, with_child):
    """The two-pool probe here (with the pool setting) and, if asked, in a child without it."""
    import subprocess

    from . import pools
    result = {"with_setting": pools.probe(seconds)}
    if with_child:
        env = dict(os.environ)
        for name, (old, _) in changes.items():   # the caller's own pool settings
            if name in POOL_SETTINGS:
                env.pop(name, None)
                if old is not None:
                    env[name] = old
        try:
            out = subprocess.run([sys.executable, "-m", "benchmarks.pools", str(seconds)],
                                 env=env, capture_output=True, text=True, timeout=300, check=True)
            result["without_setting"] = json.loads(out.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
            result["without_setting"] = {"error": str(error)}
    return result


def describe_probe(probe):
    def line(p):
        return (f"{p['pair_ms']:.2f} ms per alternating pair (alone: BLAS {p['blas_ms']:.2f} ms "
                f"+ Numba {p['numba_ms']:.2f} ms)")
    settings = ", ".join(f"{k}={v}" for k, v in probe["with_setting"]["env"].items())
    text = [f"two thread pools, probe: {'with ' + settings if settings else 'in this run'}: "
            f"{line(probe['with_setting'])}"]
    without = probe.get("without_setting")
    if without and "error" not in without:
        text.append(f"  without the setting: {line(without)}")
    elif without:
        text.append(f"  without the setting: probe failed ({without['error']})")
    return text


#: Ops that run in processes of their own (not in-process cases): --ops NAME runs its module.
SEPARATE = {"gpt-distributed": "bench_distributed"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ops and args.ops.strip() in SEPARATE:     # mpiexec runs: benchmarks/bench_distributed.py
        import importlib
        module = importlib.import_module(f".{SEPARATE[args.ops.strip()]}", __package__)
        return module.main(["--quick"] if args.quick else [])
    changes = {} if args.list else prepare_environment(argv, args.keep_pools, args.isa)
    cache_dir = None
    if args.cold:                                   # before Numba reads its configuration
        import tempfile
        cache_dir = tempfile.mkdtemp(prefix="npattn-bench-cache-")
        os.environ["NUMBA_CACHE_DIR"] = cache_dir
    try:
        return _run(args, argv, changes)
    finally:
        if cache_dir:
            import shutil
            shutil.rmtree(cache_dir, ignore_errors=True)


def _run(args, argv, changes):
    # Imported only now: NumPy must load in the environment prepare_environment() made.
    import platform

    from . import (bench_matmul, bench_linear, bench_softmax,  # noqa: F401  (they register,
                   bench_gelu, bench_attention, bench_variants,   # in this order)
                   bench_gpt)
    from . import machine, memory, report, timing
    from .cases import BASELINE, CASES, IMPLEMENTATIONS

    todo = selected(CASES, args.ops, args.quick)
    if args.list:
        for op, make, size in todo:
            print(f"{op:8} {make.__name__}{size}")
        return 0
    names = {n.lower(): n for n in IMPLEMENTATIONS}
    chosen = [n.strip().lower() for n in (args.impls or ",".join(names)).split(",") if n.strip()]
    if set(chosen) - set(names):
        raise SystemExit(f"unknown implementation(s) {set(chosen) - set(names)}; "
                         f"known: {', '.join(IMPLEMENTATIONS)}")
    chosen = [names[n] for n in chosen]
    torch = None
    if "PyTorch" in chosen:
        try:
            import torch
        except ImportError:
            print("PyTorch is not importable: its column stays empty")
    import numba
    if torch:
        torch.set_num_threads(numba.get_num_threads())   # the same cores for every peer

    mode = QUICK if args.quick else FULL
    rounds = args.rounds or mode["rounds"]
    measure_rss = not args.quick if args.memory is None else args.memory
    command = "python -m benchmarks" + "".join(f" {a}" for a in argv)
    meter = machine.CpuMeter()
    started = time.time()
    header = [f"`{command}` · {time.strftime('%Y-%m-%d %H:%M')} · "
              f"{'quick' if args.quick else 'full'} run: {rounds} rounds, "
              f"calls ≥ {mode['target'] * 1e3:.0f} ms, {mode['settle'] * 1e3:.0f} ms pause "
              f"before each (OpenMP pools spin ~10 ms)"]
    print(header[0])
    print(*describe_changes(changes), sep="\n")
    print(f"Python {platform.python_version()}; NumPy, Numba and "
          f"{'PyTorch' if torch else 'no PyTorch'} at {numba.get_num_threads()} threads; "
          f"Numba cache: {'empty (--cold)' if args.cold else 'as found on disk'}")

    cases, failed = [], 0
    for i, (op, make, size) in enumerate(todo, 1):
        bench = make(torch, *size)
        bench.impls = {n: f for n, f in bench.impls.items() if n in chosen}
        timed = dict(bench.impls)
        if bench.baseline and "npattn" in timed:
            timed[BASELINE] = bench.baseline[1]
        skipped = {n: why for n, why in bench.skipped.items() if n in chosen}
        prefix = f"[{i}/{len(todo)}] {bench.label}"
        for name, why in skipped.items():
            print(f"{prefix}: {name} skipped: {why}", flush=True)
        if args.wait_idle:
            meter.wait_until_quiet(args.wait_idle, report.BUSY)
        print(f"{prefix}: warm-up", end="", flush=True)
        before = meter.sample()
        record = {"op": op, "label": bench.label, "flops": bench.flops, "tokens": bench.tokens,
                  "plot": bench.plot, "baseline": bench.baseline and bench.baseline[0],
                  "notes": bench.notes, "size": list(size), "results": {}, "skipped": skipped}
        def warmed(first):
            print(" " + ", ".join(f"{n} {report.fmt_time(s)}" for n, s in first.items()),
                  flush=True)

        try:
            record["results"] = timing.measure(
                timed, rounds, mode["target"], mode["max_case_seconds"], mode["settle"],
                memory_of=("npattn", "NumPy") if bench.memory else (), on_warm=warmed,
                unchecked=(BASELINE,))
        except Exception as error:   # report it, go on with the other cases, fail at the end
            failed += 1
            record["error"] = f"{type(error).__name__}: {error}"
            print(f"\n{prefix}: FAILED: {record['error']}", flush=True)
        record["foreign_cpu"] = meter.foreign_share(before)
        for name, result in record["results"].items():
            rate = bench.flops / result["median"] / 1e9
            print(f"    {name:8} {report.fmt_time(result['median']):>9} median "
                  f"(IQR {report.fmt_time(result['q1'])}–{report.fmt_time(result['q3'])}, "
                  f"{result['rounds']} rounds × {result['repeats']})"
                  + (f": {record['baseline']}" if name == BASELINE else
                     f" {report.fmt_rate(rate):>6} GFLOP/s")
                  + (f", {bench.tokens / result['median']:,.0f} tokens/s"
                     if bench.tokens and name != BASELINE else ""), flush=True)
        if measure_rss and bench.rss_warmup is not None and bench.impls:
            print("    peak memory, each in a fresh process:", end="", flush=True)
            record["operand_bytes"] = bench.operand_bytes
            record["rss"] = memory.measure(make, size, bench.rss_warmup, list(bench.impls))
            print(" " + report.rss_progress(record), flush=True)
        cases.append(record)

    print("probing the two thread pools...", flush=True)
    probe = probe_pools(changes, mode["probe_seconds"], with_child=not args.quick)
    info = machine.describe(torch)
    foreign = meter.foreign_share()
    summary = _summary(info, changes, probe, foreign, args.cold)
    md = "\n".join(["# npattn benchmarks", "", *header, "", *summary, "", report.table(cases)])
    if any(c.get("rss") for c in cases):
        md += "\n\n" + report.rss_table(cases)
    first = report.first_calls(cases)
    if first:
        md += ("\n\nnpattn's first calls (compile, or load from Numba's disk cache): "
               + "; ".join(first) + ".")
    print("\n" + md)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(md + "\n")
    record = {"command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                          time.localtime(started)),
              "seconds": time.time() - started, "mode": "quick" if args.quick else "full",
              "rounds": rounds, "target_call_seconds": mode["target"],
              "settle_seconds": mode["settle"], "cold_cache": args.cold,
              "machine": info, "environment_changes": changes, "pool_probe": probe,
              "foreign_cpu": foreign, "cases": cases}
    report.write_json(args.out / "results.json", record)
    written = [args.out / "results.md", args.out / "results.json"]
    if not args.no_plot:
        plots = report.plot([c for c in cases if c["results"]], args.out,
                            f"npattn benchmarks · {info['cpu']}, {info['cpus']} CPUs · "
                            f"{command}")
        if isinstance(plots, str):
            print(plots)
        else:
            written += plots
    print("wrote " + ", ".join(str(p) for p in written) + f" in {time.time() - started:.0f} s")
    if failed:
        print(f"{failed} case(s) failed", file=sys.stderr)
    return 1 if failed else 0


def _summary(info, changes, probe, foreign, cold):
    v, threads, blas = info["versions"], info["threads"], info["blas"]
    lines = [
        f"- Machine: {info['cpu']} (LLVM: {info['llvm_cpu']}"
        + (f"; code compiled for `{info['compiled_for']}`" if info.get("compiled_for") else "")
        + f"), {info['cpus']} CPUs "
        f"({info['cpus_usable']} usable); SIMD: {' '.join(info['simd'])}; npattn's tiles: "
        f"{info['tiles']['isa']} (float32 {info['tiles']['float32']}, "
        f"float64 {info['tiles']['float64']})",
        f"- Software: Python {v['python']}, npattn {v['npattn']} ({info['git']}), "
        f"NumPy {v['numpy']}, Numba {v['numba']}, llvmlite {v['llvmlite']}, "
        f"PyTorch {v['torch'] or 'absent'}",
        f"- Threads: Numba {threads['numba']} on the `{info['numba_threading_layer']}` layer; "
        f"PyTorch {threads['torch'] or '—'}; BLAS {threads['blas'] or '?'} "
        f"({blas.get('name') or '?'} {blas.get('version') or ''}, "
        f"kernel {blas.get('architecture') or '?'})",
    ]
    for described in (describe_changes(changes), describe_probe(probe)):
        lines += ["- " + described[0]] + ["  - " + line.strip() for line in described[1:]]
    if foreign is not None:
        lines.append(f"- Other processes used {foreign:.0%} of the CPUs during the run.")
    if cold:
        lines.append("- Numba's cache was empty (--cold): first calls include compiling.")
    return lines


if __name__ == "__main__":
    sys.exit(main())
