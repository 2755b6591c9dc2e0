"""Why a job failed, where the file system shows it. NIXL's Python API returns only a status
(NIXL_ERR_BACKEND) for a failed transfer, so after one the store looks at the job's slot files
itself: their length, then a read of each slot and, for a store, a write of those same bytes back
into the slot (which no commit names), and reports what that finds (ENOSPC with the free space,
EIO, a short file).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence

from . import layout as L


def cause_of(e: BaseException) -> str:
    """A failed job's cause as a counter name: the errno's name (ENOSPC, EIO, ...) or the
    exception's type."""
    n = getattr(e, "errno", None)
    return errno.errorcode.get(n, f"errno {n}") if n else type(e).__name__


def diagnose(
    root: str,
    geo: L.Geometry,
    rank: int,
    fds: Sequence[int],
    slots: Iterable[int],
    store: bool,
    used: int,
) -> tuple[str, str]:
    """(what was found, cause name) for a job NIXL failed: each of its slots' length in its
    file (`used` bytes of each slot), a read of the slot's bytes and, for a store, a write of the
    same bytes back (the slot belongs to this failed store: no commit names it), through a
    buffered fd of the same file, until one fails. Runs after the job was released, only on
    failure."""
    free = L.free_space(root)
    for slot in sorted({int(s) for s in slots})[:8]:
        fi, off = geo.locate(slot, rank)
        path = geo.slot_path(root, rank, fi)
        try:
            size = L.fd_size(fds[fi])
            if size < off + used:
                return (
                    f"short file: {path} is {size} B, slot {slot} ends at byte {off + used}",
                    "short file",
                )
            fd = os.open(f"/proc/self/fd/{fds[fi]}", os.O_RDWR if store else os.O_RDONLY)
            try:
                data = b""
                while len(data) < used:  # a short read, then the error (as the kernel does)
                    got = os.pread(fd, used - len(data), off + len(data))
                    if not got:
                        return (
                            f"short file: {path} ends at byte {off + len(data)}, "
                            f"inside slot {slot} ({off} to {off + used})",
                            "short file",
                        )
                    data += got
                if store:
                    n = os.pwrite(fd, data, off)
                    if n < used:
                        return (
                            f"short write: {path} took {n} of {used} B at byte {off} "
                            f"(slot {slot}); {L.free_space(path)}",
                            "short write",
                        )
            finally:
                os.close(fd)
        except OSError as e:
            return (
                f"{'writing' if store else 'reading'} slot {slot}: {L.explain(e, path)}",
                cause_of(e),
            )
    return (
        f"not found: the job's slot files can be read{' and written' if store else ''}"
        f" now ({free}); the backend's log has its own message",
        "unknown",
    )
