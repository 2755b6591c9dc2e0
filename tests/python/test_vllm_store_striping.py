"""The vLLM connector's store with its slot files spread over several directories (`slot_dirs`),
without vLLM, through the real NIXL runtime and the backend under test: on folders of one file
system, and on ext4 file systems of several loop devices (as root). The journals stay in the
store's folder; a store opened with other directories, the same ones in another order, or a
directory of another store is refused before a byte moves.
"""

from __future__ import annotations

import dataclasses
import os

import loop_devices as LD
import pytest
import test_vllm_connector_store as T
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
from nixl_io_uring_dmabuf.vllm_connector import layout as L


def striped(slots: int, dirs) -> L.Geometry:
    return dataclasses.replace(T.geometry(slots), slot_files=1, slot_dirs=tuple(map(str, dirs)))


def round_trip(root, geo, backend, **kw) -> None:
    """Stores 6 blocks, then a new catalog and rank store load them byte for byte."""
    kv = T.Kv()
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend, **kw)
    for b in range(6):
        kv.fill(b, seed=700 + b)
    T.store_keys(cat, store, [T.key(b) for b in range(6)], list(range(6)))
    store.close()
    cat.close()
    cat = C.Catalog(str(root), geo)
    store = T.open_rank(root, geo, kv, backend, **kw)
    assert all(cat.lookup(T.key(b)) for b in range(6))
    res = T.load_keys(cat, store, [T.key(b) for b in range(6)], list(range(10, 16)))
    assert res.ok and res.bad_blocks == [], res.error
    assert [kv.block(b) for b in range(10, 16)] == [kv.block(b) for b in range(6)]
    store.close()
    cat.close()


def test_consecutive_slots_go_to_different_directories():
    geo = dataclasses.replace(T.geometry(10), slot_files=4, slot_dirs=("/a", "/b", "/c"))
    assert geo.num_files == 6  # 4 rounded up to a multiple of the 3 directories
    dirs = [
        os.path.dirname(os.path.dirname(geo.slot_path("/kv", 0, geo.locate(s)[0])))
        for s in range(10)
    ]
    assert dirs == ["/a", "/b", "/c"] * 3 + ["/a"]
    small = dataclasses.replace(T.geometry(2), slot_files=8, slot_dirs=("/a", "/b", "/c"))
    assert small.num_files == 2  # never a file without a slot


def test_slot_files_in_three_directories_round_trip(tmp_path, backend):
    dirs = [tmp_path / f"disk{i}" for i in range(3)]
    geo = striped(9, dirs)
    round_trip(tmp_path / "kv", geo, backend)
    for i, d in enumerate(dirs):  # file i in directory i % 3, the journals in the store's folder
        assert sorted(os.listdir(d / "rank0of1")) == [f"slots-{i:03d}.bin"]
    assert os.path.exists(tmp_path / "kv" / "rank0of1" / "commits.log")
    assert not any(n.startswith("slots-") for n in os.listdir(tmp_path / "kv" / "rank0of1"))


def test_another_set_of_directories_is_refused_with_the_stores_own(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    C.Catalog(str(tmp_path / "kv"), striped(4, dirs)).close()
    with pytest.raises(
        L.StoreMismatch,
        match=r"keeps its slots in slot_dirs \[.*/a', .*/b'\], but this engine was given slot_dirs \[.*/a'\]",
    ):
        C.Catalog(str(tmp_path / "kv"), striped(4, dirs[:1]))
    with pytest.raises(
        L.StoreMismatch, match="keeps its slots in slot_dirs .* given its own folder"
    ):
        C.Catalog(str(tmp_path / "kv"), T.geometry(4))


def test_directories_in_another_order_or_of_another_store_are_refused(tmp_path, backend):
    a, b = tmp_path / "a", tmp_path / "b"
    T.open_rank(tmp_path / "kv", striped(4, [a, b]), T.Kv(), backend).close()
    with pytest.raises(
        L.StoreMismatch, match="is member 1 of this store's 2, but is listed at position 0"
    ):
        T.open_rank(tmp_path / "kv", striped(4, [b, a]), T.Kv(), backend)
    with pytest.raises(L.StoreMismatch, match="holds the slots of another store"):
        T.open_rank(tmp_path / "other", striped(4, [a, tmp_path / "c"]), T.Kv(), backend)


@pytest.fixture
def ext4_loops(tmp_path):
    yield from LD.loops_or_skip(tmp_path, count=3, size_mb=32, ext4=True)


@pytest.mark.privileged
@pytest.mark.parametrize("o_direct", [False, True])
def test_slot_files_on_three_ext4_loop_devices_round_trip(tmp_path, backend, ext4_loops, o_direct):
    geo = striped(9, ext4_loops.mounts)
    round_trip(tmp_path / "kv", geo, backend, o_direct=o_direct, durable=o_direct)
    for i, m in enumerate(ext4_loops.mounts):
        assert (
            os.path.getsize(os.path.join(m, "rank0of1", f"slots-{i:03d}.bin")) == 3 * geo.slot_bytes
        )
