"""The connector's parameters, read from vLLM's `kv_connector_extra_config` (the same dict in the
scheduler and in every worker), validated once, with one error naming the bad key."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

# Keys of kv_connector_extra_config that vLLM itself reads (offloading/config.py, base.py;
# sync_load_budget_bytes: offloading/scheduler.py of vLLM 0.33 and 0.34, loads served in the
# step that computes the request).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "self_describing_kv_events",
        "offload_prompt_only",
        "sync_load_budget_bytes",
    }
)


# IO_URING_DMABUF's parameters unless the config sets them: the engine's thread only posts
# (buffered writes and cached reads go to the plugin's workers). On the H200 this gives the
# fastest prefix hits from storage and the least decode slowdown while stores run; on CPU the
# same hits and less engine-thread time per store job (bench/results/2026-12-02-vllm-gpu-h200.md,
# 2026-12-02-vllm-connector-cpu.md). Other backends get exactly what the config gives.
IUD_DEFAULT_PARAMS = {"inline_write_max": "0", "page_cache_caller_reads": "false"}


def kv_transfer_config(**extra: Any) -> dict:
    """vLLM's `kv_transfer_config` for the connector as the README gives it (the subclass with
    vLLM's recompute policy); `extra`: the keys of its kv_connector_extra_config (path,
    capacity_gb, o_direct, backend_params, ...)."""
    return {
        "kv_connector": "NixlStorageOffloadingConnector",
        "kv_connector_module_path": "nixl_io_uring_dmabuf.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "NixlStorageOffloadingSpec",
            "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
            **extra,
        },
    }


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return v.lower() in ("true", "1", "yes", "on")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ValueError(f"kv_connector_extra_config[{key!r}] must be a boolean, not {v!r}")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """path: the store's folder (one per engine; a rank folder per TP rank inside).
    capacity_bytes: bytes of slot files of all ranks together (capacity_gb in the config).
    backend / backend_params: the NIXL backend that moves the bytes (IO_URING_DMABUF, POSIX,
    GDS_MT, ...) and its parameters. o_direct: open the slot files with O_DIRECT. durable:
    fdatasync the slot file before a block's commit record and the journals after each append
    (survives power loss; costs the worker a sync per store job). verify_on_lookup: the
    scheduler reads and checks a block from storage the first time it would answer HIT for it
    in this process (see docs/vllm-connector.md). max_file_bytes: size of one slot file.
    slot_files: slot files per rank at least (consecutive slots go to different files).
    store_queue_s: the most store work in flight, in seconds at the rate storage has lately
    shown; blocks beyond it are not stored (backpressure.py); 0: no limit.
    slot_dirs: directories the slot files are spread over (file i in slot_dirs[i % n]); ():
    the store's folder. devices: raw block devices the slots are spread over instead (slot s on
    device s % n; always O_DIRECT; capacity_bytes 0 = their whole size); overwrite_devices:
    claim a device that carries a file system, a partition table or another store's slots."""

    path: str
    capacity_bytes: int
    backend: str = "IO_URING_DMABUF"
    backend_params: Mapping[str, str] = dataclasses.field(default_factory=dict)
    o_direct: bool = False
    durable: bool = False
    verify_on_lookup: bool = True
    max_file_bytes: int = 64 << 30
    slot_files: int = 8
    preallocate: bool = True
    store_queue_s: float = 10.0
    slot_dirs: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    overwrite_devices: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> StoreConfig:
        ours = {
            "path",
            "capacity_gb",
            "capacity_bytes",
            "backend",
            "backend_params",
            "o_direct",
            "durable",
            "verify_on_lookup",
            "max_file_gb",
            "preallocate",
            "slot_files",
            "store_queue_s",
            "slot_dirs",
            "devices",
            "overwrite_devices",
        }
        unknown = sorted(k for k in extra if k not in ours and k not in VLLM_KEYS)
        if unknown:
            raise ValueError(
                f"NixlStorageOffloadingSpec: unknown kv_connector_extra_config keys "
                f"{unknown} (known: {sorted(ours)})"
            )
        path = extra.get("path")
        if not path or not isinstance(path, str):
            raise ValueError(
                "NixlStorageOffloadingSpec: kv_connector_extra_config['path'] "
                "(the store's folder) is required"
            )
        slot_dirs = _paths(extra, "slot_dirs")
        if slot_dirs == (os.path.abspath(path),):
            slot_dirs = ()  # the store's own folder: the default placement
        devices = _paths(extra, "devices")
        if slot_dirs and devices:
            raise ValueError(
                "NixlStorageOffloadingSpec: give slot_dirs (slot files in directories) or "
                "devices (raw block devices), not both"
            )
        if devices and not _bool("o_direct", extra.get("o_direct", True)):
            raise ValueError(
                "NixlStorageOffloadingSpec: raw devices are always opened with O_DIRECT "
                "(through the page cache they would cache the KV cache twice); leave o_direct out"
            )
        if "capacity_bytes" in extra:
            cap = int(extra["capacity_bytes"])
        elif "capacity_gb" in extra:
            cap = int(float(extra["capacity_gb"]) * (1 << 30))
        elif devices:
            cap = 0  # the devices' whole size
        else:
            raise ValueError(
                "NixlStorageOffloadingSpec: kv_connector_extra_config['capacity_gb']"
                " (bytes of storage for KV blocks, all ranks) is required"
            )
        if cap < 0 or (cap == 0 and not devices):
            raise ValueError(f"NixlStorageOffloadingSpec: capacity must be positive, not {cap}")
        params = extra.get("backend_params") or {}
        if not isinstance(params, Mapping):
            raise ValueError("kv_connector_extra_config['backend_params'] must be a dict")
        max_file = int(float(extra.get("max_file_gb", 64)) * (1 << 30))
        if max_file <= 0:
            raise ValueError("kv_connector_extra_config['max_file_gb'] must be positive")
        slot_files = extra.get("slot_files", 8)
        if isinstance(slot_files, bool) or not isinstance(slot_files, int) or slot_files < 1:
            raise ValueError(
                "kv_connector_extra_config['slot_files'] must be a positive "
                f"integer, not {slot_files!r}"
            )
        queue_s = extra.get("store_queue_s", 10.0)
        if isinstance(queue_s, bool) or not isinstance(queue_s, (int, float)) or queue_s < 0:
            raise ValueError(
                "kv_connector_extra_config['store_queue_s'] must be a number of seconds >= 0 "
                f"(0: no limit), not {queue_s!r}"
            )
        backend = str(extra.get("backend", "IO_URING_DMABUF"))
        # JSON true/false arrive as Python bools; str() would give "True", which NIXL's own
        # backends need not accept
        given = {
            str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in params.items()
        }
        if backend == "IO_URING_DMABUF":
            given = {**IUD_DEFAULT_PARAMS, **given}
        return cls(
            path=path,
            capacity_bytes=cap,
            backend=backend,
            backend_params=given,
            o_direct=bool(devices) or _bool("o_direct", extra.get("o_direct", False)),
            durable=_bool("durable", extra.get("durable", False)),
            verify_on_lookup=_bool("verify_on_lookup", extra.get("verify_on_lookup", True)),
            max_file_bytes=max_file,
            slot_files=slot_files,
            preallocate=_bool("preallocate", extra.get("preallocate", True)),
            store_queue_s=float(queue_s),
            slot_dirs=slot_dirs,
            devices=devices,
            overwrite_devices=_bool("overwrite_devices", extra.get("overwrite_devices", False)),
        )


def _paths(extra: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """A list of absolute paths (a lone string is a list of one); none twice."""
    v = extra.get(key) or ()
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a list of paths, not {v!r}")
    out = tuple(os.path.abspath(p) for p in v)
    if len(set(out)) != len(out):
        raise ValueError(f"kv_connector_extra_config[{key!r}] names a path twice: {list(v)}")
    return out
