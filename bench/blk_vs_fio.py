#!/usr/bin/env python3
"""IO_URING_DMABUF (through NIXL, iud-bench with the target registered as BLOCK) against fio
(ioengine=io_uring, fixedbufs, registerfiles, direct=1) on the same block device, point by point,
and one side-by-side table. Called by bench/blk-vs-fio.sh, which builds, sets the NIXL
environment and makes the loop device; see there.

Each point (op, layout, block size, batch) runs every tool back to back on the same device
range, --reps times, the order rotating from run to run so that a change of machine load hurts
every tool alike; a cell is the median of its runs. Tools:

  iud-bench (columns "IUD spin", "IUD yield": --poll_mode): one request of `batch` descriptors of `block` bytes, posted, polled until done,
             posted again, for --duration-ms (after <= 10 warm-up requests, at most a fifth of
             the duration). Descriptor j = DRAM block j <-> device block j of [0, batch*block);
             layout rand shuffles the device blocks (every descriptor stays a separate I/O),
             layout seq keeps them in order (the engine merges neighbours into larger I/Os).
             spin polls getXferStatus in a busy loop (nixlbench); yield calls sched_yield between
             polls, which leaves the CPU to kernel threads the device needs (loop workers).
  iud-lab --bench --no-fio (column "engine", with --engine): the same engine without NIXL, same
             pattern (ci/vm/lab/src/bench.rs).
  fio:       the same range (offset=0, size=batch*block), iodepth=batch with
             iodepth_batch_submit = iodepth_batch_complete_min = iodepth_batch_complete_max =
             batch: submit `batch` I/Os in one io_uring_enter, wait for all of them, submit again
             -- the request pattern of iud-bench. rw=randread/randwrite (random map: every block
             once per pass, like the shuffle) or read/write; ramp_time = a fifth of the duration.

Only the standard library is used (Python 3.8+).
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import tempfile


def parse_size(s):
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1].upper() in mult:
        return int(s[:-1]) * mult[s[-1].upper()]
    return int(s)


def human(b):
    for unit, shift in (("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def si(v):
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def run(cmd, log):
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(p.stdout)
    log.flush()
    return p


def iud_point(a, poll, op, layout, block, batch, log):
    with tempfile.NamedTemporaryFile(prefix="iud-blk-", suffix=".csv", delete=False) as t:
        path = t.name
    try:
        cmd = [
            a.iud_bench,
            "--backend",
            a.backend,
            "--filepath",
            a.device,
            "--storage_enable_direct",
            "--storage_seg_type",
            "BLOCK",
            "--op_type",
            op,
            "--total_buffer_size",
            str(a.region),
            "--start_block_size",
            str(block),
            "--max_block_size",
            str(block),
            "--batch_sizes",
            str(batch),
            "--randomize_location_mode",
            "blockaligned" if layout == "rand" else "none",
            "--num_iter",
            "0",
            "--duration_ms",
            str(a.duration_ms),
            "--warmup_iter",
            "10",
            "--poll_mode",
            poll,
            "--csv",
            path,
        ]
        if a.check:
            cmd.append("--check_consistency")
        p = run(cmd, log)
        rows = list(csv.DictReader(open(path)))
        if p.returncode != 0 or len(rows) != 1:
            tail = "\n".join(p.stdout.strip().splitlines()[-5:])
            raise SystemExit(
                f"iud-bench failed (exit {p.returncode}) at {op} {layout} {block} x {batch}:\n{tail}"
            )
        r = rows[0]
        return float(r["iops"]), float(r["gbps"])
    finally:
        os.unlink(path)


def engine_point(a, op, layout, block, batch, log):
    """The engine without NIXL: ci/vm/lab's iud-lab --bench for one point, engine only."""
    cmd = [
        a.engine,
        "--bench",
        "--device",
        a.device,
        "--overwrite",
        "--no-fio",
        "--ops",
        op,
        "--layouts",
        layout,
        "--blocks",
        str(block),
        "--batches",
        str(batch),
        "--duration-ms",
        str(a.duration_ms),
        "--poll",
        a.engine_poll,
    ]
    p = run(cmd, log)
    for line in p.stdout.splitlines():
        f = line.split(",")
        if f[0] == "BENCH" and f[1] == "engine":
            return float(f[6]), float(f[7])
    tail = "\n".join(p.stdout.strip().splitlines()[-5:])
    raise SystemExit(
        f"iud-lab --bench failed (exit {p.returncode}) at {op} {layout} {block} x {batch}:\n{tail}"
    )


