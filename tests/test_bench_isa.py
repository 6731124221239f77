"""benchmarks --isa avx2: every implementation runs AVX2 code, and npattn picks its AVX2 tiles."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import run
from benchmarks.isa import AVX2_ENV

ROOT = Path(__file__).resolve().parent.parent


def test_native_removes_the_blas_overrides_and_sets_only_the_pool():
    env = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1", "HOME": "/h"}
    want, changes = run.wanted_environment(env, keep_pools=False)
    assert "OPENBLAS_CORETYPE" not in want and "OPENBLAS_L2_SIZE" not in want
    assert not set(AVX2_ENV) - {"OPENBLAS_CORETYPE"} & set(want)
    assert changes["OPENBLAS_CORETYPE"] == ("Haswell", None)
    assert want["HOME"] == "/h"


def test_avx2_sets_every_peer_to_avx2_code():
    want, changes = run.wanted_environment({"OPENBLAS_L2_SIZE": "1"}, keep_pools=True, isa="avx2")
    for name, (value, why) in AVX2_ENV.items():
        assert want[name] == value and changes[name] == (None, value) and why
    assert "OPENBLAS_L2_SIZE" not in want
    described = "\n".join(run.describe_changes(changes))
    assert "OPENBLAS_CORETYPE=Haswell" in described and "AVX2" in described


def test_under_the_avx2_environment_npattn_takes_its_avx2_tiles():
    """The environment alone makes a fresh process choose the avx2 family (no NPATTN_ISA),
    on any x86-64 CPU, AVX-512 ones included."""
    want, _ = run.wanted_environment(dict(os.environ), keep_pools=True, isa="avx2")
    want.pop("NPATTN_ISA", None)
    code = ("import json; from npattn.kernels import tiles; "
            "print(json.dumps([tiles.isa_in_force(), sorted(tiles.cpu_features())]))")
    out = subprocess.run([sys.executable, "-c", code], env=want, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    isa, features = json.loads(out)
    assert isa == "avx2"
    assert "avx2" in features and "avx512f" not in features
