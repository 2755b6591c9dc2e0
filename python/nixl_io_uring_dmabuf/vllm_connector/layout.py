"""Where a block's bytes live: the slot geometry shared by scheduler and workers, the folders
and file names per rank, the store's manifest (refuses a store made for another model or
layout) and the O_DIRECT alignment of a file.

    <path>/store.json                 manifest, written once by the first manager
    <path>/manager.log                ALLOC / TOMB records (every engine's manager)
    <path>/.lock                      shared flock of each live manager (keeps older releases out)
    <path>/engines/<id>.lock          one per live manager, locked while it runs (locks.Liveness)
    <path>/rank<r>of<W>/layout.json   the rank's pages per block (worker)
    <path>/rank<r>of<W>/commits.log   COMMIT / DAMAGED records (every engine's worker of the rank)
    <path>/rank<r>of<W>/slots-<i>.bin slot files, preallocated; slot s in file s % num_files
    <path>/rank<r>of<W>/.lock         shared flock of each live worker of that rank

With `slot_dirs` the slot files are spread over several directories instead (file i of every
rank in slot_dirs[i % n]/rank<r>of<W>/); with `devices` the slots are areas of raw block devices
(slot s of rank r on device s % n, devices.py). The journals and layout.json stay under <path>.

A slot holds one offloaded chunk (blocks_per_chunk vLLM blocks) of one rank, page-major: for
each KV page (layer) in order, that page of each of the chunk's blocks in order; its size is
rounded up to 4096. A page's blocks lie end to end, so a run of consecutive vLLM blocks moves
as one I/O per page rather than one per (block, page).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import os
import stat
import struct

SLOT_ALIGN = 4096
# Bytes at the start of each raw device that hold no slot: the store's header (devices.py) and
# the places where file systems and partition tables keep their signatures (wiped on claiming).
DEVICE_HEADER = 1 << 20
# /2: slots striped over the files; /3: page-major slots; /4: shared by engines (ALLOC records)
FORMAT = "iud-vllm-kv-store/4"


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def page_runs(pages, blocks_per_chunk: int) -> list[int]:
    """Where each page's run starts in a slot: page p of sub-block j is at
    page_runs[p] + j * pages[p]."""
    out, off = [], 0
    for p in pages:
        out.append(off)
        off += p * blocks_per_chunk
    return out


class StoreMismatch(RuntimeError):
    pass


class StoreUnavailable(RuntimeError):
    """The store's files cannot be created or written at start-up (full disk, read-only or
    missing path, permissions): one line naming the path and the cause."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def free_space(path: str) -> str:
    """'N free of M' on the file system holding `path` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while p != "/" and not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError as e:
        return f"free space unknown ({e.strerror})"
    return (
        f"{_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)} on "
        "its file system"
    )


def explain(err: OSError, path: str | None = None) -> str:
    """One line for an OSError: the path, the system's text and the errno's name, and the free
    space where the cause is a full file system or quota:
    '/kv/store.json: No space left on device (ENOSPC; 0 B free of 4.0 MiB on its file system)'."""
    path = path or err.filename or "?"
    name = errno.errorcode.get(err.errno, f"errno {err.errno}") if err.errno else type(err).__name__
    text = err.strerror or str(err)
    extra = f"; {free_space(path)}" if err.errno in NO_SPACE else ""
    return f"{path}: {text} ({name}{extra})"


@dataclasses.dataclass(frozen=True)
class Geometry:
    rank_block_bytes: int  # bytes one rank keeps per vLLM block (all layers)
    blocks_per_chunk: int
    world_size: int
    capacity_bytes: int
    max_file_bytes: int
    slot_files: int = 8
    # Where the slots live (store.json names it): () = slot files in the store's folder;
    # slot_dirs: slot files in these directories, file i in slot_dirs[i % n]; devices: raw
    # block devices of device_bytes bytes each, one "file" per device (devices.py).
    slot_dirs: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    device_bytes: tuple[int, ...] = ()

    def __post_init__(self):
        if self.slot_dirs and self.devices:
            raise ValueError("slots go to slot_dirs or to devices, not both")
        if len(self.devices) != len(self.device_bytes):
            raise ValueError("one size per device is needed")
        if self.rank_block_bytes <= 0:
            raise ValueError(
                f"no KV bytes per block ({self.rank_block_bytes}): the engine's KV "
                "cache is not sized yet"
            )
        if self.slot_files < 1:
            raise ValueError(f"slot_files must be at least 1, not {self.slot_files}")
        if self.num_slots < 1:
            raise ValueError(
                f"capacity {self.capacity_bytes} B holds no slot: one slot takes "
                f"{self.slot_bytes} B on each of {self.world_size} rank(s) "
                f"({self.blocks_per_chunk} block(s) of {self.rank_block_bytes} B, rounded up to "
                f"{SLOT_ALIGN})"
            )

    @property
    def slot_bytes(self) -> int:
        return round_up(self.rank_block_bytes * self.blocks_per_chunk, SLOT_ALIGN)

    @property
    def num_slots(self) -> int:
        per_slot = self.slot_bytes * self.world_size
        if not self.devices:
            return self.capacity_bytes // per_slot
        # every device holds as many slots (slot s on device s % n): the smallest decides;
        # capacity_bytes, where given, caps the store below the devices' size
        n = len(self.devices)
        each = min((b - DEVICE_HEADER) // per_slot for b in self.device_bytes)
        if self.capacity_bytes:
            each = min(each, self.capacity_bytes // per_slot // n)
        return max(0, each) * n

    @property
    def num_files(self) -> int:
        """Slot files per rank: at least `slot_files` (buffered writes to one file serialize on
        its inode lock, so consecutive slots go to different files), more where one file would
        pass max_file_bytes; a multiple of the slot directories where the slots allow, so
        consecutive slots go to different directories. Raw devices: one per device."""
        if self.devices:
            return len(self.devices)
        per_file = max(1, self.max_file_bytes // self.slot_bytes)
        n = max(-(-self.num_slots // per_file), min(self.slot_files, self.num_slots))
        k = len(self.slot_dirs)
        if k > 1 and round_up(n, k) <= self.num_slots:
            n = round_up(n, k)
        return n

    def file_slots(self, i: int) -> int:
        return (self.num_slots - i + self.num_files - 1) // self.num_files

    def file_base(self, rank: int = 0) -> int:
        """Where slot 0 of a rank's file starts: 0 in a slot file; on a raw device, past the
        header and the areas of the lower ranks."""
        if not self.devices:
            return 0
        return DEVICE_HEADER + rank * self.file_slots(0) * self.slot_bytes

    def locate(self, slot, rank: int = 0):
        """(file index, byte offset in that file or device) of a slot of `rank`, or of each of
        a numpy array of slots."""
        nf = self.num_files
        return slot % nf, self.file_base(rank) + (slot // nf) * self.slot_bytes

    def slot_path(self, root: str, rank: int, i: int) -> str:
        """The file (or device) that holds file index `i` of `rank`."""
        if self.devices:
            return self.devices[i]
        where = self.slot_dirs[i % len(self.slot_dirs)] if self.slot_dirs else root
        return slot_file(where, rank, self.world_size, i)

    @classmethod
    def from_manifest(cls, m: dict) -> Geometry:
        """The geometry a store's manifest (store.json) describes, slot for slot: the same
        slots, files or devices and offsets as the geometry that wrote it (for tools that read
        or damage a store without an engine)."""
        world, slot_bytes, slots, files = (
            m["world_size"],
            m["slot_bytes"],
            m["num_slots"],
            m["num_files"],
        )
        per_file = -(-slots // files)  # slots in the largest file (or on each device)
        devices = tuple(m.get("devices", ()))
        # each device: its header and one area of per_file slots per rank
        device_bytes = tuple(DEVICE_HEADER + per_file * slot_bytes * world for _ in devices)
        return cls(
            m["rank_block_bytes"],
            m["blocks_per_chunk"],
            world,
            slots * slot_bytes * world,  # capacity: every rank's slots
            per_file * slot_bytes,  # max_file_bytes: the manifest's files
            slot_files=files,
            slot_dirs=tuple(m.get("slot_dirs", ())),
            devices=devices,
            device_bytes=device_bytes,
        )

    def manifest(self, **extra) -> dict:
        return {
            "format": FORMAT,
            "rank_block_bytes": self.rank_block_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "world_size": self.world_size,
            "slot_bytes": self.slot_bytes,
            "num_slots": self.num_slots,
            "num_files": self.num_files,
            # only where set, so a store in one folder keeps the manifest it always had (and an
            # older release refuses a striped or raw-device store: a key it does not know)
            **({"slot_dirs": list(self.slot_dirs)} if self.slot_dirs else {}),
            **({"devices": list(self.devices)} if self.devices else {}),
            **extra,
        }


def rank_dir(root: str, rank: int, world_size: int) -> str:
    return os.path.join(root, f"rank{rank}of{world_size}")


def slot_file(root: str, rank: int, world_size: int, i: int) -> str:
    return os.path.join(rank_dir(root, rank, world_size), f"slots-{i:03d}.bin")


def commits_log(root: str, rank: int, world_size: int) -> str:
    return os.path.join(rank_dir(root, rank, world_size), "commits.log")


def manager_log(root: str) -> str:
    return os.path.join(root, "manager.log")


def write_json(path: str, obj: dict, what: str) -> None:
    """Replaces `path` whole (a temporary file of this process, then rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise StoreUnavailable(f"{what}: cannot write {explain(e, path)}") from None


def ensure_json(path: str, wanted: dict, what: str) -> None:
    """Writes `wanted` to `path` if absent; else refuses a store whose file says otherwise."""
    try:
        with open(path) as f:
            have = json.load(f)
    except FileNotFoundError:
        write_json(path, wanted, what)
        return
    refuse_difference(path, have, wanted, what)


def refuse_difference(path: str, have: dict, wanted: dict, what: str) -> None:
    """StoreMismatch naming every key where `have` (read from `path`) and `wanted` differ."""
    diff = {
        k: (have.get(k), wanted.get(k))
        for k in set(have) | set(wanted)
        if have.get(k) != wanted.get(k)
    }
    media = [k for k in ("slot_dirs", "devices") if k in diff]
    if media:

        def where(m: dict) -> str:
            return next((f"{k} {m[k]!r}" for k in media if m.get(k)), "its own folder")

        raise StoreMismatch(
            f"{what} at {path} keeps its slots in {where(have)}, but this engine was given "
            f"{where(wanted)}. Give the same list in the same order (the slots of a store "
            "cannot move), or another path."
        )
    if diff:
        raise StoreMismatch(
            f"{what} at {path} was made for another model or layout: "
            + ", ".join(f"{k} is {a!r} there, {b!r} here" for k, (a, b) in sorted(diff.items()))
            + ". Give this engine another path, or delete that store."
        )


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


_BLKGETSIZE64 = 0x80081272
_BLKSSZGET = 0x1268


def fd_size(fd: int) -> int:
    """Bytes of a regular file or of a block device (whose st_size is 0)."""
    st = os.fstat(fd)
    if not stat.S_ISBLK(st.st_mode):
        return st.st_size
    buf = bytearray(8)
    fcntl.ioctl(fd, _BLKGETSIZE64, buf)
    return struct.unpack("<Q", bytes(buf))[0]


_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000


def direct_alignment(fd: int) -> tuple[int, int]:
    """(memory, offset/length) alignment O_DIRECT needs on this file: a block device's logical
    block size (BLKSSZGET), else statx(STATX_DIOALIGN) where the kernel and file system report
    it, else 512, as the plugin decides (src/mem/file.rs)."""
    if stat.S_ISBLK(os.fstat(fd).st_mode):
        buf = bytearray(4)
        fcntl.ioctl(fd, _BLKSSZGET, buf)
        lbs = struct.unpack("<i", bytes(buf))[0]
        if lbs > 0:
            return lbs, lbs
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)
        rc = libc.statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf)
        mask = struct.unpack_from("<I", buf, 0)[0]
        mem, off = struct.unpack_from("<II", buf, 152)
        if rc == 0 and mask & _STATX_DIOALIGN and off > 0:
            return max(mem, 1), off
    except (OSError, AttributeError):
        pass
    return 512, 512
