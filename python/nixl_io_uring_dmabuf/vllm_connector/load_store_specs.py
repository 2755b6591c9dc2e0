"""What the scheduler hands the workers for one job (vLLM's LoadStoreSpec): the slots, the
store generations, the keys of a store, and for a load every rank's checksums. Plain data: it
is pickled to worker processes in multiprocess engines."""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class NixlStoreSpec(LoadStoreSpec):
    """Store chunk i (in the GPU spec's order) into slots[i] as generation gens[i]."""

    def __init__(self, keys: list[bytes], slots: list[int], gens: list[int]):
        self.keys = [bytes(k) for k in keys]
        self.slots = np.asarray(slots, dtype=np.int64)
        self.gens = np.asarray(gens, dtype=np.int64)

    def __repr__(self) -> str:
        return f"NixlStoreSpec(slots={self.slots.tolist()})"


class NixlLoadSpec(LoadStoreSpec):
    """Load chunk i from slots[i]; sums[rank][i][sub] is sub-block sub's checksum on rank."""

    def __init__(self, slots: list[int], gens: list[int], sums: dict[int, list[tuple[int, ...]]]):
        self.slots = np.asarray(slots, dtype=np.int64)
        self.gens = np.asarray(gens, dtype=np.int64)
        self.sums = sums

    def __repr__(self) -> str:
        return f"NixlLoadSpec(slots={self.slots.tolist()})"
