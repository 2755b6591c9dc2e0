"""NixlStorageOffloadingSpec: the OffloadingSpec vLLM's OffloadingConnector loads by name
(`spec_name` + `spec_module_path`). It reads the parameters, refuses what it cannot serve, and
builds the scheduler's manager (over the catalog) and each rank's worker (over a RankStore).
Scheduler and workers may be different processes: they share only the store's files."""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec

from . import devices, metrics, versions
from .backpressure import StoreQueue
from .catalog import Catalog
from .config import StoreConfig
from .layout import Geometry

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """The package's log lines go where vLLM's go (vLLM configures only its own logger)."""
    pkg, v = logging.getLogger("nixl_io_uring_dmabuf"), logging.getLogger("vllm")
    if not pkg.handlers and v.handlers:
        for h in v.handlers:
            pkg.addHandler(h)
        pkg.setLevel(v.level or logging.INFO)
        pkg.propagate = False


def _note_failure_policy() -> None:
    """vLLM 0.34 recomputes a request whose load failed only under kv_load_failure_policy
    "recompute"; its default, "fail", ends the request with an error (core/sched/scheduler.py
    `_handle_failed_recving`). Said once, where the engine's config is known."""
    try:
        from vllm.config.vllm import get_current_vllm_config_or_none

        kv = getattr(get_current_vllm_config_or_none(), "kv_transfer_config", None)
    except ImportError:
        return
    if kv is not None and getattr(kv, "kv_load_failure_policy", None) == "fail":
        logger.warning(
            "NixlStorageOffloadingSpec: kv_load_failure_policy is 'fail', so a request whose "
            "KV load fails (I/O error, damaged block) ends with an error; set "
            '"kv_load_failure_policy": "recompute" to have vLLM recompute it instead'
        )


class NixlStorageOffloadingSpec(OffloadingSpec):
    def __init__(self, config):
        self.vllm_release = versions.check()
        self.worker_api = versions.worker_api()
        _log_like_vllm()
        super().__init__(config)
        self.store_config = StoreConfig.from_extra(self.extra_config)
        if len(config.groups) != 1:
            raise ValueError(
                f"NixlStorageOffloadingSpec: the model has {len(config.groups)} offloaded KV cache "
                "groups (a hybrid model); only models with one group are served"
            )
        if config.canonical_layout:
            raise ValueError(
                "NixlStorageOffloadingSpec: canonical_layout is not served; leave it "
                "off (each rank stores its own blocks in its own files)"
            )
        self._manager = None
        self._worker = None

    @classmethod
    def build_metric_definitions(cls, extra_config) -> dict:
        """vLLM registers these beside its own kv_offload metrics (metrics.py)."""
        return {**super().build_metric_definitions(extra_config), **metrics.definitions()}

    @property
    def geometry(self) -> Geometry:
        c = self.store_config
        return Geometry(
            rank_block_bytes=int(self.config.worker_kv_bytes_per_block),
            blocks_per_chunk=int(self.blocks_per_chunk),
            world_size=int(self.config.parallel.world_size),
            capacity_bytes=c.capacity_bytes,
            max_file_bytes=c.max_file_bytes,
            slot_files=c.slot_files,
            slot_dirs=c.slot_dirs,
            devices=c.devices,
            device_bytes=tuple(devices.size_of(d) for d in c.devices),
        )

    def manifest(self) -> dict:
        g = self.config.groups[0]
        return {
            "model": str(self.config.model.name),
            "dtype": str(self.config.model.dtype),
            "tokens_per_block": int(g.tokens_per_block),
            "tokens_per_hash": int(self.tokens_per_hash),
            "kv_cache_layout": str(self.config.kv_cache_layout),
        }

    def get_manager(self):
        if self._manager is None:
            from .manager import NixlStorageManager

            c, g = self.store_config, self.geometry
            if self.worker_api is versions.WorkerApi.DEVICE_POINTERS:
                _note_failure_policy()
            self._manager = NixlStorageManager(
                Catalog(
                    c.path,
                    g,
                    self.manifest(),
                    durable=c.durable,
                    verify_on_lookup=c.verify_on_lookup,
                ),
                events=self.kv_events_config.enable_kv_cache_events,
                queue=StoreQueue(
                    c.store_queue_s, g.rank_block_bytes * g.blocks_per_chunk * g.world_size
                ),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches):
        if self._worker is None:
            from .worker import BlockIdsWorker, DevicePointersWorker

            api = versions.WorkerApi
            cls = DevicePointersWorker if self.worker_api is api.DEVICE_POINTERS else BlockIdsWorker
            self._worker = cls(self, kv_caches)
        return self._worker
