"""A bounded pool of registered staging buffers on the storage node.

The pool is one allocation cut into equal buffers and registered once with every backend that
touches it (the storage backend and UCX), so no request ever registers memory. Buffers are
handed out by index; a request that cannot get one waits, which bounds the node's memory and
is the back-pressure of the pipeline. DRAM buffers come from an anonymous mmap (page aligned,
so O_DIRECT files and block devices accept them); VRAM buffers (a GPU storage node) come from a
torch CUDA tensor.
"""

from __future__ import annotations

import mmap

import numpy as np

ALIGN = 4096


class BufferPool:
    def __init__(
        self,
        agent,
        count: int,
        size: int,
        mem: str = "DRAM",
        backends: list[str] | None = None,
        gpu: int = 0,
    ):
        if count < 2:
            raise ValueError(
                f"the pool needs at least 2 buffers to overlap storage and network, got {count}"
            )
        if size < ALIGN or size % ALIGN:
            raise ValueError(f"buffer size must be a multiple of {ALIGN}, got {size}")
        self.agent, self.count, self.size, self.mem = agent, count, size, mem
        self.dev = 0
        total = count * size
        self._keep = None
        if mem == "DRAM":
            self._mm = mmap.mmap(-1, total)
            arr = np.frombuffer(self._mm, dtype=np.uint8)
            self.base = arr.ctypes.data
            self._keep = arr
        elif mem == "VRAM":
            import torch  # only a GPU storage node needs it

            self._keep = torch.empty(total, dtype=torch.uint8, device=f"cuda:{gpu}")
            self.base = self._keep.data_ptr()
            self.dev = gpu
        else:
            raise ValueError(f"pool memory must be DRAM or VRAM, got {mem!r}")
        self._reg = agent.register_memory(
            [(self.base, total, self.dev, "iuds-pool")], mem, backends=backends or []
        )
        self._free = list(range(count - 1, -1, -1))
        self.quarantined = 0  # buffers held by transfers that could not be cancelled

    def addr(self, idx: int) -> int:
        return self.base + idx * self.size

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, idx: int) -> None:
        assert idx not in self._free, f"buffer {idx} returned twice"
        self._free.append(idx)

    @property
    def free(self) -> int:
        return len(self._free)

    def view(self, idx: int) -> np.ndarray:
        """The bytes of one DRAM buffer (for net-only benchmark fills and tests)."""
        if self.mem != "DRAM":
            raise ValueError("only DRAM buffers have a host view")
        return np.frombuffer(self._mm, dtype=np.uint8)[idx * self.size : (idx + 1) * self.size]

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
