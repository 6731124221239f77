"""npattn.optim's learning-rate schedules against torch.optim.lr_scheduler (the same floats,
bit for bit: the formulas are PyTorch's, evaluated in the same order) and against a float64
transcription of the closed forms that runs without PyTorch (the recursive forms drift from
them by rounding only: ~1e-12 over hundreds of steps)."""
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npattn import nn, optim

LR = 6e-4


def make_optimizer(lrs=(LR,), kind="AdamW"):
    """An optimiser with one parameter group per lr (its parameter has a zero grad)."""
    groups = [{"params": [nn.Parameter(np.zeros(2))], "lr": lr} for lr in lrs]
    return getattr(optim, kind)(groups, lr=lrs[0])


def make_torch_optimizer(torch, lrs=(LR,), kind="AdamW"):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return getattr(torch.optim, kind)(groups, lr=lrs[0])


def run(opt, scheduler, steps):
    """The lrs of steps 0..steps-1: read, then optimizer.step(), then scheduler.step()."""
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr())
        assert seen[-1] == [g["lr"] for g in opt.param_groups]
        opt.step()
        scheduler.step()
    return seen


def build(lib, opt, kind, kw):
    """One of the schedules, from npattn.optim or torch.optim.lr_scheduler (``lib``)."""
    if kind == "warmup+cosine":
        warmup, total, eta_min = kw["warmup"], kw["total"], kw["eta_min"]
        return lib.SequentialLR(opt, [
            lib.LinearLR(opt, start_factor=kw["start_factor"], total_iters=warmup),
            lib.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=eta_min)],
            milestones=[warmup])
    if kind == "linear":
        return lib.LinearLR(opt, start_factor=kw["start_factor"], end_factor=kw["end_factor"],
                            total_iters=kw["warmup"])
    if kind == "cosine":
        return lib.CosineAnnealingLR(opt, T_max=kw["total"], eta_min=kw["eta_min"])
    return lib.LambdaLR(opt, [lambda t, i=i: (1 + i) * 0.97 ** t + 1 / (1 + t)
                              for i in range(len(opt.param_groups))])


schedules = st.fixed_dictionaries(dict(
    kind=st.sampled_from(["warmup+cosine", "linear", "cosine", "lambda"]),
    warmup=st.integers(0, 30), total=st.integers(31, 200),
    start_factor=st.sampled_from([1e-3, 0.1, 1 / 3, 1.0]),
    end_factor=st.sampled_from([0.0, 0.5, 1.0]),
    eta_min=st.sampled_from([0.0, 6e-5, LR]),
    lrs=st.lists(st.sampled_from([LR, 1e-2, 3e-4, 0.0]), min_size=1, max_size=3)))


@given(kw=schedules)
def test_matches_torch_bit_for_bit(torch, kw):
    """Every lr of 2.5 cycles equals PyTorch's exactly, and so do param_groups' initial_lr and
    the state_dict entries the two share."""
    if kw["kind"] == "warmup+cosine" and kw["warmup"] == 0:
        kw = dict(kw, warmup=1)
    steps = int(2.5 * kw["total"])
    ours, theirs = make_optimizer(kw["lrs"]), make_torch_optimizer(torch, kw["lrs"])
    a = build(optim, ours, kw["kind"], kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # SequentialLR's deprecated step(0) inside
        b = build(torch.optim.lr_scheduler, theirs, kw["kind"], kw)
        want = run(theirs, b, steps)
    assert run(ours, a, steps) == want
    assert [g["initial_lr"] for g in ours.param_groups] == \
        [g["initial_lr"] for g in theirs.param_groups]
    mine, torchs = a.state_dict(), b.state_dict()
    for key in set(mine) & set(torchs) - {"_schedulers", "lr_lambdas"}:
        assert mine[key] == torchs[key], key


def closed_form_warmup_cosine(step, base, start_factor, warmup, total, eta_min):
    """What the schedule means, in float64: linear from base·start_factor to base over
    ``warmup`` steps, then half a cosine from base to eta_min over the rest, then (PyTorch's
    CosineAnnealingLR has no restarts) back up."""
    if step < warmup:
        return base * (start_factor + (1 - start_factor) * step / warmup)
    t = step - warmup
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / (total - warmup))) / 2


@pytest.mark.parametrize("warmup, total, start_factor, eta_min", [
    (10, 300, 1e-3, 6e-5), (1, 50, 0.5, 0.0), (100, 700, 0.01, 6e-5), (25, 26, 1 / 3, 1e-4)])
