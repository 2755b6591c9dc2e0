"""LMCache 0.5.6 through its own code (StorageManager, NixlStorageBackend) on CPU, cpu buffer mode
(the LocalCPUBackend pool registered as DRAM), byte for byte, three ways in the same run:

* baseline: LMCache's built-in backend with nixl_backend POSIX = NIXL's own POSIX;
* as-posix: the same LMCache config, with the plugin installed `--as POSIX` into (a copy of) the
  NIXL wheel's default plugin folder: no LMCache change, no NIXL_PLUGIN_DIR;
* plugin: the project's storage plugin (nixl_io_uring_dmabuf.lmcache), NIXL backend
  IO_URING_DMABUF by its own name.

Each for the static pool and dynamic mode, buffered and use_direct_io. Needs the clients venv
(bash ci/clients-setup.sh: torch, lmcache==0.5.6, nixl-cu13); skips without it.
"""

from __future__ import annotations

import json
import os

import clients_env as E

DRIVER = os.path.join(os.path.dirname(__file__), "lmcache_driver.py")
GEOMETRY = {"layers": 4, "tokens": 256, "heads": 8, "head_dim": 64}  # 2 MiB chunks (bf16)


COMBOS = [(pool, direct) for pool in (8, 0) for direct in (False, True)]


def drive(clients, route_env, spec, root):
    """All four combinations (static/dynamic x buffered/direct) in one child: LMCache and torch
    take seconds to import."""
    specs = []
    for pool, direct in COMBOS:
        path = os.path.join(
            root, f"{'static' if pool else 'dynamic'}-{'direct' if direct else 'buffered'}"
        )
        os.makedirs(path)  # dynamic mode expects nixl_path to exist
        specs.append(dict(GEOMETRY, **spec, chunks=8, batch=4, path=path, pool=pool, direct=direct))
    p = E.run([clients["py"], DRIVER, json.dumps(specs)], route_env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = [
        json.loads(ln[len("RESULT ") :]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")
    ]
    assert len(results) == len(specs)
    for r in results:
        assert r["bad"] == [], (r["spec"], r["bad"])
        assert any(os.scandir(r["spec"]["path"])), r["spec"]  # the files are there
    return results, p.stderr


def show(name, results):
    for r in results:
        s = r["spec"]
        print(
            f"{name:32s} {'static' if s['pool'] else 'dynamic':8s} "
            f"{'direct' if s['direct'] else 'buffered':9s} put {r['put_gbps']:.3f} GB/s "
            f"get {r['get_gbps']:.3f} GB/s ({r['chunks']} x {r['chunk_bytes']} B)"
        )


def test_nixl_posix_baseline(clients, tmp_path):
    """NIXL's own POSIX: the clients venv's untouched wheel."""
    res, log = drive(
        clients, E.child_env([clients["pkgs"]]), {"route": "builtin", "name": "POSIX"}, tmp_path
    )
    assert "serving as" not in log and all(r["nixl_backend"] == "POSIX" for r in res)
    show("NIXL POSIX", res)


def test_plugin_installed_as_posix(clients, tmp_path):
    """The same LMCache config; NIXL's default plugin folder holds the plugin as POSIX."""
    res, log = drive(
        clients,
        E.child_env([clients["site"], clients["pkgs"]]),
        {"route": "builtin", "name": "POSIX"},
        tmp_path,
    )
    assert log.count("IO_URING_DMABUF serving as POSIX ") == 1, log[-3000:]
    show("IO_URING_DMABUF --as POSIX", res)


def test_storage_plugin_by_its_own_name(clients, tmp_path):
    """The storage plugin: LMCache's own backend classes, NIXL backend IO_URING_DMABUF."""
    res, log = drive(
        clients, E.child_env([clients["site"], clients["pkgs"]]), {"route": "plugin"}, tmp_path
    )
    assert "serving as" not in log
    for r in res:
        assert "NixlStorageBackend" not in r["backends"] and "IO_URING_DMABUF" in r["backends"]
        assert r["nixl_backend"] == "IO_URING_DMABUF"
        assert r["backend_class"] == (
            "NixlStaticStorageBackend" if r["spec"]["pool"] else "NixlDynamicStorageBackend"
        )
    show("IO_URING_DMABUF storage plugin", res)


def test_plugin_explains_an_unpaged_cpu_pool(clients, tmp_path):
    """Without the paging switch LMCache's CPU pool cannot be registered page by page; the
    plugin names the switch (LMCache only logs a storage plugin that fails to construct)."""
    code = r"""
import sys, torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from nixl_io_uring_dmabuf.lmcache import IoUringDmabufBackend
cfg = LMCacheEngineConfig.from_dict({"chunk_size": 16, "local_cpu": False, "max_local_cpu_size": 0.01,
    "nixl_buffer_device": "cpu", "save_unfull_chunk": False,
    "extra_config": {"nixl_pool_size": 2, "nixl_path": sys.argv[1]}})
md = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                     local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 64))
try:
    IoUringDmabufBackend(cfg, "cpu", md, LocalCPUBackend(cfg, md, "cpu"), None)
except RuntimeError as e:
    print("REFUSED", e)
"""
    p = E.run([clients["py"], "-c", code, str(tmp_path)], E.child_env([clients["pkgs"]]))
    assert "REFUSED" in p.stdout and "rust_raw_block.use_uring: true" in p.stdout, p.stderr[-2000:]
