"""One DRAM -> FILE -> DRAM round trip through NIXL's Python API, timed and checked byte for byte.

Used by `doctor` (a small one per backend name) and `bench` (a large one). It drives a backend
the way storage clients do: DRAM is the local list, FILE the "remote" list, the agent's own
name the remote agent; one WRITE request, then one READ into a second, poisoned buffer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import time
import uuid

PAGE = 4096


@dataclasses.dataclass
class Result:
    backend: str
    size: int
    block: int
    write_s: float
    read_s: float
    ok: bool
    detail: str = ""

    def gbps(self, seconds: float) -> float:
        return self.size / seconds / 1e9 if seconds > 0 else float("inf")


class DramBuffer:
    """Page-aligned anonymous memory with its address."""

    def __init__(self, size: int):
        self.size = size
        self.mm = mmap.mmap(-1, max(PAGE, -(-size // PAGE) * PAGE))
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def close(self) -> None:
        del self._anchor
        self.mm.close()


def _wait(agent, handle, timeout_s: float) -> str:
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state not in ("DONE", "ERR"):
        if time.monotonic() > deadline:
            return "TIMEOUT"
        state = agent.check_xfer_state(handle)
    return state


def run(
    agent,
    backend: str,
    directory: str,
    size: int,
    block: int,
    direct: bool = False,
    timeout_s: float = 120.0,
) -> Result:
    """Writes `size` random bytes in `block`-sized descriptors to a new file in `directory`, reads
    them back, compares. The agent must already have `backend` created."""
    size = -(-size // block) * block
    src, dst = DramBuffer(size), DramBuffer(size)
    path = os.path.join(directory, f"iud-roundtrip-{uuid.uuid4().hex[:8]}.dat")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    regs = []
    handles = []
    try:
        chunk = os.urandom(min(size, 1 << 20))
        for off in range(0, size, len(chunk)):
            n = min(len(chunk), size - off)
            src.mm[off : off + n] = chunk[:n]
        dst.mm[:size] = b"\xa5" * size
        regs.append(
            agent.register_memory(
                [(src.addr, size, 0, ""), (dst.addr, size, 0, "")], "DRAM", backends=[backend]
            )
        )
        regs.append(agent.register_memory([(0, size, fd, "")], "FILE", backends=[backend]))
        offs = range(0, size, block)
        file_descs = agent.get_xfer_descs([(o, block, fd) for o in offs], "FILE")
        times = {}
        for op, buf in (("WRITE", src), ("READ", dst)):
            mem = agent.get_xfer_descs([(buf.addr + o, block, 0) for o in offs], "DRAM")
            h = agent.initialize_xfer(op, mem, file_descs, agent.name, backends=[backend])
            handles.append(h)
            t0 = time.perf_counter()
            state = _wait(agent, h, timeout_s)
            times[op] = time.perf_counter() - t0
            if state != "DONE":
                return Result(
                    backend,
                    size,
                    block,
                    times.get("WRITE", 0),
                    times.get("READ", 0),
                    False,
                    f"{op} ended in state {state}",
                )
        same = src.mm[:size] == dst.mm[:size]
        return Result(
            backend,
            size,
            block,
            times["WRITE"],
            times["READ"],
            same,
            "" if same else "the bytes read back differ from the bytes written",
        )
    finally:
        for h in handles:
            agent.release_xfer_handle(h)
        for r in reversed(regs):
            agent.deregister_memory(r, backends=[backend])
        os.close(fd)
        os.unlink(path)
        src.close()
        dst.close()


def new_agent(name_prefix: str = "iud"):
    """An agent with no default backends (create_backend adds the one under test)."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"{name_prefix}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[]))
