"""The io_uring instances of this process as /proc shows them: which fds are rings, and what is
registered in each ring's fixed tables (fdinfo's "UserFiles:" and "UserBufs:" sections, one
"<index>: <entry>" line per slot, "<none>" for an empty one)."""

from __future__ import annotations

import os


def ring_fds() -> list[int]:
    """The fds of this process that are io_uring instances, in order."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "io_uring" in os.readlink(f"/proc/self/fd/{fd}"):
                out.append(int(fd))
        except OSError:
            pass
    return sorted(out)


def registered(fd: int) -> tuple[list[str], list[str]]:
    """(registered file paths, registered buffers as "0x<addr>/<len>") of one ring; empty slots
    are left out, and a ring that closed in the meantime has none."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            lines = f.read().splitlines()
    except OSError:
        return [], []
    files: list[str] = []
    bufs: list[str] = []
    section = None
    for ln in lines:
        if ln.startswith("UserFiles:"):
            section = files
        elif ln.startswith("UserBufs:"):
            section = bufs
        elif ln[:1] not in (" ", "\t"):
            section = None
        elif section is not None and ":" in ln and "<none>" not in ln:
            section.append(ln.split(":", 1)[1].strip())
    return files, bufs


def ring_tables(fd: int | None = None) -> tuple[int, int]:
    """(registered files, registered buffers) of one ring, or summed over every ring of the
    process when fd is None."""
    files = bufs = 0
    for r in ring_fds() if fd is None else [fd]:
        f, b = registered(r)
        files, bufs = files + len(f), bufs + len(b)
    return files, bufs
