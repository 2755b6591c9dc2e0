"""The bound of buffered WRITEs into page-cache files on this machine, with no NIXL and no GPU
(issue 26: is what holds IO_URING_DMABUF and GDS_MT at the same GB/s the file system?).

Files prefilled in 64 MiB writes (large folios), then pwrite(2) calls of B bytes at random
B-aligned offsets from T threads at once (thread k writes file k mod N), their sources cycling
through a host buffer of F bytes: F small (8 MiB, the staged write window) stays in the CPU's
cache, F large (64 MiB, the staging pool's default size) does not. Each cell runs for
--seconds; GB/s = bytes written / wall time.

    python3 bench/write_bound.py [--dir /tmp] [--blocks 2M] [--files 1] [--footprints 8M,64M]
                                 [--threads 1,2,4,8] [--writeback]
"""

import argparse
import mmap
import os
import random
import threading
import time

MiB = 1 << 20


def cell(
    fds: list, file_size: int, block: int, footprint: int, threads: int, seconds: float
) -> float:
    src = mmap.mmap(-1, footprint)
    src.write(os.urandom(MiB) * (footprint // MiB))
    views = [memoryview(src)[i : i + block] for i in range(0, footprint, block)]
    slots = file_size // block
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def run(k: int) -> None:
        rng, i = random.Random(k), k
        while time.perf_counter() < stop:
            os.pwrite(fds[k % len(fds)], views[i % len(views)], rng.randrange(slots) * block)
            done[k] += block
            i += threads

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    for v in views:
        v.release()
    src.close()
    return sum(done) / wall / 1e9


def size_arg(x: str) -> int:
    x = x.strip().upper()
    mult = {"K": 1 << 10, "M": MiB}.get(x[-1:], 1)
    return int(x[:-1] if mult > 1 else x) * mult


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--file_mib", type=int, default=1024, help="size of each file")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--blocks", default="2M", help="write sizes, comma-separated (64K,256K,2M)")
    ap.add_argument("--files", default="1", help="file counts, comma-separated (1,4)")
    ap.add_argument("--footprints", default="8M,64M", help="source buffer sizes, comma-separated")
    ap.add_argument("--threads", default="1,2,4,8", help="writer thread counts, comma-separated")
    ap.add_argument(
        "--writeback",
        action="store_true",
        help="fdatasync each file after the prefill, as iud-bench does: blocks allocated, pages clean",
    )
    a = ap.parse_args()
    size = a.file_mib * MiB
    nfiles = max(int(n) for n in a.files.split(","))
    paths = [os.path.join(a.dir, f"iud-write-bound-{os.getpid()}-{i}.bin") for i in range(nfiles)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    try:
        chunk = os.urandom(MiB) * 64
        for fd in fds:
            for off in range(0, size, len(chunk)):
                os.pwrite(fd, chunk, off)
            if a.writeback:
                os.fdatasync(fd)
        print(
            f"# buffered pwrites into {a.file_mib} MiB files in {a.dir} (prefilled in 64 MiB writes{' and written back' if a.writeback else ''}); "
            f"kernel {os.uname().release}; {os.cpu_count()} CPUs; {a.seconds} s per cell\n"
        )
        threads = [int(t) for t in a.threads.split(",")]
        print(
            "| write size | files | source buffer | "
            + " | ".join(f"{t} thread(s) GB/s" for t in threads)
            + " |"
        )
        print("|---|---:|---|" + "---:|" * len(threads))
        for block in (size_arg(b) for b in a.blocks.split(",")):
            for n in (int(x) for x in a.files.split(",")):
                for footprint in (size_arg(f) for f in a.footprints.split(",")):
                    row = [cell(fds[:n], size, block, footprint, t, a.seconds) for t in threads]
                    print(
                        f"| {block >> 10} KiB | {n} | {footprint // MiB} MiB | "
                        + " | ".join(f"{g:.2f}" for g in row)
                        + " |",
                        flush=True,
                    )
    finally:
        for fd, p in zip(fds, paths):
            os.close(fd)
            os.unlink(p)


if __name__ == "__main__":
    main()
