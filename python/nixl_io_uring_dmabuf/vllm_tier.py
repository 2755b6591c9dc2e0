"""vLLM KV-offload tier: stores and loads KV chunks between vLLM's CPU primary tier and files
through NIXL, with the NIXL backend IO_URING_DMABUF.

vLLM 0.33 and 0.34 have no NIXL file tier in tree; their multi-tier offloading (TieringOffloadingSpec) loads
out-of-tree tiers named by a `secondary_tiers` entry with `type` (the class name) and
`module_path` (vllm/v1/kv_offload/tiering/factory.py, SecondaryTierFactory.get_tier_class; the
other keys of the entry are passed to the constructor). Configuration:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 17179869184,
        "secondary_tiers": [{"type": "NixlFileTier",
                             "module_path": "nixl_io_uring_dmabuf.vllm_tier",
                             "path": "/mnt/nvme/vllm-kv", "direct_io": true}]}}'

The tier runs in vLLM's scheduler process (SecondaryTierManager contract: lightweight,
non-blocking calls under the tiering manager's lock). The primary tier's CPU buffer (the
memoryview vLLM hands over, one row per chunk) is registered with NIXL once as DRAM. Each job
follows the per-job shape of vLLM's own OBJ tier engine (tiering/obj): open one file per chunk,
register them as FILE, one un-prepped transfer, polled from get_finished_jobs(); then release,
deregister, close. A store writes <key>.kv.tmp and renames it when the transfer is DONE, so a
crash never leaves a partial chunk under its final name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Job:
    job: TransferJob
    store: bool
    keys: list
    fds: list
    paths: list  # final paths (store: renamed to on success)
    handle: Any = None
    reg: Any = None
    bytes: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)


class NixlFileTier(SecondaryTierManager):
    """A secondary tier of one file per KV chunk in `path`, moved by NIXL (`backend`)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        path: str,
        backend: str = "IO_URING_DMABUF",
        backend_params: dict | None = None,
        direct_io: bool = False,
        backpressure_detector=None,
        **unused: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        from nixl._api import nixl_agent, nixl_agent_config

        if unused:
            logger.info("NixlFileTier ignores the tier parameters %s", sorted(unused))
        self._path = path
        os.makedirs(path, exist_ok=True)
        self._flags = os.O_DIRECT if direct_io else 0
        self._backend = backend
        self._primary = np.asarray(primary_kv_view)  # (num_chunks, chunk bytes), no copy
        self._base = self._primary.ctypes.data
        self._stride = self.block_size_bytes
        self._agent = nixl_agent(
            f"NixlFileTier-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[])
        )
        self._agent.create_backend(backend, dict(backend_params or {}))
        self._mem_reg = self._agent.register_memory(
            [(self._base, self._primary.nbytes, 0, "")], "DRAM", backends=[backend]
        )
        self._present: set = set()
        self._storing: set = set()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []

    # ---- naming ---------------------------------------------------------------------------
    def _file(self, key: OffloadKey) -> str:
        return os.path.join(self._path, bytes(key).hex() + ".kv")

    # ---- SecondaryTierManager -------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._storing:
            return LookupResult.RETRY
        if key in self._present or os.path.exists(self._file(key)):
            self._present.add(key)
            return LookupResult.HIT
        return LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, job_metadata: TransferJob) -> None:
        pairs = [
            (k, int(c))
            for k, c in zip(job_metadata.keys, job_metadata.chunk_ids)
            if k not in self._present and k not in self._storing
        ]
        if not pairs:
            self._finished.append(
                JobResult(job_metadata.job_id, True, transfer_time=0.0, transfer_bytes=0)
            )
            return
        paths = [self._file(k) for k, _ in pairs]
        fds = []
        try:
            for p in paths:
                fds.append(
                    os.open(p + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC | self._flags, 0o644)
                )
        except OSError as e:
            self._close(fds, [p + ".tmp" for p in paths[: len(fds)]])
            logger.error(
                "NixlFileTier: store job %d cannot open its files: %s", job_metadata.job_id, e
            )
            self._finished.append(JobResult(job_metadata.job_id, False))
            return
        job = _Job(job_metadata, True, [k for k, _ in pairs], fds, paths)
        self._storing.update(job.keys)
        self._start(job, "WRITE", [c for _, c in pairs])

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        paths = [self._file(k) for k in keys]
        fds = []
        try:
            for p in paths:
                fds.append(os.open(p, os.O_RDONLY | self._flags))
        except OSError as e:  # evicted or never stored: the whole job fails, as a miss
            self._close(fds, [])
            logger.warning("NixlFileTier: load job %d: %s", job_metadata.job_id, e)
            self._finished.append(JobResult(job_metadata.job_id, False))
            return
        job = _Job(job_metadata, False, keys, fds, paths)
        self._start(job, "READ", [int(c) for c in job_metadata.chunk_ids])

    def _start(self, job: _Job, op: str, chunk_ids: list[int]) -> None:
        a, s = self._agent, self._stride
        try:
            job.reg = a.register_memory(
                [(0, s, fd, "") for fd in job.fds], "FILE", backends=[self._backend]
            )
            mem = a.get_xfer_descs([(self._base + c * s, s, 0) for c in chunk_ids], "DRAM")
            files = a.get_xfer_descs([(0, s, fd) for fd in job.fds], "FILE")
            job.handle = a.initialize_xfer(op, mem, files, a.name, backends=[self._backend])
            job.bytes = s * len(chunk_ids)
            a.transfer(job.handle)
        except Exception as e:
            logger.error("NixlFileTier: %s job %d failed to start: %s", op, job.job.job_id, e)
            self._finish(job, False)
            return
        self._jobs[job.job.job_id] = job

    def get_finished_jobs(self) -> Iterable[JobResult]:
        for job_id, job in list(self._jobs.items()):
            try:
                state = self._agent.check_xfer_state(job.handle)
            except Exception as e:
                logger.error("NixlFileTier: job %d failed: %s", job_id, e)
                state = "ERR"
            if state in ("DONE", "ERR"):
                del self._jobs[job_id]
                self._finish(job, state == "DONE")
        out, self._finished = self._finished, []
        return out

    def _finish(self, job: _Job, ok: bool) -> None:
        if job.handle is not None:
            self._agent.release_xfer_handle(job.handle)
        if job.reg is not None:
            self._agent.deregister_memory(job.reg, backends=[self._backend])
        tmp = [p + ".tmp" for p in job.paths] if job.store else []
        self._close(job.fds, [] if ok else tmp)
        if job.store:
            if ok:
                for p in job.paths:
                    os.replace(p + ".tmp", p)
                self._present.update(job.keys)
            self._storing.difference_update(job.keys)
        self._finished.append(
            JobResult(
                job.job.job_id,
                ok,
                transfer_time=time.perf_counter() - job.t0,
                transfer_bytes=job.bytes if ok else None,
            )
        )

    @staticmethod
    def _close(fds: list, unlink: list) -> None:
        for fd in fds:
            os.close(fd)
        for p in unlink:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        while self._jobs:
            pending = self.get_finished_jobs()
            self._finished.extend(pending)  # keep them for the next get_finished_jobs()
            if self._jobs:
                time.sleep(0.001)

    def shutdown(self) -> None:
        self.drain_jobs()
        if self._mem_reg is not None:
            self._agent.deregister_memory(self._mem_reg, backends=[self._backend])
            self._mem_reg = None
        self._primary = None  # lets vLLM unmap the primary region
