"""The vLLM connector's store without vLLM: the scheduler's catalog (index, journals, eviction,
replay) and one rank's RankStore (slot files, NIXL transfers, checksums) through the real NIXL
runtime and the backend under test (IO_URING_DMABUF, or POSIX with IUD_TEST_BACKEND=POSIX).
KV memory is page-aligned anonymous mmap standing in for vLLM's per-layer KV tensors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

import iud_helpers as H  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import catalog as C  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import checksum, journal  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import layout as L  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector import rankstore as R  # noqa: E402

PAGES = (16384, 8192)  # two "layers" per block
NUM_BLOCKS = 24


class Kv:
    """KV memory of one rank: one mmap per layer, rows of PAGES[i] bytes."""

    def __init__(self, num_blocks=NUM_BLOCKS, pages=PAGES):
        self.maps = [mmap.mmap(-1, num_blocks * p) for p in pages]
        self.arrays = [
            np.frombuffer(m, dtype=np.uint8).reshape(num_blocks, p)
            for m, p in zip(self.maps, pages)
        ]
        self.regions = [
            R.Region(ctypes.addressof(ctypes.c_char.from_buffer(m)), p, num_blocks, p)
            for m, p in zip(self.maps, pages)
        ]

    def fill(self, block: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for a in self.arrays:
            a[block] = rng.integers(0, 256, a.shape[1], dtype=np.uint8)

    def block(self, block: int) -> bytes:
        return b"".join(a[block].tobytes() for a in self.arrays)


def geometry(slots: int, bpc: int = 1, world: int = 1) -> L.Geometry:
    return L.Geometry(
        rank_block_bytes=sum(PAGES),
        blocks_per_chunk=bpc,
        world_size=world,
        capacity_bytes=slots * world * L.round_up(sum(PAGES) * bpc, 4096),
        max_file_bytes=4 * L.round_up(sum(PAGES) * bpc, 4096),
    )


def open_rank(root, geo, kv, backend, rank=0, **kw) -> R.RankStore:
    return R.RankStore(
        str(root),
        geo,
        rank,
        kv.regions,
        "DRAM",
        R.StoreOptions(backend=backend, backend_params=H.default_params(backend), **kw),
    )


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


_job = iter(range(1, 1 << 30))


def wait_jobs(store, ids, timeout=60):
    ids, got, deadline = set(ids), {}, time.monotonic() + timeout
    while not ids <= set(got):
        for r in store.poll():
            got[r.job_id] = r
        assert time.monotonic() < deadline, f"jobs {ids - set(got)} not over"
        time.sleep(0.0005)
    return got


def store_keys(cat, store, keys, blocks, commit=True):
    """One store job the way the connector runs it: catalog slots, RankStore job, completion."""
    out = cat.prepare_store(keys)
    assert out is not None
    acc, evicted = out
    by_key = dict(zip(keys, blocks))
    j = next(_job)
    store.submit_store(
        j,
        [by_key[k] for k, _, _ in acc],
        [s for _, s, _ in acc],
        [0] * len(acc),
        acc if commit else [],
    )
    res = wait_jobs(store, [j])[j]
    assert res.ok, res.error
    return cat.complete_store([k for k, _, _ in acc]), evicted


def load_keys(cat, store, keys, blocks, rank=0):
    items = cat.prepare_load(keys)
    j = next(_job)
    store.submit_load(
        j,
        blocks,
        [it.slot for it in items],
        [0] * len(items),
        [it.sums[rank][0] for it in items],
        [it.gen for it in items],
    )
    res = wait_jobs(store, [j])[j]
    cat.complete_load(keys)
    return res


@pytest.fixture
def kv():
    return Kv()


def test_stored_blocks_are_found_again_by_a_new_catalog_and_load_byte_for_byte(
    tmp_path, kv, backend
):
    geo = geometry(slots=10)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(6):
        kv.fill(b, seed=100 + b)
    want = {key(b): kv.block(b) for b in range(6)}
    done, evicted = store_keys(cat, store, [key(b) for b in range(6)], list(range(6)))
    assert sorted(done) == sorted(want) and evicted == []
    assert all(cat.lookup(k) for k in want) and not cat.lookup(key(99))
    store.close()
    cat.close()

    cat = C.Catalog(str(tmp_path), geo)  # a new engine: replay
    assert sorted(cat.committed()) == sorted(want)
    assert all(cat.lookup(k) for k in want)  # verified from the files
    store = open_rank(tmp_path, geo, kv, backend)
    targets = list(range(10, 16))
    for b in targets:
        kv.arrays[0][b] = 0xA5
        kv.arrays[1][b] = 0x5A
    res = load_keys(cat, store, list(want), targets)
    assert res.ok and res.bad_blocks == []
    for k, b in zip(want, targets):
        assert kv.block(b) == want[k]
    store.close()
    cat.close()


def test_a_store_without_a_commit_record_is_never_served(tmp_path, kv, backend):
    """The data reached the slot but no COMMIT was written (a crash between data and commit)."""
    geo = geometry(slots=4)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    kv.fill(0, seed=1)
    done, _ = store_keys(cat, store, [key(0)], [0], commit=False)
    assert done == [] and not cat.lookup(key(0))
    store.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert cat.committed() == [] and not cat.lookup(key(0))
    cat.close()


def test_a_torn_journal_tail_is_ignored_then_cut_before_the_next_append(tmp_path, kv, backend):
    geo = geometry(slots=8)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(3):
        kv.fill(b, seed=b)
    store_keys(cat, store, [key(b) for b in range(3)], [0, 1, 2])
    store.close()
    cat.close()
    log = L.commits_log(str(tmp_path), 0, 1)
    whole = os.path.getsize(log)
    rec = journal.commit(key(7), 5, 999, 10, [1])
    with open(log, "ab") as f:  # a process died in the middle of its append
        f.write(rec[: len(rec) // 2])
    cat = C.Catalog(str(tmp_path), geo)
    assert sorted(cat.committed()) == sorted(key(b) for b in range(3))
    store = open_rank(tmp_path, geo, kv, backend)
    kv.fill(3, seed=3)
    done, _ = store_keys(cat, store, [key(3)], [3])  # its append cuts the tail, under the lock
    assert done == [key(3)]
    assert os.path.getsize(log) == whole + len(rec)
    store.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert sorted(cat.committed()) == sorted(key(b) for b in range(4))
    cat.close()


def test_damaged_data_is_a_miss_on_lookup_and_a_reported_failure_on_load(tmp_path, kv, backend):
    geo = geometry(slots=8)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(3):
        kv.fill(b, seed=50 + b)
    store_keys(cat, store, [key(b) for b in range(3)], [0, 1, 2])
    slot0, gen0 = cat.slot_of(key(0))
    slot1, _ = cat.slot_of(key(1))
    store.close()
    cat.close()
    for slot in (slot0, slot1):  # zero the stored data of two blocks
        fi, off = geo.locate(slot)
        with open(L.slot_file(str(tmp_path), 0, 1, fi), "r+b") as f:
            f.seek(off)
            f.write(bytes(sum(PAGES)))

    cat = C.Catalog(str(tmp_path), geo)
    assert not cat.lookup(key(0))  # checked against its checksum: a miss, and dropped
    assert cat.lookup(key(2))
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert key(0) not in cat.committed()  # the drop is in manager.log

    # Without the check on lookup the worker's check after the load reports the block.
    cat.verify_on_lookup = False
    assert cat.lookup(key(1))
    store = open_rank(tmp_path, geo, kv, backend)
    res = load_keys(cat, store, [key(1), key(2)], [20, 21])
    assert res.ok and res.bad_blocks == [20]
    assert kv.block(21) == _fill_bytes(kv, 52)
    cat.complete_load([])  # reads the DAMAGED record
    assert not cat.lookup(key(1)) and cat.lookup(key(2))
    store.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert sorted(cat.committed()) == [key(2)]
    assert gen0  # (gens start at 1)
    cat.close()


def test_a_job_in_many_parts_moves_every_block_and_checks_each_part(tmp_path, kv, backend):
    """With one block per part, each slot is its own NIXL transfer: every block arrives, a
    damaged block in a later part is reported alone, and the job's phases are timed."""
    geo = geometry(slots=8)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend, part_bytes=1)
    for b in range(6):
        kv.fill(b, seed=70 + b)
    want = [kv.block(b) for b in range(6)]
    done, _ = store_keys(cat, store, [key(b) for b in range(6)], list(range(6)))
    assert len(done) == 6
    cat.verify_on_lookup = False
    slot4, _ = cat.slot_of(key(4))
    fi, off = geo.locate(slot4)
    with open(L.slot_file(str(tmp_path), 0, 1, fi), "r+b") as f:
        f.seek(off + 100)
        f.write(b"\xff" * 8)
    targets = list(range(10, 16))
    res = load_keys(cat, store, [key(b) for b in range(6)], targets)
    assert res.ok and res.bad_blocks == [14]
    assert [kv.block(b) for b in (10, 11, 12, 13, 15)] == [want[i] for i in (0, 1, 2, 3, 5)]
    assert set(res.phases) == {"post", "xfer", "check", "finish"}
    assert store.stats["load"]["phase_xfer_s"] > 0
    store.close()
    cat.close()


