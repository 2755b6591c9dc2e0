"""VRAM <-> FILE benchmark through the real NIXL runtime, side by side in one run:
IO_URING_DMABUF (whatever path `vram_path` selects), NIXL GDS and GDS_MT (cuFile), and NIXL POSIX
with a manual copy through a pinned host buffer. Every transfer is checked once per point
(random data, byte for byte). Run on the GPU machine by ci/gpu/run.sh.

Usage: python3 bench/gpu_vram_bench.py [--dir /tmp] [--direct] [--sizes 65536,...] [--seconds 0.3]
Prints a markdown table (GB/s, decimal) per file kind.
"""
import argparse
import json
import os
import subprocess
import platform
import sys
import time

import torch
from nixl._api import nixl_agent, nixl_agent_config

MiB = 1 << 20

BACKENDS = [
    ("IO_URING_DMABUF", "IO_URING_DMABUF", {}),
    ("IUD-cufile", "IO_URING_DMABUF", {"vram_path": "cufile"}),
    ("IUD-cufile-batch", "IO_URING_DMABUF", {"vram_path": "cufile", "cufile_api": "batch"}),
    # Staging pool shapes (same total pinned memory as the default 8 x 8 MiB, or more buffers).
    ("IUD-stage-1Mx64", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(MiB), "staging_buffers": "64"}),
    ("IUD-stage-2Mx32", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(2 * MiB), "staging_buffers": "32"}),
    ("IUD-stage-4Mx16", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(4 * MiB), "staging_buffers": "16"}),
    # Small pools: less host memory touched per request (cache-resident staging for writes?).
    ("IUD-stage-1Mx16", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(MiB), "staging_buffers": "16"}),
    ("IUD-stage-512Kx16", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(MiB // 2), "staging_buffers": "16"}),
    # More bytes in flight for disks that want deep queues (256 MiB pinned instead of 64).
    ("IUD-stage-2Mx128", "IO_URING_DMABUF", {"vram_path": "staging", "staging_buffer_size": str(2 * MiB), "staging_buffers": "128"}),
    # Page-cache READ pieces handed to io_uring's workers (punted) from this size; 0 = never.
    ("IUD-punt-off", "IO_URING_DMABUF", {"vram_path": "staging", "punt_buffered_min": "0"}),
    ("IUD-punt-64K", "IO_URING_DMABUF", {"vram_path": "staging", "punt_buffered_min": "65536"}),
    ("GDS", "GDS", {}),
    ("GDS_MT", "GDS_MT", {}),
    ("POSIX+copy", "POSIX", {"use_uring": "true"}),
]


# Variants measured only when named in --backends.
OPT_IN = ("IUD-stage-", "IUD-punt-")


class Point:
    def __init__(self, agent, name, kind, block, count, direct, path, memory="vram"):
        self.agent, self.kind, self.block, self.count = agent, kind, block, count
        total = block * count
        self.total = total
        self.dram_only = memory == "dram"
        # --memory dram: every backend moves pinned host memory (no GPU copies at all).
        dev = "cpu" if self.dram_only else "cuda"
        self.vram = torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev)
        if self.dram_only:
            self.vram = self.vram.pin_memory()
        self.check = torch.empty_like(self.vram)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        os.ftruncate(self.fd, total)
        self.regs = [agent.register_memory([(0, total, self.fd, "")], "FILE", backends=[name])]
        self.remote = agent.get_xfer_descs([(i * block, block, self.fd) for i in range(count)], "FILE")
        if kind == "POSIX" and not self.dram_only:
            # POSIX cannot address VRAM: stage through a pinned host tensor by hand.
            self.host = torch.empty(total, dtype=torch.uint8).pin_memory()
            self.regs.append(agent.register_memory([(self.host.data_ptr(), total, 0, "")], "DRAM", backends=[name]))
            self.local = agent.get_xfer_descs([(self.host.data_ptr() + i * block, block, 0) for i in range(count)], "DRAM")
        else:
            self.host = None
            mk = "DRAM" if self.dram_only else "VRAM"
            self.regs.append(agent.register_memory([(self.vram.data_ptr(), total, 0, ""), (self.check.data_ptr(), total, 0, "")], mk, backends=[name]))
            self.local = agent.get_xfer_descs([(self.vram.data_ptr() + i * block, block, 0) for i in range(count)], mk)
            self.local_check = agent.get_xfer_descs([(self.check.data_ptr() + i * block, block, 0) for i in range(count)], mk)
        self.name = name

    def xfer(self, op, local=None):
        a = self.agent
        if self.host is not None and op == "WRITE":
            self.host.copy_(self.vram, non_blocking=True)
            torch.cuda.synchronize()
        h = a.initialize_xfer(op, local or self.local, self.remote, a.name, backends=[self.name])
        s = a.transfer(h)
        while s == "PROC":
            s = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        if s != "DONE":
            raise RuntimeError(f"{op} ended in {s}")
        if self.host is not None and op == "READ":
            (self.vram if local is None else self.check).copy_(self.host, non_blocking=True)
        torch.cuda.synchronize()

    def verify(self):
        self.xfer("WRITE")
        self.check.fill_(1)
        if self.host is not None:
            self.xfer("READ", local=self.local)  # lands in host, copied into check below
            self.check.copy_(self.host)
        else:
            self.xfer("READ", local=self.local_check)
        torch.cuda.synchronize()
        if not torch.equal(self.vram, self.check):
            raise RuntimeError("data mismatch")

    def close(self):
        for r in self.regs:
            self.agent.deregister_memory(r, backends=[self.name])
        os.close(self.fd)


