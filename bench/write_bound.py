"""The bound of buffered WRITEs into one page-cache file on this machine, with no NIXL and no GPU
(issue 26: is what holds IO_URING_DMABUF and GDS_MT at the same GB/s the file system?).

A file prefilled in 64 MiB writes (large folios), then 2 MiB pwrite(2) calls at random 2 MiB
offsets from T threads at once, their sources cycling through a host buffer of F bytes: F small
(8 MiB) stays in the CPU's cache, F large (64 MiB, the staging pool's default size) does not.
Each cell runs for --seconds; GB/s = bytes written / wall time.

    python3 bench/write_bound.py [--dir /tmp]
"""
import argparse
import mmap
import os
import random
import threading
import time

MiB = 1 << 20


def cell(fd: int, file_size: int, block: int, footprint: int, threads: int, seconds: float) -> float:
    src = mmap.mmap(-1, footprint)
    src.write(os.urandom(MiB) * (footprint // MiB))
    views = [memoryview(src)[i:i + block] for i in range(0, footprint, block)]
    slots = file_size // block
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def run(k: int) -> None:
        rng, i = random.Random(k), k
        while time.perf_counter() < stop:
            os.pwrite(fd, views[i % len(views)], rng.randrange(slots) * block)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--file_mib", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=1.0)
    a = ap.parse_args()
    size = a.file_mib * MiB
    path = os.path.join(a.dir, f"iud-write-bound-{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunk = os.urandom(MiB) * 64
        for off in range(0, size, len(chunk)):
            os.pwrite(fd, chunk, off)
        print(f"# 2 MiB buffered pwrites into one {a.file_mib} MiB file in {a.dir} (prefilled in "
              f"64 MiB writes); kernel {os.uname().release}; {os.cpu_count()} CPUs\n")
        print("| source buffer | 1 thread GB/s | 2 threads | 4 threads | 8 threads |")
        print("|---|---:|---:|---:|---:|")
        for footprint in (8 * MiB, 64 * MiB):
            row = [cell(fd, size, 2 * MiB, footprint, t, a.seconds) for t in (1, 2, 4, 8)]
            print(f"| {footprint // MiB} MiB | " + " | ".join(f"{g:.2f}" for g in row) + " |",
                  flush=True)
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
