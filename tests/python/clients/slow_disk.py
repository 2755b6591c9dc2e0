"""A slow disk for tests: an ext4 file system on a loop device whose writes are throttled for
the processes of one cgroup (cgroup v2 io.max, or v1 blkio.throttle.write_bps_device where the
io controller is not on cgroup v2). Only direct I/O is throttled under v1 (buffered writeback
is not charged to the writer), so the store above it must use O_DIRECT.

    with SlowDisk(tmp_path, write_bps=256 << 10) as disk:
        disk.mount          # the file system's folder
        disk.python(py)     # an interpreter wrapper that runs `py` inside the cgroup

Needs root, losetup and mkfs.ext4; `SlowDisk.unavailable()` says why not, or None.
"""

from __future__ import annotations

import os
import shutil
import subprocess

CGROUP = "/sys/fs/cgroup"


def _io_v2() -> str | None:
    """The cgroup v2 root with the io controller, if any."""
    for root in (CGROUP, os.path.join(CGROUP, "unified")):
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "io" in f.read().split():
                    return root
        except OSError:
            pass
    return None


def _blkio_v1() -> str | None:
    d = os.path.join(CGROUP, "blkio")
    return d if os.path.exists(os.path.join(d, "blkio.throttle.write_bps_device")) else None


class SlowDisk:
    def __init__(self, folder, write_bps: int, size_mb: int = 256):
        self.folder = str(folder)
        self.write_bps = int(write_bps)
        self.size_mb = size_mb
        self.image = os.path.join(self.folder, "disk.img")
        self.mount = os.path.join(self.folder, "mnt")
        self.loop: str | None = None
        self.cgroup: str | None = None
        self.kind = ""

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root (loop device, mount, cgroup)"
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"no {tool}"
        if _io_v2() is None and _blkio_v1() is None:
            return "no cgroup io controller (v2 io.max or v1 blkio throttle)"
        return None

    def __enter__(self) -> SlowDisk:
        os.makedirs(self.mount, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_mb << 20)
        self.loop = _out(["losetup", "-f", "--show", self.image])
        # inode tables and journal written now: ext4's lazy init would write (and take CPU)
        # while the test measures
        lazy = "lazy_itable_init=0,lazy_journal_init=0"
        _out(["mkfs.ext4", "-q", "-F", "-E", lazy, self.loop])
        _out(["mount", self.loop, self.mount])
        dev = os.stat(self.loop).st_rdev
        majmin = f"{os.major(dev)}:{os.minor(dev)}"
        name = f"iud-slow-{os.getpid()}"
        v2 = _io_v2()
        if v2 is not None:
            self.kind, self.cgroup = "cgroup v2 io.max", os.path.join(v2, name)
            os.makedirs(self.cgroup, exist_ok=True)
            _write(os.path.join(self.cgroup, "io.max"), f"{majmin} wbps={self.write_bps}")
        else:
            self.kind = "cgroup v1 blkio.throttle.write_bps_device"
            self.cgroup = os.path.join(_blkio_v1(), name)
            os.makedirs(self.cgroup, exist_ok=True)
            _write(
                os.path.join(self.cgroup, "blkio.throttle.write_bps_device"),
                f"{majmin} {self.write_bps}",
            )
        return self

    def python(self, py: str) -> str:
        """An executable that joins the cgroup, then runs `py` with the same arguments (the
        engine and every process and thread it starts are then throttled)."""
        path = os.path.join(self.folder, "python-in-cgroup")
        with open(path, "w") as f:
            procs = os.path.join(self.cgroup, "cgroup.procs")
            f.write(f'#!/bin/sh\necho $$ > {procs}\nexec {py} "$@"\n')
        os.chmod(path, 0o755)
        return path

    def __exit__(self, *exc) -> None:
        if self.loop:
            subprocess.run(["umount", self.mount], check=False)
            subprocess.run(["losetup", "-d", self.loop], check=False)
        if self.cgroup:
            try:
                os.rmdir(self.cgroup)
            except OSError:
                pass


def _out(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
