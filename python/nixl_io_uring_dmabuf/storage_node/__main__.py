"""Command line: ``python -m nixl_io_uring_dmabuf.storage_node serve|read|write|stats ...`` (see docs/remote-storage.md)."""

from __future__ import annotations

import argparse
import hashlib
import mmap
import signal
import sys
import threading

import numpy as np

from . import nixl_runtime

MiB = 1 << 20


def size_arg(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def addr_arg(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host:
        raise argparse.ArgumentTypeError(f"{s!r}: expected IP:PORT")
    return host, int(port)


def cmd_serve(a) -> int:
    from .exports import Export
    from .server import NodeConfig, StorageNode

    params = dict(kv.split("=", 1) for kv in a.param)
    config = NodeConfig(
        backend=a.backend,
        backend_params=params,
        buffers=a.buffers,
        buffer_size=a.buffer_size,
        listen_port=None if a.no_listen else a.port,
        publish_etcd=None if not a.no_etcd else False,
        stall_timeout=a.stall_timeout,
        client_lease=a.client_lease,
        pool_mem=a.pool_mem,
        gpu=a.gpu,
        allow_net_only=a.allow_net_only,
    )
    node = StorageNode(a.name, [Export.parse(e) for e in a.export], config)
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    node.start()
    print(f"READY {node.name} {node.instance}", flush=True)
    try:
        node.serve_forever(stop)
    finally:
        node.close()
    return 0


def _client(a):
    from .client import StorageClient

    return StorageClient(a.node, node_addr=a.addr, timeout=a.timeout)


def _buffer(n: int) -> np.ndarray:
    mm = mmap.mmap(-1, max(n, 4096))
    return np.frombuffer(mm, dtype=np.uint8)[:n]


def _blocks(a, base: int) -> list[tuple]:
    bs = a.block_size or a.length
    return [(a.file, a.offset + o, min(bs, a.length - o), base + o) for o in range(0, a.length, bs)]


def cmd_read(a) -> int:
    buf = _buffer(a.length)
    with _client(a) as c:
        c.register_array(buf)
        n = c.read(_blocks(a, buf.ctypes.data))
    if a.out == "-":
        print(f"read {n} bytes sha256={hashlib.sha256(buf.tobytes()).hexdigest()}")
    else:
        with open(a.out, "wb") as f:
            f.write(buf.tobytes())
        print(f"read {n} bytes into {a.out}")
    return 0


def cmd_write(a) -> int:
    data = open(a.input, "rb").read()
    a.length = len(data)
    buf = _buffer(a.length)
    buf[:] = np.frombuffer(data, dtype=np.uint8)
    with _client(a) as c:
        c.register_array(buf)
        n = c.write(_blocks(a, buf.ctypes.data))
    print(f"wrote {n} bytes to {a.file} at offset {a.offset}")
    return 0


def cmd_stats(a) -> int:
    import json

    with _client(a) as c:
        print(json.dumps(c.stats(), indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m nixl_io_uring_dmabuf.storage_node",
        description="IO_URING_DMABUF storage node and client over NIXL (UCX + etcd or socket metadata)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run a storage node")
    s.add_argument("--name", required=True, help="NIXL agent name clients address")
    s.add_argument(
        "--export",
        action="append",
        required=True,
        help="NAME=PATH[:rw][:direct][:size=BYTES] (repeatable); PATH may be a block device",
    )
    s.add_argument(
        "--backend", default="IO_URING_DMABUF", help="storage backend (IO_URING_DMABUF or POSIX)"
    )
    s.add_argument(
        "--param", action="append", default=[], help="backend parameter k=v (repeatable)"
    )
    s.add_argument(
        "--buffers", type=int, default=16, help="staging buffers in the pool (default 16)"
    )
    s.add_argument(
        "--buffer-size", type=size_arg, default=4 * MiB, help="bytes per buffer (default 4M)"
    )
    s.add_argument(
        "--pool-mem",
        default="DRAM",
        choices=["DRAM", "VRAM"],
        help="staging memory (VRAM: GPU node)",
    )
    s.add_argument("--gpu", type=int, default=0)
    s.add_argument(
        "--port",
        type=int,
        default=None,
        help="port of NIXL's metadata listener for the socket exchange (default NIXL's, 5555)",
    )
    s.add_argument("--no-listen", action="store_true", help="no socket listener (etcd only)")
    s.add_argument(
        "--no-etcd",
        action="store_true",
        help="do not publish to etcd even if NIXL_ETCD_ENDPOINTS is set",
    )
    s.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="fail a request with no progress for this long (s)",
    )
    s.add_argument(
        "--client-lease",
        type=float,
        default=10.0,
        help="drop a busy client silent for this long (s)",
    )
    s.add_argument(
        "--allow-net-only",
        action="store_true",
        help="benchmarks: allow READs that skip storage and send the staging buffers as they are "
        "(they may hold other clients' bytes: never on a shared node)",
    )
    s.set_defaults(fn=cmd_serve)

    for name, fn, what in (
        ("read", cmd_read, "read a range into memory"),
        ("write", cmd_write, "write a local file's bytes to a range"),
        ("stats", cmd_stats, "print the node's counters"),
    ):
        c = sub.add_parser(name, help=what)
        c.add_argument("--node", required=True, help="the node's agent name")
        c.add_argument(
            "--addr",
            type=addr_arg,
            default=None,
            help="IP:PORT of the node's listener (socket exchange); default: etcd",
        )
        c.add_argument("--timeout", type=float, default=60.0)
        if name != "stats":
            c.add_argument("--file", required=True, help="export name on the node")
            c.add_argument("--offset", type=size_arg, default=0)
            c.add_argument(
                "--block-size",
                type=size_arg,
                default=0,
                help="cut the range into blocks of this size",
            )
        if name == "read":
            c.add_argument("--length", type=size_arg, required=True)
            c.add_argument(
                "--out", default="-", help="file to write the bytes to; '-' prints a sha256"
            )
        if name == "write":
            c.add_argument("--in", dest="input", required=True)
        c.set_defaults(fn=fn)

    a = p.parse_args(argv)
    if a.cmd == "serve" and a.port is None and not a.no_listen:
        a.port = nixl_runtime.default_comm_port()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
