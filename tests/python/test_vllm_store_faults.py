"""The vLLM connector's store when the file system fails it: a full file system at the exact write
(a small tmpfs filled up with a filler file), one damaged byte in a journal, a read-only path, a
short slot file and EIO from a FUSE file system. Through the real NIXL runtime and the backend
under test, as test_vllm_connector_store.py. Each case checks what must hold:

- a journal never keeps a partial record: a failed append leaves the file as it was, is a failed
  store, and appends work again once space returns; a restart keeps every complete record;
- an eviction is journaled before it takes effect; when its TOMB cannot be written the store
  call gives up (None: vLLM offers the blocks again), with one log line, never an exception;
- one damaged record costs only that record;
- start-up on a full or read-only file system is one error line naming path and cause;
- a failed job's error names the cause (ENOSPC, EIO, short file), not just NIXL's status.

Mounting needs root; without it these tests skip.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil

import numpy as np
import pytest
import test_vllm_connector_store as T
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
from nixl_io_uring_dmabuf.vllm_connector import journal
from nixl_io_uring_dmabuf.vllm_connector import layout as L
from support.mounts import FuseMount, TmpfsMounts

REC = len(journal.commit(T.key(0), 0, 1, 10, [1]))  # one COMMIT of a one-block slot: 76 B


@pytest.fixture
def kv():
    return T.Kv()


@pytest.fixture
def small_fs(tmp_path):
    """mount(size, name, ro=False) -> a fresh tmpfs folder of `size` ("4m"), unmounted after."""
    mounts = TmpfsMounts()
    yield lambda size, name="fs", ro=False: mounts.mount(tmp_path / name, size, ro)
    gc.collect()
    mounts.unmount_all()


def fill(folder) -> str:
    """Fills the file system of `folder` to the last byte with a filler file; returns its path."""
    path = os.path.join(folder, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (1 << 20, 1 << 16, 4096, 1):
            data = b"\xff" * chunk
            while True:
                try:
                    if os.write(fd, data) < chunk:
                        break
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    assert os.statvfs(folder).f_bavail == 0
    return path


def journal_size(root) -> int:
    return os.path.getsize(L.commits_log(str(root), 0, 1))


class Blocks:
    """Stores keys in jobs and remembers each key's bytes, to check loads byte for byte."""

    def __init__(self, kv):
        self.kv, self.want, self.seed = kv, {}, 0

    def store(self, cat, store, keys):
        """One store job of `keys` into KV rows 0..; (result, keys completed)."""
        acc, _evicted = cat.prepare_store(keys)
        rows = {}
        for i, k in enumerate(keys):
            self.seed += 1
            self.kv.fill(i, seed=self.seed)
            rows[k] = i
        j = next(T._job)
        store.submit_store(
            j, [rows[k] for k, _, _ in acc], [s for _, s, _ in acc], [0] * len(acc), acc
        )
        res = T.wait_jobs(store, [j])[j]
        done = cat.complete_store([k for k, _, _ in acc])
        if res.ok:
            for k in done:
                self.want[k] = self.kv.block(rows[k])
        return res, done

    def check_loads(self, cat, store, keys):
        """Loads `keys` (8 at a time into rows 16..23) and compares them with what was stored."""
        keys = list(keys)
        for i in range(0, len(keys), 8):
            part = keys[i : i + 8]
            rows = list(range(16, 16 + len(part)))
            res = T.load_keys(cat, store, part, rows)
            assert res.ok and res.bad_blocks == [], res
            for k, r in zip(part, rows):
                assert self.kv.block(r) == self.want[k], f"key {k[:32].hex()[-4:]} differs"


def keys(a, b):
    return [T.key(i) for i in range(a, b)]


# ---- 1. ENOSPC in the commit journal's append -------------------------------------------------


@pytest.mark.privileged
def test_enospc_in_the_commit_append_leaves_the_journal_whole_and_stores_resume(
    small_fs, kv, backend
):
    """Six 8-block stores fill 3648 B of the journal's first page; the file system is then
    filled, so the seventh store's 608-B append needs a page that is not there. Before: 448 B of
    it stayed in the journal, later stores were never visible, and a restart cut 48 good
    records. Now: the journal is as it was, the store fails naming ENOSPC, the next store after
    space is freed is visible, and a restart keeps all 56 blocks, which load byte for byte."""
    root = small_fs("4m")
    geo = T.geometry(slots=64)
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    blocks = Blocks(kv)
    for j in range(6):
        res, done = blocks.store(cat, store, keys(8 * j, 8 * j + 8))
        assert res.ok and len(done) == 8
    size = journal_size(root)
    assert size == 48 * REC and size + 8 * REC > 4096  # the next append crosses the page
    filler = fill(root)
    res, done = blocks.store(cat, store, keys(48, 56))
    assert not res.ok and done == []
    assert "ENOSPC" in res.error and "commits.log" in res.error, res.error
    assert journal_size(root) == size, "the failed append left bytes in the journal"
    assert store.stats["causes"] == {"ENOSPC": 1}
    assert not any(cat.lookup(k) for k in keys(48, 56))
    os.unlink(filler)
    res, done = blocks.store(cat, store, keys(56, 64))
    assert res.ok and sorted(done) == sorted(keys(56, 64)), "a store after space came back"
    assert all(cat.lookup(k) for k in keys(56, 64))
    store.close()
    cat.close()

    cat = C.Catalog(str(root), geo)  # a new engine keeps every complete record
    assert sorted(cat.committed()) == sorted(keys(0, 48) + keys(56, 64))
    store = T.open_rank(root, geo, kv, backend)
    assert journal_size(root) == 56 * REC
    blocks.check_loads(cat, store, cat.committed())
    store.close()
    cat.close()


