"""VRAM <-> FILE benchmark through the real NIXL runtime, side by side in one run. Runs on the GPU
machine (ci/gpu/run.sh); without torch, CUDA or NIXL it stops at once with the reason (exit 2).

Tables, in this order (--tables):
0. req: what clients wait for (issue 26, bench/per_request.py): per request make_prepped_xfer
   over prepped lists + post + poll to DONE + release, split into prep / post to DONE / release,
   beside initialize_xfer per request and the repost figure of table 1, for scattered KV blocks
   (16 KiB x 8192 .. 2 MiB x 512) and a contiguous READ of the same descriptors;
   IO_URING_DMABUF against GDS_MT (--req_backends), alternated, every request verified;
   --req_processes N runs N processes per backend at once, each with its own agent and file.
   prep: the prep profile, make_prepped_xfer / initialize_xfer + release without a post, for
   lists of 8192 and 65536 descriptors (--prep_descs).
1. kv: the KV-cache pattern (issue 13): per block size B (4 KiB .. 2 MiB), N blocks at random
   slots of --kv_regions large VRAM regions (torch.cuda tensors, each registered on its own)
   against random file offsets of one shared file, no two file blocks adjacent (nothing can
   merge), READ and WRITE, one request of N descriptors reposted for --kv_seconds. Backends
   (--kv_backends): IO_URING_DMABUF, GDS_MT and POSIX+copy (POSIX on a pinned host buffer, with
   one batched gather/scatter on the GPU and one host<->device copy per request). Each backend runs
   in its own process per round (a hang cannot stop the run); --kv_rounds rounds, the backend
   order rotated every round; the table shows medians, with CPU seconds per GB (getrusage of the
   measuring process, user+sys, over the timed loop). After every timed loop every block is
   compared byte for byte with the file (WRITE sources are fresh random data, READ destinations
   are zeroed first); every transfer must end DONE.
2. contig: the contiguous sweep: IO_URING_DMABUF (whatever path `vram_path` selects), NIXL GDS and
   GDS_MT (cuFile), and NIXL POSIX with a manual copy through a pinned host buffer; one request
   of up to 128 contiguous descriptors per block size, checked once per point.

Usage: python3 bench/gpu_vram_bench.py [--dir /tmp] [--direct] [--tables kv,contig] [--seconds 0.3]
--memory dram runs the kv table on page-aligned host memory with numpy only (no torch, no GPU):
the CPU smoke test of this script (tests/python/test_bench.py).
Prints markdown tables (GB/s, decimal) on stdout; progress and raw rounds go to stderr.
"""

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import per_request  # noqa: E402 - bench/per_request.py, beside this file

MiB = 1 << 20

torch = None  # imported by need_torch() only where a table needs it
nixl_agent = nixl_agent_config = None


