"""The host <-> GPU copy stage of the staging path alone: what the driver's copies reach for the
KV-cache pattern, without storage I/O. The bound a staged VRAM transfer can at best reach.

Pieces of B bytes go from a pinned host pool shaped like the plugin's staging pool (32 buffers of
2 MiB, pieces packed PACK to a buffer) to random, non-overlapping slots of a 1 GiB VRAM region
(or back), the way the plugin issues them: one cuMemcpyBatchAsync call per buffer ("batch") or one
cuMemcpy{HtoD,DtoH}Async per piece ("piece"), on 1 or more streams taken in turn per buffer.
Every copy of a whole pass is queued first, then the streams are synchronized: GB/s is the pass's
bytes over its wall time (decimal GB), "submit us/piece" the calling thread's CPU time spent in
the queueing calls per piece (ctypes call overhead included). One sample of pieces is compared
byte for byte after each pass.

Usage: python3 bench/gpu_copy_bound.py [--sizes 16K,64K,256K,2M] [--streams 1,4] [--total_mib 256]
"""

import argparse
import ctypes
import random
import time

import torch

MiB = 1 << 20
POOL_BUFFERS, BUFFER = 32, 2 * MiB


def size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KM" else s) * mult


class Attr(ctypes.Structure):
    # CUmemcpyAttributes (cuda.h 12.8+): srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags.
    _fields_ = [
        ("order", ctypes.c_uint),
        ("src_kind", ctypes.c_uint),
        ("src_id", ctypes.c_int),
        ("dst_kind", ctypes.c_uint),
        ("dst_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


def load_cuda():
    cu = ctypes.CDLL("libcuda.so.1")
    u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    cu.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]
    cu.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]
    cu.cuStreamSynchronize.argtypes = [vp]
    batch = getattr(cu, "cuMemcpyBatchAsync_v2", None)
    if batch is not None:
        batch.argtypes = [vp, vp, vp, sz, ctypes.POINTER(Attr), vp, sz, vp]
    return cu, batch


def run_pass(cu, batch, mode, to_host, groups, streams, dev_base, host_base, block):
    """Queues every group's copies, round-robin over streams; returns (wall s, submit cpu s)."""
    attr = Attr(1, 1 if to_host else 2, 0, 2 if to_host else 1, 0, 0)
    idx = ctypes.c_size_t(0)
    t0, c0 = time.perf_counter(), time.thread_time()
    for g, (dsts, srcs, sizes, n, pieces) in enumerate(groups):
        s = streams[g % len(streams)]
        if mode == "batch" and n > 1:
            rc = batch(dsts, srcs, sizes, n, ctypes.byref(attr), ctypes.byref(idx), 1, s)
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync_v2 returned {rc}")
        else:
            for dev_off, host_off in pieces:
                if to_host:
                    rc = cu.cuMemcpyDtoHAsync_v2(host_base + host_off, dev_base + dev_off, block, s)
                else:
                    rc = cu.cuMemcpyHtoDAsync_v2(dev_base + dev_off, host_base + host_off, block, s)
                if rc != 0:
                    raise RuntimeError(f"cuMemcpyAsync returned {rc}")
    c1 = time.thread_time()
    for s in streams:
        cu.cuStreamSynchronize(s)
    return time.perf_counter() - t0, c1 - c0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16K,64K,256K,2M")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--modes", default="batch,piece")
    ap.add_argument("--total_mib", type=int, default=256)
    ap.add_argument(
        "--pack_max",
        default="128K",
        help="pieces up to this size share a buffer (the plugin's staging_pack_max)",
    )
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    torch.cuda.init()
    vram = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    host = torch.empty(POOL_BUFFERS * BUFFER, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    torch.cuda.synchronize()
    cu, batch = load_cuda()
    streams = [torch.cuda.Stream() for _ in range(max(int(x) for x in a.streams.split(",")))]
    handles = [ctypes.c_void_p(s.cuda_stream) for s in streams]
    dev_base, host_base = vram.data_ptr(), host.data_ptr()
    pack_max = size(a.pack_max)
    print(
        f"# Host <-> GPU copy stage alone ({torch.cuda.get_device_name(0)}, torch {torch.__version__})\n"
    )
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; pool {POOL_BUFFERS} x {BUFFER // MiB} MiB pinned "
        f"(torch pin_memory), {a.total_mib} MiB per pass to random slots of 1 GiB VRAM, pieces up to {pack_max >> 10} KiB "
        f"packed per buffer; median of {a.passes} passes; batched entry point: {'cuMemcpyBatchAsync_v2' if batch else 'none'}\n"
    )
    print(
        "| direction | block | mode | streams | pieces per call | GB/s | submit us/piece | verified |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for block in (size(s) for s in a.sizes.split(",")):
        n = a.total_mib * MiB // block
        per_buf = max(1, min(256, BUFFER // block)) if block <= pack_max else 1
        rng = random.Random(block)
        slots = rng.sample(range((1 << 30) // block), n)
        groups = []
        for g0 in range(0, n, per_buf):
            pieces = [
                (slots[i] * block, ((g0 // per_buf) % POOL_BUFFERS) * BUFFER + (i - g0) * block)
                for i in range(g0, min(n, g0 + per_buf))
            ]
            k = len(pieces)
            groups.append(
                [
                    (ctypes.c_uint64 * k)(),
                    (ctypes.c_uint64 * k)(),
                    (ctypes.c_size_t * k)(*([block] * k)),
                    k,
                    pieces,
                ]
            )
        for to_host in (False, True):
            for g in groups:
                for j, (d, h) in enumerate(g[4]):
                    g[0][j], g[1][j] = (
                        (host_base + h, dev_base + d) if to_host else (dev_base + d, host_base + h)
                    )
            for mode in a.modes.split(","):
                if mode == "batch" and (batch is None or per_buf == 1):
                    continue
                for ns in (int(x) for x in a.streams.split(",")):
                    walls, cpus, ok = [], [], True
                    for _ in range(a.passes):
                        if to_host:
                            vram.random_(0, 256)
                            torch.cuda.synchronize()
                        w, c = run_pass(
                            cu,
                            batch,
                            mode,
                            to_host,
                            groups,
                            handles[:ns],
                            dev_base,
                            host_base,
                            block,
                        )
                        walls.append(w)
                        cpus.append(c)
                        # The last group of each buffer wins where buffers are reused: check those.
                        for d, h in [p for g in groups[-POOL_BUFFERS:] for p in g[4]][
                            :: max(1, per_buf // 4)
                        ][:64]:
                            ok &= bool(torch.equal(vram[d : d + block].cpu(), host[h : h + block]))
                    walls.sort()
                    cpus.sort()
                    w, c = walls[len(walls) // 2], cpus[len(cpus) // 2]
                    print(
                        f"| {'GPU->host' if to_host else 'host->GPU'} | {block >> 10} KiB | {mode} | {ns} | {per_buf} | "
                        f"{a.total_mib * MiB / w / 1e9:.2f} | {c / n * 1e6:.2f} | {'yes' if ok else 'NO'} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