def test_a_failed_part_fails_the_job_and_the_store_goes_on(tmp_path, kv, backend):
    """One part of six reads a cut slot file: the job fails naming that slot once every part is
    over; the next job on the same store is served."""
    geo = geometry(slots=8)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend, part_bytes=1)
    for b in range(6):
        kv.fill(b, seed=80 + b)
    store_keys(cat, store, [key(b) for b in range(6)], list(range(6)))
    cat.verify_on_lookup = False
    last = max(range(6), key=lambda b: geo.locate(cat.slot_of(key(b))[0])[1])
    slot, _ = cat.slot_of(key(last))
    fi, off = geo.locate(slot)
    os.truncate(L.slot_file(str(tmp_path), 0, 1, fi), off + 1000)
    res = load_keys(cat, store, [key(b) for b in range(6)], list(range(10, 16)))
    assert not res.ok and "short file" in res.error and f"slot {slot}" in res.error
    assert store.in_flight() == 0
    others = [b for b in range(6) if geo.locate(cat.slot_of(key(b))[0])[0] != fi]
    res = load_keys(cat, store, [key(b) for b in others], [16 + i for i in range(len(others))])
    assert res.ok and res.bad_blocks == []
    store.close()
    cat.close()


def _fill_bytes(kv, seed):
    rng = np.random.default_rng(seed)
    return b"".join(rng.integers(0, 256, p, dtype=np.uint8).tobytes() for p in PAGES)


