"""Optimisers: SGD (with momentum and Nesterov), Adam and AdamW, as ``torch.optim`` computes them.

Each ``step()`` reads every parameter's accumulated ``grad`` and updates its ``data`` in place,
following the pseudocode of PyTorch's documentation for that class -- copied into each
docstring below -- in the order PyTorch's (single-tensor) implementation evaluates it, so a
run agrees with ``torch.optim`` to a few ulps of the parameter's dtype (PyTorch fuses some
multiply-adds, and so does npattn's Adam kernel; SGD's NumPy rounds each operation). The usage
is PyTorch's::

    opt = Adam(model.parameters(), lr=1e-3)
    for x, target in batches:
        opt.zero_grad()                      # grads accumulate: clear them first
        loss_and_backward(model, x, target)  # fills every parameter.grad
        opt.step()

``params`` is an iterable of :class:`npattn.nn.Parameter` or a list of dicts
``{"params": [...], "lr": ...}`` -- *parameter groups*, each with its own options (those it does
not give come from the constructor). ``optimizer.param_groups`` is that list of dicts, so a
learning-rate schedule is ``for g in opt.param_groups: g["lr"] = new_lr``.

Dtypes: the update runs in each parameter's dtype, and the optimiser's state (momentum buffer,
moments) is kept in that dtype too, as in PyTorch. Hyperparameters are Python floats and are
rounded to the parameter's dtype where they multiply an array (NumPy's rule for Python scalars,
and PyTorch's). SGD's update is whole-array NumPy per parameter; Adam's and AdamW's, a dozen
NumPy operations each with its temporary, run as one fused pass per parameter
(``kernels/adam.py``; measured on a 2-CPU Zen 4, one AdamW step: 2.26 -> 1.25 ms for the baby
GPT's 0.81 M parameters, 28.8 -> 6.9 ms for the 6-layer one's 10.8 M).

``state_dict()`` / ``load_state_dict()`` use PyTorch's layout and key names (``"state"`` keyed by
the parameter's position across groups, holding ``"momentum_buffer"`` or ``"step"``,
``"exp_avg"``, ``"exp_avg_sq"``, ``"max_exp_avg_sq"``; ``"param_groups"`` with the options and
``"params"`` as positions), so PyTorch's state converted with ``.numpy()`` loads too.

Learning-rate schedules are ``torch.optim.lr_scheduler``'s, same names, same numbers:
:class:`LambdaLR`, :class:`LinearLR`, :class:`CosineAnnealingLR` and :class:`SequentialLR`
(linear warm-up, then cosine decay, is ``SequentialLR(opt, [LinearLR(...),
CosineAnnealingLR(...)], milestones=[warmup])``). Each sets every group's ``lr`` (and, once,
``initial_lr``) as PyTorch's does; ``scheduler.step()`` goes after ``opt.step()``.
"""
import bisect
import copy
import math
import numbers
import types
import warnings

import numpy as np

from ._checks import converted, int_value, real_float
from .kernels.adam import BLOCK as ADAM_BLOCK
from .kernels.adam import DECOUPLED, L2_PENALTY, NO_DECAY, adam_kernel
from .nn.module import Parameter

_NOTHING = {np.dtype(t): np.zeros(0, t) for t in (np.float32, np.float64)}  # no max_exp_avg_sq


# ------------------------------------------------------------------ argument checks

def _real(name, value, where):
    return real_float(f"{where}{name}", value)


def _at_least_zero(name, value, what, where):
    value = _real(name, value, where)
    if not value >= 0.0:                                  # also rejects NaN
        raise ValueError(f"Invalid {what}: {where}{name} must be >= 0.0; got {value}")
    return value


def _betas(value, where):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{where}betas must be a pair (beta1, beta2); got {value!r}")
    betas = []
    for i, beta in enumerate(value):
        beta = _real(f"betas[{i}]", beta, where)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {where}betas[{i}] must be in "
                             f"[0, 1); got {beta}")
        betas.append(beta)
    return tuple(betas)


# ------------------------------------------------------------------ the shared machinery

