"""LMCache storage plugin: LMCache's own NIXL storage backend, with the NIXL backend IO_URING_DMABUF.

LMCache 0.5.6 only lets its built-in NIXL backend use GDS, GDS_MT, OBJ (cpu or cuda buffer) and
POSIX, HF3FS, AZURE_BLOB, DOCA_MEMOS (cpu) (lmcache/v1/storage_backend/nixl_storage_backend.py,
NixlStorageConfig.validate_nixl_backend). Out-of-tree backends load through `storage_plugins`
(lmcache/v1/storage_backend/__init__.py, storage_plugin_launcher). This module is such a plugin:
it is LMCache's NixlStaticStorageBackend (nixl_pool_size > 0) or NixlDynamicStorageBackend
(nixl_pool_size 0), unchanged, reading the same extra_config keys as the built-in one
(nixl_pool_size, nixl_path, use_direct_io, nixl_backend_params, ...), creating the NIXL backend
IO_URING_DMABUF (or extra_config.nixl_backend if set). Configuration:

    chunk_size: 256
    max_local_cpu_size: 8              # cpu mode: the shared pinned pool NIXL registers (DRAM)
    nixl_buffer_device: cpu            # cuda: a VRAM buffer of nixl_buffer_size
    storage_plugins: [IO_URING_DMABUF]
    extra_config:
      storage_plugin.IO_URING_DMABUF.module_path: nixl_io_uring_dmabuf.lmcache
      storage_plugin.IO_URING_DMABUF.class_name: IoUringDmabufBackend
      nixl_pool_size: 64               # 0 = dynamic mode, one file per key
      nixl_path: /mnt/nvme/lmcache/
      use_direct_io: true
      rust_raw_block.use_uring: true   # cpu mode only, see below

Do not set enable_nixl_storage: that creates the built-in backend as well. In cpu mode
LMCache's NIXL backend registers the LocalCPUBackend's pool page by page, which needs that pool
to be paged; LMCache 0.5.6 pages it for enable_nixl_storage or for its io_uring storage plugins
(extra_config rust_raw_block.use_uring / rust_raw_block.io_engine: io_uring;
local_cpu_backend.py, LocalCPUBackend.initialize_allocator). The second is the switch that
works without the built-in backend; this plugin says so when the pool is not paged.
"""

from __future__ import annotations

import copy
from typing import Any

from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_allocators.paged_tensor_memory_allocator import PagedTensorMemoryAllocator
from lmcache.v1.storage_backend.nixl_storage_backend import (
    NixlDynamicStorageBackend,
    NixlStaticStorageBackend,
    NixlStorageConfig,
)

DEFAULT_BACKEND = "IO_URING_DMABUF"
# A name LMCache accepts for both cpu and cuda buffers and for file pools; used only while
# LMCache parses and validates the config, then replaced by the real backend name.
_STAND_IN = "GDS_MT"


def _configs(config: Any, metadata: Any) -> tuple[NixlStorageConfig, Any]:
    """LMCache's own parse of the nixl_* keys, for our backend name.

    Returns the NixlStorageConfig and a private copy of the engine config that carries
    enable_nixl_storage (LMCache's allocator path asserts it); the caller's config is left as
    it is, so LMCache does not create its built-in NIXL backend too.
    """
    extra = dict(config.extra_config or {})
    backend = extra.get("nixl_backend") or DEFAULT_BACKEND
    mine = copy.copy(config)
    mine.extra_config = dict(extra, enable_nixl_storage=True, nixl_backend=_STAND_IN)
    if mine.extra_config.get("nixl_pool_size") is None:
        raise ValueError(
            f"{backend} storage plugin: extra_config.nixl_pool_size is required "
            "(0 = one file per key)"
        )
    nixl_config = NixlStorageConfig.from_cache_engine_config(mine, metadata)
    nixl_config.backend = backend
    return nixl_config, mine


def _check_cpu_pool(nixl_config: NixlStorageConfig, local_cpu_backend: Any) -> None:
    if nixl_config.buffer_device != "cpu":
        return
    if local_cpu_backend is None:
        raise RuntimeError(
            f"{nixl_config.backend} storage plugin: nixl_buffer_device cpu "
            "needs LMCache's LocalCPUBackend (max_local_cpu_size > 0)"
        )
    alloc = local_cpu_backend.get_memory_allocator()
    if not (
        isinstance(alloc, MixedMemoryAllocator)
        and isinstance(alloc.pin_allocator, PagedTensorMemoryAllocator)
    ):
        raise RuntimeError(
            f"{nixl_config.backend} storage plugin: LMCache's CPU pool is not paged, so NIXL "
            "cannot register it page by page; set extra_config rust_raw_block.use_uring: true "
            "(LMCache 0.5.6 pages the pool for io_uring storage plugins) or use "
            "nixl_buffer_device: cuda"
        )


class _Static(NixlStaticStorageBackend):
    @staticmethod
    def createPool(backend, size, path, use_direct_io, path_sharding, dst_device):
        # The pool of files is the same as for LMCache's own file backends.
        return NixlStaticStorageBackend.createPool(
            "POSIX", size, path, use_direct_io, path_sharding, dst_device
        )


class _Dynamic(NixlDynamicStorageBackend):
    pass


class IoUringDmabufBackend:
    """The class LMCache's storage_plugin_launcher instantiates: returns LMCache's static or
    dynamic NIXL storage backend for IO_URING_DMABUF."""

    def __new__(cls, config, dst_device=None, metadata=None, local_cpu_backend=None, loop=None):
        nixl_config, mine = _configs(config, metadata)
        _check_cpu_pool(nixl_config, local_cpu_backend)
        impl = _Dynamic if nixl_config.dynamic_storage else _Static
        return impl(nixl_config, mine, metadata, loop, local_cpu_backend)
