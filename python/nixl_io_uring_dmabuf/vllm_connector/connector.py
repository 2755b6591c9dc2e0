"""NixlStorageOffloadingConnector: vLLM's OffloadingConnector plus the one thing it lacks for
this store, reporting blocks whose load failed (checksum or I/O) through vLLM's load-error path
(`get_block_ids_with_load_errors`), so that with kv_load_failure_policy "recompute" vLLM
recomputes them instead of stopping. Selected with kv_connector
"NixlStorageOffloadingConnector" and kv_connector_module_path
"nixl_io_uring_dmabuf.vllm_connector"; everything else is OffloadingConnector's.

It refuses to start with sync loads (`sync_load_budget_bytes`) under async scheduling (the
default of vLLM 0.33 and 0.34). Measured with vLLM 0.34.0 on an H100: a new engine whose sync
loads found damaged blocks reported them, vLLM logged the requests as rescheduled, and every
such prompt's tokens were wrong. Our reading of vLLM's source (unverified as the cause): under
async scheduling the request's next step is scheduled before the failed step's output is
handled, and `_update_requests_with_invalid_blocks` (vllm/v1/core/sched/scheduler.py) marks no
stale output, as preemption does."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from .worker import NixlStorageWorker


def sync_loads_used(vllm_config) -> bool:
    """Whether the running vLLM loads hits in the step that computes them (the schedulers of 0.33
    and 0.34 read `sync_load_budget_bytes`; 0.32 ignores the key)."""
    try:  # 0.33's and 0.34's module; 0.32 has none
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    except ImportError:
        return False
    cfg = getattr(scheduler, "SchedulerOffloadConfig", None)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return "sync_load_budget_bytes" in getattr(cfg, "_fields", ()) and bool(
        int(extra.get("sync_load_budget_bytes") or 0)
    )


def check_sync_loads(vllm_config) -> None:
    """Raises ValueError for sync loads under async scheduling (the module's docstring: a failed
    load would give wrong tokens instead of being recomputed)."""
    if sync_loads_used(vllm_config) and vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "NixlStorageOffloadingConnector: sync_load_budget_bytes needs async scheduling "
            "off (--no-async-scheduling): under async scheduling vLLM keeps the next step's "
            "token of a request whose sync load failed, so its blocks could not be recomputed "
            "safely. Drop sync_load_budget_bytes (loads then run before the step, the "
            "default) or turn async scheduling off."
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
