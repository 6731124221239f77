"""Gradient checking: a hand-written backward against central finite differences, in float64.

npattn has no autograd: every ``<op>_backward`` and every ``Module.backward`` is the chain rule
written out by hand, and a hand-written derivative is easy to get subtly wrong (a sign, a
missing term, a transpose). A gradient check compares it with a derivative computed from the
forward alone -- the definition of the derivative, evaluated numerically.

**From a vector output to one number.** ``forward`` returns an array ``y``, but a backward
computes a *vector-Jacobian product*: given ``dout`` (the gradient of some loss with respect to
``y``) it returns ``dx = Σ_j dout_j ∂y_j/∂x``. That is exactly the gradient of the scalar

    f(x) = Σ_j dout_j · y_j(x)

so one numeric derivative of ``f`` per input element checks the whole backward, without ever
forming the Jacobian. ``dout`` is random (standard normal): with ``dout`` all ones, softmax's
``f = Σ_j softmax(x)_j = 1`` is a constant, its true gradient is zero, and a backward that
returns zeros -- or anything else that vanishes for a constant ``dout`` -- passes unnoticed.

**Central differences.** For each element ``x_i``:

    ∂f/∂x_i ≈ (f(x + h·e_i) - f(x - h·e_i)) / (2h)

The Taylor terms of even order cancel, so the error is ``O(h²)`` (``h²/6 · f'''``), where the
one-sided ``(f(x + h) - f(x)) / h`` is only ``O(h)``. We divide by the step actually taken,
``(x_i + h) - (x_i - h)`` in floating point, which is not always exactly ``2h``.

**Why float64.** Each ``f`` carries a rounding error of about ``u·|f|`` (``u`` the unit
roundoff), and the difference quotient divides it by ``2h``: the total error is about
``h²·|f'''| + u·|f|/h``. In float64 (``u ≈ 1.1e-16``) with ``h = 1e-6`` both terms are near
``1e-10``: about ten correct digits. In float32 (``u ≈ 6e-8``) the rounding term alone is
``0.06`` at ``h = 1e-6``, and even the best step (``h ≈ u^(1/3) ≈ 4e-3``) leaves only about
five digits -- too few to tell a small bug from noise. So every float input (and, in
:func:`gradcheck_module`, every parameter) is copied to float64 before checking, and the check
tests the *formula*; float32 accuracy is the job of the op's own tests.

**The verdict.** An element passes when ``|analytic - numeric| <= atol + rtol·|numeric|``; the
report's ``max_error`` is the worst ``|analytic - numeric| / (atol + rtol·|numeric|)``, so
``max_error <= 1`` means every element passed. Expect failures at kinks (a ReLU at 0, a max
with ties, a mask boundary): there the two sides of the difference see different formulas.

Both functions call ``forward`` ``2·n + 2`` times for ``n`` checked elements: use small shapes.
This module imports NumPy only; modules are duck-typed (``to``, ``zero_grad``,
``named_parameters``, ``backward``, and calling the module runs its forward).
"""
import copy
import math
import numbers
from collections import namedtuple

import numpy as np

from ._checks import converted

DOUT_STREAM = 0x6772616463686B  # 'gradchk': keeps dout apart from the caller's draws

#: The worst element of a check: which input (an index into ``inputs``, or a parameter's
#: dotted name), which element (a tuple index), both gradients there and its error ratio.
Mismatch = namedtuple("Mismatch", "input index analytic numeric error")


class GradcheckError(AssertionError):
    """An analytic gradient disagrees with central differences; the message is the report."""


class GradcheckShapeError(GradcheckError, ValueError):
    """An analytic gradient does not have the shape of its input (also a ``ValueError``)."""


def _label(key):
    return f"inputs[{key}]" if isinstance(key, int) else f"parameter {key!r}"


