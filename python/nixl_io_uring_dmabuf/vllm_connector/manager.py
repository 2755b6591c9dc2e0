"""The scheduler side: vLLM's OffloadingManager over the store's catalog. Every call is a
dictionary operation, except lookup's first check of a block read from storage (with
verify_on_lookup) and the journal appends (tombstones before a slot is reused).

KV events (only when the engine's kv_events_config enables them): the catalog reports each
change of the served set, and take_events hands vLLM one OffloadingEvent (medium STORAGE) per
change; vLLM's offloading scheduler turns them into BlockStored / BlockRemoved. Stored: the
blocks the replay found (in the first batch after start-up), and each block once every rank
committed it (complete_store, or earlier when a full store adopts it). Removed: evicted,
dropped as damaged (on lookup or load), or dropped by reset_cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from .backpressure import StoreQueue
from .catalog import Catalog
from .load_store_specs import NixlLoadSpec, NixlStoreSpec
from .metrics import QueueStats

# vLLM 0.34 dropped OffloadingManager.touch(): offering a stored block again marks it used.
_OFFER_IS_USE = not hasattr(OffloadingManager, "touch")

# vLLM 0.34's stored events carry the storing request's context (self_describing_kv_events
# builds the payload from it when its tracker has none); 0.32/0.33's OffloadingEvent has no
# such field.
_EVENT_HAS_REQ_CONTEXT = "req_context" in {f.name for f in dataclasses.fields(OffloadingEvent)}


class NixlStorageManager(OffloadingManager):
    def __init__(self, catalog: Catalog, events: bool = False, queue: StoreQueue | None = None):
        """events: collect KV events (the engine's kv_events_config.enable_kv_cache_events).
        Without it nothing is collected: vLLM then never drains take_events. queue: the
        stores' backpressure (backpressure.py); None: no limit."""
        self.catalog = catalog
        self.queue = queue or StoreQueue(0, catalog.geo.rank_block_bytes)
        self._queue_stats = QueueStats(self.queue)
        self._events: list[OffloadingEvent] | None = None
        self._ctx: ReqContext | None = None  # of the complete_store call in progress
        if events:
            self._events = []
            catalog.notify = self._note
            found = catalog.committed()  # what earlier engines left is served too
            if found:
                self._note(False, found)

    def _note(self, removed: bool, keys: list[bytes]) -> None:
        kw = {}
        if not removed:
            # This tier reports its removals: vLLM's tracker then follows the blocks'
            # STORAGE residency (self_describing_kv_events).
            kw["removal_expected"] = True
            if _EVENT_HAS_REQ_CONTEXT and self._ctx is not None:
                kw["req_context"] = self._ctx
        self._events.append(
            OffloadingEvent(
                keys=keys,  # an OffloadKey is the key's bytes
                medium=Medium.STORAGE,
                removed=removed,
                **kw,
            )
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.catalog.lookup(bytes(key)) else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> NixlLoadSpec:
        items = self.catalog.prepare_load([bytes(k) for k in keys])
        ranks = range(self.catalog.geo.world_size)
        return NixlLoadSpec(
            [it.slot for it in items],
            [it.gen for it in items],
            {r: [it.sums[r] for it in items] for r in ranks},
        )

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self.catalog.touch([bytes(k) for k in keys])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        self.catalog.complete_load([bytes(k) for k in keys])

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = [bytes(k) for k in keys]
        if _OFFER_IS_USE:
            self.catalog.touch(keys)
        keys = self.queue.admit(keys, lambda k: self.catalog.slot_of(k) is not None, req_context)
        out = self.catalog.prepare_store(keys)
        if out is None:
            return None
        accepted, evicted = out
        self.queue.started(k for k, _, _ in accepted)
        spec = NixlStoreSpec(
            [k for k, _, _ in accepted], [s for _, s, _ in accepted], [g for _, _, g in accepted]
        )
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k, _, _ in accepted],
            store_spec=spec,
            evicted_keys=[OffloadKey(k) for k in evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ):
        # Whether a block is kept is decided by the workers' commit records, not by `success`
        # (vLLM 0.32/0.33 always pass True; 0.34 passes False when a rank reported its store
        # failed, and that rank then wrote no commit): a block some rank did not commit is
        # dropped.
        self._ctx = req_context
        self.queue.finished(bytes(k) for k in keys)
        try:
            self.catalog.complete_store([bytes(k) for k in keys])
        finally:
            self._ctx = None

    def get_stats(self):
        return self._queue_stats.take()  # backpressure counters (metrics.py)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self.catalog.reset()

    def shutdown(self) -> None:
        self.catalog.close()
