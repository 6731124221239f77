"""How fast npattn is ready in a new process: import, first calls, and compiling from nothing.

    python -m benchmarks.first_use               # everything, with a cold compile: minutes
    python -m benchmarks.first_use --quick       # 1 run each, float32, no cold compile: seconds
    python -m benchmarks.first_use --repeats 9 --no-cold

Prints progress, then Markdown tables (median of ``--repeats`` fresh processes) and the command
that reproduces them; ``--out`` also writes them to a file. Each figure is measured in a fresh
interpreter (``python -m benchmarks.first_use --child ...``):

* **import**: ``import numba``, then ``import npattn`` (wall and CPU time), twice: with Python's
  bytecode cached as an installed package has it (``PYTHONPYCACHEPREFIX``, filled by a first
  run), and as the environment runs it (with ``PYTHONDONTWRITEBYTECODE=1`` every module is
  compiled from source on each import). The child also checks that no kernel was compiled.
* **Numba's set-up**: the first compile or cache load in any process makes Numba load its
  typing and lowering registries (and import SciPy, when installed, to look for BLAS): a fixed
  cost of Numba, not of npattn's kernels, measured apart (SciPy's import separately).
* **first calls**, kernels in Numba's disk cache (``npattn warmup`` is run first): one forward
  and backward of each op on small, demo-like inputs, in order, then the same call again (the
  "later call"): the difference is loading the kernels from the cache (reading each kernel's
  index, matching the signature, linking the object code) and, for the first op, starting
  Numba's thread pool. A kernel two ops share (the GEMM) is loaded by the first. The demo's
  ops (``DEMO``) are summed. Loading a kernel is mostly Numba rebuilding its library from the
  cache: parsing the LLVM bitcode and walking its symbols (``codegen._unserialize``), tens of
  ms for a large kernel; reading the index and matching the signature are small.
* **cold compile**: ``npattn warmup --jobs 1`` into an empty ``NUMBA_CACHE_DIR``: every kernel
  for both dtypes, per step, and the kernels that take longest (Numba's own compile timer,
  which includes the serial kernels a kernel calls when they compile with it); then the wall
  time of ``npattn warmup`` as it runs by default, one worker process per CPU.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent        # where ``-m benchmarks.first_use`` resolves
#: The ops npattn's demo (and a small transformer) calls on its first step.
DEMO = ("linear", "embedding", "dropout", "scaled_dot_product_attention", "softmax",
        "cross_entropy", "layer_norm")


# ------------------------------------------------------------------------- child side

def _first_use_calls(npattn, np, dtype, rng):
    """[(op, zero-argument call)]: one forward and backward of each op (that this version has),
    on inputs the size of the demo's (batch 2, 10 tokens, width 64, 4 heads)."""
    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x, w, b = normal(2, 10, 64), normal(64, 64), normal(64)
    q, k, v = normal(2, 4, 10, 16), normal(2, 4, 10, 16), normal(2, 4, 10, 16)
    scores = normal(2, 4, 10, 10)
    calls = []

    def add(op, call):
        if hasattr(npattn, op):
            calls.append((op, call))

    def linear():
        y = npattn.linear(x, w, b)
        return npattn.linear_backward(y, x, w, b)

    def embedding():
        idx = np.arange(20).reshape(2, 10) % 10
        table = x[0, :, :]                                        # (10, 64)
        return npattn.embedding_backward(npattn.embedding(idx, table), idx, table)

    def dropout():
        return npattn.dropout_backward(npattn.dropout(x, 0.1, seed=1), 0.1, seed=1)

    def sdpa():
        kw = dict(is_causal=True, dropout_p=0.1, seed=2)
        out, lse = npattn.scaled_dot_product_attention_forward(q, k, v, **kw)
        return npattn.scaled_dot_product_attention_backward(out, q, k, v, out, lse, **kw)

    def softmax():
        return npattn.softmax_backward(scores, npattn.softmax(scores), dim=-1)

    def cross_entropy():
        logits, target = x.reshape(20, 64)[:, :10], np.arange(20) % 10
        npattn.cross_entropy(logits, target)
        return npattn.cross_entropy_backward(np.array(1, dtype), logits, target)

    def layer_norm():
        y = npattn.layer_norm(x, (64,), w[0], b)
        return npattn.layer_norm_backward(y, x, (64,), w[0], b)

    def matmul():
        return npattn.matmul_backward(npattn.matmul(q, k.swapaxes(-1, -2)), q,
                                      k.swapaxes(-1, -2))

    def log_softmax():
        return npattn.log_softmax_backward(scores, npattn.log_softmax(scores), dim=-1)

    def attention():
        mask = np.tril(np.ones((10, 10), bool))
        npattn.attention(q, k, v, mask)
        return npattn.attention_backward(q, q, k, v, mask)

    for op, call in (("linear", linear), ("embedding", embedding), ("dropout", dropout),
                     ("scaled_dot_product_attention", sdpa), ("softmax", softmax),
                     ("cross_entropy", cross_entropy), ("layer_norm", layer_norm),
                     ("matmul", matmul), ("log_softmax", log_softmax),
                     ("attention", attention)):
        add(op, call)
    return calls


