"""Several engines on one store, without vLLM: catalogs and RankStores in one process and in
several processes at once, through the real NIXL runtime and the backend under test, as
test_vllm_connector_store.py. What must hold:

- every engine serves what any engine committed (byte for byte);
- a block another engine evicts while this one loads it is found by the load's check, never
  served torn; the next lookup misses;
- engines killed at any point lose nothing of the others, leave nothing served torn, and leave
  no slot lost: slots they held mid-store are reclaimed;
- the store format is versioned: a format-3 store is migrated, an engine of an older release
  keeps this one out (and the other way round).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import test_vllm_connector_store as T
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
from nixl_io_uring_dmabuf.vllm_connector import journal, locks
from nixl_io_uring_dmabuf.vllm_connector import layout as L

STORE_ROW, LOAD_ROW, WANT_ROW = 0, 1, 2


def content(kv, i: int) -> bytes:
    """The bytes of key i's block: every engine stores the same bytes for the same key."""
    kv.fill(WANT_ROW, seed=1000 + i)
    return kv.block(WANT_ROW)


def store_one(cat, store, kv, i: int) -> bool:
    kv.fill(STORE_ROW, seed=1000 + i)
    out = cat.prepare_store([T.key(i)])
    if not out or not out[0]:
        return False
    acc, _evicted = out
    j = next(T._job)
    store.submit_store(j, [STORE_ROW], [acc[0][1]], [0], acc)
    assert T.wait_jobs(store, [j])[j].ok
    return cat.complete_store([T.key(i)]) == [T.key(i)]


def load_one(cat, store, kv, i: int) -> str:
    """'miss', 'ok' (the right bytes), 'caught' (the check found other bytes) or 'torn' (the
    check passed with wrong bytes: must never happen)."""
    if not cat.lookup(T.key(i)):
        return "miss"
    res = T.load_keys(cat, store, [T.key(i)], [LOAD_ROW])
    if not res.ok or res.bad_blocks:
        return "caught"
    return "ok" if kv.block(LOAD_ROW) == content(kv, i) else "torn"


def two_engines(root, geo, backend) -> list[tuple]:
    """Two engines in this process on one store: (catalog, rank store, KV memory) each."""
    out = []
    for _ in range(2):
        kv = T.Kv()
        out.append((C.Catalog(str(root), geo), T.open_rank(root, geo, kv, backend), kv))
    return out


def test_engines_serve_each_others_blocks(tmp_path, backend):
    geo = T.geometry(slots=8)
    (a, sa, kva), (b, sb, kvb) = two_engines(tmp_path, geo, backend)
    for i in range(3):
        kva.fill(i, seed=1000 + i)
    assert T.store_keys(a, sa, [T.key(i) for i in range(3)], [0, 1, 2])[0]
    b.refresh()
    assert sorted(b.committed()) == sorted(T.key(i) for i in range(3))
    for i in range(3):
        assert load_one(b, sb, kvb, i) == "ok"
    # B does not store what A stores or has stored; its own new key goes to a free slot.
    assert b.prepare_store([T.key(0)]) == ([], [])
    assert store_one(b, sb, kvb, 5)
    a.refresh()
    assert load_one(a, sa, kva, 5) == "ok"
    slots = {a.slot_of(T.key(i))[0] for i in (0, 1, 2, 5)}
    assert len(slots) == 4, "two engines were given one slot"
    for x in (sa, sb, a, b):
        x.close()


def test_a_block_evicted_by_another_engine_under_a_load_is_caught_then_a_miss(tmp_path, backend):
    geo = T.geometry(slots=4)
    (a, sa, kva), (b, sb, kvb) = two_engines(tmp_path, geo, backend)
    for i in range(4):
        assert store_one(a, sa, kva, i)
    b.refresh()
    assert a.lookup(T.key(0))
    items = a.prepare_load([T.key(0)])  # A is about to load key 0 ...
    for i in range(10, 14):  # ... while B fills the store with four new blocks
        assert store_one(b, sb, kvb, i)
    assert a.slot_of(T.key(0)) is not None, "A has not looked at the journals since"
    j = next(T._job)
    sa.submit_load(j, [LOAD_ROW], [items[0].slot], [0], [items[0].sums[0][0]], [items[0].gen])
    res = T.wait_jobs(sa, [j])[j]
    a.complete_load([T.key(0)])
    assert res.ok and res.bad_blocks == [LOAD_ROW], "the load of a reused slot passed its check"
    assert not a.lookup(T.key(0))
    assert all(load_one(a, sa, kva, i) == "ok" for i in range(10, 14))
    for x in (sa, sb, a, b):
        x.close()


