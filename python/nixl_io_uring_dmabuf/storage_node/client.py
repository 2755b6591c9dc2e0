"""Client library: ask a storage node for KV blocks by (file, offset, length) into this process's memory.

The client is a NIXL agent with the UCX backend only. It registers its buffers with UCX, publishes
its metadata (etcd, or NIXL's socket exchange with the node's listener), loads the node's, and
sends requests as NIXL notifications; the node moves the bytes with UCX straight into (READ) or
out of (WRITE) the registered buffers and answers with a DONE notification.

Failure handling, so that no call hangs:
- every request has a deadline (``timeout``); when it passes, the request fails with
  RequestTimeout and the node is told to cancel it (CNCL);
- while requests are outstanding a background thread sends PING notifications; when UCX reports
  the node disconnected (a killed node: the kernel closes its sockets), every outstanding request
  fails at once with NodeUnreachable and the node's metadata is dropped;
- the next request reconnects: it fetches the node's metadata again (a restarted node
  re-registers and republishes), so a restarted node serves again without restarting clients.
After a RequestTimeout the node may still be moving bytes for that request until it sees the
cancel; ``Pending.settled`` is set when the node has answered for it (or is known gone).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time

import numpy as np

from . import nixl_runtime
from . import protocol as P


class StorageError(RuntimeError):
    """The node failed the request (its reason is the message)."""


class NodeUnreachable(StorageError):
    """No answer from the node: disconnected, no metadata, or gone silent."""


class RequestTimeout(NodeUnreachable):
    """The request's deadline passed without an answer."""


class Pending:
    """An outstanding request; ``wait()`` returns the bytes moved or raises."""

    def __init__(self, req_id: int, nbytes: int, deadline: float):
        self.req_id, self.nbytes, self.deadline = req_id, nbytes, deadline
        self._done = threading.Event()
        self.settled = threading.Event()
        self.error: StorageError | None = None
        self.moved = 0

    def _resolve(self, moved: int = 0, error: StorageError | None = None) -> None:
        if not self._done.is_set():
            self.moved, self.error = moved, error
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        # The progress thread resolves every request by its deadline; the extra margin only
        # guards against that thread having died.
        if not self._done.wait(max(0.0, self.deadline - time.monotonic()) + 5.0):
            raise RequestTimeout(
                f"request {self.req_id}: no answer and no deadline handling (progress thread dead?)"
            )
        if self.error:
            raise self.error
        return self.moved


