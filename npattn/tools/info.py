"""``npattn info``: what npattn runs on here, for bug reports and for "why is it slow?".

Versions (npattn, NumPy and its BLAS, Numba, llvmlite, Python, platform); Numba's threading
layer and thread count; the Numba settings npattn relies on and whether they are in force (the
SLP vectoriser, the fastmath set, the disk cache); the directory Numba caches npattn's kernels
in and whether it is writable; the CPU's SIMD features as LLVM sees them; environment variables
that change NumPy's or Numba's behaviour; and whether PyTorch (the tests' optional oracle) is
installed -- found without importing it, which takes seconds.

:func:`collect` returns the facts as a dict; :func:`report` prints them.
"""
import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
import textwrap
import time

import llvmlite
import llvmlite.binding
import numba
import numpy as np
from numba.core import caching

from .. import __version__, _jit
from ..functional.softmax import softmax
from ..kernels import exp, tiles
from ..kernels.softmax import softmax_forward_kernel

#: CPU features worth knowing for npattn's kernels (LLVM's names; only those LLVM lists for
#: this architecture are shown).
SIMD_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                 "avx512vl", "avx512vnni", "avx512bf16", "avx512fp16", "amx-tile", "neon",
                 "fp-armv8", "sve", "sve2")

#: Environment variables that change how NumPy's BLAS or Numba behave.
ENV_PREFIXES = ("NUMBA_", "OPENBLAS_", "GOTO_", "OMP_", "MKL_", "KMP_", "GOMP_")
ENV_NAMES = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")

#: How Numba's cache locators read (numba.core.caching.CacheImpl tries them in this order).
LOCATORS = {
    "UserProvidedCacheLocator": "NUMBA_CACHE_DIR",
    "InTreeCacheLocator": "__pycache__ next to the kernel modules",
    "UserWideCacheLocator": "Numba's user-wide cache (the package directory is not writable)",
    "IPythonCacheLocator": "IPython's cache",
    "ZipCacheLocator": "Numba's user-wide cache (the package is in a zip file)",
}

PROBE_SHAPE = (2, 8)   # the tiny softmax that starts Numba's threading layer


def _probe_kernel():
    """The parallel kernel npattn.softmax launches: Numba picks the threading layer then."""
    return softmax_forward_kernel


def versions():
    blas = None
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{deps.get('name', '?')} {deps.get('version', '')}".strip()
    except Exception:   # the config layout is NumPy's to change; the BLAS name is a nicety
        pass
    return dict(npattn=__version__, numpy=np.__version__, numpy_blas=blas,
                numba=numba.__version__, llvmlite=llvmlite.__version__,
                python=f"{platform.python_version()} ({platform.python_implementation()})",
                executable=sys.executable, platform=platform.platform(),
                machine=platform.machine())


def threads():
    """Launch one tiny parallel kernel (npattn.softmax), then read the threading layer."""
    before = _jit.threading_layer()
    dispatcher = _probe_kernel().dispatcher

    def tally(name):   # Numba counts each signature's cache misses (compiles) and hits (loads)
        return sum(getattr(dispatcher, name, {}).values())

    misses, hits = tally("_cache_misses"), tally("_cache_hits")
    start = time.perf_counter()
    softmax(np.zeros(PROBE_SHAPE))
    seconds = time.perf_counter() - start
    probe = ("compiled" if tally("_cache_misses") > misses else
             "loaded from the disk cache" if tally("_cache_hits") > hits else "already loaded")
    layer = _jit.threading_layer()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:   # not on every OS
        usable = os.cpu_count()
    return dict(layer=layer, layer_before_probe=before, probe_seconds=seconds, probe=probe,
                requested=numba.config.THREADING_LAYER,
                concurrent=None if layer is None else layer != "workqueue",
                num_threads=numba.get_num_threads(), max_threads=numba.config.NUMBA_NUM_THREADS,
                env_num_threads=os.environ.get("NUMBA_NUM_THREADS"), cpu_count=os.cpu_count(),
                usable_cpus=usable)


def _fastmath_flags(value):
    """A dispatcher's fastmath option (a set, or a bool) as a sorted list of flag names."""
    flags = getattr(value, "flags", value)
    if flags is True:
        return ["fast"]
    return sorted(flags or ())


