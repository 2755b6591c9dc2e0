"""How a storage node is set up: the `serve` options (__main__.py, docs/remote-storage.md) as one
frozen NodeConfig, and the node's log line on stderr."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from . import nixl_runtime

MiB = 1 << 20


def log(msg: str) -> None:
    print(f"iuds-node: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class NodeConfig:
    """What a node serves with (the `serve` options of __main__.py, docs/remote-storage.md)."""

    backend: str = "IO_URING_DMABUF"  # the storage backend (or POSIX, for comparison)
    backend_params: dict = field(default_factory=dict)
    buffers: int = 16  # staging buffers in the pool
    buffer_size: int = 4 * MiB
    pool_mem: str = "DRAM"  # the pool's memory: DRAM or VRAM (on GPU `gpu`)
    gpu: int = 0
    listen_port: int | None = None  # NIXL's socket listener; None: off
    publish_etcd: bool | None = None  # None: when NIXL_ETCD_ENDPOINTS is set
    stall_timeout: float = 30.0
    client_lease: float = 10.0
    md_timeout: float = 10.0
    progress_delay_us: int | None = None  # None: nixl_runtime.progress_delay_us()
    allow_net_only: bool = False  # bench/remote_bench.py only: READs without storage

    def resolved(self) -> NodeConfig:
        """This config with what it leaves to the environment decided: publish_etcd (whether
        NIXL_ETCD_ENDPOINTS is set) and progress_delay_us (nixl_runtime.progress_delay_us)."""
        return replace(
            self,
            backend_params=dict(self.backend_params),
            publish_etcd=(
                nixl_runtime.etcd_configured() if self.publish_etcd is None else self.publish_etcd
            ),
            progress_delay_us=(
                nixl_runtime.progress_delay_us()
                if self.progress_delay_us is None
                else self.progress_delay_us
            ),
        )
