"""benchmarks.micro_kernel's FMA peak probe: what it computes, and that its loop is nothing but
CHAINS independent fused multiply-adds on full-width registers (else "% of peak" would be
measured against something slower than the core's peak)."""
import re

import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import njit

from benchmarks import micro_kernel
from npattn.kernels import tiles


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=10, deadline=None)
@given(reps=st.integers(0, 300), x=st.floats(0.125, 1.0))
def test_the_peak_probe_computes_its_chains(dtype, reps, x):
    """Chain i starts at x·i and steps acc <- acc·a + x, a = x·(1 - 2^-20), reps times; the
    probe returns the sum over chains and lanes -- here against the same steps in float64."""
    loop, _, flops = micro_kernel.build_peak(dtype, np, njit)
    lanes = tiles.VECTOR_BYTES[tiles.isa_in_force()] // np.dtype(dtype).itemsize
    assert flops == 2 * micro_kernel.CHAINS * lanes
    t = np.dtype(dtype).type
    a = float(t(t(x) * t(1.0 - 2.0 ** -20)))
    accs = np.array([float(t(t(x) * t(i))) for i in range(micro_kernel.CHAINS)])
    for _ in range(reps):
        accs = accs * a + float(t(x))
    want = lanes * accs.sum()
    got = loop(reps, t(x))
    rel = (1e-6 if dtype == "float32" else 1e-12) * (reps + 10)
    assert got == pytest.approx(want, rel=rel)


def test_the_peak_probe_is_independent_fmas_in_registers():
    """The probe's loop: CHAINS fused multiply-adds a step, each on one vector register of the
    family's width (zmm on AVX-512, ymm on AVX2), no other arithmetic and no stack access."""
    loop, x, _ = micro_kernel.build_peak("float32", np, njit)
    asm = loop.inspect_asm(loop.signatures[0])
    blocks = re.findall(r"^(\.LBB\w+):\n(.*?)(?=^\.LBB|\Z)", asm, re.M | re.S)
    bodies = [re.split(rf"^\s+j\w+\s+{re.escape(label)}$", body, flags=re.M)[0]
              for label, body in blocks
              if re.search(rf"^\s+j\w+\s+{re.escape(label)}$", body, re.M)]
    body = max(bodies, key=lambda b: b.count("vfmadd"))
    fmas = re.findall(r"vfmadd\w+\s+([^\n]*)", body)
    register = "zmm" if tiles.isa_in_force() == "avx512" else "ymm"
    steps = len(fmas) // micro_kernel.CHAINS          # LLVM may unroll the loop
    assert steps >= 1 and len(fmas) == steps * micro_kernel.CHAINS, body
    assert all(register in f for f in fmas), body
    assert "(%rsp)" not in body and not re.search(r"\bv(mul|add)p", body), body
    assert not numba.config.DISABLE_JIT


@pytest.mark.parametrize("n", [1, 2, 3])
def test_spread_runs_every_thread_on_its_own_operands(n):
    """--threads: spread_peak sums n runs of the probe; spread_tile leaves in each thread's
    tile the product of that thread's own panels (distinct here, so a thread that ran
    another's operands, or none, shows)."""
    loop, x, _ = micro_kernel.build_peak("float32", np, njit)
    assert micro_kernel.spread_peak(loop, n, numba)(50, x) == pytest.approx(n * loop(50, x),
                                                                           rel=1e-6)
    mr, nr, kc = 4, 16, micro_kernel.KC
    tile_loop, ap, bp, tile = micro_kernel.build(mr, nr, "float32", np, njit)
    aps = np.stack([ap + i for i in range(n)])
    bps = np.stack([bp - i for i in range(n)])
    out = np.full((n, mr, nr), np.nan, np.float32)
    micro_kernel.spread_tile(tile_loop, n, numba)(2, kc, aps, bps, out)
    for i in range(n):
        want = aps[i].reshape(kc, mr).astype(np.int64).T @ bps[i].reshape(kc, nr).astype(np.int64)
        assert np.array_equal(out[i], want), i