# ---- 2. ENOSPC writing manager.log (ALLOC and TOMB records) ----------------------------------


def pad_to_page(path: str) -> None:
    """Appends stale records (generation 0: every reader ignores them) until `path` ends on a
    4096-byte boundary, so its next append needs a page the file system must give."""
    rem = -os.path.getsize(path) % 4096
    alloc = len(journal.alloc(b"", 0, 0, 1))
    if rem < alloc:
        rem += 4096
    n, rest = divmod(rem - alloc, len(journal.tomb(0, 0)))
    pad = [journal.tomb(0, 0)] * n + [journal.alloc(b"x" * rest, 0, 0, 1)]
    with open(path, "ab") as f:
        f.write(b"".join(pad))
    assert os.path.getsize(path) % 4096 == 0


@pytest.mark.privileged
def test_a_store_whose_alloc_cannot_be_written_is_refused_and_changes_nothing(
    small_fs, kv, backend, caplog
):
    """A slot is written only once its ALLOC is on file (it also evicts what the slot held);
    when manager.log cannot take it, the store call gives up with the index as it was."""
    root = small_fs("1m")
    geo = T.geometry(slots=8)
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    blocks = Blocks(kv)
    res, done = blocks.store(cat, store, keys(0, 8))  # full: the next store must evict
    assert res.ok and len(done) == 8
    pad_to_page(L.manager_log(str(root)))
    filler = fill(root)
    caplog.set_level(logging.INFO, logger="nixl_io_uring_dmabuf")
    for _ in range(3):  # vLLM offers the block again at every step
        assert cat.prepare_store([T.key(100)]) is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "manager.log" in errors[0].getMessage() and "ENOSPC" in errors[0].getMessage()
    assert cat.stats["store_refused"] == 3 and cat.stats["evicted"] == 0
    assert sorted(cat.committed()) == sorted(keys(0, 8))  # nothing was evicted in memory
    blocks.check_loads(cat, store, keys(0, 8))  # nor on file
    os.unlink(filler)
    res, done = blocks.store(cat, store, [T.key(100)])
    assert res.ok and done == [T.key(100)]
    assert any("can be written again" in r.getMessage() for r in caplog.records)
    evicted = set(keys(0, 8)) - set(cat.committed())
    assert len(evicted) == 1
    store.close()
    cat.close()
    cat = C.Catalog(str(root), geo)  # the ALLOC is on file: the evicted block stays gone
    assert sorted(cat.committed()) == sorted(set(keys(0, 8)) - evicted | {T.key(100)})
    store = T.open_rank(root, geo, kv, backend)
    blocks.check_loads(cat, store, cat.committed())
    store.close()
    cat.close()


@pytest.mark.privileged
def test_a_dropped_block_keeps_its_slot_until_its_tomb_is_written(small_fs, kv, backend):
    """A block found damaged on lookup while manager.log cannot be written: a miss at once, but
    its slot is free to no engine until its TOMB is on file (written with the next journal write
    that works, before that write's ALLOCs), so a restart never finds its COMMIT pointing at
    reused bytes."""
    root = small_fs("1m")
    geo = T.geometry(slots=4)
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    blocks = Blocks(kv)
    assert blocks.store(cat, store, keys(0, 2))[0].ok
    slot0, gen0 = cat.slot_of(T.key(0))
    fi, off = geo.locate(slot0)
    with open(L.slot_file(str(root), 0, 1, fi), "r+b") as f:  # damage block 0's bytes
        f.seek(off)
        f.write(bytes(100))
    pad_to_page(L.manager_log(str(root)))
    filler = fill(root)
    assert not cat.lookup(T.key(0))  # a miss, no exception although the TOMB is not written
    assert slot0 not in cat.table.free
    other = C.Catalog(str(root), geo)  # another engine: block 0 is still on file, unchecked
    assert slot0 not in other.table.free and T.key(0) in other.committed()
    assert cat.prepare_store(keys(10, 12)) is None  # no ALLOC can be written either
    os.unlink(filler)
    assert blocks.store(cat, store, [T.key(13)])[0].ok  # writes the owed TOMB first
    recs, _, _ = journal.parse(open(L.manager_log(str(root)), "rb").read())
    mine = [(r.type, r.slot, r.gen) for r in recs if r.gen]
    assert mine.index((journal.TOMB, slot0, gen0)) < len(mine) - 1  # before the new ALLOC
    other.refresh()  # (lookups do so at most every REFRESH_S)
    assert other.lookup(T.key(1)) and T.key(0) not in other.committed()
    other.close()
    store.close()
    cat.close()


