"""One store on a real distributed file system mounted by two nodes (issue 47 item 2), without
vLLM: a GlusterFS volume that the test starts (tests/support/glusterfs.py: glusterd and the brick
in one network namespace, nodes a and b each mounting the volume over FUSE from its own).
What the store relies on, checked across the two mounts:

- OFD locks and flock exclude across the nodes, and a lock goes with its holder's close;
- an append under a journal's lock is seen by the next holder on the other node (its size and
  its bytes): processes on both nodes appending at once keep every record;
- O_DIRECT works, and a slot rewritten on one node is read as it is now on the other;
- a file replaced by rename is read whole and new on the other node;
- engine processes on both nodes storing, evicting and loading at once serve nothing torn and
  lose no slot, and each node serves what the other stored, byte for byte.

Needs root and GlusterFS (installed by ci/glusterfs-setup.sh, which the fixture runs); skips
with the reason otherwise.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import time

import pytest
import test_vllm_connector_store as T
import test_vllm_store_sharing as S
from nixl_io_uring_dmabuf.vllm_connector import catalog as C
from nixl_io_uring_dmabuf.vllm_connector import file_size, journal, locks
from support import glusterfs as G

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    yield from G.bed_for_tests(tmp_path_factory, pytest.skip)


@pytest.fixture
def on_both(bed, request):
    """One fresh folder of the volume, as node a and node b see it: (path on a, path on b)."""
    name = request.node.name.replace("[", "-").replace("]", "")
    os.makedirs(os.path.join(bed.mounts["a"], name))
    return os.path.join(bed.mounts["a"], name), os.path.join(bed.mounts["b"], name)


def test_locks_exclude_across_nodes(on_both):
    a_dir, b_dir = on_both
    fa = os.open(os.path.join(a_dir, "lk"), os.O_RDWR | os.O_CREAT, 0o644)
    fb = os.open(os.path.join(b_dir, "lk"), os.O_RDWR)
    assert locks._ofd(fa, fcntl.F_WRLCK, wait=False)
    assert not locks._ofd(fb, fcntl.F_WRLCK, wait=False), "node b took a lock node a holds"
    # A lock goes with its holder's last close, as the kernel's do; on GlusterFS a little later
    # (the client releases it with the file, asynchronously): wait for it, no time asserted.
    os.close(fa)
    t0 = time.monotonic()
    while not locks._ofd(fb, fcntl.F_WRLCK, wait=False):
        assert time.monotonic() - t0 < 60, "the lock outlived its holder's close (hang guard)"
        time.sleep(0.01)
    print(f"node b got the lock {time.monotonic() - t0:.3f} s after node a closed its file")
    fa = os.open(os.path.join(a_dir, "lk"), os.O_RDWR)
    assert not locks._ofd(fa, fcntl.F_RDLCK, wait=False)
    locks._ofd(fb, fcntl.F_UNLCK, wait=True)
    # flock: older releases' exclusive lock against this release's shared one
    fcntl.flock(fa, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fb, fcntl.LOCK_SH | fcntl.LOCK_NB)
    fcntl.flock(fa, fcntl.LOCK_UN)
    fcntl.flock(fb, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(fa)
    os.close(fb)


def test_an_append_on_one_node_is_seen_by_the_next_writer_on_the_other(on_both):
    """Both writers keep their journal open (as the engines do), so each one's view of the file
    is the one its node cached; the next append must still land after the other's."""
    a_dir, b_dir = on_both
    wa = journal.Appender(os.path.join(a_dir, "j.log"), durable=False)
    wb = journal.Appender(os.path.join(b_dir, "j.log"), durable=False)
    for i in range(20):
        (wa if i % 2 == 0 else wb).append([journal.tomb(i, i)])
    with open(os.path.join(b_dir, "j.log"), "rb") as f:
        recs, used, skipped = journal.parse(f.read())
    assert [r.slot for r in recs] == list(range(20)) and not skipped
    assert wa.cut == wb.cut == 0


