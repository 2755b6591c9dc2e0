"""The vLLM connector's store on raw block devices (`devices`), without vLLM, through the real NIXL
runtime and the backend under test (the plugin registers a device as BLK_SEG, NIXL's POSIX as
FILE): loop devices over files, one and three striped, as root. The journals stay in the store's
folder. Blocks come back byte for byte in a new catalog and rank store, at the place the
geometry names on the device; capacity comes from the devices' size; a damaged slot is a miss;
a full store evicts; a device with a file system, of another store, mounted, or listed in
another order is refused with a message naming it.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import loop_devices as LD
import pytest
import test_vllm_connector_store as T
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
from nixl_io_uring_dmabuf.vllm_connector import devices as D
from nixl_io_uring_dmabuf.vllm_connector import layout as L

pytestmark = pytest.mark.privileged
SIZE_MB = 4


@pytest.fixture
def loops(tmp_path):
    """Three raw loop devices of SIZE_MB over files in the test's folder."""
    for lo in LD.loops_or_skip(tmp_path, count=3, size_mb=SIZE_MB):
        yield lo.devices


def on_devices(devs, slots: int = 0, world: int = 1) -> L.Geometry:
    """The test's geometry on `devs`; slots 0: as many as the devices hold."""
    slot = L.round_up(sum(T.PAGES), 4096)
    return dataclasses.replace(
        T.geometry(1, world=world),
        capacity_bytes=slots * world * slot,
        devices=tuple(devs),
        device_bytes=tuple(D.size_of(d) for d in devs),
    )


def read_device(dev: str, off: int, n: int) -> bytes:
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, L.round_up(n, 4096))
        os.preadv(fd, [buf], off)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def page_major(kv, b: int) -> bytes:
    return b"".join(a[b].tobytes() for a in kv.arrays)


@pytest.mark.parametrize("count", [1, 3])
def test_blocks_on_raw_devices_come_back_in_a_new_store_at_their_place(
    tmp_path, loops, backend, count
):
    devs = loops[:count]
    geo = on_devices(devs)
    per_device = (SIZE_MB * 2**20 - L.DEVICE_HEADER) // geo.slot_bytes
    assert geo.num_slots == per_device * count  # capacity from the devices' size
    kv = T.Kv()
    root = tmp_path / "kv"
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    # the plugin gets the device as BLK_SEG (its DMA-BUF path serves only that), POSIX as FILE
    assert store._nixl.file_kind == ("BLOCK" if backend == "IO_URING_DMABUF" else "FILE")
    for b in range(6):
        kv.fill(b, seed=900 + b)
    T.store_keys(cat, store, [T.key(b) for b in range(6)], list(range(6)))
    for b in range(6):  # slot s on device s % n, past the header
        slot = cat.slot_of(T.key(b))[0]
        fi, off = geo.locate(slot)
        assert devs[fi] == devs[slot % count]
        assert off == L.DEVICE_HEADER + (slot // count) * geo.slot_bytes
        assert read_device(devs[fi], off, sum(T.PAGES)) == page_major(kv, b)
    store.close()
    cat.close()
    assert not any(n.startswith("slots-") for n in os.listdir(root / "rank0of1"))
    cat = C.Catalog(str(root), geo)  # a new engine
    store = T.open_rank(root, geo, kv, backend)
    res = T.load_keys(cat, store, [T.key(b) for b in range(6)], list(range(10, 16)))
    assert res.ok and res.bad_blocks == [], res.error
    assert [kv.block(b) for b in range(10, 16)] == [kv.block(b) for b in range(6)]
    store.close()
    cat.close()


def test_a_damaged_slot_on_a_device_is_a_miss_and_a_full_store_evicts(tmp_path, loops, backend):
    geo = on_devices(loops, slots=6)
    assert geo.num_slots == 6
    kv, root = T.Kv(), tmp_path / "kv"
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend)
    for b in range(9):
        kv.fill(b, seed=950 + b)
    T.store_keys(cat, store, [T.key(b) for b in range(6)], list(range(6)))
    _, evicted = T.store_keys(cat, store, [T.key(b) for b in range(6, 9)], [6, 7, 8])
    assert sorted(evicted) == [T.key(b) for b in range(3)]  # least recently used first
    fi, off = geo.locate(cat.slot_of(T.key(4))[0])
    fd = os.open(loops[fi], os.O_RDWR | os.O_DIRECT)
    try:
        os.pwritev(fd, [mmap.mmap(-1, 4096)], off)  # zeroes the block's first 4 KiB
    finally:
        os.close(fd)
    cat.close()
    cat = C.Catalog(str(root), geo)
    assert not cat.lookup(T.key(4))  # checked on lookup: a miss
    assert all(cat.lookup(T.key(b)) for b in (3, 5, 6, 7, 8))
    store.close()
    cat.close()


def test_rank_areas_of_a_device_do_not_overlap():
    geo = dataclasses.replace(
        T.geometry(1, world=2),
        capacity_bytes=0,
        devices=("/dev/a", "/dev/b"),
        device_bytes=(L.DEVICE_HEADER + 10 * 2 * 24576 + 1000, L.DEVICE_HEADER + 99 * 24576),
    )
    assert geo.num_slots == 20  # the smaller device decides: 10 slots of each rank on each
    spans = {(fi, off) for r in (0, 1) for s in range(20) for fi, off in [geo.locate(s, r)]}
    assert len(spans) == 40
    assert max(off for _, off in spans) + geo.slot_bytes <= geo.device_bytes[0]