def test_capacity_evicts_least_recently_used_unpinned_blocks_and_reuses_their_slots(
    tmp_path, kv, backend
):
    geo = geometry(slots=4)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(8):
        kv.fill(b, seed=200 + b)
    store_keys(cat, store, [key(b) for b in range(4)], [0, 1, 2, 3])
    cat.touch([key(0)])  # 1 is now the oldest
    items = cat.prepare_load([key(1)])  # pinned by a load in flight: not evictable
    assert items[0].key == key(1)
    done, evicted = store_keys(cat, store, [key(4), key(5)], [4, 5])
    assert done == [key(4), key(5)] and evicted == [key(2), key(3)]
    cat.complete_load([key(1)])
    done, evicted = store_keys(cat, store, [key(6)], [6])
    assert evicted == [key(0)]
    live = {key(1), key(4), key(5), key(6)}
    assert set(cat.committed()) == live
    store.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert set(cat.committed()) == live
    store = open_rank(tmp_path, geo, kv, backend)
    res = load_keys(cat, store, [key(6), key(4)], [10, 11])
    assert res.ok and res.bad_blocks == []
    assert kv.block(10) == kv.block(6) and kv.block(11) == kv.block(4)
    store.close()
    cat.close()


def test_a_full_store_evicts_stores_every_rank_committed_before_vllm_completes_them(
    tmp_path, kv, backend
):
    geo = geometry(slots=3)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(6):
        kv.fill(b, seed=300 + b)
    acc, _ = cat.prepare_store([key(0), key(1), key(2)])
    j = next(_job)
    store.submit_store(j, [0, 1, 2], [s for _, s, _ in acc], [0, 0, 0], acc[:2])  # 2 committed
    assert wait_jobs(store, [j])[j].ok
    # vLLM has not called complete_store yet; the committed blocks can still make room, the
    # block in flight cannot: all or nothing, so three new blocks wait (vLLM retries them)
    assert cat.prepare_store([key(3), key(4), key(5)]) is None
    acc2, evicted = cat.prepare_store([key(3), key(4)])
    assert evicted == [key(0), key(1)] and [k for k, _, _ in acc2] == [key(3), key(4)]
    assert cat.complete_store([key(0), key(1), key(2)]) == []  # 2 was never committed
    j = next(_job)
    store.submit_store(j, [3, 4], [s for _, s, _ in acc2], [0, 0], acc2)
    assert wait_jobs(store, [j])[j].ok
    assert cat.complete_store([key(3), key(4)]) == [key(3), key(4)]
    res = load_keys(cat, store, [key(4), key(3)], [10, 11])
    assert res.ok and res.bad_blocks == []
    assert kv.block(10) == kv.block(4) and kv.block(11) == kv.block(3)
    store.close()
    cat.close()


