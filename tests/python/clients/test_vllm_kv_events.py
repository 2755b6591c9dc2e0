"""The connector's KV events (issue 47 item 3): the manager reports the blocks it serves from
storage (medium STORAGE), and vLLM's OffloadingConnector publishes them as BlockStored /
BlockRemoved on its KV event stream.

- Without an engine, for vLLM 0.32, 0.33 and 0.34 (vllm_events_driver.py over vLLM's own
  offloading classes): the events after stores, an eviction, damage on lookup and on load, an
  adoption before complete_store, a new manager's replay and reset_cache, and vLLM's own
  translation of them.

Needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import json
import os

import clients_env as E
import pytest
from test_vllm_connector import child_path

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
