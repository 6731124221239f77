"""Data-parallel training on MPI: a communicator, ``DistributedDataParallel`` and a ZeRO-1 AdamW.

The names are PyTorch's where they fit (``torch.distributed``)::

    from npattn import distributed as dist
    world = dist.init()                       # MPI's world under mpiexec, else one process
    model = dist.DistributedDataParallel(GPT(config, rng=0))    # rank 0's weights everywhere
    opt = dist.ZeroRedundancyOptimizer(AdamW(model.parameters()), model)   # optional: ZeRO-1
    for x, y in batches:                      # each rank: its B/N rows of the global batch
        model.zero_grad()
        _, loss = model(x, y)
        model.backward()                      # every gradient averaged across the ranks
        opt.step()

**The transport is MPI** (``mpi4py``, imported only by :func:`init` when the process was started
by ``mpiexec``/``srun``): it needs no daemon, scales from a laptop to a cluster, and moves NumPy
buffers without a copy. npattn imports and runs without ``mpi4py``: outside MPI, :func:`init`
returns a one-process stand-in whose collectives are the identity, so the same script runs
either way.

**Reductions in a fixed order.** MPI's ``Allreduce`` does not promise an order of summation
(it may pick its algorithm by message size and process count), so npattn never uses it on
floats. Every sum across ranks is formed by gathering the N contributions and adding them on
the receiving rank in rank order, ``((c_0 + c_1) + c_2) + ...``:

* :func:`all_reduce` and the DDP gradients: ``Allgather`` (``Iallgather`` for a bucket), then
  every rank adds the same N rows in the same order -- the same bits on every rank, at any
  thread count, run after run. Each rank receives (N - 1)·n values, as much as a ring
  ``Allreduce`` sends for N = 2 (twice as much at large N: the price of one non-blocking call
  per bucket).
* ZeRO's gradients: ``Ialltoall`` -- piece j of every rank's bucket goes to rank j, which adds
  the N pieces in rank order: a reduce-scatter in a fixed order, (N - 1)/N·n values per rank.

Both add each element's contributions in the same order, so the averaged gradient -- and the
run -- has the same bits with and without ZeRO. Against one process on the same global batch
the bits differ only by where the batch is split (each rank sums its rows' contributions, then
the ranks' sums are added): round-off, ≤ 1e-12 relative after 10 float64 steps
(``tests/test_distributed.py``).

**Buckets and overlap.** :class:`DistributedDataParallel` makes every parameter's ``data`` and
``grad`` views into flat per-bucket buffers (``bucket_cap_mb`` each, at least one parameter, in
the reverse of ``parameters()``'s order: the order the backward finishes them, last block
first). It wraps the ``backward`` of every sub-module that owns parameters: when all owners of
every parameter of a bucket have run (the tied ``wte`` weight has two, the embedding and the
``lm_head``), the bucket's non-blocking reduction starts while the backward goes on with the
blocks below. MPICH progresses a non-blocking collective only inside MPI calls, so every
wrapped ``backward`` also tests the pending requests (``Testall``: a few µs). ``comm_wait`` is
the time ``backward`` then spends waiting for the reductions to finish.

**ZeRO stage 1** (:class:`ZeroRedundancyOptimizer`): each bucket (padded to a multiple of N) is
cut into N equal pieces; rank j owns piece j of every bucket: the reduced gradient of it, the
optimiser's moments of it, and its update. After the update, ``Allgather`` (in place) gives
every rank the whole bucket again. Adam's update is elementwise, so updating pieces gives the
bits of updating whole parameters; each rank holds 1/N of the moments.

**Faults.** A rank that dies (``kill -9``, an exception) ends the whole job: ``mpiexec``
(MPICH's hydra) kills the other ranks when one exits abnormally, and ``abort`` is MPI_Abort
for a rank that wants to end the job itself.
"""
import math
import os
import time

import numpy as np

from .nn.module import Module, Parameter
from .optim import Optimizer

#: Environment variables by which a launcher announces an MPI job (MPICH/hydra and Slurm's
#: PMI, Open MPI, PMIx, MVAPICH). Without any of them init() does not import mpi4py.
LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                      "MV2_COMM_WORLD_SIZE")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
OPS = ("sum", "avg", "max", "min")