def _dispatchers():
    """Every Numba dispatcher of npattn.kernels (parallel kernels' and serial ones)."""
    from npattn.tools.warmup import dispatchers
    return dispatchers()


def child_import():
    t0, c0 = time.perf_counter(), time.process_time()
    import numba  # noqa: F401
    t1, c1 = time.perf_counter(), time.process_time()
    import npattn  # noqa: F401
    t2, c2 = time.perf_counter(), time.process_time()
    compiled = [name for name, d in _dispatchers().items() if d.signatures]
    return {"numba": t1 - t0, "npattn": t2 - t1, "npattn_cpu": c2 - c1, "compiled": compiled}


def child_first_calls(dtypes):
    import numba
    import numpy as np

    import npattn
    start = time.perf_counter()
    try:
        import scipy.linalg.cython_blas  # noqa: F401  (what Numba's set-up imports)
    except ImportError:
        pass
    scipy_seconds = time.perf_counter() - start
    from numba.core.registry import cpu_target
    cpu_target.target_context.refresh()                           # Numba's one-time set-up
    cpu_target.typing_context.refresh()
    setup = time.perf_counter() - start
    calls = []
    for name in dtypes:
        rng = np.random.default_rng(0)
        for op, call in _first_use_calls(npattn, np, np.dtype(name), rng):
            t, c = time.perf_counter(), time.thread_time()
            call()
            first, first_cpu = time.perf_counter() - t, time.thread_time() - c
            later = []
            for _ in range(5):
                t = time.perf_counter()
                call()
                later.append(time.perf_counter() - t)
            calls.append({"dtype": name, "op": op, "first": first, "first_cpu": first_cpu,
                          "later": statistics.median(later)})
    stats = {name: d.stats for name, d in _dispatchers().items()}
    return {"setup": setup, "scipy": scipy_seconds, "calls": calls,
            "cache_misses": sum(sum(s.cache_misses.values()) for s in stats.values()),
            "cache_hits": sum(sum(s.cache_hits.values()) for s in stats.values()),
            "compiled": sorted(name for name, s in stats.items() if s.cache_misses),
            "threads": numba.get_num_threads(), "layer": npattn._jit.threading_layer()}


def child_cold(dtypes, jobs=1):
    import numpy as np

    from npattn.tools import warmup
    from npattn.tools.progress import float_dtypes
    from npattn._jit import ItemKernel
    start, cpu = time.perf_counter(), time.process_time()
    timings, gaps, compiled, processes = warmup.warmup(
        [np.dtype(d) for d in dtypes], jobs=jobs,
        report=lambda line: print(line, file=sys.stderr, flush=True))
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    kernels = []
    parallel = warmup.parallel_kernels()
    dispatchers = {name: k.dispatcher for name, k in parallel.items()}
    dispatchers.update({f"{name} ({item.py_func.__name__})": item              # compiled
                        for name, k in parallel.items() if isinstance(k, ItemKernel)  # apart:
                        for item in k.items})                                         # _jit
    for name, dispatcher in dispatchers.items():
        for sig, result in dispatcher.overloads.items():
            timers = (result.metadata or {}).get("timers", {})
            dtype = sorted(float_dtypes(sig)) or ["-"]
            kernels.append({"kernel": name, "dtype": dtype[0],
                            "seconds": timers.get("compiler_lock"),
                            "llvm": timers.get("llvm_lock")})
    return {"steps": [dict(zip(("dtype", "step", "seconds", "cpu"), t)) for t in timings],
            "total": total, "total_cpu": total_cpu, "gaps": gaps, "kernels": kernels,
            "compiled": compiled, "processes": processes}


