"""The storage node: a NIXL agent that serves READ/WRITE requests for its exports to remote agents.

One agent holds two backends: a storage backend (IO_URING_DMABUF, or NIXL's POSIX for
comparison) that moves bytes between the exports and a pool of registered staging buffers, and
UCX, which moves them between those buffers and the clients' memory. Requests and completions
are NIXL notifications (protocol.py); metadata goes through NIXL's etcd support and/or its socket
listener. Nothing here is a transport or a metadata service of its own.

A READ is cut into batches of one buffer each (plan.py); each batch is a storage READ into its
buffer followed by a UCX WRITE into the client's memory, and the buffer returns to the pool when
the WRITE completes. Batches of all requests run concurrently up to the pool's size, so the
storage read of batch k+1 overlaps the network transfer of batch k. A WRITE request runs each
batch the other way round (UCX READ from the client, then storage WRITE).

The node is one thread polling NIXL (the UCX progress thread and the storage backend's own
threads do the work). Failures never stop the node: a request that fails is answered with an
error and its buffers return to the pool once no transfer holds them; a client that disconnects
(UCX reports it) or stops renewing its lease (PING notifications) loses its requests and its
cached metadata; a request whose transfers make no progress for ``stall_timeout`` fails.
"""

from __future__ import annotations

import enum
import itertools
import os
import secrets
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import nixl_runtime, plan
from . import protocol as P
from .exports import Export
from .pool import BufferPool

MiB = 1 << 20


def log(msg: str) -> None:
    print(f"iuds-node: {msg}", file=sys.stderr, flush=True)


def _nixl_errors():
    import nixl._bindings as b

    return tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))


class Stage(enum.Enum):
    """Where a batch is: waiting for a buffer, in its storage or its network transfer, or parked
    after a failure until NIXL lets its transfer go (its buffer is not reused before that)."""

    QUEUED = "queued"
    STORAGE = "storage"
    NET = "net"
    DRAINING = "draining"


@dataclass(frozen=True)
class NodeConfig:
    """What a node serves with (the `serve` options of __main__.py, docs/remote-storage.md)."""

    backend: str = "IO_URING_DMABUF"  # the storage backend (or POSIX, for comparison)
    backend_params: dict = field(default_factory=dict)
    buffers: int = 16  # staging buffers in the pool
    buffer_size: int = 4 * MiB
    pool_mem: str = "DRAM"  # the pool's memory: DRAM or VRAM (on GPU `gpu`)
    gpu: int = 0
    listen_port: int | None = None  # NIXL's socket listener; None: off
    publish_etcd: bool | None = None  # None: when NIXL_ETCD_ENDPOINTS is set
    stall_timeout: float = 30.0
    client_lease: float = 10.0
    md_timeout: float = 10.0
    progress_delay_us: int | None = None  # None: nixl_runtime.progress_delay_us()
    allow_net_only: bool = False  # bench/remote_bench.py only: READs without storage


@dataclass(eq=False)
class Batch:
    req: Active
    pieces: np.ndarray  # M x 6, plan columns
    buf: int = -1
    stage: Stage = Stage.QUEUED
    handle: object = None
    started: float = 0.0


@dataclass(eq=False)
class Active:
    client: str
    req: P.Request
    md: str  # how the client publishes metadata: "etcd" or "p2p"
    received: float
    batches: list  # pending Batch objects, in order
    inflight: list = field(default_factory=list)
    moved: int = 0
    error: str = ""
    admitted: bool = False
    last_progress: float = 0.0
    md_fetched: float = 0.0
    disconnected: bool = False
    forced: bool = False
    rdescs: object = None  # the request's client-side descriptors, for admission


@dataclass
class ClientState:
    name: str
    instance: str = ""
    last_seen: float = 0.0


