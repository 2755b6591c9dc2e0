"""The worker side: vLLM's OffloadingWorker over one rank's RankStore. It turns vLLM's KV views
into NIXL regions once (kv_views), and each job's device side and slots into (block, slot,
sub-block) triples. Two thin classes at the end take the job in the form the running vLLM hands
it: block ids (0.32/0.33) or device pointers (0.34); spec.get_worker picks one.

Ordering with the device (CUDA): a job records an event on the engine's current stream when it
is submitted and is posted only once that event has completed (polled, never waited for), so a
store reads the blocks after the forward pass that wrote them and a load writes its blocks
after the work queued on them before (vLLM's zeroing); vLLM uses loaded blocks only after the
job is reported finished. On CUDA the engine's thread queues a job's checksums on a side stream
(a few large operations per layer) and polls their event: a Python thread issuing many small
torch calls would wait for the GIL each time while the engine's thread runs. On the CPU
platform the engine's thread computes them at once, and jobs start at once.

Failures (I/O error, short read, checksum mismatch after a load, a job vLLM handed in a shape
the store cannot take) never reach the model:
- vLLM 0.34 takes a failed job back (offloading/worker.py): a failed store is reported failed
  and not kept; a failed load is reported failed and vLLM recomputes the request (with
  kv_load_failure_policy "recompute"; "fail" ends the request with an error). A load vLLM waits
  for in the same step (a sync load, `expedited`) cannot be taken back that way: under
  NixlStorageOffloadingConnector its blocks go to vLLM's load-error path instead (that
  connector refuses sync loads unless allowed: connector.py says why).
- vLLM 0.32/0.33 assert that every job succeeded, so a failed store is reported finished and
  simply not committed; a failed load's blocks go to vLLM's load-error path under
  NixlStorageOffloadingConnector, and under plain OffloadingConnector the worker stops the
  engine with an error naming the cause.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from . import checksum
from .kv_views import BlockRun, PointerMap, regions_of, run_of_block_ids
from .load_store_specs import NixlLoadSpec, NixlStoreSpec
from .rankstore import RankStore, Result, StoreOptions
from .stats_file import StatsFile

logger = logging.getLogger(__name__)


class NixlStorageWorker(OffloadingWorker):
    #: vLLM takes a job reported with success=False back (0.34); else every job must succeed.
    failed_jobs_reported = False

    def __init__(self, spec, kv_caches):
        cfg = spec.store_config
        self.rank = spec.config.parallel.rank
        self.bpc = spec.blocks_per_chunk
        regions, tensors, kind = regions_of(kv_caches)
        self._cuda = kind == "VRAM"
        self._torch_rows = checksum.TorchRows(tensors, [r.page for r in regions])
        self._torch_rows.self_check()
        self._side = None
        if self._cuda:
            import torch

            self._torch = torch
            self._device = tensors[0].device
            self._side = torch.cuda.Stream(device=self._device)
        self.store = RankStore(
            cfg.path,
            spec.geometry,
            self.rank,
            regions,
            kind,
            StoreOptions(
                backend=cfg.backend,
                backend_params=dict(cfg.backend_params),
                o_direct=cfg.o_direct,
                durable=cfg.durable,
                preallocate=cfg.preallocate,
                overwrite_devices=cfg.overwrite_devices,
            ),
            launch_sums=self._launch_sums,
        )
        self.report_load_errors = False  # NixlStorageOffloadingConnector sets it
        self._load_blocks: dict[int, np.ndarray] = {}
        self._sync_loads: set[int] = set()
        self._refused: list[Result] = []  # jobs refused at submission, reported by get_finished
        self._failed_blocks: set[int] = set()
        # Benchmarks: the RankStore's job counters, rewritten after each poll that ended jobs.
        stats_path = os.environ.get("IUD_KV_STATS_FILE")
        self._stats_file = StatsFile(stats_path, self.rank) if stats_path else None

    def _launch_sums(self, blocks: np.ndarray):
        if self._side is None:  # CPU platform: computed here, at once
            return self._torch_rows.launch(blocks)
        with self._torch.cuda.device(self._device), self._torch.cuda.stream(self._side):
            return self._torch_rows.launch(blocks)

    def _ready(self):
        if not self._cuda:
            return None
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self._device))
        return ev.query

    # ---- jobs, whatever form vLLM hands them in ----------------------------------------------
    def _store(self, job_id: int, run_of, dst_spec: NixlStoreSpec) -> bool:
        """`run_of()` gives the job's KV rows; a job that cannot be taken is reported failed by
        the next get_finished (vLLM requires submit_* to return True)."""
        try:
            blocks, chunk, sub = run_of().pairs(len(dst_spec.slots), self.bpc)
            commits = list(zip(dst_spec.keys, dst_spec.slots.tolist(), dst_spec.gens.tolist()))
            self.store.submit_store(
                job_id, blocks, dst_spec.slots[chunk], sub, commits, self._ready()
            )
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            self._refuse(job_id, True, e)
        return True

    def _load(self, job_id: int, src_spec: NixlLoadSpec, run_of, expedited: bool) -> bool:
        if expedited:
            self._sync_loads.add(job_id)
        try:
            run: BlockRun = run_of()
            self._load_blocks[job_id] = run.blocks
            blocks, chunk, sub = run.pairs(len(src_spec.slots), self.bpc)
            sums = src_spec.sums[self.rank]
            expected = [sums[c][s] for c, s in zip(chunk.tolist(), sub.tolist())]
            self.store.submit_load(
                job_id,
                blocks,
                src_spec.slots[chunk],
                sub,
                expected,
                src_spec.gens[chunk],
                self._ready(),
            )
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            self._refuse(job_id, False, e)
        return True

    def _refuse(self, job_id: int, store: bool, e: Exception) -> None:
        what = "store" if store else "load"
        logger.error("KV store rank %d: %s job %d refused: %s", self.rank, what, job_id, e)
        self._refused.append(Result(job_id, store, False, error=f"{type(e).__name__}: {e}"))

    def get_finished(self) -> list[TransferResult]:
        out = []
        results, self._refused = self._refused + self.store.poll(), []
        for r in results:
            ok = r.ok
            if not r.store:
                blocks = self._load_blocks.pop(r.job_id, None)
                if not r.ok or r.bad_blocks:
                    bad = r.bad_blocks if r.ok else None if blocks is None else blocks.tolist()
                    ok = self._load_failed(r, bad)
                self._sync_loads.discard(r.job_id)
            elif not r.ok:
                logger.warning(
                    "KV store: store job %d failed (%s); its blocks are not kept",
                    r.job_id,
                    r.error,
                )
            if not self.failed_jobs_reported:
                ok = True  # vLLM 0.32/0.33 assert success; the failure was handled above
            sized = ok and r.nbytes
            out.append(
                TransferResult(
                    r.job_id, ok, r.nbytes if sized else None, r.seconds if sized else None
                )
            )
        if out and self._stats_file:
            self._stats_file.publish(self._stats_snapshot())
        return out

    def _stats_snapshot(self) -> dict:
        stats = {k: dict(v) if isinstance(v, dict) else v for k, v in self.store.stats.items()}
        return {"rank": self.rank, "backend": self.store.backend, **stats}

    def _load_failed(self, r: Result, bad: list[int] | None) -> bool:
        """Whether the job may still be reported as a success: only when its failed blocks
        (None: not known, the job was refused before its blocks were) go to vLLM's load-error
        path instead."""
        what = f"{'the' if bad is None else len(bad)} KV block(s) of load job {r.job_id} " + (
            "failed their checksum" if r.ok else f"were not read ({r.error})"
        )
        sync = r.job_id in self._sync_loads
        if bad is not None and self.report_load_errors and (sync or not self.failed_jobs_reported):
            logger.warning("KV store: %s; vLLM recomputes them", what)
            self._failed_blocks.update(int(b) for b in bad)
            return True
        if self.failed_jobs_reported and not sync:
            logger.warning(
                "KV store: %s; the job is reported failed and vLLM recomputes the "
                "request (kv_load_failure_policy recompute; 'fail' ends it)",
                what,
            )
            return False
        if self.failed_jobs_reported:
            logger.error(
                "KV store: %s in a sync load; vLLM's OffloadingConnector stops on a "
                "failed sync load. Use kv_connector NixlStorageOffloadingConnector to "
                "have these blocks recomputed",
                what,
            )
            return False
        raise RuntimeError(
            f"KV store: {what}. vLLM's OffloadingConnector cannot take a failed load back, and "
            "the model must not use these blocks, so the engine stops. Use kv_connector "
            "NixlStorageOffloadingConnector (kv_connector_module_path "
            "nixl_io_uring_dmabuf.vllm_connector, kv_load_failure_policy recompute) to have "
            "vLLM recompute such blocks instead."
        )

    def take_failed_block_ids(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.store.wait(set(job_ids))

    def shutdown(self) -> None:
        self.store.close()
        if self._stats_file:
            self._stats_file.close()


class BlockIdsWorker(NixlStorageWorker):
    """vLLM 0.32/0.33: a job's device side is a GPULoadStoreSpec of block ids."""

    def submit_store(self, job_id: int, src_spec, dst_spec: NixlStoreSpec) -> bool:
        return self._store(job_id, lambda: run_of_block_ids(src_spec), dst_spec)

    def submit_load(
        self, job_id: int, src_spec: NixlLoadSpec, dst_spec, expedited: bool = False
    ) -> bool:
        return self._load(job_id, src_spec, lambda: run_of_block_ids(dst_spec), expedited)


class DevicePointersWorker(NixlStorageWorker):
    """vLLM 0.34: a job's device side is DevicePointers; failed jobs are reported failed."""

    failed_jobs_reported = True

    def __init__(self, spec, kv_caches):
        super().__init__(spec, kv_caches)
        self._pointers = PointerMap(kv_caches)

    def submit_store(self, job_id: int, device_ptrs, dst_spec: NixlStoreSpec) -> bool:
        return self._store(job_id, lambda: self._pointers.run_of(device_ptrs), dst_spec)

    def submit_load(
        self, job_id: int, src_spec: NixlLoadSpec, device_ptrs, expedited: bool = False
    ) -> bool:
        return self._load(job_id, src_spec, lambda: self._pointers.run_of(device_ptrs), expedited)
