"""Fuzz: every public function and module of npattn, called with random -- and randomly wrong --
arguments, either returns a correct result or raises ValueError/TypeError naming the argument.

The harness (``Case``, the option generators) is ``fuzz_harness.py``; the case generators are
in ``fuzz_functional.py`` (the ops), ``fuzz_modules.py`` (``npattn.nn``) and ``fuzz_library.py``
(optimisers, lr schedules, gradcheck, ``nn.init``, ``nn.utils``); this file holds the table,
the child and the tests.

``TABLE`` maps each public name (``npattn.__all__``, ``npattn.nn.__all__``, the
initialisers of ``nn.init``, ``nn.utils``' functions, the optimisers and learning-rate
schedules of ``npattn.optim``, the checks of ``npattn.gradcheck``) to a case generator. A case
is one call (or, for a module, a constructor, ``backward`` before ``forward``, ``forward`` and
``backward``): valid arguments drawn by
Hypothesis -- ranks and shapes with 0-size dims, float32/float64, every memory layout, NaN,
±inf and huge values -- of which 0, 1 or 2 are then replaced by a wrong one: an integer, bool,
complex, float16, object or string dtype, the other float dtype, a mismatched or
non-broadcasting shape, None, a string, a ragged list, a number out of range, a huge int, ...
(and some right ones: nested lists, NumPy scalars, Fractions). Then:

* a case with a wrong argument must raise ValueError or TypeError whose message names one of
  the wrong arguments (as a word: ``p`` does not match ``dropout_p``);
* a valid case must return: the result has the expected shape and dtype, equals the float64
  reference (``npattn.reference``, or NumPy) within a loose tolerance where that is cheap --
  NaN exactly where the reference has NaN -- and the caller's arrays are left untouched;
* anything else -- IndexError, KeyError, AttributeError, ZeroDivisionError, OverflowError, a
  Numba error, a segfault -- is a failure. One exception: ``backward`` before ``forward`` is a
  RuntimeError (a call out of order, not a bad argument), as in ``npattn.nn.Module``.

The cases run in a subprocess (``main`` below) so that a crash in compiled code is a failed
test showing the child's stderr, not a dead test run. Knobs (environment variables):
``NPATTN_FUZZ_EXAMPLES`` (Hypothesis examples per target; default 60, about 50 s with the
kernel cache warm), ``NPATTN_FUZZ_SEED``
(default 0: the same seed draws the same cases), ``NPATTN_FUZZ_ONLY`` (comma-separated
target names).
"""
import os
import pathlib
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings, strategies as st

TESTS = pathlib.Path(__file__).resolve().parent
if str(TESTS) not in sys.path:                      # the child imports this file as a module
    sys.path.insert(0, str(TESTS))

import npattn                                       # noqa: E402
from npattn import gradcheck as gradcheck_module_   # noqa: E402
from npattn import nn, optim                        # noqa: E402

from fuzz_harness import *  # noqa: E402,F401,F403 -- the harness
from fuzz_functional import *  # noqa: E402,F401,F403 -- the case generators, by kind
from fuzz_modules import *  # noqa: E402,F401,F403
from fuzz_library import *  # noqa: E402,F401,F403


# ---------------------------------------------------------------------------- the table

class Target:
    """A case generator bound to the callable it exercises: ``Target(case)`` runs one case."""

    def __init__(self, gen, fn, **kw):
        self.gen, self.fn, self.kw = gen, fn, kw
        self.key = (gen, id(fn), tuple(sorted(kw.items())))

    def __call__(self, case):
        return self.gen(case, self.fn, **self.kw)


