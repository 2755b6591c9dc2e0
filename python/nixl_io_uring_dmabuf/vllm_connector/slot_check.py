"""The scheduler's check of a block before its first hit in this process (verify_on_lookup): it
reads the block's slot from every rank's files and compares the checksums the ranks committed."""

from __future__ import annotations

import mmap
import os

import numpy as np

from . import checksum
from . import layout as L


class SlotChecker:
    def __init__(self, root: str, geo: L.Geometry):
        self.root, self.geo = root, geo
        self._rank_pages: dict[int, list[int]] = {}
        self._fds: dict[tuple[int, int], int] = {}

    def problem(self, slot: int, sums: dict[int, tuple[int, ...]]) -> str:
        """'' if every rank's bytes in `slot` have the checksums in `sums`, else what differs."""
        for rank in range(self.geo.world_size):
            pages = self._pages(rank)
            if pages is None:
                return f"rank {rank} has no layout.json"
            fi, off = self.geo.locate(slot, rank)
            n = sum(pages) * self.geo.blocks_per_chunk
            try:
                data = self._read(self._fd(rank, fi), n, off)
            except OSError as err:
                return f"rank {rank}: {err}"
            if len(data) != n:
                return f"rank {rank}: slot file ends inside the slot"
            bpc = self.geo.blocks_per_chunk
            got = checksum.slot_checksums(
                np.frombuffer(data, dtype=np.uint8), pages, L.page_runs(pages, bpc), bpc
            )
            if tuple(got) != tuple(sums.get(rank, ())):
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

    def _read(self, fd: int, n: int, off: int) -> bytes:
        if not self.geo.devices:
            return os.pread(fd, n, off)
        buf = mmap.mmap(-1, self.geo.slot_bytes)  # O_DIRECT: aligned, whole slot
        got = os.preadv(fd, [buf], off)
        return bytes(buf[: min(n, got)])

    def _fd(self, rank: int, fi: int) -> int:
        fd = self._fds.get((rank, fi))
        if fd is None:
            # raw devices O_DIRECT, like the workers: no second copy in the page cache
            flags = os.O_RDONLY | (os.O_DIRECT if self.geo.devices else 0)
            fd = os.open(self.geo.slot_path(self.root, rank, fi), flags)
            self._fds[(rank, fi)] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
