"""What the storage node keeps while it serves: its requests (Active) cut into batches (Batch),
where each batch is (Stage), the clients it has heard from (ClientState), and the counters that
STAT reports (Counters). Data and the request's route only; pipeline.py moves them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from . import plan
from . import protocol as P


class Stage(enum.Enum):
    """Where a batch is: waiting for a buffer, in its storage or its network transfer, or parked
    after a failure until NIXL lets its transfer go (its buffer is not reused before that)."""

    QUEUED = "queued"
    STORAGE = "storage"
    NET = "net"
    DRAINING = "draining"


@dataclass(eq=False)
class Batch:
    req: Active
    pieces: np.ndarray  # M x 6, plan columns
    buf: int = -1
    stage: Stage = Stage.QUEUED
    handle: object = None
    started: float = 0.0

    @property
    def nbytes(self) -> int:
        return int(self.pieces[:, plan.LEN].sum())


@dataclass(eq=False)
class Active:
    """A request from its arrival to its DONE."""

    client: str
    req: P.Request
    md: P.MdExchange  # how the client publishes its metadata
    received: float
    batches: list  # pending Batch objects, in order
    inflight: list = field(default_factory=list)
    moved: int = 0
    error: str = ""
    admitted: bool = False
    last_progress: float = 0.0
    md_fetched: float = 0.0
    disconnected: bool = False
    forced: bool = False
    rdescs: object = None  # the request's client-side descriptors, for admission

    def first_stage(self) -> Stage:
        """A READ starts in storage (file -> buffer); a WRITE, or a net_only READ, on the network."""
        return Stage.NET if (self.req.op == "WRITE" or self.req.net_only) else Stage.STORAGE

    def next_stage(self, done: Stage) -> Stage | None:
        """The stage after `done` for a batch of this request; None: the batch is finished."""
        if self.error or self.req.net_only:
            return None
        if done is Stage.STORAGE and self.req.op == "READ":
            return Stage.NET
        if done is Stage.NET and self.req.op == "WRITE":
            return Stage.STORAGE
        return None


@dataclass
class ClientState:
    name: str
    instance: str = ""
    last_seen: float = 0.0


@dataclass
class Counters:
    """The node's totals since it started, as STAT reports them."""

    requests_ok: int = 0
    requests_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    clients_dropped: int = 0
    bad_messages: int = 0