class StorageClient:
    """One connection to one storage node.

    node: the node's agent name. node_addr: (ip, port) of the node's NIXL listener for the socket
    metadata exchange; None = etcd (NIXL_ETCD_ENDPOINTS must be set).
    """

    def __init__(
        self,
        node: str,
        *,
        node_addr: tuple[str, int] | None = None,
        name: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        ping_interval: float = 1.0,
        listen_port: int = 0,
    ):
        self.node, self.node_addr = node, node_addr
        if node_addr is None and not nixl_runtime.etcd_configured():
            raise ValueError("give node_addr=(ip, port) or set NIXL_ETCD_ENDPOINTS")
        self.md = P.MdExchange.SOCKET if node_addr else P.MdExchange.ETCD
        self.timeout, self.connect_timeout, self.ping_interval = (
            timeout,
            connect_timeout,
            ping_interval,
        )
        self.instance = secrets.token_hex(6)
        self.name = name or f"iuds-client-{socket.gethostname()}-{os.getpid()}-{self.instance}"
        nixl_runtime.use_project_plugins()
        api = nixl_runtime.import_nixl()
        import nixl._bindings as b

        nixl_agent_config, nixl_thread_sync_t = api.nixl_agent_config, api.nixl_thread_sync_t

        self._errors = tuple(
            getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error")
        )
        # The socket exchange runs on NIXL's listener thread, so a p2p client has one too (port 0:
        # the kernel picks it; the node answers on the connection the client opened).
        cfg = nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=node_addr is not None,
            listen_port=listen_port,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = nixl_runtime.make_agent(self.name, cfg, nixl_runtime.progress_delay_us())
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL's UCX plugin did not load (NIXL_LOG_LEVEL=INFO says why)")
        # NIXL's STRICT sync mode makes the agent itself thread safe; _lock guards this object's
        # state (pending requests, connection flag), _conn_lock serializes (re)connects so that a
        # slow connect never holds up the progress thread.
        self._lock = threading.RLock()
        self._conn_lock = threading.Lock()
        self._regs = []
        self._dirty = True  # registrations not yet published
        self._connected = False
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._abandoned: dict[int, Pending] = {}
        self._stats: dict[int, tuple[threading.Event, list]] = {}
        self._stop = threading.Event()
        self._last_ping = 0.0
        self._thread = threading.Thread(target=self._progress, name="iuds-client", daemon=True)
        self._thread.start()

    # ---- memory -------------------------------------------------------------------------------

    def register(self, addr: int, size: int, mem: str = "DRAM", dev: int = 0):
        """Register [addr, addr+size) with UCX; published to the node before the next request."""
        with self._lock:
            reg = self.agent.register_memory([(addr, size, dev, "")], mem, backends=["UCX"])
            self._regs.append(reg)
            self._dirty = True
            return reg

    def register_array(self, arr: np.ndarray):
        return self.register(arr.ctypes.data, arr.nbytes)

    # ---- connection -----------------------------------------------------------------------------

    def _publish(self) -> None:
        if self.node_addr:
            self.agent.send_local_metadata(*self.node_addr)
        else:
            self.agent.send_local_metadata()

    def _connect(self) -> None:
        """Make sure the node has our metadata and we have its (caller holds _conn_lock)."""
        if self._connected and not self.agent.check_remote_metadata(self.node):
            # NIXL dropped it: the node removed its etcd keys (clean shutdown) and the watch fired.
            self._connected = False
        if self._connected:
            if self._dirty:
                self._publish()
                self._dirty = False
            return
        deadline = time.monotonic() + self.connect_timeout
        where = f"{self.node_addr[0]}:{self.node_addr[1]}" if self.node_addr else "etcd"
        while True:
            try:
                self._publish()
                if self.node_addr:
                    self.agent.fetch_remote_metadata(self.node, *self.node_addr)
                else:
                    self.agent.fetch_remote_metadata(self.node)
            except self._errors as e:
                raise NodeUnreachable(
                    f"metadata exchange with {self.node} via {where} failed: {e!r}"
                ) from None
            step_end = min(deadline, time.monotonic() + 1.0)
            while time.monotonic() < step_end:
                if self.agent.check_remote_metadata(self.node):
                    break
                time.sleep(0.005)
            if self.agent.check_remote_metadata(self.node):
                break
            if time.monotonic() >= deadline:
                raise NodeUnreachable(
                    f"no metadata for node {self.node} via {where} within {self.connect_timeout:.0f} s"
                )
        if self.node_addr:
            # NIXL's socket exchange may have written our first publish into a connection left
            # over from a previous node process (lost when the kernel reset it); now that the
            # node answered on a live connection, publish once more (same contents: merged).
            self._publish()
        self._dirty = False
        self._connected = True

    def _drop(self, reason: str) -> None:
        """The node is gone: forget its metadata (UCX disconnects) and fail everything outstanding."""
        with self._lock:
            if self._connected:
                try:
                    self.agent.remove_remote_agent(self.node)
                except self._errors:
                    pass
            self._connected = False
            failed = list(self._pending.values())
            self._pending.clear()
            for ev, _box in self._stats.values():
                ev.set()
            self._stats.clear()
        for p in failed:
            p._resolve(error=NodeUnreachable(f"request {p.req_id}: {reason}"))
            p.settled.set()

    def _send(self, msg: bytes) -> None:
        try:
            self.agent.send_notif(self.node, msg)
        except self._errors as e:
            raise NodeUnreachable(f"sending to node {self.node} failed: {e!r}") from None

    # ---- requests -----------------------------------------------------------------------------

    @staticmethod
    def _table(blocks) -> tuple[list[str], np.ndarray]:
        files: dict[str, int] = {}
        rows = []
        for blk in blocks:
            f, off, ln, addr = blk[:4]
            dev = blk[4] if len(blk) > 4 else 0
            rows.append((files.setdefault(f, len(files)), off, ln, addr, dev))
        return list(files), np.array(rows, dtype=np.uint64).reshape(-1, P.BLOCK_FIELDS)

    def submit(
        self,
        op: str,
        blocks,
        *,
        mem: str = "DRAM",
        timeout: float | None = None,
        net_only: bool = False,
    ) -> Pending:
        """Send one request. blocks: (file, offset, length, addr[, dev]) tuples, at most
        protocol.MAX_BLOCKS. Returns a Pending; raises NodeUnreachable if it cannot be sent."""
        files, arr = self._table(blocks)
        return self.submit_array(op, files, arr, mem=mem, timeout=timeout, net_only=net_only)

    def submit_array(
        self,
        op: str,
        files: list[str],
        arr: np.ndarray,
        *,
        mem: str = "DRAM",
        timeout: float | None = None,
        net_only: bool = False,
    ) -> Pending:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._conn_lock:
            self._connect()
        with self._lock:
            rid = next(self._ids)
            req = P.Request(
                rid, op, mem, files, arr, net_only, self.instance, {"md": self.md.value}
            )
            msg = P.encode_request(req)
            p = Pending(rid, req.nbytes, deadline)
            self._pending[rid] = p
            try:
                self._send(msg)
            except NodeUnreachable as e:
                self._pending.pop(rid, None)
                self._drop(str(e))
                raise
        return p

    def _run(self, op, blocks, mem, timeout) -> int:
        blocks = list(blocks)
        parts = [blocks[i : i + P.MAX_BLOCKS] for i in range(0, len(blocks), P.MAX_BLOCKS)]
        pend = [self.submit(op, part, mem=mem, timeout=timeout) for part in parts]
        return sum(p.wait() for p in pend)

    def read(self, blocks, *, mem: str = "DRAM", timeout: float | None = None) -> int:
        """READ blocks (file, offset, length, dst_addr[, dev]) into registered memory; bytes moved."""
        return self._run("READ", blocks, mem, timeout)

    def write(self, blocks, *, mem: str = "DRAM", timeout: float | None = None) -> int:
        """WRITE registered memory (file, offset, length, src_addr[, dev]) to the node's exports."""
        return self._run("WRITE", blocks, mem, timeout)

    def stats(self, timeout: float = 10.0) -> dict:
        with self._conn_lock:
            self._connect()
        with self._lock:
            sid = next(self._ids)
            ev, box = threading.Event(), []
            self._stats[sid] = (ev, box)
            try:
                self._send(P.encode(P.STAT, {"id": sid, "md": self.md.value}))
            except NodeUnreachable:
                self._stats.pop(sid, None)
                raise
        ev.wait(timeout)
        with self._lock:
            self._stats.pop(sid, None)
        if not box:
            raise NodeUnreachable(f"no STAT answer from {self.node} within {timeout:.0f} s")
        return box[0]

    # ---- background progress ------------------------------------------------------------------

    def _on_message(self, raw: bytes) -> None:
        try:
            m = P.decode(raw)
        except P.ProtocolError:
            return
        rid = m.header.get("id")
        if m.kind == P.DONE:
            with self._lock:
                p = self._pending.pop(rid, None) or self._abandoned.pop(rid, None)
            if p is None:
                return
            if m.header.get("ok"):
                p._resolve(int(m.header.get("bytes", 0)))
            else:
                p._resolve(
                    error=StorageError(f"request {rid}: {m.header.get('error') or 'failed'}")
                )
            p.settled.set()
        elif m.kind == P.STATR:
            with self._lock:
                w = self._stats.get(rid)
            if w:
                w[1].append(m.header)
                w[0].set()

    def _progress(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            try:
                with self._lock:
                    notifs = self.agent.get_new_notifs()
                for sender, msgs in notifs.items():
                    if sender == self.node:
                        for raw in msgs:
                            self._on_message(raw)
                now = time.monotonic()
                with self._lock:
                    busy = bool(self._pending or self._stats)
                    expired = [p for p in self._pending.values() if now > p.deadline]
                    for p in expired:
                        self._pending.pop(p.req_id, None)
                        self._abandoned[p.req_id] = p
                for p in expired:
                    p._resolve(
                        error=RequestTimeout(
                            f"request {p.req_id}: no answer from {self.node} "
                            f"by its deadline; asked the node to cancel it"
                        )
                    )
                    try:
                        with self._lock:
                            self._send(P.encode(P.CNCL, {"id": p.req_id}))
                    except NodeUnreachable as e:
                        self._drop(str(e))
                if busy and now - self._last_ping >= self.ping_interval:
                    self._last_ping = now
                    try:
                        with self._lock:
                            if self._connected:
                                self._send(P.encode(P.PING, {}))
                    except NodeUnreachable as e:
                        self._drop(f"node {self.node} disconnected ({e})")
                got = any(notifs.values())
                idle = 0.0 if got else min(0.002 if busy else 0.01, idle * 2 if idle else 0.0001)
                time.sleep(idle)
            except Exception as e:  # keep the thread alive; every failure is reported once
                print(f"iuds-client: progress thread: {e!r}", flush=True)
                time.sleep(0.1)

    def close(self) -> None:
        """Fail what is outstanding, tell the node goodbye, withdraw our metadata, deregister."""
        if self._stop.is_set():
            return
        with self._lock:
            if self._connected:
                try:
                    self._send(P.encode(P.BYE, {}))
                except NodeUnreachable:
                    pass
        self._drop("client closed")
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            try:
                if self.node_addr:
                    self.agent.invalidate_local_metadata(*self.node_addr)
                else:
                    self.agent.invalidate_local_metadata()
            except self._errors:
                pass
            for reg in self._regs:
                try:
                    self.agent.deregister_memory(reg)
                except self._errors:
                    pass
            self._regs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
