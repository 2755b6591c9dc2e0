"""Descriptor generators of the test suites: random sizes, and the offsets that lay them out in
memory and in a file. Each takes a numpy Generator, so a failing run repeats from its seed.

- place: offsets that lay sizes out one after the other, in a given order, with gaps;
- spread: non-overlapping random starts inside a span, in a random order (the soak);
- fitting: 1..n descriptors that fit a region, back to back in the file and shuffled in memory
  (the thread and stress tests);
- slotted: one random offset inside each of n disjoint slots, the slots shuffled;
- mixed_layout (a Layout): >= 1000 descriptors of 512 B .. 16 MiB with gaps on both sides, memory
  order a permutation of file order (the round trips);
- scattered_blocks: aligned blocks at random file offsets, packed into a client buffer (the
  storage node's tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGN = 4096
KiB = 1 << 10
MiB = 1 << 20


def place(sizes, order=None, gaps=None) -> np.ndarray:
    """Offsets that lay `sizes` out one after the other in `order` (index order when None), with
    gaps[k] bytes before the k-th one placed (none when None); no two overlap."""
    n = len(sizes)
    off = np.empty(n, np.int64)
    pos = 0
    for k, i in enumerate(range(n) if order is None else order):
        if gaps is not None:
            pos += int(gaps[k])
        off[i] = pos
        pos += int(sizes[i])
    return off


def spread(rng: np.random.Generator, sizes, span: int) -> np.ndarray:
    """Non-overlapping starts for `sizes` inside [0, span): placed in a random order, with the
    spare bytes cut at random points between them."""
    n = len(sizes)
    slack = span - int(np.sum(sizes))
    assert slack >= 0, f"{int(np.sum(sizes))} bytes do not fit a span of {span}"
    order = rng.permutation(n)
    cuts = np.sort(rng.integers(0, slack + 1, n))
    return place(sizes, order, np.diff(np.concatenate([[0], cuts])))


def fitting(rng: np.random.Generator, region: int, max_n: int, unit: int = 1):
    """1..max_n descriptors of at least max(512, unit) bytes, multiples of `unit`, that together
    fit `region` bytes: (sizes, file offsets back to back, memory offsets in a shuffled order)."""
    least = max(512, unit)
    n = int(rng.integers(1, max_n + 1))
    sizes = rng.integers(least // unit, 4 * region // (3 * n) // unit + 2, n).astype(np.int64)
    sizes *= unit
    while sizes.sum() > region:
        sizes = np.maximum(least, sizes // 2 // unit * unit)
    return sizes, place(sizes), place(sizes, rng.permutation(n))


def slotted(rng: np.random.Generator, sizes, span: int, unit: int = 1) -> list[int]:
    """One offset per size at a random multiple of `unit` inside its own slot of span / n bytes,
    the slots handed out in a shuffled order; no two overlap."""
    n = len(sizes)
    slot = span // n
    return [
        int(s) * slot + int(rng.integers(0, (slot - z) // unit, endpoint=True)) * unit
        for s, z in zip(rng.permutation(n), sizes)
    ]


@dataclass
class Layout:
    sizes: np.ndarray  # bytes per descriptor
    mem_off: np.ndarray  # offset of descriptor i in the DRAM buffers
    file_off: np.ndarray  # offset of descriptor i in the file
    mem_size: int
    file_size: int

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return int(self.sizes.sum())


def mixed_layout(
    rng: np.random.Generator, direct: bool, n_small=900, n_medium=180, n_large=10
) -> Layout:
    """>= 1000 descriptors, 512 B .. 16 MiB, mostly small: ~125 MiB in all.

    Buffered: arbitrary sizes and offsets. O_DIRECT: sizes, offsets and gaps are multiples of
    4096. Memory order is a random permutation of file order and both sides have random gaps,
    so index mix-ups, overruns and merged neighbours all show in the byte comparison."""
    small = rng.integers(512, 64 * KiB + 1, n_small)
    medium = rng.integers(64 * KiB, 512 * KiB + 1, n_medium)
    large = rng.integers(1 * MiB, 8 * MiB + 1, n_large)
    large[0] = 16 * MiB
    sizes = np.concatenate([small, medium, large]).astype(np.int64)
    sizes[0] = 512
    if direct:
        sizes = np.maximum(ALIGN, (sizes + ALIGN - 1) // ALIGN * ALIGN)
    sizes = sizes[rng.permutation(len(sizes))]
    n = len(sizes)

    def gaps():
        g = rng.integers(0, 3 * ALIGN, n)
        g[rng.random(n) < 0.5] = 0  # half adjacent: neighbours that a merge could join
        return g // ALIGN * ALIGN if direct else g

    file_off = place(sizes, None, gaps())
    mem_off = place(sizes, rng.permutation(n), gaps())
    return Layout(
        sizes, mem_off, file_off, int((mem_off + sizes).max()), int(file_off[-1] + sizes[-1])
    )


def scattered_blocks(
    rng: np.random.Generator, file_size: int, lo: int, hi: int, budget: int, base: int, align=4096
) -> list[tuple[int, int, int]]:
    """(file offset, length, address): blocks of lo..hi bytes (multiples of `align`) at random
    aligned file offsets, packed back to back into [base, base + budget) of a client buffer."""
    blocks, used = [], 0
    while True:
        ln = int(rng.integers(lo // align, hi // align + 1)) * align
        if used + ln > budget:
            break
        foff = int(rng.integers(0, (file_size - ln) // align + 1)) * align
        blocks.append((foff, ln, base + used))
        used += ln
    return blocks