FUNCTIONAL = {  # name -> (generator, its options); the callable is getattr(npattn, name)
    "linear": (gen_linear, dict(backward=False)),
    "linear_forward": (gen_linear, dict(backward=False)),
    "linear_backward": (gen_linear, dict(backward=True)),
    "matmul": (gen_matmul, dict(backward=False)),
    "matmul_forward": (gen_matmul, dict(backward=False)),
    "matmul_backward": (gen_matmul, dict(backward=True)),
    "softmax": (gen_softmax, dict(log=False, backward=False)),
    "softmax_forward": (gen_softmax, dict(log=False, backward=False)),
    "softmax_backward": (gen_softmax, dict(log=False, backward=True)),
    "log_softmax": (gen_softmax, dict(log=True, backward=False)),
    "log_softmax_forward": (gen_softmax, dict(log=True, backward=False)),
    "log_softmax_backward": (gen_softmax, dict(log=True, backward=True)),
    "dropout": (gen_dropout, dict(backward=False)),
    "dropout_forward": (gen_dropout, dict(backward=False)),
    "dropout_backward": (gen_dropout, dict(backward=True)),
    "dropout_mask": (gen_dropout_mask, {}),
    "scaled_dot_product_attention": (gen_sdpa, dict(mode="output")),
    "scaled_dot_product_attention_forward": (gen_sdpa, dict(mode="forward")),
    "scaled_dot_product_attention_backward": (gen_sdpa, dict(mode="backward")),
    "attention": (gen_attention, dict(backward=False)),
    "attention_forward": (gen_attention, dict(backward=False)),
    "attention_backward": (gen_attention, dict(backward=True)),
    "scaled_dot_product_attention_with_kv_cache": (gen_kv_cache, {}),
    "scaled_dot_product_attention_varlen": (gen_varlen, dict(mode="output")),
    "scaled_dot_product_attention_varlen_forward": (gen_varlen, dict(mode="forward")),
    "scaled_dot_product_attention_varlen_backward": (gen_varlen, dict(mode="backward")),
    "embedding": (gen_embedding, dict(backward=False)),
    "embedding_forward": (gen_embedding, dict(backward=False)),
    "embedding_backward": (gen_embedding, dict(backward=True)),
    "cross_entropy": (gen_cross_entropy, dict(backward=False)),
    "cross_entropy_forward": (gen_cross_entropy, dict(backward=False)),
    "cross_entropy_backward": (gen_cross_entropy, dict(backward=True)),
    "layer_norm": (gen_layer_norm, dict(backward=False)),
    "layer_norm_forward": (gen_layer_norm, dict(backward=False)),
    "layer_norm_backward": (gen_layer_norm, dict(backward=True)),
    "gelu": (gen_gelu, dict(backward=False)),
    "gelu_forward": (gen_gelu, dict(backward=False)),
    "gelu_backward": (gen_gelu, dict(backward=True)),
    "rotary_embedding": (gen_rotary, dict(backward=False)),
    "rotary_embedding_forward": (gen_rotary, dict(backward=False)),
    "rotary_embedding_backward": (gen_rotary, dict(backward=True)),
}
OTHERS = {  # name -> (generator, the class or function it exercises)
    "nn.Module": (gen_module_base, nn.Module),
    "nn.Parameter": (gen_parameter, nn.Parameter),
    "nn.Sequential": (gen_sequential, nn.Sequential),
    "nn.Linear": (gen_linear_module, nn.Linear),
    "nn.Dropout": (gen_dropout_module, nn.Dropout),
    "nn.SelfAttention": (gen_self_attention, nn.SelfAttention),
    "nn.MultiheadAttention": (gen_multihead_attention, nn.MultiheadAttention),
    "nn.Embedding": (gen_embedding_module, nn.Embedding),
    "nn.PositionalEncoding": (gen_positional_encoding, nn.PositionalEncoding),
    "nn.LayerNorm": (gen_layer_norm_module, nn.LayerNorm),
    "nn.GELU": (gen_gelu_module, nn.GELU),
    "nn.RotaryEmbedding": (gen_rotary_module, nn.RotaryEmbedding),
    "nn.ModuleList": (gen_module_list, nn.ModuleList),
    "optim.LambdaLR": (gen_lr_scheduler, optim.LambdaLR),
    "optim.LinearLR": (gen_lr_scheduler, optim.LinearLR),
    "optim.CosineAnnealingLR": (gen_lr_scheduler, optim.CosineAnnealingLR),
    "optim.SequentialLR": (gen_lr_scheduler, optim.SequentialLR),
    "optim.SGD": (gen_optimizer, optim.SGD),
    "optim.Adam": (gen_optimizer, optim.Adam),
    "optim.AdamW": (gen_optimizer, optim.AdamW),
    "gradcheck.gradcheck": (gen_gradcheck, gradcheck_module_.gradcheck),
    "gradcheck.gradcheck_module": (gen_gradcheck_module, gradcheck_module_.gradcheck_module),
}
_INIT = Target(gen_init, nn.init)
_CLIP = Target(gen_clip_grad_norm, nn.utils.clip_grad_norm_)
#: public name -> the Target that fuzzes it (nn.init's functions share one: each case draws
#: which function it calls)
TABLE = {**{name: Target(gen, getattr(npattn, name), **kw)
            for name, (gen, kw) in FUNCTIONAL.items()},
         **{name: Target(gen, fn) for name, (gen, fn) in OTHERS.items()},
         "nn.init": _INIT, **{f"nn.init.{name}": _INIT for name in INIT_FUNCTIONS},
         "nn.utils": _CLIP, "nn.utils.clip_grad_norm_": _CLIP}


def public_names():
    """Every name the fuzz table must cover, from the packages themselves."""
    names = {n for n in npattn.__all__ if callable(getattr(npattn, n))}
    names |= {f"nn.{n}" for n in nn.__all__}
    names |= {f"nn.init.{n}" for n in nn.init.__all__}
    defined = {n for n, v in vars(nn.init).items()
               if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") ==
               nn.init.__name__}
    assert defined <= set(nn.init.__all__), f"nn.init defines {defined - set(nn.init.__all__)} " \
        "outside its __all__"
    names |= {f"nn.utils.{n}" for n in nn.utils.__all__}
    names |= {f"optim.{n}" for n, v in vars(optim).items()
              if isinstance(v, type) and issubclass(v, (optim.Optimizer, optim.LRScheduler))
              and v not in (optim.Optimizer, optim.LRScheduler)}
    names |= {f"gradcheck.{n}" for n, v in vars(gradcheck_module_).items()
              if callable(v) and not isinstance(v, type) and not n.startswith("_")
              and getattr(v, "__module__", "") == gradcheck_module_.__name__}
    return names


