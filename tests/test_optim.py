"""npattn.optim: SGD, Adam and AdamW step by step against the documented pseudocode and PyTorch.

The truth is a float64 transcription of the pseudocode in ``torch.optim``'s documentation,
written here as the docs write it (``m = β1·m + (1 - β1)·g``, not the lerp npattn evaluates).
Alongside each step it carries a first-order bound on the rounding of one step in the
parameter's dtype -- the magnitudes of the terms that made the update, with the usual extra
for a division (``|m|/s`` is off by ``|m|·δs/s²``) -- summed over the steps so far: that sum is
the ``scale`` of closeness' ``n·eps·scale`` rule, so float32 passes at a few ulps per term and
a wrong formula (an error of the size of the update) fails.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from closeness import assert_close, f64
from npattn.nn import Module, Parameter
from npattn.optim import SGD, Adam, AdamW
from strategies import dtypes, lay_out, layouts, make_values, shapes

OPTIMIZERS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
ROUNDINGS = 4                      # roundings per term of an update, for closeness' n


# ------------------------------------------------------------------ the documented pseudocode

def reference_sgd(theta, grad, state, options):
    """One step of torch.optim.SGD's pseudocode in float64.

    Returns the new θ, the new state and the rounding ``scale`` of this step.
    """
    lr, mu, tau = options["lr"], options["momentum"], options["dampening"]
    decay = options["weight_decay"]
    g = -grad if options["maximize"] else grad
    size = np.abs(grad)                                   # |terms| of g
    if decay != 0:
        g = g + decay * theta
        size = size + decay * np.abs(theta)
    new = {}
    direction = size
    if mu != 0:
        if state is None:                                 # t = 1
            b, b_size = g, size
        else:
            b = mu * state["b"] + (1 - tau) * g
            b_size = mu * (state["b_size"] + np.abs(state["b"])) + abs(1 - tau) * size
        new = {"b": b, "b_size": b_size}
        if options["nesterov"]:
            g = g + mu * b
            direction = size + mu * (np.abs(b) + b_size)
        else:
            g = b
            direction = b_size
    return theta - lr * g, new, np.abs(theta) + lr * direction


def reference_adam(theta, grad, state, options, decoupled):
    """One step of torch.optim.Adam's (``decoupled``: AdamW's) pseudocode in float64."""
    lr, eps, decay = options["lr"], options["eps"], options["weight_decay"]
    beta1, beta2 = options["betas"]
    zero = np.zeros_like(theta)
    s = state or dict(t=0, m=zero, v=zero, vmax=zero, m_size=zero, v_size=zero, vmax_size=zero)
    t = s["t"] + 1
    g = -grad if options["maximize"] else grad
    size = np.abs(grad)
    scale = np.abs(theta)
    if decay != 0:
        if decoupled:
            theta = theta - lr * decay * theta            # θ_t = θ_{t-1} - γλθ_{t-1}
        else:
            g = g + decay * theta
            size = size + decay * np.abs(theta)
    m = beta1 * s["m"] + (1 - beta1) * g
    v = beta2 * s["v"] + (1 - beta2) * g ** 2
    m_size = beta1 * s["m_size"] + np.abs(s["m"]) + size  # what m's rounding errors add up to
    v_size = beta2 * s["v_size"] + v + 2 * (1 - beta2) * np.abs(g) * size
    m_hat = m / (1 - beta1 ** t)
    vmax, vmax_size = s["vmax"], s["vmax_size"]
    if options["amsgrad"]:
        vmax = np.maximum(vmax, v)
        vmax_size = np.maximum(vmax_size, v_size)
        v_used, v_used_size = vmax, vmax_size
    else:
        v_used, v_used_size = v, v_size
    v_hat = v_used / (1 - beta2 ** t)
    denom = np.sqrt(v_hat) + eps                          # s = √v̂ + ε
    new_theta = theta - lr * m_hat / denom

    step_size = lr / (1 - beta1 ** t)
    with np.errstate(divide="ignore", invalid="ignore"):  # δs = δv / (2√v·√(1 - β2^t))
        denom_error = np.where(v_used > 0, v_used_size / (2 * np.sqrt(v_used * (1 - beta2 ** t))),
                               0.0) + denom
        scale = scale + step_size * (m_size / denom + np.abs(m) * denom_error / denom ** 2)
    scale = np.where(np.isfinite(scale), scale, np.inf)
    new = dict(t=t, m=m, v=v, vmax=vmax, m_size=m_size, v_size=v_size, vmax_size=vmax_size)
    return new_theta, new, scale


REFERENCES = {
    "SGD": reference_sgd,
    "Adam": lambda *args: reference_adam(*args, decoupled=False),
    "AdamW": lambda *args: reference_adam(*args, decoupled=True),
}


class Trajectory:
    """The float64 truth for one parameter: θ and its accumulated rounding scale, step by step."""

    def __init__(self, name, data, options):
        self.step_fn, self.options = REFERENCES[name], options
        self.theta = f64(data)[0]
        self.state, self.scale = None, np.zeros(self.theta.shape)

    def step(self, grad, **changes):
        options = dict(self.options, **changes)
        self.theta, self.state, local = self.step_fn(self.theta, f64(grad)[0], self.state, options)
        self.scale = self.scale + local
        return self.theta


# ------------------------------------------------------------------ strategies

def some(fixed, floats):
    return st.one_of(st.sampled_from(fixed), floats)


@st.composite
def sgd_options(draw):
    nesterov = draw(st.booleans())                        # needs momentum > 0, dampening 0
    momentum = draw(st.floats(0.01, 0.99) if nesterov else some([0.0, 0.9], st.floats(0.0, 0.99)))
    dampening = 0.0 if nesterov else draw(some([0.0, 0.5], st.floats(0.0, 1.0)))
    return dict(lr=draw(some([0.0, 1e-2, 0.1], st.floats(1e-4, 1.0))), momentum=momentum,
                dampening=dampening,
                weight_decay=draw(some([0.0, 1e-2], st.floats(0.0, 0.1))),
                nesterov=nesterov, maximize=draw(st.booleans()))


@st.composite
def adam_options(draw):
    betas = (draw(some([0.0, 0.9], st.floats(0.0, 0.99))),
             draw(some([0.0, 0.999], st.floats(0.0, 0.9999))))
    return dict(lr=draw(some([0.0, 1e-3, 1e-2], st.floats(1e-5, 0.1))), betas=betas,
                eps=draw(some([1e-8, 0.0], st.floats(1e-12, 0.1))),
                weight_decay=draw(some([0.0, 1e-2], st.floats(0.0, 0.1))),
                amsgrad=draw(st.booleans()), maximize=draw(st.booleans()))


@st.composite
def optim_cases(draw, names=tuple(OPTIMIZERS)):
    """(optimizer name, options, dtype, initial data per parameter, grads per step).

    Gradients change magnitude from step to step (which amsgrad's maximum notices) and come
    in any memory layout (read-only too: an optimiser must never write into ``grad``).
    """
    name = draw(st.sampled_from(names))
    options = draw(sgd_options() if name == "SGD" else adam_options())
    dtype = draw(dtypes)
    param_shapes = draw(st.lists(shapes(max_ndim=3, max_dim=4), min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = [make_values(rng, shape, dtype) for shape in param_shapes]
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        magnitude = 10.0 ** draw(st.integers(-2, 2))
        steps.append([lay_out(np.asarray(make_values(rng, shape, dtype) * magnitude, dtype),
                              draw(layouts), rng)
                      for shape in param_shapes])
    return name, options, dtype, data, steps


def state_arrays(optimizer, param):
    return [v for v in optimizer.state.get(param, {}).values() if isinstance(v, np.ndarray)]


# ------------------------------------------------------------------ against the pseudocode

@pytest.mark.parametrize("which", list(OPTIMIZERS))
@given(data=st.data())
def test_steps_match_documented_pseudocode(which, data):
    name, options, dtype, data, steps = data.draw(optim_cases((which,)), label="case")
    params = [Parameter(d) for d in data]
    optimizer = OPTIMIZERS[name](params, **options)
    truths = [Trajectory(name, d, options) for d in data]
    for grads in steps:
        for param, grad in zip(params, grads):
            param.grad = grad
        originals = [g.copy() for g in grads]
        optimizer.step()
        for param, grad, original, truth in zip(params, grads, originals, truths):
            want = truth.step(grad)
            assert_close(param.data, want, dtype=dtype, n=ROUNDINGS, scale=truth.scale)
            assert np.array_equal(grad, original)        # .grad is read, never written
            for array in state_arrays(optimizer, param):
                assert array.dtype == dtype and array.shape == param.data.shape


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@settings(max_examples=12, deadline=None)
@given(options=st.fixed_dictionaries(dict(
           lr=st.sampled_from([1e-3, 1e-2]), betas=st.sampled_from([(0.9, 0.999), (0.8, 0.99)]),
           eps=st.sampled_from([1e-8, 1e-6]), weight_decay=st.sampled_from([0.0, 1e-2]),
           amsgrad=st.booleans(), maximize=st.booleans())),
       dtype=dtypes, seed=st.integers(0, 2**32 - 1), strided=st.booleans())
def test_adam_on_large_and_strided_parameters(name, options, dtype, seed, strided):
    """Adam's fused update (kernels/adam.py) runs its parallel kernel on a parameter larger
    than one BLOCK, and its serial twin below: both against the pseudocode. A parameter whose
    data is a strided view (or whose state is) is updated in a copy and copied back.

    Well-conditioned options and gradients only: over 16,000 elements, adam_options' extremes
    (β2 = 0, gradients 10^±2 apart from step to step) find elements where g + λθ cancels after
    a step of 100·lr -- chaotic in any precision, and the NumPy implementation this kernel
    replaced gives the same float32 bits there. test_steps_match_documented_pseudocode draws
    those extremes on small parameters."""
    from npattn.kernels.adam import BLOCK
    rng = np.random.default_rng(seed)
    big = make_values(rng, (BLOCK // 64 + 3, 64), dtype)             # past one BLOCK
    small = make_values(rng, (3, 5), dtype)
    if strided:                                   # every other column of a wider array
        wide = np.zeros((big.shape[0], 128), dtype)
        wide[:, ::2] = big
        params = [Parameter(big), Parameter(small)]
        params[0].data = wide[:, ::2]
    else:
        params = [Parameter(big), Parameter(small)]
    optimizer = OPTIMIZERS[name](params, **options)
    truths = [Trajectory(name, p.data, options) for p in params]
    for _ in range(3):
        for p in params:
            p.grad = make_values(rng, p.shape, dtype)
        optimizer.step()
        for p, truth in zip(params, truths):
            assert_close(p.data, truth.step(p.grad), dtype=dtype, n=ROUNDINGS, scale=truth.scale)
    if strided:
        assert np.shares_memory(params[0].data, wide)            # still the caller's view


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_param_groups_take_their_own_options(name):
    rng = np.random.default_rng(1)
    a, b = Parameter(rng.standard_normal((2, 3))), Parameter(rng.standard_normal(4))
    base = dict(lr=0.05, momentum=0.9) if name == "SGD" else dict(lr=0.05)
    optimizer = OPTIMIZERS[name]([{"params": [a]}, {"params": [b], "lr": 0.2}], **base)
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.2]
    defaults = dict(OPTIMIZERS[name]([Parameter(np.zeros(1))], **base).param_groups[0])
    defaults.pop("params")
    truths = [Trajectory(name, a.data, defaults), Trajectory(name, b.data, dict(defaults, lr=0.2))]
    for _ in range(3):
        for p in (a, b):
            p.grad = rng.standard_normal(p.shape)
        optimizer.step()
        for p, truth in zip((a, b), truths):
            assert_close(p.data, truth.step(p.grad), dtype=np.float64, n=ROUNDINGS,
                         scale=truth.scale)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_schedule_changes_lr_through_param_groups(name):
    rng = np.random.default_rng(2)
    p = Parameter(rng.standard_normal(5).astype(np.float32))
    optimizer = OPTIMIZERS[name]([p], lr=0.1)
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    truth = Trajectory(name, p.data, options)
    for lr in (0.1, 0.05, 0.0, 0.3):
        optimizer.param_groups[0]["lr"] = lr
        p.grad = rng.standard_normal(5).astype(np.float32)
        before = p.data.copy()
        optimizer.step()
        assert_close(p.data, truth.step(p.grad, lr=lr), dtype=np.float32, n=ROUNDINGS,
                     scale=truth.scale)
        if lr == 0.0:
            assert np.array_equal(p.data, before)


# ------------------------------------------------------------------ against PyTorch

def torch_optimizer(torch, name, tensors, options):
    cls = getattr(torch.optim, name)
    return cls(tensors, foreach=False, **options)


@pytest.mark.parametrize("which", list(OPTIMIZERS))
@given(data=st.data())
def test_steps_match_torch(torch, which, data):
    name, options, dtype, data, steps = data.draw(optim_cases((which,)), label="case")
    params = [Parameter(d) for d in data]
    optimizer = OPTIMIZERS[name](params, **options)
    tensors = [torch.tensor(d.copy(), requires_grad=True) for d in data]
    theirs = torch_optimizer(torch, name, tensors, options)
    truths = [Trajectory(name, d, options) for d in data]
    for grads in steps:
        for param, tensor, grad in zip(params, tensors, grads):
            param.grad = grad
            tensor.grad = torch.tensor(np.array(grad, order="C"))
        optimizer.step()
        theirs.step()
        for param, tensor, grad, truth in zip(params, tensors, grads, truths):
            truth.step(grad)                                 # for the tolerance only
            want = tensor.detach().numpy()
            assert want.dtype == dtype
            assert_close(param.data, want, dtype=dtype, n=2 * ROUNDINGS, scale=truth.scale)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_param_groups_match_torch(torch, name):
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 2), (3,))]
    params = [Parameter(d) for d in data]
    tensors = [torch.tensor(d.copy(), requires_grad=True) for d in data]
    extra = {"momentum": 0.5} if name == "SGD" else {"weight_decay": 0.1}
    ours = OPTIMIZERS[name]([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.3}],
                            lr=0.01, **extra)
    theirs = getattr(torch.optim, name)([{"params": [tensors[0]]},
                                         {"params": [tensors[1]], "lr": 0.3}],
                                        lr=0.01, foreach=False, **extra)
    for _ in range(4):
        for p, t in zip(params, tensors):
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
            t.grad = torch.tensor(p.grad.copy())
        ours.step()
        theirs.step()
        for p, t in zip(params, tensors):
            assert_close(p.data, t.detach().numpy(), dtype=np.float32, n=8 * ROUNDINGS,
                         scale=np.abs(p.data) + 1.0)


def test_loads_torch_state_dict(torch):
    """PyTorch's state (converted to NumPy) continues in npattn exactly where PyTorch left it."""
    rng = np.random.default_rng(4)
    data = rng.standard_normal((4, 3))
    tensor = torch.tensor(data.copy(), requires_grad=True)
    theirs = torch.optim.Adam([tensor], lr=0.01, amsgrad=True, foreach=False)
    for _ in range(3):
        tensor.grad = torch.tensor(rng.standard_normal((4, 3)))
        theirs.step()
    saved = theirs.state_dict()
    converted = {"state": {k: {n: v.numpy() for n, v in s.items()}
                           for k, s in saved["state"].items()},
                 "param_groups": saved["param_groups"]}
    param = Parameter(tensor.detach().numpy())
    ours = Adam([param], lr=0.5)
    ours.load_state_dict(converted)
    assert ours.param_groups[0]["lr"] == 0.01 and ours.state[param]["step"] == 3.0
    for _ in range(2):
        grad = rng.standard_normal((4, 3))
        param.grad, tensor.grad = grad, torch.tensor(grad)
        ours.step()
        theirs.step()
        assert_close(param.data, tensor.detach().numpy(), dtype=np.float64, n=16,
                     scale=np.abs(param.data) + 0.01)


# ------------------------------------------------------------------ behaviour

def test_adam_minimises_a_quadratic():
    """f(θ) = ½ Σ a_i (θ_i - c_i)², badly scaled (a from 0.01 to 100): Adam gets there."""
    rng = np.random.default_rng(5)
    a = 10.0 ** rng.uniform(-2, 2, size=8)
    c = rng.standard_normal(8)
    for dtype in (np.float32, np.float64):
        theta = Parameter(np.zeros(8, dtype))
        optimizer = Adam([theta], lr=0.05)
        loss = lambda: 0.5 * np.sum(a * (theta.data - c) ** 2)   # noqa: E731
        start = loss()
        for _ in range(2000):
            optimizer.zero_grad()
            theta.grad += (a * (theta.data - c)).astype(dtype)
            optimizer.step()
        assert loss() < 1e-6 * start
        assert np.max(np.abs(theta.data - c)) < 1e-2


def test_sgd_with_momentum_minimises_a_quadratic():
    c = np.random.default_rng(6).standard_normal(5)
    theta = Parameter(np.zeros(5))
    optimizer = SGD([theta], lr=0.1, momentum=0.9, nesterov=True)
    for _ in range(300):
        optimizer.zero_grad()
        theta.grad += theta.data - c
        optimizer.step()
    assert np.max(np.abs(theta.data - c)) < 1e-6


def test_zero_grad_zeroes_in_place():
    class Two(Module):
        def __init__(self):
            super().__init__()
            self.w = Parameter(np.ones((2, 2), np.float32))
            self.b = Parameter(np.ones(2, np.float32))

    model = Two()
    grads = [p.grad for p in model.parameters()]
    for g in grads:
        g += 3
    optimizer = SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), grads))


