"""What fio reaches on a disk with O_DIRECT, for the VRAM benchmark's ">= 95 % of fio" target.

Runs fio (io_uring engine, O_DIRECT, registered buffers and files) on one file per block size,
the same 256 MiB span the VRAM benchmark uses, at several queue depths, and prints a markdown table
of the best GB/s (decimal) per (op, block) with the depth that reached it.

With --buffered: random reads of the page cache instead (the file is written and read once
first, so it is cached), by 1..N threads each calling pread (fio's psync engine, numjobs): what
host memory alone reaches from this page cache, the storage stage of a staged VRAM read.

Usage: python3 bench/fio_reference.py --fio PATH --dir /root [--sizes 65536,...] [--seconds 2]
       python3 bench/fio_reference.py --fio PATH --dir /tmp --buffered [--jobs 1,8,16] [--ops read]
"""

import argparse
import json
import os
import subprocess
import time

MiB = 1 << 20


def fio_job(fio, path, span, seconds, flags):
    """Runs one time-based fio job with `flags` and returns its JSON job record."""
    cmd = [
        fio,
        "--name=ref",
        f"--filename={path}",
        f"--size={span}",
        *flags,
        "--time_based=1",
        f"--runtime={seconds}",
        "--ramp_time=0.5",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 60)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]


def run_fio(fio, path, op, block, depth, seconds, span, numjobs=1):
    job = fio_job(
        fio,
        path,
        span,
        seconds,
        [
            "--direct=1",
            "--ioengine=io_uring",
            "--fixedbufs=1",
            "--registerfiles=1",
            f"--rw={op}",
            f"--bs={block}",
            f"--iodepth={depth}",
            # several submitters on one device: a loop or md device serves each queue in its
            # own worker, so one fio thread may not reach what the device gives
            f"--numjobs={numjobs}",
            "--group_reporting=1",
        ],
    )
    return job["read" if op == "read" else "write"]["bw_bytes"] / 1e9


def run_fio_buffered(fio, path, op, block, jobs, seconds, span):
    job = fio_job(
        fio,
        path,
        span,
        seconds,
        [
            "--direct=0",
            "--invalidate=0",
            "--ioengine=psync",
            f"--rw=rand{op}",
            f"--bs={block}",
            f"--numjobs={jobs}",
            "--group_reporting=1",
        ],
    )
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * jobs
    return job["read" if op == "read" else "write"]["bw_bytes"] / 1e9, cpu


def buffered(a, path):
    """Page-cache random reads (or writes) by 1..N pread threads."""
    with open(path, "wb") as f:
        chunk = os.urandom(8 * MiB)
        for _ in range(a.span // len(chunk)):
            f.write(chunk)
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass
    version = subprocess.run([a.fio, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"# fio reference, page cache (buffered) on {a.dir}\n")
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; kernel {os.uname().release}; {version}; "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"command: python3 bench/fio_reference.py --fio {a.fio} --dir {a.dir} --buffered --jobs {a.jobs} "
        f"(psync, random offsets in a cached {a.span // MiB} MiB file, {a.seconds} s each)\n"
    )
    print("| op | block | threads | GB/s | CPUs busy |")
    print("|---|---|---:|---:|---:|")
    for op in a.ops.split(","):
        for block in [int(s) for s in a.sizes.split(",")]:
            for j in (int(x) for x in a.jobs.split(",")):
                try:
                    gbs, cpu = run_fio_buffered(a.fio, path, op, block, j, a.seconds, a.span)
                    print(
                        f"| {op.upper()} | {block // 1024} KiB | {j} | {gbs:.2f} | {cpu:.1f} |",
                        flush=True,
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"<!-- {op} {block} jobs {j}: {e} -->")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fio", required=True)
    ap.add_argument(
        "--dir",
        default="/root",
        help="folder of the test file; a:b:c (O_DIRECT): one file in each, read as one job",
    )
    ap.add_argument(
        "--sizes",
        default=",".join(str(s) for s in (64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB)),
    )
    ap.add_argument("--depths", default="4,16,64")
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--span", type=int, default=256 * MiB)
    ap.add_argument(
        "--buffered",
        action="store_true",
        help="page-cache reads by pread threads instead of O_DIRECT",
    )
    ap.add_argument("--jobs", default="1,8,16", help="--buffered: thread counts")
    ap.add_argument("--ops", help="read and/or write (default: read,write; --buffered: read)")
    ap.add_argument("--numjobs", default="1", help="O_DIRECT: submitting threads, e.g. 1,4")
    a = ap.parse_args()
    a.ops = a.ops or ("read" if a.buffered else "read,write")
    # fio spreads one job's I/O over the files of a ':'-separated --filename (several devices
    # read at once, as slot files striped over them are)
    files = [os.path.join(d, f"iud-fio-ref-{os.getpid()}") for d in a.dir.split(":")]
    path = ":".join(files)
    if a.buffered:
        try:
            buffered(a, path)
        finally:
            for f in files:
                os.unlink(f)
        return
    # Lay the file out once so reads hit allocated blocks.
    subprocess.run(
        [
            a.fio,
            "--name=fill",
            f"--filename={path}",
            f"--size={a.span}",
            "--direct=1",
            "--rw=write",
            "--bs=4M",
            "--ioengine=psync",
        ],
        capture_output=True,
        check=True,
    )
    version = subprocess.run([a.fio, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"# fio reference, O_DIRECT on {a.dir}\n")
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; kernel {os.uname().release}; {version}"
    )
    print(
        f"command: python3 bench/fio_reference.py --fio {a.fio} --dir {a.dir} (io_uring, fixedbufs, registerfiles, "
        f"depths {a.depths}, threads {a.numjobs}, {a.seconds} s each, {a.span // MiB} MiB span)\n"
    )
    print("| op | block | best fio GB/s | at depth x threads | all GB/s @depth x threads |")
    print("|---|---|---|---|---|")
    try:
        for op in a.ops.split(","):
            for block in [int(s) for s in a.sizes.split(",")]:
                depths = [
                    d for d in (int(x) for x in a.depths.split(",")) if d * block <= 4 * a.span
                ] or [1]
                got = []
                for d in depths:
                    for j in (int(x) for x in a.numjobs.split(",")):
                        try:
                            gbs = run_fio(a.fio, path, op, block, d, a.seconds, a.span, j)
                            got.append((gbs, f"{d}x{j}"))
                        except (RuntimeError, subprocess.TimeoutExpired) as e:
                            print(f"<!-- {op} {block} depth {d} threads {j}: {e} -->")
                if got:
                    best = max(got)
                    detail = ", ".join(f"{g:.2f}@{d}" for g, d in got)
                    print(
                        f"| {op.upper()} | {block // 1024} KiB | {best[0]:.2f} | {best[1]} | {detail} |",
                        flush=True,
                    )
    finally:
        for f in files:
            os.unlink(f)


if __name__ == "__main__":
    main()
