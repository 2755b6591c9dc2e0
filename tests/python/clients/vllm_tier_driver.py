"""Drives the NixlFileTier through vLLM 0.33's or 0.34's own tier interfaces (SecondaryTierFactory,
SecondaryTierManager: submit_store / submit_load / get_finished_jobs / lookup / drain_jobs),
over a real primary tier (CPUPrimaryTierOffloadingManager on a SharedOffloadRegion, the
memoryview vLLM hands its tiers). Run in the clients venv:

    python vllm_tier_driver.py '<json spec or list>'   ->   prints "RESULT <json>" per spec

spec: backend (NIXL backend name), path, direct, chunks, chunk_bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid


def main(spec: dict) -> dict:
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    n, cb = spec["chunks"], spec["chunk_bytes"]
    region = SharedOffloadRegion(
        engine_id=f"iud-{uuid.uuid4().hex[:8]}",
        num_chunks=2 * n + 1,
        rank=None,
        kv_bytes_per_chunk=cb,
        cpu_page_size=cb,
    )
    primary = CPUPrimaryTierOffloadingManager(num_chunks=2 * n + 1, mmap_region=region)
    view = primary.get_kv_memoryview()
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "NixlFileTier",
            "module_path": "nixl_io_uring_dmabuf.vllm_tier",
            "path": spec["path"],
            "backend": spec["backend"],
            "direct_io": spec["direct"],
            "backend_params": spec.get("params", {}),
        },
        view,
        None,
    )
    arr = np.asarray(view).view(np.uint8)  # the view is signed bytes
    rng = np.random.default_rng(spec.get("seed", 3))
    arr[:n] = rng.integers(0, 256, size=(n, cb), dtype=np.uint8)
    original = arr[:n].copy()
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(n)]
    ctx = ReqContext(req_id="r")
    import vllm

    out = {"tier": type(tier).__name__, "problems": [], "vllm": vllm.__version__}

    def wait(ids):
        results, deadline = {}, time.monotonic() + 120
        while len(results) < len(ids):
            for r in tier.get_finished_jobs():  # noqa: F821 - bound above; `del` only at the end
                results[r.job_id] = r
            assert time.monotonic() < deadline, f"jobs {ids} not finished in 120 s"
            time.sleep(0.0005)
        return results

    half = n // 2
    t0 = time.perf_counter()
    tier.submit_store(TransferJob(1, keys[:half], np.arange(half), False, ctx))
    tier.submit_store(TransferJob(2, keys[half:], np.arange(half, n), False, ctx))
    res = wait([1, 2])
    out["store_s"] = time.perf_counter() - t0
    if not (res[1].success and res[2].success):
        out["problems"].append(f"store failed: {res}")
    if any(tier.lookup(k, ctx) != LookupResult.HIT for k in keys):
        out["problems"].append("a stored key is not a HIT")
    if tier.lookup(make_offload_key(b"\1" * 32, 0), ctx) != LookupResult.MISS:
        out["problems"].append("an unknown key is not a MISS")
    for i, k in enumerate(keys):  # the files hold the chunks
        with open(os.path.join(spec["path"], bytes(k).hex() + ".kv"), "rb") as f:
            if f.read() != original[i].tobytes():
                out["problems"].append(f"file of chunk {i} differs")
    arr[n : 2 * n] = 0xA5  # poison the slots the load fills
    t0 = time.perf_counter()
    tier.submit_load(TransferJob(3, keys, np.arange(n, 2 * n), True, ctx))
    res = wait([3])
    out["load_s"] = time.perf_counter() - t0
    if not res[3].success:
        out["problems"].append("load failed")
    for i in range(n):
        if not np.array_equal(arr[n + i], original[i]):
            out["problems"].append(
                f"chunk {i} loaded wrong: {int((arr[n + i] != original[i]).sum())} bytes differ"
            )
    tier.submit_load(
        TransferJob(4, [make_offload_key(b"\2" * 32, 0)], np.array([2 * n]), True, ctx)
    )
    if wait([4])[4].success:
        out["problems"].append("a load of a key never stored succeeded")
    tier.submit_store(TransferJob(5, keys[:2], np.arange(2), False, ctx))  # already present
    if not wait([5])[5].success:
        out["problems"].append("re-storing present keys failed")
    tier.drain_jobs()
    tier.shutdown()
    leftovers = [f for f in os.listdir(spec["path"]) if f.endswith(".tmp")]
    if leftovers:
        out["problems"].append(f"temporary files left: {leftovers}")
    out["bytes"] = n * cb
    del arr, tier
    primary.shutdown()
    return out


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    for one in specs if isinstance(specs, list) else [specs]:
        print("RESULT " + json.dumps(dict(main(one), spec=one)), flush=True)