class Optimizer:
    """Base class: parameter groups, per-parameter state, ``zero_grad`` and state dicts.

    Subclasses define ``_check_group(group, where)`` (validate and normalise the options of one
    group, raising errors that name the option) and ``_update(group)`` (one step of the rule).
    """

    def __init__(self, params, defaults):
        self.defaults = self._check_group(dict(defaults), "")
        self.state = {}                                   # Parameter -> {name: array or float}
        self.param_groups = []
        if isinstance(params, (set, frozenset)):
            raise TypeError("params must be an ordered collection (a list), not a set: a "
                            "set's order changes between runs")
        if isinstance(params, (Parameter, np.ndarray, dict)):
            raise TypeError("params must be an iterable of Parameters or of dicts (parameter "
                            f"groups); got a single {type(params).__name__}")
        try:
            groups = list(params)
        except TypeError:
            raise TypeError("params must be an iterable of Parameters or of dicts (parameter "
                            f"groups); got {type(params).__name__}") from None
        if not groups:
            raise ValueError("optimizer got an empty parameter list: params must hold at least "
                             "one Parameter")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group):
        """Add ``{"params": [...], option: value, ...}``; missing options take the defaults."""
        where = f"param_groups[{len(self.param_groups)}]: "
        if not isinstance(param_group, dict):
            raise TypeError(f"{where}a parameter group must be a dict; got "
                            f"{type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"{where}a parameter group must have a 'params' entry; got keys "
                             f"{sorted(param_group)}")
        params = param_group["params"]
        if isinstance(params, Parameter):
            params = [params]
        elif isinstance(params, (set, frozenset)):
            raise TypeError(f"{where}params must be an ordered collection (a list), not a set: "
                            "a set's order changes between runs")
        else:
            params = list(params)
        for i, param in enumerate(params):
            if not isinstance(param, Parameter):
                raise TypeError(f"optimizer can only optimize Parameters, but {where}params[{i}] "
                                f"is {type(param).__name__}")
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{where}params holds the same Parameter more than once")
        taken = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in taken for p in params):
            raise ValueError(f"{where}params holds a Parameter that would be in more than one "
                             "parameter group (an earlier group holds it)")
        group = dict(self.defaults)
        group.update((k, v) for k, v in param_group.items() if k != "params")
        group = self._check_group(group, where)
        group["params"] = params
        self.param_groups.append(group)

    def zero_grad(self):
        """Set every parameter's gradient to zero (in place, so references to it stay valid)."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    param.grad = np.zeros_like(param.data)
                else:
                    param.grad[...] = 0

    def step(self, closure=None):
        """One update of every parameter from its ``grad``; returns ``closure()`` if given.

        ``closure`` (optional) re-evaluates the model and returns the loss, as in PyTorch; it
        runs before the update. A parameter whose ``grad`` is None is skipped, as in PyTorch.
        """
        if closure is not None and not callable(closure):
            raise TypeError(f"closure must be a callable that returns the loss, or None; got "
                            f"{type(closure).__name__}")
        loss = None if closure is None else closure()
        for group in self.param_groups:
            self._update(group)
        return loss

    @staticmethod
    def _grad(param):
        """The parameter's gradient, checked against its data; None when it has none."""
        grad = param.grad
        if grad is None:
            return None
        grad = converted("a parameter's grad", grad,
                         f"an array of its data's dtype {param.data.dtype}")
        if grad.shape != param.data.shape:
            raise ValueError(f"a parameter's grad must have its data's shape {param.data.shape}; "
                             f"got {grad.shape}")
        if grad.dtype != param.data.dtype:
            raise TypeError(f"a parameter's grad must have its data's dtype {param.data.dtype}; "
                            f"got {grad.dtype}")
        return grad

    # -------------------------------------------------------------- state dicts
    def state_dict(self):
        """``{"state": {position: {...}}, "param_groups": [{options, "params": positions}]}``.

        Positions number the parameters across groups in order, as PyTorch does; arrays are
        copies.
        """
        positions, groups = {}, []
        for group in self.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = [positions.setdefault(id(p), len(positions))
                                for p in group["params"]]
            groups.append(packed)
        state = {positions[id(param)]: {k: v.copy() if isinstance(v, np.ndarray) else v
                                        for k, v in entry.items()}
                 for param, entry in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Load what :meth:`state_dict` returned (or PyTorch's, converted to NumPy).

        The groups must hold as many parameters as this optimiser's; options (``lr``...) are
        taken from the saved groups; arrays are cast to each parameter's dtype, shapes must match.
        """
        saved_groups, saved_state = self._check_state_dict(state_dict)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} parameter groups; this "
                             f"optimizer has {len(self.param_groups)}")
        by_position = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict's param_groups[{i}] has "
                                 f"{len(saved['params'])} parameters; this optimizer's has "
                                 f"{len(group['params'])}")
            by_position.update(zip(saved["params"], group["params"]))
        new_groups = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            options = dict(group)
            options.update((k, v) for k, v in saved.items() if k != "params")
            options = self._check_group(options, f"param_groups[{i}]: ")
            options["params"] = group["params"]
            new_groups.append(options)
        new_state = {}
        for position, entry in saved_state.items():
            param = by_position.get(position)
            if param is None:
                raise ValueError(f"state_dict has state for parameter {position!r}, which no "
                                 "parameter group holds")
            if not isinstance(entry, dict):
                raise TypeError(f"state_dict['state'][{position!r}] must be a dict; got "
                                f"{type(entry).__name__}")
            new_state[param] = {key: self._load_value(key, value, param)
                                for key, value in entry.items()}
        self.param_groups, self.state = new_groups, new_state

    @staticmethod
    def _check_state_dict(state_dict):
        """``(param_groups, state)`` of a state dict, their structure checked."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise TypeError(f"state_dict must be a dict with keys 'state' and 'param_groups' "
                            f"(what state_dict() returns); got {type(state_dict).__name__}"
                            + (f" with keys {sorted(map(str, state_dict))}"
                               if isinstance(state_dict, dict) else ""))
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"state_dict['param_groups'] must be a list of dicts; got "
                            f"{type(groups).__name__}")
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or "params" not in group:
                raise TypeError(f"state_dict['param_groups'][{i}] must be a dict with a "
                                f"'params' list; got {group!r}")
            if not isinstance(group["params"], (list, tuple)):
                raise TypeError(f"state_dict['param_groups'][{i}]['params'] must be a list of "
                                f"positions; got {type(group['params']).__name__}")
        if not isinstance(state, dict):
            raise TypeError(f"state_dict['state'] must be a dict; got {type(state).__name__}")
        return groups, state

    @staticmethod
    def _load_value(key, value, param):
        if value is None:
            return None
        if key == "step":
            try:
                return float(np.asarray(value))
            except (ValueError, TypeError, OverflowError) as exc:
                raise TypeError(f"state 'step' must be a number; got {value!r} ({exc})") from None
        array = converted(f"state {key!r}", value,
                          f"an array of the parameter's shape {param.data.shape}", np.array,
                          dtype=param.data.dtype, order="C")
        if array.shape != param.data.shape:
            raise ValueError(f"state {key!r} must have the parameter's shape {param.data.shape}; "
                             f"got {array.shape}")
        return array

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k != "params"]
        return "\n".join(lines + [")"])


