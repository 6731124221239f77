"""First use: import time, first calls from a warm disk cache, ``npattn warmup``, and an
install whose package directory is read-only.

Every figure is taken in fresh interpreters (``benchmarks/first_use.py`` children); timings
are asserted on the best of a few runs or on CPU time, so that other processes on a busy
machine do not fail them. ``python -m benchmarks.first_use`` prints the full tables.

``npattn warmup`` runs once for the module into Numba's cache as the environment has it (the
in-tree ``__pycache__``, or ``NUMBA_CACHE_DIR``); with ``NPATTN_TEST_COLD_CACHE=1`` it runs
into an empty directory instead -- a cold compile of every kernel, minutes on 2 cores -- so
that nothing but the warmup can have filled the cache the next processes load from.
"""
import os
import shutil
import stat
import subprocess
import sys

import pytest

from benchmarks.first_use import DEMO, demo_totals, run_child
from test_stress import TESTS, run_script

PACKAGE = TESTS.parent / "npattn"
COLD = os.environ.get("NPATTN_TEST_COLD_CACHE") == "1"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """(environment changes, stdout) of ``npattn warmup`` run in a fresh process."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path_factory.mktemp("numba-cache"))} if COLD else {}
    out = run_script("import sys\nfrom npattn.tools.warmup import main\nsys.exit(main([]))",
                     timeout=3600, **env)
    return env, out


# ------------------------------------------------------------------ import

def test_import_compiles_nothing_and_costs_little_beyond_numba(tmp_path):
    """``import npattn`` after ``import numba``: < 0.3 s, with the bytecode cached as an
    installed package has it (best wall time of 3 fresh processes; median CPU time), and no
    kernel compiled."""
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PYTHONDONTWRITEBYTECODE": None}
    run_child("import", env=env)                               # fills the bytecode cache
    runs = [run_child("import", env=env) for _ in range(3)]
    walls = sorted(r["npattn"] for r in runs)
    cpus = sorted(r["npattn_cpu"] for r in runs)
    print(f"\nimport npattn after numba: wall {walls[0] * 1e3:.0f}-{walls[-1] * 1e3:.0f} ms, "
          f"CPU median {cpus[1] * 1e3:.0f} ms (import numba {runs[0]['numba'] * 1e3:.0f} ms)")
    assert all(r["compiled"] == [] for r in runs), runs[0]["compiled"]
    assert walls[0] < 0.3
    assert cpus[1] < 0.3


# ------------------------------------------------------------------ warmup

def test_warmup_shows_progress_for_every_op(warmed):
    _, out = warmed
    lines = out.strip().splitlines()
    assert lines[0].startswith("npattn warmup: ")
    assert "kernel signatures compiled" in lines[-1]
    for dtype in ("float32", "float64"):
        shown = {line.split()[1] for line in lines[1:-1] if line.split()[0] == dtype}
        assert {"linear", "matmul", "scaled_dot_product_attention", "attention",
                "dropout"} <= shown, shown
    assert all(line.rstrip().endswith(" s") for line in lines[1:-1])


WARM_CHECK = """
import contextlib, io, json
import numpy as np
import npattn
from npattn.tools import warmup
from test_stress import make_calls
from test_jit import all_kernels

def signatures():
    return {name: sorted(str(s) for s in getattr(k, "dispatcher", k).signatures)
            for name, k in all_kernels().items()}

def misses():
    return {name: len(getattr(k, "dispatcher", k).stats.cache_misses)
            for name, k in all_kernels().items()}

out = io.StringIO()
with contextlib.redirect_stdout(out):
    status = warmup.main(["--quiet"])
after_warmup = signatures()
compiled_by_warmup = {n: m for n, m in misses().items() if m}
# calls warmup does not make: other shapes, the other dtype, every option of make_calls
for dtype in (np.float32, np.float64):
    for scale in (0, 3):
        rng = np.random.default_rng(scale)
        for call in make_calls(rng, scale, dtype).values():
            call()
after_calls = signatures()
print(json.dumps(dict(status=status, printed=out.getvalue(), compiled_by_warmup=compiled_by_warmup,
                      new={n: sorted(set(after_calls[n]) - set(after_warmup[n]))
                           for n in after_calls if after_calls[n] != after_warmup[n]},
                      compiled={n: m for n, m in misses().items() if m},
                      n_signatures=sum(map(len, after_warmup.values())))))
