"""The locks that let several engines share one store, and that keep out a connector release
that cannot share it.

- Journal appends and slot allocation: an open-file-description (OFD) write lock on the whole
  journal, held for the append (and, in the scheduler, for the allocation that precedes it).
  OFD locks belong to the open file, not the process, so two catalogs or two ranks in one
  process exclude each other too; the kernel drops them when the holder dies (SIGKILL
  included). On FUSE they reach the file system as POSIX locks, which is what makes them hold
  across nodes on a file system that implements them (docs/vllm-many-engines.md).
- Engine liveness: each scheduler holds the OFD lock of its own file in `<path>/engines/`. A
  store slot another engine allocated and never committed is reclaimed only once that lock
  can be taken, i.e. its engine is gone.
- Older releases: they flock `<path>/.lock` and each rank folder's `.lock` exclusively. This
  release holds a shared flock on the same files, so an older engine is refused while any
  engine of this release runs, and the other way round.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import struct
import time

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 and arm64
ALIVE_S = 1.0  # an engine found running is not probed again for this long


class StoreBusy(RuntimeError):
    pass


def _ofd(fd: int, kind: int, wait: bool) -> bool:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


@contextlib.contextmanager
def write_locked(fd: int):
    """The whole file under an OFD write lock (waits for it)."""
    _ofd(fd, fcntl.F_WRLCK, wait=True)
    try:
        yield
    finally:
        _ofd(fd, fcntl.F_UNLCK, wait=True)


def flock_shared(path: str, what: str) -> int:
    """A shared flock on `path`: StoreBusy while an older release's engine holds it exclusively."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreBusy(
                f"{what}: {path} is locked by an engine of an older connector release, which "
                "cannot share a store; stop it, or give this engine another path"
            ) from None
        raise
    return fd


class Liveness:
    """This engine's liveness file, and the test of another engine's."""

    def __init__(self, root: str):
        self.folder = os.path.join(root, "engines")
        os.makedirs(self.folder, exist_ok=True)
        self.owner = secrets.randbits(63) | 1  # never 0: 0 means "written before format 4"
        self.path = self._path(self.owner)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        _ofd(self._fd, fcntl.F_WRLCK, wait=False)
        self._dead: set[int] = {0}
        self._seen_alive: dict[int, float] = {}  # owner -> when its lock was last found held

    def _path(self, owner: int) -> str:
        return os.path.join(self.folder, f"{owner:016x}.lock")

    def alive(self, owner: int) -> bool:
        """Whether the engine that wrote `owner` still runs (its file's lock is held)."""
        if owner == self.owner:
            return True
        if owner in self._dead:
            return False
        if time.monotonic() - self._seen_alive.get(owner, -ALIVE_S) < ALIVE_S:
            return True
        path = self._path(owner)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            self._dead.add(owner)
            return False
        try:
            if not _ofd(fd, fcntl.F_WRLCK, wait=False):
                self._seen_alive[owner] = time.monotonic()
                return True
            self._dead.add(owner)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1
