"""A storage node on host A serves IO_URING_DMABUF-backed files to clients on host B over UCX/TCP.

Everything is real: the NIXL 1.5.1 runtime, the plugin, UCX over a veth pair, etcd from Debian or
NIXL's socket metadata exchange, and random data compared byte for byte by the clients.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = pytest.mark.privileged  # network namespaces, etcd, loop devices

MiB = 1 << 20

BUFFERS = 8
NODE_ARGS = ("--buffers", str(BUFFERS), "--buffer-size", "2M", "--port", "8888")


def node_ready(bed, etcd, data_file, *extra, rw=None):
    exports = [f"kv={data_file}"]
    if rw:
        exports.append(f"rw={rw}:rw:size={32 * MiB}")
    return bed.start_node("node1", exports, *NODE_ARGS, *extra, etcd=etcd)


def connect_args(md):
    return {"node": "node1", "addr": ["10.77.0.1", 8888] if md == "p2p" else None}


def wait_stats(w, pred, within=60.0):
    """Poll the node's counters (through client w) until pred holds; return the last counters."""
    deadline = time.monotonic() + within
    while True:
        s = w.call(cmd="stats", timeout=30)
        assert s.get("ok", True), s
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


@pytest.mark.parametrize("md", ["etcd", "p2p"])
def test_two_clients_read_and_write_concurrently(bed, request, data_file, worker, md):
    rw = os.path.join(bed.tmp, "rw.bin")
    env_etcd = request.getfixturevalue("etcd") if md == "etcd" else None
    node, log = node_ready(bed, env_etcd, data_file, rw=rw)
    w1, w2 = worker(env_etcd, "c1"), worker(env_etcd, "c2")
    for w in (w1, w2):
        assert w.call(cmd="connect", **connect_args(md))["ok"]
    # Both clients at once: scattered 64 KiB..2 MiB reads, two rounds each.
    for i, w in enumerate((w1, w2)):
        w.send(cmd="read_verify", file="kv", path=data_file, seed=10 + i, budget=24 * MiB, rounds=2)
    for w in (w1, w2):
        r = w.answer()
        assert r["ok"], r
        assert r["bytes"] > 24 * MiB
    # Writes into disjoint halves of the rw export, checked in the file and read back.
    for i, w in enumerate((w1, w2)):
        w.send(
            cmd="write_verify", file="rw", path=rw, seed=20 + i, start=i * 16 * MiB, length=16 * MiB
        )
    for w in (w1, w2):
        r = w.answer()
        assert r["ok"], r
    # Memory registered after the first requests: the node fetches (etcd) or receives (socket)
    # the client's metadata again.
    assert w2.call(cmd="new_buffer")["ok"]
    r = w2.call(cmd="read_verify", file="kv", path=data_file, seed=30, budget=16 * MiB)
    assert r["ok"], r
    s = w1.call(cmd="stats")
    assert s["requests_failed"] == 0 and s["free_buffers"] == BUFFERS, s
    assert s["requests_ok"] >= 9 and len(s["clients"]) == 2, s
    for w in (w1, w2):
        assert w.call(cmd="quit")["ok"]
    assert node.poll() is None, open(log).read()


