"""The store's format version: which stores this release opens, migrates or refuses, and the
lock that keeps an older release's engine off a store this release shares (locks.py).

- `iud-vllm-kv-store/4` (this release): several engines at once; ALLOC records in manager.log.
- `/3` (one engine per store; same slot layout and records, no ALLOC): migrated in place when no
  engine of the older release has it open - only store.json changes, since format 4 reads a
  COMMIT without ALLOC as its own allocation (slot_table.py).
- `/1` and `/2` (other slot layouts): refused with the difference named (layout.ensure_json).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time

from . import layout as L
from . import locks

logger = logging.getLogger(__name__)

MIGRATES = ("iud-vllm-kv-store/3",)


def open_store(root: str, manifest: dict, what: str) -> int:
    """Creates or checks `<root>/store.json` against `manifest`, migrating a format-3 store; the
    shared flock on `<root>/.lock` it returns keeps older releases out while it is held."""
    try:
        os.makedirs(root, exist_ok=True)
        fd = locks.flock_shared(os.path.join(root, ".lock"), what)
    except OSError as e:
        raise L.StoreUnavailable(f"{what}: cannot open {L.explain(e, root)}") from None
    try:
        path = os.path.join(root, "store.json")
        have = L.read_json(path)
        if have is not None and have.get("format") in MIGRATES:
            _migrate(fd, path, have, manifest, what)
        L.ensure_json(path, manifest, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _migrate(fd: int, path: str, have: dict, manifest: dict, what: str) -> None:
    """Rewrites store.json to this format under an exclusive flock (no older engine runs then;
    engines of this release hold the shared one only briefly while they start)."""
    old = dict(have)
    old["format"] = manifest["format"]
    L.refuse_difference(path, old, manifest, what)  # refuses another model before migrating
    fcntl.flock(fd, fcntl.LOCK_UN)
    deadline = time.monotonic() + 5
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            if time.monotonic() > deadline:
                raise locks.StoreBusy(
                    f"{what}: {path} is a store of format {have['format']!r}, open in an engine "
                    f"of an older connector release; stop that engine and start this one to "
                    f"migrate it to {manifest['format']!r} (several engines can share it then)"
                ) from None
            time.sleep(0.05)
    try:
        now = L.read_json(path)
        if now is not None and now.get("format") in MIGRATES:
            L.write_json(path, {**now, "format": manifest["format"]}, what)
            logger.info(
                "KV store %s: migrated from %s to %s",
                os.path.dirname(path),
                now["format"],
                manifest["format"],
            )
    finally:
        fcntl.flock(fd, fcntl.LOCK_SH)