# ---- 3. one damaged byte in record 2 of 6 -----------------------------------------------------


@pytest.mark.parametrize("where", ["magic", "length", "body", "crc"])
def test_one_damaged_record_costs_that_record_only(tmp_path, kv, backend, where):
    geo = T.geometry(slots=16)
    cat = C.Catalog(str(tmp_path), geo)
    store = T.open_rank(tmp_path, geo, kv, backend)
    blocks = Blocks(kv)
    for i in range(6):
        assert blocks.store(cat, store, [T.key(i)])[0].ok
    store.close()
    cat.close()
    log = L.commits_log(str(tmp_path), 0, 1)
    size = os.path.getsize(log)
    assert size == 6 * REC
    at = REC + {"magic": 1, "length": 6, "crc": 9, "body": 12 + 25}[where]  # in record 2
    with open(log, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))

    cat = C.Catalog(str(tmp_path), geo)
    survivors = [T.key(i) for i in (0, 2, 3, 4, 5)]
    assert sorted(cat.committed()) == sorted(survivors)
    store = T.open_rank(tmp_path, geo, kv, backend)  # the writer cuts nothing but a torn tail
    assert os.path.getsize(log) == size
    res, done = blocks.store(cat, store, [T.key(6)])
    assert res.ok and done == [T.key(6)]
    store.close()
    cat.close()
    cat = C.Catalog(str(tmp_path), geo)
    assert sorted(cat.committed()) == sorted(survivors + [T.key(6)])
    store = T.open_rank(tmp_path, geo, kv, backend)
    blocks.check_loads(cat, store, cat.committed())
    store.close()
    cat.close()


def test_the_reader_steps_over_damage_only_once_a_valid_record_follows():
    """A damaged record at the end may be a record being written: a reader waits there (it
    is the tail), and reads on once a whole valid record follows it."""
    recs = [journal.commit(T.key(i), i, i + 1, 10, [i]) for i in range(3)]
    bad = bytearray(recs[1])
    bad[20] ^= 0xFF
    buf = recs[0] + bytes(bad)
    got, used, skipped = journal.parse(buf)
    assert [r.slot for r in got] == [0] and used == len(recs[0]) and skipped == []
    got, used, skipped = journal.parse(buf + recs[2][:30])  # the next one, half written
    assert [r.slot for r in got] == [0] and used == len(recs[0])
    got, used, skipped = journal.parse(buf + recs[2])
    assert [r.slot for r in got] == [0, 2] and used == len(buf) + len(recs[2])
    assert skipped == [(len(recs[0]), len(recs[1]))]


# ---- 4. start-up on a full or read-only file system -------------------------------------------


def _one_clear_line(excinfo, *words):
    e = excinfo.value
    msg = str(e)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    # raised `from None`: no OSError traceback from layout.py above it
    assert e.__cause__ is None and e.__suppress_context__, repr(e.__context__)
    return msg


@pytest.mark.privileged
def test_start_up_on_a_full_file_system_is_one_line_naming_path_and_cause(small_fs):
    fs = small_fs("256k")
    fill(fs)
    root = fs / "kv"
    with pytest.raises(L.StoreUnavailable) as ei:
        C.Catalog(str(root), T.geometry(slots=4))
    print(
        _one_clear_line(
            ei, str(root / "store.json"), "No space left on device", "ENOSPC", "0 B free"
        )
    )


@pytest.mark.privileged
def test_start_up_on_a_read_only_file_system_is_one_line_naming_path_and_cause(small_fs):
    fs = small_fs("256k", ro=True)
    with pytest.raises(L.StoreUnavailable) as ei:
        C.Catalog(str(fs / "kv"), T.geometry(slots=4))
    print(_one_clear_line(ei, str(fs / "kv"), "Read-only file system", "EROFS"))