def settings():
    """npattn's Numba options as its kernels' dispatchers hold them (not just as _jit says)."""
    dispatcher = _probe_kernel().dispatcher
    options = getattr(dispatcher, "targetoptions", {})    # (a plain function under DISABLE_JIT)
    return dict(slp=_jit.slp_enabled(), slp_env=os.environ.get("NUMBA_SLP_VECTORIZE"),
                fastmath=_fastmath_flags(options.get("fastmath")),
                fma_fastmath=_fastmath_flags(getattr(exp.exp_series, "targetoptions",
                                                     {}).get("fastmath")),
                jit_fastmath=sorted(_jit.FASTMATH),
                cache=isinstance(getattr(dispatcher, "_cache", None), caching.FunctionCache),
                nogil=bool(options.get("nogil")), error_model=options.get("error_model"),
                disable_jit=bool(numba.config.DISABLE_JIT),
                boundscheck=numba.config.BOUNDSCHECK, opt=numba.config.OPT)


def kernel_cache():
    """Where Numba caches npattn's kernels: the locator it chose for one kernel (at import),
    the directory, whether it is writable, and what is in it."""
    dispatcher = _probe_kernel().dispatcher
    py_func = getattr(dispatcher, "py_func", dispatcher)
    source = os.path.abspath(py_func.__code__.co_filename)
    cache = getattr(dispatcher, "_cache", None)
    path = getattr(cache, "cache_path", None)
    locator = getattr(getattr(getattr(cache, "_impl", None), "locator", None), "__class__", None)
    # where the other locators would put it (their constructors only compute the path)
    candidates = {"in-tree": caching.InTreeCacheLocator(py_func, source).get_cache_path(),
                  "user-wide": caching.UserWideCacheLocator(py_func, source).get_cache_path()}
    files = os.listdir(path) if path and os.path.isdir(path) else []
    return dict(kernel=f"{py_func.__module__}.{py_func.__name__}", source=source, path=path,
                locator=None if locator is None else locator.__name__,
                locator_override=numba.config.CACHE_LOCATOR_CLASSES or None,
                writable=bool(path) and os.access(path, os.W_OK),
                exists=bool(path) and os.path.isdir(path),
                index_files=sum(f.endswith(".nbi") for f in files),
                data_files=sum(f.endswith(".nbc") for f in files),
                candidates=candidates)


def cached_kernels():
    """{dtype: (cached, of)}: how many of npattn's parallel kernels (those of the register tile
    in force, and of the other kernel modules) have a variant for this CPU in the disk cache.

    Read from each kernel's cache index, whose keys hold the signature and the CPU (Numba's
    ``magic_tuple``: triple, CPU name, features) it was compiled for; nothing is loaded or
    compiled. The index reader is Numba's (``Cache._cache_file._load_index``, a private API):
    a Numba without it counts nothing as cached."""
    from .progress import float_dtypes
    from .warmup import _instance_dtype, parallel_kernels
    magic = numba.core.registry.cpu_target.target_context.codegen().magic_tuple()
    counts = {d: [0, 0] for d in tiles.DTYPES}
    for name, kernel in parallel_kernels().items():
        index_file = getattr(getattr(kernel.dispatcher, "_cache", None), "_cache_file", None)
        try:
            index = index_file._load_index() if index_file is not None else {}
        except Exception:            # an unreadable index is an empty one, as for Numba
            index = {}
        here = [key[0] for key in index if key[1] == magic]
        have = set().union(*(float_dtypes(sig) for sig in here)) if here else set()
        only = _instance_dtype(name)
        for d in (tiles.DTYPES if only is None else (only,)):
            counts[d][1] += 1
            counts[d][0] += d in have or (bool(here) and not have)   # (no float array argument)
    return {d: tuple(c) for d, c in counts.items()}


def cpu():
    features = llvmlite.binding.get_host_cpu_features()
    known = [f for f in SIMD_FEATURES if f in features]
    return dict(name=llvmlite.binding.get_host_cpu_name(),
                present=[f for f in known if features[f]],
                absent=[f for f in known if not features[f]],
                numba_cpu_name=numba.config.CPU_NAME, numba_cpu_features=numba.config.CPU_FEATURES)


def register_tiles():
    """The tile family in force, why, and its MR×NR per dtype (kernels/tiles.py)."""
    forced = os.environ.get("NPATTN_ISA")
    isa = tiles.isa_in_force()
    return dict(isa=isa, host=tiles.host_isa(), forced=forced,
                tiles={d: "; ".join(f"{t.mr}×{t.nr}" for t in
                                    (tiles.tile(isa, d, name) for name in tiles.ENGINES))
                       for d in tiles.DTYPES})


