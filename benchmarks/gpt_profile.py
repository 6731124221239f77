"""Where npattn's GPT spends its time: a per-op profile of one training step and of generation.

    python -m benchmarks.gpt_profile              # the baby config (4 layers, C 128, T 64, B 12)
    python -m benchmarks.gpt_profile --six        # the 6-layer one (6, 6, 384, T 256, B 8)
    python -m benchmarks.gpt_profile --quick      # 1 layer, C 32, T 16, B 2: seconds (a smoke run)
    python -m benchmarks.gpt_profile --torch      # and PyTorch's step, op group by op group

The model, batch and AdamW are ``benchmarks/bench_gpt.py``'s train-step case (dropout 0,
vocab 65), and the generation is its generate case (a prompt, then one token at a time through
the KV cache), sampled with temperature 1 instead of greedily.

**How it measures.** For the duration of the profile, every functional-layer entry point that
``npattn/models/gpt.py`` and ``npattn/nn/*`` call is replaced, in the module that calls it
(``npattn.nn.linear.linear_forward``, ``npattn.models.gpt.scaled_dot_product_attention_forward``
...: ``TARGETS``), by a wrapper that times the call with ``time.perf_counter``; ``AdamW.step``
and ``GPT._sample`` are wrapped on their classes. Everything is restored afterwards, also on an
error. Each wrapper keeps the time *exclusive* of any wrapped call inside it, so nothing is
counted twice. The step (``zero_grad``, forward, backward, ``AdamW.step``) is timed as a whole
too, and "Python and NumPy glue" is the step minus the wrapped ops: the modules' Python, the
residual adds, head splits and merges, ``zero_grad``, the checks of ``npattn/_checks.py`` that
run outside the ops. A wrapper's own cost (two ``perf_counter`` calls and a few list
operations) is measured on a no-op function and printed with the table; it falls partly inside
the op's row and partly in the glue. cProfile is not used: its hook on every Python call costs
more than many of the µs-long calls it would time.

Reported: one row per op group (``GROUPS``) with calls per step, ms per step and its share
of the step, and the mean time per call, so that per-call overhead shows: a 20 µs op called
40 times a step costs what one 0.8 ms GEMM does. Each figure is the mean over the quieter half
of ``--steps`` steps (those at or below the median step time; one warm-up step first loads
the kernels): on a shared 2-core machine a parallel kernel whose thread lost its core stalls
a step (a --quick step of ~2 ms took ~370 ms now and then on a 2-core AMD EPYC while another
process ran), and a median taken row by row would mix rows of different steps, which no
longer add up. Over whole steps they do: the glue row is each step's rest, and it is ≥ 0 when
nothing was counted twice. The unwrapped steps are measured too, alternating with the wrapped
ones: the difference is the profile's own cost.

**Against PyTorch** (``--torch``, when PyTorch is importable): the same training step of
bench_gpt's PyTorch peer (``torch_gpt``: the same weights, batch and AdamW), profiled by
``torch.profiler`` on the same number of threads, its ATen ops put in the same groups
(``TORCH_GROUPS``: ``aten::mm``/``addmm`` and the bias gradient's ``aten::sum`` are the
linear layer's GEMMs, ``_scaled_dot_product_flash_attention_for_cpu`` and its backward the
attention, and so on; everything under ``Optimizer.step#AdamW.step`` is AdamW). A third table
puts the two side by side, ms per step and PyTorch / npattn per group (> 1: npattn's op is
faster), which is the list of ops where npattn is behind PyTorch on the very shapes the GPT
runs. The profiler costs PyTorch more per op than the wrappers cost npattn (it records every
ATen call): its unprofiled steps, alternating with the profiled ones, are printed beside it,
and the glue row absorbs the difference.

The GPT calls no standalone softmax: attention's softmax is inside the fused SDPA kernels
(``attention fwd``/``bwd``; ``attention decode``: rows against a KV cache,
``scaled_dot_product_attention_with_kv_cache``), and sampling's is NumPy in ``GPT._sample`` (the
``sampling`` row). A generated token's pass through a block is one fused call, ``block_decode``
(functional/block.py: its layer norms, products, attention and GELU inside it), so generation
shows it as the ``decode block`` row; the prefill and each token's ln_f and lm_head run the
modules, in their own rows.
"""
import argparse
import importlib
import math
import statistics
import sys
import time

import numpy as np

