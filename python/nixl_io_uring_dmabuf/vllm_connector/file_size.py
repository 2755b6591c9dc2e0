"""A journal's size as the file system has it now, not as this client cached it.

On a network file system (FUSE ones included) `fstat` may answer from the client's attribute
cache: up to the mount's attribute timeout (GlusterFS and ceph-fuse: 1 s by default; on FUSE
even a timeout of 0 caches within one jiffy), it gives the size from before another node's
append. A writer that took the journal's lock and appended at that stale end overwrote the
other node's record (GlusterFS 10.3, two mounts with default options: 4 of 1200 records lost;
tests/python/test_vllm_store_glusterfs.py shows `fstat` at 0 where the volume has 100 bytes).
`statx` with AT_STATX_FORCE_SYNC asks the file system itself (FUSE sends a GETATTR; a
local file system answers from the inode, as `fstat`), and a changed size also drops the
client's cached pages of the file, so the bytes read next are the server's.
"""

from __future__ import annotations

import ctypes
import os

_AT_EMPTY_PATH = 0x1000
_AT_STATX_FORCE_SYNC = 0x2000
_STATX_SIZE = 0x200
_STX_SIZE_OFFSET = 40  # struct statx: mask, blksize, attributes, nlink, uid, gid, mode, ino, size
_STATX_BYTES = 256

_statx = None  # libc's statx, or False where libc has none


def _libc_statx():
    global _statx
    if _statx is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
            fn.argtypes += [ctypes.c_void_p]
        _statx = fn or False
    return _statx


def synced_size(fd: int) -> int:
    """The size of open file `fd`, asked of the file system (`fstat` where libc has no statx)."""
    fn = _libc_statx()
    if not fn:
        return os.fstat(fd).st_size
    buf = ctypes.create_string_buffer(_STATX_BYTES)
    if fn(fd, b"", _AT_EMPTY_PATH | _AT_STATX_FORCE_SYNC, _STATX_SIZE, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int.from_bytes(buf.raw[_STX_SIZE_OFFSET : _STX_SIZE_OFFSET + 8], "little")