def vector_widths():
    """The vector registers the code uses: the tiles' (written out, so the widest the CPU has
    -- zmm wherever AVX-512F is compiled for) and, for every other loop, what LLVM's
    vectorisers choose for this CPU in npattn's kernels, read off a probe loop compiled now.
    Those carry ``"prefer-vector-width"="512"`` (``_jit.FULL_WIDTH``), so Intel's AVX-512 CPUs,
    whose LLVM tuning prefers ymm, get zmm too; where llvmlite no longer lets npattn set it,
    the note says so and why."""
    register = _jit.loop_vector_register()
    bits = {"zmm": "512-bit (zmm)", "ymm": "256-bit (ymm)", "xmm": "128-bit (xmm)"}
    avx512 = "avx512f" in tiles.cpu_features()
    tile = bits["zmm"] if avx512 else bits["ymm"]
    loops = bits.get(register, "not vectorised")
    default = _jit.loop_vector_register(npattns=False) if avx512 else register
    if _jit.FULL_WIDTH is not None:
        note = ("npattn could not give its loops the attribute \"prefer-vector-width\"=\"512\" "
                f"({_jit.FULL_WIDTH}): they take LLVM's default width for this CPU")
    elif register != default:
        note = (f"LLVM's tuning for this CPU prefers {bits.get(default, default)} vectors; "
                "npattn's kernels carry \"prefer-vector-width\"=\"512\", other Numba code "
                "keeps the default")
    else:
        note = ""
    return dict(tiles=tile, loops=loops, note=note)


def environment():
    names = sorted(n for n in os.environ if n.startswith(ENV_PREFIXES))
    return {n: os.environ[n] for n in names}


