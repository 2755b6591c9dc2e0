"""IO_URING_DMABUF for NIXL: the plugin library, the tools that install it, and its integrations.

Tools (tools/): `python -m nixl_io_uring_dmabuf install [--as GDS_MT|POSIX|GDS] [--plugin-dir D]
[--uninstall]` puts the plugin where the installed nixl-cu12 / nixl-cu13 wheel's NIXL finds it;
`doctor` says what a process would load; `bench` times a DRAM<->FILE round trip through NIXL.

Integrations, at the module paths client configurations name (docs/use-from-clients.md):
- vllm_connector: vLLM's KV-offloading spec and connector (NixlStorageOffloadingSpec,
  NixlStorageOffloadingConnector).
- vllm_tier: a secondary tier for vLLM 0.33's KV-offload tiering (NixlFileTier).
- lmcache: LMCache's storage plugin.

storage_node/ serves files and block devices to other machines over UCX
(`python -m nixl_io_uring_dmabuf.storage_node`, docs/remote-storage.md).
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

#: The backend name the plugin has when it is not serving under another one.
PLUGIN_NAME = "IO_URING_DMABUF"

#: Names `--as` accepts: the storage backends whose callers hard-code them (docs/clients.md).
ALIASES = ("POSIX", "GDS_MT", "GDS")

_HERE = os.path.dirname(os.path.abspath(__file__))


def plugin_library() -> str:
    """Path of the plugin library this package carries.

    In an installed wheel it is lib/libplugin_IO_URING_DMABUF.so inside the package. Run from a
    source checkout, $IUD_PLUGIN_SO or the cargo build output stands in for it.
    """
    bundled = os.path.join(_HERE, "lib", "libplugin_IO_URING_DMABUF.so")
    if os.path.isfile(bundled):
        return bundled
    candidates = [os.environ.get("IUD_PLUGIN_SO", "")]
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(_HERE, "..", "..", "target")
    candidates.append(os.path.join(target, "release", "libio_uring_dmabuf.so"))
    for c in candidates:
        if c and os.path.isfile(c):
            return os.path.abspath(c)
    raise FileNotFoundError(
        f"no plugin library: {bundled} is missing (this is not an installed wheel) and no "
        "cargo build output was found; build with ci/wheel.sh or set IUD_PLUGIN_SO"
    )
