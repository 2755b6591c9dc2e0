"""LMCache 0.5.6 in cuda mode (nixl_buffer_device: cuda, a VRAM buffer registered with NIXL) on
the GPU machine, three ways: NIXL's own GDS_MT, the plugin installed --as GDS_MT into a copy of
the NIXL wheel's default folder (LMCache config unchanged), and the project's LMCache storage
plugin by the name IO_URING_DMABUF. Byte for byte, timed; static and dynamic, buffered and
use_direct_io.

    IUD_PLUGIN_SO=<plugin .so> python3 tests/gpu/lmcache_cuda.py [result.json]

IUD_LMCACHE_ROUTES (comma-separated route names, default all) picks routes; IUD_LMCACHE_LOG_DIR
keeps each route's whole child stderr (the plugin's log, its profile lines with
IO_URING_DMABUF_PROFILE=1) there; IUD_LMCACHE_REPEAT_FIRST=1 runs the first spec again at the
end of each child, to tell one-time costs of a process from the steady state;
IUD_LMCACHE_PARAMS (a JSON object) is passed as nixl_backend_params to the plugin's routes;
IUD_LMCACHE_IO=buffered (or direct) runs only those files.

Prints "SKIP: <reason>" and exits 0 without a CUDA GPU or without LMCache importable; exits 1
if any route fails. PYTHONPATH must make torch, lmcache (and its storage-path dependencies) and
NIXL importable; the project's python/ folder is added here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [os.path.join(REPO, "tests", "python", "clients"), os.path.join(REPO, "python")]


def main() -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            print("SKIP: no CUDA GPU (torch.cuda.is_available() is False)")
            return 0
        import lmcache  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e} (carry torch, lmcache==0.5.6 and its storage-path dependencies)")
        return 0
    import clients_env as E

    tmp = tempfile.mkdtemp(prefix="iud-lmcache-cuda-")
    site = os.path.join(tmp, "site")
    pkg = os.path.join(REPO, "python")
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    E.copy_nixl(site, E.wheel_module_of(sys.executable, inherited))
    p = E.run(
        [sys.executable, "-m", "nixl_io_uring_dmabuf", "install", "--as", "GDS_MT"],
        E.child_env([site, pkg] + inherited),
    )
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        return 1
    driver = os.path.join(REPO, "tests", "python", "clients", "lmcache_driver.py")
    geometry = {
        "layers": 16,
        "tokens": 256,
        "heads": 8,
        "head_dim": 64,
        "chunks": 32,
        "batch": 8,
        "device": "cuda",
    }  # Llama-3.2-1B: 8 MiB chunks
    routes = {
        "NIXL GDS_MT": ([pkg] + inherited, {"route": "builtin", "name": "GDS_MT"}),
        "IO_URING_DMABUF --as GDS_MT": (
            [site, pkg] + inherited,
            {"route": "builtin", "name": "GDS_MT"},
        ),
        "IO_URING_DMABUF storage plugin": ([site, pkg] + inherited, {"route": "plugin"}),
    }
    wanted = [r for r in os.environ.get("IUD_LMCACHE_ROUTES", "").split(",") if r]
    routes = {k: v for k, v in routes.items() if not wanted or k in wanted}
    results, status = {}, 0
    for name, (path, route) in routes.items():
        specs = []
        # A static pool holds every chunk (a smaller one evicts: LMCache then answers misses,
        # which the driver counts as failures; the 2026-12-01 H200 run had 16 slots for 32).
        for pool in (geometry["chunks"], 0):
            for direct in [
                d
                for d in (False, True)
                if os.environ.get("IUD_LMCACHE_IO", "buffered,direct").find(
                    "direct" if d else "buffered"
                )
                >= 0
            ]:
                d = os.path.join(tmp, name.replace(" ", "_"), f"{pool}-{direct}")
                os.makedirs(d)
                spec = dict(geometry, **route, pool=pool, direct=direct, path=d)
                if name != "NIXL GDS_MT" and os.environ.get("IUD_LMCACHE_PARAMS"):
                    spec["params"] = json.loads(os.environ["IUD_LMCACHE_PARAMS"])
                specs.append(spec)
        if os.environ.get("IUD_LMCACHE_REPEAT_FIRST") == "1":
            again = os.path.join(specs[0]["path"] + "-again")
            os.makedirs(again)
            specs.append(dict(specs[0], path=again, again=True))
        p = subprocess.run(
            [sys.executable, driver, json.dumps(specs)],
            env=E.child_env(path),
            capture_output=True,
            text=True,
            timeout=900,
        )
        if os.environ.get("IUD_LMCACHE_LOG_DIR"):
            with open(
                os.path.join(os.environ["IUD_LMCACHE_LOG_DIR"], name.replace(" ", "_") + ".log"),
                "w",
            ) as f:
                f.write(p.stderr)
        out = [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        results[name] = {"rc": p.returncode, "results": out, "stderr_tail": p.stderr[-3000:]}
        if p.returncode != 0 or len(out) != len(specs) or any(r["bad"] for r in out):
            status = 1
            print(f"{name}: FAILED (exit {p.returncode})\n{p.stderr[-3000:]}")
        for r in out:
            s = r["spec"]
            print(
                f"{name:32s} {'static' if s['pool'] else 'dynamic':8s}{' again' if s.get('again') else ''} "
                f"{'direct' if s['direct'] else 'buffered':9s} put {r['put_gbps']:.3f} GB/s "
                f"get {r['get_gbps']:.3f} GB/s bad={len(r['bad'])}"
            )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
