"""The vLLM connector's store and load jobs on page-cache slot files, by number of slot files per
rank and by blocks per chunk: one RankStore (the connector's worker half) over DRAM KV rows of
a Llama-like shape, through the real NIXL runtime and the backend given. Every round uses a new
store folder; settings alternate within each round. Checksums are left out (a constant), so the
time is the NIXL job's: make_prepped_xfer, post, completion, commit. After the stores, every
block is loaded back into zeroed rows and compared byte for byte. IO_URING_DMABUF gets the
connector's default parameters (config.IUD_DEFAULT_PARAMS) unless --param sets them. With
--chunks above 1 a slot holds that many blocks page by page, so a page's consecutive blocks
move as one I/O.

    python3 bench/vllm_store_files.py [--files 1 8] [--chunks 1 16] [--rounds 3] [--blocks 512]
        [--layers 32] [--page-kib 64] [--job-blocks 64] [--backend IO_URING_DMABUF]
        [--param k=v ...]

Prints one JSON line per (round, files, chunk) and a median table.
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
from nixl_io_uring_dmabuf.vllm_connector import rankstore as R  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import IUD_DEFAULT_PARAMS  # noqa: E402


def _run(store, jobs) -> float:
    """Submits every job (a callable taking its job id), polls until all are over: seconds."""
    t0 = time.perf_counter()
    for j, submit in enumerate(jobs):
        submit(j + 1)
    left = set(range(1, len(jobs) + 1))
    while left:
        for res in store.poll():
            assert res.ok, res.error
            left.discard(res.job_id)
        time.sleep(0.0002)
    return time.perf_counter() - t0


def one_round(a, files: int, chunk: int, maps, regions, saved, root: str) -> dict:
    page = a.page_kib << 10
    geo = L.Geometry(
        rank_block_bytes=page * a.layers,
        blocks_per_chunk=chunk,
        world_size=1,
        capacity_bytes=a.blocks // chunk * L.round_up(chunk * page * a.layers, 4096),
        max_file_bytes=64 << 30,
        slot_files=files,
    )
    params = {
        **(IUD_DEFAULT_PARAMS if a.backend == "IO_URING_DMABUF" else {}),
        **dict(p.split("=", 1) for p in a.param),
    }  # the connector's defaults
    store = R.RankStore(
        root,
        geo,
        0,
        regions,
        "DRAM",
        R.StoreOptions(backend=a.backend, backend_params=params),
        block_sums=lambda ids: [0] * len(ids),
    )
    firsts = range(0, a.blocks, a.job_blocks)
    ids = [list(range(f, min(a.blocks, f + a.job_blocks))) for f in firsts]
    try:
        store_s = _run(
            store,
            [
                lambda j, b=b: store.submit_store(
                    j,
                    b,
                    [i // chunk for i in b],
                    [i % chunk for i in b],
                    [(s.to_bytes(36, "big"), s, s + 1) for s in sorted({i // chunk for i in b})],
                )
                for b in ids
            ],
        )
        st = dict(store.stats["store"])
        for m in maps:
            np.frombuffer(m, dtype=np.uint8)[:] = 0
        load_s = _run(
            store,
            [
                lambda j, b=b: store.submit_load(
                    j,
                    b,
                    [i // chunk for i in b],
                    [i % chunk for i in b],
                    [0] * len(b),
                    [i // chunk + 1 for i in b],
                )
                for b in ids
            ],
        )
        lt = store.stats["load"]
    finally:
        store.close()
    assert all(bytes(m) == s for m, s in zip(maps, saved)), "a loaded block differs"
    gb = a.blocks * page * a.layers / 1e9
    return {
        "files": geo.num_files,
        "chunk": chunk,
        "GB": round(gb, 3),
        "store GB/s": round(gb / store_s, 3),
        "load GB/s": round(gb / load_s, 3),
        "jobs": int(st.get("jobs", 0)),
        "store engine_thread_ms_per_job": round(1e3 * st["post_seconds"] / max(1, st["jobs"]), 3),
        "load engine_thread_ms_per_job": round(1e3 * lt["post_seconds"] / max(1, lt["jobs"]), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[1],
        help="blocks per chunk (vLLM's blocks_per_chunk)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--job-blocks", type=int, default=64)
    ap.add_argument("--backend", default="IO_URING_DMABUF")
    ap.add_argument("--param", action="append", default=[], help="backend parameter k=v")
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp dir)")
    a = ap.parse_args()
    if any(a.job_blocks % c or a.blocks % c for c in a.chunks):
        ap.error("--job-blocks and --blocks must be multiples of every --chunks value")
    page = a.page_kib << 10
    maps = [mmap.mmap(-1, a.blocks * page) for _ in range(a.layers)]
    rng = np.random.default_rng(1)
    for m in maps:
        np.frombuffer(m, dtype=np.uint8)[:] = rng.integers(0, 256, len(m), dtype=np.uint8)
    saved = [bytes(m) for m in maps]
    regions = [
        R.Region(ctypes.addressof(ctypes.c_char.from_buffer(m)), page, a.blocks, page) for m in maps
    ]
    base = tempfile.mkdtemp(prefix="iud-store-files-", dir=a.dir)
    settings = [(f, c) for f in a.files for c in a.chunks]
    rows: dict[tuple[int, int], list[dict]] = {k: [] for k in settings}
    try:
        for rnd in range(a.rounds):
            for files, chunk in settings if rnd % 2 == 0 else settings[::-1]:
                root = os.path.join(base, f"r{rnd}-f{files}-c{chunk}")
                row = {
                    "round": rnd,
                    "backend": a.backend,
                    **one_round(a, files, chunk, maps, regions, saved, root),
                }
                print(json.dumps(row), flush=True)
                rows[(files, chunk)].append(row)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\n| slot files | blocks per chunk | store GB/s (median of {a.rounds}) | load GB/s "
        "| engine thread ms/job, store / load |"
    )
    print("|---:|---:|---:|---:|---|")
    med = statistics.median
    for rs in rows.values():
        print(
            f"| {rs[0]['files']} | {rs[0]['chunk']} | {med(r['store GB/s'] for r in rs):.2f} | "
            f"{med(r['load GB/s'] for r in rs):.2f} | "
            f"{med(r['store engine_thread_ms_per_job'] for r in rs):.2f} / "
            f"{med(r['load engine_thread_ms_per_job'] for r in rs):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
