"""``nn.utils``: what a training loop does to the gradients between backward and the step --
``clip_grad_norm_``, as ``torch.nn.utils.clip_grad_norm_``."""
import math

import numpy as np

from .. import _checks
from .module import Parameter

__all__ = ["clip_grad_norm_"]

CHUNK = 1 << 16   # elements per float64 partial sum: bounded scratch for any parameter size


def _parameters(parameters):
    """A Parameter or an iterable of them, as a list (a generator is consumed once)."""
    if isinstance(parameters, Parameter):
        return [parameters]
    if isinstance(parameters, (np.ndarray, str, dict)) or parameters is None:
        raise TypeError(f"parameters must be a Parameter or an iterable of Parameters; got "
                        f"{type(parameters).__name__}")
    try:
        params = list(parameters)
    except TypeError:
        raise TypeError(f"parameters must be a Parameter or an iterable of Parameters; got "
                        f"{type(parameters).__name__}") from None
    for i, param in enumerate(params):
        if not isinstance(param, Parameter):
            raise TypeError(f"parameters[{i}] must be a Parameter; got {type(param).__name__}")
    return params


def _grads(params):
    """The gradients that are not None, each checked: it is scaled in place."""
    grads = []
    for i, param in enumerate(params):
        grad = param.grad
        if grad is None:
            continue
        if (not isinstance(grad, np.ndarray) or grad.dtype not in _checks.FLOAT_DTYPES
                or grad.shape != param.data.shape or not grad.flags.writeable):
            got = (f"{grad.dtype} array of shape {grad.shape}" + ("" if grad.flags.writeable
                                                                  else ", read-only")
                   if isinstance(grad, np.ndarray) else type(grad).__name__)
            raise TypeError(f"parameters[{i}].grad must be a writeable float32 or float64 "
                            f"ndarray of its data's shape {param.data.shape} (it is scaled in "
                            f"place); got {got}")
        grads.append(grad)
    return grads


def _norm(values, norm_type):
    """The ``norm_type``-norm of an array, in float64, summed in a fixed order (chunks in
    turn, each by NumPy's pairwise sum): the same bits at any thread count."""
    flat = values.reshape(-1)
    if norm_type == math.inf or norm_type == -math.inf:
        if flat.size == 0:                             # the reduction's identity
            return 0.0 if norm_type > 0 else math.inf
        pick = np.max if norm_type > 0 else np.min
        return float(pick(np.abs(flat)).astype(np.float64))
    if norm_type == 0:                                 # the count of non-zero entries
        return float(np.count_nonzero(flat))
    total = 0.0
    for start in range(0, flat.size, CHUNK):
        chunk = np.abs(flat[start:start + CHUNK].astype(np.float64))
        total += float(np.sum(chunk * chunk if norm_type == 2 else chunk ** norm_type))
    return math.sqrt(total) if norm_type == 2 else total ** (1.0 / norm_type)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """Scale the gradients in place so that their total norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping.

    total = ‖(‖g_1‖_p, ‖g_2‖_p, ...)‖_p over the parameters' grads that are not None -- for
    p > 0 the p-norm of all of them concatenated; p = inf is max |g|, p = 0 (PyTorch's rule,
    applied to the per-grad norms too) counts the grads with a non-zero entry -- and then

        g ← g · min(max_norm / (total + 1e-6), 1)         for every grad

    evaluated as PyTorch does: ``total`` rounded to the grads' result dtype (float32 when all
    are float32), the coefficient computed in that dtype and each grad multiplied by it in
    its own dtype. A non-finite total scales by NaN or 0 as the formula gives, unless
    ``error_if_nonfinite``, which raises RuntimeError (PyTorch's) first and leaves the grads.

    Shapes: parameters' grads (...) each, any mix of shapes -> total a NumPy scalar of the
    grads' result dtype (``np.float32(0.0)`` without grads, as ``torch.tensor(0.0)``)

    The norms are summed in float64, in a fixed order, so the result is the same at any
    thread count and at least as accurate as PyTorch's float32 (which sums in float32).
    ``foreach`` (None or a bool) is accepted for PyTorch's signature and changes nothing: there
    is one implementation. Unlike PyTorch, a negative or NaN ``max_norm`` is a ValueError (it
    would flip or poison every gradient), and an empty grad has inf-norm 0 (the norm of no
    entries; PyTorch raises).
    """
    params = _parameters(parameters)
    max_norm = _checks.real_float("max_norm", max_norm, "a real number >= 0")
    if not max_norm >= 0.0:                            # also rejects NaN
        raise ValueError(f"max_norm must be a real number >= 0; got {max_norm}")
    norm_type = _checks.real_float("norm_type", norm_type, "a real number or inf")
    if math.isnan(norm_type):
        raise ValueError(f"norm_type must be a real number or inf; got {norm_type}")
    error_if_nonfinite = _checks.flag("error_if_nonfinite", error_if_nonfinite)
    if foreach is not None:
        _checks.flag("foreach", foreach)
    grads = _grads(params)
    if not grads:
        return np.float32(0.0)
    dtype = np.result_type(*grads)
    norms = np.array([_norm(g, norm_type) for g in grads])          # (number of grads,)
    with np.errstate(over="ignore"):                                # a float32 overflow is inf
        total = dtype.type(_norm(norms, norm_type))
    if error_if_nonfinite and not np.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    with np.errstate(invalid="ignore", divide="ignore"):            # inf/inf, as PyTorch
        coef = np.minimum(dtype.type(max_norm) / (total + dtype.type(1e-6)), dtype.type(1.0))
        for grad in grads:
            grad *= coef.astype(grad.dtype)                         # in the grad's dtype
    return total
