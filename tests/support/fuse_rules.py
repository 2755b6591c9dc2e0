"""Fault-injecting FUSE filesystem for the reliability suite.

Extends fuse_faultfs.py beside it (same raw /dev/fuse protocol, stdlib only; the FaultFS class
is reused) with more fault kinds. It serves one regular file, /data, backed by a real file.

    python fuse_rules.py MOUNTPOINT BACKING_FILE RULES

RULES is a comma-separated list (an empty string or "full" = no faults):
  eio_read:OFF     a READ whose range contains byte OFF fails with EIO
  eio_write:OFF    a WRITE whose range contains byte OFF fails with EIO
  enospc:OFF       a WRITE that reaches byte OFF or beyond fails with ENOSPC (a full disk at OFF)
  short_write:N    every WRITE stores at most N bytes and replies with that count (N > 0), so
                   write(2)/pwrite(2)/io_uring see short writes and must resubmit the remainder
  short_read:N     every READ returns at most N bytes (N > 0); with direct_io the caller sees a
                   short read and must ask again for the remainder (through the page cache FUSE
                   would take a short reply for end of file)
  delay_ms:MS      every READ and WRITE is answered MS milliseconds late
  direct_io        open replies FOPEN_DIRECT_IO (no page cache; each I/O reaches the daemon)

Prints "READY" once mounted; on unmount (or SIGTERM) prints one "STATS {json}" line and exits.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import sys
import time

import fuse_faultfs as base  # this folder is sys.path[0]: the script runs by its path

FOPEN_DIRECT_IO = 1 << 0


class Rules:
    def __init__(self, spec: str):
        self.eio_read = self.eio_write = self.enospc = None
        self.short_write = self.short_read = None
        self.delay = 0.0
        self.direct_io = False
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, _, val = item.partition(":")
            if key == "full":
                continue
            if key == "eio_read":
                self.eio_read = int(val)
            elif key == "eio_write":
                self.eio_write = int(val)
            elif key == "enospc":
                self.enospc = int(val)
            elif key == "short_write":
                self.short_write = int(val)
                assert self.short_write > 0
            elif key == "short_read":
                self.short_read = int(val)
                assert self.short_read > 0
            elif key == "delay_ms":
                self.delay = int(val) / 1000.0
            elif key == "direct_io":
                self.direct_io = True
            else:
                raise SystemExit(f"fuse_rules: unknown rule {item!r}")


class RulesFS(base.FaultFS):
    def __init__(self, mnt: str, backing: str, spec: str):
        super().__init__(mnt, backing, "full")
        self.rules = Rules(spec)
        self.stats.update(
            {
                "read_log": [],
                "short_reads": 0,
                "short_writes": 0,
                "enospc": 0,
                "eio_write": 0,
                "delayed": 0,
                "read_times": [],
            }
        )

    def handle(self, op: int, node: int, body: bytes):
        r = self.rules
        if op == base.FUSE_READ and len(self.stats["read_times"]) < 4096:
            self.stats["read_times"].append(time.time())  # when each READ reached the daemon
        if op in (base.FUSE_READ, base.FUSE_WRITE) and r.delay:
            self.stats["delayed"] += 1
            time.sleep(r.delay)
        if op == base.FUSE_OPEN and r.direct_io:
            return 0, struct.pack("<QII", 1, FOPEN_DIRECT_IO, 0)
        if op == base.FUSE_READ:
            _, off, size, *_ = base.READ_IN.unpack_from(body)
            if len(self.stats["read_log"]) < 12:  # (offset, size) of the first READs
                self.stats["read_log"].append((off, size))
            if r.eio_read is not None and off <= r.eio_read < off + size:
                self.stats["reads"] += 1
                self.stats["eio"] += 1
                return -errno.EIO, b""
            if r.short_read is not None and size > r.short_read:
                self.stats["reads"] += 1
                self.stats["short_reads"] += 1
                data = os.pread(self.bfd, r.short_read, off)
                self.stats["read_bytes"] += len(data)
                return 0, data
        if op == base.FUSE_WRITE:
            _, off, size, *_ = base.READ_IN.unpack_from(body)
            if r.eio_write is not None and off <= r.eio_write < off + size:
                self.stats["writes"] += 1
                self.stats["eio_write"] += 1
                return -errno.EIO, b""
            if r.enospc is not None and off + size > r.enospc:
                self.stats["writes"] += 1
                self.stats["enospc"] += 1
                return -errno.ENOSPC, b""
            if r.short_write is not None and size > r.short_write:
                data = body[base.READ_IN.size : base.READ_IN.size + r.short_write]
                self.stats["writes"] += 1
                self.stats["short_writes"] += 1
                done = os.pwrite(self.bfd, data, off)
                self.stats["written_bytes"] += done
                return 0, struct.pack("<II", done, 0)
        return super().handle(op, node, body)


def main() -> None:
    mnt, backing, spec = sys.argv[1], sys.argv[2], sys.argv[3]
    fs = RulesFS(mnt, backing, spec)

    def stop(*_):
        import ctypes

        ctypes.CDLL(None, use_errno=True).umount2(mnt.encode(), 2)  # MNT_DETACH

    signal.signal(signal.SIGTERM, stop)
    fs.mount()
    print("READY", flush=True)
    try:
        fs.serve()
    finally:
        import json

        print("STATS " + json.dumps(fs.stats), flush=True)


if __name__ == "__main__":
    main()
