"""vLLM's KV memory as the store sees it: the engine's KV views (CanonicalKVCaches) as NIXL
regions, and the device side of a job as KV rows. vLLM 0.32/0.33 name a job's blocks by id
(GPULoadStoreSpec); vLLM 0.34 hands flat device pointers (DevicePointers, built by its
`pointer_utils.resolve_device_pointers`), which are mapped back to rows of the registered tensors
and checked against them, so a pointer outside those tensors can never be read or written."""

from __future__ import annotations

import dataclasses

import numpy as np

from . import checksum
from .rankstore import Region


class LayoutRefused(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """A job's KV rows of its one group, in the job's order; `first_index` is the logical index
    of the first block in its request (where the first chunk may start part-way)."""

    blocks: np.ndarray
    first_index: int

    def pairs(self, num_chunks: int, bpc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, chunk index, sub-block) of each block; ValueError if the blocks do not fill
        the job's chunks."""
        n, skip = len(self.blocks), self.first_index % bpc
        k = np.arange(n, dtype=np.int64) + skip
        chunk, sub = k // bpc, k % bpc
        if n and int(chunk[-1]) + 1 != num_chunks:
            raise ValueError(
                f"{n} block(s) starting at sub-block {skip} do not fill the job's "
                f"{num_chunks} chunk(s) of {bpc}"
            )
        return self.blocks, chunk, sub


def regions_of(kv_caches) -> tuple[list[Region], list, str]:
    """(regions, tensors, NIXL memory kind) of vLLM's KV views; LayoutRefused if the spec
    cannot serve them."""
    groups = kv_caches.group_data_refs
    if len(groups) != 1:
        raise LayoutRefused(
            f"the model has {len(groups)} KV cache groups (a hybrid model: attention with "
            "Mamba, sliding-window or cross-attention groups); NixlStorageOffloadingSpec "
            "serves models with one group"
        )
    pages: dict[int, int] = {}
    for ref in groups[0]:
        pages[ref.tensor_idx] = max(pages.get(ref.tensor_idx, 0), int(ref.page_size_bytes))
    regions, tensors, kinds = [], [], set()
    for idx, page in pages.items():
        t = kv_caches.tensors[idx].tensor
        if (
            t.dim() != 2
            or t.element_size() != 1
            or t.stride(1) != 1
            or t.stride(0) < page
            or t.shape[1] < page
        ):
            raise LayoutRefused(
                f"KV tensor {idx} is not rows of contiguous blocks (shape {tuple(t.shape)}, "
                f"strides {t.stride()}, page {page} B): a layout whose block is not contiguous "
                "per layer is not served"
            )
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


def run_of_block_ids(gpu) -> BlockRun:
    """vLLM 0.32/0.33: the rows of a one-group GPULoadStoreSpec."""
    sizes, starts = list(gpu.group_sizes), list(gpu.block_indices)
    if len(sizes) != 1:
        raise ValueError(f"a job over {len(sizes)} KV cache groups")
    return BlockRun(np.asarray(gpu.block_ids[: int(sizes[0])], dtype=np.int64), int(starts[0]))


class PointerMap:
    """vLLM 0.34: maps a job's DevicePointers back to KV rows. vLLM lays the pointers out per
    data ref (layer) of the group, each ref's blocks in the job's order, at
    `tensor base + row * row stride` (v1/kv_offload/pointer_utils.py); every pointer and size is
    checked against that, not only the first ref's."""

    def __init__(self, kv_caches):
        refs = kv_caches.group_data_refs[0]
        tensors = [kv_caches.tensors[r.tensor_idx].tensor for r in refs]
        self._base = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
        self._stride = np.array([t.stride(0) for t in tensors], dtype=np.uint64)
        self._rows = min(int(t.shape[0]) for t in tensors)
        self._size = np.array([int(r.page_size_bytes) for r in refs], dtype=np.uint64)

    def run_of(self, ptrs) -> BlockRun:
        counts, nrefs = tuple(ptrs.group_block_counts), tuple(ptrs.group_data_ref_counts)
        if len(counts) != 1:
            raise ValueError(f"a job over {len(counts)} KV cache groups")
        n, m = int(counts[0]), int(nrefs[0])
        if m != len(self._base) or len(ptrs.ptrs) != n * m or len(ptrs.sizes) != n * m:
            raise ValueError(
                f"device pointers for {m} layer(s) x {n} block(s) ({len(ptrs.ptrs)} given) do "
                f"not match the {len(self._base)} registered KV layer(s)"
            )
        if n == 0:
            return BlockRun(np.empty(0, dtype=np.int64), int(ptrs.block_indices[0]))
        p = np.asarray(ptrs.ptrs, dtype=np.uint64).reshape(m, n)
        off = p[0] - self._base[0]  # wraps round for a pointer below the base: out of range
        rows = off // self._stride[0]
        if (rows >= self._rows).any() or (
            p != self._base[:, None] + rows[None, :] * self._stride[:, None]
        ).any():
            raise ValueError("device pointers outside the registered KV tensors' rows")
        if (np.asarray(ptrs.sizes, dtype=np.uint64).reshape(m, n) != self._size[:, None]).any():
            raise ValueError("device pointer sizes differ from the KV layers' page sizes")
        return BlockRun(rows.astype(np.int64), int(ptrs.block_indices[0]))
