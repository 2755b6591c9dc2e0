"""The storage node: a NIXL agent that serves READ/WRITE requests for its exports to remote agents.

Requests and completions are NIXL notifications (protocol.py); metadata goes through NIXL's etcd
support and/or its socket listener. Nothing here is a transport or a metadata service of its own.
StorageNode puts the node together from parts of one job each:

- config.py: NodeConfig, what the node serves with (the `serve` options);
- agent.py: NodeAgent, the NIXL agent with the storage backend and UCX, the registered pool and
  exports, metadata, and the transfers of one batch;
- dispatch.py: Dispatcher, messages in (REQ, CNCL, STAT, PING, BYE), clients and their leases;
- pipeline.py: Pipeline, requests from admission through batches of storage and network
  transfers to their answer;
- state.py: what these keep (requests, batches and their Stage, clients, counters).

The node is one thread polling NIXL (the UCX progress thread and the storage backend's own
threads do the work); this module holds its life cycle and the loop. Failures never stop the
node: a request that fails is answered with an error and its buffers return to the pool once no
transfer holds them; a client that disconnects (UCX reports it) or stops renewing its lease
(PING notifications) loses its requests and its cached metadata; a request whose transfers make
no progress for ``stall_timeout`` fails.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict

from .agent import NodeAgent
from .config import NodeConfig, log
from .dispatch import Dispatcher
from .exports import Export
from .pipeline import Pipeline
from .state import Counters

__all__ = ["NodeConfig", "StorageNode"]


class StorageNode:
    def __init__(self, name: str, exports: list[Export], config: NodeConfig | None = None):
        self.name = name
        self.instance = secrets.token_hex(6)
        self.config = (config or NodeConfig()).resolved()
        self.counters = Counters()
        self.agent = NodeAgent(name, exports, self.config)
        self.pipeline = Pipeline(
            self.agent,
            self.config,
            self.counters,
            self.instance,
            send=self._send,
            client_gone=self._client_gone,
        )
        self.dispatcher = Dispatcher(
            self.agent, self.pipeline, self.config, self.counters, self.stats
        )
        self._last_sweep = 0.0

    def _send(self, client: str, msg: bytes) -> None:
        self.dispatcher.send(client, msg)

    def _client_gone(self, client: str, why: str) -> None:
        self.dispatcher.forget_client(client, why, disconnect=True)

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.agent.start()
        log(f"{self.name} (instance {self.instance}) serving {self.agent.describe()}")

    def close(self) -> None:
        if not self.agent.started:
            return
        for a in list(self.pipeline.active):
            self.pipeline.fail(a, "storage node shutting down")
        deadline = time.monotonic() + 5
        while self.pipeline.active and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        self.agent.close()

    def serve_forever(self, stop=None) -> None:
        # NIXL offers no completion fd to sleep on, so the loop polls. It backs off while nothing
        # moves (50 us doubling to 1 ms with work in flight, 5 ms idle) so that a small machine's
        # CPUs stay with UCX's progress thread, the kernel's TCP and the storage backend.
        idle = 0.0
        while stop is None or not stop.is_set():
            if self.step():
                idle = 0.0
                continue
            cap = 0.001 if self.pipeline.active else 0.005
            idle = min(cap, idle * 2 if idle else 0.00005)
            time.sleep(idle)

    # ---- one turn of the loop ---------------------------------------------------------------

    def step(self) -> bool:
        notifs = self.agent.notifications()
        now = time.monotonic()
        progressed = self.dispatcher.receive(notifs, now)
        progressed |= self.pipeline.admit_waiting(now)
        progressed |= self.dispatcher.answer_stats(now)
        progressed |= self.pipeline.poll_inflight()
        progressed |= self.pipeline.schedule()
        if now - self._last_sweep > 0.1:
            self._last_sweep = now
            self.pipeline.sweep(now)
            self.dispatcher.sweep(now)
        return progressed

    def stats(self) -> dict:
        c = self.config
        return dict(
            node=self.name,
            instance=self.instance,
            backend=c.backend,
            buffers=c.buffers,
            buffer_size=c.buffer_size,
            free_buffers=self.agent.pool.free if self.agent.pool else 0,
            held_buffers=self.pipeline.held_buffers(),
            draining=self.pipeline.draining(),
            active_requests=len(self.pipeline.active),
            clients=sorted(self.dispatcher.clients),
            **asdict(self.counters),
        )