def test_bad_requests_get_errors_and_the_node_keeps_serving(bed, data_file, worker):
    node, log = node_ready(bed, None, data_file)
    w = worker()
    assert w.call(cmd="connect", **connect_args("p2p"))["ok"]
    # Unknown export, a block past the end, a WRITE to a read-only export: each an error naming it.
    r = w.call(cmd="read_verify", file="nope", path=data_file, seed=1, budget=4 * MiB)
    assert not r["ok"] and r["type"] == "StorageError" and "no export named 'nope'" in r["error"], r
    r = w.call(cmd="write_verify", file="kv", path=data_file, seed=2, start=0, length=4 * MiB)
    assert not r["ok"] and "read-only" in r["error"], r
    r = w.call(cmd="read_verify", file="kv", path=data_file + ".longer", seed=3, budget=4 * MiB)
    assert not r["ok"], r  # the oracle file does not exist: the worker reports it
    r = w.call(cmd="read_verify", file="kv", path=data_file, seed=4, budget=8 * MiB)
    assert r["ok"], r
    s = w.call(cmd="stats")
    assert s["requests_failed"] == 2 and s["free_buffers"] == BUFFERS, s
    assert node.poll() is None, open(log).read()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_client_that_disappears_mid_request_frees_its_buffers(bed, etcd, data_file, worker, how):
    # A short lease so that a silent (stopped) client is dropped quickly.
    node, log = node_ready(bed, etcd, data_file, "--client-lease", "3", "--stall-timeout", "5")
    victim, other = worker(etcd, "victim"), worker(etcd, "other")
    for w in (victim, other):
        assert w.call(cmd="connect", node="node1")["ok"]
    victim.send(cmd="big_read", file="kv", path=data_file, total=16 << 30, block=MiB, timeout=600)
    assert victim.next(60).get("event") == "submitted"
    s = wait_stats(other, lambda s: s["active_requests"] >= 1 and s["held_buffers"] > 0)
    assert s["active_requests"] >= 1, f"the victim's request never became active: {s}"
    os.kill(victim.p.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    s = wait_stats(other, lambda s: s["active_requests"] == 0 and s["free_buffers"] == BUFFERS)
    assert s["active_requests"] == 0 and s["free_buffers"] == BUFFERS, (
        f"buffers not freed after the client was {how}: {s}\n{open(log).read()[-3000:]}"
    )
    assert s["clients_dropped"] >= 1 and s["requests_failed"] >= 1, s
    # The node still serves the other client.
    r = other.call(cmd="read_verify", file="kv", path=data_file, seed=7, budget=16 * MiB)
    assert r["ok"], r
    assert node.poll() is None, open(log).read()


@pytest.mark.parametrize("md", ["etcd", "p2p"])
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_node_that_dies_mid_request_fails_the_client_then_serves_again(
    bed, request, data_file, worker, md, how
):
    env_etcd = request.getfixturevalue("etcd") if md == "etcd" else None
    node, log = node_ready(bed, env_etcd, data_file)
    w = worker(env_etcd)
    assert w.call(cmd="connect", **connect_args(md), timeout=8)["ok"]
    assert w.call(cmd="read_verify", file="kv", path=data_file, seed=1, budget=8 * MiB)["ok"]
    w.send(cmd="big_read", file="kv", path=data_file, total=16 << 30, block=MiB, timeout=8)
    assert w.next(60).get("event") == "submitted"
    time.sleep(1.0)
    os.kill(node.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    # The client must answer (no hang): NodeUnreachable when UCX sees the node's sockets close,
    # RequestTimeout (its 8 s deadline) when the node is frozen with its connections open.
    r = w.answer(timeout=60)
    assert not r["ok"], f"the request survived its node being {how}: {r}"
    want = "NodeUnreachable" if how == "killed" else "RequestTimeout"
    assert r["type"] == want, r
    print(
        f"client error after the node was {how}: {r['type']} after {r['elapsed']:.2f} s: {r['error']}"
    )
    if how == "stopped":
        os.kill(node.pid, signal.SIGKILL)
    node.wait(30)
    # A new node process under the same name re-registers its exports and publishes again.
    node2, log2 = node_ready(bed, env_etcd, data_file)
    r = w.call(
        cmd="retry_read_verify", file="kv", path=data_file, seed=2, budget=16 * MiB, within=60
    )
    assert r["ok"], f"{r}\n{open(log2).read()[-3000:]}"
    print(
        f"restarted node served after {len(r['failures_before'])} failed attempt(s): {r['failures_before'][-2:]}"
    )
    assert node2.poll() is None


def test_block_device_export(bed, worker):
    """A raw block device (a loop device over a random image, O_DIRECT) served as NIXL BLOCK."""
    import shutil
    import subprocess

    if not shutil.which("losetup"):
        pytest.skip("losetup not installed (Debian package mount)")
    img = os.path.join(bed.tmp, "blk.img")
    with open(img, "wb") as f:
        f.write(os.urandom(32 * MiB))
    r = subprocess.run(
        ["losetup", "-f", "--show", "--direct-io=on", "-b", "4096", img],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"no loop device: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        node, log = bed.start_node("node1", [f"blk={dev}:rw:direct"], *NODE_ARGS)
        assert "BLOCK" in open(log).read(), open(log).read()
        w = worker()
        assert w.call(cmd="connect", **connect_args("p2p"))["ok"]
        r = w.call(cmd="read_verify", file="blk", path=dev, seed=5, budget=16 * MiB)
        assert r["ok"], r
        r = w.call(cmd="write_verify", file="blk", path=dev, seed=6, start=4 * MiB, length=16 * MiB)
        assert r["ok"], r
        assert w.call(cmd="quit")["ok"]
        node.terminate()
        node.wait(30)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)
