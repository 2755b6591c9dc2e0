"""The vLLM connector's store jobs into page-cache slot files, by number of slot files per rank:
one RankStore (the connector's worker half) over DRAM KV rows of a Llama-like shape, through
the real NIXL runtime and the backend given. Every round uses a new store folder; settings
alternate within each round. Checksums are left out (a constant), so the time is the NIXL
job's: make_prepped_xfer, post, completion, commit. IO_URING_DMABUF gets the connector's
default parameters (config.IUD_DEFAULT_PARAMS) unless --param sets them.

    python3 bench/vllm_store_files.py [--files 1 8] [--rounds 3] [--blocks 512] [--layers 32]
        [--page-kib 64] [--job-blocks 64] [--backend IO_URING_DMABUF] [--param k=v ...]

Prints one JSON line per (round, files) and a median table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from nixl_io_uring_dmabuf.vllm_connector import layout as L  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import IUD_DEFAULT_PARAMS  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import rankstore as R  # noqa: E402


def one_round(a, files: int, maps, regions, root: str) -> dict:
    page = a.page_kib << 10
    geo = L.Geometry(rank_block_bytes=page * a.layers, blocks_per_chunk=1, world_size=1,
                     capacity_bytes=a.blocks * L.round_up(page * a.layers, 4096),
                     max_file_bytes=64 << 30, slot_files=files)
    params = {**(IUD_DEFAULT_PARAMS if a.backend == "IO_URING_DMABUF" else {}),
              **dict(p.split("=", 1) for p in a.param)}  # the connector's defaults
    store = R.RankStore(root, geo, 0, regions, "DRAM", backend=a.backend, backend_params=params,
                        block_sums=lambda ids: [0] * len(ids))
    try:
        jobs = range(0, a.blocks, a.job_blocks)
        t0 = time.perf_counter()
        for j, first in enumerate(jobs):
            ids = list(range(first, min(a.blocks, first + a.job_blocks)))
            store.submit_store(j + 1, ids, ids, [0] * len(ids),
                               [(i.to_bytes(36, "big"), i, i + 1) for i in ids])
        left = set(range(1, len(jobs) + 1))
        while left:
            for res in store.poll():
                assert res.ok, res.error
                left.discard(res.job_id)
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        st = store.stats["store"]
    finally:
        store.close()
    fi, off = geo.locate(a.blocks - 1)
    with open(L.slot_file(root, 0, 1, fi), "rb") as f:
        f.seek(off)
        got = f.read(page)
    want = bytes(maps[0][(a.blocks - 1) * page:a.blocks * page])
    assert got == want, "the last block's first page is not where Geometry.locate says"
    gb = a.blocks * page * a.layers / 1e9
    return {"files": geo.num_files, "GB": round(gb, 3), "s": round(dt, 4),
            "GB/s": round(gb / dt, 3), "jobs": int(st.get("jobs", 0)),
            "engine_thread_ms_per_job": round(1e3 * st.get("post_seconds", 0)
                                              / max(1, st.get("jobs", 1)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--job-blocks", type=int, default=64)
    ap.add_argument("--backend", default="IO_URING_DMABUF")
    ap.add_argument("--param", action="append", default=[], help="backend parameter k=v")
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp dir)")
    a = ap.parse_args()
    page = a.page_kib << 10
    maps = [mmap.mmap(-1, a.blocks * page) for _ in range(a.layers)]
    rng = np.random.default_rng(1)
    for m in maps:
        np.frombuffer(m, dtype=np.uint8)[:] = rng.integers(0, 256, len(m), dtype=np.uint8)
    regions = [R.Region(ctypes.addressof(ctypes.c_char.from_buffer(m)), page, a.blocks, page)
               for m in maps]
    base = tempfile.mkdtemp(prefix="iud-store-files-", dir=a.dir)
    rows: dict[int, list[dict]] = {f: [] for f in a.files}
    try:
        for rnd in range(a.rounds):
            order = a.files if rnd % 2 == 0 else a.files[::-1]
            for files in order:
                root = os.path.join(base, f"r{rnd}-f{files}")
                row = {"round": rnd, "backend": a.backend, **one_round(a, files, maps, regions,
                                                                          root)}
                print(json.dumps(row), flush=True)
                rows[files].append(row)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n| slot files | store GB/s (median of {a.rounds}) | rounds | engine thread ms/job |")
    print("|---:|---:|---|---:|")
    for files, rs in rows.items():
        g = [r["GB/s"] for r in rs]
        print(f"| {rs[0]['files']} | {statistics.median(g):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in g)} | "
              f"{statistics.median(r['engine_thread_ms_per_job'] for r in rs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
