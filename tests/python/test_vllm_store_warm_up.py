"""The store's start-up warm-up (rankstore.RankStore._warm_up): one round trip of every KV
tensor's first page through a private scratch file, so that the backend's first-use set-up
(IO_URING_DMABUF pins a DRAM registration as io_uring fixed buffers) is paid when the engine
starts, not by its first request. Real NIXL runtime, the backend under test.
"""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_vllm_connector_store import (  # noqa: E402
    C,
    Kv,
    L,
    R,
    geometry,
    key,
    load_keys,
    open_rank,
    store_keys,
)


def pinned_kib() -> int:
    """This process's pinned memory (VmPin): io_uring accounts fixed buffers there."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPin:"):
                return int(line.split()[1])
    pytest.skip("no VmPin line in /proc/self/status")


@pytest.mark.parametrize("o_direct", [False, True], ids=["page-cache", "o-direct"])
def test_start_up_pins_the_kv_memory_and_leaves_it_and_the_store_folder_as_they_were(
    tmp_path, backend, direct_ok, o_direct, caplog
):
    if o_direct and not direct_ok:
        pytest.skip("O_DIRECT is not supported in the test folder")
    kv = Kv()
    for b in range(kv.arrays[0].shape[0]):
        kv.fill(b, seed=900 + b)
    before = [kv.block(b) for b in range(kv.arrays[0].shape[0])]
    kv_kib = sum(a.nbytes for a in kv.arrays) // 1024
    geo = geometry(slots=6)
    pinned = pinned_kib()
    with caplog.at_level(logging.DEBUG, logger=R.__name__):
        store = open_rank(tmp_path, geo, kv, backend, o_direct=o_direct)
    try:
        assert "warm-up round trip in" in caplog.text, caplog.text
        assert "warm-up round trip failed" not in caplog.text
        if backend == "IO_URING_DMABUF":
            # the plugin took its fixed buffers at start-up, before any job
            assert pinned_kib() - pinned >= kv_kib
        assert [kv.block(b) for b in range(len(before))] == before
        rank_dir = L.rank_dir(str(tmp_path), 0, 1)
        assert not [n for n in os.listdir(rank_dir) if n.startswith(".warm-up-")]
        # the store works as before: a stored block comes back byte for byte
        cat = C.Catalog(str(tmp_path), geo)
        store_keys(cat, store, [key(1)], [1])
        res = load_keys(cat, store, [key(1)], [9])
        assert res.ok and res.bad_blocks == []
        assert kv.block(9) == before[1]
        cat.close()
    finally:
        store.close()


def test_a_failed_warm_up_is_one_warning_and_the_store_still_works(
    tmp_path, backend, monkeypatch, caplog
):
    def refuse(self, regions, fd, timeout_s):
        raise RuntimeError("the warm-up WRITE ended in state ERR")

    monkeypatch.setattr(R.RankTransfers, "round_trip", refuse)
    kv, geo = Kv(), geometry(slots=6)
    with caplog.at_level(logging.WARNING, logger=R.__name__):
        store = open_rank(tmp_path, geo, kv, backend)
    try:
        warnings = [r for r in caplog.records if "warm-up" in r.getMessage()]
        assert len(warnings) == 1
        assert "ended in state ERR" in warnings[0].getMessage()
        assert "the first job pays the backend's set-up instead" in warnings[0].getMessage()
        kv.fill(2, seed=77)
        cat = C.Catalog(str(tmp_path), geo)
        store_keys(cat, store, [key(2)], [2])
        res = load_keys(cat, store, [key(2)], [12])
        assert res.ok and res.bad_blocks == []
        assert np.array_equal(kv.arrays[0][12], kv.arrays[0][2])
        cat.close()
    finally:
        store.close()
