"""``npattn.distributed`` and ``mpiexec -n 2 npattn gpt train``: N ranks equal one process on
the same global batch (float64, ≤ 1e-12 relative after 10 steps), with and without ZeRO; the
same bytes at any thread count and after k steps + resume + k steps; errors on every rank, not
a hang; a signal stops every rank at one step; a killed rank ends the job.

The MPI tests start ``mpiexec`` (from the running Python's bin directory, where
``pip install mpich`` puts it, else from PATH) in subprocesses; they skip, saying why, where MPI
cannot start. Models are tiny (2 layers, n_embd 32, block 16): these test the machinery.
The first launch in a fresh tree compiles the float64 kernels (the tests share its cache).
"""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from npattn import distributed as dist
from npattn.models import GPT, GPTConfig
from npattn.optim import AdamW
from npattn.tools import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = "the cat sat on the mat. a dog ate the hat!\n" * 40
RUN = ["--steps", "10", "--eval-interval", "10", "--eval-iters", "1", "--n-layer", "2",
       "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
       "--dtype", "float64"]
TIMEOUT = 120                     # seconds for one mpiexec run (a cold compile included)


def _mpiexec():
    """The mpiexec beside this Python (a venv's bin, where the mpich wheel puts it), or on
    PATH; None when there is none."""
    beside = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for name in dist.LAUNCHER_VARIABLES:          # this process is not a rank
        env.pop(name, None)
    return env


@pytest.fixture(scope="session")
def mpiexec():
    """The mpiexec command, checked by running two ranks that sum their ranks; skips, with
    the reason, where MPI cannot start (no mpi4py, no mpiexec, a launcher that fails)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as error:
        pytest.skip(f"MPI cannot start: mpi4py is not installed ({error}); "
                    "pip install '.[mpi]'")
    command = _mpiexec()
    if command is None:
        pytest.skip("MPI cannot start: no mpiexec beside this Python or on PATH; pip install mpich")
    probe = ("from npattn import distributed as d; import numpy as np; "
             "a = np.array([d.get_rank() + 1.0]); d.all_reduce(a); "
             "d.get_rank() or print(d.get_world_size(), a[0])")       # one rank prints
    try:
        done = subprocess.run([command, "-n", "2", sys.executable, "-c", probe], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"MPI cannot start: {command} -n 2 failed ({error})")
    if done.returncode != 0 or done.stdout.split() != ["2", "3.0"]:
        pytest.skip(f"MPI cannot start: {command} -n 2 exited {done.returncode}: "
                    f"{(done.stderr or done.stdout).strip()[-300:]}")
    return command


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


def launch(mpiexec, argv, n=2, timeout=TIMEOUT):
    """``mpiexec -n n python -m npattn gpt train <argv>`` (threads 1 per rank unless given)."""
    if "--threads" not in argv:
        argv = [*argv, "--threads", "1"]
    return subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "npattn", "gpt",
                           "train", *argv], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def ok(done):
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _differ(a, b):
    """The entries in which two checkpoints differ (an assertion's message)."""
    with np.load(a, allow_pickle=False) as x, np.load(b, allow_pickle=False) as y:
        return [k for k in sorted(set(x.files) | set(y.files))
                if k not in x.files or k not in y.files or not np.array_equal(x[k], y[k])]


def weights(path):
    with np.load(path, allow_pickle=False) as archive:
        return {k: archive[k] for k in archive.files if k not in (gpt.META, gpt.CHECKSUM)}


# ------------------------------------------------------------------ one process

def test_outside_mpi_the_world_is_one_process():
    assert not dist.launched_by_mpi()
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    dist.barrier()
    a = np.arange(6.0).reshape(2, 3)
    assert dist.all_reduce(a, "avg") is a and np.array_equal(a, np.arange(6.0).reshape(2, 3))
    assert dist.broadcast(a) is a
    with pytest.raises(ValueError, match=r"op must be one of 'sum', 'avg', 'max', 'min'; got "
                                         r"'prod'"):
        dist.all_reduce(a, "prod")
    with pytest.raises(TypeError, match="array must have dtype float32 or float64; got int64"):
        dist.all_reduce(np.arange(3))
    with pytest.raises(ValueError, match="array must be C-contiguous and writeable"):
        dist.all_reduce(a.T)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 1\); got 1"):
        dist.broadcast(a, src=1)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number > 0; got 0"):
        dist.DistributedDataParallel(GPT(GPTConfig(8, 5, 1, 1, 4), rng=0), bucket_cap_mb=0)


