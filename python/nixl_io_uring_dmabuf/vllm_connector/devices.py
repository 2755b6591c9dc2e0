"""Raw block devices as the store's slots (`devices`): slot s of rank r on device s % n, in that
rank's area of the device, past a header area at its start (layout.DEVICE_HEADER)."""

from __future__ import annotations

import os

from . import layout as L


def size_of(path: str) -> int:
    """The device's size in bytes; refuses a path that is no block device."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise L.StoreUnavailable(f"vLLM KV store: cannot open {L.explain(e, path)}") from None
    try:
        import stat

        if not stat.S_ISBLK(os.fstat(fd).st_mode):
            raise ValueError(
                f"NixlStorageOffloadingSpec: devices: {path} is not a block device (slot files "
                "in directories go in slot_dirs)"
            )
        return L.fd_size(fd)
    finally:
        os.close(fd)