def measure(p, op, seconds):
    p.xfer(op)  # warm-up
    n, t0 = 0, time.perf_counter()
    while True:
        p.xfer(op)
        n += 1
        el = time.perf_counter() - t0
        if el >= seconds and n >= 3:
            return p.total * n / el / 1e9


def run_backend(label, name, params, sizes, args):
    """Measures one backend (in a child process, so a hang cannot stop the run)."""
    results = {}
    agent = nixl_agent(f"bench-{label}-{os.getpid()}", nixl_agent_config(backends=[]))
    agent.create_backend(name, params)
    for block in sizes:
        count = max(1, min(128, args.request_bytes // block))
        path = f"{args.dir}/iud-vram-bench-{label}.bin"
        p = None
        try:
            p = Point(agent, name, name, block, count, args.direct, path, args.memory)
            p.verify()
            for op in ("WRITE", "READ"):
                results[f"{block}:{op}"] = f"{measure(p, op, args.seconds):.2f}"
                print(f"{label} {op} {block}: {results[f'{block}:{op}']} GB/s", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the table
            print(f"{label} block {block}: {e!r}", file=sys.stderr, flush=True)
            for op in ("READ", "WRITE"):
                results.setdefault(f"{block}:{op}", f"n/a ({type(e).__name__})")
        finally:
            if p is not None:
                try:
                    p.close()
                except Exception:  # noqa: BLE001
                    pass
            if os.path.exists(path):
                os.unlink(path)
    print("RESULTS " + json.dumps(results), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--sizes", default=",".join(str(s) for s in (64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB)))
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--request_bytes", type=int, default=256 * MiB, help="bytes per request (descriptors = this / block, at most 128)")
    ap.add_argument("--backends", default=",".join(b[0] for b in BACKENDS if not b[0].startswith(OPT_IN)))
    ap.add_argument("--timeout", type=float, default=90, help="seconds allowed per backend")
    ap.add_argument("--memory", choices=("vram", "dram"), default="vram",
                    help="dram: pinned host memory for every backend (no GPU copies; POSIX+copy is then plain POSIX)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    chosen = [b for b in BACKENDS if b[0] in args.backends.split(",")]
    if args.one:
        label, name, params = next(b for b in BACKENDS if b[0] == args.one)
        run_backend(label, name, params, sizes, args)
        return
    kind = "O_DIRECT file on the virtio disk" if args.direct else "buffered file (page cache)"
    print(f"# {args.memory.upper()} <-> FILE, {kind}\n")
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; host {platform.node()}; kernel {platform.release()}; GPU {torch.cuda.get_device_name(0)}")
    print(f"command: python3 {' '.join(sys.argv)}\n", flush=True)
    results = {}
    for label, _, _ in chosen:
        cmd = [sys.executable] + sys.argv + ["--one", label]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            # The child's progress lines, failures and plugin log go to our stderr (the .log).
            sys.stderr.write(r.stderr)
            out = r.stdout
            line = next((l for l in out.splitlines() if l.startswith("RESULTS ")), None)
            got = json.loads(line[8:]) if line else {}
            if not got:
                got = {f"{b}:{op}": "n/a (failed)" for b in sizes for op in ("READ", "WRITE")}
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            sys.stderr.write(f"{label}: no result within {args.timeout:.0f} s; its stderr so far:\n{err}")
            got = {f"{b}:{op}": f"n/a (hung > {args.timeout:.0f} s)" for b in sizes for op in ("READ", "WRITE")}
        for k, v in got.items():
            b, op = k.split(":")
            results[(label, int(b), op)] = v
    labels = [b[0] for b in chosen]
    print("| op | block | " + " | ".join(f"{l} GB/s" for l in labels) + " | IO_URING_DMABUF / GDS_MT |")
    print("|---|---|" + "---|" * (len(labels) + 1))
    for op in ("READ", "WRITE"):
        for b in sizes:
            row = [results.get((l, b, op), "-") for l in labels]
            ratio = "-"
            try:
                ratio = f"{float(results[('IO_URING_DMABUF', b, op)]) / float(results[('GDS_MT', b, op)]):.2f}x"
            except (KeyError, ValueError, ZeroDivisionError):
                pass
            print(f"| {op} | {b >> 10} KiB | " + " | ".join(row) + f" | {ratio} |")
    print()


if __name__ == "__main__":
    main()
