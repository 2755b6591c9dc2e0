"""Backpressure for stores: when storage is slower than the engine offers blocks, the excess is
dropped and counted instead of queued without bound.

A store is *in flight* from the manager's prepare_store to its complete_store (vLLM calls them
in the scheduler; the worker's I/O happens in between). The queue measures how fast storage
finishes stores (blocks per second of time with stores in flight, a decayed average over the
completions), and admits a new block only while the blocks in flight, that one included, take
at most `max_seconds` at that rate. Before the first completion the rate is unknown: blocks are
admitted while the oldest store in flight is younger than `max_seconds`. A block is never
refused while nothing is in flight, so the rate keeps being measured.

A dropped block is one vLLM never stores: prepare_store leaves it out of keys_to_store, and
vLLM moves past it (offloading/scheduler.py advances the request's stored index). The rest of
that request's blocks are dropped too: a prefix lookup stops at its first missing block, so a
later block would take storage time and never be served. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

# Weight kept by the measured rate's sums at each completion: about the last ten completions
# count, so the rate follows storage that slows down or recovers within seconds.
_DECAY = 0.9


class _Dropped:
    """Marks a request (in its ReqContext state) whose stores were dropped."""


class StoreQueue:
    """The scheduler's view of the stores in flight; see the module doc. max_seconds <= 0: no
    limit (every block is admitted). block_bytes: bytes of one block on all ranks (a key)."""

    def __init__(
        self,
        max_seconds: float,
        block_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        log_every_s: float = 10.0,
    ):
        self.max_seconds = float(max_seconds)
        self.block_bytes = int(block_bytes)
        self._clock = clock
        self._log_every = log_every_s
        self._since: dict[bytes, float] = {}  # key in flight -> when it was admitted
        self._mark = clock()  # time up to which busy time is counted
        self._pending = 0.0  # seconds with stores in flight since the last completion
        self._done = 0.0  # decayed blocks completed ...
        self._busy = 0.0  # ... over decayed seconds with stores in flight
        self.admitted = 0
        self.dropped = 0
        self.peak_in_flight = 0
        self._logged_at = clock()
        self._dropped_logged = 0

    # ---- what the manager calls -------------------------------------------------------------
    def admit(self, keys: list[bytes], held: Callable[[bytes], bool], req_state=None) -> list:
        """The keys the manager may offer the store now, in their order: all that the store
        holds already (`held`) or has in flight, and the new ones while there is room; the
        other new ones are dropped and counted. req_state: the request's ReqContext (its
        set_state/get_state), so a request whose blocks were dropped stores no later ones."""
        if self.max_seconds <= 0:
            return keys
        now = self._clock()
        broken = req_state is not None and req_state.get_state(_Dropped) is not None
        room = 0 if broken else self._room(now)
        out, dropped = [], 0
        for k in keys:
            if k in self._since or held(k):
                out.append(k)
            elif room > 0:
                out.append(k)
                room -= 1
            else:
                dropped += 1
        if dropped:
            self.dropped += dropped
            if req_state is not None and not broken:
                req_state.set_state(_Dropped())
            self._log(now)
        return out

    def started(self, keys: Iterable[bytes]) -> None:
        """The keys prepare_store accepted (their stores are now in flight)."""
        now = self._clock()
        self._count_busy(now)
        for k in keys:
            self._since.setdefault(k, now)
            self.admitted += 1
        self.peak_in_flight = max(self.peak_in_flight, len(self._since))

    def finished(self, keys: Iterable[bytes]) -> None:
        """complete_store's keys: their stores are over (kept or not)."""
        now = self._clock()
        self._count_busy(now)
        n = sum(self._since.pop(k, None) is not None for k in keys)
        if n:
            self._done = self._done * _DECAY + n
            self._busy = self._busy * _DECAY + self._pending
            self._pending = 0.0

    # ---- state ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._since)

    def rate(self) -> float | None:
        """Blocks per second storage finished lately; None before any was measured."""
        return self._done / self._busy if self._busy > 0 and self._done > 0 else None

    def _count_busy(self, now: float) -> None:
        if self._since:
            self._pending += max(0.0, now - self._mark)
        self._mark = now

    def _room(self, now: float) -> int | float:
        """New blocks that may be admitted now."""
        if not self._since:
            return float("inf") if self.rate() is None else max(1, self._cap())
        if self.rate() is None:
            oldest = min(self._since.values())
            return float("inf") if now - oldest <= self.max_seconds else 0
        return max(0, self._cap() - len(self._since))

    def _cap(self) -> int:
        return int(self.rate() * self.max_seconds)

    def _log(self, now: float) -> None:
        """One line per interval while blocks are dropped."""
        if now - self._logged_at < self._log_every and self._dropped_logged:
            return
        rate = self.rate()
        logger.warning(
            "KV store: storage is behind; %d block(s) (%.1f MiB) dropped in the last %.0f s "
            "(%d in all), %d in flight, storage finishes %s",
            self.dropped - self._dropped_logged,
            (self.dropped - self._dropped_logged) * self.block_bytes / 2**20,
            now - self._logged_at,
            self.dropped,
            len(self._since),
            "?" if rate is None else f"{rate:.1f} blocks/s",
        )
        self._logged_at, self._dropped_logged = now, self.dropped
