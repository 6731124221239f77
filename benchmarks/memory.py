"""Peak resident memory of one call of one implementation, measured in a fresh process.

tracemalloc (``benchmarks/timing.py``) sees NumPy's buffers only: not what a Numba kernel
allocates (its NRT allocator), nor PyTorch's allocator. This measures the process's resident
set instead, in a child process per implementation so no other implementation's pools, caches
or freed-but-kept memory are in it::

    python -m benchmarks.memory '{"module": "benchmarks.bench_attention",
        "case": "attention_forward", "size": [1024, false], "warmup": [256, false],
        "impl": "npattn"}'

prints one JSON line. The child:

1. imports NumPy, Numba, npattn, the case's module (and PyTorch only for its column, at
   Numba's thread count, as the suite sets it);
2. builds the case at the ``warmup`` size and calls the implementation once: kernels compile
   or load from Numba's disk cache, the thread pools start, import-time caches fill;
3. builds the case at its size (the inputs), collects garbage, returns free heap to the system
   (``malloc_trim``);
4. resets the kernel's high-water mark of the resident set (``5`` into
   ``/proc/self/clear_refs``, Linux ≥ 4.0) and reads the resident set: the baseline;
5. calls the implementation once and reads the high-water mark (``VmHWM``).

Peak extra = high-water mark − baseline: everything the call held at its peak, outputs
included. Where the high-water mark cannot be reset, a thread samples the resident set every
millisecond during the call instead (``method`` says which; a sampled peak can miss a spike
shorter than that). ``ru_maxrss`` is not used: it never goes down, so a compile's or an
import's transient peak would hide the call's.

The child runs with ``MALLOC_MMAP_THRESHOLD_=131072``: a fixed threshold turns off glibc's
dynamic one, which after a large buffer is freed serves buffers up to that size (≤ 32 MiB) from
the heap, where freed memory stays resident. With it every buffer ≥ 128 KiB is mapped when
allocated and unmapped when freed, so the baseline holds no freed buffers and a buffer counts
exactly while it is alive.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ROOT = Path(__file__).resolve().parent.parent        # where ``-m benchmarks.memory`` resolves


# ------------------------------------------------------------------------- parent side

def measure(make, size, warmup, names, timeout=1800.0):
    """{implementation: result} for ``make(torch, *size)``, one fresh process each.

    A result is ``{"extra_bytes", "baseline_bytes", "peak_bytes", "method", "seconds"}``, or
    ``{"skipped": why}``, or ``{"error": message}``.
    """
    results = {}
    env = {**os.environ, **CHILD_ENV}
    for name in names:
        spec = {"module": make.__module__, "case": make.__name__, "size": list(size),
                "warmup": list(warmup), "impl": name}
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
                                  cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            lines = done.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines else {}
            if done.returncode or not result:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                result = {"error": result.get("error") or f"exit {done.returncode}: {tail}"}
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        result["seconds"] = time.perf_counter() - start
        results[name] = result
    return results


# ------------------------------------------------------------------------- child side

def _status(field):
    """``VmRSS`` / ``VmHWM`` of this process in bytes, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _reset_high_water():
    """Reset VmHWM to the current resident set; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmHWM") <= _status("VmRSS") + (1 << 20)
    except OSError:
        return False


def _trim():
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Sampler(threading.Thread):
    """The largest resident set seen, sampled every ``interval`` seconds (the fallback)."""

    def __init__(self, interval=0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, _status("VmRSS"), threading.Event()

    def run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            while not self.done.is_set():
                f.seek(0)
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
                time.sleep(self.interval)

    def stop(self):
        self.done.set()
        self.join()
        return max(self.peak, _status("VmRSS"))


def child(spec):
    import gc
    import importlib

    import numba
    import numpy  # noqa: F401  (in the baseline, like every import)

    import npattn  # noqa: F401

    torch = None
    if spec["impl"] == "PyTorch":
        import torch
        torch.set_num_threads(numba.get_num_threads())
    make = getattr(importlib.import_module(spec["module"]), spec["case"])

    warm = make(torch, *spec["warmup"])
    if spec["impl"] not in warm.impls:
        return {"skipped": warm.skipped.get(spec["impl"], "not available")}
    warm.impls[spec["impl"]]()
    del warm
    bench = make(torch, *spec["size"])
    if spec["impl"] not in bench.impls:
        return {"skipped": bench.skipped.get(spec["impl"], "not available")}
    call = bench.impls[spec["impl"]]
    gc.collect()
    _trim()
    if _reset_high_water():
        method = "VmHWM after clear_refs"
        baseline = _status("VmRSS")
        result = call()
        peak = _status("VmHWM")
    else:
        method = "VmRSS sampled every 1 ms"
        baseline = _status("VmRSS")
        sampler = _Sampler()
        sampler.start()
        result = call()
        peak = sampler.stop()
    del result
    return {"extra_bytes": peak - baseline, "baseline_bytes": baseline, "peak_bytes": peak,
            "method": method}


def main(argv):
    if len(argv) != 1:
        print(__doc__)
        return 2
    try:
        result = child(json.loads(argv[0]))
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