# ------------------------------------------------------------------ SGD

class SGD(Optimizer):
    r"""Stochastic gradient descent, optionally with momentum, as ``torch.optim.SGD``.

    PyTorch's pseudocode, with γ = lr, λ = weight_decay, μ = momentum, τ = dampening::

        for t = 1, 2, ...:
            g_t = -∇f(θ_{t-1}) if maximize else ∇f(θ_{t-1})
            if λ ≠ 0:  g_t = g_t + λ·θ_{t-1}
            if μ ≠ 0:
                b_t = μ·b_{t-1} + (1 - τ)·g_t   if t > 1   else   g_t
                g_t = g_t + μ·b_t               if nesterov else   b_t
            θ_t = θ_{t-1} - γ·g_t

    The momentum buffer starts as the first gradient (no dampening on the first step).

    Shapes: each parameter's data and grad (...), one dtype; state "momentum_buffer" (...) too

    Args:
        params: Parameters or parameter groups (see the module docstring).
        lr: learning rate γ >= 0.   momentum: μ >= 0.   dampening: τ.
        weight_decay: λ >= 0 (L2 penalty added to the gradient).
        nesterov: Nesterov momentum; needs momentum > 0 and dampening = 0.
        maximize: ascend the objective instead of descending.
    """

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, maximize=False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group, where):
        group["lr"] = _at_least_zero("lr", group["lr"], "learning rate", where)
        group["momentum"] = _at_least_zero("momentum", group["momentum"], "momentum value", where)
        group["dampening"] = _real("dampening", group["dampening"], where)
        group["weight_decay"] = _at_least_zero("weight_decay", group["weight_decay"],
                                               "weight_decay value", where)
        group["nesterov"], group["maximize"] = bool(group["nesterov"]), bool(group["maximize"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening: "
                             f"{where}nesterov=True needs momentum > 0 and dampening == 0; got "
                             f"momentum={group['momentum']}, dampening={group['dampening']}")
        return group

    def _update(self, group):
        lr, mu, tau = float(group["lr"]), float(group["momentum"]), float(group["dampening"])
        decay = float(group["weight_decay"])
        for param in group["params"]:
            grad = self._grad(param)
            if grad is None:
                continue
            g = -grad if group["maximize"] else grad               # never write into .grad
            if decay != 0:
                g = g + decay * param.data                         # (...)
            if mu != 0:
                state = self.state.setdefault(param, {})
                buf = state.get("momentum_buffer")
                if buf is None:                                    # t = 1: b_1 = g_1
                    buf = state["momentum_buffer"] = np.array(g, dtype=param.data.dtype)
                else:
                    buf *= mu
                    buf += (1.0 - tau) * g
                g = g + mu * buf if group["nesterov"] else buf
            param.data -= lr * g


# ------------------------------------------------------------------ Adam and AdamW

class Adam(Optimizer):
    r"""Adam, as ``torch.optim.Adam``: moment estimates with bias correction.

    PyTorch's pseudocode, with γ = lr, (β1, β2) = betas, λ = weight_decay, ε = eps::

        m_0 = 0, v_0 = 0, v̂max_0 = 0
        for t = 1, 2, ...:
            g_t = -∇f(θ_{t-1}) if maximize else ∇f(θ_{t-1})
            if λ ≠ 0:  g_t = g_t + λ·θ_{t-1}            (L2 penalty, added to the gradient)
            m_t = β1·m_{t-1} + (1 - β1)·g_t
            v_t = β2·v_{t-1} + (1 - β2)·g_t²
            m̂_t = m_t / (1 - β1^t)
            if amsgrad:
                v̂max_t = max(v̂max_{t-1}, v_t)
                v̂_t = v̂max_t / (1 - β2^t)
            else:
                v̂_t = v_t / (1 - β2^t)
            θ_t = θ_{t-1} - γ·m̂_t / (√v̂_t + ε)

    Evaluated as PyTorch does: ``m += (1 - β1)·(g - m)`` (a lerp), and
    ``θ -= (γ / (1 - β1^t))·m / (√v / √(1 - β2^t) + ε)``, the bias corrections in float64 --
    one fused pass over each parameter (``kernels/adam.py``).

    Shapes: each parameter's data and grad (...), one dtype; state "exp_avg", "exp_avg_sq"
    (and "max_exp_avg_sq" with amsgrad) (...) in that dtype, "step" a float

    Args:
        params: Parameters or parameter groups (see the module docstring).
        lr: γ >= 0.   betas: (β1, β2), each in [0, 1).   eps: ε >= 0, keeps the division finite.
        weight_decay: λ >= 0.   amsgrad: use the running maximum of v.   maximize: ascend.
    """

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, maximize=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group, where):
        group["lr"] = _at_least_zero("lr", group["lr"], "learning rate", where)
        group["eps"] = _at_least_zero("eps", group["eps"], "epsilon value", where)
        group["betas"] = _betas(group["betas"], where)
        group["weight_decay"] = _at_least_zero("weight_decay", group["weight_decay"],
                                               "weight_decay value", where)
        group["amsgrad"], group["maximize"] = bool(group["amsgrad"]), bool(group["maximize"])
        return group

    def _update(self, group):
        lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        mode = NO_DECAY if decay == 0 else DECOUPLED if self._decoupled else L2_PENALTY
        for param in group["params"]:
            grad = self._grad(param)
            if grad is None:
                continue
            state = self.state.setdefault(param, {})
            if not state:
                state["step"] = 0.0
                state["exp_avg"] = np.zeros_like(param.data)
                state["exp_avg_sq"] = np.zeros_like(param.data)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = np.zeros_like(param.data)
            if group["amsgrad"] and state.get("max_exp_avg_sq") is None:   # switched on later
                state["max_exp_avg_sq"] = np.zeros_like(param.data)
            state["step"] += 1.0
            t = state["step"]
            dtype = param.data.dtype.type                 # the hyperparameters, rounded to it
            arrays = [param.data, grad, state["exp_avg"], state["exp_avg_sq"],
                      state["max_exp_avg_sq"] if group["amsgrad"] else _NOTHING[param.data.dtype]]
            copied = [not (a.flags.c_contiguous and a.flags.writeable) for a in arrays]
            flat = [np.array(a, order="C") if c else a for a, c in zip(arrays, copied)]
            flat = [a.reshape(-1) for a in flat]          # (views of the parameter and state)
            kernel = adam_kernel.serial if flat[0].size <= ADAM_BLOCK else adam_kernel
            kernel(*flat, dtype(1.0 - lr * decay), dtype(decay), dtype(1.0 - beta1),
                   dtype(beta2), dtype(1.0 - beta2), dtype(eps),
                   dtype(lr / (1.0 - beta1 ** t)), dtype((1.0 - beta2 ** t) ** 0.5), mode,
                   bool(group["amsgrad"]), bool(group["maximize"]))
            for i in (0, 2, 3, 4):                        # updated in a copy: copy back
                if copied[i]:
                    arrays[i][...] = flat[i].reshape(arrays[i].shape)


