"""A tiny FUSE filesystem (raw /dev/fuse protocol, stdlib only) that fails chosen reads with
EIO, for the I/O-error tests.

It serves one regular file, /data, backed by a real file on disk, through the page cache (no
FOPEN_DIRECT_IO): a READ request covering byte OFF is answered with EIO, so a read through it
returns the bytes before the failing page and then EIO - a genuine device-style I/O error in the
middle of a regular file.

(Short replies are deliberately not offered. Through the page cache FUSE treats a short reply as
end of file. With FOPEN_DIRECT_IO, io_uring's own completion of short regular-file reads re-reads
from a stale file position on this kernel (6.18): POSIX and IO_URING_DMABUF both get DONE with
misplaced data, so such a test would measure the kernel, not the plugin.)

Run as its own process (the NIXL Python bindings hold the GIL during calls, and a plugin call
that blocks on this filesystem must not wait for a thread of the same interpreter):

    python fuse_faultfs.py MOUNTPOINT BACKING_FILE MODE

MODE: "eio:OFF" - READs whose range contains byte OFF fail with EIO; "hang:OFF:SECONDS" - the
first READ whose range contains byte OFF is answered only after SECONDS (the daemon serves
nothing meanwhile: hung storage; it prints "HELD" when it starts holding); "full" - no
interference.
Prints "READY" once mounted; on unmount (or SIGTERM) prints one "STATS {json}" line and exits.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import struct
import sys
import time

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_SETATTR = 1, 2, 3, 4
FUSE_OPEN, FUSE_READ, FUSE_WRITE, FUSE_STATFS, FUSE_RELEASE = 14, 15, 16, 17, 18
FUSE_FSYNC, FUSE_FLUSH, FUSE_INIT, FUSE_OPENDIR, FUSE_RELEASEDIR = 20, 25, 26, 27, 29
FUSE_INTERRUPT, FUSE_DESTROY, FUSE_BATCH_FORGET = 36, 38, 42
NO_REPLY = {FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT}

FUSE_BIG_WRITES = 1 << 5
MAX_IO = 128 * 1024

IN_HDR = struct.Struct("<IIQQIIIHH")  # fuse_in_header, 40 bytes
OUT_HDR = struct.Struct("<IiQ")  # fuse_out_header, 16 bytes
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
READ_IN = struct.Struct("<QQIIQII")  # fuse_read_in / fuse_write_in, 40 bytes
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # fuse_init_out, 64 bytes

ROOT, DATA = 1, 2


class FaultFS:
    def __init__(self, mnt: str, backing: str, mode: str):
        self.mnt, self.mode = mnt, mode
        self.bfd = os.open(backing, os.O_RDWR)
        self.eio_at = int(mode.split(":", 1)[1]) if mode.startswith("eio:") else None
        self.hang_at, self.hang_s = None, 0.0
        if mode.startswith("hang:"):
            _, at, secs = mode.split(":")
            self.hang_at, self.hang_s = int(at), float(secs)
        self.stats = {"reads": 0, "writes": 0, "eio": 0, "read_bytes": 0, "written_bytes": 0}
        self.fd = os.open("/dev/fuse", os.O_RDWR)

    def mount(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,max_read={MAX_IO}"
        if (
            libc.mount(b"iud-faultfs", self.mnt.encode(), b"fuse.iud-faultfs", 2 | 4, opts.encode())
            != 0
        ):
            e = ctypes.get_errno()
            raise OSError(e, f"mount fuse on {self.mnt}: {os.strerror(e)}")

    def attr(self, node: int) -> bytes:
        if node == ROOT:
            return ATTR.pack(ROOT, 0, 0, 0, 0, 0, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096, 0)
        size = os.fstat(self.bfd).st_size
        return ATTR.pack(
            DATA, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, 0o100644, 1, 0, 0, 0, 4096, 0
        )

    def handle(self, op: int, node: int, body: bytes):
        """Returns (error, payload)."""
        if op == FUSE_INIT:
            major, minor = struct.unpack_from("<II", body)
            return 0, INIT_OUT.pack(
                7, min(minor, 31), MAX_IO, FUSE_BIG_WRITES, 16, 12, MAX_IO, 1, 0, 0, 0, 0
            )
        if op == FUSE_LOOKUP:
            name = body.split(b"\0", 1)[0]
            if node == ROOT and name == b"data":
                return 0, struct.pack("<QQQQII", DATA, 0, 3600, 3600, 0, 0) + self.attr(DATA)
            return -errno.ENOENT, b""
        if op == FUSE_GETATTR:
            return 0, struct.pack("<QII", 0, 0, 0) + self.attr(node)
        if op == FUSE_SETATTR:
            return 0, struct.pack("<QII", 0, 0, 0) + self.attr(node)
        if op in (FUSE_OPEN, FUSE_OPENDIR):
            return 0, struct.pack("<QII", 1, 0, 0)
        if op in (FUSE_RELEASE, FUSE_RELEASEDIR, FUSE_FLUSH, FUSE_FSYNC, FUSE_DESTROY):
            return 0, b""
        if op == FUSE_READ:
            _, off, size, *_ = READ_IN.unpack_from(body)
            self.stats["reads"] += 1
            if self.eio_at is not None and off <= self.eio_at < off + size:
                self.stats["eio"] += 1
                return -errno.EIO, b""
            if self.hang_at is not None and off <= self.hang_at < off + size:
                self.hang_at = None
                self.stats["hung"] = self.hang_s
                print("HELD", flush=True)
                time.sleep(self.hang_s)
            data = os.pread(self.bfd, size, off)
            self.stats["read_bytes"] += len(data)
            return 0, data
        if op == FUSE_WRITE:
            _, off, size, *_ = READ_IN.unpack_from(body)
            data = body[READ_IN.size : READ_IN.size + size]
            self.stats["writes"] += 1
            done = os.pwrite(self.bfd, data, off)
            self.stats["written_bytes"] += done
            return 0, struct.pack("<II", done, 0)
        return -errno.ENOSYS, b""

    def serve(self) -> None:
        bufsize = MAX_IO + 64 * 1024
        while True:
            try:
                req = os.read(self.fd, bufsize)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            if not req:
                return
            _, op, unique, node, *_ = IN_HDR.unpack_from(req)
            body = req[IN_HDR.size :]
            if op in NO_REPLY:
                continue
            try:
                err, payload = self.handle(op, node, body)
            except OSError as e:
                err, payload = -e.errno, b""
            if err:
                payload = b""
            try:
                os.write(self.fd, OUT_HDR.pack(OUT_HDR.size + len(payload), err, unique) + payload)
            except OSError:
                pass  # the request was interrupted
            if op == FUSE_DESTROY:
                return


def main() -> None:
    mnt, backing, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    fs = FaultFS(mnt, backing, mode)

    def stop(*_):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(mnt.encode(), 2)  # MNT_DETACH

    signal.signal(signal.SIGTERM, stop)
    fs.mount()
    print("READY", flush=True)
    try:
        fs.serve()
    finally:
        print("STATS " + json.dumps(fs.stats), flush=True)


if __name__ == "__main__":
    main()