"""


def test_after_warmup_a_new_process_compiles_nothing(warmed):
    """After ``npattn warmup`` in one process, a second process runs warmup again -- every
    kernel signature comes from the disk cache -- then calls every op in other shapes, both
    dtypes and every option: no kernel gains a signature (warmup reached them all) and no
    kernel is compiled."""
    env, _ = warmed
    from test_stress import last_json
    result = last_json(run_script(WARM_CHECK, timeout=1800, **env))
    assert result["status"] == 0
    assert result["printed"] == ""                             # --quiet
    assert result["compiled_by_warmup"] == {}
    assert result["new"] == {}
    assert result["compiled"] == {}
    assert result["n_signatures"] >= 30


WARM_SOME = "import sys\nfrom npattn.tools.warmup import main\nsys.exit(main({argv!r}))"


def test_parallel_warmup_fills_an_empty_cache(tmp_path):
    """``npattn warmup --jobs 2`` into an empty cache: the float32 and float64 units of one op
    compile in two worker processes at once and write to the same kernels' cache indexes;
    afterwards the parent loads every signature, and so does a new process, compiling none."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    ops = ["--ops", "softmax,dropout"]
    out = run_script(WARM_SOME.format(argv=ops + ["--jobs", "2"]), timeout=1200, **env)
    lines = out.strip().splitlines()
    shown = {tuple(line.split()[:2]) for line in lines[1:-1]}
    assert shown == {(d, op) for d in ("float32", "float64") for op in ("softmax,", "dropout")}
    assert " in 2 processes: " in lines[-1]
    compiled = int(lines[-1].split(": ")[-1].split()[0])
    loaded = int(lines[-1].split(", ")[-1].split()[0])
    assert compiled >= 6 and loaded >= 6, lines[-1]             # fwd + bwd of each, 2 dtypes
    again = run_script(WARM_SOME.format(argv=ops + ["--jobs", "1"]), timeout=600, **env)
    assert f": 0 kernel signatures compiled, {loaded} already in the cache" in again, again


def die_in_worker(dtype_name, step_names, lock_path):
    """Stands in for warmup._warm_unit in the worker processes of the next test."""
    os._exit(3)


DEAD_WORKER = """
import sys
from npattn.tools import warmup
import test_first_use
warmup._warm_unit = test_first_use.die_in_worker      # (the workers import it by this name)
sys.exit(warmup.main(["--ops", "dropout", "--jobs", "2"]))
"""


def test_a_dead_warmup_worker_leaves_the_work_to_the_parent(tmp_path):
    out = run_script(DEAD_WORKER, timeout=600, NUMBA_CACHE_DIR=str(tmp_path))
    lines = out.strip().splitlines()
    assert "a worker process died" in out
    assert {tuple(line.split()[:2]) for line in lines if line.endswith(" s")} == \
        {("float32", "dropout"), ("float64", "dropout")}
    assert lines[-1].startswith("npattn warmup: ") and " 0 kernel signatures" not in lines[-1]


LOCKED_WRITE = """
import json, sys, time
import numpy as np
import npattn
from npattn.tools import warmup
assert warmup._lock_cache_writes(sys.argv[1])
assert warmup._lock_cache_writes(sys.argv[1])           # a second call installs nothing more
start = time.perf_counter()
npattn.dropout_mask((3, 5), 0.3, seed=1)                # compiles, then writes the cache
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def _cpu_seconds(pid):
    """User + system CPU time of process ``pid`` so far (Linux /proc), or None once it ended."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_a_warmup_worker_writes_the_cache_only_under_the_lock(tmp_path):
    """While another process holds the lock, a worker compiles (uses CPU), then waits in its
    cache write (uses none) with nothing written; once the lock is released it writes."""
    import fcntl
    import time
    from test_stress import last_json
    lock, cache = tmp_path / "lock", tmp_path / "cache"
    lock.touch()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", LOCKED_WRITE, str(lock)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cpu, deadline = None, time.monotonic() + 300
        while time.monotonic() < deadline:       # until its CPU time stops growing: blocked
            time.sleep(2)                        # (a compile never idles that long)
            now = _cpu_seconds(child.pid)
            if child.poll() is not None or now is None or now == cpu:
                break
            cpu = now
        blocked = child.poll() is None
        written_while_held = sorted(p.name for p in cache.rglob("*.nb[ic]"))
        fcntl.flock(held, fcntl.LOCK_UN)
    stdout, stderr = child.communicate(timeout=600)
    assert child.returncode == 0, stderr
    assert blocked, "the worker finished while the lock was held"
    assert written_while_held == []
    assert list(cache.rglob("*.nbi")) and last_json(stdout)["seconds"] > 2


