"""The store's slots as every engine sees them, rebuilt from the journals' records by any number
of engines, whatever order the journals are read in. No I/O here.

A slot's current generation is the largest gen any record names for it; records of older
generations are stale and ignored. Gens are unique per store: each is taken under manager.log's
lock as one more than the largest on file.

- ALLOC(slot, gen, owner, key) is on file before a byte of the new block is written. It
  supersedes every older generation of the slot, so it is also the eviction of what the slot
  held: no TOMB is needed before reuse.
- COMMIT(slot, gen) from every rank makes the block READY (served). A COMMIT seen before its
  ALLOC counts as the ALLOC with owner 0: the ALLOC comes later in read order, or the store was
  written before format 4 had ALLOC records.
- TOMB or DAMAGED of the current generation makes the slot dead, and free.

A slot is free when never allocated or dead; an allocation no rank will complete (its engine is
gone, locks.Liveness) is reclaimed by the scheduler that needs the slot. Two ready slots with one
key (a store raced by a broken lock, or left by an older release) serve the newer; the older is
free to reuse.
"""

from __future__ import annotations

import dataclasses

from . import journal


@dataclasses.dataclass
class Slot:
    gen: int
    owner: int = 0
    key: bytes | None = None
    commits: dict[int, journal.Record] = dataclasses.field(default_factory=dict)
    ready: bool = False
    dead: bool = False


@dataclasses.dataclass(frozen=True)
class Change:
    """A block that became served (removed False) or stopped being served (removed True)."""

    removed: bool
    key: bytes
    slot: int
    gen: int
    sums: dict[int, tuple[int, ...]]
    damaged: bool = False  # removed by a DAMAGED record (a rank's check after a load)


class SlotTable:
    def __init__(self, num_slots: int, world_size: int):
        self.num_slots, self.world_size = num_slots, world_size
        self.slots: dict[int, Slot] = {}
        self.free: set[int] = set(range(num_slots))
        self.ready_by_key: dict[bytes, int] = {}  # key -> slot that serves it
        self.storing_by_key: dict[bytes, int] = {}  # allocated, not ready, not dead
        self.unfinished: set[int] = set()  # slots allocated, neither ready nor dead
        self.max_gen = 0
        self.changes: list[Change] = []

    # ---- records --------------------------------------------------------------------------
    def apply_manager(self, rec: journal.Record) -> None:
        if rec.type == journal.ALLOC:
            s = self._current(rec.slot, rec.gen)
            if s is not None:
                s.owner = s.owner or rec.owner
                self._name(rec.slot, s, rec.key)
        elif rec.type == journal.TOMB:
            self._kill(rec.slot, rec.gen)

    def apply_rank(self, rank: int, rec: journal.Record) -> None:
        if rec.type == journal.DAMAGED:
            self._kill(rec.slot, rec.gen, damaged=True)
            return
        if rec.type != journal.COMMIT:
            return
        s = self._current(rec.slot, rec.gen)
        if s is None or s.dead or not self._name(rec.slot, s, rec.key):
            return
        s.commits[rank] = rec
        if len(s.commits) == self.world_size and not s.ready:
            self._make_ready(rec.slot, s)

    def take_changes(self) -> list[Change]:
        out, self.changes = self.changes, []
        return out

    # ---- queries --------------------------------------------------------------------------
    def is_current(self, slot: int, gen: int) -> bool:
        s = self.slots.get(slot)
        return s is not None and s.gen == gen and not s.dead

    # ---- internals ------------------------------------------------------------------------
    def _current(self, slot: int, gen: int) -> Slot | None:
        """The slot's state for `gen`: None if `gen` is older than its current one; a new
        generation retires what the slot held."""
        if slot >= self.num_slots:
            return None
        self.max_gen = max(self.max_gen, gen)
        s = self.slots.get(slot)
        if s is not None and gen < s.gen:
            return None
        if s is not None and gen == s.gen:
            return s
        if s is not None:
            self._retire(slot, s)
        s = self.slots[slot] = Slot(gen)
        self.free.discard(slot)
        self.unfinished.add(slot)
        return s

    def _name(self, slot: int, s: Slot, key: bytes) -> bool:
        """Gives the slot's generation its key; a second, different key kills it (two engines
        took one generation: only a lock that did not hold across nodes lets that happen)."""
        if s.key is None:
            s.key = key
            if not s.ready and not s.dead:
                self.storing_by_key[key] = slot
            return True
        if s.key != key:
            self._kill(slot, s.gen)
            return False
        return True

    def _make_ready(self, slot: int, s: Slot) -> None:
        s.ready = True
        self.unfinished.discard(slot)
        if self.storing_by_key.get(s.key) == slot:
            del self.storing_by_key[s.key]
        other = self.ready_by_key.get(s.key)
        if other is not None and self.slots[other].gen > s.gen:
            self.free.add(slot)  # an older copy of a served key: not served, reusable
            return
        if other is not None:
            self.free.add(other)
        self.ready_by_key[s.key] = slot
        sums = {r: rec.sums for r, rec in s.commits.items()}
        self.changes.append(Change(False, s.key, slot, s.gen, sums))

    def _kill(self, slot: int, gen: int, damaged: bool = False) -> None:
        s = self._current(slot, gen)
        if s is None or s.dead:
            return
        self._retire(slot, s, damaged)
        s.dead = True
        self.unfinished.discard(slot)
        self.free.add(slot)

    def _retire(self, slot: int, s: Slot, damaged: bool = False) -> None:
        if s.key is None:
            return
        if self.storing_by_key.get(s.key) == slot:
            del self.storing_by_key[s.key]
        if s.ready and self.ready_by_key.get(s.key) == slot:
            del self.ready_by_key[s.key]
            self.changes.append(Change(True, s.key, slot, s.gen, {}, damaged))
