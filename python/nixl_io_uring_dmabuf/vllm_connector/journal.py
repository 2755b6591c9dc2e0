"""The store's append-only journals: framed records, an appender that cuts a torn tail off before
it appends, and an incremental reader that stops at the first incomplete or damaged record.

Each journal has exactly one writer. A rank's worker writes `commits.log` in its rank folder: a
COMMIT record once a block's data store has completed (and, with `durable`, after the slot file
was fdatasync'ed), a DAMAGED record when a load found a block not matching its checksum. The
scheduler's manager writes `manager.log` at the store's root: a TOMB record before a slot is
reused or a block dropped. A record is

    magic u32 'IUDK' | type u8 | version u8 | body length u16 | crc32(type, body) u32 | body

little-endian. COMMIT body: gen u64, slot u32, bytes u32, n u16, key length u16, key, n x u64
checksums (one per sub-block of the slot). TOMB and DAMAGED bodies: gen u64, slot u32.

Damage costs only the damaged record: a reader that meets a record whose magic, version, CRC or
body does not hold scans on for the next offset where a whole valid record starts, and reads on
from there (the framing above, unchanged since the first store, is enough for that: a record is
accepted only with its magic and a matching CRC). What follows the last valid record with no
valid record after it is the tail: a record being written (readers wait for it) or a torn last
record (the writer cuts it when it opens the journal).

An append is all or nothing: the writer reserves the bytes first (fallocate, keeping the size),
so a full file system fails the append before a byte is written, and any append that fails
later (a short write, EIO, a failed fdatasync) is cut off again (ftruncate back to the old
size) before the error goes up. The journal is then as it was and the next append works as soon
as the file system does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import logging
import os
import struct
import zlib

from . import layout as L

logger = logging.getLogger(__name__)

MAGIC = 0x4B445549  # b"IUDK" little-endian
VERSION = 1
COMMIT, TOMB, DAMAGED = 1, 2, 3
_HEAD = struct.Struct("<IBBHI")
_COMMIT = struct.Struct("<QIIHH")
_SLOT = struct.Struct("<QI")
_MAGIC_BYTES = struct.pack("<I", MAGIC)


@dataclasses.dataclass(frozen=True)
class Record:
    type: int
    gen: int
    slot: int
    key: bytes = b""
    nbytes: int = 0
    sums: tuple[int, ...] = ()


def _frame(rtype: int, body: bytes) -> bytes:
    crc = zlib.crc32(bytes([rtype]) + body)
    return _HEAD.pack(MAGIC, rtype, VERSION, len(body), crc) + body


def commit(key: bytes, slot: int, gen: int, nbytes: int, sums: list[int]) -> bytes:
    body = _COMMIT.pack(gen, slot, nbytes, len(sums), len(key)) + bytes(key)
    return _frame(COMMIT, body + struct.pack(f"<{len(sums)}Q", *sums))


def tomb(slot: int, gen: int) -> bytes:
    return _frame(TOMB, _SLOT.pack(gen, slot))


def damaged(slot: int, gen: int) -> bytes:
    return _frame(DAMAGED, _SLOT.pack(gen, slot))


def _parse(rtype: int, body: bytes) -> Record | None:
    if rtype == COMMIT and len(body) >= _COMMIT.size:
        gen, slot, nbytes, n, klen = _COMMIT.unpack_from(body)
        if len(body) != _COMMIT.size + klen + 8 * n:
            return None
        key = body[_COMMIT.size : _COMMIT.size + klen]
        sums = struct.unpack_from(f"<{n}Q", body, _COMMIT.size + klen)
        return Record(COMMIT, gen, slot, key, nbytes, tuple(sums))
    if rtype in (TOMB, DAMAGED) and len(body) == _SLOT.size:
        gen, slot = _SLOT.unpack(body)
        return Record(rtype, gen, slot)
    return None


def _at(buf: bytes, off: int) -> tuple[Record | None, int]:
    """The record at `off`: (record, end) if a whole valid one starts there; (None, -1) if the
    bytes there could still become one (an incomplete header or body); (None, 0) if not."""
    if off + _HEAD.size > len(buf):
        return None, -1
    magic, rtype, version, blen, crc = _HEAD.unpack_from(buf, off)
    if magic != MAGIC or version != VERSION:
        return None, 0
    end = off + _HEAD.size + blen
    if end > len(buf):
        return None, -1
    body = buf[off + _HEAD.size : end]
    if zlib.crc32(bytes([rtype]) + body) != crc:
        return None, 0
    rec = _parse(rtype, body)
    return (rec, end) if rec is not None else (None, 0)


def _next_valid(buf: bytes, start: int) -> int | None:
    """The first offset from `start` on where a whole valid record starts."""
    i = buf.find(_MAGIC_BYTES, start)
    while i >= 0:
        rec, _end = _at(buf, i)
        if rec is not None:
            return i
        i = buf.find(_MAGIC_BYTES, i + 1)
    return None


def parse(buf: bytes) -> tuple[list[Record], int, list[tuple[int, int]]]:
    """The valid records of `buf`: (records, used, skipped). `used` is the end of the last valid
    record; what follows it is the tail (incomplete: the writer may be mid-append, or died
    there; or damaged with no valid record after it). `skipped` lists the (offset, length) of
    damaged bytes before `used` that were stepped over: each costs the records it held, and
    the records after it are read."""
    out, skipped, off, used = [], [], 0, 0
    while off < len(buf):
        rec, end = _at(buf, off)
        if rec is not None:
            out.append(rec)
            off = used = end
            continue
        nxt = _next_valid(buf, off + 1)
        if nxt is None:
            break
        skipped.append((off, nxt - off))
        off = nxt
    return out, used, skipped


class Reader:
    """Reads a journal written by another process from where the previous call stopped."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.skipped: list[tuple[int, int]] = []  # damaged ranges stepped over, absolute
        self.tail = 0  # bytes after the last valid record at the last read
        self.failing: OSError | None = None  # why the last read could not read the file

    @property
    def damaged_at(self) -> int | None:
        return self.skipped[0][0] if self.skipped else None

    def read_new(self) -> list[Record]:
        """The records appended since the last call. A journal that cannot be read now (EIO)
        gives none, with one log line, and is read again next time."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        except OSError as e:
            return self._unreadable(e)
        try:
            size = os.fstat(fd).st_size
            if size < self.offset:  # the writer cut a torn tail or a failed append
                self.offset = size
            buf = os.pread(fd, size - self.offset, self.offset) if size > self.offset else b""
        except OSError as e:
            return self._unreadable(e)
        finally:
            os.close(fd)
        self.failing = None
        recs, used, skipped = parse(buf)
        for off, n in skipped:
            logger.warning(
                "KV store: %s: %d damaged byte(s) at byte %d skipped (the records "
                "there are lost; the records after them are read)",
                self.path,
                n,
                self.offset + off,
            )
        self.skipped += [(self.offset + off, n) for off, n in skipped]
        self.tail = len(buf) - used
        self.offset += used
        return recs

    def _unreadable(self, e: OSError) -> list[Record]:
        if self.failing is None:
            logger.error(
                "KV store: cannot read %s; its new records wait until it can be read",
                L.explain(e, self.path),
            )
        self.failing = e
        return []


_libc = None


def _reserve(fd: int, offset: int, length: int) -> None:
    """fallocate(FALLOC_FL_KEEP_SIZE) of [offset, offset + length): a full file system fails
    here, before the append writes a byte. File systems without fallocate skip it (the append
    is then undone by ftruncate if it fails)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, 1, offset, length) != 0:  # 1 = FALLOC_FL_KEEP_SIZE
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(err, os.strerror(err))


