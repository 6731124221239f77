"""Does a fixed number of partial sums make a reduction target-independent, and what does it cost?

    python -m benchmarks.fixed_sums                       # bits digests and interleaved times
    python -m benchmarks.fixed_sums --llvm-option=-force-vector-width=16   # digests only

Softmax's pass 2 (exp of x - max, store, sum) in two forms, compiled here (not the library's
kernel, which is left alone), serial, one row at a time:

* ``reassoc``: as ``kernels/softmax.py`` writes it, ``s += e`` under the project's fastmath
  (``contract``, ``reassoc``): LLVM splits the sum into as many partial sums as the target's
  vector width and interleave give, so the bits follow the target;
* ``lanes16``: 16 partial sums held in a scratch array, ``acc[l] += e`` for the 16 entries of a
  chunk, then the tail and a fixed halving tree; compiled with ``contract`` only (no
  ``reassoc``): LLVM may vectorise the lane loop (independent lanes) but not reorder a sum, so
  the bits are the same at any vector width.

It prints a digest of each form's output (compare the digests of two runs with different
``--llvm-option``s) and, without options, the two forms' times in interleaved rounds.
"""
import argparse
import hashlib
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fixed_sums")
    parser.add_argument("--llvm-option", action="append", default=[],
                        help="an LLVM option set before compiling (e.g. -force-vector-width=16)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    import llvmlite.binding as llvm
    for option in args.llvm_option:
        llvm.set_option("fixed_sums", option)
    import numpy as np
    from numba import njit
    from npattn import _jit
    from npattn.kernels.exp import exp_one_native

    reassoc = dict(nogil=True, error_model="numpy", fastmath=_jit.FASTMATH)
    contract = dict(nogil=True, error_model="numpy", fastmath={"contract"})

    @njit(**reassoc)
    def rows_reassoc(x, out):
        for n in range(x.shape[0]):
            xn, row = x[n], out[n]
            m = xn.max()
            s = x.dtype.type(0)
            for k in range(xn.shape[0]):
                e = exp_one_native(xn[k] - m)
                row[k] = e
                s += e
            inv = 1 / s
            for k in range(row.shape[0]):
                row[k] *= inv

    @njit(**contract)
    def rows_lanes16(x, out):
        acc = np.empty(16, x.dtype)
        for n in range(x.shape[0]):
            xn, row = x[n], out[n]
            m = xn.max()
            acc[:] = 0
            full = xn.shape[0] - xn.shape[0] % 16
            for c in range(0, full, 16):
                xc, rc = xn[c:c + 16], row[c:c + 16]
                for lane in range(16):
                    e = exp_one_native(xc[lane] - m)
                    rc[lane] = e
                    acc[lane] += e
            tail = x.dtype.type(0)
            for k in range(full, xn.shape[0]):
                e = exp_one_native(xn[k] - m)
                row[k] = e
                tail += e
            for width in (8, 4, 2, 1):
                for lane in range(width):
                    acc[lane] += acc[lane + width]
            inv = 1 / (acc[0] + tail)
            for k in range(row.shape[0]):
                row[k] *= inv

    @njit(**contract)
    def lane_sums(row, acc):
        # the 16 partial sums of row's full chunks, lane by lane (no reassoc: independent lanes)
        acc[:] = 0
        full = row.shape[0] - row.shape[0] % 16
        for c in range(0, full, 16):
            rc = row[c:c + 16]
            for lane in range(16):
                acc[lane] += rc[lane]
        tail = row.dtype.type(0)
        for k in range(full, row.shape[0]):
            tail += row[k]
        for width in (8, 4, 2, 1):
            for lane in range(width):
                acc[lane] += acc[lane + width]
        return acc[0] + tail

    @njit(**reassoc)
    def rows_split(x, out):
        # exp and store in one vector loop (no sum), then the fixed 16-lane sum of the row (in L1)
        acc = np.empty(16, x.dtype)
        for n in range(x.shape[0]):
            xn, row = x[n], out[n]
            m = xn.max()
            for k in range(xn.shape[0]):
                row[k] = exp_one_native(xn[k] - m)
            inv = 1 / lane_sums(row, acc)
            for k in range(row.shape[0]):
                row[k] *= inv

    forms = {"reassoc": rows_reassoc, "lanes16": rows_lanes16, "split16": rows_split}
    cases = [(np.float32, 4096, 1024), (np.float32, 64, 10), (np.float32, 8192, 77),
             (np.float64, 2048, 1024)]
    inputs = []
    for dtype, n, c in cases:
        x = (np.random.default_rng(0).standard_normal((n, c)) * 3).astype(dtype)
        inputs.append((x, np.empty_like(x)))
    print(f"LLVM options: {args.llvm_option or 'none'}")
    for (dtype, n, c), (x, out) in zip(cases, inputs):
        digests = {}
        for name, form in forms.items():
            form(x, out)
            digests[name] = hashlib.sha256(out.tobytes()).hexdigest()[:16]
        ref = np.exp(x - x.max(1, keepdims=True).astype(np.float64))
        ref /= ref.sum(1, keepdims=True)
        err = {}
        for name, form in forms.items():
            form(x, out)
            err[name] = float(np.abs(out - ref).max())
        print(f"  {np.dtype(dtype).name} ({n}, {c}): digests {digests}, max |err| vs float64 "
              + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    if args.llvm_option:
        return 0
    print(f"interleaved times, {args.rounds} rounds, medians (× reassoc's):")
    for (dtype, n, c), (x, out) in zip(cases, inputs):
        times = {name: [] for name in forms}
        for r in range(args.rounds):
            order = list(forms) if r % 2 == 0 else list(forms)[::-1]
            for name in order:
                reps = max(1, int(2e6 // (n * c)))
                start = time.perf_counter()
                for _ in range(reps):
                    forms[name](x, out)
                times[name].append((time.perf_counter() - start) / reps * 1e3)
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"  {np.dtype(dtype).name} ({n}, {c}): reassoc {med['reassoc']:.3f} ms; "
              + ", ".join(f"{k} {med[k]:.3f} ms ({med[k] / med['reassoc']:.3f}×)"
                          for k in forms if k != "reassoc"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
