"""vLLM KV-cache offloading to files or block devices through NIXL (default backend
IO_URING_DMABUF), loaded by vLLM from its configuration alone:

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "NixlStorageOffloadingSpec",
        "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
        "path": "/mnt/nvme/vllm-kv", "capacity_gb": 512}}

The worker moves blocks directly between the engine's own KV cache tensors (VRAM on CUDA,
DRAM on vLLM's CPU platform) and slot files or raw block devices; the scheduler keeps an index of committed blocks
that a new engine rebuilds from the store's journals. docs/vllm-connector.md has the
parameters, the store format and the limits.

Modules: config (parameters), layout (geometry, files, manifest), media (the store id and
the slot directories' markers), devices (raw block devices: size, claiming, header), journal (records) with file_size
(a journal's size as the file system has it, for stores shared across nodes), checksum,
catalog (the scheduler's index; no vLLM), rankstore (one rank's NIXL transfers; no vLLM) over
jobs (a job's records and parts) and transfers (its NIXL agent),
versions (supported vLLM releases and their worker API), kv_views (vLLM's KV memory and a job's
device side as KV rows), load_store_specs (what a job hands the workers), manager, backpressure
(stores dropped when storage is behind), metrics (the spec's Prometheus series), worker, spec
(the OffloadingSpec vLLM loads), connector (the subclass that reports damaged loads to vLLM for
recomputation). The vLLM-facing names load lazily, so the store's own modules import without
vLLM.
"""

from __future__ import annotations

_LAZY = {
    "NixlStorageOffloadingSpec": "spec",
    "NixlStorageManager": "manager",
    "NixlStorageWorker": "worker",
    "NixlStorageOffloadingConnector": "connector",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
