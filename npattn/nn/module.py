"""Parameter and Module: the bookkeeping every layer shares, as ``torch.nn`` does it.

There is no autograd tape. A module's ``forward`` computes its output and remembers what its
``backward`` will need (the inputs, a dropout seed, a logsumexp...); ``backward(dout)`` runs the
chain rule by hand with the functional ``*_backward`` pairs, **adds** each parameter's gradient
into ``parameter.grad`` (so gradients of several uses or several batches accumulate, as
``loss.backward()`` does in PyTorch) and returns the gradient of the input(s). ``backward``
pairs with the most recent ``forward``. What a forward saves is its ``_saved`` attribute (one
array or a tuple); inside ``with no_saving():`` forwards save nothing (inference, as
``torch.no_grad``), so a model can run the same forward to generate.

Names follow PyTorch: a parameter's name is the attribute path that reaches it
(``out_proj.weight``), so ``state_dict()`` keys are PyTorch's keys and a PyTorch
``state_dict`` converted to NumPy arrays loads with ``load_state_dict``.
"""
import contextlib
import numbers
import threading
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from .._checks import FLOAT_DTYPES, converted, float_dtype


class _Inference(threading.local):
    active = False                      # no_saving() is on in this thread


_inference = _Inference()


@contextlib.contextmanager
def no_saving():
    """Forwards run inside this context save nothing for backward: a module's ``self._saved =
    ...`` is dropped, and what its last forward outside saved stays (a backward after them
    pairs with that forward). Per thread; nests."""
    before = _inference.active
    _inference.active = True
    try:
        yield
    finally:
        _inference.active = before


class Parameter:
    """A trainable array ``data`` and the gradient ``grad`` accumulated into it.

    Shapes: data (...) and grad (...), one float dtype. ``grad`` starts at zeros (PyTorch's
    starts as ``None``; zeros make "accumulate" one line and change no result).
    """

    __slots__ = ("data", "grad")

    def __init__(self, data):
        data = converted("Parameter data", data, "a float32 or float64 array",   # a copy the
                         np.array, order="C")                                    # module owns
        if data.dtype not in FLOAT_DTYPES:
            raise TypeError(f"Parameter data must have dtype float32 or float64; got {data.dtype}")
        self.data = data
        self.grad = np.zeros_like(data)

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    def accumulate(self, grad):
        """``grad += g``: how every backward hands a parameter its gradient. ``g`` must be a
        float array of the parameter's shape (it is rounded to the parameter's dtype)."""
        g = converted("grad", grad, "a float array")
        if g.dtype not in FLOAT_DTYPES:
            raise TypeError(f"grad must be a float32 or float64 array; got dtype {g.dtype}")
        if g.shape != self.data.shape:
            raise ValueError(f"grad must have the parameter's shape {self.data.shape}; got "
                             f"{g.shape}")
        self.grad += g

    def __repr__(self):
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


