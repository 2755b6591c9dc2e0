"""Block checksums of the KV store: one algorithm, computed on host bytes (numpy) and on device
tensors (torch, CPU or CUDA) with identical results, so a block stored from GPU memory can be
checked by the scheduler from the file and by the worker in GPU memory after a load.

A page (one layer's bytes of one block) is read as little-endian int16 words w_i, i < n; its
sums are s1 = sum(w_i) and s2 = sum(w_i * (i mod 65521 + 1)), exact in int64 for pages up to
2**26 bytes (|w_i * m_i| < 2**31, n <= 2**25). A sub-block's checksum folds the (s1, s2) of its
pages, in slot order, into 64 bits (FNV-1a over the two words). Not cryptographic: it detects
damage (zeroed, torn, misplaced or flipped data), not an adversary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

MASK = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MOD = 65521
MAX_PAGE_BYTES = 1 << 26

_weights_np: dict[int, np.ndarray] = {}


def check_page_bytes(page_bytes: int) -> None:
    if page_bytes <= 0 or page_bytes % 2 or page_bytes > MAX_PAGE_BYTES:
        raise ValueError(f"a KV page of {page_bytes} bytes cannot be checksummed (it must be "
                         f"even and at most {MAX_PAGE_BYTES} bytes)")


def _weights(n: int) -> np.ndarray:
    w = _weights_np.get(n)
    if w is None:
        w = (np.arange(n, dtype=np.int64) % _MOD) + 1
        _weights_np[n] = w
    return w


def page_sums(page: np.ndarray) -> tuple[int, int]:
    """(s1, s2) of one page given as a uint8/int8 array of even length."""
    words = np.ascontiguousarray(page).view("<i2").astype(np.int64)
    return int(words.sum()), int((words * _weights(len(words))).sum())


def fold(sums: Iterable[tuple[int, int]]) -> int:
    """The 64-bit checksum of a sub-block from its pages' (s1, s2), in slot order."""
    h = _FNV_OFFSET
    for s1, s2 in sums:
        h = ((h ^ (s1 & MASK)) * _FNV_PRIME) & MASK
        h = ((h ^ (s2 & MASK)) * _FNV_PRIME) & MASK
    return h


def slot_checksums(data: np.ndarray, pages: Sequence[int], count: int) -> list[int]:
    """Checksums of the first `count` sub-blocks in a slot's bytes (`data`, uint8), each sub-block
    being `pages` (bytes per page, slot order) laid end to end."""
    out, off = [], 0
    for _ in range(count):
        parts = []
        for p in pages:
            parts.append(page_sums(data[off:off + p]))
            off += p
        out.append(fold(parts))
    return out


class TorchRows:
    """Page sums of rows of 2-D int8 tensors (vLLM's per-layer KV views, CPU or CUDA) with the
    same results as `page_sums`. Work runs on the tensors' device; only the sums come back."""

    def __init__(self, tensors: Sequence, pages: Sequence[int], max_bytes: int = 64 << 20):
        import torch

        self._torch = torch
        self._tensors = list(tensors)
        self._pages = list(pages)
        self._weights: dict[tuple[int, str], object] = {}
        self._max_bytes = max_bytes

    def _w(self, n: int, device):
        k = (n, str(device))
        w = self._weights.get(k)
        if w is None:
            t = self._torch
            w = (t.arange(n, dtype=t.int64, device=device) % _MOD) + 1
            self._weights[k] = w
        return w

    def sums(self, piece: int, block_ids: np.ndarray) -> list[tuple[int, int]]:
        """(s1, s2) of page `piece` of each block in `block_ids` (blocks = tensor rows)."""
        t = self._torch
        tensor, page = self._tensors[piece], self._pages[piece]
        n = page // 2
        out: list[tuple[int, int]] = []
        step = max(1, self._max_bytes // (page * 8))  # int64 working copy per batch
        ids = t.as_tensor(np.asarray(block_ids, dtype=np.int64), device=tensor.device)
        w = self._w(n, tensor.device)
        for i in range(0, len(ids), step):
            rows = tensor.index_select(0, ids[i:i + step])[:, :page].contiguous()
            words = rows.view(t.int16).to(t.int64)
            s1 = words.sum(dim=1)
            s2 = (words * w).sum(dim=1)
            out.extend(zip(s1.tolist(), s2.tolist()))
        return out