def test_skips_a_parameter_without_grad_and_keeps_the_first_momentum_buffer():
    p, q = Parameter(np.ones(3)), Parameter(np.ones(3))
    p.grad, q.grad = np.array([1.0, 2.0, 3.0]), None
    optimizer = SGD([p, q], lr=0.1, momentum=0.9, dampening=0.5)
    optimizer.step()
    assert np.array_equal(q.data, np.ones(3)) and q not in optimizer.state
    # b_1 = g_1 (dampening does not apply to the first step): θ = 1 - 0.1·g
    assert np.array_equal(optimizer.state[p]["momentum_buffer"], [1.0, 2.0, 3.0])
    assert_close(p.data, 1 - 0.1 * np.array([1.0, 2.0, 3.0]), dtype=np.float64)


def test_amsgrad_keeps_the_running_maximum():
    p = Parameter(np.zeros(2))
    optimizer = Adam([p], amsgrad=True, betas=(0.0, 0.0))
    for g, want in (([3.0, 1.0], [9.0, 1.0]), ([1.0, 2.0], [9.0, 4.0]), ([0.5, 0.1], [9.0, 4.0])):
        p.grad = np.array(g)
        optimizer.step()
        assert np.array_equal(optimizer.state[p]["max_exp_avg_sq"], want)
        assert np.array_equal(optimizer.state[p]["exp_avg_sq"], np.square(g))
    # The maximum is of v, before bias correction: with β2 = 0.5 a shrinking gradient gives
    # max(v) = v_1 but max(v̂) = v̂_1 = v_1 / (1 - β2), a different step.
    options = dict(lr=0.1, betas=(0.9, 0.5), eps=1e-8, weight_decay=0.0, amsgrad=True,
                   maximize=False)
    p = Parameter(np.zeros(3))
    optimizer, truth = Adam([p], **options), Trajectory("Adam", p.data, options)
    for g in ([3.0, -1.0, 0.5], [0.1, -0.2, 0.5], [0.1, 0.1, 0.1]):
        p.grad = np.array(g)
        optimizer.step()
        assert_close(p.data, truth.step(p.grad), dtype=np.float64, n=ROUNDINGS,
                     scale=truth.scale)


