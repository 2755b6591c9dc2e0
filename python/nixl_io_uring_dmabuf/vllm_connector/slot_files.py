"""One rank's folder of the store, as one engine's worker opens it: its shared lock (keeps older
releases out; every engine's worker of this rank works in the folder at once), layout.json, the
commit journal's appender and the slot files, opened and sized (preallocated, or sparse). Set-up failures
are one StoreUnavailable naming path and cause. rankstore.RankStore runs the jobs over these.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import devices, journal, locks, media
from . import layout as L

if TYPE_CHECKING:
    from .rankstore import Region


class RankFiles:
    """The open files of one rank (see the module doc); close() releases them and the lock."""

    def __init__(
        self,
        root: str,
        geo: L.Geometry,
        rank: int,
        pages: list[int],
        o_direct: bool,
        durable: bool,
        preallocate: bool,
        overwrite_devices: bool = False,
    ):
        self.root, self.geo, self.rank = root, geo, rank
        self.fds: list[int] = []
        self.log: journal.Appender | None = None
        W = geo.world_size
        rdir = L.rank_dir(root, rank, W)
        what = f"vLLM KV store rank {rank}"
        try:
            os.makedirs(rdir, exist_ok=True)
            self._lock_fd = locks.flock_shared(os.path.join(rdir, ".lock"), what)
        except OSError as e:
            raise L.StoreUnavailable(f"{what}: cannot open {L.explain(e, rdir)}") from None
        try:
            L.ensure_json(
                os.path.join(rdir, "layout.json"),
                {
                    "pages": pages,
                    "blocks_per_chunk": geo.blocks_per_chunk,
                    "slot_bytes": geo.slot_bytes,
                    "rank": rank,
                    "world_size": W,
                },
                what,
            )
            try:
                self.log = journal.Appender(L.commits_log(root, rank, W), durable)
            except OSError as e:
                raise L.StoreUnavailable(
                    f"{what}: cannot open {L.explain(e, L.commits_log(root, rank, W))}"
                ) from None
            if geo.slot_dirs:
                media.claim_dirs(root, geo)
            if geo.devices:
                devices.claim(root, geo, overwrite_devices)
                self._open_devices()
            else:
                self._open_files(o_direct, preallocate)
        except BaseException:
            self.close()
            raise

    def _open_devices(self) -> None:
        """The raw devices, always O_DIRECT; their size was checked by the geometry."""
        for dev in self.geo.devices:
            try:
                self.fds.append(os.open(dev, os.O_RDWR | os.O_DIRECT))
            except OSError as e:
                raise L.StoreUnavailable(
                    f"vLLM KV store rank {self.rank}: cannot open {L.explain(e, dev)}"
                ) from None

    def _open_files(self, o_direct: bool, preallocate: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if o_direct else 0)
        what = f"vLLM KV store rank {self.rank}"
        for i in range(self.geo.num_files):
            path = self.geo.slot_path(self.root, self.rank, i)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, flags, 0o644)
                self.fds.append(fd)
                old = os.fstat(fd).st_size
            except OSError as e:
                raise L.StoreUnavailable(f"{what}: cannot open {L.explain(e, path)}") from None
            size = self.geo.file_slots(i) * self.geo.slot_bytes
            if old >= size:
                continue
            try:
                if preallocate:
                    try:
                        os.posix_fallocate(fd, 0, size)
                        continue
                    except OSError as e:
                        if e.errno in L.NO_SPACE:
                            os.ftruncate(fd, old)
                            raise L.StoreUnavailable(
                                f"{what}: cannot preallocate {size} B for "
                                f"{L.explain(e, path)}. Free space, lower capacity_gb, or set "
                                "preallocate to false (sparse slot files: stores then fail "
                                "while the file system is full)"
                            ) from None
                os.ftruncate(fd, size)  # sparse: preallocate off or not supported here
            except OSError as e:
                raise L.StoreUnavailable(f"{what}: cannot size {L.explain(e, path)}") from None

    def check_direct(self, pages: list[int], regions: Sequence[Region], mem_kind: str) -> None:
        """Refuses (ValueError) a KV layout that O_DIRECT on these files cannot serve."""
        # the strictest of the files: slot_dirs and devices may differ in block size
        aligns = [L.direct_alignment(fd) for fd in self.fds]
        mem_align, off_align = max(a[0] for a in aligns), max(a[1] for a in aligns)
        problems = []
        offsets = np.cumsum([0] + pages)
        if self.geo.slot_bytes % off_align:
            problems.append(f"slot size {self.geo.slot_bytes} B is not a multiple of {off_align}")
        for p in list(pages) + [int(o) for o in offsets[1:]] + [sum(pages)]:
            if p % off_align:
                problems.append(
                    f"a KV page boundary ({p} B into a block) is not a multiple of {off_align} B"
                )
                break
        if mem_kind == "DRAM":
            for i, r in enumerate(regions):
                if r.addr % mem_align or r.stride % mem_align:
                    problems.append(
                        f"KV tensor {i} at 0x{r.addr:x} (row stride {r.stride} B) is "
                        f"not aligned to {mem_align} B"
                    )
        if problems:
            raise ValueError(
                "o_direct cannot serve this KV cache layout: "
                + "; ".join(problems)
                + ". Set o_direct to false."
            )

    def scratch(self, nbytes: int, o_direct: bool) -> int:
        """An unlinked file of `nbytes` beside the rank's slot files (in the rank's folder for
        raw devices: nothing may be written on a device outside its slots), O_DIRECT where the
        slot files are and its file system takes it. Private to this process, so engines that
        share the store never read each other's scratch bytes. The caller closes it."""
        where = (
            L.rank_dir(self.root, self.rank, self.geo.world_size)
            if self.geo.devices
            else os.path.dirname(self.geo.slot_path(self.root, self.rank, 0))
        )
        fd, path = tempfile.mkstemp(prefix=".warm-up-", dir=where)
        try:
            os.unlink(path)
            os.ftruncate(fd, nbytes)
            if o_direct:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                except OSError:
                    pass  # this file system has no O_DIRECT: the scratch file stays buffered
        except BaseException:
            os.close(fd)
            raise
        return fd

    def fdatasync(self, slots) -> None:
        """fdatasync of every slot file that holds one of `slots`; an error names the file."""
        for fi in sorted({self.geo.locate(int(s))[0] for s in slots}):
            try:
                os.fdatasync(self.fds[fi])
            except OSError as e:
                path = self.geo.slot_path(self.root, self.rank, fi)
                raise OSError(e.errno, f"fdatasync of {L.explain(e, path)}") from None

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.log is not None:
            self.log.close()
            self.log = None
        os.close(self._lock_fd)
