"""Raw block devices as the store's slots (`devices`): slot s of rank r on device s % n, in that
rank's area of the device, past a header area of layout.DEVICE_HEADER bytes at its start. The
journals and layout.json stay in the store's folder (`path`).

Claiming a device (the first worker that opens it) refuses it when it is mounted or held (a
partition, md, LVM, dm), when its first bytes carry a file system or partition table signature
(unless `overwrite_devices`), or when it carries the header of another store (unless
`overwrite_devices`) or of this store at another position in the list (always: the slots would
be read from the wrong device). Then the header area is zeroed, which also removes those
signatures, and this store's header written: magic, store id, position, geometry.

Everything is read and written with O_DIRECT, like the slots: a block device's page cache would
cache the KV cache a second time in DRAM.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import stat
import struct

from . import layout as L
from . import media

MAGIC = b"IUD-VLLM-KV-DEVICE\n"
_HEAD = 128 << 10  # read at claiming: covers every signature below

# (name, byte offset, bytes): a file system or partition table that a store would destroy
SIGNATURES = (
    ("an XFS file system", 0, b"XFSB"),
    ("an ext2/3/4 file system", 1080, struct.pack("<H", 0xEF53)),
    ("a btrfs file system", 65600, b"_BHRfS_M"),
    ("a GPT partition table", 512, b"EFI PART"),
    ("a GPT partition table", 4096, b"EFI PART"),
    ("an LVM physical volume", 536, b"LVM2 001"),
    ("a swap area", 4086, b"SWAPSPACE2"),
    ("an MBR partition table or boot sector", 510, b"\x55\xaa"),
)


def size_of(path: str) -> int:
    """The device's size in bytes; refuses a path that is no block device."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise L.StoreUnavailable(f"vLLM KV store: cannot open {L.explain(e, path)}") from None
    try:
        if not stat.S_ISBLK(os.fstat(fd).st_mode):
            raise ValueError(
                f"NixlStorageOffloadingSpec: devices: {path} is not a block device (slot files "
                "in directories go in slot_dirs)"
            )
        return L.fd_size(fd)
    finally:
        os.close(fd)


def signature(head: bytes) -> str | None:
    """What the first bytes of a device say it holds (a file system, a partition table), or
    None."""
    for name, off, magic in SIGNATURES:
        if head[off : off + len(magic)] == magic:
            return f"{name} (signature at byte {off})"
    return None


def header(head: bytes) -> dict | None:
    """The store header at the start of a device, or None."""
    if not head.startswith(MAGIC):
        return None
    body = head[len(MAGIC) : 4096].split(b"\0", 1)[0]
    try:
        return json.loads(body)
    except ValueError:
        return {}


def in_use(path: str) -> str | None:
    """Why the kernel says the device is taken (mounted, partitions, a holder), or None."""
    rdev = os.stat(path).st_rdev
    majmin = f"{os.major(rdev)}:{os.minor(rdev)}"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[2] == majmin:
                return f"it is mounted at {parts[4]}"
    sysfs = f"/sys/dev/block/{majmin}"
    with contextlib.suppress(OSError):
        holders = os.listdir(os.path.join(sysfs, "holders"))
        if holders:
            return f"it is held by {', '.join(holders)} (md, LVM or device mapper)"
    with contextlib.suppress(OSError):
        parts = [
            n for n in os.listdir(sysfs) if os.path.exists(os.path.join(sysfs, n, "partition"))
        ]
        if parts:
            return f"it has partitions ({', '.join(sorted(parts))}); give a partition instead"
    return None


def _read_head(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, _HEAD)  # page-aligned, as O_DIRECT needs
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def _write_header(path: str, fields: dict) -> None:
    """Zeroes the header area (and the signatures in it), then writes the header; synced."""
    body = MAGIC + json.dumps(fields, sort_keys=True).encode()
    assert len(body) < 4096, "device header too long"
    buf = mmap.mmap(-1, L.DEVICE_HEADER)
    buf[: len(body)] = body
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        if os.pwritev(fd, [buf], 0) != L.DEVICE_HEADER:
            raise OSError(f"short write of the store header on {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def claim(root: str, geo: L.Geometry, overwrite: bool) -> None:
    """Checks every device of the store and writes the header of each that has none (see the
    module doc); one error naming the device and what is on it."""
    sid, devs = media.store_id(root), list(geo.devices)
    what = "vLLM KV store"
    lock = os.open(os.path.join(root, "devices.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one engine, or engines, claim in turn
        for k, dev in enumerate(devs):
            busy = in_use(dev)
            if busy:
                raise L.StoreUnavailable(f"{what}: device {dev} cannot hold slots: {busy}")
            try:
                head = _read_head(dev)
            except OSError as e:
                raise L.StoreUnavailable(f"{what}: cannot read {L.explain(e, dev)}") from None
            have = header(head)
            if have is not None:
                problem = media.member_problem(have, sid, root, f"device {dev}", k, devs)
                if not problem:
                    continue
                if have.get("store_id") == sid:  # this store, another position: never
                    raise L.StoreMismatch(
                        f"{what}: {problem}. Device names can change between boots: /dev/disk/by-id/ names do not."
                    )
                if not overwrite:
                    raise L.StoreMismatch(
                        f"{what}: {problem}. Set overwrite_devices to true to give it to this "
                        "store (the other store loses its blocks there), or give another device."
                    )
            else:
                found = signature(head)
                if found and not overwrite:
                    raise L.StoreMismatch(
                        f"{what}: device {dev} carries {found}; the store would destroy it. "
                        "Give another device, or set overwrite_devices to true to overwrite it."
                    )
            fields = {
                "store_id": sid,
                "store": os.path.abspath(root),
                "member": k,
                "of": devs,
                "slot_bytes": geo.slot_bytes,
                "world_size": geo.world_size,
                "num_slots": geo.num_slots,
            }
            try:
                _write_header(dev, fields)
            except OSError as e:
                raise L.StoreUnavailable(f"{what}: cannot write {L.explain(e, dev)}") from None
    finally:
        os.close(lock)