def fio_point(a, op, layout, block, batch, log):
    rw = {
        ("READ", "rand"): "randread",
        ("WRITE", "rand"): "randwrite",
        ("READ", "seq"): "read",
        ("WRITE", "seq"): "write",
    }[(op, layout)]
    cmd = [
        a.fio,
        "--name=p",
        f"--filename={a.device}",
        "--ioengine=io_uring",
        "--fixedbufs=1",
        "--registerfiles=1",
        "--direct=1",
        f"--rw={rw}",
        f"--bs={block}",
        "--offset=0",
        f"--size={block * batch}",
        f"--iodepth={batch}",
        f"--iodepth_batch_submit={batch}",
        f"--iodepth_batch_complete_min={batch}",
        f"--iodepth_batch_complete_max={batch}",
        "--time_based=1",
        f"--runtime={a.duration_ms}ms",
        f"--ramp_time={a.duration_ms // 5}ms",
        "--gtod_reduce=1",
        "--scramble_buffers=0",
        "--output-format=json",
    ]
    p = run(cmd, log)
    try:
        j = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    except (ValueError, KeyError, IndexError) as e:
        raise SystemExit(
            f"fio failed (exit {p.returncode}) at {op} {layout} {block} x {batch}:\n{p.stdout[-1500:]}"
        ) from e
    if p.returncode != 0 or j.get("error"):
        raise SystemExit(
            f"fio error {j.get('error')} (exit {p.returncode}) at {op} {layout} {block} x {batch}"
        )
    side = j["read" if op == "READ" else "write"]
    return float(side["iops"]), float(side["bw_bytes"]) / 1e9


def short(t):
    """Ratio column name: 'IUD spin' -> 'spin', 'engine yield' -> 'engine'."""
    w = t.split()
    return w[-1] if w[0] == "IUD" and len(w) > 1 else w[0]