def test_buckets_follow_the_backward_and_zero_on_one_rank_is_adamw():
    """Buckets run last block first; on one rank DDP + ZeRO is plain AdamW, bit for bit (the
    pieces' elementwise update is the whole parameters' update)."""
    config = GPTConfig(16, 11, 2, 2, 16)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (2, 3, 16)), rng.integers(0, 11, (2, 3, 16))
    models = []
    for zero in (False, True):
        model = GPT(config, dtype=np.float64, rng=1)
        opt = AdamW(model.parameters(), lr=1e-2)
        ddp = dist.DistributedDataParallel(model, bucket_cap_mb=0.01)
        stepper = dist.ZeroRedundancyOptimizer(opt, ddp) if zero else opt
        for i in range(2):
            ddp.zero_grad()
            ddp(x[i], y[i])
            ddp.backward()
            stepper.step()
        models.append((model, ddp, stepper))
    names = {id(p): n for n, p in models[0][0].named_parameters()}
    buckets = [[names[id(p)] for p in b] for b in models[0][1].buckets]
    assert len(buckets) > 2 and buckets[0][0] == "transformer.ln_f.bias"
    assert buckets[-1][-1] == "transformer.wte.weight"
    for (name, a), b in zip(models[0][0].state_dict().items(), models[1][0].state_dict().values()):
        assert np.array_equal(a, b), name
    full, sharded = models[0][2].state_dict(), models[1][2].state_dict()
    for position, entry in full["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(entry[key], sharded["state"][position][key])
    assert models[1][2].shard_numel == sum(p.data.size for p in models[1][0].parameters())


# ------------------------------------------------------------------ two ranks

def test_two_ranks_match_one_process_with_and_without_zero_and_resume_to_the_same_bytes(
        mpiexec, corpus, tmp_path, capsys):
    """One process, then five mpiexec -n 2 runs of the same 10 float64 steps of global batch 4:

    * every parameter within 1e-12 (relative to its largest entry) of one process's;
    * --zero, at 2 threads per rank: the same bytes as without (fixed-order reductions,
      elementwise update on shards; the thread count changes nothing);
    * 5 steps (--stop-at) + --resume + 5 steps: the same bytes, with and without --zero.
    """
    data = ["--data", str(corpus)]
    one = tmp_path / "one.npz"
    assert gpt.main(["train", *data, "--out", str(one), *RUN]) == 0
    capsys.readouterr()
    two, zero = tmp_path / "two.npz", tmp_path / "zero.npz"
    printed = ok(launch(mpiexec, [*data, "--out", str(two), *RUN]))
    assert printed.count("done: 10 steps") == 1                  # rank 0 alone prints
    assert "data-parallel: MPI, 2 ranks" in printed and "2 sequences per rank" in printed
    ok(launch(mpiexec, [*data, "--out", str(zero), *RUN, "--zero", "--threads", "2"]))
    assert zero.read_bytes() == two.read_bytes(), _differ(zero, two)
    # The worst parameter is c_attn's key bias: its true gradient is 0 (softmax ignores a
    # shift of every score), so its entries are round-off that Adam scales up (measured at
    # the default lr 2e-3: 7e-13 of c_attn.bias's largest entry; every weight below 2e-14)
    want, got = weights(one), weights(two)
    assert set(want) == set(got)
    for name in want:
        if name.startswith("optimizer."):
            continue
        scale = np.max(np.abs(want[name]))
        assert np.max(np.abs(got[name] - want[name])) <= 1e-12 * scale, name
    for flags in (["--zero"], []):
        part = tmp_path / f"part{len(flags)}.npz"
        ok(launch(mpiexec, [*data, "--out", str(part), *RUN, *flags, "--stop-at", "5"]))
        assert json.loads(str(np.load(part)[gpt.META]))["step"] == 5
        printed = ok(launch(mpiexec, ["--out", str(part), "--resume", str(part), *flags,
                                      "--eval-interval", "10", "--eval-iters", "1"]))
        assert "resumed from" in printed
        assert part.read_bytes() == two.read_bytes(), flags


THREE_RANKS = """
import numpy as np
from npattn import distributed as dist
from npattn.models import GPT, GPTConfig
from npattn.optim import AdamW
rank, n = dist.get_rank(), dist.get_world_size()
def values(r):                      # a wide range of magnitudes: the order of a sum shows
    g = np.random.default_rng(r)
    return g.standard_normal(1000) * 10.0 ** g.integers(-8, 9, 1000)
mine = values(rank)
want = (values(0) + values(1)) + values(2)                       # rank order
other = (values(2) + values(1)) + values(0)
assert not np.array_equal(want, other), "premise: another order gives other bits"
got = dist.all_reduce(mine.copy())
assert np.array_equal(got, want), "sum not in rank order"
avg = dist.all_reduce(mine.copy(), "avg")
assert np.array_equal(avg, want / 3), "avg"
assert np.array_equal(dist.all_reduce(mine.copy(), "max"), np.maximum(np.maximum(values(0), values(1)), values(2)))
b = np.full(3, float(rank), np.float32)
assert np.array_equal(dist.broadcast(b, src=2), np.full(3, 2, np.float32))
x = np.random.default_rng(9).integers(0, 7, (2, 3, 8))
finals = []
for zero in (False, True):
    model = GPT(GPTConfig(8, 7, 1, 1, 8), dtype=np.float64, rng=rank)   # rank 0's wins
    ddp = dist.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = AdamW(model.parameters(), lr=1e-2)
    stepper = dist.ZeroRedundancyOptimizer(opt, ddp) if zero else opt
    for i in range(2):
        ddp.zero_grad(); ddp(x[i, rank:rank + 1], x[i, rank:rank + 1]); ddp.backward(); stepper.step()
    state = np.concatenate([a.ravel() for a in model.state_dict().values()])
    finals.append(state)
    gathered = np.zeros((n, state.size)); gathered[rank] = state
    dist.all_reduce(gathered)
    assert all(np.array_equal(gathered[0], g) for g in gathered), "ranks differ"
assert np.array_equal(finals[0], finals[1]), "ZeRO differs from DDP"
model = GPT(GPTConfig(8, 7, 1, 1, 8), dtype=np.float64, rng=0)   # one process, all 3 rows
opt = AdamW(model.parameters(), lr=1e-2)
for i in range(2):
    model.zero_grad(); model(x[i], x[i]); model.backward(); opt.step()
alone = np.concatenate([a.ravel() for a in model.state_dict().values()])
assert np.max(np.abs(alone - finals[0])) <= 1e-12 * np.max(np.abs(alone)), "not one process's"
done = dist.all_reduce(np.ones(1))
rank or print("ok", int(done[0]))          # one rank prints (ranks' lines would interleave)
"""


def test_three_ranks_reduce_in_rank_order_and_agree_with_and_without_zero(mpiexec):
    """With 3 ranks the order of a sum shows (with 2, a + b = b + a): all_reduce equals the
    rank-order sum bit for bit (the premise asserted: another order differs); broadcast from
    rank 2; DDP (rank 0's initial weights, buckets of a few parameters, reductions started
    during the backward) leaves the same bits on every rank, within 1e-12 of one process on
    the 3 rows, and ZeRO (padded, uneven pieces) the same bits as DDP."""
    done = subprocess.run([mpiexec, "-n", "3", sys.executable, "-c", THREE_RANKS], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok", "3"], done.stdout


def test_errors_stop_every_rank_with_status_2_and_one_message(mpiexec, corpus, tmp_path):
    """A batch the world does not divide, and options that differ between ranks (an MPMD
    launch): rank 0 prints one error, every rank exits 2, nothing hangs or is written."""
    out = tmp_path / "never.npz"
    base = ["--data", str(corpus), "--out", str(out), *RUN]
    done = launch(mpiexec, [*base, "--batch-size", "3"], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "gpt train: error: argument --batch-size: must be divisible by the number of ranks 2 "
        "(each rank trains on batch_size / 2 sequences of the global batch); got 3"), done.stderr
    command = [sys.executable, "-m", "npattn", "gpt", "train", *base, "--threads", "1"]
    done = subprocess.run([mpiexec, "-n", "1", *command, "--lr", "0.001", ":", "-n", "1",
                           *command, "--lr", "0.002"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(r"argument --lr: every rank must be given the same "
                                          r"value; got 0.001 on rank 0 and 0.002 on rank 1",
                                          errors[0]), done.stderr
    assert not out.exists()


# ------------------------------------------------------------------ signals and faults

def _ranks(pid):
    """{rank: pid} of the Python processes under the process ``pid`` (mpiexec's ranks)."""
    children = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                environ = (pathlib.Path("/proc") / str(child) / "environ").read_bytes()
                cmdline = (pathlib.Path("/proc") / str(child) / "cmdline").read_bytes()
            except OSError:
                continue
            rank = re.search(rb"(?:^|\0)PMI_RANK=(\d+)\0", environ)
            if rank and b"npattn" in cmdline:
                found[int(rank.group(1))] = child
    return found


def _alive(pid):
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Job:
    """A background ``mpiexec -n 2 ... gpt train``, killed with all its processes on exit
    whatever happens."""

    def __init__(self, mpiexec, argv):
        self.proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "npattn",
                                      "gpt", "train", *argv, "--threads", "1"], cwd=ROOT,
                                     env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.seen = {}

    def ranks(self, checkpoint, within=TIMEOUT):
        """{rank: pid} once training is under way (``checkpoint`` written)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.seen.update(_ranks(self.proc.pid))
            if checkpoint.exists() and len(self.seen) == 2:
                return dict(self.seen)
            time.sleep(0.2)
        raise AssertionError(f"training did not start: {self.proc.poll()} "
                             f"{self.proc.stderr.read() if self.proc.poll() is not None else ''}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.seen.update(_ranks(self.proc.pid))
        for pid in [*self.seen.values(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.communicate()
        return False


LONG = ["--steps", "100000", "--eval-interval", "1", "--eval-iters", "1", "--n-layer", "1",
        "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4"]


@pytest.fixture(scope="module")
def warm(corpus, tmp_path_factory):
    """One step of LONG's model in this process first: the kernels it needs are then in the
    disk cache, so that the two ranks do not compile them side by side while the test waits."""
    out = tmp_path_factory.mktemp("warm") / "warm.npz"
    argv = ["train", "--data", str(corpus), "--out", str(out), *LONG, "--steps", "1"]
    assert gpt.main(argv) == 0


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(
        mpiexec, corpus, warm, tmp_path, capsys):
    out = tmp_path / "run.npz"
    with Job(mpiexec, ["--data", str(corpus), "--out", str(out), *LONG]) as job:
        ranks = job.ranks(out)
        os.kill(ranks[1], signal.SIGTERM)                  # not rank 0: the ranks must agree
        stdout, stderr = job.proc.communicate(timeout=60)
        assert job.proc.returncode == 143, stdout + stderr
        assert not any(_alive(pid) for pid in ranks.values())
    step = int(re.search(r"stopped by SIGTERM after step (\d+)/100000", stdout).group(1))
    assert json.loads(str(np.load(out)[gpt.META]))["step"] == step
    assert gpt.main(["train", "--out", str(out), "--resume", str(out), "--stop-at",
                     str(step + 1), "--eval-iters", "1"]) == 0     # resumes (in one process)
    assert f"resumed from {out} at step {step}" in capsys.readouterr().out


def test_a_killed_rank_ends_the_job_within_30_s_and_the_checkpoint_resumes(
        mpiexec, corpus, warm, tmp_path, capsys):
    out = tmp_path / "run.npz"
    with Job(mpiexec, ["--data", str(corpus), "--out", str(out), *LONG]) as job:
        ranks = job.ranks(out)
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still ran 30 s after a rank was killed")
        ended = time.monotonic() - killed
        assert job.proc.returncode != 0
        deadline = time.monotonic() + 5                    # the orphans' last breath
        while any(_alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks.values()), "a rank is left running"
    assert ended < 30
    step = gpt.load_checkpoint(out)[2]["step"]
    assert gpt.main(["train", "--out", str(out), "--resume", str(out), "--stop-at",
                     str(step + 1), "--eval-iters", "1"]) == 0
    assert f"resumed from {out} at step {step}" in capsys.readouterr().out
