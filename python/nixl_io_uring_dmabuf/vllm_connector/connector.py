"""NixlStorageOffloadingConnector: vLLM's OffloadingConnector plus the one thing it lacks for
this store, reporting blocks whose load failed (checksum or I/O) through vLLM's load-error path
(`get_block_ids_with_load_errors`), so that with kv_load_failure_policy "recompute" vLLM
recomputes them instead of stopping. Selected with kv_connector
"NixlStorageOffloadingConnector" and kv_connector_module_path
"nixl_io_uring_dmabuf.vllm_connector"; everything else is OffloadingConnector's.

It refuses to start with sync loads (`sync_load_budget_bytes`, read by the schedulers of vLLM
0.33 and 0.34). Under async scheduling (their default) always: measured with vLLM 0.34.0 on an
H100, a new engine whose sync loads found damaged blocks reported them, vLLM logged the requests
as rescheduled, and every such prompt's tokens were wrong. Our reading of vLLM's source
(unverified as the cause): the request's next step is scheduled before the failed step's output
is handled, and `_update_requests_with_invalid_blocks` (vllm/v1/core/sched/scheduler.py) marks
no stale output, as preemption does. With async scheduling off, only with
IUD_VLLM_ALLOW_SYNC_LOADS=1: that recovery has not been checked in an engine. Sync loads were
also slower in the same run (32k hit 164 ms against vLLM's own CPU tier's 143 without them)."""

from __future__ import annotations

import os

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from . import versions
from .worker import NixlStorageWorker


def sync_loads_used(vllm_config) -> bool:
    """Whether this engine loads hits in the step that computes them: a running vLLM that has
    sync loads, and a budget for them."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return versions.has_sync_loads() and bool(int(extra.get("sync_load_budget_bytes") or 0))


def check_sync_loads(vllm_config) -> None:
    """Raises ValueError for sync loads: always under async scheduling, else unless
    IUD_VLLM_ALLOW_SYNC_LOADS=1 (the module's docstring says why)."""
    if not sync_loads_used(vllm_config):
        return
    way_out = (
        "Drop sync_load_budget_bytes: loads then finish before the step that uses them "
        "(vLLM's default), and a failed one is recomputed."
    )
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "NixlStorageOffloadingConnector: sync_load_budget_bytes is refused under async "
            "scheduling: when sync loads failed their checksums, vLLM 0.34.0 rescheduled the "
            "requests and still returned wrong tokens (measured on an H100). " + way_out
        )
    if os.environ.get("IUD_VLLM_ALLOW_SYNC_LOADS") != "1":
        raise ValueError(
            "NixlStorageOffloadingConnector: sync_load_budget_bytes with async scheduling off "
            "has not been checked against a failed load in an engine; set "
            "IUD_VLLM_ALLOW_SYNC_LOADS=1 to use it. " + way_out
        )


class NixlStorageOffloadingConnector(OffloadingConnector):
    def __init__(self, vllm_config, *args, **kwargs):
        check_sync_loads(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)

    def _nixl_worker(self) -> NixlStorageWorker | None:
        cw = getattr(self, "connector_worker", None)
        w = getattr(cw, "worker", None)
        return w if isinstance(w, NixlStorageWorker) else None

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        w = self._nixl_worker()
        if w is not None:
            w.report_load_errors = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self._nixl_worker()
        return w.take_failed_block_ids() if w is not None else set()
