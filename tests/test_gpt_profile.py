"""``python -m benchmarks.gpt_profile``: its tables account for the whole step, op by op.

Run in-process at the ``--quick`` sizes (1 layer, n_embd 32, block 16, batch 2; a 4-token
prompt and 6 new tokens). The call counts are derived here from the model's graph, not read
from the profiler: a wrapper dropped from ``benchmarks.gpt_profile.TARGETS`` moves its op into
the glue row and fails ``test_every_op_the_step_uses_has_its_row`` (planted: without the
``linear_backward`` wrapper, linear showed 5 calls instead of 10). A wrapper that also counted
its wrapped callees (planted: ``nn.Linear.forward`` wrapped too, without the exclusive-time
subtraction) makes the glue negative and fails ``test_the_rows_add_up_to_the_step``.
"""
import contextlib
import importlib
import io
import time

import pytest

from benchmarks import gpt_profile
from benchmarks.bench_gpt import GEN_QUICK, TRAIN_QUICK


def expected_calls(n_layer):
    """Calls per training step and per generation at the --quick sizes, from the graph."""
    new = GEN_QUICK[-1]
    decodes = 1 + (new - 1)                       # a prefill, then one pass per new token but
    train = {                                     # the last (the cache never fills at 4 + 6)
        "linear (GEMM)": 2 * (4 * n_layer + 1),   # c_attn, c_proj, c_fc, c_proj; lm_head; ×2
        "attention fwd": n_layer, "attention bwd": n_layer,
        "layer_norm": 2 * (2 * n_layer + 1),      # ln_1, ln_2 per block, ln_f; fwd and bwd
        "gelu": 2 * n_layer,
        "cross_entropy": 2,
        "embedding": 4,                           # wte and wpe, forward and backward
        "dropout": 1 + 2 * n_layer,               # drop; resid and mlp dropout per block:
                                                  # backward only (p = 0: forward returns x)
        "AdamW": 1,
    }
    # the prefill runs the modules; each new token one fused block_decode per layer (its
    # products, layer norms, attention and GELU inside it), then ln_f and lm_head
    generate = {"linear (GEMM)": 4 * n_layer + 1 + (decodes - 1),
                "attention fwd": n_layer,                   # the prefill, on the fused engine
                "decode block": (decodes - 1) * n_layer,    # each new token, per layer
                "layer_norm": 2 * n_layer + 1 + (decodes - 1), "gelu": n_layer,
                "embedding": 2, "sampling (NumPy)": new}
    return train, generate


@pytest.fixture(scope="module")
def tables():
    """The two tables of one ``--quick`` run (pytest's capsys is per test; this is per file)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpt_profile.main(["--quick", "--steps", "3"]) == 0
    return parse(out.getvalue())


def parse(text):
    """[({row name: (calls or None, ms)}, measured step ms), ...]: one pair per table; the
    'sum of the rows' line is left out (the test sums the rows itself)."""
    tables, current = [], None
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| op |"):
            current = None
            continue
        if current is None:
            current = {}
            tables.append(current)
        name, calls, ms = [cell.strip() for cell in line.strip("|").split("|")][:3]
        if name.endswith("(measured)"):
            current["@step"] = float(ms)
        elif not name.startswith("sum of"):
            current[name] = (float(calls) if calls else None, float(ms))
    return [(t, t.pop("@step")) for t in tables]


def test_every_op_the_step_uses_has_its_row(tables):
    train, generate = expected_calls(TRAIN_QUICK[0])
    assert len(tables) == 2
    for (table, _), want in zip(tables, (train, generate)):
        got = {name: calls for name, (calls, _) in table.items() if name != gpt_profile.GLUE}
        assert got == want


def test_the_rows_add_up_to_the_step(tables):
    for table, step in tables:
        rows = [ms for _, ms in table.values()]
        assert sum(rows) == pytest.approx(step, rel=1e-3, abs=0.01)      # printed rounding
        assert table[gpt_profile.GLUE][1] >= -0.001     # nothing counted twice
        assert all(ms >= 0 for ms in rows)


def test_the_wrappers_are_restored(tables):
    linear = importlib.import_module("npattn.nn.linear")
    functional = importlib.import_module("npattn.functional.linear")
    optim = importlib.import_module("npattn.optim")
    gpt = importlib.import_module("npattn.models.gpt")
    assert linear.linear_forward is functional.linear_forward
    assert "step" not in optim.AdamW.__dict__                     # inherited again
    assert isinstance(gpt.GPT.__dict__["_sample"], staticmethod)
    assert not hasattr(gpt.GPT._sample, "__wrapped__")


def test_a_failing_wrap_restores_what_it_had_patched():
    recorder = gpt_profile.Recorder()
    bad = gpt_profile.TARGETS[:2] + (("npattn.nn.linear", "no_such_function", "gelu"),)
    linear = importlib.import_module("npattn.nn.linear")
    before = linear.linear_forward
    with pytest.raises(AttributeError, match="no_such_function"):
        with gpt_profile.patched(recorder, targets=bad):
            pass
    assert linear.linear_forward is before


def test_exclusive_time_counts_a_nested_call_once():
    recorder = gpt_profile.Recorder()
    inner = recorder.wrap(lambda: sum(range(20000)), "gelu")
    outer = recorder.wrap(lambda: inner() + sum(range(20000)), "linear (GEMM)")
    start = time.perf_counter()
    outer()
    took = time.perf_counter() - start
    assert recorder.calls["gelu"] == recorder.calls["linear (GEMM)"] == 1
    assert 0 < recorder.seconds["gelu"] < took
    assert recorder.seconds["gelu"] + recorder.seconds["linear (GEMM)"] <= took


def test_bad_steps_exit_2_naming_the_argument(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpt_profile.main(["--quick", "--steps", "0"])
    assert exit_.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_torch_side_by_side_gives_each_group_its_aten_ops(torch):
    """``--torch``: PyTorch's step profiled and put in npattn's groups. Every group whose op
    PyTorch's GPT runs must get time, and the rows must not add up to more than the step
    (planted: ``aten::_scaled_dot_product_flash_attention_for_cpu`` dropped from
    TORCH_GROUPS left attention fwd at 0 and failed here)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpt_profile.main(["--quick", "--torch", "--steps", "2"]) == 0
    text = out.getvalue()
    assert "against PyTorch" in text
    rows = {}
    for line in text[text.index("against PyTorch"):].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "op" \
                and not cells[1].startswith("-"):
            rows[cells[0]] = (float(cells[1]), float(cells[2]))
    ran = ["linear (GEMM)", "attention fwd", "attention bwd", "layer_norm", "gelu",
           "cross_entropy", "embedding", "AdamW"]
    assert all(rows[g][1] > 0 for g in ran), rows
    rest = rows[f"{gpt_profile.GLUE} (the rest)"]
    assert rest[0] >= -0.001 and rest[1] >= -0.001
    step = rows["step"]
    for side in (0, 1):
        total = sum(ms[side] for name, ms in rows.items() if name != "step")
        assert total == pytest.approx(step[side], rel=1e-3, abs=0.01)