#: Row order of the tables; "glue" is what no wrapper timed.
GROUPS = ("linear (GEMM)", "attention fwd", "attention bwd", "attention decode", "decode block",
          "layer_norm", "gelu",
          "cross_entropy", "embedding", "softmax", "dropout", "AdamW", "sampling (NumPy)")
GLUE = "Python and NumPy glue"

#: (module, attribute, group): the functional entry points the GPT's modules call, in the
#: module that calls them (``from ..functional.x import f`` binds f there, so that is where it
#: must be replaced). A rename in npattn makes the profile fail here, not silently miscount.
TARGETS = (
    ("npattn.nn.linear", "linear_forward", "linear (GEMM)"),
    ("npattn.nn.linear", "linear_backward", "linear (GEMM)"),
    ("npattn.models.gpt", "scaled_dot_product_attention_forward", "attention fwd"),
    ("npattn.models.gpt", "scaled_dot_product_attention_backward", "attention bwd"),
    ("npattn.models.gpt", "scaled_dot_product_attention_with_kv_cache", "attention decode"),
    ("npattn.models.gpt", "block_decode", "decode block"),
    ("npattn.nn.normalization", "layer_norm_forward", "layer_norm"),
    ("npattn.nn.normalization", "layer_norm_backward", "layer_norm"),
    ("npattn.models.gpt", "gelu_forward", "gelu"),
    ("npattn.models.gpt", "gelu_backward", "gelu"),
    ("npattn.models.gpt", "cross_entropy_forward", "cross_entropy"),
    ("npattn.models.gpt", "cross_entropy_backward", "cross_entropy"),
    ("npattn.nn.embedding", "embedding_forward", "embedding"),
    ("npattn.nn.embedding", "embedding_backward", "embedding"),
    ("npattn.nn.dropout", "dropout_forward", "dropout"),
    ("npattn.nn.dropout", "dropout_backward", "dropout"),
)
#: (module, class, method, group): methods wrapped on their class.
METHODS = (
    ("npattn.optim", "AdamW", "step", "AdamW"),
    ("npattn.models.gpt", "GPT", "_sample", "sampling (NumPy)"),
)

#: PyTorch's side (--torch): {ATen op: group} by the op's self time; everything inside the
#: optimizer's step is AdamW. The bias gradient is an aten::sum under AddmmBackward0, as npattn's
#: linear_backward sums it (during its weight gradient's product: gemm's row_sums); other
#: aten::sum calls are few and small.
TORCH_GROUPS = {
    "aten::mm": "linear (GEMM)", "aten::addmm": "linear (GEMM)", "aten::sum": "linear (GEMM)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention fwd",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention bwd",
    "aten::native_layer_norm": "layer_norm", "aten::native_layer_norm_backward": "layer_norm",
    "aten::gelu": "gelu", "aten::gelu_backward": "gelu",
    "aten::_log_softmax": "cross_entropy", "aten::_log_softmax_backward_data": "cross_entropy",
    "aten::nll_loss_forward": "cross_entropy", "aten::nll_loss_backward": "cross_entropy",
    "aten::embedding_dense_backward": "embedding", "aten::index_select": "embedding",
    "aten::native_dropout": "dropout", "aten::native_dropout_backward": "dropout",
}
TORCH_OPTIMIZER = "Optimizer.step#AdamW.step"


class Recorder:
    """Exclusive time and calls per group since the last ``reset``.

    ``stack`` holds, for each wrapped call in progress, the time its wrapped callees took, so
    that an outer wrapper subtracts them (exclusive time) and nothing is counted twice."""

    def __init__(self):
        self.stack = []
        self.reset()

    def reset(self):
        self.seconds = dict.fromkeys(GROUPS, 0.0)
        self.calls = dict.fromkeys(GROUPS, 0)

    def wrap(self, fn, group):
        stack, clock = self.stack, time.perf_counter

        def timed(*args, **kwargs):
            stack.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - start
                inner = stack.pop()
                self.seconds[group] += took - inner
                self.calls[group] += 1
                if stack:
                    stack[-1] += took                   # the caller's wrapped callee time
        timed.__wrapped__ = fn
        return timed


