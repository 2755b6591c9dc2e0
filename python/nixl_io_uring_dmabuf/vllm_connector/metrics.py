"""The connector's own Prometheus metrics, through vLLM's offloading metrics (0.32, 0.33, 0.34:
distributed/kv_transfer/kv_connector/v1/offloading/metrics.py). vLLM registers the metrics an
OffloadingSpec declares in build_metric_definitions beside its own `vllm:kv_offload_*`, and
publishes what the manager's get_stats returns each step (offloading/scheduler.py get_stats).

Bytes and seconds per direction need nothing here: vLLM counts them from the worker's
TransferResult (vllm:kv_offload_store_bytes, _store_time, _load_bytes, _load_time and the
_store_size/_load_size histograms). This module adds the backpressure counters."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

from .backpressure import StoreQueue

DROPPED_BLOCKS = "vllm:kv_offload_store_dropped_blocks"
DROPPED_BYTES = "vllm:kv_offload_store_dropped_bytes"
IN_FLIGHT_BLOCKS = "vllm:kv_offload_store_in_flight_blocks"


def definitions() -> dict:
    return {
        DROPPED_BLOCKS: OffloadingCounterMetadata(
            documentation="KV blocks not stored because storage was behind (backpressure).",
        ),
        DROPPED_BYTES: OffloadingCounterMetadata(
            documentation="Bytes of KV blocks (all ranks) not stored because storage was behind.",
        ),
        IN_FLIGHT_BLOCKS: OffloadingGaugeMetadata(
            documentation="KV blocks whose stores are in flight (prepare_store to complete_store).",
        ),
    }


class QueueStats:
    """What changed in a StoreQueue since the last `take`, as vLLM's stats payload. The first
    take reports zeros, so the series exist from the engine's first step."""

    def __init__(self, queue: StoreQueue):
        self.queue = queue
        self._dropped: int | None = None
        self._in_flight: int | None = None

    def take(self) -> OffloadingConnectorStats | None:
        q = self.queue
        if q.dropped == self._dropped and q.in_flight == self._in_flight:
            return None
        stats = OffloadingConnectorStats()
        new = q.dropped - (self._dropped or 0)
        stats.increase_counter(DROPPED_BLOCKS, new)
        stats.increase_counter(DROPPED_BYTES, new * q.block_bytes)
        stats.set_gauge(IN_FLIGHT_BLOCKS, q.in_flight)
        self._dropped, self._in_flight = q.dropped, q.in_flight
        return stats
