"""``NUMBA_DISABLE_JIT=1``: every kernel runs as plain Python, so a debugger steps into it.

A child process with the JIT disabled runs a small case of every public op, forward and
backward (``tests/test_stress.py::make_calls``, float64), the KV-cache decode step, every
``nn`` module, two AdamW steps and a GPT forward, backward and ``generate``; this process runs the
same calls compiled, and every output must agree to round-off (float64: the Python fallbacks
need not fuse or reassociate as LLVM does, so not bit for bit). Tiny shapes: the child takes
~15 s.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
RTOL = 1e-11        # relative to each output's largest magnitude: round-off in float64


def outputs():
    """{name: array} of every case, computed in this process (jitted or not)."""
    import npattn
    from npattn import nn, optim
    from npattn.models import GPT, GPTConfig
    from test_stress import make_calls

    results = {}

    def keep(name, arrays):
        arrays = arrays if isinstance(arrays, (tuple, list)) else (arrays,)
        for i, a in enumerate(arrays):
            if a is not None:
                results[f"{name} [{i}]"] = np.array(a, dtype=np.float64)

    rng = np.random.default_rng(29)
    for name, call in make_calls(rng, 0, np.float64).items():
        keep(name, call())

    f64 = np.float64
    q, k_new, v_new = (rng.standard_normal(s) for s in ((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8)))
    k_cache, v_cache = rng.standard_normal((1, 2, 90, 8)), rng.standard_normal((1, 2, 90, 8))
    keep("kv cache", npattn.scaled_dot_product_attention_with_kv_cache(
        q, k_cache, v_cache, 70, k_new, v_new, is_causal=True, enable_gqa=True))

    x = rng.standard_normal((2, 5, 16))
    mha = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True, dtype=f64, rng=1, seed=2)
    out, weights = mha(x, x, x, need_weights=True)
    keep("MultiheadAttention", (out, weights, *mha.backward(rng.standard_normal(out.shape))))
    keep("MultiheadAttention grads", [p.grad for p in mha.parameters()])
    stack = nn.Sequential(nn.Linear(16, 24, dtype=f64, rng=3), nn.GELU(),
                          nn.LayerNorm(24, dtype=f64), nn.Dropout(0.2, seed=4))
    y = stack(x)
    keep("Sequential", (y, stack.backward(rng.standard_normal(y.shape))))
    keep("Sequential grads", [p.grad for p in stack.parameters()])
    attn = nn.SelfAttention(16, 8, dropout=0.1, dtype=f64, rng=5, seed=6)
    z, w = attn(x, is_causal=True)
    keep("SelfAttention", (z, w, attn.backward(rng.standard_normal(z.shape))))
    embed, pos = nn.Embedding(11, 16, dtype=f64, rng=7), nn.PositionalEncoding(16, 9, 0.1,
                                                                               dtype=f64, seed=8)
    rope = nn.RotaryEmbedding(16, 9, dtype=f64)
    tokens = rng.integers(0, 11, (2, 5))
    e = rope(pos(embed(tokens)))
    embed.backward(pos.backward(rope.backward(rng.standard_normal(e.shape))))
    keep("Embedding, PositionalEncoding, RotaryEmbedding", (e, embed.weight.grad))
    opt = optim.AdamW(stack.parameters(), lr=0.1)
    opt.step()
    opt.step()
    keep("AdamW", [p.data for p in stack.parameters()])

    config = GPTConfig(block_size=8, vocab_size=13, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
    gpt = GPT(config, dtype=f64, rng=5, seed=6)
    idx = rng.integers(0, 13, (2, 8))
    logits, loss = gpt(idx, targets=np.roll(idx, -1, axis=1))
    gpt.backward()
    keep("GPT forward", (logits, loss))
    keep("GPT grads", [p.grad for p in gpt.parameters()])
    gpt.eval()
    keep("GPT generate", gpt.generate(idx[:, :3], 4, top_k=5, seed=7).astype(np.float64))
    return results


CHILD = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import numba, numpy as np
assert numba.config.DISABLE_JIT
import npattn
assert npattn.__file__.startswith({root!r}), npattn.__file__
from test_disable_jit import outputs
np.savez({path!r}, **outputs())
"""


def run_without_jit(path, extra_env=None):
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONWARNINGS="error::RuntimeWarning",
               **(extra_env or {}))
    script = CHILD.format(root=str(ROOT), tests=str(TESTS), path=str(path))
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_every_op_module_and_the_gpt_run_as_plain_python(tmp_path):
    path = tmp_path / "nojit.npz"
    child = run_without_jit(path)
    assert child.returncode == 0, child.stderr[-3000:]
    with np.load(path) as data:
        plain = {key: data[key] for key in data.files}
    jitted = outputs()
    assert sorted(plain) == sorted(jitted)
    assert len(jitted) >= 60, len(jitted)
    wrong = {}
    for key, want in jitted.items():
        got = plain[key]
        assert got.shape == want.shape, key
        same_nan = np.array_equal(np.isnan(got), np.isnan(want))
        finite = np.isfinite(want)
        scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-300)
        error = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)) / scale
        if not same_nan or not np.array_equal(got[~finite], want[~finite]) or error > RTOL:
            wrong[key] = error
    assert not wrong, f"plain Python differs from the compiled kernels: {json.dumps(wrong)}"
