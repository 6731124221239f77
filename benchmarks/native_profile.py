"""Where the CPU time of npattn's GPT goes, function by function: a sampling profile of the
compiled kernels, the OpenMP runtime, Numba's reference counting, Python and the C library.

    python -m benchmarks.native_profile              # the baby config's training step, 2 threads
    python -m benchmarks.native_profile --six        # the 6-layer one
    python -m benchmarks.native_profile --generate   # a KV-cached generation
    python -m benchmarks.native_profile --threads 1 --seconds 10 --top 40
    python -m benchmarks.native_profile --quick      # gpt_profile's --quick sizes: a smoke run

``benchmarks.gpt_profile`` says which *op* takes the time (its wrappers time each functional
call); this says which *function* does, inside the ops: a GEMM's micro-kernel loop
(``gemm.block_product``) against its packing (``gemm.pack_a_block``), the attention engine's
masking against its softmax, and what no wrapper sees -- the threads waiting in the OpenMP
runtime (a thread whose share of a launch is done, or the worker while the main thread runs
Python), and Numba's reference counting (``NRT_incref``/``NRT_decref``: an atomic add per view
or record of arrays passed to a function that LLVM did not inline).

**How.** The workload (``gpt_profile``'s training step or generation, the same model, batch and
AdamW) runs in a child process, in a loop, once its kernels are compiled or loaded; Linux
``perf record`` samples its instruction pointers on every thread (``-F`` 2000 per second, for
``--seconds``). perf cannot name Numba's code -- it is compiled into anonymous memory at run
time, with no symbol table perf reads -- so each sampled address is looked up in the *running*
child with ``gdb -batch -p`` (``info symbol``: gdb reads the symbols of the in-memory objects
LLVM's JIT registers with it), and the child is stopped only then. Reported: each function's
share of all samples of all threads (so on 2 threads, 50 % is one thread's whole time), named
``module.function`` for npattn's kernels (the engine instance's tile dropped:
``gemm.block_product``), and grouped (``category``) into npattn kernels, Numba's parallel
launch code, its reference counting, the OpenMP runtime, Python, NumPy, the C library and the
operating system. A function LLVM inlined into its caller is counted in the caller (the
micro-kernel inside ``block_product``).

Needs ``perf`` (with permission to attach: ``perf_event_paranoid`` <= 1, or root) and ``gdb``
on the machine; without them it says which is missing and stops. Samples are time on the
CPU, not cycles (a VM often has no hardware counters): a thread that waits spinning counts, a
thread that sleeps does not.
"""
import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: The sampling rate (per second, per thread) and how long the child runs before sampling
#: starts at most (its first steps compile or load the kernels)
FREQUENCY = 2000
READY_TIMEOUT = 900

#: Numba's escapes (``_`` and the hex code) of the characters of an engine instance's module
#: name that a symbol cannot hold (``attention[avx512-float32]``). Only these are undone: the
#: escape is ambiguous (``_f32`` is also a name's own text), and a function's name, a Python
#: identifier, has none.
_ESCAPES = {"_5b": "[", "_5d": "]", "_2d": "-", "_2e": "."}
_ABI_TAG = re.compile(r"\[abi:[^\]]*\]")


def _unescape(part):
    for escape, char in _ESCAPES.items():
        part = part.replace(escape, char)
    return part


def _itanium_parts(mangled):
    """The nested name of an Itanium-mangled symbol, ``_ZN6npattn7kernels...E``: its parts
    (<length><name> each), up to the first thing that is not one (an ABI tag, the argument
    types)."""
    parts, i = [], mangled.index("N") + 1
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        parts.append(mangled[j:j + n])
        i = j + n
    return parts


def function_name(answer):
    """The function gdb's ``info symbol`` answer names, readably: ``module.function`` for an
    npattn kernel (``gemm.block_product``), Numba's parfor bodies as ``parallel loop body``,
    other functions Numba compiled as ``numba: <its nested name>``, anything else by its
    symbol (``NRT_incref``); None when gdb found no symbol."""
    if answer.startswith("No symbol"):
        return None
    symbol = answer.split(" in section ")[0].rsplit(" + ", 1)[0].strip()
    if "__numba_parfor_gufunc" in symbol:
        return "parallel loop body (a prange kernel's own loop)"
    if symbol.startswith("npattn::kernels::"):                  # gdb demangled it
        parts = _ABI_TAG.sub("", symbol.split("(")[0]).split("::")[2:]
    elif "_ZN" in symbol:
        parts = _itanium_parts(symbol[symbol.index("_ZN"):])
        if parts[:1] == ["cpython"]:                            # the Python entry wrapper
            parts = parts[1:]
        if parts[:2] != ["npattn", "kernels"]:             # Numba's own compiled helpers
            return "numba: " + ".".join(parts) if parts else symbol
        parts = parts[2:]
    else:
        return symbol
    return f"{_unescape(parts[0]).split('[')[0]}.{parts[-1]}"


def category(name, dso):
    """The group of a sampled function (``name`` from :func:`function_name`, or perf's own
    symbol) in the object ``dso`` perf saw it in."""
    if name.startswith(("NRT_incref", "NRT_decref")):
        return "Numba's reference counting"
    if name.startswith(("NRT_", "nrt_")):
        return "Numba's runtime (allocation)"
    if name.startswith("parallel loop body"):
        return "Numba's parallel launch"
    if "libgomp" in dso or "omppool" in dso or "tbbpool" in dso or "workqueue" in dso:
        return "OpenMP runtime (threads waiting or meeting)"
    if dso.startswith(("/tmp/perf-", "[JIT", "[unknown")):     # code compiled at run time
        return "Numba's own helpers" if name.startswith("numba: ") else (
            "npattn kernels" if re.fullmatch(r"\w+\.\w+", name) else "other")
    if "libpython" in dso or dso.endswith("python3") or "/bin/python" in dso:
        return "Python interpreter"
    if "numpy" in dso or "_multiarray" in dso or "openblas" in dso:
        return "NumPy"
    if "kernel" in dso:
        return "operating system (page faults, scheduling)"
    if "libc" in dso or "libm" in dso or "ld-linux" in dso:
        return "C library (malloc, memset, libm)"
    return "other"


