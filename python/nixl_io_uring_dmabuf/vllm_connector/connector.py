"""NixlStorageOffloadingConnector: vLLM's OffloadingConnector plus the one thing it lacks for
this store, reporting blocks whose load failed (checksum or I/O) through vLLM's load-error path
(`get_block_ids_with_load_errors`), so that with kv_load_failure_policy "recompute" vLLM
recomputes them instead of stopping. Selected with kv_connector
"NixlStorageOffloadingConnector" and kv_connector_module_path
"nixl_io_uring_dmabuf.vllm_connector"; everything else is OffloadingConnector's."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from .worker import NixlStorageWorker


class NixlStorageOffloadingConnector(OffloadingConnector):
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
