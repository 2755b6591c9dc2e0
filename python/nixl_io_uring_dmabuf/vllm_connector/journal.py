"""The store's append-only journals: framed records, an appender that cuts a torn tail off before
it appends, and an incremental reader that stops at the first incomplete or damaged record.

Every engine on a store appends to the same journals, each append under an OFD write lock on
the journal (locks.py). A rank's worker writes `commits.log` in its rank folder: a COMMIT
record once a block's data store has completed (and, with `durable`, after the slot file was
fdatasync'ed), a DAMAGED record when a load found a block not matching its checksum. The
schedulers write `manager.log` at the store's root: an ALLOC record before a slot is written
(store format 4 on), a TOMB record when a block is dropped without its slot being taken. A
record is

    magic u32 'IUDK' | type u8 | version u8 | body length u16 | crc32(type, body) u32 | body

little-endian. COMMIT body: gen u64, slot u32, bytes u32, n u16, key length u16, key, n x u64
checksums (one per sub-block of the slot). ALLOC body: gen u64, slot u32, owner u64, key length
u16, key. TOMB and DAMAGED bodies: gen u64, slot u32.

Damage costs only the damaged record: a reader that meets a record whose magic, version, CRC or
body does not hold scans on for the next offset where a whole valid record starts, and reads on
from there (the framing above, unchanged since the first store, is enough for that: a record is
accepted only with its magic and a matching CRC). What follows the last valid record with no
valid record after it is the tail: a record being written (readers wait for it) or a torn last
record, left by a writer that died holding the lock (the next writer cuts it, under the lock).

An append is all or nothing: the writer reserves the bytes first (fallocate, keeping the size),
so a full file system fails the append before a byte is written, and any append that fails
later (a short write, EIO, a failed fdatasync) is cut off again (ftruncate back to the old
size) before the error goes up. The journal is then as it was and the next append works as soon
as the file system does.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import struct
import zlib

from . import file_size, locks
from . import layout as L

logger = logging.getLogger(__name__)

MAGIC = 0x4B445549  # b"IUDK" little-endian
VERSION = 1
COMMIT, TOMB, DAMAGED, ALLOC = 1, 2, 3, 4
_HEAD = struct.Struct("<IBBHI")
_COMMIT = struct.Struct("<QIIHH")
_ALLOC = struct.Struct("<QIQH")
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
    owner: int = 0  # ALLOC: the allocating engine (locks.Liveness)


def _frame(rtype: int, body: bytes) -> bytes:
    crc = zlib.crc32(bytes([rtype]) + body)
    return _HEAD.pack(MAGIC, rtype, VERSION, len(body), crc) + body


def commit(key: bytes, slot: int, gen: int, nbytes: int, sums: list[int]) -> bytes:
    body = _COMMIT.pack(gen, slot, nbytes, len(sums), len(key)) + bytes(key)
    return _frame(COMMIT, body + struct.pack(f"<{len(sums)}Q", *sums))


def alloc(key: bytes, slot: int, gen: int, owner: int) -> bytes:
    return _frame(ALLOC, _ALLOC.pack(gen, slot, owner, len(key)) + bytes(key))


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
    if rtype == ALLOC and len(body) >= _ALLOC.size:
        gen, slot, owner, klen = _ALLOC.unpack_from(body)
        if len(body) != _ALLOC.size + klen:
            return None
        return Record(ALLOC, gen, slot, body[_ALLOC.size :], owner=owner)
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
            size = file_size.synced_size(fd)  # not a cached size: appends seen sooner
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
    """One process's writer of a journal that other processes append to as well. Each append
    runs under the journal's lock: it first cuts a torn tail (a writer died holding the lock),
    then writes at the end it read, so no append depends on O_APPEND across nodes. `locked()`
    holds the lock across a read-decide-append sequence (the scheduler's slot allocation)."""

    def __init__(self, path: str, durable: bool):
        self.path = path
        self.durable = durable
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._end = 0  # end of the last valid record seen, at or before the file's end
        self._depth = 0
        self.cut = 0  # torn bytes this writer cut off

    @contextlib.contextmanager
    def locked(self):
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with locks.write_locked(self._fd):
            self._depth = 1
            try:
                self._find_end()
                yield
            finally:
                self._depth = 0

    def _find_end(self) -> None:
        """Under the lock: the end of the last valid record, a torn tail cut off. The size is
        asked of the file system: a cached one would put this append over another node's."""
        size = file_size.synced_size(self._fd)
        if size < self._end:
            self._end = 0
        if size == self._end:
            return
        _recs, used, _skipped = parse(os.pread(self._fd, size - self._end, self._end))
        if self._end + used < size:  # nobody writes without the lock: torn, not in progress
            os.ftruncate(self._fd, self._end + used)
            os.fsync(self._fd)
            self.cut += size - self._end - used
            logger.warning(
                "KV store: %s: cut %d byte(s) of a torn append",
                self.path,
                size - self._end - used,
            )
        self._end += used

    def append(self, records: list[bytes]) -> None:
        """Appends `records` whole, or raises AppendFailed with the journal as it was."""
        if not records:
            return
        data = b"".join(records)
        try:
            with self.locked():
                self._write_at_end(data)
        except AppendFailed:
            raise
        except OSError as e:
            raise AppendFailed(e.errno, f"cannot append to {L.explain(e, self.path)}") from None

    def _write_at_end(self, data: bytes) -> None:
        start = self._end
        try:
            _reserve(self._fd, start, len(data))
            view, pos = memoryview(data), start
            while view:
                n = os.pwrite(self._fd, view, pos)
                if n <= 0:
                    raise OSError(errno.EIO, "write wrote nothing")
                view, pos = view[n:], pos + n
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
            raise AppendFailed(e.errno, f"cannot append to {L.explain(e, self.path)}") from None
        self._end = start + len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
