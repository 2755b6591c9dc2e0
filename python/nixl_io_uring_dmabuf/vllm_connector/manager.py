"""The scheduler side: vLLM's OffloadingManager over the store's catalog. Every call is a
dictionary operation, except lookup's first check of a block read from storage (with
verify_on_lookup) and the journal appends (tombstones before a slot is reused)."""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from .catalog import Catalog
from .load_store_specs import NixlLoadSpec, NixlStoreSpec

# vLLM 0.34 dropped OffloadingManager.touch(): offering a stored block again marks it used.
_OFFER_IS_USE = not hasattr(OffloadingManager, "touch")


class NixlStorageManager(OffloadingManager):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

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
        out = self.catalog.prepare_store(keys)
        if out is None:
            return None
        accepted, evicted = out
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
        self.catalog.complete_store([bytes(k) for k in keys])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self.catalog.reset()

    def shutdown(self) -> None:
        self.catalog.close()
