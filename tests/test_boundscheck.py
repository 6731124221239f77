"""The kernel tests once more with Numba's bounds checking on: an index out of bounds in any
kernel -- a packing loop, an edge tile, a row of softmax, a mask plane -- raises IndexError instead of reading
or writing someone else's memory. Small examples, in a subprocess with its own kernel cache
(bounds-checked kernels must not mix with the fast ones)."""
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kernel        # run again under each register tile in CI

TESTS = pathlib.Path(__file__).resolve().parent
KERNEL_TESTS = ["test_gemm.py", "test_linear.py", "test_matmul.py", "test_softmax.py",
                "test_dropout.py", "test_exp.py", "test_attention.py", "test_embedding.py",
                "test_cross_entropy.py", "test_layer_norm.py", "test_gelu.py", "test_rope.py",
                "test_attention_varlen.py", "test_tanh.py", "test_vector_pack.py",
                "test_vector_exp.py"]


def test_kernel_tests_pass_with_bounds_checking(tmp_path):
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "HYPOTHESIS_PROFILE": "boundscheck"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "-k", "not torch and not slp and not thread_count", *(str(TESTS / t) for t in KERNEL_TESTS)],
        capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
