"""Which outputs' bits depend on the CPU the kernels were compiled for.

    python -m benchmarks.target_bits                    # native against haswell, demo included
    python -m benchmarks.target_bits --targets native,haswell,skylake --no-demo
    python -m benchmarks.target_bits --targets native,haswell/avx2     # on an AVX-512 CPU
    python -m benchmarks.target_bits --targets native,native@-force-vector-width=16 --no-demo

Each target runs in child processes of its own, with an empty ``NUMBA_CACHE_DIR`` of its own
(no target is served another's code) and ``NUMBA_CPU_NAME`` set (``native``: unset, Numba
compiles for this CPU). ``name/avx2`` also sets ``NUMBA_CPU_FEATURES`` to Haswell's, AVX-512
off: under a bare ``NUMBA_CPU_NAME`` Numba keeps the host's features, so on an AVX-512 CPU
``haswell`` alone still compiles AVX-512 code. A target may end in ``@`` and LLVM options,
comma-separated: ``native@-force-vector-width=16`` forces the loop vectoriser's width to 16
lanes (AVX-512's float32 width) on the AVX2 CPU that runs it, which shows the ops whose bits
follow the vector width. Every target runs on this machine's cores: the comparison isolates
the code LLVM generates from the hardware that runs it.

A child runs every public op, forward and backward, on float32 and float64 inputs from fixed
seeds (``tests/test_stress.py::make_calls``, at two sizes, plus the KV-cache decode step) and
saves every output; with ``--demo`` it also trains ``npattn demo`` and keeps its fingerprint.
The parent prints, per call, whether the bytes are equal and, where not, how many elements
differ and by how much (in units of the dtype's eps times the output's largest magnitude).
Exit status 0 either way: this is a measurement.

Compiling every kernel for a target takes minutes (both dtypes); the demo ~1 min more.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.isa import AVX2_FEATURES

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _kv_cache_call(rng, dtype):
    import npattn
    q = rng.standard_normal((2, 4, 3, 16)).astype(dtype)
    k_new = rng.standard_normal((2, 2, 3, 16)).astype(dtype)
    v_new = rng.standard_normal((2, 2, 3, 16)).astype(dtype)
    k_cache = rng.standard_normal((2, 2, 300, 16)).astype(dtype)
    v_cache = rng.standard_normal((2, 2, 300, 16)).astype(dtype)
    return lambda: npattn.scaled_dot_product_attention_with_kv_cache(
        q, k_cache.copy(), v_cache.copy(), 290, k_new, v_new, is_causal=True, enable_gqa=True)


def op_outputs():
    """{"<dtype> s<scale> <call>": [arrays]} for every public op, forward and backward."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_stress import make_calls
    outputs = {}
    for dtype in (np.float32, np.float64):
        for scale in (0, 3):
            rng = np.random.default_rng(1234 + scale)
            calls = make_calls(rng, scale, dtype)
            calls["kv_cache decode"] = _kv_cache_call(rng, dtype)
            for name, call in calls.items():
                result = call()
                result = result if isinstance(result, tuple) else (result,)
                outputs[f"{np.dtype(dtype).name} s{scale} {name}"] = [
                    np.asarray(r) for r in result if r is not None]
    return outputs


def child(out_dir, demo):
    import llvmlite.binding as llvm
    for option in filter(None, os.environ.get("NPATTN_BITS_LLVM_OPTIONS", "").split(",")):
        llvm.set_option("target_bits", option)     # before any kernel compiles
    import numba
    from npattn.kernels import tiles
    outputs = op_outputs()
    np.savez(pathlib.Path(out_dir) / "outputs.npz",
             **{f"{name}|{i}": a for name, arrays in outputs.items()
                for i, a in enumerate(arrays)})
    info = dict(cpu_name=numba.config.CPU_NAME or llvm.get_host_cpu_name(),
                isa=tiles.isa_in_force())
    if demo:
        from npattn.tools import demo as demo_tool
        info["demo"] = demo_tool.train(out=lambda *a, **k: None)["fingerprint"]
    (pathlib.Path(out_dir) / "info.json").write_text(json.dumps(info))


def run_target(target, work, demo):
    out_dir = pathlib.Path(work) / "".join(c if c.isalnum() else "-" for c in target)
    out_dir.mkdir()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(out_dir / "cache"))
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    target, _, options = target.partition("@")
    if options:                                  # LLVM's own options, e.g. a vector width
        env["NPATTN_BITS_LLVM_OPTIONS"] = options
    name, _, features = target.partition("/")
    if name != "native":
        env["NUMBA_CPU_NAME"] = name
    if features == "avx2":
        env["NUMBA_CPU_FEATURES"] = AVX2_FEATURES
    elif features:
        raise SystemExit(f"target {target!r}: the only feature set is /avx2")
    cmd = [sys.executable, "-m", "benchmarks.target_bits", "--child", str(out_dir)]
    if demo:
        cmd.append("--demo")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    info = json.loads((out_dir / "info.json").read_text())
    with np.load(out_dir / "outputs.npz") as data:
        arrays = {key: data[key] for key in data.files}
    return info, arrays


def compare(base, other):
    """[(call, output index, differing elements, size, worst |diff| / (eps · max|base|))]."""
    rows = []
    for key in sorted(base):
        a, b = base[key], other[key]
        if a.tobytes() == b.tobytes():
            continue
        differ = int(np.sum(~((a == b) | (np.isnan(a) & np.isnan(b)))))
        finite = np.isfinite(a) & np.isfinite(b)
        scale = float(np.max(np.abs(a[finite]))) if finite.any() else 1.0
        eps = float(np.finfo(a.dtype).eps)
        worst = float(np.max(np.abs(a[finite] - b[finite]))) / (eps * scale) if finite.any() \
            else float("nan")
        name, index = key.rsplit("|", 1)
        rows.append((name, int(index), differ, a.size, worst))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.target_bits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="native,haswell",
                        help="NUMBA_CPU_NAME values, 'native' for this CPU (default "
                             "native,haswell); the first is the baseline")
    parser.add_argument("--demo", action=argparse.BooleanOptionalAction, default=True,
                        help="also train npattn demo and compare its fingerprint")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.demo)
        return 0
    targets = [t for t in args.targets.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="npattn-bits-") as work:
        results = {t: run_target(t, work, args.demo) for t in targets}
    base_info, base = results[targets[0]]
    print(f"baseline: {targets[0]} (Numba's target {base_info['cpu_name']}, "
          f"tiles {base_info['isa']}), {len(base)} output arrays"
          + (f", demo fingerprint {base_info['demo']}" if args.demo else ""))
    for target in targets[1:]:
        info, arrays = results[target]
        rows = compare(base, arrays)
        print(f"\n{target} (Numba's target {info['cpu_name']}, tiles {info['isa']}): "
              f"{len(rows)} of {len(base)} output arrays differ"
              + (f"; demo fingerprint {info['demo']}" if args.demo else ""))
        for name, index, differ, size, worst in rows:
            print(f"  {name} [output {index}]: {differ}/{size} elements, "
                  f"worst {worst:.2g} eps·max|out|")
    return 0


if __name__ == "__main__":
    sys.exit(main())
