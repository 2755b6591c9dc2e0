"""Loop devices for tests: block devices over files in a folder (tmpfs for memory speed, or the
disk), optionally with ext4 made and mounted on each. Everything is undone on exit, also when
the test or the set-up fails half way.

    with LoopDevices(tmp_path, count=2, size_mb=64, ext4=True) as loops:
        loops.devices   # ['/dev/loopN', ...]
        loops.mounts    # their mount points (ext4=True)

Needs root and losetup (mkfs.ext4 and mount for ext4); `unavailable()` says why not, or None.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def unavailable(ext4: bool = False) -> str | None:
    if os.geteuid() != 0:
        return "loop devices need root"
    tools = ("losetup", "mkfs.ext4", "mount", "umount") if ext4 else ("losetup",)
    for tool in tools:
        if shutil.which(tool) is None:
            return f"no {tool}"
    return None


def _out(argv: list[str]) -> str:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip() or p.returncode}")
    return p.stdout.strip()


class LoopDevices:
    def __init__(self, folder, count: int, size_mb: int, ext4: bool = False, direct_io=True):
        self.folder, self.count, self.size_mb = str(folder), count, size_mb
        self.ext4, self.direct_io = ext4, direct_io
        self.images: list[str] = []
        self.devices: list[str] = []
        self.mounts: list[str] = []

    def __enter__(self) -> LoopDevices:
        try:
            for i in range(self.count):
                image = os.path.join(self.folder, f"loop{i}.img")
                with open(image, "wb") as f:
                    f.truncate(self.size_mb << 20)
                self.images.append(image)
                # direct I/O to the backing file where it supports it (not tmpfs): the loop
                # device then does not cache everything a second time in the page cache
                argv = ["losetup", "-f", "--show", image]
                if self.direct_io and not _on_tmpfs(image):
                    argv.insert(1, "--direct-io=on")
                self.devices.append(_out(argv))
            if self.ext4:
                for i, dev in enumerate(self.devices):
                    mnt = os.path.join(self.folder, f"mnt{i}")
                    os.makedirs(mnt, exist_ok=True)
                    _out(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0", dev])
                    _out(["mount", dev, mnt])
                    self.mounts.append(mnt)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for mnt in reversed(self.mounts):
            subprocess.run(["umount", mnt], check=False, capture_output=True)
        self.mounts = []
        for dev in reversed(self.devices):
            subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)
        self.devices = []
        for image in self.images:
            try:
                os.unlink(image)
            except OSError:
                pass
        self.images = []


def mkfs_ext4(device: str) -> None:
    """An ext4 file system on `device` (not mounted): what a store must refuse to overwrite."""
    _out(["mkfs.ext4", "-q", "-F", device])


def _on_tmpfs(path: str) -> bool:
    return _fs_type(path) == "tmpfs"


def _fs_type(path: str) -> str:
    """The file system type of the mount holding `path` (from /proc/self/mounts)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def loops_or_skip(folder, count: int, size_mb: int, ext4: bool = False, mkfs: bool = False):
    """A test's loop devices (a generator for a fixture: `yield from loops_or_skip(...)`): skips
    the test with one line naming why when they cannot be made here. ext4: each device carries
    a mounted ext4; mkfs: the test runs mkfs.ext4 itself."""
    import pytest

    why = unavailable(ext4=ext4 or mkfs)
    if why:
        pytest.skip(f"no loop devices: {why}")
    with LoopDevices(folder, count=count, size_mb=size_mb, ext4=ext4) as lo:
        yield lo
