"""How a case is timed: warm-up, calibration, interleaved rounds, peak memory.

1. Warm-up: each implementation is called once, untimed by the rounds; that first call is
   timed on its own, because npattn's compiles (or loads its kernels from Numba's disk cache).
   Its results are then checked (:func:`check_agreement`): every peer must give what npattn
   gives, within the dtype's tolerance, or the case fails untimed -- the speed of a wrong
   answer is no benchmark.
2. Calibration: each implementation's op is repeated until ``target`` seconds pass; a timed
   *call* is then that many repeats of the op, so quick ops are not measured at the clock's
   resolution. Times are reported per op.
3. Rounds: each round times every implementation once, in an order rotated from round to
   round, so a slow drift of the machine (another process, the clock) is shared by all.
   The repeats of one implementation stay together: two thread pools are never alternated
   inside a timed call (see ``benchmarks.pools``). Before each timed call the process sleeps
   ``settle`` seconds: after its last parallel region, a GNU OpenMP pool (Numba's ``omp``
   layer, PyTorch) spins about 10 ms before its workers sleep, and meanwhile a NumPy call
   shares the two cores with it (measured: NumPy n=512 fp32 1.79 ms right after npattn or
   PyTorch, 1.34 ms after NumPy or after a 10 ms pause). Shortening the spin instead
   (``GOMP_SPINCOUNT=0``, ``OMP_WAIT_POLICY=PASSIVE``) made npattn's and PyTorch's own
   back-to-back small calls 3-6× slower.
4. Peak memory: one more untimed call under ``tracemalloc`` (NumPy reports its buffers to it;
   PyTorch's allocator does not, so it is not measured).
"""
import gc
import math
import statistics
import time
import tracemalloc

import numpy as np


def _timed(fn, repeats):
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    finally:
        if gc_was_enabled:
            gc.enable()


def calibrate(fn, target):
    """(repeats of ``fn`` that last about ``target`` seconds, at least 1; seconds per op)."""
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < target / 4 or calls == 0:
        fn()
        calls += 1
    per_op = elapsed / calls
    return max(1, math.ceil(target / per_op)), per_op


def peak_bytes(fn):
    """Peak bytes allocated (and visible to tracemalloc) during one call of ``fn``."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


#: Largest difference from npattn's result allowed, relative to the result's largest magnitude.
#: Loose against rounding (sums of up to 4096 terms in float32) and tight against a wrong
#: answer: a wrong mask, scale, transpose or gradient is off by O(1).
AGREEMENT = {"float16": 1e-2, "float32": 1e-3, "float64": 1e-9}


def _arrays(value):
    """The arrays of an implementation's result, in order: nested tuples and lists flattened,
    PyTorch tensors converted."""
    if isinstance(value, (tuple, list)):
        return [a for item in value for a in _arrays(item)]
    if hasattr(value, "detach"):                      # a torch.Tensor
        value = value.detach().numpy()
    return [value]


def check_agreement(outputs, reference="npattn"):
    """Raise ValueError unless every result in ``outputs`` ({implementation: result}) holds the
    same arrays as ``outputs[reference]``: same count, shapes and dtype class, and values within
    ``AGREEMENT[dtype] · max|reference|`` of it. Returns {implementation: worst relative error}."""
    if reference not in outputs:
        return {}
    want = [np.asarray(a) for a in _arrays(outputs[reference])]
    worst = {}
    for name, result in outputs.items():
        if name == reference:
            continue
        got = [np.asarray(a) for a in _arrays(result)]
        if [a.shape for a in got] != [a.shape for a in want]:
            raise ValueError(f"{name} returned arrays of shapes {[a.shape for a in got]}, "
                             f"{reference} {[a.shape for a in want]}: not the same result")
        worst[name] = 0.0
        for i, (g, w) in enumerate(zip(got, want)):
            scale = float(np.max(np.abs(w))) if w.size else 0.0
            err = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
            tol = AGREEMENT.get(w.dtype.name, 1e-3) * max(scale, np.finfo(np.float64).tiny)
            if not err <= tol:                    # (NaN fails too)
                raise ValueError(f"{name} disagrees with {reference} on result {i} "
                                 f"(shape {w.shape}, {w.dtype}): max difference {err:.3g} "
                                 f"> {tol:.3g} (= {AGREEMENT.get(w.dtype.name, 1e-3):g} × "
                                 f"max|{reference}| {scale:.3g}); not timing a wrong answer")
            worst[name] = max(worst[name], err / max(scale, np.finfo(np.float64).tiny))
    return worst


def summary(times):
    """Median, quartiles and range of per-op times in seconds."""
    ordered = sorted(times)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return dict(median=statistics.median(ordered), q1=q1, q3=q3, min=ordered[0], max=ordered[-1])


def measure(impls, rounds, target, max_seconds, settle=0.015, memory_of=(), on_warm=None,
            unchecked=()):
    """Time each implementation of one case; returns a dict of per-implementation results.

    ``max_seconds`` bounds the rounds of a slow case (at least 3 rounds are kept).
    ``unchecked``: implementations that compute something else on purpose (a case's
    baseline), timed like the others but left out of the agreement check.
    ``on_warm(first_call_seconds)`` is called after the warm-up, for progress output.
    """
    names = list(impls)
    first, outputs = {}, {}
    for name in names:                                   # warm-up: compiles npattn's kernels
        start = time.perf_counter()
        outputs[name] = impls[name]()
        first[name] = time.perf_counter() - start
    agreement = check_agreement({n: r for n, r in outputs.items()   # raises on a wrong
                                 if n not in unchecked})             # answer
    del outputs
    if on_warm:
        on_warm(first)
    calibration = {}
    for name in names:
        time.sleep(settle)
        calibration[name] = calibrate(impls[name], target)
    repeats = {name: calibration[name][0] for name in names}
    per_round = sum(n * per_op for n, per_op in calibration.values())
    rounds_run = rounds if rounds * per_round <= max_seconds else max(
        3, min(rounds, int(max_seconds / per_round)))
    times = {name: [] for name in names}
    for r in range(rounds_run):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            time.sleep(settle)                       # let the previous pool fall asleep
            times[name].append(_timed(impls[name], repeats[name]))
        gc.collect()
    results = {}
    for name in names:
        results[name] = dict(summary(times[name]), first_call=first[name],
                             agreement=agreement.get(name),
                             repeats=repeats[name], rounds=rounds_run, times=times[name])
        if name in memory_of:
            results[name]["peak_bytes"] = peak_bytes(impls[name])
    return results