def fail(msg):
    print(f"gpu_vram_bench.py: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def need_torch():
    """torch with a CUDA device, or exit 2 with the reason."""
    global torch
    try:
        import torch as t
    except ImportError as e:
        fail(
            f"needs torch with CUDA ({e}). It runs on the GPU machine: bash ci/gpu/run.sh bench "
            "(or bench-args); here only `--memory dram --tables kv` runs (numpy, no GPU)"
        )
    if not t.cuda.is_available():
        fail(
            "torch.cuda.is_available() is False: no CUDA GPU or driver here. It runs on the GPU "
            "machine: bash ci/gpu/run.sh bench; here only `--memory dram --tables kv` runs"
        )
    torch = t


def need_nixl():
    global nixl_agent, nixl_agent_config
    try:
        from nixl._api import nixl_agent as a
        from nixl._api import nixl_agent_config as c
    except ImportError as e:
        fail(
            f"cannot import NIXL's Python API ({e}): put the nixl wheel on PYTHONPATH "
            "(ci/gpu/run.sh does) or use the project's .venv"
        )
    nixl_agent, nixl_agent_config = a, c


BACKENDS = [
    ("IO_URING_DMABUF", "IO_URING_DMABUF", {}),
    ("IUD-cufile", "IO_URING_DMABUF", {"vram_path": "cufile"}),
    ("IUD-cufile-batch", "IO_URING_DMABUF", {"vram_path": "cufile", "cufile_api": "batch"}),
    # Staging pool shapes (same total pinned memory as the default 8 x 8 MiB, or more buffers).
    (
        "IUD-stage-1Mx64",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB), "staging_buffers": "64"},
    ),
    (
        "IUD-stage-2Mx32",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(2 * MiB), "staging_buffers": "32"},
    ),
    (
        "IUD-stage-4Mx16",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(4 * MiB), "staging_buffers": "16"},
    ),
    # Small pools: less host memory touched per request (cache-resident staging for writes?).
    (
        "IUD-stage-1Mx16",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB), "staging_buffers": "16"},
    ),
    (
        "IUD-stage-512Kx16",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB // 2), "staging_buffers": "16"},
    ),
    (
        "IUD-stage-256Kx16",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB // 4), "staging_buffers": "16"},
    ),
    (
        "IUD-stage-512Kx8",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB // 2), "staging_buffers": "8"},
    ),
    (
        "IUD-stage-512Kx32",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(MiB // 2), "staging_buffers": "32"},
    ),
    # More bytes in flight for disks that want deep queues (256 MiB pinned instead of 64).
    (
        "IUD-stage-2Mx128",
        "IO_URING_DMABUF",
        {"vram_path": "staging", "staging_buffer_size": str(2 * MiB), "staging_buffers": "128"},
    ),
    # Page-cache READ pieces handed to io_uring's workers (punted) from this size; 0 = never.
    ("IUD-punt-off", "IO_URING_DMABUF", {"vram_path": "staging", "punt_buffered_min": "0"}),
    ("IUD-punt-64K", "IO_URING_DMABUF", {"vram_path": "staging", "punt_buffered_min": "65536"}),
    # Page-cache workers: any number writing one file at once (the old behaviour), or two;
    # the posting/polling thread not running queued reads (the old behaviour).
    ("IUD-fw0", "IO_URING_DMABUF", {"page_cache_file_writers": "0"}),
    ("IUD-fw2", "IO_URING_DMABUF", {"page_cache_file_writers": "2"}),
    ("IUD-nocaller", "IO_URING_DMABUF", {"page_cache_caller_reads": "false"}),
    # ... or always, also while staged VRAM moves (the default before 2026-12-04 afternoon).
    ("IUD-caller", "IO_URING_DMABUF", {"page_cache_caller_reads": "true"}),
    # Page-cache worker threads (auto: the CPUs less two, at most 16; before 2026-12-04 half the
    # CPUs, at most 8), one writer per file, and DRAM writes left to the ring alone (no inline
    # pwrite by the posting/polling thread).
    ("IUD-pct16", "IO_URING_DMABUF", {"page_cache_threads": "16"}),
    ("IUD-pct14", "IO_URING_DMABUF", {"page_cache_threads": "14"}),
    ("IUD-pct12", "IO_URING_DMABUF", {"page_cache_threads": "12"}),
    ("IUD-pct10", "IO_URING_DMABUF", {"page_cache_threads": "10"}),
    ("IUD-pct8", "IO_URING_DMABUF", {"page_cache_threads": "8"}),
    # ... and all 16 writing one file at once (as many writers as GDS_MT's compatibility mode?)
    (
        "IUD-pct16fw0",
        "IO_URING_DMABUF",
        {"page_cache_threads": "16", "page_cache_file_writers": "0"},
    ),
    # The staging write window (staged_write_window, default 8 MiB): none, 16 MiB, and 8 MiB
    # with 512 KiB write pieces.
    ("IUD-win0", "IO_URING_DMABUF", {"staged_write_window": "0"}),
    ("IUD-win16M", "IO_URING_DMABUF", {"staged_write_window": str(16 * MiB)}),
    ("IUD-win8M-p512K", "IO_URING_DMABUF", {"staged_write_piece_max": str(MiB // 2)}),
    # Staged runs (pieces end to end in the file move as one I/O) capped at one 32 KiB page:
    # the plugin before runs, for the slot layout's 32 KiB pages.
    ("IUD-maxio32K", "IO_URING_DMABUF", {"max_io_size": str(32 << 10)}),
    ("IUD-fw1", "IO_URING_DMABUF", {"page_cache_file_writers": "1"}),
    ("IUD-inline0", "IO_URING_DMABUF", {"inline_write_max": "0"}),
    # Staged page-cache writes in 512 KiB pieces (the default before 2026-12-01's session 20: 2 MiB).
    ("IUD-swp512K", "IO_URING_DMABUF", {"staged_write_piece_max": str(MiB // 2)}),
    # prepXfer planned by the calling thread alone (auto: 4 threads on 8 or more CPUs).
    ("IUD-prep1", "IO_URING_DMABUF", {"prep_threads": "1"}),
    # Requests advance only when polled (no progress thread: the behaviour before session 20).
    ("IUD-noprogress", "IO_URING_DMABUF", {"progress_thread": "false"}),
    # Staged pieces packed several to a staging buffer up to 128 KiB (the default before session
    # 21; now half a buffer) or 1 MiB.
    ("IUD-pack128K", "IO_URING_DMABUF", {"staging_pack_max": str(MiB // 8)}),
    ("IUD-pack1M", "IO_URING_DMABUF", {"staging_pack_max": str(MiB)}),
    # Packed staging buffers to the GPU: always by the scatter kernel (reading the pinned buffer
    # over the bus, or after one DMA into a VRAM mirror), or always by cuMemcpyBatchAsync (the
    # behaviour before session 21); auto takes the kernel for pieces up to 64 KiB.
    ("IUD-kernel", "IO_URING_DMABUF", {"staging_copy": "kernel"}),
    ("IUD-dmakernel", "IO_URING_DMABUF", {"staging_copy": "dma-kernel"}),
    ("IUD-batch", "IO_URING_DMABUF", {"staging_copy": "batch"}),
    # Scatter kernels on 1 or 2 device streams in turn instead of 4 (issue 26 item 4)
    ("IUD-kstreams1", "IO_URING_DMABUF", {"staging_kernel_streams": "1"}),
    ("IUD-kstreams2", "IO_URING_DMABUF", {"staging_kernel_streams": "2"}),
    # Buffered reads spread over the page-cache workers from 256 KiB only (the auto value on 8 or
    # more CPUs before session 21), or from 4 KiB (auto now).
    ("IUD-punt-256K", "IO_URING_DMABUF", {"punt_buffered_min": "262144"}),
    ("IUD-punt-4K", "IO_URING_DMABUF", {"punt_buffered_min": "4096"}),
    # Page-cache writers per file: four (issue 26's WRITE profile; fw0 = no limit, fw1 = one).
    ("IUD-fw4", "IO_URING_DMABUF", {"page_cache_file_writers": "4"}),
    # Staged page-cache READs in worker pieces (staged_read_piece_max, default 256 KiB): none of
    # its own (a staging buffer's piece per worker: the behaviour before 2026-12-04 night),
    # 512 KiB, 1 MiB.
    ("IUD-rp0", "IO_URING_DMABUF", {"staged_read_piece_max": "0"}),
    ("IUD-rp512K", "IO_URING_DMABUF", {"staged_read_piece_max": str(MiB // 2)}),
    ("IUD-rp1M", "IO_URING_DMABUF", {"staged_read_piece_max": str(MiB)}),
    # Idle page-cache workers watch for the next job before they sleep (page_cache_spin_us).
    ("IUD-spin50", "IO_URING_DMABUF", {"page_cache_spin_us": "50"}),
    ("IUD-spin200", "IO_URING_DMABUF", {"page_cache_spin_us": "200"}),
    # More ops in flight per engine (ring_entries bounds them: 512 by default): scattered 16 KiB
    # pieces fill 512 x 16 KiB = 8 MiB of the 64 MiB staging pool at once.
    ("IUD-ring2048", "IO_URING_DMABUF", {"ring_entries": "2048"}),
    ("IUD-ring4096", "IO_URING_DMABUF", {"ring_entries": "4096"}),
    ("IUD-ring8192", "IO_URING_DMABUF", {"ring_entries": "8192"}),
    ("GDS", "GDS", {}),
    ("GDS_MT", "GDS_MT", {}),
    ("POSIX+copy", "POSIX", {"use_uring": "true"}),
]


# Variants measured only when named in --backends.
OPT_IN = (
    "IUD-stage-",
    "IUD-punt-",
    "IUD-pct",
    "IUD-win",
    "IUD-fw1",
    "IUD-fw4",
    "IUD-inline",
    "IUD-swp",
    "IUD-noprogress",
    "IUD-pack",
    "IUD-kernel",
    "IUD-dmakernel",
    "IUD-batch",
    "IUD-kstreams",
    "IUD-ring",
    "IUD-caller",
)


# ---------------------------------------------------------------------------------------------
# Contiguous sweep (table 2)


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
        self.remote = agent.get_xfer_descs(
            [(i * block, block, self.fd) for i in range(count)], "FILE"
        )
        if kind == "POSIX" and not self.dram_only:
            # POSIX cannot address VRAM: stage through a pinned host tensor by hand.
            self.host = torch.empty(total, dtype=torch.uint8).pin_memory()
            self.regs.append(
                agent.register_memory(
                    [(self.host.data_ptr(), total, 0, "")], "DRAM", backends=[name]
                )
            )
            self.local = agent.get_xfer_descs(
                [(self.host.data_ptr() + i * block, block, 0) for i in range(count)], "DRAM"
            )
        else:
            self.host = None
            mk = "DRAM" if self.dram_only else "VRAM"
            self.regs.append(
                agent.register_memory(
                    [(self.vram.data_ptr(), total, 0, ""), (self.check.data_ptr(), total, 0, "")],
                    mk,
                    backends=[name],
                )
            )
            self.local = agent.get_xfer_descs(
                [(self.vram.data_ptr() + i * block, block, 0) for i in range(count)], mk
            )
            self.local_check = agent.get_xfer_descs(
                [(self.check.data_ptr() + i * block, block, 0) for i in range(count)], mk
            )
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
                print(
                    f"{label} {op} {block}: {results[f'{block}:{op}']} GB/s",
                    file=sys.stderr,
                    flush=True,
                )
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


# ---------------------------------------------------------------------------------------------
# KV-cache pattern (table 1)


def kv_blocks(block, fixed):
    """Descriptors per request: --kv_blocks, else 8192 * sqrt(16 KiB / B) rounded down to a power
    of two, within 512..8192 (issue 13's points: 16K x 8192, 64K x 4096, 256K x 2048, 2M x 512)."""
    if fixed:
        return fixed
    n = 8192 * math.sqrt(16384 / block)
    return max(512, min(8192, 1 << int(math.floor(math.log2(n)))))


def kv_max_blocks(block, region_bytes, regions, file_bytes):
    """Blocks that fit: distinct region slots, and file slots with a free slot between any two."""
    return min(regions * (region_bytes // block), -(-(file_bytes // block) // 2))


def kv_layout(seed, block, n, region_bytes, regions, file_bytes):
    """(region index, slot in region, file offset) arrays of the n descriptors, in request order;
    the same in every process for the same arguments."""
    import numpy as np

    rng = np.random.default_rng([seed, block, n])
    per = region_bytes // block
    mem = rng.choice(regions * per, size=n, replace=False)
    slots = file_bytes // block
    c = np.sort(rng.choice(slots - n + 1, size=n, replace=False))
    file_slots = rng.permutation(c + np.arange(n))  # sorted + rank: no two neighbours
    return (
        (mem // per).astype(np.int64),
        (mem % per).astype(np.int64),
        (file_slots * block).astype(np.int64),
    )


def kv_points(args):
    """[(op, block, n)] in table order, n already fitted to the regions and the file."""
    pts = []
    for op in args.kv_ops.split(","):
        for b in args.kv_sizes:
            n = min(
                kv_blocks(b, args.kv_blocks),
                kv_max_blocks(b, args.kv_region_bytes, args.kv_regions, args.kv_file_bytes),
            )
            pts.append((op, b, n))
    return pts


class DeviceMem:
    """Large VRAM regions (torch.cuda tensors) and batched slot access on the GPU."""

    kind = "VRAM"

    def alloc(self, n):
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def ptr(self, a):
        return a.data_ptr()

    def index(self, idx):
        return torch.from_numpy(idx).to("cuda")

    def fill_slots(self, region, block, idx, seed):
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        region.view(-1, block)[idx] = torch.randint(
            0, 256, (len(idx), block), dtype=torch.uint8, device="cuda", generator=g
        )

    def zero_slots(self, region, block, idx):
        region.view(-1, block)[idx] = 0

    def gather(self, regions, block, n, parts):
        out = torch.empty((n, block), dtype=torch.uint8, device="cuda")
        for r, (pos, idx) in parts.items():
            out[pos] = regions[r].view(-1, block)[idx]
        return out

    def equal(self, got, expected_np):
        return bool(torch.equal(got, torch.from_numpy(expected_np).to("cuda")))

    def first_diff(self, got, expected_np):
        ne = (got != torch.from_numpy(expected_np).to("cuda")).nonzero()
        return tuple(int(v) for v in ne[0]) if len(ne) else None

    def sync(self):
        torch.cuda.synchronize()


class HostMem:
    """--memory dram: page-aligned numpy regions (no torch, no GPU), for the CPU smoke test."""

    kind = "DRAM"

    def alloc(self, n):
        import numpy as np

        raw = np.empty(n + 4096, dtype=np.uint8)
        off = (-raw.ctypes.data) % 4096
        a = raw[off : off + n]
        a[:] = 0  # touch every page
        return a

    def ptr(self, a):
        return a.ctypes.data

    def index(self, idx):
        return idx

    def fill_slots(self, region, block, idx, seed):
        import numpy as np

        region.reshape(-1, block)[idx] = np.random.default_rng(seed).integers(
            0, 256, (len(idx), block), dtype=np.uint8
        )

    def zero_slots(self, region, block, idx):
        region.reshape(-1, block)[idx] = 0

    def gather(self, regions, block, n, parts):
        import numpy as np

        out = np.empty((n, block), dtype=np.uint8)
        for r, (pos, idx) in parts.items():
            out[pos] = regions[r].reshape(-1, block)[idx]
        return out

    def equal(self, got, expected_np):
        import numpy as np

        return bool(np.array_equal(got, expected_np))

    def first_diff(self, got, expected_np):
        import numpy as np

        ne = np.argwhere(got != expected_np)
        return tuple(int(v) for v in ne[0]) if len(ne) else None

    def sync(self):
        pass


def cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def kv_child(label, name, params, args):
    """One backend, one round: every KV point; prints RESULTS {key: sample}."""

    mem = HostMem() if args.memory == "dram" else DeviceMem()
    staged = name == "POSIX" and args.memory != "dram"  # POSIX cannot address VRAM
    agent = nixl_agent(f"kv-{label}-{os.getpid()}", nixl_agent_config(backends=[]))
    agent.create_backend(name, params)
    rb = args.kv_region_bytes
    regions = [mem.alloc(rb) for _ in range(args.kv_regions)]
    regs = []
    points = kv_points(args)
    max_req = max(n * b for _, b, n in points)
    if staged:
        host = torch.empty(max_req, dtype=torch.uint8).pin_memory()
        scratch = torch.empty(max_req, dtype=torch.uint8, device="cuda")
        regs.append(
            agent.register_memory([(host.data_ptr(), max_req, 0, "")], "DRAM", backends=[name])
        )
    else:
        for r in regions:
            regs.append(agent.register_memory([(mem.ptr(r), rb, 0, "")], mem.kind, backends=[name]))
    path = kv_file(args)
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if args.direct else 0))
    vfd = os.open(path, os.O_RDONLY)  # buffered, for verification
    regs.append(agent.register_memory([(0, args.kv_file_bytes, fd, "")], "FILE", backends=[name]))
    results = {}
    try:
        for op, block, n in points:
            key = f"{op}:{block}"
            try:
                results[key] = kv_point(
                    agent,
                    name,
                    mem,
                    regions,
                    fd,
                    vfd,
                    op,
                    block,
                    n,
                    args,
                    (host, scratch) if staged else None,
                )
            except Exception as e:  # noqa: BLE001 - reported in the table
                results[key] = {"error": f"{type(e).__name__}: {e}"}
            r = results[key]
            msg = (
                r.get("error")
                or f"{r['gbps']:.3f} GB/s {r['cpu_s_per_gb']:.3f} CPU s/GB {r['requests']} req {'ok' if r['verified'] is True else r['verified']}"
            )
            print(
                f"kv {label} round {args.kv_round} {op} {block} x {n}: {msg}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        deregister_all(agent, name, regs)
        os.close(fd)
        os.close(vfd)
    print("RESULTS " + json.dumps(results), flush=True)


def kv_point(agent, name, mem, regions, fd, vfd, op, block, n, args, staged):
    import numpy as np

    ridx, slot, foff = kv_layout(
        args.seed, block, n, args.kv_region_bytes, args.kv_regions, args.kv_file_bytes
    )
    # Per region: (descriptor positions, slots), as index arrays on the device of the memory.
    parts = {}
    for r in range(len(regions)):
        sel = np.nonzero(ridx == r)[0]
        if len(sel):
            parts[r] = (mem.index(sel), mem.index(slot[sel]))
    seed = (
        (args.seed * 1000003 + block * 7 + (1 if op == "WRITE" else 2)) * 131
        + args.kv_round * 17
        + os.getpid() % 97
    )
    for r, (_pos, idx) in parts.items():
        if op == "WRITE":
            mem.fill_slots(regions[r], block, idx, seed + r)
        else:
            mem.zero_slots(regions[r], block, idx)
    mem.sync()
    remote = np.stack([foff, np.full(n, block), np.full(n, fd)], axis=1).astype(np.uint64)
    if staged is None:
        base = np.array([mem.ptr(r) for r in regions], dtype=np.uint64)
        addrs = base[ridx] + (slot * block).astype(np.uint64)
        local = np.stack(
            [addrs, np.full(n, block, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1
        )
        lkind = mem.kind
    else:
        host, scratch = staged
        addrs = host.data_ptr() + np.arange(n, dtype=np.uint64) * block
        local = np.stack(
            [addrs, np.full(n, block, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1
        )
        lkind = "DRAM"
    h = agent.initialize_xfer(
        op,
        agent.get_xfer_descs(local, lkind),
        agent.get_xfer_descs(remote, "FILE"),
        agent.name,
        backends=[name],
    )

    def post():
        s = agent.transfer(h)
        while s == "PROC":
            if args.kv_poll_sleep_us:  # poll as LMCache does (time.sleep(0.001) between checks)
                time.sleep(args.kv_poll_sleep_us / 1e6)
            s = agent.check_xfer_state(h)
        if s != "DONE":
            raise RuntimeError(f"{op} ended in {s}")

    def one():
        if staged is None:
            post()
            return
        # POSIX+copy: one batched gather/scatter on the GPU and one copy per request.
        sv = scratch[: n * block].view(n, block)
        if op == "WRITE":
            for r, (pos, idx) in parts.items():
                sv[pos] = regions[r].view(-1, block)[idx]
            host[: n * block].copy_(scratch[: n * block])
            post()
        else:
            post()
            scratch[: n * block].copy_(host[: n * block], non_blocking=True)
            for r, (pos, idx) in parts.items():
                regions[r].view(-1, block)[idx] = sv[pos]
            torch.cuda.synchronize()

    try:
        one()  # warm-up
        c0, t0, k = cpu_s(), time.perf_counter(), 0
        while True:
            one()
            k += 1
            el = time.perf_counter() - t0
            if el >= args.kv_seconds and k >= 3:
                break
        cpu = cpu_s() - c0
    finally:
        agent.release_xfer_handle(h)
    mem.sync()
    nbytes = k * n * block
    # Byte for byte: every block against the file (read through a buffered fd).
    expected = np.empty((n, block), dtype=np.uint8)
    for i in range(n):
        got_n = os.preadv(vfd, [expected[i]], int(foff[i]))
        if got_n != block:
            raise RuntimeError(f"short verification read at {foff[i]}: {got_n}")
    got = mem.gather(regions, block, n, parts)
    verified = True
    if not mem.equal(got, expected):
        d, j = mem.first_diff(got, expected)
        verified = (
            f"MISMATCH: descriptor {d} (region {ridx[d]} slot {slot[d]}, file offset {foff[d]}) "
            f"first difference at byte {j}"
        )
    if op == "WRITE" and not args.direct:
        os.fdatasync(fd)  # not timed: keep one measurement's dirty pages out of the next
    return {
        "gbps": nbytes / el / 1e9,
        "cpu_s_per_gb": cpu / (nbytes / 1e9),
        "requests": k,
        "verified": verified,
    }


def kv_file(args):
    return os.path.join(args.dir, "iud-kv-bench.bin")


def prefill(path, nbytes, direct):
    """Random file content (numpy's generator), fsynced for O_DIRECT runs."""
    import numpy as np

    rng = np.random.default_rng(0xF11E)
    chunk = 64 * MiB
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            k = min(chunk, left)
            f.write(rng.bytes(k))
            left -= k
        f.flush()
        if direct:
            os.fsync(f.fileno())


def deregister_all(agent, name, regs):
    """Deregisters `regs` from backend `name` at the end of a benchmark child, each on its own: a
    failure (the child is already reporting another) must not leave the rest registered."""
    for h in regs:
        try:
            agent.deregister_memory(h, backends=[name])
        except Exception:  # noqa: BLE001
            pass


def median(v):
    s = sorted(v)
    n = len(s)
    if not n:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def kv_table(args, deadline):
    labels = [l for l in args.kv_backends.split(",") if l]
    chosen = [next(b for b in BACKENDS if b[0] == l) for l in labels]
    points = kv_points(args)
    path = kv_file(args)
    t = time.perf_counter()
    prefill(path, args.kv_file_bytes, args.direct)
    print(
        f"kv: file {path}: {args.kv_file_bytes} random bytes written in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    samples = {(l, op, b): [] for l in labels for op, b, _ in points}
    notes = []
    try:
        for rnd in range(args.kv_rounds):
            for j in range(len(chosen)):
                label = chosen[(j + rnd) % len(chosen)][0]
                left = deadline - time.monotonic()
                if left < 20:
                    notes.append(f"{label} round {rnd + 1}: not run (time budget --budget_s spent)")
                    continue
                cmd = [sys.executable] + sys.argv + ["--kv_one", label, "--kv_round", str(rnd)]
                got = {}
                try:
                    r = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=min(args.kv_timeout, left)
                    )
                    sys.stderr.write(r.stderr)
                    line = next(
                        (x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None
                    )
                    got = json.loads(line[8:]) if line else {}
                    if not line:
                        notes.append(f"{label} round {rnd + 1}: no results (exit {r.returncode})")
                except subprocess.TimeoutExpired as e:
                    err = (
                        e.stderr.decode(errors="replace")
                        if isinstance(e.stderr, bytes)
                        else (e.stderr or "")
                    )
                    sys.stderr.write(
                        f"kv {label} round {rnd + 1}: no result within the timeout; its stderr so far:\n{err}"
                    )
                    notes.append(per_request.cut_short(label, rnd, args.kv_timeout, left))
                for op, b, _ in points:
                    s = got.get(f"{op}:{b}")
                    if s is not None:
                        samples[(label, op, b)].append(s)
    finally:
        os.unlink(path)
    print(
        f"kv raw rounds: {json.dumps({f'{k[0]} {k[1]} {k[2]}': v for k, v in samples.items()})}",
        file=sys.stderr,
        flush=True,
    )
    return labels, points, samples, notes


def print_kv_table(args, labels, points, samples, notes):
    kind = "O_DIRECT" if args.direct else "page cache"
    print(
        f"## Table 1: KV-cache pattern, {args.memory.upper()} <-> FILE ({kind}), scattered blocks\n"
    )
    print(
        f"{args.kv_regions} {args.memory.upper()} region(s) of {args.kv_region_bytes // MiB} MiB; file of "
        f"{args.kv_file_bytes // MiB} MiB in {args.dir}; blocks at random slots against random file offsets, no "
        f"two adjacent; one request of N descriptors reposted for >= {args.kv_seconds} s (>= 3 times) after one "
        f"warm-up; medians of {args.kv_rounds} rounds, each backend in its own process per round, order rotated; "
        "every block compared with the file after every timed loop; CPU s/GB = user+sys of the measuring "
        "process (getrusage) over the timed loop per GB.\n"
    )
    ref = "GDS_MT" if "GDS_MT" in labels else (labels[1] if len(labels) > 1 else None)
    head = "| op | block | blocks |" + "".join(f" {l} GB/s | {l} CPU s/GB |" for l in labels)
    head += f" {labels[0]} / {ref} |" if ref else ""
    print(head + " verified |")
    print("|---|---:|---:|" + "---:|---:|" * len(labels) + ("---:|" if ref else "") + "---|")
    failures = 0
    for op, b, n in points:
        row = f"| {op} | {b >> 10} KiB | {n} |"
        gb = {}
        bad = []
        for l in labels:
            ok = [s for s in samples[(l, op, b)] if "gbps" in s]
            errs = [s["error"] for s in samples[(l, op, b)] if "error" in s]
            if ok:
                gb[l] = median([s["gbps"] for s in ok])
                row += f" {gb[l]:.2f} | {median([s['cpu_s_per_gb'] for s in ok]):.3f} |"
                bad += [f"{l}: {s['verified']}" for s in ok if s["verified"] is not True]
            else:
                row += f" n/a ({errs[0][:40] if errs else 'not run'}) | - |"
            bad += [f"{l}: {e}" for e in errs]
        if ref:
            row += (
                f" {gb[labels[0]] / gb[ref]:.2f}x |" if labels[0] in gb and gb.get(ref) else " - |"
            )
        if bad:
            failures += 1
            for x in bad:
                notes.append(f"{op} {b >> 10} KiB: {x}")
        print(row + (" FAILED |" if bad else " yes |"))
    print()
    for x in notes:
        print(f"- {x}")
    if notes:
        print()
    return failures


def contig_table(args, sizes, deadline):
    chosen = [b for b in BACKENDS if b[0] in args.backends.split(",")]
    results = {}
    for label, _, _ in chosen:
        left = deadline - time.monotonic()
        if left < 15:
            got = {
                f"{b}:{op}": "n/a (time budget spent)" for b in sizes for op in ("READ", "WRITE")
            }
        else:
            cmd = [sys.executable] + sys.argv + ["--one", label]
            try:
                r = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=min(args.timeout, left)
                )
                # The child's progress lines, failures and plugin log go to our stderr (the .log).
                sys.stderr.write(r.stderr)
                out = r.stdout
                line = next((l for l in out.splitlines() if l.startswith("RESULTS ")), None)
                got = json.loads(line[8:]) if line else {}
                if not got:
                    got = {f"{b}:{op}": "n/a (failed)" for b in sizes for op in ("READ", "WRITE")}
            except subprocess.TimeoutExpired as e:
                err = (
                    e.stderr.decode(errors="replace")
                    if isinstance(e.stderr, bytes)
                    else (e.stderr or "")
                )
                sys.stderr.write(
                    f"{label}: no result within {min(args.timeout, left):.0f} s; its stderr so far:\n{err}"
                )
                why = (
                    "time budget (--budget_s) ran out"
                    if left < args.timeout
                    else f"hung > {min(args.timeout, left):.0f} s"
                )
                got = {f"{b}:{op}": f"n/a ({why})" for b in sizes for op in ("READ", "WRITE")}
        for k, v in got.items():
            b, op = k.split(":")
            results[(label, int(b), op)] = v
    kind = "O_DIRECT" if args.direct else "page cache"
    print(f"## Table 2: contiguous sweep, {args.memory.upper()} <-> FILE ({kind})\n")
    labels = [b[0] for b in chosen]
    print(
        "| op | block | "
        + " | ".join(f"{l} GB/s" for l in labels)
        + " | IO_URING_DMABUF / GDS_MT |"
    )
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


def parse_sizes(s):
    out = []
    for x in s.split(","):
        x = x.strip().upper()
        mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(x[-1:], 1)
        out.append(int(x[:-1] if mult > 1 else x) * mult)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--direct", action="store_true")
    ap.add_argument(
        "--tables",
        default="req,kv,contig",
        help="any of req, prep, kv, contig (printed in that order: req, what clients wait for, first)",
    )
    ap.add_argument(
        "--sizes",
        default=",".join(str(s) for s in (64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB)),
        help="contig block sizes",
    )
    ap.add_argument("--seconds", type=float, default=0.3, help="contig: timed seconds per point")
    ap.add_argument(
        "--request_bytes",
        type=int,
        default=256 * MiB,
        help="contig: bytes per request (descriptors = this / block, at most 128)",
    )
    ap.add_argument(
        "--backends",
        default=",".join(b[0] for b in BACKENDS if not b[0].startswith(OPT_IN)),
        help="contig backends",
    )
    ap.add_argument("--timeout", type=float, default=90, help="contig: seconds allowed per backend")
    ap.add_argument(
        "--memory",
        choices=("vram", "dram"),
        default="vram",
        help="dram: host memory for every backend (contig: pinned, POSIX+copy is then plain POSIX; kv: numpy, no GPU needed)",
    )
    ap.add_argument("--kv_backends", default="IO_URING_DMABUF,GDS_MT,POSIX+copy")
    ap.add_argument("--kv_sizes", default="4K,8K,16K,32K,64K,128K,256K,512K,1M,2M")
    ap.add_argument("--kv_ops", default="READ,WRITE")
    ap.add_argument(
        "--kv_blocks",
        type=int,
        default=0,
        help="descriptors per request; 0 = 8192*sqrt(16K/B), power of two in 512..8192",
    )
    ap.add_argument("--kv_regions", type=int, default=2)
    ap.add_argument("--kv_region_mib", type=int, default=1024, help="MiB per region")
    ap.add_argument(
        "--kv_file_mib",
        type=int,
        default=0,
        help="file size; 0 = what the largest point needs with no two blocks adjacent",
    )
    ap.add_argument("--kv_rounds", type=int, default=3)
    ap.add_argument(
        "--kv_seconds",
        type=float,
        default=0.25,
        help="timed seconds per measurement (at least 3 requests)",
    )
    ap.add_argument(
        "--kv_timeout", type=float, default=150, help="seconds allowed per backend and round"
    )
    ap.add_argument(
        "--kv_poll_sleep_us",
        type=float,
        default=0,
        help="sleep between checkXfer calls (0 = spin; LMCache sleeps 1000 us)",
    )
    # Table 0 and the prep profile (bench/per_request.py).
    ap.add_argument(
        "--req_backends",
        default="IO_URING_DMABUF,GDS_MT",
        help="req and prep: backends (the second is the ratio's reference)",
    )
    ap.add_argument(
        "--req_points",
        default="16K:8192,32K:8192,64K:4096,256K:2048,2M:512",
        help="req: block:descriptors per point",
    )
    ap.add_argument("--req_ops", default="READ,WRITE")
    ap.add_argument(
        "--req_modes",
        default="prepped,init,repost",
        help="req: make_prepped_xfer per request (always), initialize_xfer per request, repost of one request",
    )
    ap.add_argument(
        "--req_slot_pages",
        type=int,
        default=0,
        help="also READ/WRITE the vLLM connector's slot layout: blocks of this many descriptors "
        "scattered in memory, end to end in the file (0 = off)",
    )
    ap.add_argument(
        "--req_no_contig",
        dest="req_contig",
        action="store_false",
        help="req: leave out the contiguous READ per size",
    )
    ap.add_argument(
        "--req_seconds", type=float, default=0.25, help="req: summed request time per measurement"
    )
    ap.add_argument(
        "--req_processes",
        type=int,
        default=1,
        help="req: processes per backend at once (one agent and one file each; prepped mode only)",
    )
    ap.add_argument(
        "--req_prefill_write",
        type=int,
        default=64 * MiB,
        help="req: bytes per write when the file is prefilled (small writes: small page-cache folios)",
    )
    ap.add_argument("--prep_descs", default="8192,65536", help="prep: descriptors per list")
    ap.add_argument("--prep_block", type=int, default=4096)
    ap.add_argument("--prep_ops", default="READ,WRITE")
    ap.add_argument("--prep_seconds", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--budget_s",
        type=float,
        default=450,
        help="wall-clock budget of the whole run: backends and rounds that would start later are reported as not run",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--kv_one", help=argparse.SUPPRESS)
    ap.add_argument("--req_one", help=argparse.SUPPRESS)
    ap.add_argument("--req_proc", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prep_one", help=argparse.SUPPRESS)
    ap.add_argument("--kv_round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    start = time.monotonic()
    tables = [t for t in args.tables.split(",") if t]
    if not tables or any(t not in ("req", "prep", "kv", "contig") for t in tables):
        fail(f"--tables {args.tables}: any of req, prep, kv, contig")
    args.req_points = per_request.parse_points(args.req_points)
    args.prep_descs = [int(x) for x in args.prep_descs.split(",")]
    args.req_file_bytes = per_request.file_bytes(args)
    args.kv_sizes = parse_sizes(args.kv_sizes)
    args.kv_region_bytes = args.kv_region_mib * MiB
    if any(args.kv_region_bytes % b for b in args.kv_sizes):
        fail("--kv_region_mib must be a multiple of every --kv_sizes block")
    if args.kv_file_mib:
        args.kv_file_bytes = args.kv_file_mib * MiB
    else:
        need = max(
            (
                2 * min(kv_blocks(b, args.kv_blocks), args.kv_regions * (args.kv_region_bytes // b))
                - 1
            )
            * b
            for b in args.kv_sizes
        )
        args.kv_file_bytes = -(-need // MiB) * MiB
    if "req" in tables and (why := per_request.check_fit(args)):
        fail(f"req: {why}")
    if args.req_processes < 1:
        fail("--req_processes must be at least 1")
    # Fail fast, before any file or child: what the chosen tables need.
    if args.memory == "vram" or "contig" in tables or args.one:
        need_torch()
    need_nixl()
    if args.kv_one:
        label, name, params = next(b for b in BACKENDS if b[0] == args.kv_one)
        kv_child(label, name, params, args)
        return
    if args.req_one:
        label, name, params = next(b for b in BACKENDS if b[0] == args.req_one)
        per_request.child(sys.modules[__name__], label, name, params, args)
        return
    if args.prep_one:
        label, name, params = next(b for b in BACKENDS if b[0] == args.prep_one)
        per_request.prep_child(sys.modules[__name__], label, name, params, args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.one:
        label, name, params = next(b for b in BACKENDS if b[0] == args.one)
        run_backend(label, name, params, sizes, args)
        return
    kind = "O_DIRECT file" if args.direct else "buffered file (page cache)"
    print(f"# {args.memory.upper()} <-> FILE, {kind}\n")
    gpu = torch.cuda.get_device_name(0) if torch is not None else "none (--memory dram)"
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; host {platform.node()}; kernel {platform.release()}; "
        f"{os.cpu_count()} CPUs; GPU {gpu}; loadavg {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    print(f"command: python3 {' '.join(sys.argv)}\n", flush=True)
    deadline = start + args.budget_s
    failures = 0
    g = sys.modules[__name__]
    if "req" in tables:
        failures += per_request.print_table(g, args, *per_request.table(g, args, deadline))
        sys.stdout.flush()
    if "prep" in tables:
        per_request.prep_table(g, args, deadline)
        sys.stdout.flush()
    if "kv" in tables:
        failures += print_kv_table(args, *kv_table(args, deadline))
        sys.stdout.flush()
    if "contig" in tables:
        contig_table(args, sizes, deadline)
    print(f"total wall time {time.monotonic() - start:.0f} s")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