def child(kind, dtypes):
    if kind == "import":
        return child_import()
    if kind == "first":
        return child_first_calls(dtypes)
    if kind == "cold":
        return child_cold(dtypes)
    if kind == "cold-parallel":
        from npattn.tools.warmup import default_jobs
        return child_cold(dtypes, jobs=default_jobs())
    if kind == "warm":
        from npattn.tools.warmup import main
        return {"status": main(["--quiet"])}
    raise ValueError(f"unknown child {kind!r}")


# ------------------------------------------------------------------------- parent side

def run_child(kind, dtypes=("float32",), env=None, timeout=3600):
    """The JSON result of ``child(kind, dtypes)`` run in a fresh interpreter in ``env`` (the
    current environment, changed by ``{name: value or None to unset}``)."""
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    done = subprocess.run([sys.executable, "-m", "benchmarks.first_use", "--child", kind,
                           "--dtype", ",".join(dtypes)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"child {kind} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _median(results, key):
    return statistics.median(r[key] for r in results)


def measure(repeats=5, cold=True, dtypes=("float32", "float64"), log=print):
    """Every figure of the module docstring: {"imports", "first", "cold", ...}."""
    record = {"repeats": repeats, "dtypes": list(dtypes)}
    prefix = tempfile.mkdtemp(prefix="npattn-pycache-")
    try:
        log("import, bytecode cached (PYTHONPYCACHEPREFIX)...")
        cached = {"PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": None}
        run_child("import", env=cached)                          # fills the bytecode cache
        record["import_cached"] = [run_child("import", env=cached) for _ in range(repeats)]
        log("import, as this environment runs it...")
        record["import_env"] = [run_child("import") for _ in range(repeats)]
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    log("npattn warmup (kernels into the disk cache, if not there yet)...")
    record["warm_status"] = run_child("warm")["status"]
    log("first calls, warm cache...")
    record["first"] = [run_child("first", dtypes) for _ in range(repeats)]
    if cold:
        for key, kind, how in (("cold", "cold", "in this process"),
                               ("cold_parallel", "cold-parallel", "one process per CPU")):
            cache = tempfile.mkdtemp(prefix="npattn-cold-cache-")
            try:
                log(f"cold compile into an empty cache, {how} (minutes)...")
                record[key] = run_child(kind, ("float32", "float64"),
                                        env={"NUMBA_CACHE_DIR": cache})
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    return record


def _s(seconds):
    if seconds is None:
        return "—"
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.2g} ms" \
        if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def demo_totals(first, key="first"):
    """(npattn's first calls of the DEMO ops in float32, the same plus Numba's set-up) of one
    child_first_calls result: wall time, or with ``key="first_cpu"`` the calling thread's CPU
    time (which other processes on the machine do not inflate)."""
    ours = sum(c[key] for c in first["calls"] if c["dtype"] == "float32" and c["op"] in DEMO)
    return ours, ours + first["setup"]


def markdown(record, command):
    runs = record["repeats"]
    ic, ie, first = record["import_cached"], record["import_env"], record["first"]
    compiled = sorted({n for r in ic + ie for n in r["compiled"]})
    lines = [f"### First use · `{command}` · {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"Median of {runs} fresh process{'es' * (runs > 1)}; Numba "
             f"{first[0]['threads']} threads, `{first[0]['layer']}` layer.", "",
             "| step | wall | CPU |", "|---|---|---|",
             f"| `import numba` | {_s(_median(ic, 'numba'))} | |",
             f"| `import npattn` after it, bytecode cached (as installed) | "
             f"{_s(_median(ic, 'npattn'))} | {_s(_median(ic, 'npattn_cpu'))} |",
             f"| `import npattn`, compiled from source (`PYTHONDONTWRITEBYTECODE=1`) | "
             f"{_s(_median(ie, 'npattn'))} | {_s(_median(ie, 'npattn_cpu'))} |",
             f"| Numba's set-up, once per process (of which importing SciPy) | "
             f"{_s(_median(first, 'setup'))} ({_s(_median(first, 'scipy'))}) | |"]
    lines.append("")
    lines.append("Kernels compiled by the import: " + (", ".join(compiled) or "none") + ".")
    dtypes = record["dtypes"]
    lines += ["", "First call of each op in a new process, kernels in the disk cache (forward + "
              "backward, in this order; then the same call again):", "",
              "| op | " + " | ".join(f"{d} first | {d} later" for d in dtypes) + " |",
              "|---|" + "---|---|" * len(dtypes)]
    ops = [c["op"] for c in first[0]["calls"] if c["dtype"] == dtypes[0]]
    for op in ops:
        cells = []
        for d in dtypes:
            pick = [[c for c in r["calls"] if c["op"] == op and c["dtype"] == d] for r in first]
            pick = [p[0] for p in pick if p]
            cells += [_s(statistics.median(p["first"] for p in pick)) if pick else "—",
                      _s(statistics.median(p["later"] for p in pick)) if pick else "—"]
        lines.append(f"| {op}{' (demo)' * (op in DEMO)} | " + " | ".join(cells) + " |")
    totals = [demo_totals(r) for r in first]
    misses = sum(r["cache_misses"] for r in first)
    lines += ["", f"The demo's ops, first calls in float32: "
              f"{_s(statistics.median(t[0] for t in totals))}; with Numba's set-up: "
              f"{_s(statistics.median(t[1] for t in totals))}. Kernels compiled in these "
              f"processes: {misses} (0: all loaded from the cache)."]
    cold = record.get("cold")
    if cold:
        par = record.get("cold_parallel")
        lines += ["", f"Cold compile of every kernel, float32 and float64, into an empty cache "
                  f"(`npattn warmup --jobs 1`): {_s(cold['total'])} wall, "
                  f"{_s(cold['total_cpu'])} CPU"
                  + (f"; not reached: {', '.join(cold['gaps'])}" if cold["gaps"] else "")
                  + (f". In {par['processes']} processes (`npattn warmup`, the default): "
                     f"{_s(par['total'])} wall" if par else "") + ".",
                  "", "| step | float32 | float64 |", "|---|---|---|"]
        steps = dict.fromkeys(s["step"] for s in cold["steps"])
        for step in steps:
            cells = []
            for d in ("float32", "float64"):
                s = [x for x in cold["steps"] if x["step"] == step and x["dtype"] == d]
                cells.append(f"{_s(s[0]['seconds'])} (CPU {_s(s[0]['cpu'])})" if s else "—")
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        slow = sorted((k for k in cold["kernels"] if k["seconds"]), key=lambda k: -k["seconds"])
        lines += ["", "Slowest kernels to compile (wall, including the serial kernels each "
                  "compiles with it):", "", "| kernel | dtype | compile | of which LLVM |",
                  "|---|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['dtype']} | {_s(k['seconds'])} | {_s(k['llvm'])} |"
                  for k in slow[:8]]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_use",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one run of each, float32 only, no cold compile")
    parser.add_argument("--repeats", type=int, help="fresh processes per figure (default 5)")
    parser.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                        help="compile everything into an empty cache (default: unless --quick)")
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, (args.dtype or "float32").split(","))))
        return 0
    repeats = args.repeats or (1 if args.quick else 5)
    cold = (not args.quick) if args.cold is None else args.cold
    dtypes = ("float32",) if args.quick else ("float32", "float64")
    record = measure(repeats, cold, dtypes, log=lambda m: print(m, file=sys.stderr, flush=True))
    md = markdown(record, "python -m benchmarks.first_use" + "".join(f" {a}" for a in argv))
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