def test_adamw_decays_weights_outside_the_adaptive_step():
    """Zero gradient: Adam's L2 term still moves θ by ~lr (normalised); AdamW by lr·λ·θ."""
    p, q = Parameter(np.full(2, 10.0)), Parameter(np.full(2, 10.0))
    p.grad, q.grad = np.zeros(2), np.zeros(2)
    AdamW([p], lr=0.1, weight_decay=0.01).step()
    Adam([q], lr=0.1, weight_decay=0.01).step()
    assert_close(p.data, np.full(2, 10.0 * (1 - 0.1 * 0.01)), dtype=np.float64)
    # g = λθ = 0.1 on the first step: m̂ = 0.1, √v̂ = 0.1, so θ moves by lr·0.1/(0.1 + ε)
    assert_close(q.data, np.full(2, 10.0 - 0.1 * 0.1 / (0.1 + 1e-8)), dtype=np.float64, n=8)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_continues_bitwise(name):
    rng = np.random.default_rng(7)
    extra = {"momentum": 0.9, "lr": 0.1} if name == "SGD" else {"amsgrad": True}
    data = rng.standard_normal((3, 4)).astype(np.float32)
    p1, p2 = Parameter(data), Parameter(data)
    first = OPTIMIZERS[name]([p1], **extra)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(5)]
    for g in grads[:2]:
        p1.grad = g
        first.step()
    saved = first.state_dict()
    p2.data[...] = p1.data
    second = OPTIMIZERS[name]([p2], **dict(extra, lr=123.0))
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"]
    for g in grads[2:]:
        p1.grad = p2.grad = g
        first.step()
        second.step()
        assert np.array_equal(p1.data, p2.data)
    for key, value in saved["state"][0].items():             # a copy, not the live state
        if isinstance(value, np.ndarray):
            assert not np.shares_memory(value, first.state[p1][key])