class StorageNode:
    def __init__(self, name: str, exports: list[Export], config: NodeConfig | None = None):
        c = config or NodeConfig()
        self.name = name
        self.instance = secrets.token_hex(6)
        self.exports = {e.name: e for e in exports}
        self.backend = c.backend
        self.backend_params = dict(c.backend_params)
        self.nbuf, self.buf_size, self.pool_mem, self.gpu = (
            c.buffers,
            c.buffer_size,
            c.pool_mem,
            c.gpu,
        )
        self.listen_port = c.listen_port
        self.publish_etcd = (
            nixl_runtime.etcd_configured() if c.publish_etcd is None else c.publish_etcd
        )
        self.stall_timeout, self.client_lease, self.md_timeout = (
            c.stall_timeout,
            c.client_lease,
            c.md_timeout,
        )
        self.allow_net_only = c.allow_net_only
        self.progress_delay_us = (
            nixl_runtime.progress_delay_us() if c.progress_delay_us is None else c.progress_delay_us
        )
        self.agent = None
        self.pool: BufferPool | None = None
        self.active: list[Active] = []
        self.clients: dict[str, ClientState] = {}
        self.stat_waiting: list[
            tuple[str, dict, float, float]
        ] = []  # (client, header, received, fetched)
        self.counters = dict(
            requests_ok=0,
            requests_failed=0,
            bytes_read=0,
            bytes_written=0,
            clients_dropped=0,
            bad_messages=0,
        )
        self._rr = itertools.count()
        self._errors = ()
        self._last_sweep = 0.0

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        nixl_runtime.use_project_plugins()
        api = nixl_runtime.import_nixl()
        nixl_agent_config = api.nixl_agent_config

        self._errors = _nixl_errors()
        listen = self.listen_port is not None
        cfg = nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=listen,
            listen_port=self.listen_port or 0,
            backends=[],
        )
        self.agent = nixl_runtime.make_agent(self.name, cfg, self.progress_delay_us)
        plugins = self.agent.get_plugin_list()
        for need in ("UCX", self.backend):
            if need not in plugins:
                raise RuntimeError(
                    f"NIXL plugin {need} not found in {os.environ.get('NIXL_PLUGIN_DIR') or 'the wheel'} "
                    f"(available: {', '.join(plugins)}); set NIXL_PLUGIN_DIR to the folder ci/build.sh lays out"
                )
        self.agent.create_backend("UCX", {})
        self.agent.create_backend(self.backend, self.backend_params)
        self.pool = BufferPool(
            self.agent,
            self.nbuf,
            self.buf_size,
            self.pool_mem,
            backends=["UCX", self.backend],
            gpu=self.gpu,
        )
        for e in self.exports.values():
            e.open(self.agent, self.backend)
        if self.publish_etcd:
            self.agent.send_local_metadata()
        served = ", ".join(
            f"{e.name}={e.path} ({e.size} B, {e.seg}{', rw' if e.writable else ''})"
            for e in self.exports.values()
        )
        md = "etcd " + os.environ.get("NIXL_ETCD_ENDPOINTS", "") if self.publish_etcd else "no etcd"
        if self.listen_port is not None:
            md += f", socket port {self.listen_port}"
        log(
            f"{self.name} (instance {self.instance}) serving {served} through {self.backend} with "
            f"{self.nbuf} x {self.buf_size} B {self.pool_mem} buffers; metadata: {md}"
        )

    def close(self) -> None:
        if self.agent is None:
            return
        for a in list(self.active):
            self._fail(a, "storage node shutting down")
        deadline = time.monotonic() + 5
        while self.active and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        if self.publish_etcd:
            try:
                self.agent.invalidate_local_metadata()
            except self._errors as e:
                log(f"removing this node's metadata from etcd failed: {e!r}")
        for e in self.exports.values():
            e.close(self.agent)
        if self.pool:
            self.pool.close()
        self.agent = None

    def serve_forever(self, stop=None) -> None:
        # NIXL offers no completion fd to sleep on, so the loop polls. It backs off while nothing
        # moves (50 us doubling to 1 ms with work in flight, 5 ms idle) so that a small machine's
        # CPUs stay with UCX's progress thread, the kernel's TCP and the storage backend.
        idle = 0.0
        while stop is None or not stop.is_set():
            if self.step():
                idle = 0.0
                continue
            cap = 0.001 if self.active else 0.005
            idle = min(cap, idle * 2 if idle else 0.00005)
            time.sleep(idle)

    # ---- one turn of the loop ---------------------------------------------------------------

    def step(self) -> bool:
        progressed = False
        notifs = self.agent.get_new_notifs()
        now = time.monotonic()
        for client, msgs in notifs.items():
            for m in msgs:
                self._on_message(client, m, now)
                progressed = True
        for a in list(self.active):
            if not a.admitted:
                progressed |= self._admit(a, now)
        progressed |= self._answer_stats(now)
        for a in list(self.active):
            for b in list(a.inflight):
                progressed |= self._poll(b)
        progressed |= self._schedule()
        if now - self._last_sweep > 0.1:
            self._last_sweep = now
            self._sweep(now)
        return progressed

    # ---- messages -----------------------------------------------------------------------------

    def _client(self, name: str, now: float) -> ClientState:
        c = self.clients.get(name)
        if c is None:
            c = self.clients[name] = ClientState(name)
        c.last_seen = now
        return c

    def _on_message(self, client: str, raw: bytes, now: float) -> None:
        try:
            m = P.decode(raw)
        except P.ProtocolError as e:
            self.counters["bad_messages"] += 1
            log(f"ignoring a message from {client}: {e}")
            return
        c = self._client(client, now)
        if m.kind == P.PING:
            return
        if m.kind == P.BYE:
            # Bookkeeping only: the client withdraws its metadata itself (etcd delete or socket
            # INVL), and NIXL on this node drops it when that arrives.
            self._forget_client(client, "client said goodbye", disconnect=False)
            return
        if m.kind == P.STAT:
            self.stat_waiting.append((client, m.header, now, 0.0))
            return
        if m.kind == P.REQ:
            try:
                req = P.decode_request(m)
            except P.ProtocolError as e:
                self.counters["bad_messages"] += 1
                log(f"ignoring a request from {client}: {e}")
                return
            if req.instance and c.instance and req.instance != c.instance:
                # The client restarted under the same name: its old requests and (with etcd) its
                # cached metadata belong to a dead process.
                self._forget_client(
                    client,
                    f"client restarted (instance {c.instance} -> {req.instance})",
                    disconnect=m.header.get("md") == "etcd",
                )
                c = self._client(client, now)
            c.instance = req.instance or c.instance
            a = Active(client, req, m.header.get("md", "etcd"), now, [], last_progress=now)
            err = self._validate(req)
            if err:
                a.error = err
            self.active.append(a)
            return
        if m.kind == P.CNCL:
            rid = m.header.get("id")
            for a in self.active:
                if a.client == client and a.req.req_id == rid:
                    log(f"request {rid} of {client}: cancelled by the client")
                    self._fail(a, "cancelled by the client")
                    break
            return
        self.counters["bad_messages"] += 1
        log(f"ignoring a {m.kind!r} message from {client}: only clients' messages are accepted")

    def _validate(self, req: P.Request) -> str:
        if req.net_only and not (self.allow_net_only and req.op == "READ"):
            # It sends staging buffers as they are, which may hold other clients' bytes.
            return "net_only is a READ benchmark mode the node must allow (--allow-net-only)"
        exps = []
        for f in req.files:
            e = self.exports.get(f)
            if e is None:
                return f"no export named {f!r} (this node serves {', '.join(sorted(self.exports)) or 'nothing'})"
            if req.op == "WRITE" and not e.writable:
                return f"export {f!r} is read-only"
            exps.append(e)
        b = req.blocks
        if int(b[:, 0].max()) >= len(exps):
            return f"a block names file index {int(b[:, 0].max())} but the request lists {len(exps)} files"
        if int(b[:, 2].min()) == 0:
            return f"block {int(np.argmin(b[:, 2]))} has length 0"
        sizes = np.array([e.size for e in exps], dtype=np.uint64)[b[:, 0].astype(np.int64)]
        end = b[:, 1] + b[:, 2]
        bad = np.nonzero((end > sizes) | (end < b[:, 1]))[0]
        if len(bad):
            i = int(bad[0])
            f = exps[int(b[i, 0])]
            return (
                f"block {i} ({f.name} offset {int(b[i, 1])} length {int(b[i, 2])}) ends past the "
                f"export's {f.size} bytes"
            )
        return ""

    # ---- admission: the client's metadata must be loaded before anything moves -------------

    def _remote_descs(self, a: Active, rows: np.ndarray):
        d = np.ascontiguousarray(
            np.stack([rows[:, 3], rows[:, 2], rows[:, 4]], axis=1), dtype=np.uint64
        )
        return self.agent.get_xfer_descs(d, a.req.mem)

    def _have_md(self, client: str, descs=None) -> bool:
        try:
            return self.agent.check_remote_metadata(client, descs)
        except self._errors:
            return False

    def _fetch_md(self, client: str, md: str, now: float, last: float) -> float:
        """Ask etcd for the client's metadata (at most once a second); returns the time asked."""
        if md == "etcd" and self.publish_etcd and now - last >= 1.0:
            try:
                self.agent.fetch_remote_metadata(client)
            except self._errors as e:
                log(f"fetching {client}'s metadata from etcd failed: {e!r}")
            return now
        return last

    def _admit(self, a: Active, now: float) -> bool:
        if a.rdescs is None and not a.error:
            a.rdescs = self._remote_descs(a, a.req.blocks)
        if self._have_md(a.client, None if a.error else a.rdescs):
            a.admitted = True
            a.last_progress = now
            if a.error:
                self._finish(a)
                return True
            exps = [self.exports[f] for f in a.req.files]
            a.batches = [
                Batch(a, p)
                for p in plan.cut_batches(a.req.blocks, self.buf_size, lambda i: exps[i].seg)
            ]
            return True
        a.md_fetched = self._fetch_md(a.client, a.md, now, a.md_fetched)
        if now - a.received > self.md_timeout:
            # Without the client's metadata the node cannot even send it an error.
            log(
                f"dropping request {a.req.req_id} of {a.client}: its metadata ({'etcd' if a.md == 'etcd' else 'socket'}) "
                f"did not arrive within {self.md_timeout:.0f} s"
            )
            self.counters["requests_failed"] += 1
            self.active.remove(a)
            return True
        return False

    def _answer_stats(self, now: float) -> bool:
        progressed = False
        keep = []
        for client, h, received, fetched in self.stat_waiting:
            if self._have_md(client):
                self._send(client, P.encode(P.STATR, {"id": h.get("id", 0), **self.stats()}))
                progressed = True
            elif now - received <= self.md_timeout:
                keep.append(
                    (client, h, received, self._fetch_md(client, h.get("md", "etcd"), now, fetched))
                )
            else:
                log(f"dropping a STAT from {client}: no metadata within {self.md_timeout:.0f} s")
        self.stat_waiting = keep
        return progressed

    def stats(self) -> dict:
        return dict(
            node=self.name,
            instance=self.instance,
            backend=self.backend,
            buffers=self.nbuf,
            buffer_size=self.buf_size,
            free_buffers=self.pool.free if self.pool else 0,
            held_buffers=sum(len(a.inflight) for a in self.active),
            draining=sum(b.stage is Stage.DRAINING for a in self.active for b in a.inflight),
            active_requests=len(self.active),
            clients=sorted(c for c in self.clients),
            **self.counters,
        )

    # ---- the pipeline -----------------------------------------------------------------------

    def _schedule(self) -> bool:
        """Hand free buffers to admitted requests' next batches, one per request in turn."""
        progressed = False
        while self.pool.free:
            ready = [a for a in self.active if a.admitted and not a.error and a.batches]
            if not ready:
                break
            start = next(self._rr) % len(ready)
            for a in ready[start:] + ready[:start]:
                if not self.pool.free:
                    break
                b = a.batches.pop(0)
                b.buf = self.pool.take()
                a.inflight.append(b)
                first = Stage.NET if (a.req.op == "WRITE" or a.req.net_only) else Stage.STORAGE
                self._post(b, first)
                progressed = True
        return progressed

    def _local_descs(self, b: Batch):
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
        return self.agent.get_xfer_descs(np.ascontiguousarray(d, dtype=np.uint64), self.pool.mem)

    def _post(self, b: Batch, stage: Stage) -> None:
        a = b.req
        b.stage, b.started = stage, time.monotonic()
        try:
            local = self._local_descs(b)
            if stage is Stage.STORAGE:
                exps = [self.exports[f] for f in a.req.files]
                p = b.pieces
                fds = np.array([e.fd for e in exps], dtype=np.uint64)[
                    p[:, plan.FILE].astype(np.int64)
                ]
                remote = np.ascontiguousarray(
                    np.stack([p[:, plan.FOFF], p[:, plan.LEN], fds], axis=1), dtype=np.uint64
                )
                seg = exps[int(p[0, plan.FILE])].seg
                h = self.agent.initialize_xfer(
                    a.req.op,
                    local,
                    self.agent.get_xfer_descs(remote, seg),
                    self.name,
                    backends=[self.backend],
                )
            else:
                # READ request: UCX WRITE into the client; WRITE request: UCX READ from it.
                op = "WRITE" if a.req.op == "READ" else "READ"
                h = self.agent.initialize_xfer(
                    op, local, self._remote_descs(a, b.pieces), a.client, backends=["UCX"]
                )
            b.handle = h
            st = self.agent.transfer(h)
        except self._errors as e:
            self._batch_failed(b, f"{stage.value} transfer could not be posted: {e!r}", e)
            return
        if st == "DONE":
            self._stage_done(b)
        elif st != "PROC":
            self._batch_failed(b, f"{stage.value} transfer failed when posted ({st})", None)

    def _poll(self, b: Batch) -> bool:
        if b.handle is None or b not in b.req.inflight:
            return False  # parked by a failure of another batch of its request in this turn
        if b.stage is Stage.DRAINING:
            return self._poll_draining(b)
        try:
            st = self.agent.check_xfer_state(b.handle)
        except self._errors as e:
            self._batch_failed(b, f"{b.stage.value} transfer failed: {e!r}", e)
            return True
        if st == "PROC":
            return False
        if st == "DONE":
            self._stage_done(b)
        else:
            self._batch_failed(b, f"{b.stage.value} transfer failed ({st})", None)
        return True

    def _release(self, b: Batch) -> bool:
        """Release the batch's transfer handle; False if NIXL could not (still in flight)."""
        if b.handle is None:
            return True
        try:
            self.agent.release_xfer_handle(b.handle)
        except self._errors:
            return False
        b.handle = None
        return True

    def _stage_done(self, b: Batch) -> None:
        a = b.req
        self._release(b)
        a.last_progress = time.monotonic()
        nxt = None
        if not a.error and not a.req.net_only:
            if b.stage is Stage.STORAGE and a.req.op == "READ":
                nxt = Stage.NET
            elif b.stage is Stage.NET and a.req.op == "WRITE":
                nxt = Stage.STORAGE
        if nxt:
            self._post(b, nxt)
            return
        a.inflight.remove(b)
        self.pool.give(b.buf)
        if not a.error:
            a.moved += int(b.pieces[:, plan.LEN].sum())
        self._maybe_finish(a)

    def _batch_failed(self, b: Batch, why: str, exc) -> None:
        a = b.req
        disconnected = exc is not None and type(exc).__name__ == "nixlRemoteDisconnectError"
        log(f"request {a.req.req_id} of {a.client}: {why}")
        self._park(b)
        if disconnected and b.stage is Stage.NET:
            # The client is gone: all its requests end here, and its metadata goes.
            self._forget_client(a.client, "UCX reported it disconnected", disconnect=True)
        else:
            self._fail(a, why)

    def _park(self, b: Batch) -> None:
        """Stop a batch of a failed request. Its buffer returns to the pool at once if NIXL
        releases (cancels) the transfer, else the batch stays in the request as "draining" until
        the transfer ends, so no buffer is reused while a transfer may still touch it and the
        request's answer never precedes a late write into the client's memory."""
        a = b.req
        if self._release(b):
            if b in a.inflight:
                a.inflight.remove(b)
            self.pool.give(b.buf)
        else:
            b.stage = Stage.DRAINING

    def _poll_draining(self, b: Batch) -> bool:
        try:
            st = self.agent.check_xfer_state(b.handle)
        except self._errors:
            st = "ERR"
        if st == "PROC" or not self._release(b):
            return False
        a = b.req
        a.inflight.remove(b)
        self.pool.give(b.buf)
        self._maybe_finish(a)
        return True

    def _fail(self, a: Active, why: str) -> None:
        if not a.error:
            a.error = why
            a.last_progress = time.monotonic()
        a.batches = []
        for b in list(a.inflight):
            if b.stage is not Stage.DRAINING:
                self._park(b)
        self._maybe_finish(a)

    def _maybe_finish(self, a: Active) -> None:
        if not a.inflight and (a.error or not a.batches):
            self._finish(a)

    def _finish(self, a: Active) -> None:
        if a not in self.active:
            return
        self.active.remove(a)
        ok = not a.error
        if ok:
            self.counters["requests_ok"] += 1
            self.counters["bytes_read" if a.req.op == "READ" else "bytes_written"] += a.moved
        else:
            self.counters["requests_failed"] += 1
        if not a.disconnected:
            self._send(a.client, P.done(a.req.req_id, ok, a.moved, a.error, self.instance))

    def _send(self, client: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(client, msg)
        except self._errors as e:
            self._forget_client(client, f"sending to it failed: {e!r}", disconnect=True)

    # ---- clients that go away -----------------------------------------------------------------

    def _forget_client(self, client: str, why: str, disconnect: bool) -> None:
        c = self.clients.pop(client, None)
        mine = [a for a in self.active if a.client == client]
        if c is None and not mine:
            return
        self.counters["clients_dropped"] += 1
        log(f"dropping client {client}: {why}; {len(mine)} request(s) aborted")
        for a in mine:
            a.disconnected = True
            self._fail(a, why)
        if disconnect:
            try:
                self.agent.remove_remote_agent(client)
            except self._errors:
                pass  # never loaded or already invalidated (etcd watch, socket INVL)

    def _sweep(self, now: float) -> None:
        for a in list(self.active):
            if a.admitted and not a.error and now - a.last_progress > self.stall_timeout:
                log(
                    f"request {a.req.req_id} of {a.client}: no transfer finished for {self.stall_timeout:.0f} s"
                )
                self._fail(a, f"no progress for {self.stall_timeout:.0f} s")
            elif a.error and not a.forced and now - a.last_progress > self.stall_timeout:
                # Transfers NIXL could not cancel are still in flight: cut the connection so
                # UCX fails them and the buffers come back.
                log(
                    f"request {a.req.req_id} of {a.client}: {len(a.inflight)} transfer(s) still in flight "
                    f"{self.stall_timeout:.0f} s after it failed; disconnecting the client"
                )
                a.forced = True
                try:
                    self.agent.remove_remote_agent(a.client)
                except self._errors:
                    pass
        for name, c in list(self.clients.items()):
            busy = any(a.client == name for a in self.active)
            if busy and now - c.last_seen > self.client_lease:
                self._forget_client(
                    name,
                    f"no message for {self.client_lease:.0f} s (lease expired)",
                    disconnect=True,
                )
            elif not busy and now - c.last_seen > max(60.0, 6 * self.client_lease):
                # Idle bookkeeping only; NIXL keeps the metadata until it is invalidated.
                self.clients.pop(name, None)
