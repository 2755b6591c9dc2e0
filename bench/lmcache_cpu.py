"""LMCache 0.5.6 on CPU (cpu buffer = DRAM), store and retrieve through its own StorageManager and
NIXL storage backend: NIXL's POSIX, the plugin installed --as POSIX, and the project's storage
plugin (IO_URING_DMABUF), static pool and dynamic mode, buffered and use_direct_io. Each
retrieval is checked byte for byte (tests/python/clients/lmcache_driver.py).

    python3 bench/lmcache_cpu.py --out bench/results/<date>-lmcache-cpu.md [--chunks 32] [--reps 3]

Needs ci/build.sh and ci/clients-setup.sh. Writes a markdown report with the machine, command,
date and every measured value (median first).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [os.path.join(REPO, "tests", "python", "clients"), os.path.join(REPO, "python")]
import clients_env as E  # noqa: E402

GEOMETRY = {"layers": 16, "tokens": 256, "heads": 8, "head_dim": 64}  # Llama-3.2-1B: 8 MiB chunks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temp folder)")
    a = ap.parse_args()
    venv = os.environ.get("IUD_CLIENTS_VENV") or os.path.join(REPO, ".venv-clients")
    py = os.path.join(venv, "bin", "python")
    tmp = tempfile.mkdtemp(prefix="iud-lmcache-bench-", dir=a.dir)
    pkgs = E.pip_target(E.build_wheel(os.path.join(tmp, "wheel")), os.path.join(tmp, "pkgs"))
    site = os.path.join(tmp, "site")
    E.copy_nixl(site, E.wheel_module_of(py))
    p = E.run(
        [py, "-m", "nixl_io_uring_dmabuf", "install", "--as", "POSIX"], E.child_env([site, pkgs])
    )
    assert p.returncode == 0, p.stderr
    routes = {
        "NIXL POSIX (own)": ([pkgs], {"route": "builtin", "name": "POSIX"}),
        "IO_URING_DMABUF --as POSIX": ([site, pkgs], {"route": "builtin", "name": "POSIX"}),
        "IO_URING_DMABUF storage plugin": ([site, pkgs], {"route": "plugin"}),
    }
    load_before = os.getloadavg()
    rows = {}
    for rep in range(a.reps):
        for name, (path, route) in routes.items():  # interleaved, so load drifts hit all alike
            specs = []
            for pool in (a.chunks, 0):
                for direct in (False, True):
                    d = os.path.join(tmp, "data", f"{rep}-{name.replace(' ', '_')}-{pool}-{direct}")
                    os.makedirs(d)
                    specs.append(
                        dict(
                            GEOMETRY,
                            **route,
                            chunks=a.chunks,
                            batch=a.batch,
                            pool=pool,
                            direct=direct,
                            path=d,
                            seed=rep + 1,
                        )
                    )
            p = subprocess.run(
                [
                    py,
                    os.path.join(REPO, "tests", "python", "clients", "lmcache_driver.py"),
                    json.dumps(specs),
                ],
                env=E.child_env(path),
                capture_output=True,
                text=True,
                timeout=1800,
            )
            res = [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and len(res) == len(specs), p.stderr[-3000:]
            for r in res:
                assert not r["bad"], (name, r["spec"], r["bad"])
                s = r["spec"]
                key = (
                    name,
                    "static" if s["pool"] else "dynamic",
                    "direct" if s["direct"] else "buffered",
                )
                rows.setdefault(key, []).append((r["put_gbps"], r["get_gbps"]))
    load_after = os.getloadavg()
    chunk = (
        2 * GEOMETRY["layers"] * 2 * GEOMETRY["tokens"] * GEOMETRY["heads"] * GEOMETRY["head_dim"]
    )
    lines = [
        f"# LMCache 0.5.6 on CPU through NIXL: POSIX vs IO_URING_DMABUF ({datetime.date.today()})",
        "",
        f"* machine: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (the machine is "
        "shared with other work: numbers are indicative only)",
        f"* storage: {a.dir or tempfile.gettempdir()} (`df`: {subprocess.run(['df', '-T', tmp], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]})",
        f"* command: `python3 bench/lmcache_cpu.py --out {a.out} --chunks {a.chunks} --batch {a.batch} --reps {a.reps}`",
        f"* LMCache's StorageManager, cpu buffer mode (the LocalCPUBackend pool registered as DRAM), "
        f"{a.chunks} chunks of {chunk >> 20} MiB (Llama-3.2-1B, 256 tokens), batches of {a.batch}; "
        f"static pool of {a.chunks} files or dynamic mode (one file per key); every get checked "
        "byte for byte. put = batched_put until the backend reports every key; get = batched_get.",
        "* NIXL POSIX runs with LMCache's default `nixl_backend_params` ({}), so NIXL picks its "
        "default queue.",
        "",
        "| route | mode | I/O | put GB/s (median, all) | get GB/s (median, all) |",
        "|---|---|---|---|---|",
    ]
    for (name, mode, io), vals in rows.items():
        puts = [v[0] for v in vals]
        gets = [v[1] for v in vals]
        lines.append(
            f"| {name} | {mode} | {io} | {statistics.median(puts):.2f} "
            f"({', '.join(f'{x:.2f}' for x in puts)}) | {statistics.median(gets):.2f} "
            f"({', '.join(f'{x:.2f}' for x in gets)}) |"
        )
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
