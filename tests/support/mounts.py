"""File systems the tests mount (root only): the FUSE fault file systems and small tmpfs folders.

Both skip the calling test, with the reason, where the machine cannot mount them.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
#: Fault modes: "eio:OFF", "hang:OFF:SECONDS", "full" (fuse_faultfs.py).
FAULTFS = os.path.join(HERE, "fuse_faultfs.py")
#: Fault rules: "eio_read:OFF,short_write:N,direct_io,..." (fuse_rules.py).
RULES = os.path.join(HERE, "fuse_rules.py")


class FuseMount:
    """One regular file, `path` (MNT/data), served by a FUSE daemon from a backing file that starts
    as `content`. The daemon prints READY once mounted; stop() unmounts it and returns the
    daemon's STATS (the counters of what it served and failed)."""

    def __init__(self, mnt: str, faults: str, content: np.ndarray, daemon: str = FAULTFS):
        self.mnt = str(mnt)
        os.mkdir(self.mnt)
        self.backing = self.mnt + ".backing"
        with open(self.backing, "wb") as f:
            f.write(content.tobytes())
        self.path = os.path.join(self.mnt, "data")
        self.proc = subprocess.Popen(
            [sys.executable, daemon, self.mnt, self.backing, faults],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        line = self.proc.stdout.readline().strip() if ready else ""
        if line != "READY":
            self.proc.kill()
            err = self.proc.communicate(timeout=10)[1]
            pytest.skip(f"cannot mount the FUSE fault file system: {line!r} {err.strip()[-500:]}")
        self.stats = None

    def daemon_fds(self) -> set[int]:
        """This process's ends of the daemon's pipes (not the plugin's descriptors)."""
        return {self.proc.stdout.fileno(), self.proc.stderr.fileno()}

    def backing_bytes(self) -> np.ndarray:
        with open(self.backing, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)

    def stop(self) -> dict:
        if self.stats is not None:
            return self.stats
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(self.mnt.encode(), 0) != 0:
            libc.umount2(self.mnt.encode(), 2)  # MNT_DETACH: goes once the last user does
        try:
            out, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate(timeout=10)
        lines = [ln for ln in out.splitlines() if ln.startswith("STATS ")]
        self.stats = json.loads(lines[-1][6:]) if lines else {"daemon_stderr": err}
        return self.stats


class TmpfsMounts:
    """Small tmpfs folders for full and read-only file system tests; unmount_all() at the end."""

    def __init__(self):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        self.mounted: list[str] = []

    def mount(self, folder, size: str, ro: bool = False, mode: str | None = "0755") -> str:
        """A fresh tmpfs of `size` ("4m") at `folder` (created here); `mode` of its root (None:
        tmpfs's own, 1777)."""
        os.mkdir(folder)
        opts = f"size={size}" + (f",mode={mode}" if mode else "") + (",ro" if ro else "")
        p = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
        self.mounted.append(str(folder))
        return folder

    def unmount_all(self) -> None:
        for d in reversed(self.mounted):
            subprocess.run(["umount", d], capture_output=True)
            if os.path.ismount(d):
                subprocess.run(["umount", "-l", d], capture_output=True)
        self.mounted = []
