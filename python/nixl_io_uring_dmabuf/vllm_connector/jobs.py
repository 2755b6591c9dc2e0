"""The store's job records: what a job is (its KV rows, slots and phase), the parts it moves in,
and what it reports. RankStore (rankstore.py) moves jobs through their phases; nothing here does
I/O.

A job moves in **parts** of whole slots, each one NIXL transfer, all posted at once: the first
part starts after one part's make_prepped_xfer rather than the whole job's, and a load checks
each part's blocks as soon as that part is DONE, while the next parts still move, so only the
last part's checksums follow the transfer.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping

import numpy as np

# Bytes of KV rows per part: 256 MiB keeps a 32k-token prefix of an 8B model (4 GiB) in 16
# parts, each still hundreds of the plugin's I/Os.
PART_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Region:
    """One KV tensor as rows: row b (block b) starts at addr + b * stride, page bytes long."""

    addr: int
    stride: int
    num_blocks: int
    page: int
    dev: int = 0


class Phase(enum.Enum):
    """Where a job is. RankStore._advance moves a job forward through these, never back, and
    returns at once where it would have to wait."""

    WAIT = "wait"  # for the device work the job follows (its `ready` callable)
    POST = "post"  # make_prepped_xfer and transfer of every part (a store's checksums queued)
    XFER = "xfer"  # NIXL moves the parts (check_xfer_state); a load queues each part's checksums
    CHECK = "check"  # the checksums: a store's of its rows, a load's of what arrived
    FINISH = "finish"  # store: COMMIT records; load: compare, DAMAGED records


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """How a rank's files are written and which NIXL backend moves the bytes (the connector's
    parameters of the same names, docs/vllm-connector.md); part_bytes: KV bytes per transfer."""

    backend: str = "IO_URING_DMABUF"
    backend_params: Mapping[str, str] = dataclasses.field(default_factory=dict)
    o_direct: bool = False
    durable: bool = False
    preallocate: bool = True
    part_bytes: int = PART_BYTES
    overwrite_devices: bool = False


@dataclasses.dataclass
class Result:
    job_id: int
    store: bool
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    bad_blocks: list[int] = dataclasses.field(default_factory=list)  # loads: damaged blocks
    error: str = ""
    # wall seconds the job spent in each phase it went through (Phase values), from the
    # moment `ready` said yes to its end: where a job's time goes
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Part:
    """Whole slots of a job moved by one NIXL transfer; `pos` are the job's positions (indices
    into its blocks) in it."""

    pos: np.ndarray
    handle: object = None
    over: bool = False  # DONE, failed, or never posted
    error: Exception | None = None
    sums: object = None  # a load's pending checksums of this part
    got: list[int] | None = None  # ... and their values, once they are in


def parts_of(slots: np.ndarray, blocks_per_part: int) -> list[np.ndarray]:
    """The job's positions grouped by slot (in slot order) and cut, at slot boundaries, into
    parts of at least `blocks_per_part` blocks (the last may be smaller)."""
    if not len(slots):
        return []
    order = np.argsort(slots, kind="stable")
    s = slots[order]
    starts = np.flatnonzero(s[1:] != s[:-1]) + 1
    parts, begin = [], 0
    for st in starts.tolist():
        if st - begin >= blocks_per_part:
            parts.append(order[begin:st])
            begin = st
    parts.append(order[begin:])
    return parts


@dataclasses.dataclass
class Job:
    job_id: int
    store: bool
    blocks: np.ndarray
    slots: np.ndarray
    subs: np.ndarray
    ready: Callable[[], bool] | None
    commits: list[tuple[bytes, int, int]] = dataclasses.field(default_factory=list)
    expected: list[int] = dataclasses.field(default_factory=list)
    gens: list[int] = dataclasses.field(default_factory=list)
    parts: list[Part] = dataclasses.field(default_factory=list)
    sums: object = None  # a store's pending checksums of its rows
    t0: float = 0.0
    post_s: float = 0.0  # time the engine's thread spent starting and finishing it
    phase: Phase = Phase.WAIT
    entered: float = 0.0  # when the job entered its phase
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def enter(self, phase: Phase, now: float | None = None) -> None:
        """Moves to `phase`, adding the time spent in the one it leaves (WAIT not counted:
        the device work the job follows is the engine's, not the store's)."""
        now = time.perf_counter() if now is None else now
        if self.phase is not Phase.WAIT:
            k = self.phase.value
            self.phases[k] = self.phases.get(k, 0.0) + now - self.entered
        self.phase, self.entered = phase, now

    def in_flight(self) -> list[Part]:
        return [p for p in self.parts if p.handle is not None and not p.over]

    def first_error(self) -> Exception | None:
        return next((p.error for p in self.parts if p.error is not None), None)