def test_warmup_then_cosine_is_the_closed_form(warmup, total, start_factor, eta_min):
    """No PyTorch needed: the recursive lrs stay within 1e-12 (relative to the base lr) of the
    closed form over two cycles, reach eta_min at ``total`` and the base lr at ``warmup``."""
    opt = make_optimizer()
    sched = build(optim, opt, "warmup+cosine", dict(warmup=warmup, total=total,
                                                   start_factor=start_factor, eta_min=eta_min))
    seen = run(opt, sched, 2 * total)
    want = [closed_form_warmup_cosine(t, LR, start_factor, warmup, total, eta_min)
            for t in range(2 * total)]
    np.testing.assert_allclose([s[0] for s in seen], want, rtol=0, atol=1e-12 * LR)
    assert seen[warmup][0] == LR                     # the milestone: the closed form's step 0
    assert abs(seen[total][0] - eta_min) <= 1e-12 * LR
    assert seen[0][0] == LR * start_factor


def test_cosine_alone_and_its_recursion():
    """CosineAnnealingLR's recursive update, written out: lr_t = η + (lr_{t-1} − η)·(1 +
    cos(πt/T))/(1 + cos(π(t−1)/T)), and at t − 1 − T ≡ 0 (mod 2T) the additive step."""
    T, eta = 7, 1e-5
    opt = make_optimizer([0.1, 0.02])
    sched = optim.CosineAnnealingLR(opt, T_max=T, eta_min=eta)
    seen = run(opt, sched, 40)
    for g, base in enumerate([0.1, 0.02]):
        lr = base
        for t in range(1, 40):
            if (t - 1 - T) % (2 * T) == 0:
                lr = lr + (base - eta) * (1 - math.cos(math.pi / T)) / 2
            else:
                lr = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (
                    lr - eta) + eta
            assert seen[t][g] == lr
            assert abs(lr - (eta + (base - eta) * (1 + math.cos(math.pi * t / T)) / 2)) < 1e-15


def test_linear_and_lambda_are_their_formulas():
    opt = make_optimizer([1.0])
    seen = run(opt, optim.LinearLR(opt, start_factor=0.25, end_factor=0.75, total_iters=4), 8)
    np.testing.assert_allclose([s[0] for s in seen], [0.25, 0.375, 0.5, 0.625, 0.75, 0.75, 0.75,
                                                      0.75], rtol=1e-15)
    opt = make_optimizer([2.0, 4.0])
    sched = optim.LambdaLR(opt, [lambda t: 0.5 ** t, lambda t: 1.0 / (t + 1)])
    seen = run(opt, sched, 5)
    assert seen == [[2.0 * 0.5 ** t, 4.0 / (t + 1)] for t in range(5)]


