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
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import struct
import zlib

MAGIC = 0x4B445549  # b"IUDK" little-endian
VERSION = 1
COMMIT, TOMB, DAMAGED = 1, 2, 3
_HEAD = struct.Struct("<IBBHI")
_COMMIT = struct.Struct("<QIIHH")
_SLOT = struct.Struct("<QI")


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
        key = body[_COMMIT.size:_COMMIT.size + klen]
        sums = struct.unpack_from(f"<{n}Q", body, _COMMIT.size + klen)
        return Record(COMMIT, gen, slot, key, nbytes, tuple(sums))
    if rtype in (TOMB, DAMAGED) and len(body) == _SLOT.size:
        gen, slot = _SLOT.unpack(body)
        return Record(rtype, gen, slot)
    return None


def parse(buf: bytes) -> tuple[list[Record], int, bool]:
    """Records at the start of `buf`: (records, bytes they take, damaged). Stops at the first
    record that is incomplete (the writer may be mid-write, or died there) or damaged."""
    out, off = [], 0
    while off + _HEAD.size <= len(buf):
        magic, rtype, version, blen, crc = _HEAD.unpack_from(buf, off)
        if magic != MAGIC or version != VERSION:
            return out, off, True
        end = off + _HEAD.size + blen
        if end > len(buf):
            break
        body = buf[off + _HEAD.size:end]
        rec = _parse(rtype, body) if zlib.crc32(bytes([rtype]) + body) == crc else None
        if rec is None:
            return out, off, True
        out.append(rec)
        off = end
    return out, off, False


class Reader:
    """Reads a journal written by another process from where the previous call stopped."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.damaged_at: int | None = None

    def read_new(self) -> list[Record]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        try:
            size = os.fstat(fd).st_size
            if size < self.offset:  # the writer cut a torn tail we had stopped at
                self.offset = size
            buf = os.pread(fd, size - self.offset, self.offset) if size > self.offset else b""
        finally:
            os.close(fd)
        recs, used, bad = parse(buf)
        self.damaged_at = self.offset + used if bad else None
        self.offset += used
        return recs


class Appender:
    """The single writer of one journal. Opening it cuts everything after the last complete,
    undamaged record (a torn tail left by a process that died mid-append)."""

    def __init__(self, path: str, durable: bool):
        self.path = path
        self.durable = durable
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            recs, used, _bad = parse(os.pread(fd, size, 0) if size else b"")
            if used < size:
                os.ftruncate(fd, used)
                os.fsync(fd)
            self.records = recs  # what was there, for the caller's replay
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.cut = size - used

    def append(self, records: list[bytes]) -> None:
        if not records:
            return
        data = b"".join(records)
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.durable:
            os.fdatasync(self._fd)

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
            raise StoreBusy(f"{what}: {path} is locked by another live process (another vLLM "
                            "engine uses this store; give each engine its own path)") from None
        raise
    return fd
