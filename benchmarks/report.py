"""What a run writes: the Markdown table, results.json and the GFLOP/s plots."""
import json
from collections import defaultdict

from .cases import BASELINE, IMPLEMENTATIONS

#: A case during which other processes took more than this share of the CPUs is marked.
BUSY = 0.10
#: The x axis of a figure, when it is not "n".
X_LABELS = {"attention": "L = S"}


def fmt_time(seconds):
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def fmt_rate(gflops):
    return f"{gflops:.3g}" if gflops < 100 else f"{gflops:.0f}"


def cell(result, flops, tokens=None):
    """``1.23 ms ±2% · 456 GF/s``: median, half the interquartile range, GFLOP/s (and
    ``· 7,890 tok/s`` for a case that processes ``tokens`` tokens per call)."""
    if result is None:
        return "—"
    spread = (result["q3"] - result["q1"]) / 2 / result["median"] * 100
    rate = "" if not tokens else f" · {tokens / result['median']:,.0f} tok/s"
    return (f"{fmt_time(result['median'])} ±{spread:.0f}% · "
            f"{fmt_rate(flops / result['median'] / 1e9)} GF/s{rate}")


def speedup(case, peer):
    ours, theirs = case["results"].get("npattn"), case["results"].get(peer)
    if not ours or not theirs:
        return "—"
    ratio = theirs["median"] / ours["median"]
    return f"{ratio:.2f}×" if ratio >= 0.1 else f"{ratio:.2g}×"


def fmt_bytes(n):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def memory(case):
    peaks = [case["results"].get(name, {}).get("peak_bytes") for name in ("npattn", "NumPy")]
    if all(p is None for p in peaks):
        return ""
    return " / ".join("—" if p is None else fmt_bytes(p) for p in peaks)


def table(cases):
    """The Markdown table: one row per case, one column per implementation, then the ratios.
    Cases with a baseline (Bench.baseline) follow in a table of their own, which adds the
    baseline's time and baseline ÷ npattn."""
    plain = [c for c in cases if BASELINE not in c["results"]]
    based = [c for c in cases if BASELINE in c["results"]]
    head = ("| case | npattn | NumPy | PyTorch | speedup vs NumPy | speedup vs PyTorch "
            "| peak memory npattn / NumPy |")
    lines, notes, busy = [], [], False
    for group, extra in ((plain, ""), (based, " npattn baseline | speedup vs baseline |")):
        if not group:
            continue
        if lines:
            lines.append("")
        lines += [head + extra, "|---|---|---|---|---|---|---|" + "---|" * extra.count("|")]
        for case in group:
            label = case["label"]
            if case.get("foreign_cpu") is not None and case["foreign_cpu"] > BUSY:
                label += " †"
                busy = True
            skipped = case.get("skipped", {})
            cells = ["skipped" if name in skipped else
                     cell(case["results"].get(name), case["flops"], case.get("tokens"))
                     for name in IMPLEMENTATIONS]
            row = (f"| {label} | " + " | ".join(cells) + f" | {speedup(case, 'NumPy')} | "
                   f"{speedup(case, 'PyTorch')} | {memory(case)} |")
            if extra:
                row += (f" {fmt_time(case['results'][BASELINE]['median'])} | "
                        f"{speedup(case, BASELINE)} |")
                notes.append(f"{case['label']}: baseline = {case['baseline']}.")
            lines.append(row)
            notes += [n for n in case.get("notes", ()) if n not in notes]
            notes += [f"{case['label']}: {name} skipped: {why}." for name, why in skipped.items()]
    lines.append("")
    lines.append("Each cell: median time per op ±½ interquartile range · GFLOP/s. "
                 "Speedup = peer median / npattn median (> 1: npattn is faster). Peak memory: "
                 "tracemalloc's peak during one call, outputs included.")
    if busy:
        lines.append(f"† other processes used more than {BUSY:.0%} of the CPUs during this case.")
    lines += notes
    return "\n".join(lines)


def _rss(result):
    if result is None:
        return "—"
    if "extra_bytes" in result:
        return fmt_bytes(max(0, result["extra_bytes"]))
    return "skipped" if "skipped" in result else "failed"


def rss_progress(case):
    """One line: each implementation's peak extra memory, and npattn's against the operands."""
    parts = [f"{name} {'+' if 'extra_bytes' in r else ''}{_rss(r)}"
             for name, r in case["rss"].items()]
    ours, size = case["rss"].get("npattn", {}).get("extra_bytes"), case.get("operand_bytes")
    if size:
        parts.append(f"operands {fmt_bytes(size)}"
                     + (f": npattn {max(0, ours) / size:.2f}×" if ours is not None else ""))
    errors = [f"{n}: {r['error']}" for n, r in case["rss"].items() if "error" in r]
    return ", ".join(parts) + "".join(f"\n    {e}" for e in errors)


def rss_table(cases):
    """Peak resident memory above the baseline, one call per fresh process (memory.py)."""
    lines = ["| case | operands | npattn | NumPy | PyTorch | npattn ÷ operands |",
             "|---|---|---|---|---|---|"]
    methods = set()
    for case in cases:
        if not case.get("rss"):
            continue
        size = case.get("operand_bytes")
        ours = case["rss"].get("npattn", {}).get("extra_bytes")
        ratio = f"{max(0, ours) / size:.2f}×" if ours is not None and size else "—"
        methods |= {r["method"] for r in case["rss"].values() if "method" in r}
        lines.append(f"| {case['label']} | {fmt_bytes(size) if size else '—'} | "
                     + " | ".join("skipped" if name in case.get("skipped", {})
                                  else _rss(case["rss"].get(name)) for name in IMPLEMENTATIONS)
                     + f" | {ratio} |")
    lines += ["", "Peak memory of one call above the process's resident set just before it "
              "(imports, inputs and a small warm-up call already in; outputs included), each "
              "implementation in a fresh process (`benchmarks/memory.py`; measured as "
              f"{', '.join(sorted(methods)) or '—'}). Operands: the inputs and the output of the "
              "forward (attention: q, k, v and the output, for fwd+bwd too)."]
    return "\n".join(lines)


def first_calls(cases, threshold=0.05):
    """npattn's first calls that took notably longer than its steady state: compile or load."""
    rows = []
    for case in cases:
        ours = case["results"].get("npattn")
        if ours and ours["first_call"] - ours["median"] > threshold:
            rows.append(f"{case['label']}: {ours['first_call']:.2f} s")
    return rows


def write_json(path, record):
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str) + "\n")


def plot(cases, out_dir, caption):
    """One PNG per figure (``gemm.png``...): GFLOP/s against size, a panel per dtype.

    Returns the paths written, or a message saying why nothing was.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib, or '.[bench]')"
    figures = defaultdict(lambda: defaultdict(list))       # figure -> panel -> [case]
    for case in cases:
        if case.get("plot"):
            figure, panel, _ = case["plot"]
            figures[figure][panel].append(case)
    written = []
    for figure, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (panel, members) in zip(axes[0], sorted(panels.items())):
            members = sorted(members, key=lambda c: c["plot"][2])
            for name in IMPLEMENTATIONS:
                points = [(c["plot"][2], c["flops"] / c["results"][name]["median"] / 1e9)
                          for c in members if name in c["results"]]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks([c["plot"][2] for c in members], [str(c["plot"][2]) for c in members])
            ax.set_xlabel(X_LABELS.get(figure, "n"))
            ax.set_ylabel("GFLOP/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{figure} {panel}")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(caption, fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{figure}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
