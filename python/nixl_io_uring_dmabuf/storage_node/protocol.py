"""The storage node's messages: requests, completions and control, carried as NIXL notifications.

Every message is one NIXL notification (``send_notif`` / ``get_new_notifs``), so the node and its
clients share no channel besides the agents themselves. A message is

    b"IUDS" | kind (4 ASCII bytes) | header length (u32 little endian) | JSON header | payload

The payload of a request is an N x 5 array of little-endian uint64, one row per block:
(file index into the header's "files", file offset, length, client address, client device id).
A block is the unit the client asks for; the node may cut it into pieces internally.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"IUDS"
VERSION = 1

# Message kinds.
REQ = b"REQ_"  # client -> node: READ (file -> client memory) or WRITE (client memory -> file)
DONE = b"DONE"  # node -> client: one request finished (ok or with an error text)
PING = b"PING"  # client -> node: "still here" while requests are outstanding (a lease)
STAT = b"STAT"  # client -> node: ask for counters
STATR = b"STAR"  # node -> client: counters (answer to STAT)
BYE = b"BYE_"  # client -> node: forget me (its metadata and any bookkeeping)
CNCL = b"CNCL"  # client -> node: give up request "id" (answered by its DONE once nothing moves)

KINDS = (REQ, DONE, PING, STAT, STATR, BYE, CNCL)
BLOCK_FIELDS = 5
# A request names at most this many blocks; larger lists are split by the client library. Bounds
# the size of one notification (MAX_BLOCKS * 40 bytes = 2.5 MiB).
MAX_BLOCKS = 65536

_HDR = struct.Struct("<4s4sI")


class ProtocolError(ValueError):
    """A message that is not a storage-node message or is malformed."""


@dataclass
class Message:
    kind: bytes
    header: dict
    payload: bytes = b""


def encode(kind: bytes, header: dict, payload: bytes = b"") -> bytes:
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    h = dict(header)
    h.setdefault("v", VERSION)
    body = json.dumps(h, separators=(",", ":")).encode()
    return _HDR.pack(MAGIC, kind, len(body)) + body + payload


def decode(msg: bytes) -> Message:
    if len(msg) < _HDR.size:
        raise ProtocolError(
            f"message of {len(msg)} bytes is shorter than the {_HDR.size}-byte frame"
        )
    magic, kind, hlen = _HDR.unpack_from(msg)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    end = _HDR.size + hlen
    if end > len(msg):
        raise ProtocolError(f"header length {hlen} runs past the {len(msg)}-byte message")
    try:
        header = json.loads(msg[_HDR.size : end])
    except ValueError as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise ProtocolError(
            f"unsupported header version {header.get('v') if isinstance(header, dict) else header!r}"
        )
    return Message(kind, header, bytes(msg[end:]))


class MdExchange(enum.Enum):
    """How a client publishes its metadata: the "md" field of its REQ and STAT headers."""

    ETCD = "etcd"  # NIXL's etcd support (NIXL_ETCD_ENDPOINTS)
    SOCKET = "p2p"  # NIXL's socket listener, peer to peer

    @classmethod
    def of(cls, header: dict) -> MdExchange:
        """The exchange a header names; etcd where it names none."""
        return cls.ETCD if header.get("md", cls.ETCD.value) == cls.ETCD.value else cls.SOCKET


@dataclass
class Request:
    """A READ or WRITE request as the node sees it."""

    req_id: int
    op: str  # "READ" (file -> client) or "WRITE" (client -> file)
    mem: str  # client memory type: "DRAM" or "VRAM"
    files: list[str]  # export names, indexed by column 0 of blocks
    blocks: np.ndarray  # N x 5 uint64
    net_only: bool = False  # benchmark: skip storage, move pool buffers over UCX only
    instance: str = ""  # client instance token (changes when a client restarts)
    extra: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.blocks[:, 2].sum()) if len(self.blocks) else 0


def encode_request(req: Request) -> bytes:
    blocks = np.ascontiguousarray(req.blocks, dtype="<u8")
    if blocks.ndim != 2 or blocks.shape[1] != BLOCK_FIELDS:
        raise ProtocolError(f"blocks must be N x {BLOCK_FIELDS}, got shape {blocks.shape}")
    if not 0 < len(blocks) <= MAX_BLOCKS:
        raise ProtocolError(f"a request names 1..{MAX_BLOCKS} blocks, got {len(blocks)}")
    header = {
        "id": req.req_id,
        "op": req.op,
        "mem": req.mem,
        "files": req.files,
        "n": len(blocks),
        "net_only": req.net_only,
        "inst": req.instance,
        **req.extra,
    }
    return encode(REQ, header, blocks.tobytes())


def decode_request(m: Message) -> Request:
    h = m.header
    try:
        n = int(h["n"])
        op, mem, files, req_id = h["op"], h["mem"], list(h["files"]), int(h["id"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"request header lacks or garbles {e}") from None
    if op not in ("READ", "WRITE"):
        raise ProtocolError(f"request {req_id}: op must be READ or WRITE, got {op!r}")
    if mem not in ("DRAM", "VRAM"):
        raise ProtocolError(f"request {req_id}: memory must be DRAM or VRAM, got {mem!r}")
    if not 0 < n <= MAX_BLOCKS or len(m.payload) != n * BLOCK_FIELDS * 8:
        raise ProtocolError(
            f"request {req_id}: {n} blocks do not match a payload of {len(m.payload)} bytes"
        )
    blocks = np.frombuffer(m.payload, dtype="<u8").reshape(n, BLOCK_FIELDS).astype(np.uint64)
    return Request(
        req_id,
        op,
        mem,
        files,
        blocks,
        bool(h.get("net_only", False)),
        str(h.get("inst", "")),
        {"md": h.get("md", "etcd")},
    )


def done(req_id: int, ok: bool, nbytes: int = 0, error: str = "", node: str = "") -> bytes:
    return encode(DONE, {"id": req_id, "ok": ok, "bytes": nbytes, "error": error, "node": node})