def test_a_full_store_keeps_the_blocks_named_in_the_same_store_call(tmp_path, kv, backend):
    geo = geometry(slots=2)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(3):
        kv.fill(b, seed=400 + b)
    store_keys(cat, store, [key(0), key(1)], [0, 1])  # 0 is the oldest
    done, evicted = store_keys(cat, store, [key(0), key(2)], [0, 2])  # a request's blocks 0, 2
    assert done == [key(2)] and evicted == [key(1)]
    assert set(cat.committed()) == {key(0), key(2)}
    store.close()
    cat.close()


def test_a_full_store_with_every_block_pinned_refuses_new_stores(tmp_path, kv, backend):
    geo = geometry(slots=2)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    store_keys(cat, store, [key(0), key(1)], [0, 1])
    cat.prepare_load([key(0), key(1)])
    assert cat.prepare_store([key(2)]) is None
    assert cat.prepare_store([key(0)]) == ([], [])  # already there: nothing to do
    store.close()
    cat.close()


def test_chunks_of_several_blocks_load_from_the_middle_of_a_slot(tmp_path, kv, backend):
    """blocks_per_chunk = 3: a slot holds 3 blocks; a load may start inside a chunk."""
    geo = geometry(slots=4, bpc=3)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in range(6):
        kv.fill(b, seed=300 + b)
    acc, _ = cat.prepare_store([key(0), key(1)])
    slots = [s for _, s, _ in acc]
    j = next(_job)
    store.submit_store(j, list(range(6)), [slots[0]] * 3 + [slots[1]] * 3, [0, 1, 2] * 2, acc)
    assert wait_jobs(store, [j])[j].ok
    assert cat.complete_store([key(0), key(1)]) == [key(0), key(1)]
    items = cat.prepare_load([key(0), key(1)])
    j = next(_job)  # the first chunk's first block is already on the "GPU": skip 1
    store.submit_load(
        j,
        [12, 13, 14, 15, 16],
        [slots[0]] * 2 + [slots[1]] * 3,
        [1, 2, 0, 1, 2],
        [items[0].sums[0][1], items[0].sums[0][2]] + list(items[1].sums[0]),
        [items[0].gen] * 2 + [items[1].gen] * 3,
    )
    res = wait_jobs(store, [j])[j]
    assert res.ok and res.bad_blocks == []
    assert [kv.block(b) for b in range(12, 17)] == [kv.block(b) for b in range(1, 6)]
    store.close()
    cat.close()


def test_a_chunk_lands_page_major_in_its_slot(tmp_path, kv, backend):
    """The slot file itself, after a store of one chunk of 3 blocks: page p of sub-block j is at
    page_runs[p] + j * page, so a page's consecutive blocks lie end to end (one I/O per page)."""
    geo = geometry(slots=2, bpc=3)
    assert L.page_runs(PAGES, 3) == [0, 3 * PAGES[0]]
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend)
    for b in (4, 5, 6):
        kv.fill(b, seed=600 + b)
    acc, _ = cat.prepare_store([key(0)])
    j = next(_job)
    store.submit_store(j, [4, 5, 6], [acc[0][1]] * 3, [0, 1, 2], acc)
    assert wait_jobs(store, [j])[j].ok
    store.close()
    fi, off = geo.locate(acc[0][1])
    with open(L.slot_file(str(tmp_path), 0, 1, fi), "rb") as f:
        f.seek(off)
        data = f.read(3 * sum(PAGES))
    want = b"".join(a[b].tobytes() for a in kv.arrays for b in (4, 5, 6))
    assert data == want
    cat.close()