def torch_status():
    """PyTorch's version and location if installed, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return dict(installed=False, version=None, location=None)
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return dict(installed=True, version=version, location=spec.origin)


def collect():
    """Every fact ``npattn info`` prints, as a dict of dicts (one per section)."""
    facts = dict(versions=versions(), threads=threads(), settings=settings())
    facts.update(cache=kernel_cache(), cached=cached_kernels(), cpu=cpu(), tiles=register_tiles(),
                 widths=vector_widths(),
                 environment=environment(),
                 torch=torch_status())
    return facts


def _onoff(flag):
    return "on" if flag else "off"


def report(facts, out=None):
    """Print ``facts`` (from :func:`collect`) as the ``npattn info`` report."""
    out = sys.stdout if out is None else out
    say = lambda line="": print(line, file=out)
    v, t, s, c, p = (facts[k] for k in ("versions", "threads", "settings", "cache", "cpu"))

    say("Versions")
    say(f"  npattn    {v['npattn']}")
    say(f"  NumPy     {v['numpy']}" + (f"  (BLAS: {v['numpy_blas']})" if v["numpy_blas"] else ""))
    say(f"  Numba     {v['numba']}")
    say(f"  llvmlite  {v['llvmlite']}")
    say(f"  Python    {v['python']}  {v['executable']}")
    say(f"  platform  {v['platform']}")

    say()
    say("Threads")
    rows = "x".join(map(str, PROBE_SHAPE))
    say(f"  threading layer  {t['layer']}  (Numba picks it at the first parallel launch: this "
        f"report ran")
    say(f"                   npattn.softmax on a {rows} array first, in {t['probe_seconds']:.2f} s"
        f" ({t['probe']}))")
    say(f"  requested layer  {t['requested']}  (NUMBA_THREADING_LAYER)")
    if t["concurrent"] is not None:
        say("  calls from several Python threads  " +
            ("run concurrently" if t["concurrent"] else
             "are serialised by npattn (workqueue aborts on concurrent launches)"))
    say(f"  threads          numba.get_num_threads() = {t['num_threads']} of "
        f"NUMBA_NUM_THREADS = {t['max_threads']}"
        f" ({'set to ' + t['env_num_threads'] if t['env_num_threads'] else 'env unset'}); "
        f"CPUs usable: {t['usable_cpus']} of {t['cpu_count']}")

    say()
    say("Numba settings npattn relies on")
    if s["slp_env"] is None:
        slp_note = "npattn turned it on at import; NUMBA_SLP_VECTORIZE is unset"
    else:
        slp_note = f"NUMBA_SLP_VECTORIZE={s['slp_env']} overrides npattn's default (on)"
    say(f"  SLP vectoriser   {_onoff(s['slp'])}  ({slp_note})")
    if not s["slp"]:
        say("                   without it the lane maxima of softmax and attention run several "
            "times slower, and npattn compiles")
        say("                   kernels without the disk cache (an entry there was always "
            "compiled with SLP)")
    say(f"  fastmath         {{{', '.join(s['fastmath'])}}} for kernels, "
        f"{{{', '.join(s['fma_fastmath'])}}} for exp's and tanh's polynomials;")
    say("                   the register tiles are explicit fused multiply-adds "
        "(kernels/vector_tile.py);")
    say("                   never nnan/ninf (masks are -inf and NaN must propagate)")
    say(f"  cache=True       {_onoff(s['cache'] and s['slp'])}" +
        ("  (compiled kernels are stored on disk and reloaded)" if s["cache"] and s["slp"]
         else "  (not while SLP is off)"))
    say(f"  other options    nogil={s['nogil']}, error_model={s['error_model']!r}, "
        f"NUMBA_OPT={int(s['opt'])}, NUMBA_BOUNDSCHECK="
        f"{'unset' if s['boundscheck'] is None else s['boundscheck']}")
    if s["disable_jit"]:
        say("  NUMBA_DISABLE_JIT is set: every kernel runs as plain Python (very slow)")

    say()
    say("Kernel cache")
    how = LOCATORS.get(c["locator"], c["locator"])
    if c["path"] is None:
        say("  directory        none: no writable cache directory was found at import, so "
            "kernels compile")
        say("                   again in every process")
    else:
        say(f"  directory        {c['path']}")
        say(f"  chosen by        Numba's {c['locator']}: {how}")
    say("  Numba's order    NUMBA_CACHE_DIR if set, else __pycache__ next to the module if "
        "writable,")
    say(f"                   else the user-wide {c['candidates']['user-wide']}")
    if c["locator_override"]:
        say(f"                   (NUMBA_CACHE_LOCATOR_CLASSES={c['locator_override']} replaces "
            "that order)")
    say(f"  writable         {'yes' if c['writable'] else 'no'}")
    say(f"  contents         {c['index_files']} kernel index files (.nbi), {c['data_files']} "
        f"compiled variants (.nbc)")
    cached = facts["cached"]
    say("  for this CPU     " + ", ".join(f"{d}: {n} of {of}" for d, (n, of) in cached.items())
        + " parallel kernels cached")
    if any(n < of for n, of in cached.values()):
        say("                   (the rest compile on first use; `npattn warmup` compiles them "
            "now)")

    say()
    say("CPU (as LLVM sees it; kernels are compiled for it)")
    say(f"  host CPU         {p['name']}" +
        (f"  (NUMBA_CPU_NAME={p['numba_cpu_name']} overrides it)" if p["numba_cpu_name"]
         else ""))
    say(f"  SIMD present     {' '.join(p['present']) or '-'}")
    say(f"  SIMD absent      {' '.join(p['absent']) or '-'}")
    r = facts["tiles"]
    why = (f"NPATTN_ISA={r['forced']}; the host's would be {r['host']}" if r["forced"]
           else "from the CPU; NPATTN_ISA=avx2|avx512 forces one")
    say(f"  register tiles   {r['isa']} ({why})")
    say("                   " + ", ".join(f"{d} {t}" for d, t in r["tiles"].items()) +
        "  (MR×NR: GEMM; attention)")
    w = facts["widths"]
    say(f"  vector width     register tiles {w['tiles']}, other loops {w['loops']}")
    for line in textwrap.wrap(f"({w['note']})" if w["note"] else "", 78):
        say(f"                   {line}")

    say()
    say("Environment (variables that change NumPy's BLAS or Numba)")
    env = facts["environment"]
    for name, value in env.items():
        say(f"  {name}={value}")
    unset = [n for n in ENV_NAMES if n not in env]
    if unset:
        say(f"  unset: {', '.join(unset)}")
    if "OPENBLAS_CORETYPE" in env:
        say("  (OPENBLAS_CORETYPE pins OpenBLAS's kernels instead of detecting the CPU: a pin "
            "below the CPU,")
        say("  e.g. Haswell on an AVX-512 machine, can halve NumPy's matmul)")

    say()
    say("Optional")
    tr = facts["torch"]
    if tr["installed"]:
        say(f"  PyTorch          {tr['version']} is installed; not imported (only the tests and "
            "the benchmarks")
        say("                   use it, as an oracle and a peer)")
        say(f"                   {tr['location']}")
    else:
        say("  PyTorch          not installed (only the tests' optional oracle and the "
            "benchmarks' peer)")


def build_parser(prog="npattn info"):
    return argparse.ArgumentParser(
        prog=prog, description="What npattn runs on: versions, Numba's threading layer and "
        "threads, the Numba settings npattn relies on, the kernel cache directory, the CPU's "
        "SIMD features, relevant environment variables, and whether PyTorch is installed.")


def main(argv=None, prog="npattn info"):
    build_parser(prog).parse_args(argv)
    report(collect())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
