"""Two thread pools on two cores: how much alternating OpenBLAS and a Numba kernel costs.

    python -m benchmarks.pools          # one JSON line, in the environment as it is

NumPy's OpenBLAS keeps its own worker threads, and Numba's ``omp`` threading layer keeps
GNU OpenMP's. After a call, each pool's idle workers spin for a while before they sleep; a
call on the other pool meanwhile shares the cores with them, and on a 2-core machine it waits
for time slices. The probe times a small BLAS product alone, a small npattn (Numba parallel)
kernel alone, and the two alternating; ``interference_ms`` is what a pair costs beyond the two
alone. ``benchmarks.run`` runs it in this process (with its pool settings) and in a child
process with the caller's environment, and reports both.
"""
import json
import os
import sys
import time

import numpy as np

import npattn

#: What the probe alternates: a BLAS product big enough to use every BLAS thread, and a Numba
#: parallel kernel big enough to use every Numba thread; each runs in well under a millisecond.
GEMM_N = 256
SOFTMAX_ROWS = (512, 256)
#: The variables that decide how long idle pool workers spin (the ones probed and reported).
POOL_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")


def _per_call_ms(fn, seconds):
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return elapsed / calls * 1e3


def probe(seconds=0.3, repeats=3):
    """Milliseconds per BLAS call, per Numba call and per alternating pair (best of repeats)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32)
    x = rng.standard_normal(SOFTMAX_ROWS, dtype=np.float32)
    blas = lambda: a @ a                                   # noqa: E731
    numba_kernel = lambda: npattn.softmax(x)               # noqa: E731
    pair = lambda: (a @ a, npattn.softmax(x))              # noqa: E731
    result = {}
    for name, fn in (("blas_ms", blas), ("numba_ms", numba_kernel), ("pair_ms", pair)):
        result[name] = min(_per_call_ms(fn, seconds) for _ in range(repeats))
    result["interference_ms"] = result["pair_ms"] - result["blas_ms"] - result["numba_ms"]
    result["env"] = {k: os.environ[k] for k in POOL_VARIABLES if k in os.environ}
    return result



if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 0.3
    print(json.dumps(probe(seconds)))