@pytest.mark.parametrize("bpc", [1, 3])
def test_a_job_lists_each_slot_as_one_range_of_its_file(tmp_path, kv, backend, bpc):
    """The descriptors of a job, in request order, walk each slot's bytes from its start to its
    end without a gap (so a backend can read or write a slot in few large I/Os), and consecutive
    GPU blocks of one page are neighbours in the request (so they merge)."""
    geo = geometry(slots=6, bpc=bpc)
    store = open_rank(tmp_path, geo, kv, backend)
    n = 2 * bpc
    blocks = list(range(3, 3 + n))
    slots = [4] * bpc + [1] * bpc  # two chunks, out of slot order
    subs = list(range(bpc)) * 2
    local, remote = store._indices(*store._check_pairs(blocks, slots, subs))
    npg, runs = len(PAGES), L.page_runs(PAGES, bpc)
    chunk, page = np.divmod(remote, npg)
    slot, sub = np.divmod(chunk, bpc)
    fi, base = geo.locate(slot)
    pages = np.asarray(PAGES)[page]
    rows = np.stack([base + np.asarray(runs)[page] + sub * pages, pages, fi], axis=1)
    blk, lpage = np.divmod(local, npg)
    addr = (
        np.asarray([r.addr for r in kv.regions])[lpage]
        + blk * np.asarray([r.stride for r in kv.regions])[lpage]
    )
    mem = np.stack([addr, np.asarray(PAGES)[lpage]], axis=1)
    per_slot = bpc * len(PAGES)
    for c in range(2):
        r = rows[c * per_slot : (c + 1) * per_slot]
        assert len(set(r[:, 2])) == 1, "one file per slot"
        assert (r[1:, 0] == r[:-1, 0] + r[:-1, 1]).all(), (
            f"slot {slots[c * bpc]}: a gap or a step back"
        )
        if bpc > 1:
            m = mem[c * per_slot : c * per_slot + bpc]
            assert (m[1:, 0] == m[:-1, 0] + m[:-1, 1]).all(), (
                "page 0 of consecutive blocks: neighbours"
            )
    assert sorted(zip(local.tolist(), remote.tolist())) == sorted(
        zip(
            (np.asarray(blocks)[:, None] * len(PAGES) + np.arange(len(PAGES))).reshape(-1).tolist(),
            (
                (np.asarray(slots) * bpc + np.asarray(subs))[:, None] * len(PAGES)
                + np.arange(len(PAGES))
            )
            .reshape(-1)
            .tolist(),
        )
    )
    store.close()


def test_o_direct_slot_files(tmp_path, kv, backend, need_direct):
    geo = geometry(slots=6)
    cat = C.Catalog(str(tmp_path), geo)
    store = open_rank(tmp_path, geo, kv, backend, o_direct=True, durable=True)
    for b in range(4):
        kv.fill(b, seed=400 + b)
    store_keys(cat, store, [key(b) for b in range(4)], [0, 1, 2, 3])
    res = load_keys(cat, store, [key(b) for b in range(4)], [8, 9, 10, 11])
    assert res.ok and res.bad_blocks == []
    assert [kv.block(b) for b in range(8, 12)] == [kv.block(b) for b in range(4)]
    store.close()
    cat.close()


def test_o_direct_refuses_unaligned_kv_memory_at_start_up(tmp_path, backend, need_direct):
    kv = Kv()
    kv.regions = [R.Region(r.addr + 64, r.stride, r.num_blocks - 1, r.page) for r in kv.regions]
    with pytest.raises(ValueError, match="o_direct cannot serve this KV cache layout"):
        open_rank(tmp_path, geometry(slots=2), kv, backend, o_direct=True)


def test_a_store_made_for_another_layout_is_refused(tmp_path, kv, backend):
    cat = C.Catalog(str(tmp_path), geometry(slots=4), {"model": "a"})
    C.Catalog(str(tmp_path), geometry(slots=4), {"model": "a"}).close()  # shared: a second is fine
    cat.close()
    with pytest.raises(L.StoreMismatch, match="model is 'a' there, 'b' here"):
        C.Catalog(str(tmp_path), geometry(slots=4), {"model": "b"})
    with pytest.raises(L.StoreMismatch, match="num_slots"):
        C.Catalog(str(tmp_path), geometry(slots=5), {"model": "a"})


