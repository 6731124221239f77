"""The benchmark suite refuses to time a wrong answer (benchmarks/timing.py, check_agreement).

Untimed: these tests call each implementation once and compare results; no speed is asserted.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import cases, timing
from benchmarks import (bench_attention, bench_gelu, bench_gpt, bench_linear,  # noqa: F401
                        bench_matmul, bench_softmax, bench_variants)            # (register)

try:
    import torch
except ImportError:                                  # the check runs without the oracle too
    torch = None


@st.composite
def results(draw):
    """(result of nested arrays, its dtype): what a case's implementation returns."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    shapes = draw(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
                           min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return (arrays[0], tuple(arrays[1:])), dtype


def _flat(result):
    return timing._arrays(result)


@settings(max_examples=40, deadline=None)
@given(case=results(), which=st.integers(0, 10), factor=st.sampled_from([0.5, 2.0, 10.0]))
def test_a_peer_off_by_more_than_the_tolerance_fails_and_within_it_passes(case, which, factor):
    result, dtype = case
    arrays = _flat(result)
    target = arrays[which % len(arrays)]
    tol = timing.AGREEMENT[np.dtype(dtype).name]
    scale = float(np.abs(target).max())
    close = [a.copy() for a in arrays]
    close[which % len(arrays)].flat[0] += tol * scale / 4
    assert timing.check_agreement({"npattn": result, "NumPy": close})["NumPy"] <= tol
    wrong = [a.copy() for a in arrays]
    wrong[which % len(arrays)].flat[0] += factor * tol * scale * 4
    with pytest.raises(ValueError, match="NumPy disagrees with npattn on result"):
        timing.check_agreement({"npattn": result, "NumPy": wrong})


def test_shapes_count_and_nan_are_checked():
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="shapes"):
        timing.check_agreement({"npattn": (a, a), "NumPy": (a,)})
    with pytest.raises(ValueError, match="shapes"):
        timing.check_agreement({"npattn": a, "NumPy": a.T})
    nan = a.copy()
    nan[1, 2] = np.nan
    with pytest.raises(ValueError, match="disagrees"):
        timing.check_agreement({"npattn": a, "NumPy": nan})


@pytest.mark.skipif(torch is None, reason="PyTorch tensors are converted only when it exists")
def test_torch_tensors_are_compared_as_arrays():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert timing.check_agreement({"npattn": a, "PyTorch": torch.from_numpy(a.copy())}) == {
        "PyTorch": 0.0}
    with pytest.raises(ValueError, match="PyTorch disagrees"):
        timing.check_agreement({"npattn": a, "PyTorch": torch.from_numpy(a + 1)})


def _quick_benches():
    for c in cases.CASES:
        for size in c.quick:
            yield pytest.param(c.make, size, id=f"{c.make.__name__}{size}")


@pytest.mark.parametrize("make,size", list(_quick_benches()))
def test_every_quick_case_agrees_and_a_planted_wrong_peer_is_refused(make, size):
    """Each quick case's implementations agree as the suite calls them (with the PyTorch peer
    when it is importable); the same case with NumPy's result scaled by 1.01 fails untimed."""
    bench = make(torch, *size)
    outputs = {name: fn() for name, fn in bench.impls.items()}
    worst = timing.check_agreement(outputs)
    assert set(worst) == set(bench.impls) - {"npattn"}
    if "NumPy" not in bench.impls:
        return
    numpy = bench.impls["NumPy"]

    def scaled(value):
        if isinstance(value, (tuple, list)):
            return type(value)(scaled(v) for v in value)
        return value * value.dtype.type(1.01)

    bench.impls["NumPy"] = lambda: scaled(numpy())
    with pytest.raises(ValueError, match="NumPy disagrees"):
        timing.measure(bench.impls, rounds=1, target=1e-4, max_seconds=1.0, settle=0.0)


def test_a_baseline_is_timed_but_not_compared():
    """A case's baseline (Bench.baseline: npattn on a related problem, e.g. full causal
    attention beside a sliding window) is timed in the same rounds and reported beside the
    peers, but computes something else: it is left out of the agreement check, and only it."""
    from benchmarks import report
    a = np.arange(3.0)
    impls = {"npattn": lambda: a, "NumPy": lambda: a.copy(), cases.BASELINE: lambda: a + 1}
    results = timing.measure(impls, rounds=2, target=1e-4, max_seconds=1.0, settle=0.0,
                             unchecked=(cases.BASELINE,))
    assert set(results) == set(impls) and results[cases.BASELINE]["agreement"] is None
    with pytest.raises(ValueError, match="disagrees"):
        timing.measure(impls, rounds=1, target=1e-4, max_seconds=1.0, settle=0.0)
    record = {"label": "x", "flops": 1.0, "results": results, "baseline": "the same, plus one"}
    text = report.table([record])
    assert "speedup vs baseline" in text and "x: baseline = the same, plus one." in text
    plain = {**record, "label": "y", "results": {
        n: r for n, r in results.items() if n != cases.BASELINE}}
    assert "speedup vs baseline" not in report.table([plain])
    both = report.table([record, plain]).split("\n\n")[:2]       # two tables, plain first
    assert "| y |" in both[0] and "baseline" not in both[0]
    assert "| x |" in both[1] and "speedup vs baseline" in both[1]
