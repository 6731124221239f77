"""npattn explain: the walkthrough's numbers against the textbook recomputed here, what it prints,
and that a kernel off by a little is caught."""
import io
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import npattn
from closeness import abs64, assert_close, f64
from npattn import reference
from npattn.tools import explain
from strategies import dtypes

ROUNDED = 5e-4 + 1e-9   # explain prints 3 decimals


@pytest.fixture(scope="module", params=[np.float32, np.float64], ids=["float32", "float64"])
def lesson(request):
    """One walkthrough per dtype: (the dict run returned, the text it printed, the dtype)."""
    out = io.StringIO()
    result = explain.run(seed=0, dtype=request.param, out=out)
    return result, out.getvalue(), np.dtype(request.param)


def numbers_after(text, label):
    """The numbers printed after ``label`` on its line (the first line that has it)."""
    line = next(line for line in text.splitlines() if label in line)
    rest = line.split(label, 1)[1]
    return np.array([float(v) for v in re.findall(r"-?\d+\.\d+(?:e[-+]?\d+)?", rest)])


def sinusoids(n, d):
    """PE(t, 2i) = sin(t / 10000^(2i/d)), PE(t, 2i+1) = cos(t / 10000^(2i/d)), entry by entry."""
    pe = np.zeros((n, d))
    for t in range(n):
        for j in range(d):
            angle = t / 10000.0 ** ((j - j % 2) / d)
            pe[t, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return pe


def test_the_article_softmax_example(lesson):
    result, text, dtype = lesson
    want = reference.softmax_forward(np.array([2.0, 4.0, 4.0]))
    assert want[0] == pytest.approx(1 / (1 + 2 * math.e ** 2), rel=1e-14)   # the closed form
    assert_close(result["token"]["article_softmax"], want, dtype=dtype, n=3)
    printed = numbers_after(text, "softmax([2, 4, 4]) =")
    np.testing.assert_allclose(printed, want, atol=ROUNDED, rtol=0)
    assert "[0.0, 0.5, 0.5]" in text                   # and what the article wrote instead


def test_input_is_embedding_plus_positional_encoding(lesson):
    result, _, dtype = lesson
    step = result["input"]
    n, d = step["x"].shape
    assert (n, d) == (len(explain.TOKENS), explain.D_MODEL)
    assert_close(step["positional"], sinusoids(n, d), dtype=np.float64)
    assert_close(step["x"], step["embedding"] + sinusoids(n, d), dtype=dtype, n=2,
                 scale=np.abs(step["embedding"]) + 1)


def test_projections_are_the_linear_layers(lesson):
    result, _, dtype = lesson
    x, proj = result["input"]["x"], result["projections"]
    for name, width in (("q", explain.D_K), ("k", explain.D_K), ("v", explain.D_V)):
        w, b = proj[f"w_{name}"], proj[f"b_{name}"]
        assert w.shape == (width, explain.D_MODEL) and b.shape == (width,)   # nn.Linear's layout
        want = reference.linear_forward(*f64(x, w, b))
        ax, aw, ab = abs64(x, w, b)
        assert_close(proj[name], want, dtype=dtype, n=explain.D_MODEL, scale=ax @ aw.T + ab)


def test_token_one_step_by_step(lesson):
    result, text, dtype = lesson
    q, k, v = f64(*(result["projections"][n] for n in "qkv"))
    token = result["token"]
    scores = np.array([sum(q[0, i] * k[j, i] for i in range(q.shape[1])) for j in range(len(k))])
    assert_close(token["scores"], scores, dtype=dtype, n=q.shape[1],
                 scale=np.abs(k) @ np.abs(q[0]))
    weights = reference.softmax_forward(scores)
    assert_close(token["weights"], weights, dtype=dtype, n=len(k))
    z1 = sum(weights[j] * v[j] for j in range(len(v)))                # z¹ = Σ_j w_j·v^j
    assert_close(token["z1"], z1, dtype=dtype, n=len(v), scale=np.abs(v).max(axis=0))
    np.testing.assert_allclose(numbers_after(text, "z¹ = Σ_j w_j·v^j ="), z1, atol=ROUNDED, rtol=0)
    for j in range(len(k)):
        label = f"q¹·k{'¹²³'[j]} ="
        np.testing.assert_allclose(numbers_after(text, label)[0], scores[j], atol=ROUNDED, rtol=0)
    assert "k¹, k², k²" in text and "k³" in text        # the article's typo, pointed out


def test_matrix_form_row_one_is_z1(lesson):
    result, _, dtype = lesson
    m, token = result["matrix"], result["token"]
    z1 = f64(token["z1"])[0]
    for name in "QKV":                                 # Q stacks the q^t of step 2
        assert_close(m[name], f64(result["projections"][name.lower()])[0], dtype=dtype,
                     n=explain.D_MODEL, scale=np.abs(m[name]).max())
    q, k, v = f64(m["Q"], m["K"], m["V"])
    weights = reference.softmax_forward(q @ k.T, dim=-1)
    assert_close(m["weights"], weights, dtype=dtype, n=explain.D_K)
    assert_close(m["weights"].sum(axis=-1), np.ones(len(q)), dtype=dtype, n=len(q))
    assert_close(m["Z"][0], z1, dtype=dtype, n=len(v), scale=np.abs(v).max(axis=0))
    assert_close(m["unscaled_fused_Z"][0], z1, dtype=dtype, n=len(v),
                 scale=np.abs(v).max(axis=0))
    want_z, want_weights = reference.attention_forward(q, k, v)     # scores / √d_k
    for got in (m["scaled_Z"], m["fused_Z"]):
        assert_close(got, want_z, dtype=dtype, n=explain.D_K, scale=np.abs(v).max(axis=0))
    for got in (m["scaled_weights"], m["fused_weights"]):
        assert_close(got, want_weights, dtype=dtype, n=explain.D_K)


def test_sqrt_dk_restores_unit_variance(lesson):
    demo = lesson[0]["matrix"]["sqrt_dk"]
    for d, (raw, scaled) in demo["variances"].items():
        assert 0.75 < raw / d < 1.25 and 0.75 < scaled < 1.25, (d, raw, scaled)
    unscaled_peak, scaled_peak = demo["peaks"]
    assert unscaled_peak > scaled_peak


def test_batch_shapes_mask_and_dropout(lesson):
    result, text, dtype = lesson
    b = result["batch"]
    assert b["x"].shape == (2, 5, 512)                 # the article's example
    for name, shape in (("Q", (2, 5, 64)), ("K", (2, 5, 64)), ("V", (2, 5, 64)),
                        ("scores", (2, 5, 5)), ("weights", (2, 5, 5)), ("Z", (2, 5, 64))):
        assert b[name].shape == shape, name
        assert str(shape) in text
    assert "[2, 5, 64]" in text and "2·5 = 10 independent 512-vectors" in text
    x = b["x"]
    for name in "qkv":
        w, bias = b["params"][name]
        ax, aw, ab = abs64(x, w, bias)
        assert_close(b[name.upper()], reference.linear_forward(*f64(x, w, bias)), dtype=dtype,
                     n=512, scale=ax @ aw.T + ab)
    q, k, v = f64(b["Q"], b["K"], b["V"])
    scale = np.abs(v).max(axis=-2, keepdims=True)
    want_z, want_weights = reference.attention_forward(q, k, v)
    for got_z, got_w in ((b["Z"], b["weights"]), (b["fused_Z"], b["fused_weights"])):
        assert_close(got_z, want_z, dtype=dtype, n=64, scale=scale)
        assert_close(got_w, want_weights, dtype=dtype, n=64)

    lengths = np.array(explain.LENGTHS)                # padding: key j is real iff j < length
    mask = np.broadcast_to(np.arange(5)[None, None, :] < lengths[:, None, None], (2, 5, 5))
    np.testing.assert_array_equal(b["mask"], mask)
    want_z, want_weights = reference.attention_forward(q, k, v, mask)
    assert_close(b["masked_Z"], want_z, dtype=dtype, n=64, scale=scale)
    assert_close(b["masked_weights"], want_weights, dtype=dtype, n=64)
    assert np.all(b["masked_weights"][~mask] == 0)

    keep = npattn.dropout_mask((2, 5, 5), b["dropout_p"], b["seed"])
    want_z, want_weights = reference.attention_forward(q, k, v, mask, keep, b["dropout_p"])
    assert_close(b["dropout_Z"], want_z, dtype=dtype, n=64, scale=scale / (1 - b["dropout_p"]))
    assert_close(b["dropout_weights"], want_weights, dtype=dtype, n=64)
    assert np.all(b["dropout_weights"][~keep] == 0)


def test_backward_matches_the_textbook(lesson):
    result, _, dtype = lesson
    b, g = result["batch"], result["backward"]
    x, dz = f64(b["x"], g["dZ"])
    q, k, v = f64(b["Q"], b["K"], b["V"])
    dq, dk, dv, _ = reference.attention_backward(dz, q, k, v)
    for got, want in ((g["dQ"], dq), (g["dK"], dk), (g["dV"], dv),
                      (g["fused"][0], dq), (g["fused"][1], dk), (g["fused"][2], dv)):
        assert_close(got, want, dtype=dtype, n=64, scale=np.abs(want).max())
    dx = np.zeros_like(x)
    for name, d in (("q", dq), ("k", dk), ("v", dv)):
        w, bias = f64(*b["params"][name])
        dx_part, dweight, dbias = reference.linear_backward(d, x, w, bias)
        dx += dx_part
        upper = name.upper()
        assert_close(g[f"dW_{upper}"], dweight, dtype=dtype, n=512, scale=np.abs(dweight).max())
        assert_close(g[f"db_{upper}"], dbias, dtype=dtype, n=512,
                     scale=np.abs(d).sum(axis=(0, 1)).max())
    assert_close(g["dX"], dx, dtype=dtype, n=512, scale=np.abs(dx).max())
    # b_K shifts a whole row of scores, which softmax ignores: its gradient is zero
    assert_close(g["db_K"], np.zeros(dk.shape[-1]), dtype=dtype, n=512,
                 scale=np.abs(dk).sum(axis=(0, 1)).max())
    keep = npattn.dropout_mask((2, 5, 5), b["dropout_p"], b["seed"])
    want = reference.attention_backward(dz, q, k, v, b["mask"], keep, b["dropout_p"])[:3]
    for got, w in zip(g["fused_masked"], want):
        assert_close(got, w, dtype=dtype, n=64, scale=np.abs(w).max())


def test_every_check_is_printed_and_passes(lesson):
    result, text, dtype = lesson
    checks = result["checks"]
    assert result["ok"] and all(c.ok for c in checks)
    assert result["tolerance"] == explain.TOLERANCE_EPS * np.finfo(dtype).eps
    assert result["max_discrepancy"] == max(c.error for c in checks) <= result["tolerance"]
    assert text.count("\n    ok  ") == len(checks) > 40
    assert "\n    MISMATCH  " not in text and "\nMISMATCH:" not in text
    for n in range(1, 7):
        assert f"Step {n} ·" in text


@settings(max_examples=4)   # each example is a whole walkthrough (~1 s); the fixture covers seed 0
@given(seed=st.integers(0, 2 ** 32 - 1), dtype=dtypes)
def test_any_seed_passes_its_checks(seed, dtype):
    out = io.StringIO()
    result = explain.run(seed=seed, dtype=dtype, out=out)
    assert result["ok"] and f"seed {seed}" in out.getvalue()
    q, k, v = f64(*(result["projections"][n] for n in "qkv"))
    z1 = reference.softmax_forward(k @ q[0]) @ v
    assert_close(result["matrix"]["Z"][0], z1, dtype=dtype, n=len(v),
                 scale=np.abs(v).max(axis=0))


def _off_by(func, factor):
    """``func`` with its (first) result multiplied by ``factor``: a kernel a little wrong."""
    def wrong(*args, **kwargs):
        out = func(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * out[0].dtype.type(factor),) + out[1:]
        return out * out.dtype.type(factor)
    return wrong


@pytest.mark.parametrize("op", ["linear", "softmax", "attention", "matmul_backward",
                                "attention_backward"])   # ~1.5 s each: a sample of the ops
def test_a_wrong_kernel_is_caught(monkeypatch, op):
    # off by 1e-3 relative: ~8x float32's tolerance, far below what a reader would notice
    monkeypatch.setattr(explain, op, _off_by(getattr(npattn, op), 1 + 1e-3))
    out = io.StringIO()
    with pytest.raises(explain.Mismatch) as caught:
        explain.run(seed=0, dtype=np.float32, out=out)
    failed = caught.value.failed
    assert failed and all(not c.ok and c.error > caught.value.result["tolerance"]
                          for c in failed)
    assert caught.value.result["ok"] is False
    text = out.getvalue()
    assert text.count("\n    MISMATCH  ") == len(failed) and "\nMISMATCH:" in text


def test_main_exits_1_on_a_mismatch(monkeypatch, capsys):
    monkeypatch.setattr(explain, "softmax", _off_by(npattn.softmax, 1.01))
    assert explain.main(["--seed", "0", "--dtype", "float64"]) == 1
    assert "\nMISMATCH:" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dtype=np.int32), TypeError, ["dtype", "float32 or float64", "int32"]),
    (dict(dtype="float16"), TypeError, ["dtype", "float16"]),
    (dict(seed=-1), ValueError, ["seed", "non-negative", "-1"]),
    (dict(seed=1.5), ValueError, ["seed", "1.5"]),
    (dict(seed=True), ValueError, ["seed", "True"]),
])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, error, words):
    out = io.StringIO()
    with pytest.raises(error) as caught:
        explain.run(out=out, **kwargs)
    assert all(w in str(caught.value) for w in words), str(caught.value)
    assert out.getvalue() == ""
