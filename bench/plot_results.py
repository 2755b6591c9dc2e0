"""Plots an iud-bench results folder: DIR/results.csv -> DIR/results.png.

One row of panels per (workload, op, descriptors per request): throughput (GB/s) vs block size per
backend, each backend's ratio to the first baseline (backend [B], the second --backend spec), and
CPU seconds per GB. ci/bench.sh runs it after iud-bench --out_dir DIR.

Usage: python bench/plot_results.py DIR
Needs matplotlib (ci/bench.sh installs it into .venv; the test suite does not need it).
"""

import csv
import math
import os
import sys


def load(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def groups(rows):
    """(title, key) per panel row: KV rows by op (their descriptor count varies with the block);
    per-request rows by mode, op and layout; contiguous rows by op and descriptors per request."""
    out = []
    for r in rows:
        if r["workload"] == "kv":
            key = ("kv", r["op"], None)
            title = f"KV-cache {r['op']} (scattered, medians of {r['rounds']} rounds)"
        elif r["workload"].startswith("req"):
            key = ("req", r["workload"], r["op"], r["layout"])
            title = f"per request ({r['workload']}) {r['op']}, {'contiguous' if r['layout'] == 'contig' else 'scattered'}"
        else:
            key = ("contig", r["op"], r["descs"], r["layout"])
            title = f"contiguous sweep {r['op']}, {r['descs']} desc/request ({r['layout']})"
        if (title, key) not in out:
            out.append((title, key))
    return out


def in_group(r, key):
    if key[0] == "kv":
        return r["workload"] == "kv" and r["op"] == key[1]
    if key[0] == "req":
        return (r["workload"], r["op"], r["layout"]) == key[1:]
    return r["workload"] == "contig" and (r["op"], r["descs"], r["layout"]) == key[1:]


def size_label(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def fnum(s):
    try:
        v = float(s)
    except (TypeError, ValueError):
        return math.nan
    return v


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = sys.argv[1]
    rows = load(os.path.join(d, "results.csv"))
    if not rows:
        sys.exit(f"{d}/results.csv has no rows")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    backends = {}
    for r in rows:
        backends.setdefault(int(r["backend_index"]), r["backend"])
    letters = {i: chr(ord("A") + i) for i in backends}
    panels = groups(rows)
    has_ratio = 1 in backends and len(backends) > 1
    ncol = 3 if has_ratio else 2
    fig, axes = plt.subplots(
        len(panels), ncol, figsize=(6 * ncol, 3.6 * len(panels)), squeeze=False
    )
    for row_i, (title, key) in enumerate(panels):
        sel = [r for r in rows if in_group(r, key)]
        blocks = sorted({int(r["block"]) for r in sel})
        ax_bw, ax_cpu = axes[row_i][0], axes[row_i][ncol - 1]
        ax_ratio = axes[row_i][1] if has_ratio else None
        for b, label in sorted(backends.items()):
            pts = sorted((int(r["block"]), r) for r in sel if int(r["backend_index"]) == b)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            name = f"[{letters[b]}] {label}"
            style = dict(marker="o", label=name, color=f"C{b % 10}")
            ax_bw.plot(xs, [fnum(p[1]["gbps"]) for p in pts], **style)
            ax_cpu.plot(xs, [fnum(p[1]["cpu_s_per_gb"]) for p in pts], **style)
            if ax_ratio is not None and b != 1:
                ax_ratio.plot(xs, [fnum(p[1]["ratio_vs_baseline"]) for p in pts], **style)
        ax_bw.set_title(title, fontsize=9)
        ax_bw.set_ylabel("GB/s")
        ax_cpu.set_ylabel("CPU s per GB")
        ax_cpu.set_title("CPU time per GB (getrusage of the process)", fontsize=9)
        ax_cpu.set_yscale("log")
        ax_cpu.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax_cpu.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax_cpu.yaxis.set_minor_formatter(NullFormatter())
        ax_cpu.tick_params(axis="y", which="both", labelsize=7)
        if ax_ratio is not None:
            ax_ratio.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            ax_ratio.set_ylabel("GB/s / [B] GB/s")
            ax_ratio.legend(fontsize=7)
            ax_ratio.set_title(f"ratio vs first baseline [B] {backends[1]}", fontsize=9)
        for ax in axes[row_i]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(blocks)
            ax.set_xticklabels([size_label(b) for b in blocks], fontsize=7)
            ax.set_xlabel("block size")
            ax.grid(True, alpha=0.3)
        ax_bw.legend(fontsize=7)
    bg = rows[0].get("background_load", "0")
    fig.suptitle(
        f"iud-bench {os.path.basename(os.path.abspath(d))} (background load: {bg} busy processes)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out = os.path.join(d, "results.png")
    fig.savefig(out, dpi=90)
    print(f"plot written: {out}")


if __name__ == "__main__":
    main()
