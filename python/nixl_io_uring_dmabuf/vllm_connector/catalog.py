"""The scheduler's view of the store: which block (by vLLM's offload key) is committed in which
slot, which slots are free, LRU order and eviction, and the replay that rebuilds all of it from
the journals when an engine starts. No vLLM and no NIXL in here.

Visibility rule: a block is loadable only when every rank's worker wrote a COMMIT record for
its (slot, gen) - written after that rank's data store completed - and no TOMB or DAMAGED
record names that (slot, gen). `gen` is unique per store (persisted as the largest gen in any
journal + 1 on start-up), so a stale commit can never make a reused slot look committed. A slot
is reused only after a TOMB for its previous block is in manager.log (fdatasync'ed with
`durable`), written before the store spec leaves the scheduler.

A journal that cannot be written (full file system, EIO) never raises into vLLM: a store call
that needs an eviction gives up (None: vLLM offers the blocks again at its next step) with the
index unchanged; a block dropped for another reason (damage, a store not every rank committed,
reset) leaves the index at once, but its slot stays out of use until its TOMB is written, which
is retried with every later journal write. One log line when writing starts failing, one when it
works again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable

import numpy as np

from . import checksum, journal
from . import layout as L

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Entry:
    key: bytes
    slot: int
    gen: int
    ready: bool = False
    pins: int = 0
    dropped: bool = False
    tombed: bool = False  # its TOMB is in manager.log: the slot may be reused once unpinned
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
        self.root = root
        self.geo = geometry
        self.verify_on_lookup = verify_on_lookup
        try:
            os.makedirs(root, exist_ok=True)
            self._lock_fd = journal.lock_exclusive(os.path.join(root, ".lock"), "vLLM KV store")
        except OSError as e:
            raise L.StoreUnavailable(f"vLLM KV store: cannot open {L.explain(e, root)}") from None
        try:
            L.ensure_json(
                os.path.join(root, "store.json"),
                geometry.manifest(**(manifest_extra or {})),
                "vLLM KV store",
            )
            try:
                self._log = journal.Appender(L.manager_log(root), durable)
            except OSError as e:
                raise L.StoreUnavailable(
                    "vLLM KV store: cannot open " + L.explain(e, L.manager_log(root))
                ) from None
        except BaseException:
            os.close(self._lock_fd)
            raise
        W = geometry.world_size
        self._readers = [journal.Reader(L.commits_log(root, r, W)) for r in range(W)]
        self._ready: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._storing: dict[bytes, Entry] = {}
        self._by_slot_gen: dict[tuple[int, int], Entry] = {}
        self._pending: dict[tuple[int, int], dict[int, journal.Record]] = {}
        self._parked: dict[bytes, Entry] = {}  # dropped while a load holds them
        self._rank_pages: dict[int, list[int]] = {}
        self._fds: dict[tuple[int, int], int] = {}
        self._owed: list[Entry] = []  # dropped, TOMB not written yet: slot not reusable
        self._log_failing = False
        self.stats = collections.Counter()
        # Told of every change of the served set (vLLM's KV events, manager.py):
        # notify(removed, keys) when blocks become loadable (False) or leave the index (True).
        # Blocks the replay finds at start-up are not reported here (committed() lists them).
        self.notify: Callable[[bool, list[bytes]], None] | None = None
        self._replay()

    # ---- start-up ------------------------------------------------------------------------
    def _replay(self) -> None:
        W, n = self.geo.world_size, self.geo.num_slots
        dead = {(r.slot, r.gen) for r in self._log.records if r.type == journal.TOMB}
        max_gen = max((r.gen for r in self._log.records), default=0)
        commits: dict[tuple[int, int], dict[int, journal.Record]] = collections.defaultdict(dict)
        for rank, reader in enumerate(self._readers):
            recs = reader.read_new()  # logs each damaged range it steps over
            if reader.failing is not None:  # its generations are unknown: cannot start
                self.close()
                raise L.StoreUnavailable(
                    "vLLM KV store: cannot read " + L.explain(reader.failing, reader.path)
                )
            if reader.tail:
                logger.warning(
                    "KV store: %s ends in %d byte(s) that are no whole record (a "
                    "torn append); ignored",
                    reader.path,
                    reader.tail,
                )
            for rec in recs:
                max_gen = max(max_gen, rec.gen)
                if rec.type == journal.COMMIT:
                    commits[(rec.slot, rec.gen)][rank] = rec
                elif rec.type == journal.DAMAGED:
                    dead.add((rec.slot, rec.gen))
        best: dict[int, tuple[int, dict[int, journal.Record]]] = {}
        for (slot, gen), recs in commits.items():
            keys = {rec.key for rec in recs.values()}
            if (slot, gen) in dead or len(recs) != W or len(keys) != 1 or slot >= n:
                continue
            if slot not in best or best[slot][0] < gen:
                best[slot] = (gen, recs)
        by_key: dict[bytes, Entry] = {}
        for slot, (gen, recs) in best.items():
            e = Entry(
                recs[0].key, slot, gen, ready=True, sums={r: rec.sums for r, rec in recs.items()}
            )
            old = by_key.get(e.key)
            if old is None or old.gen < gen:
                by_key[e.key] = e
        for e in sorted(by_key.values(), key=lambda e: e.gen):  # oldest store first = LRU
            self._ready[e.key] = e
            self._by_slot_gen[(e.slot, e.gen)] = e
        used = {e.slot for e in self._ready.values()}
        self._free = [s for s in range(n - 1, -1, -1) if s not in used]
        self._next_gen = max_gen + 1
        logger.info(
            "KV store %s: %d committed block(s) found, %d of %d slots free (cut %d torn "
            "byte(s) off manager.log)",
            self.root,
            len(self._ready),
            len(self._free),
            n,
            self._log.cut,
        )

    # ---- scheduler operations ------------------------------------------------------------
    def lookup(self, key: bytes) -> bool:
        e = self._ready.get(key)
        if e is None:
            return False
        if self.verify_on_lookup and not e.verified:
            problem = self._verify(e)
            if problem:
                logger.warning(
                    "KV store: block in slot %d (gen %d) fails its check (%s); "
                    "dropped, it is a miss",
                    e.slot,
                    e.gen,
                    problem,
                )
                self.stats["damaged"] += 1
                self._drop(e)
                self._tomb([e])
                return False
            e.verified = True
        return True

    def prepare_store(
        self, keys: Iterable[bytes]
    ) -> tuple[list[tuple[bytes, int, int]], list[bytes]] | None:
        """Slots for the keys not stored or being stored: [(key, slot, gen)], evicted keys.
        All or nothing, as vLLM's own CPU manager: None (nothing evicted) when the free slots
        and the evictable blocks do not hold them all, or when the eviction's TOMBs cannot be
        written; vLLM then offers them again next step."""
        keys = list(keys)
        todo = list(
            dict.fromkeys(k for k in keys if k not in self._ready and k not in self._storing)
        )
        short = len(todo) - len(self._free)
        victims: list[Entry] = []
        if short > 0:
            self._adopt_committed()  # more eviction candidates, before vLLM reports them
            protected = set(keys)  # the request's earlier blocks must stay
            victims = [e for e in self._ready.values() if e.pins == 0 and e.key not in protected][
                :short
            ]
            if len(victims) < short:
                return None
        # The eviction is journaled before it takes effect: no TOMB on file, no eviction.
        if (victims or self._owed) and not self._tomb(victims) and victims:
            self.stats["store_refused"] += 1  # the index is as it was; vLLM retries
            return None
        for v in victims:
            del self._ready[v.key]
            del self._by_slot_gen[(v.slot, v.gen)]
            v.dropped = True
            self._free.append(v.slot)
        self.stats["evicted"] += len(victims)
        self._notify(True, [v.key for v in victims])
        accepted = []
        for k in todo:
            e = Entry(k, self._free.pop(), self._next_gen)
            self._next_gen += 1
            self._storing[k] = e
            self._by_slot_gen[(e.slot, e.gen)] = e
            accepted.append((k, e.slot, e.gen))
        return accepted, [v.key for v in victims]

    def complete_store(self, keys: Iterable[bytes]) -> list[bytes]:
        """The keys whose stores every rank committed; the others' slots are freed."""
        self._pull()
        done, tombs, made = [], [], []
        for k in keys:
            e = self._storing.pop(k, None)
            if e is None:
                if k in self._ready:  # adopted early by prepare_store
                    done.append(k)
                continue
            recs = self._pending.pop((e.slot, e.gen), {})
            if self._all_committed(e, recs):
                self._make_ready(e, recs)
                done.append(k)
                made.append(k)
            else:
                logger.warning(
                    "KV store: store of slot %d (gen %d) was not committed by every "
                    "rank (%d of %d); the block is not kept",
                    e.slot,
                    e.gen,
                    len(recs),
                    self.geo.world_size,
                )
                self.stats["store_failed"] += 1
                del self._by_slot_gen[(e.slot, e.gen)]
                e.dropped = True
                if recs:  # some rank's COMMIT is on file: the slot waits for its TOMB
                    tombs.append(e)
                else:
                    self._free.append(e.slot)
        if tombs or self._owed:
            self._tomb(tombs)
        self._notify(False, made)
        return done

    def prepare_load(self, keys: Iterable[bytes]) -> list[LoadItem]:
        out = []
        for k in keys:
            e = self._ready[k]
            e.pins += 1
            self._ready.move_to_end(k)
            out.append(LoadItem(k, e.slot, e.gen, dict(e.sums)))
        return out

    def complete_load(self, keys: Iterable[bytes]) -> None:
        self._pull()
        for k in keys:
            e = self._ready.get(k) or self._parked.get(k)
            if e is None:
                continue
            e.pins = max(0, e.pins - 1)
            if e.dropped and e.pins == 0:
                del self._parked[k]
                if e.tombed:
                    self._free.append(e.slot)

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._ready:
                self._ready.move_to_end(k)

    def reset(self) -> None:
        """Drops every committed block no load holds (vLLM's reset_cache)."""
        victims = [e for e in self._ready.values() if e.pins == 0]
        for e in victims:
            self._drop(e, notify=False)
        self._notify(True, [e.key for e in victims])
        self._tomb(victims)

    def committed(self) -> list[bytes]:
        return list(self._ready)

    def slot_of(self, key: bytes) -> tuple[int, int] | None:
        e = self._ready.get(key)
        return (e.slot, e.gen) if e else None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._log.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ---- internals -----------------------------------------------------------------------
    def _all_committed(self, e: Entry, recs: dict[int, journal.Record]) -> bool:
        return len(recs) == self.geo.world_size and all(r.key == e.key for r in recs.values())

    def _make_ready(self, e: Entry, recs: dict[int, journal.Record]) -> None:
        e.ready = True
        e.sums = {rank: rec.sums for rank, rec in recs.items()}
        self._ready[e.key] = e

    def _adopt_committed(self) -> None:
        """Stores every rank has committed but vLLM has not completed yet (it reports them a
        step later) become ready now, so a full store can evict them; their data is on file."""
        self._pull()
        made = []
        for sg, recs in list(self._pending.items()):
            e = self._by_slot_gen.get(sg)
            if e is None or e.ready or not self._all_committed(e, recs):
                continue
            del self._storing[e.key]
            del self._pending[sg]
            self._make_ready(e, recs)
            made.append(e.key)
        self._notify(False, made)

    def _pull(self) -> None:
        """New records of the workers' journals: commits of stores in flight, damage found by
        loads (the block is dropped, so the next lookup misses)."""
        for rank, reader in enumerate(self._readers):
            for rec in reader.read_new():
                e = self._by_slot_gen.get((rec.slot, rec.gen))
                if e is None:
                    continue
                if rec.type == journal.COMMIT and not e.ready:
                    self._pending.setdefault((rec.slot, rec.gen), {})[rank] = rec
                elif rec.type == journal.DAMAGED and e.ready:
                    logger.warning(
                        "KV store: rank %d found the block in slot %d (gen %d) "
                        "damaged on load; dropped",
                        rank,
                        rec.slot,
                        rec.gen,
                    )
                    self.stats["damaged"] += 1
                    self._drop(e)
                    self._tomb([e])

    def _drop(self, e: Entry, notify: bool = True) -> None:
        """Out of the index at once; the caller writes its TOMB (_tomb), which frees the slot."""
        if self._ready.pop(e.key, None) is not None and notify:
            self._notify(True, [e.key])
        self._by_slot_gen.pop((e.slot, e.gen), None)
        e.dropped = True
        if e.pins:  # a load still reads it: the slot comes free when vLLM completes that load
            self._parked[e.key] = e

    def _notify(self, removed: bool, keys: list[bytes]) -> None:
        if keys and self.notify is not None:
            self.notify(removed, keys)

    def _tomb(self, entries: list[Entry]) -> bool:
        """Writes the TOMBs of `entries` and of those still owed from a failed write, in one
        append, then frees the slots no load holds. If manager.log cannot be written, the
        entries stay owed (their slots unused) and False is returned; never raises."""
        todo = self._owed + list(entries)
        if not todo:
            return True
        try:
            self._log.append([journal.tomb(e.slot, e.gen) for e in todo])
        except OSError as err:
            self.stats["journal_failed"] += 1
            if not self._log_failing:
                logger.error(
                    "KV store: %s; stores that need an eviction are refused (vLLM "
                    "offers them again) and dropped blocks keep their slots until it "
                    "can be written",
                    err,
                )
                self._log_failing = True
            self._owed = [e for e in todo if e.dropped]  # an eviction not taken is not owed
            return False
        if self._log_failing:
            logger.warning(
                "KV store: %s can be written again (%d store call(s) were refused meanwhile)",
                self._log.path,
                self.stats["store_refused"],
            )
            self._log_failing = False
        self._owed = []
        for e in todo:
            e.tombed = True
            if e.dropped and e.pins == 0:
                if self._parked.get(e.key) is e:
                    del self._parked[e.key]
                self._free.append(e.slot)
        return True

    def _verify(self, e: Entry) -> str:
        for rank in range(self.geo.world_size):
            pages = self._pages(rank)
            if pages is None:
                return f"rank {rank} has no layout.json"
            fi, off = self.geo.locate(e.slot)
            n = sum(pages) * self.geo.blocks_per_chunk
            try:
                fd = self._fd(rank, fi)
                data = os.pread(fd, n, off)
            except OSError as err:
                return f"rank {rank}: {err}"
            if len(data) != n:
                return f"rank {rank}: slot file ends inside the slot"
            bpc = self.geo.blocks_per_chunk
            got = checksum.slot_checksums(
                np.frombuffer(data, dtype=np.uint8), pages, L.page_runs(pages, bpc), bpc
            )
            if tuple(got) != tuple(e.sums.get(rank, ())):
                return f"rank {rank}: checksum differs"
        return ""

    def _pages(self, rank: int) -> list[int] | None:
        pages = self._rank_pages.get(rank)
        if pages is None:
            meta = L.read_json(
                os.path.join(L.rank_dir(self.root, rank, self.geo.world_size), "layout.json")
            )
            if meta is None:
                return None
            pages = self._rank_pages[rank] = [int(p) for p in meta["pages"]]
        return pages

    def _fd(self, rank: int, fi: int) -> int:
        fd = self._fds.get((rank, fi))
        if fd is None:
            fd = os.open(L.slot_file(self.root, rank, self.geo.world_size, fi), os.O_RDONLY)
            self._fds[(rank, fi)] = fd
        return fd
