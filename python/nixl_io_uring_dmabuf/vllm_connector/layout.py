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

A slot holds one offloaded chunk (blocks_per_chunk vLLM blocks) of one rank, page-major: for
each KV page (layer) in order, that page of each of the chunk's blocks in order; its size is
rounded up to 4096. A page's blocks lie end to end, so a run of consecutive vLLM blocks moves
as one I/O per page rather than one per (block, page).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import struct

SLOT_ALIGN = 4096
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

    def __post_init__(self):
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
        return self.capacity_bytes // (self.slot_bytes * self.world_size)

    @property
    def num_files(self) -> int:
        """Slot files per rank: at least `slot_files` (buffered writes to one file serialize on
        its inode lock, so consecutive slots go to different files), more where one file would
        pass max_file_bytes."""
        per_file = max(1, self.max_file_bytes // self.slot_bytes)
        return max(-(-self.num_slots // per_file), min(self.slot_files, self.num_slots))

    def file_slots(self, i: int) -> int:
        return (self.num_slots - i + self.num_files - 1) // self.num_files

    def locate(self, slot):
        """(file index, byte offset in that file) of a slot, or of each of a numpy array of
        slots."""
        return slot % self.num_files, (slot // self.num_files) * self.slot_bytes

    def manifest(self, **extra) -> dict:
        return {
            "format": FORMAT,
            "rank_block_bytes": self.rank_block_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "world_size": self.world_size,
            "slot_bytes": self.slot_bytes,
            "num_slots": self.num_slots,
            "num_files": self.num_files,
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


_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000


def direct_alignment(fd: int) -> tuple[int, int]:
    """(memory, offset/length) alignment O_DIRECT needs on this file: statx(STATX_DIOALIGN) where
    the kernel and file system report it, else 512, as the plugin decides (src/mem/file.rs)."""
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