class GradcheckReport:
    """The outcome of :func:`gradcheck` / :func:`gradcheck_module`.

    Attributes:
        ok: every checked element within tolerance, and no gradient with a wrong shape.
        max_error: the worst ``|analytic - numeric| / (atol + rtol·|numeric|)`` over all
            checked elements (``<= 1`` passes; ``inf`` where either side is NaN or inf).
        worst: a :data:`Mismatch` for that element, or None when nothing was checked.
        errors: ``{input index or parameter name: worst error ratio}``, for each checked one.
        skipped: ``{input index or parameter name: why it was not checked}`` (a None
            gradient, a non-float input, a gradient of the wrong shape).
        problems: messages for gradients whose shape differs from their input's.
        notes: warnings that do not fail the check (e.g. forward did not return float64).
    """

    def __init__(self, *, errors, worsts, skipped, problems, notes, eps, atol, rtol):
        self.errors = errors
        self.skipped = skipped
        self.problems = problems
        self.notes = notes
        self.eps, self.atol, self.rtol = eps, atol, rtol
        self.max_error = max(errors.values(), default=0.0)
        candidates = [w for w in worsts.values() if w is not None]
        self.worst = max(candidates, key=lambda w: w.error) if candidates else None
        self.ok = not problems and self.max_error <= 1.0

    def __bool__(self):
        return self.ok

    def __str__(self):
        verdict = "passed" if self.ok else "FAILED"
        lines = [f"gradcheck {verdict}: max error {self.max_error:.3g} "
                 f"(|analytic - numeric| / (atol + rtol·|numeric|); <= 1 passes; "
                 f"atol={self.atol:g}, rtol={self.rtol:g}, eps={self.eps:g})"]
        if self.worst is not None and self.max_error > 1.0:
            w = self.worst
            lines.append(f"  worst: {_label(w.input)} at index {w.index}: analytic {w.analytic!r}, "
                         f"numeric {w.numeric!r}, |difference| {abs(w.analytic - w.numeric):.3g} "
                         f"> allowed {self.atol + self.rtol * abs(w.numeric):.3g}")
        lines += [f"  problem: {p}" for p in self.problems]
        keys = list(self.errors) + [k for k in self.skipped if k not in self.errors]
        keys = (sorted(k for k in keys if isinstance(k, int))         # inputs, then parameters
                + [k for k in keys if not isinstance(k, int)])
        width = max((len(_label(k)) for k in keys), default=0)
        for key in keys:
            if key in self.errors:
                flag = "" if self.errors[key] <= 1.0 else "  FAILED"
                lines.append(f"  {_label(key):<{width}}  {self.errors[key]:.3g}{flag}")
            else:
                lines.append(f"  {_label(key):<{width}}  not checked: {self.skipped[key]}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self):
        return f"<GradcheckReport ok={self.ok} max_error={self.max_error:.3g}>"


# ------------------------------------------------------------------ building blocks

def _is_float_array(x):
    return isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)


def _prepare(inputs):
    """Float arrays -> private float64 C-contiguous copies; anything else passes unchanged."""
    if isinstance(inputs, np.ndarray):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tuple or list of arguments; got {type(inputs).__name__}")
    return [np.array(x, dtype=np.float64, order="C") if _is_float_array(x) else x
            for x in inputs]


def _copies(args):
    return [a.copy() if _is_float_array(a) else a for a in args]


def _as_output(value, what):
    try:
        out = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must return an array; got {type(value).__name__} "
                        f"({exc})") from None
    if not (np.issubdtype(out.dtype, np.floating) or np.issubdtype(out.dtype, np.integer)):
        raise TypeError(f"{what} must return a float array; got dtype {out.dtype}")
    return out


def _reference_output(run, what):
    """Run the forward twice: it must be deterministic, or differences measure noise."""
    first = _as_output(run(), what)
    second = _as_output(run(), what)
    if first.shape != second.shape or not np.array_equal(first, second, equal_nan=True):
        raise ValueError(f"{what} gave different results for the same inputs; a gradient check "
                         "needs a deterministic forward (dropout off with eval(), or a fixed "
                         "seed on every call)")
    notes = []
    if first.dtype != np.float64:
        notes.append(f"{what} returned {first.dtype}, not float64: central differences lose "
                     "most of their digits below float64")
    return first, notes


def _dout(dout, shape, seed):
    if dout is None:
        # a stream of its own: from default_rng(seed) alone, dout would equal a test input
        # drawn with the same seed, and a symmetric gradient would hide a transposed one
        return np.random.default_rng([seed, DOUT_STREAM]).standard_normal(shape)  # output's shape
    dout = converted("dout", dout, f"a float array of forward's output shape {shape}", np.array,
                     dtype=np.float64)
    if dout.shape != shape:
        raise ValueError(f"dout must have the shape of forward's output {shape}; got {dout.shape}")
    return dout


def _numeric_gradient(objective, array, eps):
    """∂objective/∂array by central differences, perturbing ``array`` in place.

    Each element is restored to its exact original value after its two evaluations.
    """
    grad = np.zeros(array.shape)                                      # array's shape
    for index in np.ndindex(array.shape):
        original = array[index]
        array[index] = plus_x = original + eps
        plus = objective()
        array[index] = minus_x = original - eps
        minus = objective()
        array[index] = original
        grad[index] = (plus - minus) / (plus_x - minus_x)             # the step actually taken
    return grad


def _compare(key, analytic, numeric, atol, rtol):
    """Worst ratio ``|analytic - numeric| / (atol + rtol·|numeric|)`` and where it is."""
    if analytic.size == 0:
        return 0.0, None
    diff = np.abs(analytic - numeric)
    allowed = atol + rtol * np.abs(numeric)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(diff == 0, 0.0, diff / allowed)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)                  # NaN/inf never pass
    index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    error = float(ratio[index])
    return error, Mismatch(key, tuple(int(i) for i in index), float(analytic[index]),
                           float(numeric[index]), error)