def tally(samples, names):
    """samples: (address, perf's symbol, dso) per sample; names: address -> function_name
    for the addresses perf could not name. Returns (share, name, category) rows, largest
    first, and the number of samples."""
    counts = collections.Counter()
    for address, symbol, dso in samples:
        name = names.get(address) if symbol == "[unknown]" else symbol
        if name is None:
            name = f"unnamed code in {os.path.basename(dso)}"
        counts[name, category(name, dso)] += 1
    total = sum(counts.values())
    return [(n / total, name, group) for (name, group), n in counts.most_common()], total


def _child(args):
    """The workload, in the child: build it, run it until its kernels are in, say so on
    stdout, then loop until stopped."""
    from .bench_gpt import BABY, GEN_BABY, GEN_QUICK, GEN_SIX, SIX, TRAIN_QUICK
    from .gpt_profile import generate_workload, train_workload
    if args.generate:
        step = generate_workload(GEN_QUICK if args.quick else GEN_SIX if args.six else GEN_BABY)
    else:
        step = train_workload(TRAIN_QUICK if args.quick else SIX if args.six else BABY)
    for _ in range(3):
        step()
    print("ready", flush=True)
    while True:
        step()


def _tools():
    missing = [tool for tool in ("perf", "gdb") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"benchmarks.native_profile needs {' and '.join(missing)} on PATH "
                 f"(not found); install {'them' if len(missing) > 1 else 'it'} (e.g. apt-get install linux-perf gdb) or use "
                 f"python -m benchmarks.gpt_profile, which needs neither")


def _perf_samples(pid, seconds, directory):
    data = os.path.join(directory, "perf.data")
    record = subprocess.run(["perf", "record", "-q", "-F", str(FREQUENCY), "-o", data, "-p",
                             str(pid), "--", "sleep", str(seconds)],
                            capture_output=True, text=True)
    if record.returncode != 0 or not os.path.exists(data):
        sys.exit(f"perf record failed ({record.returncode}): {record.stderr.strip()}")
    script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym,dso"],
                            capture_output=True, text=True)
    samples = []
    for line in script.stdout.splitlines():
        match = re.match(r"\s*([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$", line)
        if match:
            samples.append((match.group(1), match.group(2), match.group(3)))
    return samples


def _gdb_names(pid, addresses, directory):
    commands = os.path.join(directory, "gdb.commands")
    with open(commands, "w") as f:
        f.write("set pagination off\n")
        for address in addresses:
            f.write(f"info symbol 0x{address}\n")
    out = subprocess.run(["gdb", "-batch", "-nx", "-p", str(pid), "-x", commands],
                         capture_output=True, text=True).stdout
    answers = [line for line in out.splitlines()
               if " in section " in line or line.startswith("No symbol matches")]
    if len(answers) != len(addresses):
        sys.exit(f"gdb answered {len(answers)} of {len(addresses)} look-ups (attach refused? "
                 f"ptrace_scope must allow it: /proc/sys/kernel/yama/ptrace_scope)")
    return {address: function_name(answer) for address, answer in zip(addresses, answers)}


def report(rows, total, title, top):
    groups = collections.Counter()
    for share, _, group in rows:
        groups[group] += share
    lines = [f"**{title}**: {total} samples on all threads", "",
             "| group | % of samples |", "|---|---:|"]
    lines += [f"| {group} | {100 * share:.1f} |" for group, share in groups.most_common()]
    lines += ["", "| function | group | % of samples |", "|---|---|---:|"]
    lines += [f"| {name} | {group} | {100 * share:.1f} |" for share, name, group in rows[:top]]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--six", action="store_true", help="the 6-layer config")
    parser.add_argument("--generate", action="store_true", help="a generation, not a step")
    parser.add_argument("--quick", action="store_true",
                        help="gpt_profile's --quick sizes (1 layer, C 32, T 16, B 2)")
    parser.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="sampling time")
    parser.add_argument("--top", type=int, default=30, help="functions listed")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    _tools()
    command = [sys.executable, "-m", "benchmarks.native_profile", "--child"]
    command += ["--six"] * args.six + ["--generate"] * args.generate + ["--quick"] * args.quick
    env = {**os.environ, "NUMBA_NUM_THREADS": str(args.threads)}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while child.stdout.readline().strip() != "ready":
            if child.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the workload did not start (exit status {child.poll()})")
        with tempfile.TemporaryDirectory() as directory:
            samples = _perf_samples(child.pid, args.seconds, directory)
            unknown = sorted({a for a, symbol, _ in samples if symbol == "[unknown]"})
            names = _gdb_names(child.pid, unknown, directory) if unknown else {}
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    rows, total = tally(samples, names)
    what = "generation" if args.generate else "training step"
    sizes = "quick" if args.quick else "6-layer" if args.six else "baby"
    print(report(rows, total, f"{sizes} GPT {what}, {args.threads} threads, "
                              f"{args.seconds:g} s", args.top))


if __name__ == "__main__":
    main()