class AdamW(Adam):
    r"""AdamW, as ``torch.optim.AdamW``: Adam with *decoupled* weight decay.

    PyTorch's pseudocode, with γ = lr, (β1, β2) = betas, λ = weight_decay, ε = eps::

        m_0 = 0, v_0 = 0, v̂max_0 = 0
        for t = 1, 2, ...:
            g_t = -∇f(θ_{t-1}) if maximize else ∇f(θ_{t-1})
            θ_t = θ_{t-1} - γ·λ·θ_{t-1}               (decay the weights, not the gradient)
            m_t = β1·m_{t-1} + (1 - β1)·g_t
            v_t = β2·v_{t-1} + (1 - β2)·g_t²
            m̂_t = m_t / (1 - β1^t)
            if amsgrad:
                v̂max_t = max(v̂max_{t-1}, v_t)
                v̂_t = v̂max_t / (1 - β2^t)
            else:
                v̂_t = v_t / (1 - β2^t)
            θ_t = θ_t - γ·m̂_t / (√v̂_t + ε)

    The decay is ``θ *= 1 - γ·λ``, outside the adaptive scaling: with Adam's L2 penalty
    (``g + λθ``) a weight with large gradients would be decayed less; here every weight decays
    at the same rate. The default ``weight_decay`` is 1e-2, as in PyTorch.

    Shapes: as :class:`Adam`

    Args: as :class:`Adam`; ``weight_decay`` λ >= 0 defaults to 1e-2.
    """

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, maximize=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)


