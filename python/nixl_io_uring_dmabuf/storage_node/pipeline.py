"""The request pipeline of the storage node: admission, batches through storage and network,
failures, and the answer.

A request is admitted once the client's metadata covers its memory; it is then cut into batches
of one pool buffer each (plan.py). A READ batch is a storage READ into its buffer followed by a
UCX WRITE into the client's memory, and the buffer returns to the pool when the WRITE completes;
a WRITE batch runs the other way round (UCX READ from the client, then storage WRITE). Batches of
all requests run concurrently up to the pool's size, handed out one per request in turn, so the
storage read of batch k+1 overlaps the network transfer of batch k.

A request that fails (a transfer error, a cancel, its client gone, ``stall_timeout`` without
progress) is answered with the error once no transfer holds its buffers; a transfer NIXL cannot
cancel keeps its buffer until it ends (Stage.DRAINING).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from . import plan
from . import protocol as P
from .agent import NodeAgent, XferState
from .config import NodeConfig, log
from .state import Active, Batch, Counters, Stage


class Pipeline:
    def __init__(
        self,
        agent: NodeAgent,
        config: NodeConfig,
        counters: Counters,
        instance: str,
        send: Callable[[str, bytes], None],
        client_gone: Callable[[str, str], None],
    ):
        """send(client, message) answers a client; client_gone(client, why) drops a client that
        UCX reported disconnected, with all its requests."""
        self.agent, self.config, self.counters, self.instance = agent, config, counters, instance
        self._send, self._client_gone = send, client_gone
        self.active: list[Active] = []
        self._rr = itertools.count()

    def add(self, a: Active) -> None:
        self.active.append(a)

    def of_client(self, client: str) -> list[Active]:
        return [a for a in self.active if a.client == client]

    def held_buffers(self) -> int:
        return sum(len(a.inflight) for a in self.active)

    def draining(self) -> int:
        return sum(b.stage is Stage.DRAINING for a in self.active for b in a.inflight)

    # ---- admission: the client's metadata must be loaded before anything moves -------------

    def admit_waiting(self, now: float) -> bool:
        progressed = False
        for a in list(self.active):
            if not a.admitted:
                progressed |= self._admit(a, now)
        return progressed

    def _admit(self, a: Active, now: float) -> bool:
        if a.rdescs is None and not a.error:
            a.rdescs = self.agent.client_descs(a, a.req.blocks)
        if self.agent.has_metadata(a.client, None if a.error else a.rdescs):
            a.admitted = True
            a.last_progress = now
            if a.error:
                self._finish(a)
                return True
            exps = [self.agent.exports[f] for f in a.req.files]
            a.batches = [
                Batch(a, p)
                for p in plan.cut_batches(
                    a.req.blocks, self.config.buffer_size, lambda i: exps[i].seg
                )
            ]
            return True
        a.md_fetched = self.agent.fetch_metadata(a.client, a.md, now, a.md_fetched)
        if now - a.received > self.config.md_timeout:
            # Without the client's metadata the node cannot even send it an error.
            how = "etcd" if a.md is P.MdExchange.ETCD else "socket"
            log(
                f"dropping request {a.req.req_id} of {a.client}: its metadata ({how}) "
                f"did not arrive within {self.config.md_timeout:.0f} s"
            )
            self.counters.requests_failed += 1
            self.active.remove(a)
            return True
        return False

    # ---- batches through storage and network --------------------------------------------------

    def schedule(self) -> bool:
        """Hand free buffers to admitted requests' next batches, one per request in turn."""
        pool = self.agent.pool
        progressed = False
        while pool.free:
            ready = [a for a in self.active if a.admitted and not a.error and a.batches]
            if not ready:
                break
            start = next(self._rr) % len(ready)
            for a in ready[start:] + ready[:start]:
                if not pool.free:
                    break
                b = a.batches.pop(0)
                b.buf = pool.take()
                a.inflight.append(b)
                self._post(b, a.first_stage())
                progressed = True
        return progressed

    def _post(self, b: Batch, stage: Stage) -> None:
        b.stage, b.started = stage, time.monotonic()
        try:
            b.handle = self.agent.prepare(b, stage)
            st = self.agent.transfer(b.handle)
        except self.agent.errors as e:
            self._batch_failed(b, f"{stage.value} transfer could not be posted: {e!r}", e)
            return
        if st is XferState.DONE:
            self._stage_done(b)
        elif st is not XferState.PROC:
            self._batch_failed(b, f"{stage.value} transfer failed when posted ({st.value})", None)

    def poll_inflight(self) -> bool:
        progressed = False
        for a in list(self.active):
            for b in list(a.inflight):
                progressed |= self._poll(b)
        return progressed

    def _poll(self, b: Batch) -> bool:
        if b.handle is None or b not in b.req.inflight:
            return False  # parked by a failure of another batch of its request in this turn
        if b.stage is Stage.DRAINING:
            return self._poll_draining(b)
        try:
            st = self.agent.state(b.handle)
        except self.agent.errors as e:
            self._batch_failed(b, f"{b.stage.value} transfer failed: {e!r}", e)
            return True
        if st is XferState.PROC:
            return False
        if st is XferState.DONE:
            self._stage_done(b)
        else:
            self._batch_failed(b, f"{b.stage.value} transfer failed ({st.value})", None)
        return True

    def _release(self, b: Batch) -> bool:
        """Release the batch's transfer handle; False if NIXL could not (still in flight)."""
        if b.handle is None:
            return True
        if not self.agent.release(b.handle):
            return False
        b.handle = None
        return True

    def _stage_done(self, b: Batch) -> None:
        a = b.req
        self._release(b)
        a.last_progress = time.monotonic()
        nxt = a.next_stage(b.stage)
        if nxt:
            self._post(b, nxt)
            return
        a.inflight.remove(b)
        self.agent.pool.give(b.buf)
        if not a.error:
            a.moved += b.nbytes
        self._maybe_finish(a)

    # ---- failures -----------------------------------------------------------------------------

    def _batch_failed(self, b: Batch, why: str, exc) -> None:
        a = b.req
        disconnected = exc is not None and type(exc).__name__ == "nixlRemoteDisconnectError"
        log(f"request {a.req.req_id} of {a.client}: {why}")
        self._park(b)
        if disconnected and b.stage is Stage.NET:
            # The client is gone: all its requests end here, and its metadata goes.
            self._client_gone(a.client, "UCX reported it disconnected")
        else:
            self.fail(a, why)

    def _park(self, b: Batch) -> None:
        """Stop a batch of a failed request. Its buffer returns to the pool at once if NIXL
        releases (cancels) the transfer, else the batch stays in the request as "draining" until
        the transfer ends, so no buffer is reused while a transfer may still touch it and the
        request's answer never precedes a late write into the client's memory."""
        a = b.req
        if self._release(b):
            if b in a.inflight:
                a.inflight.remove(b)
            self.agent.pool.give(b.buf)
        else:
            b.stage = Stage.DRAINING

    def _poll_draining(self, b: Batch) -> bool:
        try:
            st = self.agent.state(b.handle)
        except self.agent.errors:
            st = XferState.ERR
        if st is XferState.PROC or not self._release(b):
            return False
        a = b.req
        a.inflight.remove(b)
        self.agent.pool.give(b.buf)
        self._maybe_finish(a)
        return True

    def fail(self, a: Active, why: str) -> None:
        """End a request with an error: its queued batches are dropped, its transfers parked;
        the answer goes once none holds a buffer."""
        if not a.error:
            a.error = why
            a.last_progress = time.monotonic()
        a.batches = []
        for b in list(a.inflight):
            if b.stage is not Stage.DRAINING:
                self._park(b)
        self._maybe_finish(a)

    def sweep(self, now: float) -> None:
        """Fail requests whose transfers made no progress for stall_timeout; disconnect the
        client of a failed request whose transfers are still in flight that long after."""
        timeout = self.config.stall_timeout
        for a in list(self.active):
            if a.admitted and not a.error and now - a.last_progress > timeout:
                log(
                    f"request {a.req.req_id} of {a.client}: no transfer finished for {timeout:.0f} s"
                )
                self.fail(a, f"no progress for {timeout:.0f} s")
            elif a.error and not a.forced and now - a.last_progress > timeout:
                # Transfers NIXL could not cancel are still in flight: cut the connection so
                # UCX fails them and the buffers come back.
                log(
                    f"request {a.req.req_id} of {a.client}: {len(a.inflight)} transfer(s) still in flight "
                    f"{timeout:.0f} s after it failed; disconnecting the client"
                )
                a.forced = True
                self.agent.drop_client(a.client)

    # ---- the answer ---------------------------------------------------------------------------

    def _maybe_finish(self, a: Active) -> None:
        if not a.inflight and (a.error or not a.batches):
            self._finish(a)

    def _finish(self, a: Active) -> None:
        if a not in self.active:
            return
        self.active.remove(a)
        ok = not a.error
        if ok:
            self.counters.requests_ok += 1
            if a.req.op == "READ":
                self.counters.bytes_read += a.moved
            else:
                self.counters.bytes_written += a.moved
        else:
            self.counters.requests_failed += 1
        if not a.disconnected:
            self._send(a.client, P.done(a.req.req_id, ok, a.moved, a.error, self.instance))
