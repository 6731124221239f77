"""What a result was measured on: CPU, versions, thread pools, and who else used the CPU.

Everything optional degrades to a note: no threadpoolctl, no PyTorch, no /proc (not Linux).
"""
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import llvmlite
import llvmlite.binding
import numba
import numpy as np

import npattn

#: The SIMD extensions worth naming (LLVM's spelling, as Numba compiles for them).
SIMD = ("sse4.2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl",
        "avx512vnni", "avx512bf16", "avx512fp16", "amx-tile", "neon", "sve")


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def simd_flags():
    features = llvmlite.binding.get_host_cpu_features()
    return [name for name in SIMD if features.get(name)]


def register_tiles():
    """npattn's instruction set in force and its GEMM register tile per dtype (MR×NR)."""
    from npattn.kernels import tiles
    isa = tiles.isa_in_force()
    return {"isa": isa, **{dtype: "{}×{}".format(*tiles.TILES[isa, dtype]) for dtype in tiles.DTYPES}}


def git_commit():
    """The repository's commit, with ``+dirty`` when the work tree has changes; None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        run = lambda *cmd: subprocess.run(("git", *cmd), cwd=root, capture_output=True,  # noqa: E731
                                          text=True, timeout=10, check=True).stdout.strip()
        return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def blas_pools():
    """threadpoolctl's view of the loaded thread pools (BLAS, OpenMP), or None without it."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return threadpool_info()


def numpy_blas(pools):
    """NumPy's BLAS: name, version, kernel architecture and threads, as far as known."""
    blas = {}
    try:
        config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas.update(name=config.get("name"), version=config.get("version"))
    except Exception:  # NumPy < 1.26 has no dict mode; the name stays unknown
        pass
    for pool in pools or ():
        if pool.get("user_api") == "blas" and "numpy" in pool.get("filepath", ""):
            blas.update(name=pool.get("internal_api"), version=pool.get("version"),
                        architecture=pool.get("architecture"), threads=pool.get("num_threads"),
                        threading=pool.get("threading_layer"))
    if pools is None:
        blas["architecture"] = "unknown (pip install threadpoolctl)"
    return blas


def describe(torch):
    """The machine and software record of results.json (call after the first npattn kernel)."""
    try:
        layer = numba.threading_layer()
    except ValueError:              # no parallel kernel has run yet
        layer = None
    pools = blas_pools()
    versions = {"python": platform.python_version(), "npattn": npattn.__version__,
                "numpy": np.__version__, "numba": numba.__version__,
                "llvmlite": llvmlite.__version__,
                "torch": torch.__version__ if torch else None}
    for optional in ("threadpoolctl", "matplotlib"):
        module = sys.modules.get(optional)
        versions[optional] = getattr(module, "__version__", None)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu": cpu_model(), "llvm_cpu": llvmlite.binding.get_host_cpu_name(),
        "compiled_for": numba.config.CPU_NAME,      # None: the host (--isa avx2: haswell)
        "tiles": register_tiles(),
        "cpus": os.cpu_count(), "cpus_usable": affinity, "simd": simd_flags(),
        "platform": platform.platform(), "versions": versions, "git": git_commit(),
        "threads": {"numba": numba.get_num_threads(),
                    "torch": torch.get_num_threads() if torch else None,
                    "blas": numpy_blas(pools).get("threads")},
        "numba_threading_layer": layer, "blas": numpy_blas(pools), "thread_pools": pools,
    }


class CpuMeter:
    """The share of the machine's CPU time that other processes (or the hypervisor) took.

    From /proc/stat (all CPUs' busy time, steal included) minus this process's and its
    children's own CPU time; ``None`` where /proc/stat does not exist.
    """

    def __init__(self):
        self.start = self.sample()

    @staticmethod
    def sample():
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return None
        own = sum(getattr(resource.getrusage(who), field)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for field in ("ru_utime", "ru_stime"))
        hz = os.sysconf("SC_CLK_TCK")
        total = sum(ticks) / hz
        idle = (ticks[3] + ticks[4]) / hz          # idle + iowait
        return time.monotonic(), total, idle, own

    def foreign_share(self, since=None):
        """Share of all CPUs' time used by others since ``since`` (a sample) or the start."""
        since = since or self.start
        now = self.sample()
        if now is None or since is None or now[1] <= since[1]:
            return None
        capacity = now[1] - since[1]
        busy = capacity - (now[2] - since[2])
        return min(1.0, max(0.0, (busy - (now[3] - since[3])) / capacity))

    def wait_until_quiet(self, limit, threshold, window=0.5, say=print):
        """Wait (at most ``limit`` seconds) until others use under ``threshold`` of the CPUs.

        Returns the seconds waited. Judged over ``window``-second samples; no-op without /proc.
        """
        waited, told = 0.0, False
        while waited < limit:
            before = self.sample()
            if before is None:
                return waited
            time.sleep(window)
            waited += window
            share = self.foreign_share(before)
            if share is None or share < threshold:
                break
            if not told:
                say(f"  (waiting up to {limit:.0f} s: other processes use {share:.0%} of the "
                    f"CPUs)", flush=True)
                told = True
        return waited
