"""One engine's view of a store that any number of engines share: which block (by vLLM's offload
key) is served from which slot, this engine's LRU order and pins, slot allocation and eviction.
No vLLM and no NIXL in here.

The shared state lives only in the journals (slot_table.py says how records make it): this
catalog follows them from where it last read (`refresh`: one open, fstat and read of each new
tail), at start-up from their beginning, then before each allocation, at each completion, and
at lookup at most every REFRESH_S. So every engine serves what any engine committed.

Allocation (prepare_store) runs under manager.log's lock: read the journals to their end, take
free slots, then slots of engines that died mid-store, then this engine's least recently used
blocks that it does not load and that the call does not name; append an ALLOC per slot; only
then does the store spec leave the scheduler. Another engine may evict a block this engine is
about to load: the load then reads another block's bytes (or a torn mix), which the worker's
check after every load finds (the block's checksum and generation are in the load spec), and
vLLM recomputes the request. So no lease across engines is needed for correctness; the cost of
that race is one recompute.

A journal that cannot be written (full file system, EIO) never raises into vLLM: a store call
gives up (None: vLLM offers the blocks again at its next step) with nothing changed; a block
dropped for another reason (damage, a store not every rank committed, reset) leaves the index
at once, but its slot stays out of use until its TOMB is written, which is retried with every
later journal write. One log line when writing starts failing, one when it works again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable

from . import journal, store_version
from . import layout as L
from .locks import Liveness
from .slot_check import SlotChecker
from .slot_table import SlotTable

logger = logging.getLogger(__name__)

REFRESH_S = 0.01  # lookups read the journals at most this often
_GONE_KEPT = 65536  # blocks left the index, still loadable by a lookup that saw them


@dataclasses.dataclass
class Entry:
    key: bytes
    slot: int
    gen: int
    pins: int = 0
    verified: bool = False
    sums: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoadItem:
    key: bytes
    slot: int
    gen: int
    sums: dict[int, tuple[int, ...]]  # rank -> checksum per sub-block


class Catalog:
    def __init__(
        self,
        root: str,
        geometry: L.Geometry,
        manifest_extra: dict | None = None,
        durable: bool = False,
        verify_on_lookup: bool = True,
    ):
        self.root, self.geo, self.verify_on_lookup = root, geometry, verify_on_lookup
        what = "vLLM KV store"
        self._lock_fd = store_version.open_store(
            root, geometry.manifest(**(manifest_extra or {})), what
        )
        try:
            self._live = Liveness(root)
            self._log = journal.Appender(L.manager_log(root), durable)
        except OSError as e:
            os.close(self._lock_fd)
            raise L.StoreUnavailable(f"{what}: cannot open {L.explain(e, root)}") from None
        W = geometry.world_size
        self._mreader = journal.Reader(L.manager_log(root))
        self._readers = [journal.Reader(L.commits_log(root, r, W)) for r in range(W)]
        self.table = SlotTable(geometry.num_slots, W)
        self._check = SlotChecker(root, geometry)
        self._ready: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # LRU
        self._gone: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._storing: dict[bytes, Entry] = {}  # this engine's allocations in flight
        self._owed: list[tuple[int, int]] = []  # dropped, TOMB not written yet
        self._log_failing = False
        self._refreshed = 0.0
        self.stats = collections.Counter()
        # Told of every change of the served set (vLLM's KV events, manager.py):
        # notify(removed, keys) when blocks become loadable (False) or leave the index (True),
        # whichever engine stored or evicted them. The replay's blocks are not reported here
        # (committed() lists them).
        self.notify: Callable[[bool, list[bytes]], None] | None = None
        self._replay()

    # ---- start-up ------------------------------------------------------------------------
    def _replay(self) -> None:
        self.refresh()
        for reader in [self._mreader, *self._readers]:
            if reader.failing is not None:  # its generations are unknown: cannot start
                self.close()
                raise L.StoreUnavailable(
                    "vLLM KV store: cannot read " + L.explain(reader.failing, reader.path)
                )
            if reader.tail:
                logger.warning(
                    "KV store: %s ends in %d byte(s) that are no whole record (a torn append, "
                    "or one being written); ignored",
                    reader.path,
                    reader.tail,
                )
        logger.info(
            "KV store %s: %d committed block(s) found, %d of %d slots free",
            self.root,
            len(self._ready),
            len(self.table.free),
            self.geo.num_slots,
        )

    # ---- scheduler operations ------------------------------------------------------------
    def lookup(self, key: bytes) -> bool:
        if time.monotonic() - self._refreshed > REFRESH_S:
            self.refresh()
        e = self._ready.get(key)
        if e is None:
            return False
        if self.verify_on_lookup and not e.verified:
            problem = self._check.problem(e.slot, e.sums)
            if problem:
                logger.warning(
                    "KV store: block in slot %d (gen %d) fails its check (%s); "
                    "dropped, it is a miss",
                    e.slot,
                    e.gen,
                    problem,
                )
                self.stats["damaged"] += 1
                self._drop([e])
                self._tomb([(e.slot, e.gen)])
                return False
            e.verified = True
        return True

    def prepare_store(
        self, keys: Iterable[bytes]
    ) -> tuple[list[tuple[bytes, int, int]], list[bytes]] | None:
        """Slots for the keys no engine stores or has stored: [(key, slot, gen)], evicted keys.
        All or nothing, as vLLM's own CPU manager: None (nothing changed) when free, reclaimable
        and evictable slots do not hold them all, or when the ALLOC records cannot be written;
        vLLM then offers them again next step."""
        keys = list(keys)
        if not self._new(keys):
            return [], []
        try:
            with self._log.locked():
                self.refresh()
                todo = self._new(keys)
                slots, victims = self._find_slots(len(todo), set(keys))
                if slots is None:
                    return None
                gen = self.table.max_gen + 1
                picks = [(k, s, gen + i) for i, (k, s) in enumerate(zip(todo, slots))]
                records = [journal.tomb(s, g) for s, g in self._owed]
                records += [journal.alloc(k, s, g, self._live.owner) for k, s, g in picks]
                if not self._append(records):
                    self.stats["store_refused"] += 1  # nothing changed; vLLM retries
                    return None
                self._owed = []
                self.refresh()  # our own records: the victims leave the index
        except OSError as err:  # the lock itself failed (a file system without locks)
            self._note_failure(err)
            self.stats["store_refused"] += 1
            return None
        for k, s, g in picks:
            self._storing[k] = Entry(k, s, g)
        self.stats["evicted"] += len(victims)
        return picks, victims

    def complete_store(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys whose stores every rank committed; the others' slots are given back."""
        self.refresh()
        done, tombs = [], []
        for k in keys:
            e = self._storing.pop(k, None)
            slot = self.table.slots.get(e.slot) if e is not None else None
            if slot is not None and slot.gen == e.gen and not slot.ready and not slot.dead:
                logger.warning(
                    "KV store: store of slot %d (gen %d) was not committed by every "
                    "rank (%d of %d); the block is not kept",
                    e.slot,
                    e.gen,
                    len(slot.commits),
                    self.geo.world_size,
                )
                self.stats["store_failed"] += 1
                tombs.append((e.slot, e.gen))
            elif k in self._ready:
                done.append(k)
        if tombs or self._owed:
            self._tomb(tombs)
        return done

    def prepare_load(self, keys: Iterable[bytes]) -> list[LoadItem]:
        out = []
        for k in keys:
            e = self._ready.get(k) or self._gone.get(k)
            if e is None:  # cannot happen after a hit; a load that fails its check if it does
                n = self.geo.blocks_per_chunk
                e = Entry(k, 0, 0, sums={r: (0,) * n for r in range(self.geo.world_size)})
            e.pins += 1
            if k in self._ready:
                self._ready.move_to_end(k)
            out.append(LoadItem(k, e.slot, e.gen, dict(e.sums)))
        return out

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self.refresh()  # DAMAGED records a rank wrote during the load
        for k in keys:
            e = self._ready.get(k) or self._gone.get(k)
            if e is not None:
                e.pins = max(0, e.pins - 1)

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._ready:
                self._ready.move_to_end(k)

    def reset(self) -> None:
        """Drops every committed block this engine does not load (vLLM's reset_cache): for every
        engine on the store."""
        victims = [e for e in self._ready.values() if e.pins == 0]
        self._drop(victims)
        self._tomb([(e.slot, e.gen) for e in victims])

    def committed(self) -> list[bytes]:
        return list(self._ready)

    def slot_of(self, key: bytes) -> tuple[int, int] | None:
        e = self._ready.get(key)
        return (e.slot, e.gen) if e else None

    def close(self) -> None:
        # Stores in flight are left as they are: the workers may still commit them (vLLM often
        # stops before it completes its last stores), and those never committed are reclaimed
        # by the next engine that needs room, once this one's liveness lock is gone.
        self._check.close()
        self._log.close()
        self._live.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ---- internals -----------------------------------------------------------------------
    def _new(self, keys: list[bytes]) -> list[bytes]:
        """The keys nobody has stored or is storing (an engine that died mid-store aside)."""
        out = []
        for k in dict.fromkeys(keys):
            if k in self._ready or k in self._storing:
                continue
            other = self.table.storing_by_key.get(k)
            if other is not None and self._live.alive(self.table.slots[other].owner):
                continue
            out.append(k)
        return out

    def _find_slots(self, n: int, keep: set[bytes]) -> tuple[list[int] | None, list[bytes]]:
        """n slots to write, and the keys evicted for them; (None, []) if there are not n."""
        slots = []
        for s in self.table.free:
            if len(slots) == n:
                break
            slots.append(s)
        if len(slots) < n:  # slots of engines that died between ALLOC and COMMIT
            for s in self.table.unfinished:
                if len(slots) == n:
                    break
                owner = self.table.slots[s].owner
                if owner != self._live.owner and not self._live.alive(owner):
                    slots.append(s)
                    self.stats["reclaimed"] += 1
        victims = []
        for e in self._ready.values():
            if len(slots) == n:
                break
            if e.pins == 0 and e.key not in keep:
                slots.append(e.slot)
                victims.append(e.key)
        return (slots, victims) if len(slots) == n else (None, [])

    def refresh(self) -> None:
        """Reads the journals' new records (manager.log first: an ALLOC precedes its COMMITs)
        and brings the index up to date with them."""
        self._refreshed = time.monotonic()
        for rec in self._mreader.read_new():
            self.table.apply_manager(rec)
        for rank, reader in enumerate(self._readers):
            for rec in reader.read_new():
                self.table.apply_rank(rank, rec)
        batch: list[bytes] = []
        kind = False
        for ch in self.table.take_changes():
            if batch and ch.removed != kind:
                self._notify(kind, batch)
                batch = []
            kind = ch.removed
            if ch.removed:
                e = self._ready.get(ch.key)
                if e is None or (e.slot, e.gen) != (ch.slot, ch.gen):
                    continue
                self._forget(e)
                if ch.damaged:
                    logger.warning(
                        "KV store: a rank found the block in slot %d (gen %d) damaged on "
                        "load; dropped",
                        ch.slot,
                        ch.gen,
                    )
                    self.stats["damaged"] += 1
            else:
                old = self._ready.pop(ch.key, None)
                self._ready[ch.key] = Entry(ch.key, ch.slot, ch.gen, sums=ch.sums)
                if old is not None:
                    continue  # a newer copy of a served block: not news for a router
            batch.append(ch.key)
        self._notify(kind, batch)

    def _forget(self, e: Entry) -> None:
        del self._ready[e.key]
        self._gone[e.key] = e
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    def _drop(self, entries: list[Entry]) -> None:
        """Out of this engine's index at once; the caller writes their TOMBs."""
        for e in entries:
            self._forget(e)
        self._notify(True, [e.key for e in entries])

    def _notify(self, removed: bool, keys: list[bytes]) -> None:
        if keys and self.notify is not None:
            self.notify(removed, keys)

    def _tomb(self, pairs: list[tuple[int, int]]) -> bool:
        """Writes the TOMBs of (slot, gen) `pairs` and of those still owed, in one append; if
        manager.log cannot be written they stay owed (their slots unused), never raises."""
        todo = self._owed + list(pairs)
        if not todo:
            return True
        if not self._append([journal.tomb(s, g) for s, g in todo]):
            self._owed = todo
            return False
        self._owed = []
        self.refresh()
        return True

    def _append(self, records: list[bytes]) -> bool:
        try:
            self._log.append(records)
        except OSError as err:
            self._note_failure(err)
            return False
        if self._log_failing:
            logger.warning(
                "KV store: %s can be written again (%d store call(s) were refused meanwhile)",
                self._log.path,
                self.stats["store_refused"],
            )
            self._log_failing = False
        return True

    def _note_failure(self, err: OSError) -> None:
        self.stats["journal_failed"] += 1
        if not self._log_failing:
            logger.error(
                "KV store: %s; stores are refused (vLLM offers them again) and dropped "
                "blocks keep their slots until it can be written",
                err,
            )
            self._log_failing = True
