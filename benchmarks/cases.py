"""The registry of benchmark cases: adding a case is one small function.

A case function takes ``torch`` (the module, or ``None`` when PyTorch is absent) and the
parameters of one size, prepares its inputs, and returns a :class:`Bench`: the implementations
as zero-argument callables on those inputs, the FLOP count of one call, a label and, for the
cases that are plotted, the size for the x-axis::

    @case("gemm", sizes=[(128, "float32"), (256, "float32")], quick=[(128, "float32")])
    def gemm(torch, n, dtype):
        a, b = randn(n, n, dtype=dtype), randn(n, n, dtype=dtype)
        return Bench(f"gemm {short(dtype)} n={n}", flops=2 * n**3,
                     impls=impls(npattn=lambda: npattn.matmul(a, b), numpy=lambda: a @ b,
                                 torch=torch_forward(torch, torch and torch.matmul, a, b)),
                     plot=("gemm", short(dtype), n))

``python -m benchmarks`` runs every size of ``sizes``; ``--quick`` runs the ``quick`` sizes.
The cases live in ``bench_<op>.py``, one per functional file, and register on import. Every
implementation of a case returns the same arrays in the same order (nested tuples are
flattened): the forward's output, then for fwd+bwd cases the gradients. Before timing, the
peers' results are checked against npattn's (``timing.check_agreement``).
"""
from dataclasses import dataclass, field

import numpy as np

#: The implementations, in the table's column order.
IMPLEMENTATIONS = ("npattn", "NumPy", "PyTorch")
#: The name of a case's own baseline (Bench.baseline) among its timed implementations.
BASELINE = "npattn baseline"


@dataclass
class Bench:
    """One prepared case: what to time and how to report it."""
    label: str                       # the table's row, e.g. "linear fwd [8,512,512]→2048"
    flops: float                     # floating-point operations in one call (any implementation)
    impls: dict                      # implementation name -> zero-argument callable
    plot: tuple = None               # (figure, panel, x): gemm.png, panel "fp32", x = n
    memory: bool = False             # measure the peak memory of npattn and NumPy
    notes: list = field(default_factory=list)  # footnotes for the table (e.g. nominal FLOPs)
    skipped: dict = field(default_factory=dict)  # implementation -> why it was left out
    # Peak resident memory of each implementation in a fresh process (benchmarks/memory.py,
    # full runs), measured when rss_warmup is set: the case's parameters for the small call
    # made first (it compiles, loads caches), so that only the case's own call is counted.
    rss_warmup: tuple = None
    operand_bytes: int = None        # bytes of the operands and result (e.g. q, k, v, output)
    tokens: int = None               # tokens one call processes (gpt): the table adds tokens/s
    # npattn on a related problem that the case's npattn call should beat, e.g. full causal
    # attention for a sliding window: (what it is, zero-argument callable). Timed in the same
    # interleaved rounds as the implementations, but not checked for agreement (it computes
    # something else); the table adds its time and baseline ÷ npattn.
    baseline: tuple = None


@dataclass
class Case:
    op: str                          # the --ops name: gemm, linear, bmm, softmax, ...
    make: object                     # make(torch, *size) -> Bench
    sizes: list                      # parameter tuples of the full run
    quick: list                      # parameter tuples of the --quick run


CASES = []


def case(op, sizes, quick):
    """Register ``make(torch, *size)`` for each size (``quick``: the sizes of ``--quick``)."""
    def register(make):
        CASES.append(Case(op, make, list(sizes), list(quick)))
        return make
    return register


def impls(npattn, numpy, torch=None):
    """The implementations dict in column order; PyTorch only when it is importable."""
    found = {"npattn": npattn, "NumPy": numpy, "PyTorch": torch}
    return {name: fn for name, fn in found.items() if fn is not None}


_rng = np.random.default_rng(20240531)


def randn(*shape, dtype="float32"):
    """Standard normal inputs: no denormals, no infinities, the same stream every run."""
    return _rng.standard_normal(shape, dtype=np.dtype(dtype))


def short(dtype):
    return {"float32": "fp32", "float64": "fp64"}[np.dtype(dtype).name]


def shape(dims):
    return "[" + ",".join(map(str, dims)) + "]"


def torch_forward(torch, fn, *arrays):
    """``fn`` on tensors sharing the arrays' memory, under ``torch.no_grad()``; None without torch."""
    if torch is None:
        return None
    tensors = [torch.from_numpy(a) for a in arrays]

    def call():
        with torch.no_grad():
            return fn(*tensors)
    return call


def torch_forward_backward(torch, fn, dout, *arrays):
    """``fn`` forward, then autograd's gradients for every input given upstream ``dout``;
    returns (output, gradients), as the other implementations of a fwd+bwd case do.

    ``torch.autograd.grad`` returns fresh gradients instead of accumulating into ``.grad``, so
    every call does the same work.
    """
    if torch is None:
        return None
    tensors = [torch.from_numpy(a).requires_grad_() for a in arrays]
    grad = torch.from_numpy(dout)

    def call():
        out = fn(*tensors)
        return out, torch.autograd.grad(out, tensors, grad)
    return call