def test_a_device_with_a_file_system_is_refused_unless_told_to_overwrite(tmp_path, loops, backend):
    LD.mkfs_ext4(loops[1])
    geo = on_devices(loops)
    with pytest.raises(
        L.StoreMismatch, match=rf"device {loops[1]} carries an ext2/3/4 file system"
    ):
        T.open_rank(tmp_path / "kv", geo, T.Kv(), backend)
    T.open_rank(tmp_path / "kv", geo, T.Kv(), backend, overwrite_devices=True).close()
    assert D.signature(read_device(loops[1], 0, 128 << 10)) is None
    assert D.header(read_device(loops[1], 0, 4096))["member"] == 1


def test_a_mounted_device_is_refused_even_when_told_to_overwrite(tmp_path, backend):
    why = LD.unavailable(ext4=True)
    if why:
        pytest.skip(f"no loop devices: {why}")
    with LD.LoopDevices(tmp_path, count=1, size_mb=SIZE_MB, ext4=True) as lo:
        geo = on_devices(lo.devices)
        with pytest.raises(
            L.StoreUnavailable, match=f"{lo.devices[0]} cannot hold slots: it is mounted at"
        ):
            T.open_rank(tmp_path / "kv", geo, T.Kv(), backend, overwrite_devices=True)


def test_devices_of_another_store_or_in_another_order_are_refused(tmp_path, loops, backend):
    geo = on_devices(loops[:2])
    T.open_rank(tmp_path / "kv", geo, T.Kv(), backend).close()
    swapped = on_devices(loops[1::-1])
    with pytest.raises(
        L.StoreMismatch, match="is member 1 of this store's 2, but is listed at position 0"
    ):
        T.open_rank(tmp_path / "kv", swapped, T.Kv(), backend, overwrite_devices=True)
    with pytest.raises(L.StoreMismatch, match="holds the slots of another store"):
        T.open_rank(tmp_path / "other", geo, T.Kv(), backend)
    T.open_rank(tmp_path / "other", geo, T.Kv(), backend, overwrite_devices=True).close()
    with pytest.raises(L.StoreMismatch, match="holds the slots of another store"):
        T.open_rank(tmp_path / "kv", geo, T.Kv(), backend)  # the first store lost them


def test_a_store_on_devices_refuses_an_engine_given_other_devices(tmp_path, loops):
    C.Catalog(str(tmp_path / "kv"), on_devices(loops[:2])).close()
    with pytest.raises(
        L.StoreMismatch,
        match=r"keeps its slots in devices \[.*\], but this engine was given devices",
    ):
        C.Catalog(str(tmp_path / "kv"), on_devices(loops))


def test_a_regular_file_is_not_a_device(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a block device"):
        D.size_of(str(f))


def test_two_ranks_keep_their_halves_in_their_own_areas(tmp_path, loops, backend):
    """TP = 2 on two devices: each rank stores its half of a block in its area; a new store's
    ranks load their own halves back, and the block is served only once both committed."""
    geo = on_devices(loops[:2], world=2)
    root = tmp_path / "kv"
    kvs = [T.Kv(), T.Kv()]
    cat = C.Catalog(str(root), geo)
    stores = [T.open_rank(root, geo, kvs[r], backend, rank=r) for r in (0, 1)]
    acc, _ = cat.prepare_store([T.key(b) for b in range(4)])
    for r in (0, 1):
        for b in range(4):
            kvs[r].fill(b, seed=1000 * (r + 1) + b)
        j = next(T._job)
        stores[r].submit_store(j, list(range(4)), [s for _, s, _ in acc], [0] * 4, acc)
        assert T.wait_jobs(stores[r], [j])[j].ok
    cat.complete_store([k for k, _, _ in acc])
    for s in stores:
        s.close()
    cat.close()
    cat = C.Catalog(str(root), geo)
    items = cat.prepare_load([T.key(b) for b in range(4)])
    for r in (0, 1):
        store = T.open_rank(root, geo, kvs[r], backend, rank=r)
        j = next(T._job)
        store.submit_load(
            j,
            list(range(10, 14)),
            [it.slot for it in items],
            [0] * 4,
            [it.sums[r][0] for it in items],
            [it.gen for it in items],
        )
        res = T.wait_jobs(store, [j])[j]
        assert res.ok and res.bad_blocks == [], res.error
        assert [kvs[r].block(b) for b in range(10, 14)] == [kvs[r].block(b) for b in range(4)]
        store.close()
    cat.complete_load([T.key(b) for b in range(4)])
    cat.close()


def test_two_engines_on_the_same_devices_serve_each_others_blocks(tmp_path, loops, backend):
    geo, root = on_devices(loops), tmp_path / "kv"
    kvs = [T.Kv(), T.Kv()]
    cats = [C.Catalog(str(root), geo), C.Catalog(str(root), geo)]
    stores = [T.open_rank(root, geo, kv, backend) for kv in kvs]
    for e in (0, 1):
        for b in range(3):
            kvs[e].fill(b, seed=3000 + 10 * e + b)
        T.store_keys(cats[e], stores[e], [T.key(10 * e + b) for b in range(3)], [0, 1, 2])
    for e in (0, 1):  # each loads the other's three blocks
        other = 1 - e
        cats[e].refresh()  # lookups follow the journals at most every 10 ms
        assert all(cats[e].lookup(T.key(10 * other + b)) for b in range(3))  # checked on lookup
        res = T.load_keys(
            cats[e], stores[e], [T.key(10 * other + b) for b in range(3)], [20, 21, 22]
        )
        assert res.ok and res.bad_blocks == [], res.error
        assert [kvs[e].block(b) for b in (20, 21, 22)] == [kvs[other].block(b) for b in range(3)]
    for x in stores + cats:
        x.close()
