"""The connector's Prometheus series through one vLLM release's own offloading metrics class
(OffloadPromMetrics, what vLLM's PrometheusStatLogger builds for an offloading connector): the
spec's declared series are registered, and the manager's stats payload (a StoreQueue that
dropped blocks) lands in them. Run in the clients venv with that release first on PYTHONPATH;
prints one line: RESULT {json}."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def main() -> int:
    import vllm
    from nixl_io_uring_dmabuf.vllm_connector.backpressure import StoreQueue
    from nixl_io_uring_dmabuf.vllm_connector.metrics import QueueStats
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    extra = {
        "spec_name": "NixlStorageOffloadingSpec",
        "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
    }
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = OffloadPromMetrics(
        config,
        {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    clock = [0.0]
    q = StoreQueue(1.0, 4096, clock=lambda: clock[0])
    stats = QueueStats(q)
    prom.observe(stats.take().data, 0)  # the zeros of the first step
    q.started([b"a", b"b"])
    clock[0] = 5.0  # storage is behind: the next offer is dropped
    q.admit([b"c", b"d", b"e"], lambda k: False)
    prom.observe(stats.take().data, 0)
    samples = {
        s.name: s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith("vllm:kv_offload_store_")
        and not s.name.endswith(("_created", "_bucket"))
    }
    print("RESULT " + json.dumps({"vllm": vllm.__version__, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
