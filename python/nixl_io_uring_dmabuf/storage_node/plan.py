"""Cuts a request's blocks into batches, each of which fits one pool buffer.

A block longer than a buffer is cut into buffer-sized pieces; pieces are packed in request order
into batches of at most one buffer, each piece at a 4 KiB-aligned offset of the buffer (O_DIRECT
files and block devices need aligned memory). A batch never mixes export kinds (FILE and BLOCK
are different NIXL memory types, so they cannot share one transfer).
"""

from __future__ import annotations

import numpy as np

ALIGN = 4096

# Columns of a batch's piece array.
FILE, FOFF, LEN, CADDR, CDEV, BOFF = range(6)


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def cut_batches(blocks: np.ndarray, buf_size: int, seg_of_file) -> list[np.ndarray]:
    """blocks: N x 5 (file index, file offset, length, client address, client device).

    seg_of_file(i) gives the NIXL segment ("FILE"/"BLOCK") of file index i. Returns a list of
    M x 6 uint64 arrays (the 5 block columns, then the piece's offset in the buffer).
    """
    batches: list[np.ndarray] = []
    cur: list[tuple] = []
    used = 0
    seg = None
    for f, foff, ln, caddr, cdev in blocks.tolist():
        s = seg_of_file(f)
        done = 0
        while done < ln:
            piece = min(ln - done, buf_size)
            start = _align(used)
            if cur and (start + piece > buf_size or s != seg):
                batches.append(np.array(cur, dtype=np.uint64))
                cur, used, start = [], 0, 0
            seg = s
            cur.append((f, foff + done, piece, caddr + done, cdev, start))
            used = start + piece
            done += piece
    if cur:
        batches.append(np.array(cur, dtype=np.uint64))
    return batches
