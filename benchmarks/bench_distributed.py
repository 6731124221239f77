"""gpt-distributed: data-parallel GPT training, npattn on MPI against PyTorch's DDP (gloo).

    python -m benchmarks --ops gpt-distributed          # the same as:
    python -m benchmarks.bench_distributed [--quick] [--steps N] [--configs baby,six]

The model, global batch and AdamW are ``benchmarks/bench_gpt.py``'s train-step cases (nanoGPT's
baby config: L4 H4 C128 T64 B12; the 6-layer one: L6 H6 C384 T256 B8), float32. Each
configuration runs in its own processes (``mpiexec -n R`` for R ranks, the mpiexec beside this
Python), warms up for 2 steps, then times ``--steps`` steps between two barriers:

| row | what |
|---|---|
| npattn 1×1, 1×2 | one process, 1 and 2 Numba threads (no DDP) |
| npattn 2×1 | 2 ranks × 1 thread, ``DistributedDataParallel`` (1 MB buckets, overlap on) |
| npattn 2×1 no overlap | the same, every reduction started after the backward |
| npattn 2×1 ZeRO | the same with ``ZeroRedundancyOptimizer`` |
| PyTorch 1×1, DDP 2×1 | ``benchmarks/torch_gpt.py``'s nanoGPT, ``torch.nn.parallel.DistributedDataParallel`` on gloo (127.0.0.1), 1 thread per process |

Each row reports tokens/s of the global batch (B·T per step), the speed-up over npattn 1×1, the
time per step each rank's backward spent waiting for reductions (``DistributedDataParallel
.comm_wait``; npattn only), the optimiser state each rank holds (AdamW's moments: whole, or
ZeRO's shard) and each rank's peak resident memory (``ru_maxrss``, the largest rank's).
The issue's goals: 2×1 ≥ 1.8× 1×1, ≥ 1.3× PyTorch DDP 2×1, ZeRO's optimiser state ≤ 0.55×.
Ranks of 1 thread each on a 2-core machine: the 1×2 row is the fair one-process comparison.
"""
import argparse
import json
import os
import pathlib
import resource
import shutil
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (name, n_layer, n_head, n_embd, block_size, global batch)
CONFIGS = {"baby": (4, 4, 128, 64, 12), "six": (6, 6, 384, 256, 8),
           "quick": (1, 2, 32, 16, 4)}
STEPS = {"baby": 30, "six": 6, "quick": 5}
WARMUP = 2
# (label, implementation, ranks, threads, options)
ROWS = [("npattn 1×1", "npattn", 1, 1, {}),
        ("npattn 1×2", "npattn", 1, 2, {}),
        ("npattn 2×1", "npattn", 2, 1, {}),
        ("npattn 2×1 no overlap", "npattn", 2, 1, {"overlap": False}),
        ("npattn 2×1 ZeRO", "npattn", 2, 1, {"zero": True}),
        ("PyTorch 1×1", "torch", 1, 1, {}),
        ("PyTorch DDP 2×1", "torch", 2, 1, {})]


def mpiexec():
    beside = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


# ------------------------------------------------------------------ the workers (each rank)

def _batch(cfg, batch):
    import numpy as np
    rng = np.random.default_rng(1)
    from .bench_gpt import VOCAB
    return (rng.integers(0, VOCAB, (batch, cfg.block_size)),
            rng.integers(0, VOCAB, (batch, cfg.block_size)))


def npattn_worker(spec):
    import numba
    import numpy as np
    from npattn import distributed as dist
    from npattn import optim
    from npattn.models import GPT
    from .bench_gpt import BETAS, LR, config, decay_groups
    numba.set_num_threads(spec["threads"])
    world = dist.init()
    n_layer, n_head, n_embd, block, batch = CONFIGS[spec["config"]]
    cfg = config(n_layer, n_head, n_embd, block)
    model = GPT(cfg, rng=0, seed=0)
    x, y = _batch(cfg, batch)
    rows = batch // world.size
    x, y = x[world.rank * rows:(world.rank + 1) * rows], y[world.rank * rows:(world.rank + 1) * rows]
    params = list(model.parameters())
    opt = optim.AdamW(decay_groups([p for p in params if p.data.ndim >= 2],
                                   [p for p in params if p.data.ndim < 2]), lr=LR, betas=BETAS)
    ddp = dist.DistributedDataParallel(model, overlap=spec.get("overlap", True), world=world)
    stepper = dist.ZeroRedundancyOptimizer(opt, ddp) if spec.get("zero") else opt

    def step():
        ddp.zero_grad()
        ddp(x, y)
        ddp.backward()
        stepper.step()

    for _ in range(WARMUP):
        step()
    ddp.comm_wait = 0.0
    world.barrier()
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    world.barrier()
    seconds = time.perf_counter() - start
    state = (stepper.state_bytes() if spec.get("zero") else
             sum(a.nbytes for e in opt.state.values() for a in e.values()
                 if isinstance(a, np.ndarray)))
    return dict(seconds=seconds, wait=ddp.comm_wait / spec["steps"], state=state,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                rank=world.rank, size=world.size), world