# ------------------------------------------------------------------ learning-rate schedules

EPOCH_DEPRECATION_WARNING = (
    "The epoch parameter in `scheduler.step()` was not necessary and is being deprecated "
    "where possible. Please use `scheduler.step()` to step the scheduler. During the "
    "deprecation, if epoch is different from None, the closed form is used instead of the new "
    "chainable form, where available.")


def _factor(name, value, low, high, low_open):
    """A real number in [low, high] (or (low, high]); NaN is refused."""
    value = real_float(name, value)
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}; got {value}")
    return value


def _count(name, value, minimum):
    value = int_value(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    return value


class LRScheduler:
    """Base class of the learning-rate schedules, as ``torch.optim.lr_scheduler.LRScheduler``.

    ``last_epoch`` counts the ``step()`` calls (-1 before the constructor's own first step,
    which sets each group's ``lr`` for step 0). The constructor stores each group's ``lr`` as
    its ``initial_lr`` -- unless the group has one, from an earlier scheduler -- and
    ``base_lrs`` are those. ``step()`` then sets ``group["lr"]`` from :meth:`get_lr`, which
    PyTorch writes *recursively* (from the group's current ``lr``, so that schedules chain);
    ``get_last_lr()`` returns what it set. Resuming with ``last_epoch >= 0`` needs the groups'
    ``initial_lr``. ``state_dict()`` is every attribute but the optimizer, as PyTorch's.

    Subclasses define ``get_lr()`` and may define ``_get_closed_form_lr()`` (used by
    ``step(epoch)``, which PyTorch deprecates, and by :class:`SequentialLR` at a milestone).
    PyTorch's warnings about calling ``scheduler.step()`` before ``optimizer.step()`` are not
    reproduced.
    """

    _is_initial = False

    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an npattn.optim optimizer; got "
                            f"{type(optimizer).__name__}")
        last_epoch = _count("last_epoch", last_epoch, -1)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise ValueError(
                        f"last_epoch = {last_epoch} resumes a schedule, which needs each "
                        f"group's 'initial_lr' (set by a scheduler built with last_epoch=-1, "
                        f"and saved in the optimizer's state_dict); got param_groups[{i}] "
                        f"without it")
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self):
        """Reset the step count and take the first step (which sets the lrs of step 0)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self):
        raise NotImplementedError(f"{type(self).__name__} does not define get_lr")

    def get_last_lr(self):
        """The learning rates the last step set, one per parameter group."""
        return list(self._last_lr)

    def step(self, epoch=None):
        """Advance the schedule one step and set every group's ``lr``. ``epoch`` (deprecated,
        as in PyTorch) jumps to that step, with the closed form where there is one."""
        self._step_count += 1
        if epoch is not None:
            warnings.warn(EPOCH_DEPRECATION_WARNING, UserWarning, stacklevel=2)
            epoch = _count("epoch", epoch, 0)
        self._update_lr(epoch)

    def _update_lr(self, epoch=None):
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed_form = getattr(self, "_get_closed_form_lr", None)
            values = closed_form() if closed_form is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        """Every attribute but the optimizer (copies), as PyTorch's."""
        return {key: copy.deepcopy(value) for key, value in self.__dict__.items()
                if key != "optimizer"}

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` returned (or PyTorch's scheduler state)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (what state_dict() returns); got "
                            f"{type(state_dict).__name__}")
        self.__dict__.update(copy.deepcopy(state_dict))

    def __repr__(self):
        return f"{type(self).__name__}(last_epoch={self.last_epoch}, lr={self._last_lr})"


class LambdaLR(LRScheduler):
    """lr_t = initial_lr · lr_lambda(t), as ``torch.optim.lr_scheduler.LambdaLR``.

    ``lr_lambda`` is a function of the step t (an int) giving a real factor, or a list of
    them, one per parameter group. ``state_dict()`` saves a lambda as None (a function
    cannot be saved) and a callable object as a copy of its ``__dict__``, as PyTorch's.
    """

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an npattn.optim optimizer; got "
                            f"{type(optimizer).__name__}")
        groups = len(optimizer.param_groups)
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * groups
        if len(lambdas) != groups:
            raise ValueError(f"lr_lambda must be one function or a list of {groups} (one per "
                             f"parameter group); got a list of {len(lambdas)}")
        for i, fn in enumerate(lambdas):
            if not callable(fn):
                where = "lr_lambda" if not isinstance(lr_lambda, (list, tuple)) else \
                    f"lr_lambda[{i}]"
                raise TypeError(f"{where} must be a function of the step (an int) returning a "
                                f"factor; got {type(fn).__name__}")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base_lr * real_float(f"lr_lambda({self.last_epoch})", fn(self.last_epoch))
                for fn, base_lr in zip(self.lr_lambdas, self.base_lrs)]

    def state_dict(self):
        state = {key: copy.deepcopy(value) for key, value in self.__dict__.items()
                 if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else
                               copy.deepcopy(fn.__dict__) for fn in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or "lr_lambdas" not in state_dict:
            raise TypeError("state_dict must be a dict with an 'lr_lambdas' entry (what "
                            f"state_dict() returns); got {type(state_dict).__name__}")
        state = {k: v for k, v in state_dict.items() if k != "lr_lambdas"}
        self.__dict__.update(copy.deepcopy(state))
        for fn, saved in zip(self.lr_lambdas, state_dict["lr_lambdas"]):
            if saved is not None:
                fn.__dict__.update(copy.deepcopy(saved))


class LinearLR(LRScheduler):
    """The factor of initial_lr goes linearly from ``start_factor`` (step 0) to
    ``end_factor`` (step ``total_iters`` and after), as ``torch.optim.lr_scheduler.LinearLR``:
    the warm-up of a warm-up-then-decay schedule.

        closed form:  lr_t = initial_lr · (s + (e − s)·min(t, T)/T),   s, e, T as named
        evaluated as PyTorch does, recursively:
        lr_0 = lr·s,   lr_t = lr_{t−1}·(1 + (e − s)/(T·s + (t − 1)·(e − s)))  for 0 < t ≤ T

    Args: start_factor in (0, 1], end_factor in [0, 1], total_iters T >= 0 (T = 0: the
    closed form is e from step 0 on; PyTorch divides by zero there).
    """

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5,
                 last_epoch=-1):
        self.start_factor = _factor("start_factor", start_factor, 0.0, 1.0, low_open=True)
        self.end_factor = _factor("end_factor", end_factor, 0.0, 1.0, low_open=False)
        self.total_iters = _count("total_iters", total_iters, 0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups = self.optimizer.param_groups
        if self.last_epoch == 0:
            return [group["lr"] * self.start_factor for group in groups]
        if self._is_initial or self.last_epoch > self.total_iters:
            return [group["lr"] for group in groups]
        return [group["lr"] * (1.0 + (self.end_factor - self.start_factor) / (
                    self.total_iters * self.start_factor
                    + (self.last_epoch - 1) * (self.end_factor - self.start_factor)))
                for group in groups]

    def _get_closed_form_lr(self):
        if self.total_iters == 0:
            return [base_lr * self.end_factor for base_lr in self.base_lrs]
        return [base_lr * (self.start_factor + (self.end_factor - self.start_factor)
                           * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base_lr in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from initial_lr down to ``eta_min`` over ``T_max`` steps, as
    ``torch.optim.lr_scheduler.CosineAnnealingLR`` (no restarts: past T_max it rises again).

        closed form:  lr_t = η_min + (initial_lr − η_min)·(1 + cos(π·t/T_max))/2
        evaluated as PyTorch does, recursively (so that it chains after a warm-up):
        lr_t = η_min + (lr_{t−1} − η_min)·(1 + cos(π·t/T_max)) / (1 + cos(π·(t − 1)/T_max))
        and, where the denominator is 0 (t − 1 − T_max a multiple of 2·T_max),
        lr_t = lr_{t−1} + (initial_lr − η_min)·(1 − cos(π/T_max))/2

    Args: T_max >= 1 steps; eta_min >= 0, finite.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        self.T_max = _count("T_max", T_max, 1)
        eta_min = real_float("eta_min", eta_min)
        if not 0.0 <= eta_min < math.inf:                 # also rejects NaN
            raise ValueError(f"eta_min must be a finite real number >= 0; got {eta_min}")
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        groups, t, T, eta = self.optimizer.param_groups, self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return [group["lr"] for group in groups]
        if self._step_count == 1 and t > 0:
            return [eta + (base_lr - eta) * (1 + math.cos(t * math.pi / T)) / 2
                    for base_lr in self.base_lrs]
        if (t - 1 - T) % (2 * T) == 0:
            return [group["lr"] + (base_lr - eta) * (1 - math.cos(math.pi / T)) / 2
                    for base_lr, group in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T))
                * (group["lr"] - eta) + eta for group in groups]

    def _get_closed_form_lr(self):
        return [self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base_lr in self.base_lrs]


class SequentialLR(LRScheduler):
    """Schedules one after another, as ``torch.optim.lr_scheduler.SequentialLR``:
    ``schedulers[i]`` runs from ``milestones[i - 1]`` to ``milestones[i]``; each one after the
    first starts, at its milestone, from its closed form at step 0 (its initial_lr).

    Warm-up then cosine decay, GPT-style::

        warmup = LinearLR(opt, start_factor=1e-3, total_iters=W)
        decay = CosineAnnealingLR(opt, T_max=steps - W, eta_min=lr / 10)
        schedule = SequentialLR(opt, [warmup, decay], milestones=[W])

    Args: schedulers (a list of schedulers of this optimizer, at least one), milestones
    (len(schedulers) − 1 non-decreasing ints >= 0). The constructor undoes the steps the
    schedulers took when they were built and restarts the first, as PyTorch's does.
    """

    def __init__(self, optimizer, schedulers, milestones, last_epoch=-1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an npattn.optim optimizer; got "
                            f"{type(optimizer).__name__}")
        if not isinstance(schedulers, (list, tuple)) or not schedulers:
            raise ValueError(f"schedulers must be a non-empty list of schedulers; got "
                             f"{schedulers!r}")
        for i, scheduler in enumerate(schedulers):
            if not isinstance(scheduler, LRScheduler):
                raise TypeError(f"schedulers[{i}] must be a learning-rate scheduler; got "
                                f"{type(scheduler).__name__}")
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"schedulers[{i}] must schedule this optimizer; got one of "
                                 f"another optimizer")
        if not isinstance(milestones, (list, tuple)):
            raise TypeError(f"milestones must be a list of ints; got {type(milestones).__name__}")
        milestones = [_count(f"milestones[{i}]", m, 0) for i, m in enumerate(milestones)]
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"milestones must hold one fewer entry than schedulers "
                             f"({len(schedulers) - 1}); got {len(milestones)}")
        if milestones != sorted(milestones):
            raise ValueError(f"milestones must be non-decreasing; got {milestones}")
        last_epoch = _count("last_epoch", last_epoch, -1)
        self._schedulers = list(schedulers)
        self._milestones = milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:              # back to the initial values
            group["lr"] = group["initial_lr"]
        self.recursive_undo()                             # the schedulers' first steps
        first = bisect.bisect_right(self._milestones, 0)  # the one meant to run at step 0
        self._schedulers[first]._initial_step()
        self._last_lr = self._schedulers[first].get_last_lr()

    def recursive_undo(self, sched=None):
        """Take back the step each (nested) scheduler took when it was built."""
        scheds = self if sched is None else sched
        if hasattr(scheds, "_schedulers"):
            for s in scheds._schedulers:
                self.recursive_undo(s)
        elif hasattr(scheds, "last_epoch"):
            scheds.last_epoch -= 1

    def step(self):
        self.last_epoch += 1
        idx = bisect.bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)                       # starts from its step 0
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self):
        state = {key: copy.deepcopy(value) for key, value in self.__dict__.items()
                 if key not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or "_schedulers" not in state_dict:
            raise TypeError("state_dict must be a dict with a '_schedulers' entry (what "
                            f"state_dict() returns); got {type(state_dict).__name__}")
        saved = state_dict["_schedulers"]
        if len(saved) != len(self._schedulers):
            raise ValueError(f"state_dict holds {len(saved)} schedulers; this SequentialLR "
                             f"has {len(self._schedulers)}")
        self.__dict__.update(copy.deepcopy({k: v for k, v in state_dict.items()
                                            if k != "_schedulers"}))
        for scheduler, state in zip(self._schedulers, saved):
            scheduler.load_state_dict(state)