WORKER = r"""
import json, os, random, sys, time
sys.path[:0] = sys.argv[1].split(os.pathsep)
import test_vllm_connector_store as T
import test_vllm_store_sharing as S
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
root, backend, seed, seconds = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
geo = T.geometry(slots=8)
cat = C.Catalog(root, geo)
kv = T.Kv()
store = T.open_rank(root, geo, kv, backend)
rng = random.Random(seed)
seen = {"miss": 0, "ok": 0, "caught": 0, "torn": 0, "stored": 0}
print("running", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    i = rng.randrange(24)  # 24 keys shared by every engine, 8 slots: evictions all the time
    got = S.load_one(cat, store, kv, i)
    seen[got] += 1
    if got != "ok" and S.store_one(cat, store, kv, i):
        seen["stored"] += 1
store.close()
cat.close()
print("RESULT " + json.dumps(seen), flush=True)
"""


def start(root, backend, seed, seconds, on=()):
    """An engine process on `root`; `on`: a command prefix it runs under (another node's)."""
    here = os.path.dirname(__file__)
    path = os.pathsep.join([here, os.path.join(here, "..", "..", "python")])
    p = subprocess.Popen(
        [*on, sys.executable, "-c", WORKER, path, str(root), backend, str(seed), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in p.stdout:
        if line.strip() == "running":
            return p
    raise AssertionError(f"engine {seed} did not start: {p.wait()}")


def result(p) -> dict:
    out = p.stdout.read()
    assert p.wait() == 0, out
    return json.loads(out.split("RESULT ", 1)[1])


def check_store(root, backend) -> None:
    """A new engine: every block served loads byte for byte, and every slot can be allocated
    (none lost to a killed engine)."""
    geo = T.geometry(slots=8)
    cat, kv = C.Catalog(str(root), geo), T.Kv()
    store = T.open_rank(root, geo, kv, backend)
    found = cat.committed()
    for k in found:
        assert load_one(cat, store, kv, int.from_bytes(k[:32], "big")) == "ok"
    out = cat.prepare_store([T.key(100 + i) for i in range(8)])
    assert out is not None and len(out[0]) == 8, "slots were lost"
    store.close()
    cat.close()


def test_three_engines_store_evict_and_load_at_once(tmp_path, backend):
    procs = [start(tmp_path, backend, seed, 6.0) for seed in (1, 2, 3)]
    seen = [result(p) for p in procs]
    print(seen)
    assert all(s["torn"] == 0 for s in seen), seen
    assert sum(s["ok"] for s in seen) > 10 and all(s["stored"] for s in seen), seen
    check_store(tmp_path, backend)


def test_engines_killed_at_any_point_lose_nothing_of_the_others(tmp_path, backend):
    rng = random.Random(5)
    survivor = start(tmp_path, backend, 100, 12.0)
    for n in range(6):
        victim = start(tmp_path, backend, n, 30.0)
        time.sleep(rng.uniform(0.05, 1.0))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    seen = result(survivor)
    assert seen["torn"] == 0 and seen["ok"] > 0, seen
    check_store(tmp_path, backend)


def test_a_torn_alloc_is_cut_by_the_next_engine_that_appends(tmp_path, backend):
    geo = T.geometry(slots=4)
    cat = C.Catalog(str(tmp_path), geo)
    kv = T.Kv()
    store = T.open_rank(tmp_path, geo, kv, backend)
    assert store_one(cat, store, kv, 0)
    log = L.manager_log(str(tmp_path))
    whole = os.path.getsize(log)
    rec = journal.alloc(T.key(9), 3, 999, 12345)
    with open(log, "ab") as f:  # an engine died inside its append (holding the lock)
        f.write(rec[:20])
    other = C.Catalog(str(tmp_path), geo)
    assert other.committed() == [T.key(0)]
    assert store_one(other, store, kv, 1)
    recs, used, _ = journal.parse(open(log, "rb").read())
    assert used == os.path.getsize(log) and os.path.getsize(log) > whole
    assert 999 not in [r.gen for r in recs]
    cat.refresh()
    assert load_one(cat, store, kv, 1) == "ok"
    for x in (store, cat, other):
        x.close()


def test_a_format_3_store_is_migrated_and_keeps_its_blocks(tmp_path, backend):
    geo = T.geometry(slots=4)
    cat, kv = C.Catalog(str(tmp_path), geo), T.Kv()
    store = T.open_rank(tmp_path, geo, kv, backend)
    for i in range(3):
        assert store_one(cat, store, kv, i)
    store.close()
    cat.close()
    # What format 3 left: no ALLOC records, store.json says /3.
    log = L.manager_log(str(tmp_path))
    recs, _, _ = journal.parse(open(log, "rb").read())
    assert all(r.type == journal.ALLOC for r in recs)
    open(log, "wb").close()
    meta = os.path.join(tmp_path, "store.json")
    m = json.load(open(meta))
    json.dump({**m, "format": "iud-vllm-kv-store/3"}, open(meta, "w"))
    cat = C.Catalog(str(tmp_path), geo)
    assert json.load(open(meta))["format"] == L.FORMAT
    assert sorted(cat.committed()) == [T.key(i) for i in range(3)]
    store = T.open_rank(tmp_path, geo, kv, backend)
    assert all(load_one(cat, store, kv, i) == "ok" for i in range(3))
    assert store_one(cat, store, kv, 3)  # the free slot; then an eviction
    assert store_one(cat, store, kv, 4) and len(cat.committed()) == 4
    store.close()
    cat.close()


def test_an_engine_of_an_older_release_and_this_one_keep_each_other_out(tmp_path):
    geo = T.geometry(slots=4)
    C.Catalog(str(tmp_path), geo).close()
    meta = os.path.join(tmp_path, "store.json")
    m = json.load(open(meta))
    json.dump({**m, "format": "iud-vllm-kv-store/3"}, open(meta, "w"))
    old = os.open(os.path.join(tmp_path, ".lock"), os.O_RDWR)
    fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the older release holds
    with pytest.raises(locks.StoreBusy, match="older connector release"):
        C.Catalog(str(tmp_path), geo)
    os.close(old)
    cat = C.Catalog(str(tmp_path), geo)  # migrated now
    old = os.open(os.path.join(tmp_path, ".lock"), os.O_RDWR)
    with pytest.raises(BlockingIOError):  # the older release's start-up is refused
        fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(old)
    cat.close()
    json.dump({**m, "format": "iud-vllm-kv-store/2"}, open(meta, "w"))
    with pytest.raises(L.StoreMismatch, match="format is 'iud-vllm-kv-store/2' there"):
        C.Catalog(str(tmp_path), geo)


def test_stores_an_engine_never_completed_are_kept_if_committed_else_reclaimed(tmp_path, backend):
    """vLLM often stops before it completes its last stores: a block every rank committed stays
    served; a slot allocated and never committed is reused by the next engine that needs room."""
    geo = T.geometry(slots=2)
    cat, kv = C.Catalog(str(tmp_path), geo), T.Kv()
    store = T.open_rank(tmp_path, geo, kv, backend)
    kv.fill(STORE_ROW, seed=1000)
    (acc0, acc1), _ = cat.prepare_store([T.key(0), T.key(1)])
    j = next(T._job)
    store.submit_store(j, [STORE_ROW], [acc0[1]], [0], [acc0])  # key 1 is never written
    assert T.wait_jobs(store, [j])[j].ok
    store.close()
    cat.close()  # no complete_store
    cat, kv = C.Catalog(str(tmp_path), geo), T.Kv()
    store = T.open_rank(tmp_path, geo, kv, backend)
    assert cat.committed() == [T.key(0)] and load_one(cat, store, kv, 0) == "ok"
    assert store_one(cat, store, kv, 2) and cat.stats["reclaimed"] == 1
    assert sorted(cat.committed()) == [T.key(0), T.key(2)]
    store.close()
    cat.close()