def _check_options(eps, atol, rtol, seed):
    """The keyword arguments both checks share: real eps > 0, atol, rtol >= 0, an int seed."""
    for name, value in (("eps", eps), ("atol", atol), ("rtol", rtol)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    if not 0 < eps < math.inf:                                        # also rejects NaN
        raise ValueError(f"eps must be > 0 and finite; got {eps}")
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0; got {value}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int >= 0; got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be an int >= 0; got {seed}")


class _Checker:
    """Collects per-input results into a report."""

    def __init__(self, eps, atol, rtol, notes):
        self.eps, self.atol, self.rtol = eps, atol, rtol
        self.errors, self.worsts, self.skipped, self.problems = {}, {}, {}, []
        self.notes = list(notes)

    def check_inputs(self, args, grads, objective, what):
        """:meth:`check` each float-array input against its gradient; note why others are
        skipped (``None`` from backward, or an input that is not a float array)."""
        for i, (arg, grad) in enumerate(zip(args, grads)):
            if grad is None:
                self.skipped[i] = "backward returned None"
            elif not _is_float_array(arg):
                self.skipped[i] = f"not a float array ({type(arg).__name__}), so not perturbed"
            else:
                self.check(i, grad, arg, objective, what)

    def check(self, key, analytic, target, objective, what):
        """Compare ``analytic`` with central differences of ``objective`` over ``target``."""
        analytic = converted(f"{what} for {_label(key)}", analytic, "a float array")
        if not (np.issubdtype(analytic.dtype, np.floating)
                or np.issubdtype(analytic.dtype, np.integer)):
            raise TypeError(f"{what} for {_label(key)} must be a float array; got dtype "
                            f"{analytic.dtype}")
        if analytic.shape != target.shape:
            self.problems.append(f"{what} for {_label(key)} has shape {analytic.shape}; "
                                 f"expected {target.shape}, the shape of {_label(key)}")
            self.skipped[key] = f"the gradient has the wrong shape {analytic.shape}"
            return
        numeric = _numeric_gradient(objective, target, self.eps)
        self.errors[key], self.worsts[key] = _compare(key, analytic.astype(np.float64), numeric,
                                                      self.atol, self.rtol)

    def report(self, raise_exception):
        report = GradcheckReport(errors=self.errors, worsts=self.worsts, skipped=self.skipped,
                                 problems=self.problems, notes=self.notes, eps=self.eps,
                                 atol=self.atol, rtol=self.rtol)
        if raise_exception and not report.ok:
            raise (GradcheckShapeError if report.problems else GradcheckError)(str(report))
        return report


# ------------------------------------------------------------------ the two checks

def gradcheck(forward, backward, inputs, *, dout=None, eps=1e-6, atol=1e-5, rtol=1e-3, seed=0,
              raise_exception=True):
    """Check ``backward`` against central differences of ``forward``, in float64.

    ``forward(*inputs) -> array y``; ``backward(dout, *inputs)`` returns the gradient of
    ``Σ dout·y`` with respect to each input: a tuple with one entry per input (``None`` for an
    input that is not differentiable, such as integer indices or a boolean mask), or a single
    array when there is one input. ``dx_i = Σ_j dout_j ∂y_j/∂x_i`` is compared with

        (f(x + eps·e_i) - f(x - eps·e_i)) / (2·eps),   f(x) = Σ_j dout_j · y_j(x)

    for every element of every float input that has a gradient.

    Shapes: inputs (each its own shape) -> y (...); dout (...) like y; gradient i like input i

    Args:
        inputs: a tuple or list of arguments (a lone ndarray is one input). Float ndarrays are
            copied to float64 (the caller's arrays are never touched); everything else --
            integer and bool arrays, Python scalars, None -- is passed unchanged and not
            perturbed. Bind hyperparameters with a lambda rather than passing them as inputs.
        dout: the output gradient; default: standard normal from
            ``np.random.default_rng([seed, DOUT_STREAM])``, of y's shape.
        eps: the finite-difference step (added to and subtracted from each element).
        atol, rtol: an element passes when ``|analytic - numeric| <= atol + rtol·|numeric|``.
        raise_exception: raise :class:`GradcheckError` (an ``AssertionError``) with the report
            as its message when the check fails; a gradient of the wrong shape raises
            :class:`GradcheckShapeError`, which is also a ``ValueError``.

    Returns a :class:`GradcheckReport`. ``forward`` must be deterministic (it runs twice on the
    same inputs and the results must be identical).

    >>> import numpy as np
    >>> gradcheck(np.tanh, lambda dout, x: dout * (1 - np.tanh(x) ** 2), (np.zeros(3),)).ok
    True
    """
    _check_options(eps, atol, rtol, seed)
    for name, fn in (("forward", forward), ("backward", backward)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable; got {type(fn).__name__}")
    args = _prepare(inputs)
    out, notes = _reference_output(lambda: forward(*args), "forward")
    dout = _dout(dout, out.shape, seed)

    grads = backward(dout.copy(), *_copies(args))
    if len(args) == 1 and not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if not isinstance(grads, (tuple, list)) or len(grads) != len(args):
        got = (f"{len(grads)} gradients" if isinstance(grads, (tuple, list))
               else type(grads).__name__)
        raise ValueError(f"backward must return a tuple with one gradient (or None) per input, "
                         f"{len(args)} here; got {got}")

    def objective():
        return float(np.sum(dout * _as_output(forward(*args), "forward"), dtype=np.float64))

    checker = _Checker(eps, atol, rtol, notes)
    checker.check_inputs(args, grads, objective, "the gradient from backward")
    return checker.report(raise_exception)


def _default_output(result):
    return result[0] if isinstance(result, tuple) else result


def gradcheck_module(module, inputs, *, output=None, dout=None, eps=1e-6, atol=1e-5, rtol=1e-3,
                     seed=0, raise_exception=True):
    """Check a module's ``backward`` -- input gradients and every parameter's ``.grad``.

    Works on ``copy.deepcopy(module).to(np.float64)``: the caller's module (its parameters,
    gradients and saved state) is untouched. The steps:

    1. ``y = output(copy(*inputs))`` (twice: it must give the same result both times);
    2. ``copy.zero_grad()``; ``dinputs = copy.backward(dout)``;
    3. each float input with a gradient and each parameter (by its dotted name from
       ``named_parameters()``) is compared with central differences of ``Σ dout·y``, perturbing
       the input or ``param.data`` in place, one element at a time (and restoring it).

    Shapes: as :func:`gradcheck`; each parameter's ``grad`` like its ``data``

    Args:
        inputs: the forward's arguments, as in :func:`gradcheck` (float arrays become float64
            copies; integer indices, boolean masks and the like pass unchanged).
        output: ``output(result) -> array`` picks the differentiated array from what forward
            returns; default: the result itself, or ``result[0]`` when it is a tuple (attention
            modules return ``(output, weights)``).
        dout, eps, atol, rtol, seed, raise_exception: as in :func:`gradcheck`.

    ``backward(dout)`` may return one array (the gradient of the first input; any further
    inputs are then not checked), a tuple aligned with the inputs (``None`` entries allowed),
    or ``None`` when no input is differentiable (e.g. ``Embedding``'s integer indices).

    The forward must be deterministic between calls: put dropout off with ``module.eval()``
    before checking, or make it draw from a seed fixed for every call. The check does not
    change the module's mode itself; a forward that differs between two identical calls is a
    ``ValueError``.

    Returns a :class:`GradcheckReport` whose ``errors`` has input indices and parameter names.
    """
    _check_options(eps, atol, rtol, seed)
    missing = [m for m in ("to", "zero_grad", "named_parameters", "backward", "__call__")
               if not callable(getattr(module, m, None))]
    if missing:
        raise TypeError(f"module must be an npattn.nn.Module (or have its methods); got "
                        f"{type(module).__name__} without {', '.join(missing)}")
    if output is not None and not callable(output):
        raise TypeError(f"output must be a callable that picks the array to check, or None; "
                        f"got {type(output).__name__}")
    model = copy.deepcopy(module)
    model = model.to(np.float64) or model
    select = _default_output if output is None else output
    args = _prepare(inputs)
    out, notes = _reference_output(lambda: select(model(*args)), "the module's forward")
    dout = _dout(dout, out.shape, seed)

    model.zero_grad()                                    # the forward above ran last
    dinputs = model.backward(dout.copy())
    if dinputs is None:
        dinputs = (None,) * len(args)
    elif not isinstance(dinputs, (tuple, list)):
        dinputs = (dinputs,) + (None,) * (len(args) - 1)
    if len(dinputs) != len(args):
        raise ValueError(f"the module's backward must return one gradient (or None) per input, "
                         f"{len(args)} here; got {len(dinputs)}")
    dparams = [(name, np.array(param.grad, copy=True), param)
               for name, param in model.named_parameters()]

    def objective():
        y = _as_output(select(model(*args)), "the module's forward")
        return float(np.sum(dout * y, dtype=np.float64))

    checker = _Checker(eps, atol, rtol, notes)
    checker.check_inputs(args, dinputs, objective, "the input gradient from backward")
    for name, grad, param in dparams:
        checker.check(name, grad, param.data, objective, "the parameter's .grad")
    return checker.report(raise_exception)