@pytest.mark.privileged
def test_a_rank_on_a_full_file_system_is_one_line_naming_path_and_cause(small_fs, kv, backend):
    root = small_fs("512k")
    geo = T.geometry(slots=4)
    cat = C.Catalog(str(root), geo)
    fill(root)
    with pytest.raises(L.StoreUnavailable) as ei:
        T.open_rank(root, geo, kv, backend)
    print(_one_clear_line(ei, "layout.json", "No space left on device"))
    cat.close()


@pytest.mark.privileged
def test_slot_files_that_do_not_fit_are_refused_at_start_up(small_fs, kv, backend):
    """64 slots of 24 KiB (1.5 MiB) on a 1 MiB file system: refused, naming the file, rather
    than started on sparse files whose every store would fail."""
    root = small_fs("1m")
    geo = T.geometry(slots=64)
    cat = C.Catalog(str(root), geo)
    with pytest.raises(L.StoreUnavailable) as ei:
        T.open_rank(root, geo, kv, backend)
    print(_one_clear_line(ei, "cannot preallocate", "slots-", "ENOSPC", "preallocate to false"))
    store = T.open_rank(root, geo, kv, backend, preallocate=False)  # sparse, as asked
    store.close()
    cat.close()


# ---- 5. the cause of a failed transfer reaches the job's error --------------------------------


@pytest.mark.privileged
def test_enospc_in_a_slot_write_names_enospc_in_the_jobs_error(small_fs, kv, backend, caplog):
    root = small_fs("1m")
    geo = T.geometry(slots=16)
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend, preallocate=False)  # sparse slot files
    blocks = Blocks(kv)
    assert blocks.store(cat, store, keys(0, 2))[0].ok
    filler = fill(root)
    caplog.set_level(logging.INFO, logger="nixl_io_uring_dmabuf")
    res, done = blocks.store(cat, store, keys(2, 6))
    assert not res.ok and done == []
    print(res.error)
    assert "No space left on device (ENOSPC" in res.error and "slots-" in res.error
    assert store.stats["causes"] == {"ENOSPC": 1} and store.stats["store"]["failed"] == 1
    assert any(
        "ENOSPC" in r.getMessage() and "store job" in r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR
    )
    os.unlink(filler)
    res, done = blocks.store(cat, store, keys(6, 10))
    assert res.ok and sorted(done) == sorted(keys(6, 10))
    blocks.check_loads(cat, store, keys(0, 2) + keys(6, 10))
    store.close()
    cat.close()


def test_a_short_slot_file_is_named_in_the_load_jobs_error(tmp_path, kv, backend):
    geo = T.geometry(slots=4)
    cat = C.Catalog(str(tmp_path), geo)
    store = T.open_rank(tmp_path, geo, kv, backend)
    blocks = Blocks(kv)
    assert blocks.store(cat, store, keys(0, 2))[0].ok
    slot, _ = cat.slot_of(T.key(1))
    fi, off = geo.locate(slot)
    os.truncate(L.slot_file(str(tmp_path), 0, 1, fi), off + 1000)  # someone cut the file
    res = T.load_keys(cat, store, [T.key(1)], [20])
    print(res.error)
    assert not res.ok and "short file" in res.error and f"slot {slot}" in res.error
    assert store.stats["causes"] == {"short file": 1}
    store.close()
    cat.close()


@pytest.mark.privileged
def test_eio_from_the_file_system_is_named_in_the_load_jobs_error(tmp_path, kv, backend):
    """The slot file is served by a FUSE file system that fails reads of one slot with EIO."""
    block = L.round_up(sum(T.PAGES), 4096)
    geo = L.Geometry(
        rank_block_bytes=sum(T.PAGES),
        blocks_per_chunk=1,
        world_size=1,
        capacity_bytes=4 * block,
        max_file_bytes=64 * block,
        slot_files=1,
    )
    root = tmp_path / "kv"
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    blocks = Blocks(kv)
    assert blocks.store(cat, store, keys(0, 2))[0].ok
    store.close()
    slot, _ = cat.slot_of(T.key(1))
    _, off = geo.locate(slot)
    path = L.slot_file(str(root), 0, 1, 0)
    content = np.fromfile(path, dtype=np.uint8)
    fs = FuseMount(str(tmp_path / "mnt"), f"eio:{off + 4096}", content)
    try:
        os.unlink(path)
        os.symlink(fs.path, path)
        store = T.open_rank(root, geo, kv, backend)
        res = T.load_keys(cat, store, [T.key(0)], [20])
        assert res.ok and kv.block(20) == blocks.want[T.key(0)]
        res = T.load_keys(cat, store, [T.key(1)], [21])
        print(res.error)
        assert not res.ok and "Input/output error (EIO" in res.error
        assert f"slot {slot}" in res.error and store.stats["causes"] == {"EIO": 1}
        store.close()
        del store
        gc.collect()
    finally:
        fs.stop()
    cat.close()
    shutil.rmtree(root, ignore_errors=True)
