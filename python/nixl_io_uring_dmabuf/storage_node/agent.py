"""The storage node's NIXL agent and what is registered with it.

One agent holds two backends: the storage backend (IO_URING_DMABUF, or NIXL's POSIX for
comparison), which moves bytes between the exports and a pool of registered staging buffers, and
UCX, which moves them between those buffers and the clients' memory. NodeAgent creates both,
registers the pool (pool.py) and the exports (exports.py), publishes and withdraws the node's
metadata, loads and drops the clients', and turns a batch into a transfer of one backend or the
other. Every NIXL call of the node goes through here; NIXL's failures are its exceptions, the
tuple ``NodeAgent.errors``.
"""

from __future__ import annotations

import enum
import os

import numpy as np

from . import nixl_runtime, plan
from . import protocol as P
from .config import NodeConfig, log
from .exports import Export
from .pool import BufferPool
from .state import Active, Batch, Stage


def nixl_errors() -> tuple:
    import nixl._bindings as b

    return tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))


class XferState(enum.Enum):
    """A transfer's state as NIXL reports it (``transfer``, ``check_xfer_state``); anything else
    NIXL might answer counts as ERR."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"

    @classmethod
    def _missing_(cls, value):
        return cls.ERR


class NodeAgent:
    def __init__(self, name: str, exports: list[Export], config: NodeConfig):
        self.name = name
        self.exports = {e.name: e for e in exports}
        self.config = config
        self.nixl = None  # the nixl_agent, from start() to close()
        self.pool: BufferPool | None = None
        self.errors: tuple = ()

    @property
    def started(self) -> bool:
        return self.nixl is not None

    # ---- set-up and tear-down -----------------------------------------------------------------

    def start(self) -> None:
        """Create the agent and its backends, register the pool and the exports, publish the
        node's metadata to etcd (if configured)."""
        c = self.config
        nixl_runtime.use_project_plugins()
        api = nixl_runtime.import_nixl()
        self.errors = nixl_errors()
        cfg = api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=c.listen_port is not None,
            listen_port=c.listen_port or 0,
            backends=[],
        )
        self.nixl = nixl_runtime.make_agent(self.name, cfg, c.progress_delay_us)
        plugins = self.nixl.get_plugin_list()
        for need in ("UCX", c.backend):
            if need not in plugins:
                raise RuntimeError(
                    f"NIXL plugin {need} not found in {os.environ.get('NIXL_PLUGIN_DIR') or 'the wheel'} "
                    f"(available: {', '.join(plugins)}); set NIXL_PLUGIN_DIR to the folder ci/build.sh lays out"
                )
        self.nixl.create_backend("UCX", {})
        self.nixl.create_backend(c.backend, c.backend_params)
        self.pool = BufferPool(
            self.nixl,
            c.buffers,
            c.buffer_size,
            c.pool_mem,
            backends=["UCX", c.backend],
            gpu=c.gpu,
        )
        for e in self.exports.values():
            e.open(self.nixl, c.backend)
        if c.publish_etcd:
            self.nixl.send_local_metadata()

    def describe(self) -> str:
        """What the node serves, through what, and where its metadata is (for the start line)."""
        c = self.config
        served = ", ".join(
            f"{e.name}={e.path} ({e.size} B, {e.seg}{', rw' if e.writable else ''})"
            for e in self.exports.values()
        )
        md = "etcd " + os.environ.get("NIXL_ETCD_ENDPOINTS", "") if c.publish_etcd else "no etcd"
        if c.listen_port is not None:
            md += f", socket port {c.listen_port}"
        return (
            f"{served} through {c.backend} with {c.buffers} x {c.buffer_size} B {c.pool_mem} "
            f"buffers; metadata: {md}"
        )

    def close(self) -> None:
        """Withdraw the node's metadata from etcd, deregister and close the exports and the pool."""
        if self.config.publish_etcd:
            try:
                self.nixl.invalidate_local_metadata()
            except self.errors as e:
                log(f"removing this node's metadata from etcd failed: {e!r}")
        for e in self.exports.values():
            e.close(self.nixl)
        if self.pool:
            self.pool.close()
        self.nixl = None

    # ---- messages and clients' metadata -------------------------------------------------------

    def notifications(self) -> dict:
        return self.nixl.get_new_notifs()

    def send(self, client: str, msg: bytes) -> None:
        """One notification to `client`; raises one of `errors` if NIXL cannot send it."""
        self.nixl.send_notif(client, msg)

    def has_metadata(self, client: str, descs=None) -> bool:
        """Whether the client's metadata is loaded (and covers `descs`, if given)."""
        try:
            return self.nixl.check_remote_metadata(client, descs)
        except self.errors:
            return False

    def fetch_metadata(self, client: str, md: P.MdExchange, now: float, last: float) -> float:
        """Ask etcd for the client's metadata (at most once a second); returns the time asked."""
        if md is P.MdExchange.ETCD and self.config.publish_etcd and now - last >= 1.0:
            try:
                self.nixl.fetch_remote_metadata(client)
            except self.errors as e:
                log(f"fetching {client}'s metadata from etcd failed: {e!r}")
            return now
        return last

    def drop_client(self, client: str) -> None:
        """Drop the client's metadata and connection (UCX fails what is still in flight to it)."""
        try:
            self.nixl.remove_remote_agent(client)
        except self.errors:
            pass  # never loaded or already invalidated (etcd watch, socket INVL)

    # ---- transfers ----------------------------------------------------------------------------

    def client_descs(self, a: Active, rows: np.ndarray):
        """Descriptors of the client's memory named by rows (block or piece columns 2..4)."""
        d = np.ascontiguousarray(
            np.stack([rows[:, 3], rows[:, 2], rows[:, 4]], axis=1), dtype=np.uint64
        )
        return self.nixl.get_xfer_descs(d, a.req.mem)

    def _pool_descs(self, b: Batch):
        p = b.pieces
        base = self.pool.addr(b.buf)
        d = np.stack(
            [
                p[:, plan.BOFF] + np.uint64(base),
                p[:, plan.LEN],
                np.full(len(p), self.pool.dev, dtype=np.uint64),
            ],
            axis=1,
        )
        return self.nixl.get_xfer_descs(np.ascontiguousarray(d, dtype=np.uint64), self.pool.mem)

    def prepare(self, b: Batch, stage: Stage):
        """The transfer handle of one stage of a batch: STORAGE between its exports and its pool
        buffer (the storage backend), NET between that buffer and the client (UCX)."""
        a = b.req
        local = self._pool_descs(b)
        if stage is Stage.STORAGE:
            exps = [self.exports[f] for f in a.req.files]
            p = b.pieces
            fds = np.array([e.fd for e in exps], dtype=np.uint64)[p[:, plan.FILE].astype(np.int64)]
            remote = np.ascontiguousarray(
                np.stack([p[:, plan.FOFF], p[:, plan.LEN], fds], axis=1), dtype=np.uint64
            )
            seg = exps[int(p[0, plan.FILE])].seg
            return self.nixl.initialize_xfer(
                a.req.op,
                local,
                self.nixl.get_xfer_descs(remote, seg),
                self.name,
                backends=[self.config.backend],
            )
        # READ request: UCX WRITE into the client; WRITE request: UCX READ from it.
        op = "WRITE" if a.req.op == "READ" else "READ"
        return self.nixl.initialize_xfer(
            op, local, self.client_descs(a, b.pieces), a.client, backends=["UCX"]
        )

    def transfer(self, handle) -> XferState:
        return XferState(self.nixl.transfer(handle))

    def state(self, handle) -> XferState:
        return XferState(self.nixl.check_xfer_state(handle))

    def release(self, handle) -> bool:
        """Release a transfer handle; False if NIXL could not (the transfer is still in flight)."""
        try:
            self.nixl.release_xfer_handle(handle)
        except self.errors:
            return False
        return True
