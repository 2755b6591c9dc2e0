"""Stores and retrieves KV chunks through LMCache 0.5.6's own StorageManager and NIXL storage
backend, byte for byte, and times it. Run in the clients venv (ci/clients-setup.sh):

    python lmcache_driver.py '<json spec or list of specs>'  ->  prints "RESULT <json>" per spec

spec: route   "builtin"  LMCache's built-in NixlStorageBackend with nixl_backend = spec.name
                         (POSIX: NIXL's own, or the plugin installed --as POSIX, depending on
                         which NIXL the process imports)
              "plugin"   the project's storage plugin (nixl_io_uring_dmabuf.lmcache), NIXL
                         backend IO_URING_DMABUF
      pool    nixl_pool_size (0 = dynamic mode, one file per key)
      direct  use_direct_io
      path    nixl_path;  chunks, batch, layers, tokens, heads, head_dim: the KV geometry
      device  nixl_buffer_device (cpu; cuda on a GPU machine)

cpu mode registers LMCache's LocalCPUBackend pool (DRAM) with NIXL; puts go through
StorageManager.batched_put (asynchronous inside LMCache: the driver waits until the backend
reports every key), gets through StorageManager.batched_get(location=<backend>), which reads
from the files into freshly allocated pool pages.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec: dict) -> dict:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    shape = (spec["layers"], 2, spec["tokens"], spec["heads"], spec["head_dim"])
    dtype = torch.bfloat16
    chunk_bytes = 2
    for d in shape:
        chunk_bytes *= d
    n = spec["chunks"]
    extra = {
        "nixl_pool_size": spec["pool"],
        "nixl_path": spec["path"],
        "use_direct_io": spec["direct"],
        "nixl_backend_params": spec.get("params", {}),
    }
    device = spec.get("device", "cpu")
    cfg = {
        "chunk_size": spec["tokens"],
        "local_cpu": False,
        "save_unfull_chunk": False,
        # the pool holds one batch being put and all chunks being read back, with room
        "max_local_cpu_size": (3 * n * chunk_bytes) / (1 << 30),
        "nixl_buffer_device": device,
    }
    if device != "cpu":
        cfg["nixl_buffer_size"] = 2 * n * chunk_bytes
    if spec["route"] == "builtin":
        extra.update(enable_nixl_storage=True, nixl_backend=spec["name"])
        location = "NixlStorageBackend"
    else:
        name = "IO_URING_DMABUF"
        extra.update(
            {
                f"storage_plugin.{name}.module_path": "nixl_io_uring_dmabuf.lmcache",
                f"storage_plugin.{name}.class_name": "IoUringDmabufBackend",
                "rust_raw_block.use_uring": True,
            }
        )
        cfg["storage_plugins"] = [name]
        location = name
    cfg["extra_config"] = extra
    config = LMCacheEngineConfig.from_dict(cfg)
    md = LMCacheMetadata(
        model_name="iud-test",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=shape,
    )
    sm = StorageManager(config, md, EventManager())
    out = {"backends": list(sm.storage_backends), "chunk_bytes": chunk_bytes, "chunks": n}
    try:
        be = sm.storage_backends[location]
        out["backend_class"] = (
            type(be).__mro__[1].__name__ if spec["route"] == "plugin" else type(be).__name__
        )
        out["nixl_backend"] = be.nixl_config.backend
        gen = torch.Generator().manual_seed(spec.get("seed", 1))
        keys = [CacheEngineKey("iud-test", 1, 0, 10_000 + i, dtype) for i in range(n)]
        expect = {}
        put_s = 0.0
        for start in range(0, n, spec["batch"]):
            ks = keys[start : start + spec["batch"]]
            objs = sm.batched_allocate(torch.Size(shape), dtype, len(ks))
            assert objs is not None, "the LMCache CPU pool is full"
            for k, o in zip(ks, objs):
                data = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=gen)
                o.tensor.view(torch.uint8).view(-1).copy_(data)
                expect[k] = data
            t0 = time.perf_counter()
            sm.batched_put(ks, objs, location=location)
            deadline = time.monotonic() + 120
            while not all(be.contains(k) for k in ks):
                assert time.monotonic() < deadline, (
                    "puts did not complete within 120 s (see the log)"
                )
                time.sleep(0.0005)
            put_s += time.perf_counter() - t0
        get_s = 0.0
        bad = []
        for start in range(0, n, spec["batch"]):
            ks = keys[start : start + spec["batch"]]
            t0 = time.perf_counter()
            got = sm.batched_get(ks, location=location)
            get_s += time.perf_counter() - t0
            for k, g in zip(ks, got):
                if g is None:
                    bad.append(f"{k.chunk_hash}: miss")
                    continue
                data = g.tensor.view(torch.uint8).reshape(-1).cpu()
                if not torch.equal(data, expect[k]):
                    diff = int((data != expect[k]).sum())
                    bad.append(f"{k.chunk_hash}: {diff} bytes differ")
                g.ref_count_down()
        out.update(
            put_s=put_s,
            get_s=get_s,
            bad=bad,
            put_gbps=n * chunk_bytes / put_s / 1e9,
            get_gbps=n * chunk_bytes / get_s / 1e9,
        )
    finally:
        sm.close()
    return out


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    for one in specs if isinstance(specs, list) else [specs]:
        print("RESULT " + json.dumps(dict(main(one), spec=one)), flush=True)