class AppendFailed(OSError):
    """An append that did not happen; the journal is as it was before it (errno kept)."""


class Appender:
    """The single writer of one journal. Opening it cuts the tail after the last valid record
    (a torn record left by a process that died mid-append); damaged records before it stay and
    are skipped by every reader."""

    def __init__(self, path: str, durable: bool):
        self.path = path
        self.durable = durable
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            recs, used, skipped = parse(os.pread(fd, size, 0) if size else b"")
            if used < size:
                os.ftruncate(fd, used)
                os.fsync(fd)
            self.records = recs  # what was there, for the caller's replay
            self.skipped = skipped
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        for off, n in skipped:
            logger.warning(
                "KV store: %s: %d damaged byte(s) at byte %d skipped (the records "
                "there are lost; the records after them are kept)",
                path,
                n,
                off,
            )
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._size = used
        self.cut = size - used

    def append(self, records: list[bytes]) -> None:
        """Appends `records` whole, or raises AppendFailed with the journal as it was."""
        if not records:
            return
        data = b"".join(records)
        start = self._size
        try:
            _reserve(self._fd, start, len(data))
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "write wrote nothing")
                view = view[n:]
            if self.durable:
                os.fdatasync(self._fd)
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)
            except OSError as e2:
                logger.error(
                    "KV store: cannot cut the failed append off %s (%s); readers skip it as damage",
                    self.path,
                    L.explain(e2, self.path),
                )
                try:
                    self._size = os.fstat(self._fd).st_size
                except OSError:
                    pass
            raise AppendFailed(e.errno, f"cannot append to {L.explain(e, self.path)}") from None
        self._size = start + len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class StoreBusy(RuntimeError):
    pass


def lock_exclusive(path: str, what: str) -> int:
    """An flock'ed fd on `path`; StoreBusy if another live process holds it. The kernel drops
    the lock when the holder dies (SIGKILL included), so a crashed engine never blocks the
    next one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreBusy(
                f"{what}: {path} is locked by another live process (another vLLM "
                "engine uses this store; give each engine its own path)"
            ) from None
        raise
    return fd