class patched:
    """``with patched(recorder):`` every TARGETS and METHODS entry wrapped, restored on exit."""

    def __init__(self, recorder, targets=TARGETS, methods=METHODS):
        self.recorder, self.targets, self.methods = recorder, targets, methods
        self.saved = []

    def __enter__(self):
        try:
            for module, name, group in self.targets:
                owner = importlib.import_module(module)
                self._replace(owner, name, self.recorder.wrap(getattr(owner, name), group))
            for module, cls, name, group in self.methods:
                owner = getattr(importlib.import_module(module), cls)
                fn = getattr(owner, name)            # a staticmethod comes back as a function
                wrapped = self.recorder.wrap(fn, group)
                if isinstance(owner.__dict__.get(name), staticmethod):
                    wrapped = staticmethod(wrapped)
                self._replace(owner, name, wrapped)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _replace(self, owner, name, value):
        # (owner, name, what owner's own __dict__ held, or a marker: inherited from a base)
        self.saved.append((owner, name, owner.__dict__.get(name, patched)))
        setattr(owner, name, value)

    def __exit__(self, *exc):
        while self.saved:                           # last patched first: nested wraps unwind
            owner, name, value = self.saved.pop()
            if value is patched:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        return False


def wrapper_cost(recorder, calls=20000):
    """Seconds a wrapper adds to one call: a wrapped no-op minus the bare no-op (median of 5)."""
    def noop():
        return None
    timed = recorder.wrap(noop, GROUPS[0])
    costs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            noop()
        bare = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(calls):
            timed()
        costs.append((time.perf_counter() - start - bare) / calls)
    recorder.reset()
    return statistics.median(costs)


class Profile:
    """The per-step record of one workload: ``totals`` (s), ``seconds[group]`` and
    ``calls[group]`` lists (one entry per step), and the unwrapped steps' ``plain`` (s)."""

    def __init__(self, name, unit):
        self.name, self.unit = name, unit
        self.totals, self.plain = [], []
        self.seconds = {g: [] for g in GROUPS}
        self.calls = {g: [] for g in GROUPS}

    def add(self, total, recorder):
        self.totals.append(total)
        for g in GROUPS:
            self.seconds[g].append(recorder.seconds[g])
            self.calls[g].append(recorder.calls[g])

    def quiet(self):
        """The steps at or below the median step time: the quieter half of the run. On a
        shared machine a step that lost its CPU for a while is dropped whole, not just the op
        that was running, so the rows of the remaining steps still add up to their step."""
        median = statistics.median(self.totals)
        return [i for i, t in enumerate(self.totals) if t <= median]

    def rows(self):
        """[(group, calls per step, ms per step, % of the step, mean µs per call)] for the
        groups that were called, then the glue (calls None), each the mean over the quiet
        steps; and that mean step in ms. The rows add up to the step (the glue is its rest)."""
        keep = self.quiet()

        def mean(values):
            return sum(values[i] for i in keep) / len(keep)
        step = mean(self.totals) * 1e3
        rows = []
        for g in GROUPS:
            calls = mean(self.calls[g])
            if calls:
                ms = mean(self.seconds[g]) * 1e3
                rows.append((g, calls, ms, 100 * ms / step, ms / calls * 1e3))
        glue = step - sum(mean(self.seconds[g]) * 1e3 for g in GROUPS)
        rows.append((GLUE, None, glue, 100 * glue / step, None))
        return rows, step

    def table(self, cost):
        rows, step = self.rows()
        calls = sum(c for _, c, *_ in rows if c)
        plain = statistics.mean(sorted(self.plain)[:len(self.quiet())]) * 1e3
        out = [f"**{self.name}**: {step:.2f} ms per {self.unit}, the mean of the quieter "
               f"{len(self.quiet())} of {len(self.totals)} {self.unit}s ({plain:.2f} ms without "
               f"the wrappers, likewise); {calls:g} wrapped calls per {self.unit}, "
               f"{cost * 1e6:.2f} µs of wrapper each ({calls * cost * 1e3:.3f} ms)", "",
               f"| op | calls per {self.unit} | ms per {self.unit} | % of {self.unit} | "
               f"µs per call |", "|---|---:|---:|---:|---:|"]
        for group, n, ms, share, per_call in rows:
            out.append(f"| {group} | {'' if n is None else f'{n:g}'} | {ms:.3f} | "
                       f"{share:.1f} | {'' if per_call is None else f'{per_call:.1f}'} |")
        out.append(f"| sum of the rows | {calls:g} | {sum(r[2] for r in rows):.3f} | "
                   f"{sum(r[3] for r in rows):.1f} | |")
        out.append(f"| {self.unit} (measured) | | {step:.3f} | 100.0 | |")
        return "\n".join(out)