def test_tensor_parallel_blocks_need_every_ranks_commit(tmp_path, backend):
    geo = geometry(slots=4, world=2)
    kvs = [Kv(), Kv()]
    cat = C.Catalog(str(tmp_path), geo)
    stores = [open_rank(tmp_path, geo, kvs[r], backend, rank=r) for r in range(2)]
    for r in range(2):
        kvs[r].fill(0, seed=10 + r)
        kvs[r].fill(1, seed=20 + r)
    acc, _ = cat.prepare_store([key(0), key(1)])
    for r in range(2):  # rank 1 "dies" before committing key(1)
        j = next(_job)
        stores[r].submit_store(
            j, [0, 1], [acc[0][1], acc[1][1]], [0, 0], acc if r == 0 else acc[:1]
        )
        assert wait_jobs(stores[r], [j])[j].ok
    assert cat.complete_store([key(0), key(1)]) == [key(0)]
    assert os.path.isfile(L.slot_file(str(tmp_path), 1, 2, 0))
    for s in stores:
        s.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert cat.committed() == [key(0)] and cat.lookup(key(0))
    cat.close()


CHILD = r"""
import os, sys, time
sys.path[:0] = sys.argv[1].split(os.pathsep)
import test_vllm_connector_store as T
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
root, backend = sys.argv[2], sys.argv[3]
geo = T.geometry(slots=8)
kv = T.Kv()
cat = C.Catalog(root, geo)
store = T.open_rank(root, geo, kv, backend)
i = 0
while True:  # store forever, every block's content derived from its key number
    b = i % T.NUM_BLOCKS
    kv.fill(b, seed=i)
    T.store_keys(cat, store, [T.key(i)], [b])
    i += 1
    if i == 3:
        print("storing", flush=True)
"""