def torch_worker(spec):
    import torch
    from npattn.models import GPT
    from .bench_gpt import config, torch_peer, torch_train_step
    torch.set_num_threads(spec["threads"])
    rank = int(os.environ.get("PMI_RANK", 0))
    size = int(os.environ.get("PMI_SIZE", 1))
    n_layer, n_head, n_embd, block, batch = CONFIGS[spec["config"]]
    cfg = config(n_layer, n_head, n_embd, block)
    model = torch_peer(torch, cfg, GPT(cfg, rng=0).state_dict())
    if size > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(model)
    x, y = (torch.from_numpy(a) for a in _batch(cfg, batch))
    rows = batch // size
    x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    step, opt = torch_train_step(torch, model, x, y)

    def barrier():
        if size > 1:
            torch.distributed.barrier()

    for _ in range(WARMUP):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    barrier()
    seconds = time.perf_counter() - start
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    result = dict(seconds=seconds, wait=None, state=state,
                  rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  rank=rank, size=size)
    if size > 1:
        everyone = [None] * size
        torch.distributed.all_gather_object(everyone, result)
        torch.distributed.destroy_process_group()
        return (everyone if rank == 0 else None), None
    return [result], None


def worker(spec):
    if spec["impl"] == "torch":
        results, _ = torch_worker(spec)
    else:
        result, world = npattn_worker(spec)
        results = world.allgather_object(result)
        if world.rank != 0:
            results = None
    if results is not None:
        print("RESULT " + json.dumps(results), flush=True)


# ------------------------------------------------------------------ the driver

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(config, steps, impl, ranks, threads, options):
    spec = dict(config=config, steps=steps, impl=impl, threads=threads, port=_free_port(),
                **options)
    command = [sys.executable, "-m", "benchmarks.bench_distributed", "--worker", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {ranks}×{threads} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-800:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(config, steps, rows):
    n_layer, n_head, n_embd, block, batch = CONFIGS[config]
    tokens = steps * batch * block
    out = [f"gpt-distributed L{n_layer} H{n_head} C{n_embd} T{block} global B{batch}, float32, "
           f"{steps} timed steps",
           "",
           "| configuration | tokens/s | vs npattn 1×1 | comm wait / step | optimizer state / rank "
           "| peak RSS / rank |",
           "|---|---:|---:|---:|---:|---:|"]
    base = None
    for label, results in rows:
        if results is None:
            out.append(f"| {label} | failed | | | | |")
            continue
        seconds = max(r["seconds"] for r in results)
        rate = tokens / seconds
        base = base or rate
        waits = [r["wait"] for r in results if r["wait"] is not None]
        wait = f"{max(waits) * 1e3:.2f} ms" if waits else "—"
        out.append(f"| {label} | {rate:,.0f} | {rate / base:.2f}× | {wait} | "
                   f"{max(r['state'] for r in results) / 2**20:.2f} MiB | "
                   f"{max(r['rss'] for r in results) / 2**20:.0f} MiB |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_distributed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    parser.add_argument("--configs", default="baby,six", help="baby,six (default both)")
    parser.add_argument("--steps", type=int, help="timed steps (default: baby 30, six 6)")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before each row, wait up to SECONDS for other processes to leave "
                             "the CPUs (on a shared machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if mpiexec() is None:
        print("gpt-distributed: no mpiexec (pip install '.[mpi]'): skipped")
        return 0
    try:
        import torch  # noqa: F401
        rows = ROWS
    except ImportError:
        rows = [r for r in ROWS if r[1] != "torch"]
    configs = ["quick"] if args.quick else [c.strip() for c in args.configs.split(",")]
    from .machine import CpuMeter
    from .report import BUSY
    meter = CpuMeter()
    for config in configs:
        steps = args.steps or STEPS[config]
        measured = []
        for label, impl, ranks, threads, options in rows:
            if args.wait_idle:
                meter.wait_until_quiet(args.wait_idle, BUSY)
            print(f"{config}: {label} ...", end="", flush=True)
            before = meter.sample()
            try:
                results = run_row(config, steps, impl, ranks, threads, options)
                print(f" {max(r['seconds'] for r in results):.2f} s", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(f" FAILED: {error}", flush=True)
                results = None
            foreign = meter.foreign_share(before)
            if foreign is not None and foreign > BUSY:
                label += f" † ({foreign:.0%} of the CPUs used by others)"
            measured.append((label, results))
        print()
        print(table(config, steps, measured))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
