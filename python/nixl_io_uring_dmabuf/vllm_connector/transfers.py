"""One rank's NIXL side of the store: an agent with one storage backend, the KV memory and the
slot files registered once, and two prepped descriptor lists (every (block, page) of the KV
memory, every (slot, sub-block, page) of the files), so that a job is one `make_prepped_xfer`
by indices. rankstore.RankStore runs the jobs; this class only sets up, prepares and posts transfers,
polls and releases them, and tears down.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import layout as L

if TYPE_CHECKING:
    from .rankstore import Region


def merge_regions(regions: Sequence[Region]) -> list[tuple[int, int, int]]:
    """Registration ranges (addr, length, dev): the regions' extents merged where they touch,
    so views into one allocation are registered as that allocation once."""
    spans = sorted(
        (r.dev, r.addr, r.addr + (r.num_blocks - 1) * r.stride + r.page) for r in regions
    )
    out: list[list[int]] = []
    for dev, a, e in spans:
        if out and out[-1][2] == dev and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], e - out[-1][0])
        else:
            out.append([a, e - a, dev])
    return [(a, n, d) for a, n, d in out]


def scratch_offsets(regions: Sequence[Region]) -> list[int]:
    """Where each KV tensor's first page goes in the warm-up's scratch file (4 KiB aligned, for
    O_DIRECT), and the file's size last."""
    offsets = [0]
    for r in regions:
        offsets.append(offsets[-1] + L.round_up(r.page, 4096))
    return offsets


class RankTransfers:
    """The agent, registrations and prepped lists of one rank (see the module doc)."""

    def __init__(
        self,
        rank: int,
        backend: str,
        backend_params: Mapping[str, str],
        mem_kind: str,
        regions: Sequence[Region],
        geo: L.Geometry,
        fds: Sequence[int],
    ):
        from nixl._api import nixl_agent, nixl_agent_config

        pages = [r.page for r in regions]
        npg, nb = len(pages), regions[0].num_blocks
        if any(r.num_blocks != nb for r in regions):
            raise ValueError("the KV tensors have different numbers of blocks")
        self.backend = backend
        self._be = [backend]
        self._mem_kind = mem_kind
        self.agent = a = nixl_agent(
            f"iud-kv-r{rank}-{os.getpid()}-{uuid.uuid4().hex[:6]}", nixl_agent_config(backends=[])
        )
        a.create_backend(backend, dict(backend_params))
        self._mem_reg = a.register_memory(
            [(ad, n, d, "") for ad, n, d in merge_regions(regions)], mem_kind, backends=self._be
        )
        # The plugin serves a raw device as BLK_SEG (its DMA-BUF path takes only that); NIXL's
        # own backends take a block device's fd as FILE
        self.file_kind = "BLOCK" if geo.devices and backend == "IO_URING_DMABUF" else "FILE"
        self._file_reg = a.register_memory(
            [
                (geo.file_base(rank), geo.file_slots(i) * geo.slot_bytes, fd, "")
                for i, fd in enumerate(fds)
            ],
            self.file_kind,
            backends=self._be,
        )
        mem = np.empty((nb, npg, 3), dtype=np.int64)
        for p, r in enumerate(regions):
            mem[:, p, 0] = r.addr + np.arange(nb, dtype=np.int64) * r.stride
            mem[:, p, 1] = r.page
            mem[:, p, 2] = r.dev
        bpc = geo.blocks_per_chunk
        runs = L.page_runs(pages, bpc)
        files = np.empty((geo.num_slots, bpc, npg, 3), dtype=np.int64)
        slots = np.arange(geo.num_slots, dtype=np.int64)
        fi, base = geo.locate(slots, rank)
        slot_fds = np.asarray(fds, dtype=np.int64)[fi]
        for j in range(bpc):
            for p in range(npg):
                files[:, j, p, 0] = base + runs[p] + j * pages[p]
                files[:, j, p, 1] = pages[p]
                files[:, j, p, 2] = slot_fds
        self.num_blocks, self.num_pages = nb, npg
        self._local = a.prep_xfer_dlist(
            "NIXL_INIT_AGENT", mem.reshape(-1, 3), mem_kind, backends=self._be
        )
        self._remote = a.prep_xfer_dlist(
            a.name, files.reshape(-1, 3), self.file_kind, backends=self._be
        )

    def prep(self, store: bool, local: np.ndarray, remote: np.ndarray) -> object:
        """The handle of a WRITE (store) or READ (load) of the given list indices."""
        return self.agent.make_prepped_xfer(
            "WRITE" if store else "READ",
            self._local,
            local,
            self._remote,
            remote,
            backends=self._be,
        )

    def start(self, handle) -> str:
        """Posts a prepped transfer; NIXL's state for it ("ERR" when it refused)."""
        return self.agent.transfer(handle)

    def state(self, handle) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        self.agent.release_xfer_handle(handle)

    def round_trip(self, regions: Sequence[Region], fd: int, timeout_s: float) -> None:
        """Writes the first page of every KV tensor to the scratch file `fd` and reads it back
        into the same place (the bytes are unchanged), through this agent and backend: what a
        backend sets up on a registration's first use then happens here, at start-up, instead
        of in the engine's first request (IO_URING_DMABUF pins a DRAM registration as io_uring
        fixed buffers then: 185-275 ms for a 1 GiB KV cache on a 2-CPU machine). RuntimeError
        if a transfer fails or takes longer than `timeout_s`."""
        a, offsets = self.agent, scratch_offsets(regions)
        local = [(r.addr, r.page, r.dev) for r in regions]
        remote = [(off, r.page, fd) for off, r in zip(offsets, regions)]
        reg = a.register_memory([(0, offsets[-1], fd, "")], "FILE", backends=self._be)
        try:
            for op in ("WRITE", "READ"):
                h = a.initialize_xfer(
                    op,
                    a.get_xfer_descs(local, self._mem_kind),
                    a.get_xfer_descs(remote, "FILE"),
                    a.name,
                    backends=self._be,
                )
                try:
                    state, end = a.transfer(h), time.monotonic() + timeout_s
                    while state == "PROC" and time.monotonic() < end:
                        time.sleep(0.001)
                        state = a.check_xfer_state(h)
                    if state != "DONE":
                        raise RuntimeError(f"the warm-up {op} ended in state {state}")
                finally:
                    a.release_xfer_handle(h)
        finally:
            a.deregister_memory(reg, backends=self._be)

    def close(self) -> None:
        a = self.agent
        for h in (self._local, self._remote):
            try:
                a.release_dlist_handle(h)
            except Exception:  # noqa: BLE001
                pass
        a.deregister_memory(self._file_reg, backends=self._be)
        a.deregister_memory(self._mem_reg, backends=self._be)