def test_sigkill_during_stores_leaves_only_whole_blocks_visible(tmp_path, backend):
    env = dict(os.environ)
    path = os.pathsep.join(
        [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "python")]
    )
    for delay in (0.05, 0.3):
        root = tmp_path / f"kill-{delay}"
        p = subprocess.Popen(
            [sys.executable, "-c", CHILD, path, str(root), backend],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []
        for line in p.stdout:  # NIXL logs to stdout too
            lines.append(line)
            if line.strip() == "storing":
                break
        assert lines and lines[-1].strip() == "storing", "".join(lines)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        geo = geometry(slots=8)
        cat = C.Catalog(str(root), geo)
        kv = Kv()
        store = open_rank(root, geo, kv, backend)
        found = cat.committed()
        assert found, "the child committed nothing"
        for n, k in enumerate(found):
            i = int.from_bytes(k[:32], "big")
            assert cat.lookup(k)
            res = load_keys(cat, store, [k], [n % NUM_BLOCKS])
            assert res.ok and res.bad_blocks == []
            kv.fill(NUM_BLOCKS - 1, seed=i)
            assert kv.block(n % NUM_BLOCKS) == kv.block(NUM_BLOCKS - 1)
        store.close()
        cat.close()


@pytest.mark.parametrize("place", ["folder", "slot_dirs", "devices"])
def test_a_manifest_gives_back_the_geometry_that_wrote_it(place):
    """Geometry.from_manifest, what tools without an engine use to find a slot: every slot of
    every rank in the same file (or device) at the same offset as the geometry that wrote
    store.json, for slot files in the store's folder, striped over folders, and raw devices of
    unequal sizes."""
    geo = geometry(37, bpc=2, world=2)
    slot = geo.slot_bytes
    where = {
        "folder": {},
        "slot_dirs": {"slot_dirs": ("/a", "/b", "/c")},
        "devices": {
            "devices": ("/dev/x", "/dev/y"),
            "device_bytes": (L.DEVICE_HEADER + 2 * 11 * slot + 1000, L.DEVICE_HEADER + 99 * slot),
        },
    }[place]
    geo = dataclasses.replace(geo, **where)
    again = L.Geometry.from_manifest(json.loads(json.dumps(geo.manifest())))
    assert again.manifest() == geo.manifest()
    for rank in (0, 1):
        for s in range(geo.num_slots):
            fi, off = geo.locate(s, rank)
            assert again.locate(s, rank) == (fi, off)
            assert again.slot_path("/kv", rank, fi) == geo.slot_path("/kv", rank, fi)


def test_checksums_see_zeroing_flips_and_swaps():
    rng = np.random.default_rng(5)
    page = rng.integers(0, 256, 8192, dtype=np.uint8)
    base = checksum.fold([checksum.page_sums(page)])
    flipped = page.copy()
    flipped[1000] ^= 1
    swapped = page.copy()
    swapped[[0, 1, 2, 3]] = swapped[[2, 3, 0, 1]]
    for other in (np.zeros_like(page), flipped, swapped):
        if not np.array_equal(other, page):
            assert checksum.fold([checksum.page_sums(other)]) != base
    halves = [checksum.page_sums(page[:4096]), checksum.page_sums(page[4096:])]
    assert checksum.fold(halves) != checksum.fold(halves[::-1])


def test_the_plugin_gets_engine_thread_light_parameters_unless_the_config_sets_them():
    from nixl_io_uring_dmabuf.vllm_connector.config import StoreConfig

    base = {"path": "/kv", "capacity_gb": 1}
    assert StoreConfig.from_extra(base).backend_params == {
        "inline_write_max": "0",
        "page_cache_caller_reads": "false",
    }
    mine = StoreConfig.from_extra({**base, "backend_params": {"inline_write_max": "65536"}})
    assert mine.backend_params == {"inline_write_max": "65536", "page_cache_caller_reads": "false"}
    # Another backend (NIXL's own) gets exactly what the config gives, JSON booleans as
    # "true"/"false".
    assert StoreConfig.from_extra({**base, "backend": "GDS_MT"}).backend_params == {}
    posix = StoreConfig.from_extra(
        {**base, "backend": "POSIX", "backend_params": {"use_uring": True, "ios_pool_size": 64}}
    )
    assert posix.backend_params == {"use_uring": "true", "ios_pool_size": "64"}


def test_vllm_keys_are_taken_and_unknown_keys_refused_with_their_names():
    from nixl_io_uring_dmabuf.vllm_connector.config import StoreConfig

    base = {"path": "/kv", "capacity_gb": 1}
    # vLLM 0.34's scheduler reads sync_load_budget_bytes from the same dict
    StoreConfig.from_extra({**base, "sync_load_budget_bytes": 1 << 30, "block_size": 64})
    with pytest.raises(
        ValueError, match=r"unknown kv_connector_extra_config keys \['sync_load_budget'\]"
    ):
        StoreConfig.from_extra({**base, "sync_load_budget": 1 << 30})


def test_fold_columns_is_fold_for_every_block():
    rng = np.random.default_rng(3)
    s1 = rng.integers(-(1 << 40), 1 << 40, size=(5, 7), dtype=np.int64)
    s2 = rng.integers(-(1 << 46), 1 << 46, size=(5, 7), dtype=np.int64)
    want = [checksum.fold(zip(s1[:, b].tolist(), s2[:, b].tolist())) for b in range(7)]
    assert checksum.fold_columns(s1, s2) == want


@pytest.mark.parametrize(
    "slots,max_slots_per_file,stripe,files",
    [(20, 4, 8, 8), (20, 1, 8, 20), (3, 100, 8, 3), (20, 100, 1, 1), (20, 3, 2, 7)],
)
def test_slots_are_striped_over_the_files_and_each_has_one_place(
    slots, max_slots_per_file, stripe, files
):
    block = L.round_up(sum(PAGES), 4096)
    geo = L.Geometry(
        rank_block_bytes=sum(PAGES),
        blocks_per_chunk=1,
        world_size=1,
        capacity_bytes=slots * block,
        max_file_bytes=max_slots_per_file * block,
        slot_files=stripe,
    )
    assert geo.num_files == files
    places = [geo.locate(s) for s in range(slots)]
    assert len(set(places)) == slots
    assert [fi for fi, _ in places[:files]] == list(range(files))  # neighbours differ in file
    for fi, off in places:
        assert off % geo.slot_bytes == 0 and off + geo.slot_bytes <= geo.file_slots(fi) * block
        assert geo.file_slots(fi) <= max_slots_per_file
    assert sum(geo.file_slots(i) for i in range(files)) == slots


def test_a_store_of_block_major_slots_is_refused(tmp_path):
    geo = geometry(slots=4, bpc=2)
    with open(tmp_path / "store.json", "w") as f:
        json.dump({**geo.manifest(), "format": "iud-vllm-kv-store/2"}, f)
    with pytest.raises(L.StoreMismatch, match="format is 'iud-vllm-kv-store/2' there"):
        C.Catalog(str(tmp_path), geo)


def test_a_store_of_the_contiguous_slot_layout_is_refused(tmp_path):
    geo = geometry(slots=4)
    old = {**geo.manifest(), "format": "iud-vllm-kv-store/1", "slots_per_file": 4}
    del old["num_files"]
    with open(tmp_path / "store.json", "w") as f:
        json.dump(old, f)
    with pytest.raises(L.StoreMismatch, match="made for another model or layout"):
        C.Catalog(str(tmp_path), geo)