def test_initial_lr_is_set_once_and_resuming_needs_it():
    opt = make_optimizer([0.1, 0.2])
    sched = optim.LinearLR(opt, start_factor=0.5, total_iters=3)
    assert [g["initial_lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert sched.base_lrs == [0.1, 0.2] and sched.last_epoch == 0
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.1]
    second = optim.CosineAnnealingLR(opt, T_max=5)    # initial_lr is kept, not the current lr
    assert second.base_lrs == [0.1, 0.2]
    fresh = make_optimizer()
    with pytest.raises(ValueError, match=r"last_epoch = 3 resumes a schedule, which needs each "
                                         r"group's 'initial_lr'.*param_groups\[0\]"):
        optim.CosineAnnealingLR(fresh, T_max=5, last_epoch=3)


@pytest.mark.parametrize("kind", ["warmup+cosine", "linear", "cosine", "lambda"])
def test_state_dict_round_trip_resumes_the_same_schedule(kind):
    """Stop half-way, save the optimiser's and the scheduler's state, build both afresh, load,
    go on: the same lrs as the run that never stopped."""
    kw = dict(warmup=5, total=40, start_factor=0.1, end_factor=1.0, eta_min=1e-5)
    opt = make_optimizer([LR, 1e-2])
    sched = build(optim, opt, kind, kw)
    whole = run(opt, sched, 80)
    opt = make_optimizer([LR, 1e-2])
    sched = build(optim, opt, kind, kw)
    first = run(opt, sched, 33)
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt2 = make_optimizer([LR, 1e-2])
    sched2 = build(optim, opt2, kind, kw)              # (PyTorch's order: scheduler, then load)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert first + run(opt2, sched2, 47) == whole
    assert sched.state_dict() == saved_sched or kind == "lambda"


def test_torch_state_dict_loads(torch):
    """A PyTorch SequentialLR's state_dict (plain Python values) loads into ours and resumes
    with PyTorch's numbers."""
    import copy
    kw = dict(warmup=4, total=30, start_factor=0.2, eta_min=1e-5)
    theirs = make_torch_optimizer(torch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = build(torch.optim.lr_scheduler, theirs, "warmup+cosine", kw)
        run(theirs, b, 11)
        saved = copy.deepcopy(b.state_dict())
        want = run(theirs, b, 30)
    ours = make_optimizer()
    a = build(optim, ours, "warmup+cosine", kw)
    a.load_state_dict(saved)
    for group in ours.param_groups:
        group["lr"] = a.get_last_lr()[0]               # (the optimiser's state carries lr)
    assert run(ours, a, 30) == want


def test_step_with_an_epoch_uses_the_closed_form_and_warns():
    opt = make_optimizer([1.0])
    sched = optim.CosineAnnealingLR(opt, T_max=10)
    with pytest.warns(UserWarning, match="epoch parameter"):
        sched.step(5)
    assert sched.get_last_lr() == [0.5 * (1 + math.cos(math.pi / 2))]
    assert sched.last_epoch == 5


def test_a_lambda_is_saved_as_none_a_callable_object_as_its_dict():
    class Factor:
        def __init__(self):
            self.scale = 2.0

        def __call__(self, t):
            return self.scale

    opt = make_optimizer([1.0, 1.0])
    obj = Factor()
    sched = optim.LambdaLR(opt, [lambda t: 1.0, obj])
    state = sched.state_dict()
    assert state["lr_lambdas"] == [None, {"scale": 2.0}]
    obj.scale = 5.0
    sched.load_state_dict(state)
    assert obj.scale == 2.0 and sched.state_dict()["lr_lambdas"] == [None, {"scale": 2.0}]


@pytest.mark.parametrize("make, error, words", [
    (lambda o: optim.LinearLR("opt"), TypeError, ["optimizer", "str"]),
    (lambda o: optim.LinearLR(o, start_factor=0.0), ValueError, ["start_factor", "(0.0, 1.0]",
                                                                 "0.0"]),
    (lambda o: optim.LinearLR(o, start_factor=1.5), ValueError, ["start_factor", "1.5"]),
    (lambda o: optim.LinearLR(o, end_factor=-0.1), ValueError, ["end_factor", "[0.0, 1.0]"]),
    (lambda o: optim.LinearLR(o, end_factor=math.nan), ValueError, ["end_factor", "nan"]),
    (lambda o: optim.LinearLR(o, total_iters=-1), ValueError, ["total_iters", ">= 0", "-1"]),
    (lambda o: optim.LinearLR(o, total_iters=2.0), TypeError, ["total_iters", "float"]),
    (lambda o: optim.LinearLR(o, last_epoch=-2), ValueError, ["last_epoch", ">= -1", "-2"]),
    (lambda o: optim.CosineAnnealingLR(o, T_max=0), ValueError, ["T_max", ">= 1", "0"]),
    (lambda o: optim.CosineAnnealingLR(o, T_max=None), TypeError, ["T_max", "NoneType"]),
    (lambda o: optim.CosineAnnealingLR(o, 5, eta_min=-1e-5), ValueError, ["eta_min", ">= 0"]),
    (lambda o: optim.CosineAnnealingLR(o, 5, eta_min="0"), TypeError, ["eta_min", "str"]),
    (lambda o: optim.LambdaLR(o, 0.5), TypeError, ["lr_lambda", "function", "float"]),
    (lambda o: optim.LambdaLR(o, [lambda t: 1.0] * 2), ValueError, ["lr_lambda", "1", "2"]),
    (lambda o: optim.LambdaLR(o, lambda t: "x"), TypeError, ["lr_lambda(0)", "str"]),
    (lambda o: optim.SequentialLR(o, [], []), ValueError, ["schedulers", "non-empty"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o)], [3]), ValueError,
     ["milestones", "0", "got 1"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o), 3], [3]), TypeError,
     ["schedulers[1]", "int"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o), optim.LinearLR(make_optimizer())],
                                  [3]), ValueError, ["schedulers[1]", "this optimizer"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o)] * 3, [5, 2]), ValueError,
     ["milestones", "non-decreasing", "[5, 2]"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o)] * 2, [1.5]), TypeError,
     ["milestones[0]", "float"]),
    (lambda o: optim.SequentialLR(o, [optim.LinearLR(o)] * 2, 3), TypeError,
     ["milestones", "int"]),
])
def test_bad_arguments_name_themselves(make, error, words):
    with pytest.raises(error) as info:
        make(make_optimizer())
    for word in words:
        assert word in str(info.value)
