"""The worker side: vLLM's OffloadingWorker over one rank's RankStore. It turns vLLM's KV views
(CanonicalKVCaches: one int8 (num_blocks, page) tensor per layer, VRAM or DRAM) into NIXL
regions once, and each job's GPU block ids and slots into (block, slot, sub-block) pairs.

Ordering with the device (CUDA): a job records an event on the engine's current stream when it
is submitted and is posted only once that event has completed (polled, never waited for), so a
store reads the blocks after the forward pass that wrote them and a load writes its blocks
after the work queued on them before (vLLM's zeroing); vLLM uses loaded blocks only after the
job is reported finished. On CUDA the engine's thread queues a job's checksums on a side stream
(a few large operations per layer) and polls their event: no Python thread runs them, because a
thread that issues many small torch calls waits for the GIL each time while the engine's thread
runs (measured on the H200: 0.6-0.9 s per 4 GiB load job that way). On the CPU platform the
engine's thread computes them at once, for the same reason, and jobs start at once.

Failures: vLLM 0.32/0.33 assert that every job succeeded (offloading/worker.py), so a store
that failed is reported finished and simply not committed (the scheduler then drops the block).
A load whose data failed its checksum (or whose transfer failed) must not reach the model:
under NixlStorageOffloadingConnector its blocks go to vLLM's load-error path (recompute);
under plain OffloadingConnector the worker stops the engine with an error naming the cause.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from . import checksum
from .rankstore import RankStore, Region
from .stats_file import StatsFile
from .specs import NixlLoadSpec, NixlStoreSpec

logger = logging.getLogger(__name__)


class LayoutRefused(ValueError):
    pass


def regions_of(kv_caches: CanonicalKVCaches) -> tuple[list[Region], list, str]:
    """(regions, tensors, NIXL memory kind) of vLLM's KV views; LayoutRefused if the spec
    cannot serve them."""
    groups = kv_caches.group_data_refs
    if len(groups) != 1:
        raise LayoutRefused(f"the model has {len(groups)} KV cache groups (a hybrid model: "
                            "attention with Mamba, sliding-window or cross-attention groups); "
                            "NixlStorageOffloadingSpec serves models with one group")
    pages: dict[int, int] = {}
    for ref in groups[0]:
        pages[ref.tensor_idx] = max(pages.get(ref.tensor_idx, 0), int(ref.page_size_bytes))
    regions, tensors, kinds = [], [], set()
    for idx, page in pages.items():
        t = kv_caches.tensors[idx].tensor
        if t.dim() != 2 or t.element_size() != 1 or t.stride(1) != 1 or t.stride(0) < page \
                or t.shape[1] < page:
            raise LayoutRefused(f"KV tensor {idx} is not rows of contiguous blocks (shape "
                                f"{tuple(t.shape)}, strides {t.stride()}, page {page} B): a "
                                "layout whose block is not contiguous per layer is not served")
        dev = t.device
        if dev.type == "cuda":
            kinds.add("VRAM")
            dev_id = dev.index if dev.index is not None else 0
        elif dev.type == "cpu":
            kinds.add("DRAM")
            dev_id = 0
        else:
            raise LayoutRefused(f"KV tensors on {dev.type} are not served (CUDA or CPU only)")
        checksum.check_page_bytes(page)
        regions.append(Region(t.data_ptr(), t.stride(0), t.shape[0], page, dev_id))
        tensors.append(t)
    if len(kinds) != 1:
        raise LayoutRefused(f"KV tensors on several kinds of memory: {sorted(kinds)}")
    return regions, tensors, kinds.pop()


def pairs_of(gpu: GPULoadStoreSpec, num_chunks: int, bpc: int):
    """(block ids, chunk index, sub-block) of each GPU block of a one-group job."""
    sizes, starts = list(gpu.group_sizes), list(gpu.block_indices)
    if len(sizes) != 1:
        raise ValueError(f"a job over {len(sizes)} KV cache groups")
    n, skip = int(sizes[0]), int(starts[0]) % bpc
    blocks = np.asarray(gpu.block_ids[:n], dtype=np.int64)
    k = np.arange(n, dtype=np.int64) + skip
    chunk, sub = k // bpc, k % bpc
    if n and int(chunk[-1]) + 1 != num_chunks:
        raise ValueError(f"{n} block(s) starting at sub-block {skip} do not fill the job's "
                         f"{num_chunks} chunk(s) of {bpc}")
    return blocks, chunk, sub


class NixlStorageWorker(OffloadingWorker):
    def __init__(self, spec, kv_caches: CanonicalKVCaches):
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
        self.store = RankStore(cfg.path, spec.geometry, self.rank, regions, kind,
                               backend=cfg.backend, backend_params=dict(cfg.backend_params),
                               o_direct=cfg.o_direct, durable=cfg.durable,
                               preallocate=cfg.preallocate, launch_sums=self._launch_sums)
        self.report_load_errors = False  # NixlStorageOffloadingConnector sets it
        self._load_blocks: dict[int, np.ndarray] = {}
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

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: NixlStoreSpec) -> bool:
        blocks, chunk, sub = pairs_of(src_spec, len(dst_spec.slots), self.bpc)
        commits = list(zip(dst_spec.keys, dst_spec.slots.tolist(), dst_spec.gens.tolist()))
        self.store.submit_store(job_id, blocks, dst_spec.slots[chunk], sub, commits,
                                self._ready())
        return True

    def submit_load(self, job_id: int, src_spec: NixlLoadSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        blocks, chunk, sub = pairs_of(dst_spec, len(src_spec.slots), self.bpc)
        sums = src_spec.sums[self.rank]
        expected = [sums[c][s] for c, s in zip(chunk.tolist(), sub.tolist())]
        self._load_blocks[job_id] = blocks
        self.store.submit_load(job_id, blocks, src_spec.slots[chunk], sub, expected,
                               src_spec.gens[chunk], self._ready())
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        for r in self.store.poll():
            if not r.store:
                blocks = self._load_blocks.pop(r.job_id, np.empty(0, dtype=np.int64))
                bad = r.bad_blocks if r.ok else blocks.tolist()
                if bad:
                    self._load_failed(r, bad)
            elif not r.ok:
                logger.warning("KV store: store job %d failed (%s); its blocks are not kept",
                               r.job_id, r.error)
            out.append(TransferResult(r.job_id, True, r.nbytes or None,
                                      r.seconds if r.nbytes else None))
        if out and self._stats_file:
            self._stats_file.publish(self._stats_snapshot())
        return out

    def _stats_snapshot(self) -> dict:
        stats = {k: dict(v) if isinstance(v, dict) else v for k, v in self.store.stats.items()}
        return {"rank": self.rank, "backend": self.store.backend, **stats}

    def _load_failed(self, r, bad: list[int]) -> None:
        what = (f"{len(bad)} KV block(s) of load job {r.job_id} "
                + (f"failed their checksum" if r.ok else f"were not read ({r.error})"))
        if self.report_load_errors:
            logger.warning("KV store: %s; vLLM recomputes them", what)
            self._failed_blocks.update(int(b) for b in bad)
            return
        raise RuntimeError(
            f"KV store: {what}. vLLM's OffloadingConnector cannot take a failed load back, and "
            "the model must not use these blocks, so the engine stops. Use kv_connector "
            "NixlStorageOffloadingConnector (kv_connector_module_path "
            "nixl_io_uring_dmabuf.vllm_connector, kv_load_failure_policy recompute) to have "
            "vLLM recompute such blocks instead.")

    def take_failed_block_ids(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def wait(self, job_ids: set[int]) -> None:
        self.store.wait(set(job_ids))

    def shutdown(self) -> None:
        self.store.close()
        if self._stats_file:
            self._stats_file.close()
