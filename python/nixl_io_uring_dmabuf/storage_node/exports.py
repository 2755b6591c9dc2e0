"""The files and block devices a storage node serves, opened and registered with its storage backend.

An export is named by the operator (``kv=/data/kv.bin:rw``); clients refer to it by that name and
never see paths. Each export is opened once and registered once as one NIXL FILE region (or
BLOCK for a block device with IO_URING_DMABUF) covering its whole size; requests are checked
against that size before anything moves.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass

BLKGETSIZE64 = 0x80081272


@dataclass
class Export:
    name: str
    path: str
    writable: bool = False
    direct: bool = False
    size: int = 0  # bytes served; 0 = the file's or device's current size
    fd: int = -1
    seg: str = "FILE"
    reg: object = None

    @classmethod
    def parse(cls, spec: str) -> Export:
        """NAME=PATH[:rw][:direct][:size=BYTES]"""
        name, eq, rest = spec.partition("=")
        if not eq or not name or not rest:
            raise ValueError(f"export {spec!r}: expected NAME=PATH[:rw][:direct][:size=BYTES]")
        path, *opts = rest.split(":")
        e = cls(name, path)
        for o in opts:
            if o == "rw":
                e.writable = True
            elif o == "direct":
                e.direct = True
            elif o.startswith("size="):
                e.size = int(o[5:])
            else:
                raise ValueError(f"export {spec!r}: unknown option {o!r}")
        return e

    def open(self, agent, backend: str) -> None:
        flags = (os.O_RDWR if self.writable else os.O_RDONLY) | (os.O_DIRECT if self.direct else 0)
        if self.writable and self.size:
            flags |= os.O_CREAT
        self.fd = os.open(self.path, flags, 0o644)
        try:
            st = os.fstat(self.fd)
            if stat.S_ISBLK(st.st_mode):
                dev_size = struct.unpack("Q", fcntl.ioctl(self.fd, BLKGETSIZE64, b"\0" * 8))[0]
                self.size = min(self.size, dev_size) if self.size else dev_size
                # IO_URING_DMABUF serves raw devices as NIXL BLOCK; NIXL's POSIX backend takes
                # any fd as FILE.
                self.seg = "BLOCK" if "BLK_SEG" in agent.get_backend_mem_types(backend) else "FILE"
            else:
                if self.writable and self.size > st.st_size:
                    os.ftruncate(self.fd, self.size)
                self.size = self.size or st.st_size
            if self.size <= 0:
                raise ValueError(
                    f"export {self.name}: {self.path} is empty; give :size=BYTES to serve a new file"
                )
            self.reg = agent.register_memory(
                [(0, self.size, self.fd, self.name)], self.seg, backends=[backend]
            )
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def close(self, agent) -> None:
        if self.reg is not None:
            agent.deregister_memory(self.reg)
            self.reg = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
