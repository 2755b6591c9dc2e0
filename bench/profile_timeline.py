#!/usr/bin/env python3
"""Where a request's time goes, from a benchmark log run with IO_URING_DMABUF_PROFILE=1.

The plugin logs one "profile: request done in T ms: ... first / last I/O reaped at A / B ms,
first copy started at C ms, last seen done at D ms" line per request (src/xfer/profile.rs);
bench/gpu_vram_bench.py prints one "req BACKEND proc P round R OP KIND BLOCK x COUNT ..." line
after each measurement's requests. Each profile line is counted toward the next "req" line. The
untimed warm-up and verification requests of a measurement are among them. Prints a markdown
table of medians per (backend, kind, block, count):

    python3 bench/profile_timeline.py per-request-latency.log
"""

import re
import statistics
import sys

PROFILE = re.compile(
    r"profile: request done in ([\d.]+) ms: storage I/O [\d.]+ ms summed over (\d+) I/Os; "
    r"device copies: (\d+) started .*first / last I/O reaped at ([\d.]+) / ([\d.]+) ms, "
    r"first copy started at ([\d.]+) ms, last seen done at ([\d.]+) ms"
)
REQ = re.compile(r"^req (\S+) proc \d+ round \d+ (\w+) (\w+) (\d+) x (\d+) ")
COLUMNS = (
    "request ms",
    "I/Os",
    "copies",
    "first I/O reaped",
    "last I/O reaped",
    "first copy started",
    "last copy seen done",
)


def summarize(lines):
    """{(backend, op, kind, block, count): [per-request tuples]} in the log's order."""
    pending, out = [], {}
    for line in lines:
        m = PROFILE.search(line)
        if m:
            pending.append(tuple(float(x) for x in m.groups()))
            continue
        m = REQ.match(line)
        if m:
            backend, op, kind, block, count = m.groups()
            out.setdefault((backend, op, kind, int(block), int(count)), []).extend(pending)
            pending = []
    return out


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__.split("\n\n")[-1].strip())
    with open(argv[1], errors="replace") as f:
        rows = summarize(f)
    if not rows:
        sys.exit(f"{argv[1]}: no profiled requests (was IO_URING_DMABUF_PROFILE=1 set?)")
    print("| backend | op | kind | block | count | requests | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|---:|---:|---:|" + "---:|" * len(COLUMNS))
    for (backend, op, kind, block, count), reqs in rows.items():
        if not reqs:
            continue
        med = [statistics.median(r[i] for r in reqs) for i in range(len(COLUMNS))]
        cells = [f"{med[0]:.3f}", f"{med[1]:.0f}", f"{med[2]:.0f}"] + [f"{v:.3f}" for v in med[3:]]
        print(
            f"| {backend} | {op} | {kind} | {block} | {count} | {len(reqs)} | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main(sys.argv)