def test_the_size_is_the_volumes_on_a_mount_with_the_default_attribute_cache(bed, on_both):
    """Where a mount keeps attributes for 1 s (GlusterFS' default), the journals ask the file
    system for the size (file_size.synced_size) and see the other node's append at once."""
    a_dir, b_dir = on_both
    plain = os.path.join(bed.folder, "mnt-b-default")
    bed.mount("b", plain, options="")
    try:
        path = os.path.join(plain, os.path.basename(b_dir), "size")
        with open(os.path.join(a_dir, "size"), "wb") as fa:
            fd = os.open(path, os.O_RDONLY)
            assert file_size.synced_size(fd) == 0
            fa.write(b"x" * 100)
            fa.flush()
            print(f"fstat on the cached mount: {os.fstat(fd).st_size} (the volume has 100)")
            assert file_size.synced_size(fd) == 100
            os.close(fd)
    finally:
        bed.unmount(plain)


APPENDER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from nixl_io_uring_dmabuf.vllm_connector import journal
w = journal.Appender(sys.argv[2], durable=False)
tag = int(sys.argv[3])
for i in range(int(sys.argv[4])):
    w.append([journal.tomb(tag, i)])
print(w.cut)
"""


def test_appenders_on_both_nodes_at_once_keep_every_record(bed, on_both):
    """Two processes on each node append 200 records each to one journal under its lock."""
    a_dir, b_dir = on_both
    py_dir = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    procs = []
    for tag, node in enumerate(("a", "a", "b", "b")):
        path = os.path.join(a_dir if node == "a" else b_dir, "j.log")
        argv = [sys.executable, "-c", APPENDER, py_dir, path, str(tag), "200"]
        procs.append(subprocess.Popen(bed.on(node, argv), stdout=subprocess.PIPE, text=True))
    cuts = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    with open(os.path.join(a_dir, "j.log"), "rb") as f:
        recs, used, skipped = journal.parse(f.read())
    got = sorted((r.slot, r.gen) for r in recs)
    assert got == [(t, i) for t in range(4) for i in range(200)], "records lost or doubled"
    assert cuts == ["0"] * 4, "a writer cut another's whole record as torn"


def _aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))
    buf.write(data)
    return buf


def test_o_direct_and_a_rewritten_slot_read_as_it_is_now(on_both):
    a_dir, b_dir = on_both
    fa = os.open(os.path.join(a_dir, "slots"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    fb = os.open(os.path.join(b_dir, "slots"), os.O_RDWR | os.O_DIRECT)
    out = mmap.mmap(-1, 8192)
    for gen in (b"1", b"2"):  # node b keeps its file open across the rewrite
        assert os.pwritev(fa, [_aligned(gen * 8192)], 0) == 8192
        assert os.preadv(fb, [out], 0) == 8192 and out[:] == gen * 8192
    os.close(fa)
    os.close(fb)


def test_a_file_replaced_by_rename_is_read_whole_and_new_on_the_other_node(on_both):
    a_dir, b_dir = on_both
    for version in ("1", "2"):
        with open(os.path.join(a_dir, "store.json.tmp"), "w") as f:
            f.write(version * 1000)
        os.rename(os.path.join(a_dir, "store.json.tmp"), os.path.join(a_dir, "store.json"))
        with open(os.path.join(b_dir, "store.json")) as f:
            assert f.read() == version * 1000


def test_each_node_serves_what_the_other_stored(on_both, backend):
    a_dir, b_dir = on_both
    geo = T.geometry(slots=8)
    a, b = C.Catalog(a_dir, geo), C.Catalog(b_dir, geo)
    kva, kvb = T.Kv(), T.Kv()
    sa, sb = T.open_rank(a_dir, geo, kva, backend), T.open_rank(b_dir, geo, kvb, backend)
    for i in range(3):
        assert S.store_one(a, sa, kva, i)
    b.refresh()
    assert sorted(b.committed()) == sorted(T.key(i) for i in range(3))
    assert [S.load_one(b, sb, kvb, i) for i in range(3)] == ["ok"] * 3
    assert S.store_one(b, sb, kvb, 5)
    a.refresh()
    assert S.load_one(a, sa, kva, 5) == "ok"
    slots = {a.slot_of(T.key(i))[0] for i in (0, 1, 2, 5)}
    assert len(slots) == 4, "the two nodes were given one slot"
    for x in (sa, sb, a, b):
        x.close()


def test_engines_on_both_nodes_store_evict_and_load_at_once(bed, on_both, backend):
    """Two engine processes on node a and one on node b, 24 keys in 8 slots for 6 s each."""
    a_dir, b_dir = on_both
    where = [("a", a_dir), ("a", a_dir), ("b", b_dir)]
    procs = [
        S.start(root, backend, seed, 6.0, on=bed.on(node, []))
        for seed, (node, root) in enumerate(where, 1)
    ]
    seen = [S.result(p) for p in procs]
    print(seen)
    assert all(s["torn"] == 0 for s in seen), seen
    assert sum(s["ok"] for s in seen) > 0 and all(s["stored"] for s in seen), seen
    S.check_store(b_dir, backend)


def test_each_node_is_its_own_network_namespace_with_its_own_client(bed):
    """What makes the two mounts two nodes: each mount's FUSE client runs in its node's network
    namespace and reaches the brick over the bridge, and bed.python runs a process there."""
    ours = os.readlink("/proc/self/ns/net")
    seen = set()
    for node in ("a", "b"):
        argv = [
            bed.python(node, sys.executable),
            "-c",
            "import os; print(os.readlink('/proc/self/ns/net'))",
        ]
        ns = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
        assert ns != ours
        seen.add(ns)
        pids = subprocess.run(
            ["ip", "netns", "pids", bed.ns[node]], capture_output=True, text=True
        ).stdout.split()
        comms = {open(f"/proc/{p}/comm").read().strip() for p in pids}
        assert "glusterfs" in comms, f"node {node}: no FUSE client in its namespace: {comms}"
    assert len(seen) == 2


# Put before S.start's `python -c WORKER PATH ...`: runs it with locks that never exclude, what a
# file system that keeps locks local to each mount gives one engine per node.
NO_LOCKS = r"""
import os, sys
code, sys.argv = sys.argv[3], ["-c", *sys.argv[4:]]
sys.path[:0] = sys.argv[1].split(os.pathsep)
from nixl_io_uring_dmabuf.vllm_connector import locks
locks._ofd = lambda fd, kind, wait: True
exec(compile(code, "<engine>", "exec"), {"__name__": "__main__"})
"""


def test_without_locks_that_exclude_across_nodes_nothing_torn_is_served(bed, on_both, backend):
    """One engine per node whose locks never exclude (journal appends and allocations collide,
    engines look dead to each other): records are overwritten and slots given twice, yet every
    block that is served has its own bytes; the checks catch the rest. Capacity may be lost."""
    a_dir, b_dir = on_both
    procs = [
        S.start(root, backend, seed, 6.0, on=bed.on(node, [sys.executable, "-c", NO_LOCKS]))
        for seed, (node, root) in enumerate([("a", a_dir), ("b", b_dir)], 1)
    ]
    seen = [S.result(p) for p in procs]
    print(seen)
    assert all(s["torn"] == 0 for s in seen), seen
    geo = T.geometry(slots=8)
    cat, kv = C.Catalog(b_dir, geo), T.Kv()
    store = T.open_rank(b_dir, geo, kv, backend)
    found = [int.from_bytes(k[:32], "big") for k in cat.committed()]
    assert "torn" not in [S.load_one(cat, store, kv, i) for i in found]
    store.close()
    cat.close()