def launched_by_mpi():
    """True when a launcher (mpiexec, srun) started this process as part of an MPI job."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def launched_rank():
    """This process's rank as the launcher announced it (0 outside MPI), without starting MPI:
    lets a command quiet every rank but 0 before ``init``."""
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def local_ranks():
    """How many ranks of this job run on this machine, as the launcher announced it (MPICH's
    MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, Slurm's SLURM_NTASKS_PER_NODE);
    1 outside MPI or when none says."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(name, "").isdigit() and launched_by_mpi():
            return max(1, int(os.environ[name]))
    return 1


def _buffer(name, array):
    """``array`` itself if MPI can reduce it in place: a C-contiguous, writeable float32 or
    float64 ndarray (a copy would not be in place); TypeError naming ``name`` otherwise."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy array (reduced in place); got "
                        f"{type(array).__name__}")
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must have dtype float32 or float64; got {array.dtype}")
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"{name} must be C-contiguous and writeable (it is reduced in place); "
                         f"got a {'read-only' if not array.flags.writeable else 'strided'} array")
    return array


def _ordered(rows, op, out):
    """out = rows[0] op rows[1] op ... in rank order (rows (N, ...)): the fixed order."""
    combine = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    if len(rows) == 1:
        np.copyto(out, rows[0])
    else:
        combine(rows[0], rows[1], out=out)          # (no copy of rows[0] first)
    for row in rows[2:]:
        combine(out, row, out=out)
    if op == "avg":
        out /= out.dtype.type(len(rows))
    return out


class SingleProcess:
    """The world of one process: what :func:`init` returns outside MPI. Every collective is the
    identity (``avg`` over one rank is the value itself), so code written for N ranks runs."""

    rank, size = 0, 1
    name = "one process (no MPI)"

    def barrier(self):
        pass

    def all_reduce(self, array, op="sum"):
        return array

    def broadcast(self, array, src=0):
        return array

    def allgather_object(self, value):
        return [value]

    def flag(self, value):
        return int(value)

    def iallgather(self, send, recv):
        recv[0] = send
        return None

    def ialltoall(self, send, recv):
        recv.reshape(-1)[...] = send
        return None

    def allgather_in_place(self, flat):
        return None

    def wait(self, request):
        pass

    def test(self, requests):
        pass

    def abort(self, code=1):
        os._exit(code)


class MPIWorld(SingleProcess):
    """MPI's COMM_WORLD through mpi4py (NumPy buffers, no copies); see the module docstring for
    the fixed-order reductions."""

    def __init__(self, MPI):
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.name = f"MPI, {self.size} ranks ({MPI.Get_library_version().splitlines()[0].strip()})"

    def barrier(self):
        self.comm.Barrier()

    def all_reduce(self, array, op="sum"):
        rows = np.empty((self.size,) + array.shape, array.dtype)       # (N, ...)
        self.comm.Allgather(array, rows)
        return _ordered(rows, op, array)

    def broadcast(self, array, src=0):
        self.comm.Bcast(array, root=src)
        return array

    def allgather_object(self, value):
        return self.comm.allgather(value)

    def flag(self, value):
        """The largest of the ranks' ints (order does not matter for a max): a cheap vote."""
        return int(self.comm.allreduce(int(value), op=self.MPI.MAX))

    def iallgather(self, send, recv):
        return self.comm.Iallgather(send, recv)

    def ialltoall(self, send, recv):
        return self.comm.Ialltoall(send, recv)

    def allgather_in_place(self, flat):
        self.comm.Allgather(self.MPI.IN_PLACE, flat)

    def wait(self, request):
        request.Wait()

    def test(self, requests):
        if requests:
            self.MPI.Request.Testall(requests)

    def abort(self, code=1):
        self.comm.Abort(code)


_world = None


def init():
    """The communicator of this process, made on the first call: MPI's world when a launcher
    started the process (``mpiexec -n N``, ``srun``), otherwise :class:`SingleProcess`.

    Under a launcher mpi4py must be importable (``pip install "npattn[mpi]"``); RuntimeError
    says so otherwise, rather than running N copies that each believe they are alone.
    """
    global _world
    if _world is None:
        if launched_by_mpi():
            try:
                from mpi4py import MPI
            except ImportError as error:
                raise RuntimeError(f"this process was started by an MPI launcher (mpiexec or "
                                   f"srun), but mpi4py cannot be imported ({error}): "
                                   "pip install 'npattn[mpi]'") from None
            _world = MPIWorld(MPI)
        else:
            _world = SingleProcess()
    return _world


def get_rank():
    """This process's rank in [0, world size)."""
    return init().rank


def get_world_size():
    """The number of processes (ranks) in the job: 1 outside MPI."""
    return init().size


def barrier():
    """Wait until every rank has called barrier."""
    init().barrier()


def all_reduce(array, op="sum"):
    """Reduce ``array`` across the ranks, in place, and return it: ``op`` "sum", "avg", "max"
    or "min" of every rank's array, summed in rank order (module docstring), so every rank gets
    the same bits. Shapes: array (...) float32 or float64, the same shape on every rank."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}; got {op!r}")
    return init().all_reduce(_buffer("array", array), op)


def broadcast(array, src=0):
    """Copy rank ``src``'s ``array`` into every rank's, in place, and return it."""
    world = init()
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)) or not (
            0 <= src < world.size):
        raise ValueError(f"src must be a rank in [0, {world.size}); got {src!r}")
    return world.broadcast(_buffer("array", array), int(src))


# ------------------------------------------------------------------ DistributedDataParallel

class _Bucket:
    """Parameters whose data and grad are views into two flat buffers of ``size`` elements
    (their total, padded to a multiple of the world size so that it cuts into equal pieces)."""

    def __init__(self, params, world_size, dtype):
        self.params = params
        self.offsets = np.cumsum([0] + [p.data.size for p in params])   # (len(params) + 1,)
        self.size = -(-int(self.offsets[-1]) // world_size) * world_size
        self.piece = self.size // world_size
        self.data = np.zeros(self.size, dtype)                           # (S,)
        self.grad = np.zeros(self.size, dtype)                           # (S,)
        for param, start in zip(params, self.offsets):
            stop = start + param.data.size
            self.data[start:stop] = param.data.reshape(-1)
            self.grad[start:stop] = param.grad.reshape(-1)
            param.data = self.data[start:stop].reshape(param.data.shape)
            param.grad = self.grad[start:stop].reshape(param.data.shape)
        self.recv = None              # (N, S) for DDP's gather, (N, P) for ZeRO's alltoall
        self.request = None
        self.waiting = 0              # parameters of this backward not yet finished


class DistributedDataParallel:
    """``module`` trained on every rank, its gradients averaged across the ranks.

    At construction every parameter is broadcast from rank 0 (all ranks start from rank 0's
    weights) and becomes a view into its bucket (module docstring). ``ddp(*inputs)`` is
    ``module(*inputs)``; ``ddp.backward(*args)`` runs ``module.backward(*args)``, starting each
    bucket's reduction as soon as the backward has finished its parameters (``overlap=True``)
    or all of them at the end (``overlap=False``, for comparison), then waits for all of them
    and leaves in every ``param.grad`` the average over the ranks of the ranks' gradients. With
    a :class:`ZeroRedundancyOptimizer` attached, the reduction is its reduce-scatter instead.

    Each rank's loss must be the mean over its own rows: with equal shards (B/N rows each) the
    average of the ranks' means is the mean over the global batch, and so is the gradient.

    Attributes: ``module``, ``world``, ``buckets`` (lists of parameters, in reduction order),
    ``comm_wait`` (seconds ``backward`` spent waiting for reductions, summed over calls).
    """

    def __init__(self, module, bucket_cap_mb=1.0, overlap=True, world=None):
        if not isinstance(module, Module):
            raise TypeError(f"module must be an npattn.nn.Module; got {type(module).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
                not bucket_cap_mb > 0 or not math.isfinite(bucket_cap_mb):
            raise ValueError(f"bucket_cap_mb must be a finite number > 0; got {bucket_cap_mb!r}")
        self.module, self.overlap = module, bool(overlap)
        self.world = init() if world is None else world
        self.comm_wait = 0.0
        self.sharded = None                              # the ZeRO optimizer, when attached
        params = list(module.parameters())
        if not params:
            raise ValueError("module must have at least one parameter; got none")
        dtypes = {p.data.dtype for p in params}
        if len(dtypes) != 1:
            raise TypeError(f"module's parameters must have one dtype; got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        cap = max(1, int(bucket_cap_mb * 2 ** 20) // dtype.itemsize)     # elements
        groups, current, filled = [], [], 0
        for param in reversed(params):               # backward order: the last blocks first
            if current and filled + param.data.size > cap:
                groups.append(current)
                current, filled = [], 0
            current.append(param)
            filled += param.data.size
        groups.append(current)
        self._buckets = [_Bucket(g, self.world.size, dtype) for g in groups]
        for bucket in self._buckets:
            self.world.broadcast(bucket.data, 0)
        self.buckets = [b.params for b in self._buckets]
        # which bucket each parameter is in, and how many modules own it (wte: two)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._owners = {}
        self._running = False
        for _, sub in module.named_modules():
            own = list(sub._parameters.values())
            if not own:
                continue
            for param in own:
                self._owners[id(param)] = self._owners.get(id(param), 0) + 1
            object.__setattr__(sub, "backward", self._hooked(sub, sub.backward, own))

    def _hooked(self, sub, backward, own):
        def hooked(*args, **kwargs):
            result = backward(*args, **kwargs)
            if self._running:
                self._finished(own)
            return result
        hooked.__doc__ = backward.__doc__
        return hooked

    def __call__(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def zero_grad(self):
        self.module.zero_grad()

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -------------------------------------------------------------- backward
    def _finished(self, own):
        """A module's backward has run: count down its parameters' owners; start every bucket
        whose parameters are all final; let MPI progress the reductions already started."""
        for param in own:
            self._left[id(param)] -= 1
            if self._left[id(param)] == 0:
                bucket = self._bucket_of[id(param)]
                bucket.waiting -= 1
                if bucket.waiting == 0 and self.overlap:
                    self._start(bucket)
        self.world.test([b.request for b in self._started if b.request is not None])

    def _start(self, bucket):
        n = self.world.size
        if self.sharded is None:                     # DDP: every rank gets every contribution
            if bucket.recv is None:
                bucket.recv = np.empty((n, bucket.size), bucket.grad.dtype)      # (N, S)
            bucket.request = self.world.iallgather(bucket.grad, bucket.recv)
        else:                                        # ZeRO: piece j of each rank to rank j
            if bucket.recv is None:
                bucket.recv = np.empty((n, bucket.piece), bucket.grad.dtype)     # (N, P)
            bucket.request = self.world.ialltoall(bucket.grad, bucket.recv)
        self._started.append(bucket)

    def backward(self, *args, **kwargs):
        """``module.backward(*args)``, then every gradient averaged across the ranks (or, with
        ZeRO, this rank's piece of it in the optimiser: ``param.grad`` keeps the local one)."""
        if self.world.size == 1:                     # nothing to average
            return self.module.backward(*args, **kwargs)
        self._left = dict(self._owners)
        for bucket in self._buckets:
            bucket.waiting = len(bucket.params)
        self._started = []
        self._running = True
        try:
            result = self.module.backward(*args, **kwargs)
        finally:
            self._running = False
        for bucket in self._buckets:                 # not started yet (overlap off, or unused)
            if bucket not in self._started:
                self._start(bucket)
        start = time.perf_counter()
        for bucket in self._started:                 # the order they were started: same on all
            self.world.wait(bucket.request)
            bucket.request = None
            if self.sharded is None:
                _ordered(bucket.recv, "avg", bucket.grad)
            else:
                _ordered(bucket.recv, "avg", self.sharded._grads[id(bucket)])
        self.comm_wait += time.perf_counter() - start
        return result


# ------------------------------------------------------------------ ZeRO stage 1

class ZeroRedundancyOptimizer:
    """ZeRO stage 1: ``optimizer`` (an Adam or AdamW over ``ddp``'s parameters) with its state
    sharded across the ranks: rank j keeps the moments of, and updates, piece j of every bucket
    of ``ddp`` (module docstring); ``step()`` then all-gathers the updated parameters.

    The results equal the unsharded optimiser's bit for bit (Adam's update is elementwise, and
    the reduce-scatter adds in the same order as DDP's gather). ``optimizer.param_groups`` stays
    the place for options, so a learning-rate schedule made on ``optimizer`` works unchanged;
    its ``state`` stays empty. ``state_dict()`` / ``load_state_dict()`` use the unsharded
    optimiser's layout (every parameter's whole moments), so a checkpoint resumes with or
    without ZeRO; ``state_dict()`` is collective (every rank must call it). ``shard_numel`` is
    the number of elements whose state this rank holds.
    """

    def __init__(self, optimizer, ddp):
        if not isinstance(optimizer, Optimizer) or not hasattr(optimizer, "_decoupled"):
            raise TypeError(f"optimizer must be an npattn.optim.Adam or AdamW; got "
                            f"{type(optimizer).__name__}")
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"ddp must be a DistributedDataParallel; got {type(ddp).__name__}")
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if mine != {id(p) for p in ddp.parameters()}:
            raise ValueError("optimizer must hold exactly the parameters of ddp's module")
        if optimizer.state:
            raise ValueError("optimizer must not have stepped yet (its state would be lost); "
                             "load a state with load_state_dict instead")
        self.optimizer, self.ddp, self.world = optimizer, ddp, ddp.world
        rank = self.world.rank
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._grads = {}                             # id(bucket) -> this rank's piece (P,)
        self._pieces = []                            # (piece Parameter, param, start, stop)
        pieces = [[] for _ in optimizer.param_groups]
        for bucket in ddp._buckets:
            low, high = rank * bucket.piece, (rank + 1) * bucket.piece
            grad = (bucket.grad if self.world.size == 1       # one rank: no reduction
                    else np.zeros(bucket.piece, bucket.grad.dtype))           # (P,)
            self._grads[id(bucket)] = grad
            for param, offset in zip(bucket.params, bucket.offsets):
                start, stop = max(low, offset), min(high, offset + param.data.size)
                if start >= stop:
                    continue
                piece = Parameter(np.zeros(1, bucket.data.dtype))
                piece.data = bucket.data[start:stop]                 # views: updated in place
                piece.grad = grad[start - low:stop - low]
                pieces[group_of[id(param)]].append(piece)
                self._pieces.append((piece, param, bucket, start - offset, stop - offset))
        inner = object.__new__(type(optimizer))
        Optimizer.__init__(inner, [dict(self._options(g), params=p)
                                   for g, p in zip(optimizer.param_groups, pieces)],
                           dict(optimizer.defaults))
        self._inner = inner
        self.shard_numel = sum(piece.data.size for piece, *_ in self._pieces)
        ddp.sharded = self

    @staticmethod
    def _options(group):
        return {k: v for k, v in group.items() if k != "params"}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self):
        self.ddp.zero_grad()

    def step(self):
        """Update this rank's pieces (options from ``optimizer.param_groups``), then gather."""
        for inner, outer in zip(self._inner.param_groups, self.optimizer.param_groups):
            inner.update(self._options(outer))
        self._inner.step()
        for bucket in self.ddp._buckets:
            self.world.allgather_in_place(bucket.data)

    def state_bytes(self):
        """Bytes of optimiser state (moments) this rank holds."""
        return sum(a.nbytes for entry in self._inner.state.values() for a in entry.values()
                   if isinstance(a, np.ndarray))

    def state_dict(self):
        """The unsharded optimiser's state dict (collective: gathers every piece's moments)."""
        positions = {id(p): i for i, p in enumerate(
            p for g in self.optimizer.param_groups for p in g["params"])}
        full = self.optimizer.state_dict()
        entries = list(self._inner.state.values())
        if not entries:
            return full
        keys = [k for k, v in entries[0].items() if isinstance(v, np.ndarray)]
        step = entries[0]["step"]
        gathered = {}
        for key in keys:
            for bucket in self.ddp._buckets:
                flat = np.zeros(bucket.size, bucket.data.dtype)                  # (S,)
                for piece, param, owner, start, stop in self._pieces:
                    if owner is bucket:
                        offset = bucket.offsets[bucket.params.index(param)]
                        flat[offset + start:offset + stop] = self._inner.state[piece][key]
                self.world.allgather_in_place(flat)
                for param, offset in zip(bucket.params, bucket.offsets):
                    gathered.setdefault(positions[id(param)], {})[key] = \
                        flat[offset:offset + param.data.size].reshape(param.data.shape).copy()
        for position, entry in gathered.items():
            full["state"][position] = dict(step=step, **entry)
        return full

    def load_state_dict(self, state_dict):
        """Load an unsharded optimiser's state dict: the options into ``optimizer``, this
        rank's pieces of the moments into the shards."""
        self.optimizer.load_state_dict(state_dict)
        full, self.optimizer.state = self.optimizer.state, {}
        self._inner.state = {}
        for piece, param, _, start, stop in self._pieces:
            entry = full.get(param)
            if entry:
                self._inner.state[piece] = {
                    k: (v.reshape(-1)[start:stop].copy() if isinstance(v, np.ndarray) else v)
                    for k, v in entry.items()}