class Module:
    """Base class: registers parameters, buffers and sub-modules in the order they are set.

    Subclasses define ``forward(*inputs)`` and ``backward(dout)``; calling the module runs
    ``forward``. ``training`` (set by ``train()`` / ``eval()``) switches dropout on and off.
    """

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    # ------------------------------------------------------------ registration
    def __setattr__(self, name, value):
        if name == "_saved":                            # what forward keeps for backward:
            if not _inference.active:                   # never a parameter, buffer or
                object.__setattr__(self, name, value)       # module (none under no_saving)
            return
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call Module.__init__() "
                                 f"before setting {name!r}")
        if name in self._buffers and isinstance(value, np.ndarray):
            object.__setattr__(self, name, value)       # a new array for a buffer: still one
            return
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        object.__delattr__(self, name)

    def register_buffer(self, name, array, persistent=True):
        """A non-trainable array that belongs to the module's state (e.g. the positional table).

        Persistent buffers appear in ``state_dict()``, as in PyTorch.
        """
        object.__setattr__(self, name, array)
        self._buffers[name] = persistent

    # ------------------------------------------------------------ traversal
    def named_modules(self, prefix=""):
        """``(name, module)`` for this module and every descendant, depth first."""
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self):
        return (child for child in self._modules.values() if child is not None)

    def named_parameters(self, prefix=""):
        """``(dotted name, Parameter)`` pairs, each parameter once, in registration order."""
        seen = set()
        for path, module in self.named_modules(prefix):
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{path}.{name}" if path else name), param

    def parameters(self):
        return [param for _, param in self.named_parameters()]

    def named_buffers(self, prefix="", persistent_only=False):
        for path, module in self.named_modules(prefix):
            for name, persistent in module._buffers.items():
                if persistent or not persistent_only:
                    yield (f"{path}.{name}" if path else name), getattr(module, name)

    # ------------------------------------------------------------ state
    def zero_grad(self):
        """Set every parameter's gradient to zero (before the next accumulation)."""
        for param in self.parameters():
            param.grad[...] = 0

    def train(self, mode=True):
        """Training mode (dropout active) for this module and all below it; returns self."""
        for _, module in self.named_modules():
            object.__setattr__(module, "training", bool(mode))
        return self

    def eval(self):
        """Evaluation mode: dropout is the identity. Same as ``train(False)``."""
        return self.train(False)

    def state_dict(self):
        """PyTorch's keys -> copies of the arrays (parameters, then persistent buffers)."""
        state = OrderedDict((name, param.data.copy()) for name, param in self.named_parameters())
        state.update((name, np.array(buf)) for name, buf in self.named_buffers(persistent_only=True))
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays into the parameters and buffers, cast to each one's dtype.

        ``state_dict`` maps PyTorch's names to arrays (``{k: v.numpy() for k, v in
        torch_module.state_dict().items()}``). Shapes must match. With ``strict`` (the default)
        missing or unexpected keys are an error; returns ``(missing, unexpected)`` key lists.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays; got "
                            f"{type(state_dict).__name__}")
        if not isinstance(strict, (bool, np.bool_)):
            raise TypeError(f"strict must be a bool; got {type(strict).__name__}")
        targets = dict(self.named_parameters())
        owners = {name: (module, name.rpartition(".")[2])
                  for path, module in self.named_modules()
                  for name in [f"{path}.{b}" if path else b
                               for b, persistent in module._buffers.items() if persistent]}
        missing = [k for k in list(targets) + list(owners) if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets and k not in owners]
        if strict and (missing or unexpected):
            raise ValueError(f"state_dict does not match {type(self).__name__}: missing keys "
                             f"{missing}, unexpected keys {unexpected}")
        copies = []                                     # every check passes before any copy
        for key, value in state_dict.items():
            if key in targets:
                current = targets[key].data
            elif key in owners:
                current = getattr(*owners[key])
            else:
                continue
            value = converted(f"state_dict[{key!r}]", value, "a float array")
            if value.shape != current.shape:
                raise ValueError(f"state_dict[{key!r}] must have shape {current.shape}; "
                                 f"got {value.shape}")
            if not (np.issubdtype(value.dtype, np.floating) or value.dtype == current.dtype):
                raise TypeError(f"state_dict[{key!r}] must be a float array; got {value.dtype}")
            copies.append((current, value))
        for current, value in copies:
            current[...] = value
        return missing, unexpected

    def to(self, dtype):
        """Cast every parameter (data and grad) and float buffer to ``dtype``; returns self."""
        dtype = float_dtype(dtype)
        for param in self.parameters():
            param.data = param.data.astype(dtype)
            param.grad = param.grad.astype(dtype)
        for _, module in self.named_modules():
            for name in module._buffers:
                buf = getattr(module, name)
                if isinstance(buf, np.ndarray) and buf.dtype in FLOAT_DTYPES:
                    object.__setattr__(module, name, buf.astype(dtype))
        return self

    # ------------------------------------------------------------ running
    def forward(self, *inputs, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def backward(self, dout):
        raise NotImplementedError(f"{type(self).__name__} does not define backward")

    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    def _saved_for_backward(self):
        """What the last forward saved; a clear error when backward comes first."""
        saved = self.__dict__.get("_saved")
        if saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward was called before forward")
        return saved

    def extra_repr(self):
        return ""

    def __repr__(self):
        lines = [f"({name}): {repr(child)}".replace("\n", "\n  ")
                 for name, child in self._modules.items()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ")" if not lines else head + "\n  " + "\n  ".join(lines) + "\n)"


class Sequential(Module):
    """Modules applied in order; backward runs them in reverse. Keys are "0", "1", ..."""

    def __init__(self, *modules):
        super().__init__()
        for index, module in enumerate(modules):
            if not isinstance(module, Module):
                raise TypeError(f"Sequential argument {index} must be a Module; "
                                f"got {type(module).__name__}")
            setattr(self, str(index), module)

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def __iter__(self):
        return iter(self._modules.values())

    def forward(self, x):
        for module in self:
            x = module(x)
        return x

    def backward(self, dout):
        for module in reversed(list(self)):
            dout = module.backward(dout)
        return dout


class ModuleList(Module):
    """Modules held in a list, as ``torch.nn.ModuleList``: registered under the names "0",
    "1", ... so that their parameters are named ``h.0.ln_1.weight`` (a GPT's blocks), in
    ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` -- PyTorch's keys.

    Shapes: none (a container)

    It indexes (an int, negative counting from the end, or a slice, which gives a ModuleList
    of those modules), assigns and deletes by index (the later modules are renumbered, as
    PyTorch does), and has ``len``, iteration, ``append``, ``extend``, ``insert``, ``pop``,
    ``+`` and ``+=``. An index out of range is an IndexError, as for a list. Like PyTorch's it
    has no ``forward`` -- the model calls its modules (``for block in self.h: x = block(x)``)
    -- and so no ``backward``: the model runs its modules' backward in reverse order.
    """

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules, name="modules")

    # ------------------------------------------------------------ the list
    @staticmethod
    def _module(name, module):
        if not isinstance(module, Module):
            raise TypeError(f"{name} must be a Module; got {type(module).__name__}")
        return module

    def _index(self, idx, name="index"):
        """An int index in [-len, len) as one in [0, len)."""
        if isinstance(idx, (bool, np.bool_)) or not isinstance(idx, numbers.Integral):
            raise TypeError(f"{name} must be an int or a slice; got {type(idx).__name__}")
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"{name} {idx} is out of range for a ModuleList of {n} modules")
        return int(idx) % n

    def _renumber(self, modules):
        """Hold exactly ``modules``, named "0", "1", ... (after a deletion or insertion)."""
        for key in list(self._modules):
            delattr(self, key)
        for i, module in enumerate(modules):
            setattr(self, str(i), module)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(list(self._modules.values()))

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[str(self._index(idx))]

    def __setitem__(self, idx, module):
        key = str(self._index(idx))
        self._modules[key] = self._module("module", module)   # in place: the order stays
        object.__setattr__(self, key, module)

    def __delitem__(self, idx):
        modules = list(self._modules.values())
        if isinstance(idx, slice):
            del modules[idx]
        else:
            del modules[self._index(idx)]
        self._renumber(modules)

    def append(self, module):
        """Add ``module`` at the end (its name: the old length); returns self."""
        setattr(self, str(len(self)), self._module("module", module))
        return self

    def extend(self, modules, name="modules"):
        """Append every module of the iterable ``modules``; returns self."""
        if isinstance(modules, Module) and not isinstance(modules, (ModuleList, Sequential)):
            raise TypeError(f"{name} must be an iterable of Modules; got a single "
                            f"{type(modules).__name__}")
        try:
            items = list(modules)
        except TypeError:
            raise TypeError(f"{name} must be an iterable of Modules; got "
                            f"{type(modules).__name__}") from None
        for i, module in enumerate(items):          # every entry checked before any is added
            self._module(f"{name}[{i}]", module)
        for module in items:
            self.append(module)
        return self

    def insert(self, index, module):
        """Insert ``module`` before position ``index`` (as ``list.insert``: clamped to the
        ends); the modules from there on are renumbered."""
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, numbers.Integral):
            raise TypeError(f"index must be an int; got {type(index).__name__}")
        modules = list(self._modules.values())
        modules.insert(int(index), self._module("module", module))
        self._renumber(modules)

    def pop(self, index=-1):
        """Remove and return the module at ``index`` (the last by default)."""
        module = self[index]
        del self[index]
        return module

    def __iadd__(self, modules):
        return self.extend(modules)

    def __add__(self, other):
        if not isinstance(other, ModuleList):
            return NotImplemented
        return ModuleList(list(self) + list(other))

    # ------------------------------------------------------------ running
    def forward(self, *inputs, **kwargs):
        raise NotImplementedError("ModuleList has no forward, as in PyTorch: it is a container; "
                                  "call its modules (for block in blocks: x = block(x))")

    def backward(self, dout):
        raise NotImplementedError("ModuleList has no backward: it is a container; call its "
                                  "modules' backward in reverse order (for block in "
                                  "reversed(blocks): dout = block.backward(dout))")
