"""The storage node's side of the protocol: messages in, clients tracked, answers out.

Every message is a NIXL notification (protocol.py). A REQ is checked against the exports and
handed to the pipeline, CNCL fails the request it names, STAT is answered with the node's counters
once the client's metadata is loaded, PING renews the client's lease and BYE forgets it. A client
that stops renewing its lease while it has requests, or whose sends fail, loses its requests and
its cached metadata; one that restarts under the same name loses those of its old instance.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import protocol as P
from .agent import NodeAgent
from .config import NodeConfig, log
from .pipeline import Pipeline
from .state import Active, ClientState, Counters


class Dispatcher:
    def __init__(
        self,
        agent: NodeAgent,
        pipeline: Pipeline,
        config: NodeConfig,
        counters: Counters,
        stats: Callable[[], dict],
    ):
        """stats() is the node's STAT answer."""
        self.agent, self.pipeline, self.config, self.counters = agent, pipeline, config, counters
        self._stats = stats
        self.clients: dict[str, ClientState] = {}
        # STATs waiting for the client's metadata: (client, header, received, fetched)
        self.stat_waiting: list[tuple[str, dict, float, float]] = []

    # ---- messages in ------------------------------------------------------------------------

    def receive(self, notifs: dict, now: float) -> bool:
        """Handle the notifications NIXL returned ({client: [message]}); True if there were any."""
        progressed = False
        for client, msgs in notifs.items():
            for m in msgs:
                self.on_message(client, m, now)
                progressed = True
        return progressed

    def _client(self, name: str, now: float) -> ClientState:
        c = self.clients.get(name)
        if c is None:
            c = self.clients[name] = ClientState(name)
        c.last_seen = now
        return c

    def on_message(self, client: str, raw: bytes, now: float) -> None:
        try:
            m = P.decode(raw)
        except P.ProtocolError as e:
            self._ignore(client, "a message", e)
            return
        c = self._client(client, now)
        if m.kind == P.PING:
            return
        if m.kind == P.BYE:
            # Bookkeeping only: the client withdraws its metadata itself (etcd delete or socket
            # INVL), and NIXL on this node drops it when that arrives.
            self.forget_client(client, "client said goodbye", disconnect=False)
            return
        if m.kind == P.STAT:
            self.stat_waiting.append((client, m.header, now, 0.0))
            return
        if m.kind == P.REQ:
            self._on_request(client, c, m, now)
            return
        if m.kind == P.CNCL:
            rid = m.header.get("id")
            for a in self.pipeline.of_client(client):
                if a.req.req_id == rid:
                    log(f"request {rid} of {client}: cancelled by the client")
                    self.pipeline.fail(a, "cancelled by the client")
                    break
            return
        self._ignore(client, f"a {m.kind!r} message", "only clients' messages are accepted")

    def _ignore(self, client: str, what: str, why) -> None:
        self.counters.bad_messages += 1
        log(f"ignoring {what} from {client}: {why}")

    def _on_request(self, client: str, c: ClientState, m: P.Message, now: float) -> None:
        try:
            req = P.decode_request(m)
        except P.ProtocolError as e:
            self._ignore(client, "a request", e)
            return
        md = P.MdExchange.of(m.header)
        if req.instance and c.instance and req.instance != c.instance:
            # The client restarted under the same name: its old requests and (with etcd) its
            # cached metadata belong to a dead process.
            self.forget_client(
                client,
                f"client restarted (instance {c.instance} -> {req.instance})",
                disconnect=m.header.get("md") == P.MdExchange.ETCD.value,
            )
            c = self._client(client, now)
        c.instance = req.instance or c.instance
        a = Active(client, req, md, now, [], last_progress=now)
        a.error = self.validate(req)
        self.pipeline.add(a)

    def validate(self, req: P.Request) -> str:
        """Why the node refuses the request ("" if it does not)."""
        if req.net_only and not (self.config.allow_net_only and req.op == "READ"):
            # It sends staging buffers as they are, which may hold other clients' bytes.
            return "net_only is a READ benchmark mode the node must allow (--allow-net-only)"
        exports = self.agent.exports
        exps = []
        for f in req.files:
            e = exports.get(f)
            if e is None:
                return f"no export named {f!r} (this node serves {', '.join(sorted(exports)) or 'nothing'})"
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

    # ---- answers out --------------------------------------------------------------------------

    def answer_stats(self, now: float) -> bool:
        progressed = False
        keep = []
        for client, h, received, fetched in self.stat_waiting:
            if self.agent.has_metadata(client):
                self.send(client, P.encode(P.STATR, {"id": h.get("id", 0), **self._stats()}))
                progressed = True
            elif now - received <= self.config.md_timeout:
                md = P.MdExchange.of(h)
                keep.append(
                    (client, h, received, self.agent.fetch_metadata(client, md, now, fetched))
                )
            else:
                log(
                    f"dropping a STAT from {client}: no metadata within {self.config.md_timeout:.0f} s"
                )
        self.stat_waiting = keep
        return progressed

    def send(self, client: str, msg: bytes) -> None:
        """Send to a client; one that cannot be reached is dropped."""
        try:
            self.agent.send(client, msg)
        except self.agent.errors as e:
            self.forget_client(client, f"sending to it failed: {e!r}", disconnect=True)

    # ---- clients that go away -----------------------------------------------------------------

    def forget_client(self, client: str, why: str, disconnect: bool) -> None:
        """Fail the client's requests and forget it; disconnect: drop its metadata too."""
        c = self.clients.pop(client, None)
        mine = self.pipeline.of_client(client)
        if c is None and not mine:
            return
        self.counters.clients_dropped += 1
        log(f"dropping client {client}: {why}; {len(mine)} request(s) aborted")
        for a in mine:
            a.disconnected = True
            self.pipeline.fail(a, why)
        if disconnect:
            self.agent.drop_client(client)

    def sweep(self, now: float) -> None:
        """Drop clients with requests whose lease expired; forget long-idle ones."""
        lease = self.config.client_lease
        for name, c in list(self.clients.items()):
            busy = bool(self.pipeline.of_client(name))
            if busy and now - c.last_seen > lease:
                self.forget_client(
                    name, f"no message for {lease:.0f} s (lease expired)", disconnect=True
                )
            elif not busy and now - c.last_seen > max(60.0, 6 * lease):
                # Idle bookkeeping only; NIXL keeps the metadata until it is invalidated.
                self.clients.pop(name, None)