def _measure(profile, recorder, run, steps, also=None):
    """run() once to warm up, then ``steps`` times wrapped (``profile.add``) and ``steps``
    times bare (``profile.plain``), alternating, so that drift hits both alike. ``also``: a
    function called once after each pair (another workload measured in the same rounds)."""
    with patched(recorder):
        run()                                       # warm-up: kernels load (or compile)
    for _ in range(steps):
        with patched(recorder):
            recorder.reset()
            start = time.perf_counter()
            run()
            profile.add(time.perf_counter() - start, recorder)
        start = time.perf_counter()
        run()
        profile.plain.append(time.perf_counter() - start)
        if also is not None:
            also()


def train_workload(sizes):
    """bench_gpt's train-step case at ``sizes`` = (n_layer, n_head, n_embd, block_size,
    batch): one step (zero_grad, forward, backward, AdamW.step) as a function of nothing."""
    from npattn import optim
    from npattn.models import GPT

    from .bench_gpt import BETAS, LR, VOCAB, config, decay_groups
    n_layer, n_head, n_embd, block_size, batch = sizes
    model = GPT(config(n_layer, n_head, n_embd, block_size), rng=0, seed=0)
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, (batch, block_size))                    # (B, T)
    y = rng.integers(0, VOCAB, (batch, block_size))
    params = list(model.parameters())
    opt = optim.AdamW(decay_groups([p for p in params if p.data.ndim >= 2],
                                   [p for p in params if p.data.ndim < 2]), lr=LR, betas=BETAS)

    def step():
        model.zero_grad()
        model(x, y)
        model.backward()
        opt.step()
    return step


def generate_workload(sizes):
    """bench_gpt's generate case at ``sizes`` = (n_layer, n_head, n_embd, block_size, prompt,
    new), sampled (temperature 1, seed 0): one generation as a function of nothing."""
    from npattn.models import GPT

    from .bench_gpt import VOCAB, config
    n_layer, n_head, n_embd, block_size, prompt, new = sizes
    model = GPT(config(n_layer, n_head, n_embd, block_size), rng=0)
    idx = np.random.default_rng(2).integers(0, VOCAB, (1, prompt))    # (1, prompt)
    return lambda: model.generate(idx, new, seed=0)


def profile_train(sizes, steps, recorder=None, also=None):
    """Profile of ``steps`` training steps of bench_gpt's train-step case at ``sizes`` =
    (n_layer, n_head, n_embd, block_size, batch); ``also`` as for _measure."""
    n_layer, n_head, n_embd, block_size, batch = sizes
    profile = Profile(f"train step L{n_layer} H{n_head} C{n_embd} T{block_size} B{batch}",
                      "step")
    _measure(profile, recorder or Recorder(), train_workload(sizes), steps, also)
    return profile


def profile_generate(sizes, steps, recorder=None):
    """Profile of ``steps`` generations of bench_gpt's generate case at ``sizes`` =
    (n_layer, n_head, n_embd, block_size, prompt, new), sampled (temperature 1, seed 0)."""
    n_layer, n_head, n_embd, block_size, prompt, new = sizes
    profile = Profile(f"generate L{n_layer} H{n_head} C{n_embd} T{block_size} "
                      f"{prompt}→+{new} tokens", "generation")
    _measure(profile, recorder or Recorder(), generate_workload(sizes), steps)
    return profile


def torch_groups(events):
    """{group: self CPU seconds} of a torch.profiler run's events (TORCH_GROUPS; AdamW: every
    event inside the optimizer's step). Events of no group are left out: the glue."""
    seconds = dict.fromkeys(GROUPS, 0.0)
    for event in events:
        parent, in_step = event, False
        while parent is not None and not in_step:
            in_step = parent.name == TORCH_OPTIMIZER
            parent = parent.cpu_parent
        group = "AdamW" if in_step else TORCH_GROUPS.get(event.name)
        if group is not None:
            seconds[group] += event.self_cpu_time_total * 1e-6
    return seconds


