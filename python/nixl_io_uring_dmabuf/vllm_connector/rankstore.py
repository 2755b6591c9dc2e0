"""One rank's half of the store: its slot files and commit journal, and the jobs that move blocks
between the engine's KV memory and those files. No vLLM and no torch in here: KV memory comes as
regions (address, row stride, rows, page bytes, device) and checksums from a callable, so the
same code serves vLLM's tensors (VRAM or DRAM) and the unit tests' buffers.

Set-up, once: the rank's folder is locked, its slot files opened and sized (slot_files.RankFiles),
and the NIXL side (transfers.RankTransfers) registers the KV memory and the files and preps their
descriptor lists. A job is one `make_prepped_xfer` by indices, posted when its `ready` callable
says the device work it must follow is done (never waited for), polled by `poll()`, then released;
it goes through the phases of `Phase`. A store's COMMIT records (with the checksums computed from
the KV memory before the transfer) are appended only after the transfer is DONE - after fdatasync
of the slot files when `durable`. A load is checked against the expected checksums after it is
DONE; a block that does not match is reported and gets a DAMAGED record.

A failed job's error names its cause where the file system shows one (diagnosis.py). Set-up
failures of the store's files (full or read-only file system) are one StoreUnavailable line
naming path and cause.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from . import checksum, journal
from . import layout as L
from .diagnosis import cause_of, diagnose
from .jobs import Job, Part, Phase, Region, Result, StoreOptions, parts_of
from .slot_files import RankFiles
from .transfers import RankTransfers, scratch_offsets

logger = logging.getLogger(__name__)

# Longest the start-up warm-up round trip may take (a hung file system must not hang start-up).
WARM_UP_TIMEOUT_S = 30.0

# block ids -> one checksum per block (checksum.fold over the block's pages, in order)
BlockSumsFn = Callable[[np.ndarray], list[int]]
# block ids -> a pending result with done() and result() (checksum.PendingSums), started in
# the calling thread without waiting (device work)
LaunchSumsFn = Callable[[np.ndarray], object]


class HostRows:
    """Page sums of host-memory regions (by address), for DRAM without torch."""

    def __init__(self, regions: Sequence[Region]):
        self._regions = list(regions)

    def block_sums(self, block_ids: np.ndarray) -> list[int]:
        out = []
        for b in np.asarray(block_ids).tolist():
            pages = []
            for r in self._regions:
                buf = (ctypes.c_uint8 * r.page).from_address(r.addr + int(b) * r.stride)
                pages.append(checksum.page_sums(np.frombuffer(buf, dtype=np.uint8)))
            out.append(checksum.fold(pages))
        return out


class RankStore:
    """One rank's store: set-up of its files, the job pipeline (submit, poll, wait) and close.

    `block_sums` computes a job's checksums in the checksum thread (default: from host memory);
    `launch_sums`, where given, queues them on the device from the engine's thread instead.
    """

    def __init__(
        self,
        root: str,
        geo: L.Geometry,
        rank: int,
        regions: Sequence[Region],
        mem_kind: str,
        options: StoreOptions | None = None,
        *,
        block_sums: BlockSumsFn | None = None,
        launch_sums: LaunchSumsFn | None = None,
    ):
        options = options or StoreOptions()
        self.geo, self.rank, self.backend = geo, rank, options.backend
        self.regions = list(regions)
        self.pages = [r.page for r in self.regions]
        self.durable = options.durable
        self.part_bytes = options.part_bytes
        if sum(self.pages) > geo.rank_block_bytes:
            raise ValueError(
                f"rank {rank}: the KV cache has {sum(self.pages)} B per block, more "
                f"than the {geo.rank_block_bytes} B vLLM announced to the scheduler"
            )
        for p in self.pages:
            checksum.check_page_bytes(p)
        self._block_sums = block_sums or HostRows(self.regions).block_sums
        self._launch_sums = launch_sums
        direct = options.o_direct or bool(geo.devices)  # raw devices are always O_DIRECT
        self._files = RankFiles(
            root,
            geo,
            rank,
            self.pages,
            direct,
            options.durable,
            options.preallocate,
            options.overwrite_devices,
        )
        self._root, self._fds, self._log = root, self._files.fds, self._files.log
        try:
            if direct:
                self._files.check_direct(self.pages, self.regions, mem_kind)
            self._nixl = RankTransfers(
                rank,
                options.backend,
                options.backend_params,
                mem_kind,
                self.regions,
                geo,
                self._fds,
            )
            self._nb, self._npg = self._nixl.num_blocks, self._nixl.num_pages
        except BaseException:
            self._files.close()
            raise
        self._warm_up(direct)
        self._jobs: dict[int, Job] = {}
        self._done: list[Result] = []
        # Checksums run here, off the engine's thread (torch and numpy release the GIL).
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="iud-kv-sums")
        # Per direction: jobs, bytes, seconds (post to the poll that saw DONE), post_seconds
        # (the engine's thread: checksums, make_prepped_xfer, post, commit or check),
        # poll_seconds and poll_max (the engine's thread in check_xfer_state); loads also blocks
        # checked and blocks found damaged; phase_<phase>_s the jobs' wall time per phase.
        self.stats = {
            d: {
                "jobs": 0,
                "failed": 0,
                "bytes": 0,
                "seconds": 0.0,
                "post_seconds": 0.0,
                "poll_seconds": 0.0,
                "poll_max": 0.0,
                "blocks": 0,
                "bad_blocks": 0,
                "sum_seconds": 0.0,
                # wall seconds of the jobs' phases (Result.phases), summed
                **{f"phase_{ph.value}_s": 0.0 for ph in Phase if ph is not Phase.WAIT},
            }
            for d in ("store", "load")
        }
        # Failed jobs by cause (ENOSPC, EIO, short file, ...), and jobs in flight now.
        self.stats["causes"] = collections.Counter()
        self.stats["in_flight"] = 0
        logger.info(
            "KV store rank %d: %d slot(s) of %d B in %d file(s), %d page(s) per block, "
            "backend %s%s",
            rank,
            geo.num_slots,
            geo.slot_bytes,
            len(self._fds),
            len(self.pages),
            options.backend,
            " O_DIRECT" if options.o_direct else "",
        )

    def _warm_up(self, o_direct: bool) -> None:
        """One round trip of each KV tensor's first page (block 0: vLLM's null block, which
        holds no request's KV) through a private scratch file, so the backend's first-use
        set-up is paid at start-up, not by the first request. A failure costs only that: one
        warning, and the store works as it would have."""
        t0, fd = time.perf_counter(), -1
        try:
            fd = self._files.scratch(scratch_offsets(self.regions)[-1], o_direct)
            self._nixl.round_trip(self.regions, fd, WARM_UP_TIMEOUT_S)
            logger.debug(
                "KV store rank %d: warm-up round trip in %.1f ms",
                self.rank,
                (time.perf_counter() - t0) * 1e3,
            )
        except Exception as e:  # noqa: BLE001 - the store works without it
            logger.warning(
                "KV store rank %d: the warm-up round trip failed (%s); the first job pays "
                "the backend's set-up instead",
                self.rank,
                e,
            )
        finally:
            if fd >= 0:
                os.close(fd)

    # ---- jobs ----------------------------------------------------------------------------
    def _indices(self, blocks, slots, subs) -> tuple[np.ndarray, np.ndarray]:
        # In each slot's byte order: slot by slot, and in a slot page by page, then sub-block.
        # A slot is then one range of its file that the backend reads or writes in few large
        # I/Os (IO_URING_DMABUF's staged runs; buffered I/O of one file batches on its page-cache
        # workers), and consecutive GPU blocks of one page, neighbours in the request, merge.
        # Listing page 0 of every block first would scatter a job's consecutive descriptors
        # over all slot files, one page-cache hand-off per page.
        npg = self._npg
        blocks, slots, subs = (np.asarray(x, dtype=np.int64) for x in (blocks, slots, subs))
        if self.geo.blocks_per_chunk == 1:
            # One block per slot (vLLM's default): block by block, its pages in order.
            p = np.arange(npg, dtype=np.int64)[None, :]
            local, remote = blocks[:, None] * npg + p, slots[:, None] * npg + p
        else:
            k = np.repeat(np.arange(len(blocks)), npg)
            p = np.tile(np.arange(npg, dtype=np.int64), len(blocks))
            order = np.lexsort((subs[k], p, slots[k]))  # slot, then page, then sub-block
            k, p = k[order], p[order]
            local = blocks[k] * npg + p
            remote = (slots[k] * self.geo.blocks_per_chunk + subs[k]) * npg + p
        return local.reshape(-1).astype(np.int32), remote.reshape(-1).astype(np.int32)

    def _check_pairs(self, blocks, slots, subs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        blocks, slots, subs = (np.asarray(x, dtype=np.int64) for x in (blocks, slots, subs))
        if not (len(blocks) == len(slots) == len(subs)):
            raise ValueError("blocks, slots and sub-blocks differ in length")
        if len(blocks) and (
            blocks.min() < 0
            or blocks.max() >= self._nb
            or slots.min() < 0
            or slots.max() >= self.geo.num_slots
            or subs.min() < 0
            or subs.max() >= self.geo.blocks_per_chunk
        ):
            raise ValueError("a block, slot or sub-block index is out of range")
        return blocks, slots, subs

    def submit_store(
        self,
        job_id: int,
        blocks,
        slots,
        subs,
        commits: Sequence[tuple[bytes, int, int]],
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Store KV rows `blocks[i]` into (slots[i], subs[i]); commit (key, slot, gen) for each
        slot once the transfer is DONE (every sub-block of the slot must be in the job)."""
        blocks, slots, subs = self._check_pairs(blocks, slots, subs)
        job = Job(job_id, True, blocks, slots, subs, ready, commits=list(commits))
        self._add(job)

    def submit_load(
        self,
        job_id: int,
        blocks,
        slots,
        subs,
        expected: Sequence[int],
        gens: Sequence[int],
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Load (slots[i], subs[i]) into KV rows `blocks[i]`; `expected[i]` is that sub-block's
        checksum on this rank, `gens[i]` the store generation (for DAMAGED records)."""
        blocks, slots, subs = self._check_pairs(blocks, slots, subs)
        job = Job(
            job_id, False, blocks, slots, subs, ready, expected=list(expected), gens=list(gens)
        )
        self._add(job)

    def _add(self, job: Job) -> None:
        if job.job_id in self._jobs:
            raise ValueError(f"job {job.job_id} is already in flight")
        self._jobs[job.job_id] = job
        self.stats["in_flight"] = len(self._jobs)
        self._advance(job)

    def _start_sums(self, job: Job, blocks: np.ndarray):
        """Checksums of `blocks`, pending: queued on the device from this thread where the worker
        can (launch_sums), else computed in the checksum thread."""
        st = self.stats["store" if job.store else "load"]
        if self._launch_sums is None:
            return self._pool.submit(self._timed_sums, st, blocks)
        t = time.perf_counter()
        pending = self._launch_sums(blocks)
        st["sum_seconds"] += time.perf_counter() - t
        return pending

    def _timed_sums(self, st: dict, blocks: np.ndarray) -> list[int]:
        """Block checksums in the checksum thread; its time goes to the job counters."""
        t = time.perf_counter()
        try:
            return self._block_sums(blocks)
        finally:
            st["sum_seconds"] += time.perf_counter() - t

    def _post_parts(self, job: Job) -> None:
        """Cuts the job into parts of whole slots and posts each. A part NIXL refuses ends the
        posting; the parts already posted still run to their end before the job fails."""
        t = time.perf_counter()
        per_part = max(1, self.part_bytes // max(1, sum(self.pages)))
        job.parts = [Part(pos) for pos in parts_of(job.slots, per_part)]
        for part in job.parts:
            try:
                local, remote = self._indices(
                    job.blocks[part.pos], job.slots[part.pos], job.subs[part.pos]
                )
                part.handle = self._nixl.prep(job.store, local, remote)
                if self._nixl.start(part.handle) == "ERR":
                    raise RuntimeError("NIXL refused to post the transfer")
            except Exception as e:  # noqa: BLE001 - the job fails once its posted parts end
                part.error = e
                for rest in job.parts:
                    rest.over = rest.over or rest.handle is None or rest is part
                break
        job.post_s += time.perf_counter() - t

    def _poll_parts(self, job: Job) -> bool:
        """Moves the job's parts on; a load's part that is DONE gets its checksums queued.
        Whether every part is over."""
        for part in job.in_flight():
            t = time.perf_counter()
            try:
                state = self._nixl.state(part.handle)
            except Exception as e:  # noqa: BLE001 - this part failed; NIXL says no more
                state, part.error = "ERR", e
            self._timed_poll(job, time.perf_counter() - t)
            if state == "PROC":
                continue
            part.over = True
            if state != "DONE":
                part.error = part.error or RuntimeError(f"NIXL transfer state {state}")
            elif not job.store:
                part.sums = self._start_sums(job, job.blocks[part.pos])
        if not job.store:  # fold the checksums that are in while later parts still move
            for part in job.parts:
                if part.got is None and part.sums is not None and part.sums.done():
                    part.got = part.sums.result()
        return not job.in_flight()

    def _advance(self, job: Job) -> Result | None:
        """One step of a job (never waits): as far through its phases (Phase) as it can go
        now; its Result once it is over. Its parts are always over before it is."""
        failure, failed_in = None, None
        try:
            if job.phase is Phase.WAIT:
                if job.ready is not None and not job.ready():
                    return None
                job.t0 = time.perf_counter()
                job.enter(Phase.POST if len(job.blocks) else Phase.FINISH, job.t0)
            if job.phase is Phase.POST:
                if job.store:  # the rows' checksums, read beside the transfer that reads them
                    job.sums = self._start_sums(job, job.blocks)
                self._post_parts(job)
                job.enter(Phase.XFER)
            if job.phase is Phase.XFER:
                if not self._poll_parts(job):
                    return None
                error = job.first_error()
                if error is not None:
                    raise error
                job.enter(Phase.CHECK)
            if job.phase is Phase.CHECK:
                pending = [job.sums] if job.store else [p.sums for p in job.parts]
                if not all(x.done() for x in pending):
                    return None
                job.enter(Phase.FINISH)
            t = time.perf_counter()
            res = self._finish(job)
            job.post_s += time.perf_counter() - t
            job.enter(Phase.WAIT)  # over: closes the FINISH phase's time
            res.phases = job.phases
        except Exception as e:  # noqa: BLE001 - the job is over, reported failed
            failure, failed_in = e, job.phase
        self._release(job)
        if failure is not None:
            error, cause = str(failure), cause_of(failure)
            if failed_in in (Phase.POST, Phase.XFER) and not isinstance(failure, OSError):
                # NIXL says only that the backend failed: look at the files for the cause.
                found, cause = diagnose(
                    self._root,
                    self.geo,
                    self.rank,
                    self._fds,
                    job.slots,
                    job.store,
                    self.geo.blocks_per_chunk * sum(self.pages),
                )
                error = f"{error}; cause: {found}"
            self.stats["causes"][cause] += 1
            logger.error(
                "KV store rank %d: %s job %d failed: %s",
                self.rank,
                "store" if job.store else "load",
                job.job_id,
                error,
            )
            res = Result(job.job_id, job.store, False, error=error)
        del self._jobs[job.job_id]
        self.stats["in_flight"] = len(self._jobs)
        self._done.append(res)
        st = self.stats["store" if job.store else "load"]
        st["jobs"] += 1
        st["failed"] += not res.ok
        st["bytes"] += res.nbytes
        st["seconds"] += res.seconds
        st["post_seconds"] += job.post_s
        st["blocks"] += len(job.blocks) if res.ok else 0
        st["bad_blocks"] += len(res.bad_blocks)
        for k, v in res.phases.items():
            st[f"phase_{k}_s"] += v
        return res

    def _timed_poll(self, job: Job, dt: float) -> None:
        st = self.stats["store" if job.store else "load"]
        st["poll_seconds"] += dt
        st["poll_max"] = max(st["poll_max"], dt)

    def _finish(self, job: Job) -> Result:
        nbytes = len(job.blocks) * sum(self.pages)
        res = Result(job.job_id, job.store, True, nbytes, time.perf_counter() - job.t0)
        if job.store:
            sums: dict[int, dict[int, int]] = {}
            for slot, sub, h in zip(
                job.slots.tolist(), job.subs.tolist(), job.sums.result() if job.sums else []
            ):
                sums.setdefault(slot, {})[sub] = h
            recs = []
            bpc = self.geo.blocks_per_chunk
            for key, slot, gen in job.commits:
                subs = sums.get(slot, {})
                if len(subs) != bpc:
                    logger.warning(
                        "KV store rank %d: slot %d got %d of %d sub-blocks; not committed",
                        self.rank,
                        slot,
                        len(subs),
                        bpc,
                    )
                    continue
                recs.append(
                    journal.commit(
                        key, slot, gen, bpc * sum(self.pages), [subs[j] for j in range(bpc)]
                    )
                )
            if self.durable:
                self._files.fdatasync(job.slots)
            self._log.append(recs)  # whole or not at all (journal.AppendFailed)
            return res
        got = [0] * len(job.blocks)
        for part in job.parts:
            values = part.got if part.got is not None else part.sums.result()
            for i, h in zip(part.pos.tolist(), values):
                got[i] = h
        bad = [i for i, (g, e) in enumerate(zip(got, job.expected)) if g != e]
        if bad:
            res.bad_blocks = [int(job.blocks[i]) for i in bad]
            slots = sorted({(int(job.slots[i]), int(job.gens[i])) for i in bad})
            logger.warning(
                "KV store rank %d: load job %d: %d block(s) do not match their checksum (slots %s)",
                self.rank,
                job.job_id,
                len(bad),
                [s for s, _ in slots],
            )
            try:
                self._log.append([journal.damaged(s, g) for s, g in slots])
            except OSError as e:  # the blocks are still reported bad; only the record is lost
                logger.error("KV store rank %d: DAMAGED record not written: %s", self.rank, e)
        return res

    def _release(self, job: Job) -> None:
        """Releases the job's transfers; only once every part is over (see _advance)."""
        for part in job.parts:
            if part.handle is None:
                continue
            try:
                self._nixl.release(part.handle)
            except Exception as e:  # noqa: BLE001
                logger.error("KV store rank %d: releasing job %d: %s", self.rank, job.job_id, e)
            part.handle = None

    def poll(self) -> list[Result]:
        for job in list(self._jobs.values()):
            self._advance(job)
        out, self._done = self._done, []
        return out

    def wait(self, job_ids, timeout: float = 600.0) -> None:
        """Blocks until the given jobs are over; their results stay for the next poll()."""
        deadline = time.monotonic() + timeout
        while any(j in self._jobs for j in job_ids):
            for j in list(job_ids):
                job = self._jobs.get(j)
                if job is not None:
                    self._advance(job)
            if any(j in self._jobs for j in job_ids):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"KV store jobs {sorted(job_ids)} not over in {timeout} s")
                time.sleep(0.0002)

    def in_flight(self) -> int:
        return len(self._jobs)

    # ---- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.wait(list(self._jobs), timeout=60)
        except Exception as e:  # noqa: BLE001
            logger.error("KV store rank %d: jobs still in flight at close: %s", self.rank, e)
        self._nixl.close()
        self._files.close()
        self._pool.shutdown(wait=False)