def test_load_state_dict_rejects_mismatches():
    p = Parameter(np.zeros(3))
    p.grad = np.ones(3)
    optimizer = Adam([p])
    optimizer.step()
    saved = optimizer.state_dict()
    with pytest.raises(ValueError, match="parameter groups"):
        Adam([{"params": [Parameter(np.zeros(3))]}, {"params": [Parameter(np.zeros(3))]}]
             ).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        Adam([Parameter(np.zeros(4))]).load_state_dict(saved)


# ------------------------------------------------------------------ bad arguments

def one():
    return [Parameter(np.zeros(2))]


@pytest.mark.parametrize("make, error, message", [
    (lambda: SGD(one(), lr=-0.1), ValueError, r"learning rate: lr must be >= 0.0; got -0.1"),
    (lambda: Adam(one(), lr=-1.0), ValueError, r"lr must be >= 0.0; got -1.0"),
    (lambda: AdamW(one(), lr=float("nan")), ValueError, r"lr must be >= 0.0; got nan"),
    (lambda: SGD(one(), lr="fast"), TypeError, r"lr must be a real number; got str"),
    (lambda: SGD(one(), lr=0.1, momentum=-0.5), ValueError, r"momentum must be >= 0.0"),
    (lambda: SGD(one(), lr=0.1, weight_decay=-1), ValueError, r"weight_decay must be >= 0.0"),
    (lambda: SGD(one(), lr=0.1, nesterov=True), ValueError, r"nesterov=True needs momentum > 0"),
    (lambda: SGD(one(), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
     r"dampening == 0; got momentum=0.9, dampening=0.1"),
    (lambda: Adam(one(), betas=(1.0, 0.999)), ValueError,
     r"index 0: betas\[0\] must be in \[0, 1\); got 1.0"),
    (lambda: Adam(one(), betas=(0.9, -0.1)), ValueError,
     r"index 1: betas\[1\] must be in \[0, 1\)"),
    (lambda: AdamW(one(), betas=(0.9, 1.5)), ValueError,
     r"betas\[1\] must be in \[0, 1\); got 1.5"),
    (lambda: Adam(one(), betas=0.9), TypeError, r"betas must be a pair"),
    (lambda: Adam(one(), eps=-1e-8), ValueError, r"epsilon value: eps must be >= 0.0"),
    (lambda: AdamW(one(), weight_decay=-0.01), ValueError, r"weight_decay must be >= 0.0"),
    (lambda: SGD([], lr=0.1), ValueError, r"empty parameter list"),
    (lambda: Adam(iter([])), ValueError, r"empty parameter list"),
    (lambda: SGD([np.zeros(2)], lr=0.1), TypeError, r"params\[0\] is ndarray"),
    (lambda: Adam(one() + [3.0]), TypeError, r"params\[1\] is float"),
    (lambda: Adam(Parameter(np.zeros(2))), TypeError, r"got a single Parameter"),
    (lambda: Adam(5), TypeError, r"iterable of Parameters"),
    (lambda: Adam({"params": one()}), TypeError, r"got a single dict"),
    (lambda: Adam([{"params": set(one())}]), TypeError, r"not a set"),
    (lambda: Adam([{"lr": 0.1}]), ValueError, r"'params' entry"),
    (lambda: Adam([{"params": one()}, {"params": one(), "lr": -2.0}]), ValueError,
     r"param_groups\[1\]: lr must be >= 0.0; got -2.0"),
    (lambda: Adam([{"params": one()}, {"params": one(), "betas": (0.9, 1.0)}]), ValueError,
     r"param_groups\[1\]: betas\[1\]"),
])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_parameter_twice_is_an_error():
    p = one()[0]
    with pytest.raises(ValueError, match="more than once"):
        SGD([p, p], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        SGD([{"params": [p]}, {"params": [p]}], lr=0.1)


def test_a_grad_of_the_wrong_shape_or_dtype_is_an_error():
    p = Parameter(np.zeros((2, 3), np.float32))
    optimizer = Adam([p])
    p.grad = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match=r"shape \(2, 3\); got \(6,\)"):
        optimizer.step()
    p.grad = np.zeros((2, 3))
    with pytest.raises(TypeError, match="dtype float32; got float64"):
        optimizer.step()
    assert not p.data.any()


def test_step_returns_the_closure_loss():
    p = Parameter(np.ones(1))
    assert SGD([p], lr=0.1).step(lambda: 4.5) == 4.5
    assert math.isclose(p.data[0], 1.0)                      # grad was zero