def torch_train(sizes):
    """bench_gpt's PyTorch peer of the training step at ``sizes``, warmed up: (its Profile,
    a function that adds one step profiled by torch.profiler -- the groups' seconds -- and one
    unprofiled step to it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from npattn.models import GPT

    from .bench_gpt import VOCAB, config, torch_peer, torch_train_step
    n_layer, n_head, n_embd, block_size, batch = sizes
    cfg = config(n_layer, n_head, n_embd, block_size)
    peer = torch_peer(torch, cfg, GPT(cfg, rng=0, seed=0).state_dict())
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.integers(0, VOCAB, (batch, block_size)))
    y = torch.from_numpy(rng.integers(0, VOCAB, (batch, block_size)))
    step = torch_train_step(torch, peer, x, y)[0]
    result = Profile(f"PyTorch {torch.__version__} train step L{n_layer} H{n_head} "
                     f"C{n_embd} T{block_size} B{batch}", "step")
    step()                                          # warm-up

    def one_round():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            step()
            took = time.perf_counter() - start
        seconds = torch_groups(prof.events())
        result.totals.append(took)
        for g in GROUPS:
            result.seconds[g].append(seconds[g])
            result.calls[g].append(0)
        start = time.perf_counter()
        step()
        result.plain.append(time.perf_counter() - start)
    return result, one_round


def side_by_side(ours, theirs):
    """The npattn and PyTorch training-step profiles as one table: ms per step each (means
    over each one's quieter half) and PyTorch / npattn per group."""
    keep = {id(p): p.quiet() for p in (ours, theirs)}

    def ms(profile, values):
        rows = keep[id(profile)]
        return sum(values[i] for i in rows) / len(rows) * 1e3
    out = [f"**{ours.name} against {theirs.name}**: ms per step, each the mean of its quieter "
           f"half of the steps; PyTorch's ATen ops timed by torch.profiler (its unprofiled "
           f"step: {statistics.mean(sorted(theirs.plain)[:len(keep[id(theirs)])]) * 1e3:.2f} "
           f"ms), npattn's by the wrappers", "",
           "| op | npattn ms | PyTorch ms | PyTorch / npattn |", "|---|---:|---:|---:|"]
    totals = [ms(p, p.totals) for p in (ours, theirs)]
    rest = list(totals)
    for g in GROUPS:
        a, b = ms(ours, ours.seconds[g]), ms(theirs, theirs.seconds[g])
        rest = [rest[0] - a, rest[1] - b]
        if a or b:
            ratio = f"{b / a:.2f}×" if a and b else "—"     # (an op one side does not run)
            out.append(f"| {g} | {a:.3f} | {b:.3f} | {ratio} |")
    out.append(f"| {GLUE} (the rest) | {rest[0]:.3f} | {rest[1]:.3f} | "
               f"{rest[1] / rest[0] if rest[0] > 0 else math.inf:.2f}× |")
    out.append(f"| step | {totals[0]:.3f} | {totals[1]:.3f} | {totals[1] / totals[0]:.2f}× |")
    return "\n".join(out)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt_profile",
                                     description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--six", action="store_true",
                      help="the 6-layer config (n_layer 6, n_head 6, n_embd 384, block 256, "
                           "batch 8) instead of the baby one")
    size.add_argument("--quick", action="store_true",
                      help="1 layer, n_embd 32, block 16, batch 2, 5 steps: a smoke run")
    parser.add_argument("--torch", action="store_true",
                        help="also profile PyTorch's training step (the same model, batch and "
                             "AdamW, torch.profiler) and print the two side by side")
    parser.add_argument("--steps", type=int, default=None,
                        help="profiled steps (and generations) after the warm-up "
                             "(default 11; 5 with --quick)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"argument --steps: must be at least 1; got {args.steps}")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import numba

    from .bench_gpt import BABY, GEN_BABY, GEN_QUICK, GEN_SIX, SIX, TRAIN_QUICK
    from .machine import cpu_model, git_commit
    train, gen = ((TRAIN_QUICK, GEN_QUICK) if args.quick else (SIX, GEN_SIX) if args.six
                  else (BABY, GEN_BABY))
    steps = args.steps or (5 if args.quick else 11)
    peer = one_round = None
    if args.torch:          # before npattn's first launch: PyTorch's OpenMP pool, started
        import torch        # after Numba's, ran its step ~30× slower here (2 CPUs, Zen 4)
        torch.set_num_threads(numba.get_num_threads())
        peer, one_round = torch_train(train)
    recorder = Recorder()
    cost = wrapper_cost(recorder)
    profiles = [profile_train(train, steps, recorder, also=one_round),   # rounds interleaved
                profile_generate(gen, steps, recorder)]
    print(f"npattn GPT per-op profile, float32, {steps} steps after a warm-up\n"
          f"{cpu_model()}; {numba.get_num_threads()} threads; Numba {numba.__version__}; "
          f"commit {git_commit()}\ncommand: python -m benchmarks.gpt_profile {' '.join(argv)}")
    for profile in profiles:
        print("\n" + profile.table(cost))
    if peer is not None:
        print("\n" + side_by_side(profiles[0], peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