def targets():
    """Distinct runs: aliases (``softmax`` is ``softmax_forward``) run once, under both names."""
    runs = {}
    for name in sorted(TABLE):
        if not name.startswith("nn.init."):
            runs.setdefault(TABLE[name].key, []).append(name)
    return {" = ".join(names): TABLE[names[0]] for names in runs.values()}


# ---------------------------------------------------------------------------- the child



def main():
    """Run every target's fuzz cases; print a summary; 0 when all passed."""
    only = {n for n in os.environ.get("NPATTN_FUZZ_ONLY", "").split(",") if n}
    failures = []
    start = time.perf_counter()
    for label, runner in targets().items():
        if only and not only & set(label.split(" = ")):
            continue
        print(f"fuzz: {label}", end="", flush=True)
        begin, calls = time.perf_counter(), sum(COUNTS.values())

        @hypothesis_seed(SEED)
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), print_blob=True)
        @given(data=st.data())
        def fuzz(data):
            CASES[label] += 1
            with np.errstate(all="ignore"):        # NaN/inf inputs: no RuntimeWarning noise
                runner(Case(data, label))

        try:
            fuzz()
        except Exception:                          # noqa: BLE001 -- report it, go on
            failures.append(label)
            print(f"\nFAILED {label}:\n{traceback.format_exc()}", flush=True)
        print(f": {sum(COUNTS.values()) - calls} calls, {time.perf_counter() - begin:.1f} s",
              flush=True)
    print(f"fuzz cases run: {sum(CASES.values())} ({sum(COUNTS.values())} calls) over "
          f"{len(CASES)} targets covering {len(TABLE)} public names, {EXAMPLES} examples per "
          f"target, seed {SEED}, {time.perf_counter() - start:.1f} s", flush=True)
    if failures:
        print(f"fuzz FAILED: {', '.join(failures)}", flush=True)
    return 1 if failures else 0


# ---------------------------------------------------------------------------- the tests

def test_fuzz_table_covers_every_public_name():
    """A new public function, module, optimiser or check must get a fuzz generator."""
    missing = public_names() - set(TABLE)
    stale = set(TABLE) - public_names()
    assert not missing, f"public names the fuzz table does not cover: {sorted(missing)}"
    assert not stale, f"fuzz table entries that are not public names: {sorted(stale)}"
    for name in FUNCTIONAL:
        assert TABLE[name].fn is getattr(npattn, name), name


def _fake_op(behaviour):
    def op(x, dim=-1):
        np.asarray(x)
        if behaviour == "index error":
            raise IndexError("index 7 is out of bounds")
        if behaviour == "anonymous error" or (behaviour == "reject" and not isinstance(
                dim, int)):
            raise ValueError("something went wrong")
        return np.asarray(x)
    return op


@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data())
def test_the_harness_can_fail(data):
    """The judge itself: an IndexError escapes, an error that names no argument fails, a wrong
    argument accepted fails, a valid call that raises fails."""
    case = Case(data, "fake")
    case.add("x", np.ones(3))
    case.add("dim", -1, [("'0'", "0", True)])
    with pytest.raises(IndexError):
        case.run(_fake_op("index error"), lambda r, a: None)
    with pytest.raises(AssertionError, match="valid call raised"):
        case.run(_fake_op("anonymous error"), lambda r, a: None)
    case.mutate(most=1)
    case.args["dim"], case.bad = "0", {"dim"}
    with pytest.raises(AssertionError, match="names none of the wrong arguments"):
        case.run(_fake_op("reject"), lambda r, a: None)
    with pytest.raises(AssertionError, match="accepted the wrong"):
        case.run(_fake_op("accept"), lambda r, a: None)


def test_fuzz_every_public_name_in_a_subprocess(capsys):
    """The fuzz cases, in a child process: a crash is a failure with the child's stderr."""
    env = {**os.environ, "NPATTN_FUZZ_EXAMPLES": str(EXAMPLES), "NPATTN_FUZZ_SEED": str(SEED),
           "PYTHONFAULTHANDLER": "1"}
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_fuzz; "
            f"sys.exit(test_fuzz.main())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=TESTS.parent, timeout=TIMEOUT)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("fuzz cases run")]
    with capsys.disabled():
        print("\n" + (summary[0] if summary else "fuzz: no summary line"))
    assert proc.returncode == 0, (f"fuzz child exited with {proc.returncode}\n--- stdout (tail)\n"
                                  f"{proc.stdout[-12000:]}\n--- stderr (tail)\n"
                                  f"{proc.stderr[-6000:]}")
    assert summary, proc.stdout[-2000:]
