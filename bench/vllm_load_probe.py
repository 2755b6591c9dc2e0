"""Where the vLLM connector's load job spends its time, outside vLLM, and the bounds it can reach
on the same machine in the same call.

One RankStore (the connector's worker half, with its checksums on the device as the worker queues
them) over KV rows shaped like vLLM 0.34's for Llama-3.1-8B: one tensor per layer, one page of
64 KiB per (block, layer), block size 16 (so 32768 tokens are 2048 blocks, 4 GiB), slots of 16
blocks in page-cache files, through the real NIXL runtime. Each variant (backend parameters, or
checksums off) stores the prefix once, then loads it back `--rounds` times into other rows,
consecutive (a fresh engine) or scattered (a busy one), polling as an engine step would; every
load is compared with the stored rows. A job's time is split by the store's phases (post:
list indices and make_prepped_xfer and transfer; xfer: until NIXL reports DONE; check: the
checksums of what arrived; finish).

Bounds, same call (`--bounds`): one pinned host buffer of the job's bytes copied to VRAM (the
bus); the slot files read into pinned host memory by N threads (the page cache's copy); the
plugin moving the same file ranges into one contiguous VRAM buffer in 1 MiB descriptors (no
scatter, no checksums).

    python3 bench/vllm_load_probe.py --dir /tmp/probe [--tokens 32768] [--rounds 3]
        [--rows consecutive scattered] [--variants light caller nosums ...] [--bounds]
        [--device cuda|cpu] [--o-direct] [--slot-dirs A:B] [--file-mib 3072]
        [--keep] [--load-only] [--no-warm-up]

Prints one JSON line per measurement and a summary table (markdown) at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from nixl_io_uring_dmabuf.vllm_connector import checksum  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import layout as L  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import rankstore as R  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import IUD_DEFAULT_PARAMS  # noqa: E402

BLOCK_TOKENS = 16
# name: (backend parameters over the connector's defaults, store options, checksum kernel);
# "nosums" leaves the checksums out
WHOLE = {"part_bytes": 1 << 62}
VARIANTS: dict[str, tuple[dict, dict, str]] = {
    "light": ({}, {}, "auto"),
    "whole": ({}, WHOLE, "auto"),
    "whole-torch": ({}, WHOLE, "torch"),
    "torchsums": ({}, {}, "torch"),
    "part64m": ({}, {"part_bytes": 64 << 20}, "auto"),
    "part1g": ({}, {"part_bytes": 1 << 30}, "auto"),
    "caller": ({"page_cache_caller_reads": "true"}, {}, "auto"),
    "piece1m": ({"staged_read_piece_max": "1048576"}, {}, "auto"),
    "buf8": ({"staging_buffers": "8"}, {}, "auto"),
    "buf16": ({"staging_buffers": "16"}, {}, "auto"),
    "buf64": ({"staging_buffers": "64"}, {}, "auto"),
    "buf128": ({"staging_buffers": "128"}, {}, "auto"),
    "sbuf8m": ({"staging_buffer_size": "8388608", "staging_buffers": "16"}, {}, "auto"),
    "nofixed": ({"fixed_buffers": "off"}, {}, "auto"),
    "threads15": ({"page_cache_threads": "15"}, {}, "auto"),
    "spin": ({"page_cache_spin_us": "200"}, {}, "auto"),
    "nosums": ({}, {}, "auto"),
}


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


class Probe:
    def __init__(self, a):
        import torch

        self.a, self.t = a, torch
        self.dev = torch.device(a.device)
        self.page = a.page_kib << 10
        self.nblocks = a.tokens // BLOCK_TOKENS
        self.nchunks = -(-self.nblocks // a.bpc)
        self.nblocks = self.nchunks * a.bpc
        rows = 2 * self.nblocks + 64
        gen = torch.Generator(device=self.dev).manual_seed(7)
        self.tensors = [self._aligned(rows, gen) for _ in range(a.layers)]
        self.sums = {
            k: checksum.TorchRows(self.tensors, [self.page] * a.layers, kernel=k)
            for k in ("auto", "torch")
        }
        emit({"checksum_kernel_auto": self.sums["auto"].kernel})
        self.side = torch.cuda.Stream(self.dev) if self.dev.type == "cuda" else None
        dev_id = (self.dev.index or 0) if self.dev.type == "cuda" else 0
        self.regions = [
            R.Region(x.data_ptr(), x.stride(0), rows, self.page, dev_id) for x in self.tensors
        ]
        self.kind = "VRAM" if self.dev.type == "cuda" else "DRAM"
        self.geo = L.Geometry(
            rank_block_bytes=self.page * a.layers,
            blocks_per_chunk=a.bpc,
            world_size=1,
            capacity_bytes=self.nchunks * L.round_up(a.bpc * self.page * a.layers, 4096),
            max_file_bytes=a.file_mib << 20,
            slot_dirs=tuple(a.slot_dirs.split(":")) if a.slot_dirs else (),
        )
        rng = np.random.default_rng(3)
        perm = rng.permutation(rows - self.nblocks) + self.nblocks
        self.src = np.arange(self.nblocks, dtype=np.int64)
        self.dst = {
            "consecutive": np.arange(self.nblocks, 2 * self.nblocks, dtype=np.int64),
            "scattered": np.sort(perm[: self.nblocks])[rng.permutation(self.nblocks)],
        }

    def _aligned(self, rows: int, gen):
        """Random KV rows starting on a 4 KiB boundary (O_DIRECT into DRAM needs it; CUDA's
        allocations already are)."""
        t = self.t
        flat = t.randint(
            -128, 128, (rows * self.page + 4096,), dtype=t.int8, device=self.dev, generator=gen
        )
        skip = -flat.data_ptr() % 4096
        return flat[skip : skip + rows * self.page].view(rows, self.page)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.t.cuda.synchronize(self.dev)

    def launcher(self, on: bool, kernel: str = "auto"):
        rows = self.sums[kernel]

        def launch(blocks):
            if not on:
                return _Const([0] * len(blocks))
            if self.side is None:
                return rows.launch(blocks)
            with self.t.cuda.stream(self.side):
                return rows.launch(blocks)

        return launch

    def run(self, name: str, root: str) -> list[dict]:
        a = self.a
        params, options, kernel = VARIANTS[name]
        sums_on = name != "nosums"
        opts = R.StoreOptions(
            backend=a.backend,
            backend_params={**IUD_DEFAULT_PARAMS, **params},
            o_direct=a.o_direct,
            **options,
        )
        # Each variant's store has slot folders of its own (a folder serves one store), so a
        # --load-only run of any variant finds that variant's slots.
        geo = dataclasses.replace(
            self.geo, slot_dirs=tuple(os.path.join(d, name) for d in self.geo.slot_dirs)
        )
        if not a.load_only:
            for d in [root, *geo.slot_dirs]:
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
        launch = self.launcher(sums_on, kernel)
        store = R.RankStore(root, geo, 0, self.regions, self.kind, opts, launch_sums=launch)
        out = []
        try:
            k = np.arange(self.nblocks)
            slots, subs = k // a.bpc, k % a.bpc
            commits = [(b"k%d" % s, int(s), 1) for s in range(self.nchunks)]
            if not a.load_only:  # else the slots an earlier --keep run stored
                self.sync()
                t0 = time.perf_counter()
                store.submit_store(1, self.src, slots, subs, commits)
                res = self._wait(store, 1)
                store_s = time.perf_counter() - t0
                out.append(self._rec(name, "store", "-", res, store_s))
                emit(out[-1])
            sums = self.sums["torch"].block_sums(self.src) if sums_on else [0] * self.nblocks
            job = 2
            for r in range(a.rounds):
                for rows_kind in a.rows:
                    dst = self.dst[rows_kind]
                    for x in self.tensors:
                        x[dst] = 0
                    self.sync()
                    t0 = time.perf_counter()
                    store.submit_load(job, dst, slots, subs, sums, [1] * self.nchunks)
                    res = self._wait(store, job)
                    dt = time.perf_counter() - t0
                    self.sync()
                    same = all(self.t.equal(x[dst], x[self.src]) for x in self.tensors)
                    rec = self._rec(name, "load", rows_kind, res, dt)
                    rec.update(round=r, bytes_equal=same)
                    out.append(rec)
                    emit(rec)
                    job += 1
        finally:
            store.close()
            if not a.keep:
                for d in [root, *geo.slot_dirs]:
                    shutil.rmtree(d, ignore_errors=True)
        return out

    def _wait(self, store, job_id):
        while True:
            for res in store.poll():
                if res.job_id == job_id:
                    if not res.ok or res.bad_blocks:
                        raise RuntimeError(f"job {job_id}: {res.error or res.bad_blocks}")
                    return res
            time.sleep(self.a.poll_us * 1e-6)

    def _rec(self, name, what, rows_kind, res, wall) -> dict:
        return {
            "variant": name,
            "job": what,
            "rows": rows_kind,
            "gb": round(res.nbytes / 1e9, 3),
            "wall_ms": round(wall * 1e3, 2),
            "gbps": round(res.nbytes / wall / 1e9, 2),
            "phases_ms": {k: round(v * 1e3, 2) for k, v in res.phases.items()},
        }


class _Const:
    def __init__(self, v):
        self._v = v

    def done(self) -> bool:
        return True

    def result(self):
        return self._v


def bounds(p: Probe, root: str) -> list[dict]:
    """The bus, the page cache's copy and the plugin without scatter or checksums."""
    t, a = p.t, p.a
    nbytes = p.nblocks * p.page * a.layers
    out = []
    if p.dev.type == "cuda":
        host = t.empty(nbytes, dtype=t.uint8, pin_memory=True)
        dev = t.empty(nbytes, dtype=t.uint8, device=p.dev)
        for _ in range(3):
            p.sync()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            p.sync()
            dt = time.perf_counter() - t0
            out.append(
                {"bound": "pinned host -> VRAM, one copy", "gbps": round(nbytes / dt / 1e9, 2)}
            )
        del dev
    else:
        host = t.empty(nbytes, dtype=t.uint8)
    # the slot files as the store lays them out
    opts = R.StoreOptions(backend=a.backend, backend_params=dict(IUD_DEFAULT_PARAMS))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    store = R.RankStore(root, p.geo, 0, p.regions, p.kind, opts, launch_sums=p.launcher(False))
    k = np.arange(p.nblocks)
    store.submit_store(1, p.src, k // a.bpc, k % a.bpc, [])
    p._wait(store, 1)
    files = [os.open(L.slot_file(root, 0, 1, i), os.O_RDONLY) for i in range(p.geo.num_files)]
    hv = host.numpy()
    piece = 4 << 20
    tasks = []
    for s in range(p.nchunks):
        fi, off = p.geo.locate(s)
        for o in range(0, p.geo.slot_bytes, piece):
            n = min(piece, p.geo.slot_bytes - o)
            dst = s * p.geo.slot_bytes + o
            if dst + n <= nbytes:
                tasks.append((files[fi], off + o, dst, n))
    for threads in a.read_threads:
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for _ in range(3):
                t0 = time.perf_counter()
                list(ex.map(lambda x: os.preadv(x[0], [hv[x[2] : x[2] + x[3]]], x[1]), tasks))
                dt = time.perf_counter() - t0
                out.append(
                    {
                        "bound": f"page cache -> pinned host, {threads} threads, 4 MiB preadv",
                        "gbps": round(nbytes / dt / 1e9, 2),
                    }
                )
    for f in files:
        os.close(f)
    store.close()
    # the plugin, file -> one contiguous buffer of the same memory kind, 1 MiB descriptors
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("probe-bound", nixl_agent_config(backends=[]))
    agent.create_backend(a.backend, dict(IUD_DEFAULT_PARAMS))
    buf = t.empty(nbytes, dtype=t.uint8, device=p.dev)
    fds = [os.open(L.slot_file(root, 0, 1, i), os.O_RDWR) for i in range(p.geo.num_files)]
    mreg = agent.register_memory([(buf.data_ptr(), nbytes, p.dev.index or 0, "")], p.kind)
    freg = agent.register_memory(
        [(0, p.geo.file_slots(i) * p.geo.slot_bytes, fd, "") for i, fd in enumerate(fds)], "FILE"
    )
    mib = 1 << 20
    local, remote = [], []
    for s in range(p.nchunks):
        fi, off = p.geo.locate(s)
        for o in range(0, p.nblocks * p.page * a.layers // p.nchunks, mib):
            local.append((buf.data_ptr() + s * (nbytes // p.nchunks) + o, mib, p.dev.index or 0))
            remote.append((off + o, mib, fds[fi]))
    ld = agent.get_xfer_descs(local, p.kind)
    rd = agent.get_xfer_descs(remote, "FILE")
    for _ in range(3):
        t0 = time.perf_counter()
        h = agent.initialize_xfer("READ", ld, rd, agent.name)
        agent.transfer(h)
        while (st := agent.check_xfer_state(h)) == "PROC":
            time.sleep(a.poll_us * 1e-6)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(h)
        out.append(
            {
                "bound": f"plugin READ file -> contiguous {p.kind}, 1 MiB descriptors ({st})",
                "gbps": round(nbytes / dt / 1e9, 2),
            }
        )
    agent.deregister_memory(freg)
    agent.deregister_memory(mreg)
    for f in fds:
        os.close(f)
    shutil.rmtree(root, ignore_errors=True)
    for rec in out:
        emit(rec)
    return out


def summary(loads: list[dict], bnds: list[dict]) -> str:
    lines = [
        "| variant | job | rows | ms (median) | GB/s | first round ms | later rounds ms | post | xfer "
        "| check | finish | equal |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keys = sorted({(r["variant"], r["job"], r["rows"]) for r in loads})
    for v, job, rows in keys:
        rs = [r for r in loads if (r["variant"], r["job"], r["rows"]) == (v, job, rows)]
        med = statistics.median(r["wall_ms"] for r in rs)

        def ph(k, rs=rs):
            return statistics.median(r["phases_ms"].get(k, 0.0) for r in rs)

        # a process's first load against its later ones (a first-round cost shows here)
        first = [r["wall_ms"] for r in rs if r.get("round") == 0]
        later = [r["wall_ms"] for r in rs if r.get("round", 0) > 0]
        f_ms = f"{first[0]:.1f}" if first else "-"
        l_ms = f"{statistics.median(later):.1f}" if later else "-"
        lines.append(
            f"| {v} | {job} | {rows} | {med:.1f} | {rs[0]['gb'] / med * 1e3:.1f} | {f_ms} | {l_ms} | "
            f"{ph('post'):.1f} | "
            f"{ph('xfer'):.1f} | {ph('check'):.1f} | {ph('finish'):.1f} | "
            f"{all(r.get('bytes_equal', '-') for r in rs)} |"
        )
    by: dict[str, list] = {}
    for b in bnds:
        by.setdefault(b["bound"], []).append(b["gbps"])
    lines += ["", "| bound | GB/s (best of 3) |", "|---|---:|"]
    lines += [f"| {k} | {max(v):.1f} |" for k, v in by.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--bpc", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", nargs="+", default=["consecutive", "scattered"])
    ap.add_argument("--variants", nargs="+", default=["light"], choices=sorted(VARIANTS))
    ap.add_argument("--backend", default="IO_URING_DMABUF")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--poll-us", type=float, default=200.0)
    ap.add_argument("--bounds", action="store_true")
    ap.add_argument("--read-threads", type=int, nargs="+", default=[8, 14])
    ap.add_argument("--o-direct", action="store_true", help="the store's o_direct option")
    ap.add_argument("--slot-dirs", default="", help="A:B: the slot files striped over these")
    ap.add_argument("--file-mib", type=int, default=64 << 10, help="largest slot file")
    ap.add_argument("--keep", action="store_true", help="leave the store for a --load-only run")
    ap.add_argument(
        "--load-only",
        action="store_true",
        help="load what an earlier --keep run of the same arguments stored (a new process's "
        "first load against its later ones)",
    )
    ap.add_argument(
        "--no-warm-up", action="store_true", help="leave out the store's start-up round trip"
    )
    a = ap.parse_args()
    if a.no_warm_up:
        R.RankStore._warm_up = lambda self, o_direct: None
    p = Probe(a)
    emit({"machine": os.uname().nodename, "tokens": a.tokens, "blocks": p.nblocks, "args": vars(a)})
    loads = []
    for v in a.variants:
        loads += p.run(v, os.path.join(a.dir, v))
    bnds = bounds(p, os.path.join(a.dir, "bounds")) if a.bounds else []
    print(summary(loads, bnds), flush=True)


if __name__ == "__main__":
    main()
