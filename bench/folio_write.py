"""What one buffered pwrite costs by the size of the page-cache folios it lands in (issue 26's
WRITE profile): a file prefilled in writes of P bytes (P = 4 KiB leaves small folios, 64 MiB
large ones on file systems with large folios, such as ext4 on Linux 6.18), then B-byte writes
at random B-aligned offsets of it, timed one by one in this process (no NIXL, no plugin: the
file system's own cost, which every backend pays). Usage: python3 bench/folio_write.py [--dir /tmp]
"""

import argparse
import os
import random
import time

MiB = 1 << 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--file_mib", type=int, default=512)
    ap.add_argument("--prefill", default="4096,2097152,67108864", help="prefill write sizes")
    ap.add_argument("--blocks", default="16384,65536,262144,2097152", help="timed write sizes")
    ap.add_argument("--seconds", type=float, default=0.5, help="per (prefill, block) cell")
    args = ap.parse_args()
    size = args.file_mib * MiB
    path = os.path.join(args.dir, f"iud-folio-{os.getpid()}.bin")
    pre = [int(x) for x in args.prefill.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    print(
        f"# buffered pwrite cost by prefill write size; {args.file_mib} MiB file in {args.dir}; "
        f"kernel {os.uname().release}; loadavg {' '.join(open('/proc/loadavg').read().split()[:3])}\n"
    )
    print(
        "| prefill write | " + " | ".join(f"{b >> 10} KiB write: us (GB/s)" for b in blocks) + " |"
    )
    print("|---:|" + "---:|" * len(blocks))
    try:
        for p in pre:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            chunk = os.urandom(max(p, 4096))
            for off in range(0, size, p):
                os.pwrite(fd, chunk[:p], off)
            os.fdatasync(fd)
            row = f"| {p >> 10} KiB |"
            for b in blocks:
                data = os.urandom(b)
                rng = random.Random(b ^ p)
                n, t = 0, 0.0
                while t < args.seconds or n < 16:
                    o = rng.randrange(size // b) * b
                    t0 = time.perf_counter()
                    os.pwrite(fd, data, o)
                    t += time.perf_counter() - t0
                    n += 1
                os.fdatasync(fd)
                row += f" {t / n * 1e6:.1f} ({b * n / t / 1e9:.2f}) |"
            print(row, flush=True)
            os.close(fd)
            os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