def test_warmup_rejects_bad_jobs_and_unknown_ops(capsys):
    from npattn.tools.warmup import main
    for argv, word in ((["--jobs", "0"], "--jobs"), (["--ops", "softmax,conv2d"], "conv2d")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert word in capsys.readouterr().err


def test_warmup_rejects_an_unknown_dtype(capsys):
    from npattn.tools.warmup import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float16"])
    assert exit_info.value.code == 2
    assert "float16" in capsys.readouterr().err


# ------------------------------------------------------------------ first calls

def test_first_calls_from_a_warm_cache_are_fast(warmed):
    """A new process whose kernels are all in the disk cache: the first forward and backward
    of every op the demo uses, in float32, take < 1 s together, and nothing compiles.

    Asserted on the calling thread's CPU time (what loading the kernels costs, which other
    processes on a busy machine do not inflate) and, more loosely, on the best wall time of up
    to 3 processes. Numba's own one-time set-up (its registries, SciPy's import) is reported
    apart: any Numba program pays it at its first compile or cache load."""
    env, _ = warmed
    runs = []
    for _ in range(3):
        runs.append(run_child("first", ("float32", "float64"), env=env))
        if demo_totals(runs[-1])[0] < 1.0:
            break
    best = min(runs, key=lambda r: demo_totals(r)[0])
    ops = {c["op"] for c in best["calls"] if c["dtype"] == "float32"}
    per_op = ", ".join(f"{c['op']} {c['first'] * 1e3:.0f}"
                       for c in best["calls"] if c["dtype"] == "float32")
    cpu = min(demo_totals(r, "first_cpu")[0] for r in runs)
    print(f"\nfirst calls, float32 (ms): {per_op}; demo total {demo_totals(best)[0]:.2f} s "
          f"(CPU {cpu:.2f} s), with Numba's set-up {demo_totals(best)[1]:.2f} s "
          f"(SciPy {best['scipy']:.2f} s)")
    assert all(r["cache_misses"] == 0 for r in runs), [r["compiled"] for r in runs]
    assert {"linear", "dropout", "scaled_dot_product_attention", "softmax"} <= ops
    assert len(ops & set(DEMO)) >= 4
    assert cpu < 1.0
    assert demo_totals(best)[0] < 2.0


# ------------------------------------------------------------------ read-only install

#: Capabilities that let root write where permission bits say no: dropped from the child's
#: bounding set (prctl PR_CAPBSET_DROP) before it execs Python, so the bits hold for it.
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, PR_CAPBSET_DROP = 1, 2, 3, 24

DROP_AND_EXEC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in ({caps}):
    if libc.prctl({drop}, cap, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_CAPBSET_DROP, {{cap}}): errno {{ctypes.get_errno()}}")
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""

READ_ONLY_CHILD = """
import os, sys
package = sys.argv[1]
try:                                            # the premise: this process cannot write there
    open(os.path.join(package, "probe"), "w").close()
    print("WRITABLE")
    sys.exit(0)
except PermissionError:
    pass
import numpy as np
import npattn
from npattn.kernels.dropout import dropout_mask_kernel
assert os.path.dirname(npattn.__file__) == package, npattn.__file__
mask = npattn.dropout_mask((3, 1000), 0.25, seed=4)
stats = dropout_mask_kernel.dispatcher.stats
print(0.65 < mask.mean() < 0.85, stats.cache_path, sum(stats.cache_hits.values()),
      sum(stats.cache_misses.values()))
"""


@pytest.fixture
def read_only_site(tmp_path):
    """site/ holding a copy of the package (no caches), site/ and everything in it read-only;
    made writable again afterwards, so that the temporary directory can be removed."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "npattn", ignore=shutil.ignore_patterns("__pycache__"))
    paths = [site, *site.rglob("*")]
    for path in paths:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    yield site
    for path in paths:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _run_read_only(site, home):
    """READ_ONLY_CHILD's (stdout, stderr), as a user for whom ``site`` is read-only: HOME is
    ``home``, NUMBA_CACHE_DIR and XDG_CACHE_HOME unset, and root without the capabilities
    that ignore permission bits. Runs from ``site``'s parent, away from the repository."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), PYTHONPATH=str(site))
    child = ["-c", READ_ONLY_CHILD, str(site / "npattn")]
    command = [sys.executable, *child]
    if os.geteuid() == 0:
        caps = ", ".join(map(str, (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER)))
        command = [sys.executable, "-c", DROP_AND_EXEC.format(caps=caps, drop=PR_CAPBSET_DROP),
                   *child]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=site.parent,
                          timeout=900)
    if proc.returncode and "prctl(PR_CAPBSET_DROP" in proc.stderr:
        pytest.skip(f"root, and cannot drop the capabilities that bypass permissions: "
                    f"{proc.stderr.strip()}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    if proc.stdout.startswith("WRITABLE"):
        pytest.skip("cannot make a directory read-only for this process")
    return proc.stdout, proc.stderr


def test_a_read_only_install_caches_in_the_user_cache_directory(read_only_site, tmp_path):
    """Package directory read-only, NUMBA_CACHE_DIR unset: Numba caches in ~/.cache/numba
    instead -- no error, no warning -- and a second process loads the kernels from there."""
    site, home = read_only_site, tmp_path / "home"
    home.mkdir()
    out, err = _run_read_only(site, home)
    ok, cache_path, hits, misses = out.split()
    assert err == ""
    assert ok == "True"
    assert cache_path.startswith(str(home / ".cache" / "numba")), cache_path
    assert int(misses) == 1
    out, err = _run_read_only(site, home)                      # a second process: from there
    ok, cache_path, hits, misses = out.split()
    assert (err, ok, hits, misses) == ("", "True", "1", "0")


def test_a_read_only_install_with_a_read_only_home_compiles_without_a_cache(read_only_site,
                                                                           tmp_path):
    """Package directory and home both read-only, NUMBA_CACHE_DIR unset: Numba has nowhere to
    cache (it would raise at import); npattn compiles in the process instead, silently."""
    site, home = read_only_site, tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    try:
        out, err = _run_read_only(site, home)
    finally:
        home.chmod(0o755)
    ok, cache_path, hits, misses = out.split()
    assert err == ""
    assert (ok, cache_path, hits, misses) == ("True", "None", "0", "1")
    assert not any(home.iterdir())
