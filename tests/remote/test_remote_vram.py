"""Client VRAM as the destination (and source) of remote storage requests, on a GPU machine.

The storage node (host A namespace) reads its file with IO_URING_DMABUF into staging buffers, in
DRAM or (a GPU storage node) in VRAM, and UCX moves them into a torch CUDA tensor of the client
(host B namespace) on the same machine: UCX chooses among the transports in UCX_TLS (tcp plus
its CUDA transports cuda_copy/cuda_ipc here). Whether the UCX libraries carried by the NIXL
wheel do this is what the test finds out; without CUDA (or torch) every case skips.
"""

from __future__ import annotations

import os

import pytest

MiB = 1 << 20


def _cuda() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


pytestmark = [
    pytest.mark.privileged,  # network namespaces
    pytest.mark.skipif(bool(_cuda()), reason=_cuda() or "CUDA available"),
]

UCX_TLS = os.environ.get("IUDS_VRAM_UCX_TLS", "tcp,cuda_copy,cuda_ipc")


@pytest.mark.parametrize("pool", ["DRAM", "VRAM"])
@pytest.mark.parametrize("md", ["p2p", "etcd"])
def test_client_vram_read_and_write(bed, request, data_file, worker, md, pool, monkeypatch):
    etcd = request.getfixturevalue("etcd") if md == "etcd" else None
    monkeypatch.setenv("UCX_TLS", UCX_TLS)
    real_env = bed.env

    def env(host, **extra):  # UCX's CUDA transports next to TCP on both "hosts"
        e = real_env(host, **extra)
        e["UCX_TLS"] = UCX_TLS
        return e

    monkeypatch.setattr(bed, "env", env)
    rw = os.path.join(bed.tmp, "rw.bin")
    node, log = bed.start_node(
        "node1",
        [f"kv={data_file}", f"rw={rw}:rw:size={32 * MiB}"],
        "--buffers",
        "8",
        "--buffer-size",
        "2M",
        "--port",
        "8888",
        "--pool-mem",
        pool,
        etcd=etcd,
    )
    w = worker(etcd)
    addr = ["10.77.0.1", 8888] if md == "p2p" else None
    assert w.call(cmd="connect", node="node1", addr=addr, mem="VRAM")["ok"]
    r = w.call(cmd="read_verify", file="kv", path=data_file, seed=3, budget=32 * MiB, rounds=2)
    assert r["ok"], f"{r}\n{open(log).read()[-3000:]}"
    r = w.call(cmd="write_verify", file="rw", path=rw, seed=4, start=0, length=16 * MiB)
    assert r["ok"], f"{r}\n{open(log).read()[-3000:]}"
    s = w.call(cmd="stats")
    print(
        f"VRAM client, {pool} staging, {md}: {s['bytes_read']} B read, {s['bytes_written']} B written, "
        f"UCX_TLS={UCX_TLS}"
    )
    assert s["requests_failed"] == 0, s
    assert w.call(cmd="quit")["ok"]
    assert node.poll() is None, open(log).read()
