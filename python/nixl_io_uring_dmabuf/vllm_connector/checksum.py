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

import functools
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
        raise ValueError(
            f"a KV page of {page_bytes} bytes cannot be checksummed (it must be "
            f"even and at most {MAX_PAGE_BYTES} bytes)"
        )


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


def slot_checksums(
    data: np.ndarray, pages: Sequence[int], runs: Sequence[int], count: int
) -> list[int]:
    """Checksums of the `count` sub-blocks in a slot's bytes (`data`, uint8): page p of
    sub-block j is at runs[p] + j * pages[p] (layout.page_runs)."""
    return [
        fold([page_sums(data[r + j * p : r + (j + 1) * p]) for p, r in zip(pages, runs)])
        for j in range(count)
    ]


def fold_columns(s1: np.ndarray, s2: np.ndarray) -> list[int]:
    """`fold` of many sub-blocks at once: s1, s2 are (pages, blocks) int64 arrays of page sums,
    pages in slot order; returns one checksum per block."""
    h = np.full(s1.shape[1], _FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    a1, a2 = s1.astype(np.int64).view(np.uint64), s2.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        for p in range(s1.shape[0]):
            h = (h ^ a1[p]) * prime
            h = (h ^ a2[p]) * prime
    return [int(x) for x in h]


class PendingSums:
    """Block checksums being computed on a device; `done()` polls, `result()` reads them."""

    def __init__(self, host, event):
        self._host, self._event = host, event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        s = self._host.numpy()
        return fold_columns(s[0], s[1])


@functools.cache
def _triton_page_sums():
    """The page sums as one Triton kernel (one program per (block, page), reading each page once),
    or None where Triton is not installed. Built once per process, so it is compiled once (at
    the worker's self-check), and not specialized on the job's block count."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n_rows", "n_pages"])
    def page_sums(addrs, words, strides, rows, out, n_rows, n_pages, BLOCK: tl.constexpr):
        i = tl.program_id(0)  # the block's position in the job
        p = tl.program_id(1)  # the page (layer)
        base = tl.load(addrs + p).to(tl.pointer_type(tl.int16))
        start = tl.load(rows + i) * tl.load(strides + p)
        n = tl.load(words + p)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        acc2 = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, n, BLOCK):
            j = k + tl.arange(0, BLOCK)
            x = tl.load(base + start + j, mask=j < n, other=0).to(tl.int32)
            acc1 += x.to(tl.int64)
            # |x| <= 32768 and the weight <= 65521: the product fits in int32
            acc2 += (x * (j % 65521 + 1)).to(tl.int64)
        tl.store(out + p * n_rows + i, tl.sum(acc1, axis=0))
        tl.store(out + (n_pages + p) * n_rows + i, tl.sum(acc2, axis=0))

    return page_sums


class TorchRows:
    """Block checksums of rows of 2-D int8 tensors (vLLM's per-layer KV views, CPU or CUDA), the
    same values as `fold(page_sums(...))` over the block's pages. The page sums of all of a job's
    blocks are queued on the tensors' device without waiting (`launch`) on the caller's current
    stream: on CUDA one Triton kernel that reads each page once where Triton is installed (vLLM
    brings it), else a few large torch operations per layer; one copy brings them to host memory,
    where they are folded. Queued from the engine's own thread, the work needs no Python thread,
    so it never waits for the GIL while the engine's thread runs.

    `kernel`: "auto" (Triton on CUDA where installed, else torch), "torch" or "triton"."""

    def __init__(
        self,
        tensors: Sequence,
        pages: Sequence[int],
        max_bytes: int = 256 << 20,
        kernel: str = "auto",
    ):
        import torch

        self._torch = torch
        self._tensors = list(tensors)
        self._pages = list(pages)
        self._weights: dict[tuple[int, str], object] = {}
        self._max_bytes = max_bytes
        self._kernel = None
        dev = self._tensors[0].device
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"checksum kernel {kernel!r}: auto, torch or triton")
        if kernel == "triton" or (kernel == "auto" and dev.type == "cuda"):
            self._kernel = _triton_page_sums()
            if self._kernel is None and kernel == "triton":
                raise RuntimeError(
                    "the Triton checksum kernel needs Triton, which is not installed"
                )
        if self._kernel is not None:
            self._setup_kernel(dev)

    @property
    def kernel(self) -> str:
        return "triton" if self._kernel is not None else "torch"

    def _setup_kernel(self, dev) -> None:
        """Each tensor's address, page and row stride in int16 words, as the kernel reads them."""
        t = self._torch
        for x in self._tensors:
            if x.data_ptr() % 2 or x.stride(0) % 2 or x.stride(1) != 1:
                raise ValueError("a KV tensor's rows are not 2-byte aligned")

        def words(vals):
            return t.tensor(vals, dtype=t.int64, device=dev)

        self._addrs = words([x.data_ptr() for x in self._tensors])
        self._words = words([p // 2 for p in self._pages])
        self._strides = words([x.stride(0) // 2 for x in self._tensors])

    def _w(self, n: int, device):
        k = (n, str(device))
        w = self._weights.get(k)
        if w is None:
            t = self._torch
            # (i mod 65521) + 1 <= 65521 and |w_i| <= 32768: each product fits in int32.
            w = ((t.arange(n, dtype=t.int64, device=device) % _MOD) + 1).to(t.int32)
            self._weights[k] = w
        return w

    def launch(self, block_ids: np.ndarray) -> PendingSums:
        t = self._torch
        dev = self._tensors[0].device
        n = len(block_ids)
        ids = t.as_tensor(np.asarray(block_ids, dtype=np.int64)).to(dev, non_blocking=True)
        out = t.empty((2, len(self._tensors), n), dtype=t.int64, device=dev)
        if self._kernel is not None and n:
            grid = (n, len(self._tensors))
            self._kernel[grid](
                self._addrs,
                self._words,
                self._strides,
                ids,
                out,
                n,
                len(self._tensors),
                BLOCK=1024,
            )
        else:
            self._launch_torch(ids, out)
        if dev.type != "cuda":
            return PendingSums(out, None)
        host = t.empty(out.shape, dtype=t.int64, pin_memory=True)
        host.copy_(out, non_blocking=True)
        ev = t.cuda.Event()
        ev.record()
        return PendingSums(host, ev)

    def _launch_torch(self, ids, out) -> None:
        t = self._torch
        n = len(ids)
        for p, (tensor, page) in enumerate(zip(self._tensors, self._pages)):
            w = self._w(page // 2, tensor.device)
            step = max(1, self._max_bytes // (page * 2))  # int32 working copy per batch
            for i in range(0, n, step):
                rows = tensor.index_select(0, ids[i : i + step])[:, :page].contiguous()
                words = rows.view(t.int16)
                t.sum(words, dim=1, dtype=t.int64, out=out[0, p, i : i + step])
                t.sum(words.to(t.int32) * w, dim=1, dtype=t.int64, out=out[1, p, i : i + step])

    def block_sums(self, block_ids: np.ndarray) -> list[int]:
        """The checksum of each block in `block_ids` (rows of every tensor, pages in order)."""
        return self.launch(block_ids).result() if len(block_ids) else []

    def self_check(self) -> None:
        """The device's arithmetic gives exactly the host algorithm's values (a store's checksums
        are compared across the two); RuntimeError if not."""
        t = self._torch
        dev = self._tensors[0].device
        gen = np.random.default_rng(1)
        pages = [4096, 2048]
        host = [gen.integers(-128, 128, size=(3, p), dtype=np.int8) for p in pages]
        host[0][0, :2] = [0, -128]  # the word -32768, times the largest weight used here
        rows = TorchRows([t.as_tensor(x).to(dev) for x in host], pages, 1 << 12, self.kernel)
        got = rows.block_sums(np.array([2, 0, 1]))
        want = [fold(page_sums(host[p][b].view(np.uint8)) for p in range(2)) for b in (2, 0, 1)]
        if got != want:
            raise RuntimeError(
                f"KV checksums on {dev} differ from the host algorithm ({got} != {want})"
            )