def table(rows, tools, reps, legend=None):
    """rows: dicts with op/layout/block/batch and, per tool label, its median IOPS. The first line
    of the header names the tools, the ratio columns give each tool's IOPS / fio's IOPS."""
    others = [t for t in tools if t != "fio"]
    g = 18  # width of one tool's IOPS + GB/s group
    top = (
        " " * 25
        + "".join(f"|{t:^{g}}" for t in tools)
        + "|"
        + f"{'IOPS / fio IOPS':^{8 * len(others)}}"
    )
    hdr = (
        f"{'Op':<6}{'Layout':<7}{'Block':>6}{'Batch':>6}"
        + f"|{'IOPS':>9}{'GB/s':>8} " * len(tools)
        + "|"
        + "".join(f"{short(t):>8}" for t in others)
    )
    out = [top.rstrip(), hdr, "-" * len(hdr)]
    ratios = {t: [] for t in others}
    for r in rows:
        line = f"{r['op']:<6}{r['layout']:<7}{human(r['block']):>6}{r['batch']:>6}"
        for t in tools:
            line += f"|{si(r[t]):>9}{r[t] * r['block'] / 1e9:>8.3f} "
        line += "|"
        for t in others:
            if r["fio"] > 0:
                ratios[t].append(r[t] / r["fio"])
                line += f"{r[t] / r['fio']:>8.2f}"
            else:
                line += f"{'-':>8}"
        out.append(line)
    out.append("-" * len(hdr))
    for t in others:
        v = ratios[t]
        if v:
            out.append(
                f"{t} / fio over {len(v)} points: geometric mean {statistics.geometric_mean(v):.2f}, "
                f"median {statistics.median(v):.2f}, min {min(v):.2f}, max {max(v):.2f}"
            )
    for line in legend or []:
        out.append(line)
    out.append(
        "IOPS = I/Os of one block per second; GB/s decimal"
        + (
            f"; each cell: median of {reps} runs per tool, run in rotating order"
            if reps > 1
            else ""
        )
    )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", required=True)
    ap.add_argument("--iud-bench", required=True)
    ap.add_argument("--fio", default="fio")
    ap.add_argument("--backend", default="IO_URING_DMABUF")
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--layouts", default="rand,seq")
    ap.add_argument(
        "--block-sizes", default="4K-1M", help="LO-HI (doubling) or a list, e.g. 4K,64K,1M"
    )
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--duration-ms", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--poll-modes",
        default="spin,yield",
        help="iud-bench --poll_mode per IUD column: spin (getXferStatus in a busy loop, "
        "nixlbench) and/or yield (sched_yield between polls)",
    )
    ap.add_argument(
        "--engine",
        default=None,
        help="iud-lab binary: adds an ENG column, the engine without NIXL (iud-lab --bench)",
    )
    ap.add_argument("--engine-poll", default="yield", choices=["spin", "yield"])
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip iud-bench's consistency check (outside the timed loop)",
    )
    ap.add_argument(
        "--log", default=None, help="full output of every command (default: a temp file)"
    )
    a = ap.parse_args()

    if "-" in a.block_sizes:
        lo, hi = (parse_size(x) for x in a.block_sizes.split("-"))
        blocks = []
        while lo <= hi:
            blocks.append(lo)
            lo *= 2
    else:
        blocks = [parse_size(x) for x in a.block_sizes.split(",")]
    batches = [int(x) for x in a.batch_sizes.split(",")]
    a.region = max(blocks) * max(batches)
    log = (
        open(a.log, "w")
        if a.log
        else tempfile.NamedTemporaryFile("w", prefix="blk-vs-fio-", suffix=".log", delete=False)
    )
    print(f"per-command output: {log.name}")

    tools = []  # (label, function)
    polls = [p for p in a.poll_modes.split(",") if p]
    for p in polls:
        if p not in ("spin", "yield"):
            raise SystemExit(f"--poll-modes: spin|yield, got {p}")
        label = f"IUD {p}"
        tools.append((label, lambda op, l, b, n, p=p: iud_point(a, p, op, l, b, n, log)))
    if a.engine:
        tools.append(
            (f"engine {a.engine_poll}", lambda op, l, b, n: engine_point(a, op, l, b, n, log))
        )
    tools.append(("fio", lambda op, l, b, n: fio_point(a, op, l, b, n, log)))
    labels = [t[0] for t in tools]

    rows = []
    k = 0
    for op in a.ops.upper().split(","):
        for layout in a.layouts.split(","):
            for batch in batches:
                for block in blocks:
                    got = {t: [] for t in labels}
                    for _ in range(a.reps):
                        # Rotate who goes first, so that a load change hurts every tool alike.
                        order = tools[k % len(tools) :] + tools[: k % len(tools)]
                        k += 1
                        for label, fn in order:
                            got[label].append(fn(op, layout, block, batch)[0])
                    r = {"op": op, "layout": layout, "block": block, "batch": batch}
                    r.update({t: statistics.median(v) for t, v in got.items()})
                    rows.append(r)
                    print(
                        f"  {op:<5} {layout:<4} {human(block):>5} x {batch:<3} "
                        + "  ".join(f"{t} {si(r[t]):>7}" for t in labels),
                        flush=True,
                    )
    print()
    legend = [
        f"IUD {p}: IO_URING_DMABUF through NIXL (iud-bench, BLOCK registration), getXferStatus polled "
        + ("in a busy loop (nixlbench's way)" if p == "spin" else "with sched_yield between polls")
        for p in polls
    ]
    if a.engine:
        legend.append(
            f"engine {a.engine_poll}: the same engine without NIXL (iud-lab --bench, Engine::check polled "
            + ("in a busy loop)" if a.engine_poll == "spin" else "with sched_yield between polls)")
        )
    legend.append(
        "fio: ioengine=io_uring fixedbufs registerfiles direct=1, iodepth = batch, "
        "submits a batch and waits for all of it (iodepth_batch_submit = _complete_min = batch)"
    )
    print(table(rows, labels, a.reps, legend))


if __name__ == "__main__":
    main()
