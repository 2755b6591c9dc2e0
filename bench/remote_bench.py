"""Remote READ benchmark: a storage node on host A serves scattered blocks to a client on host B.

Two network namespaces joined by a veth pair stand for the two hosts
(python/nixl_io_uring_dmabuf/storage_node/testbed.py); UCX moves the bytes over TCP between them.
Two storage nodes run side by side on host A, the same program with IO_URING_DMABUF and with NIXL's
POSIX backend, serving the same file (in the page cache). For each block size the client asks each
node for the same scattered blocks (random 4 KiB-aligned file offsets) in one request, and also
asks each node for a "net only" request: the same blocks and the same pipeline, but the node skips
the storage read and sends its staging buffers as they are. That is the UCX-only ceiling: a DRAM ->
DRAM transfer between the same two agents, through the same buffers and batches. Targets are
interleaved within each round so that machine noise hits all of them alike; each point is the
median of the rounds.

Run as root:  .venv/bin/python bench/remote_bench.py [--total 256M] [--rounds 5] [--out FILE.md]
Every READ of the first round is verified byte for byte against the file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

from nixl_io_uring_dmabuf.storage_node import nixl_runtime, testbed  # noqa: E402
from nixl_io_uring_dmabuf.storage_node.__main__ import size_arg  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def fmt_size(n: int) -> str:
    return f"{n // MiB}M" if n >= MiB and n % MiB == 0 else f"{n // KiB}K"


# ---- client side (runs on host B) -------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and all its threads, from /proc (the namespaces
    share the PID namespace)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) / TICK, int(f[12]) / TICK


def client_main(a) -> None:
    import mmap

    import numpy as np
    from nixl_io_uring_dmabuf.storage_node import StorageClient

    cfg = json.loads(a.client)
    total, path, fsize = cfg["total"], cfg["path"], cfg["file_size"]
    buf = np.frombuffer(mmap.mmap(-1, total), dtype=np.uint8)
    base = buf.ctypes.data
    nodes = {}
    for name, port in cfg["nodes"]:
        c = StorageClient(name, node_addr=(testbed.A_IP, port), timeout=600)
        c.register(base, total)
        nodes[name] = c
    rng = np.random.default_rng(cfg["seed"])
    out = []
    fh = open(path, "rb")
    for bs in cfg["blocks"]:
        n = total // bs
        offs = rng.integers(0, (fsize - bs) // 4096 + 1, size=n, dtype=np.int64) * 4096
        files = ["kv"]
        arr = np.zeros((n, 5), dtype=np.uint64)
        arr[:, 1] = offs
        arr[:, 2] = bs
        arr[:, 3] = base + np.arange(n, dtype=np.uint64) * bs
        # Warm-up (connections, first touch of the client buffer, node batches).
        for _name, c in nodes.items():
            c.submit_array("READ", files, arr, net_only=True).wait()
        for r in range(cfg["rounds"]):
            for name, c in nodes.items():
                for net_only in (True, False):
                    if not net_only and r == 0:
                        buf[:] = 0xA5
                    npid = cfg["pids"][name]
                    n0, c0 = cpu_of(npid), cpu_of(os.getpid())
                    t0 = time.perf_counter()
                    moved = c.submit_array("READ", files, arr, net_only=net_only).wait()
                    dt = time.perf_counter() - t0
                    n1, c1 = cpu_of(npid), cpu_of(os.getpid())
                    ok = None
                    if not net_only and r == 0:
                        ok = all(
                            os.pread(fh.fileno(), bs, int(o))
                            == buf[i * bs : (i + 1) * bs].tobytes()
                            for i, o in enumerate(offs)
                        )
                    out.append(
                        dict(
                            block=bs,
                            node=name,
                            net_only=net_only,
                            round=r,
                            bytes=moved,
                            seconds=dt,
                            verified=ok,
                            node_cpu=[n1[0] - n0[0], n1[1] - n0[1]],
                            client_cpu=[c1[0] - c0[0], c1[1] - c0[1]],
                        )
                    )
                    print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    stats = {name: c.stats() for name, c in nodes.items()}
    for c in nodes.values():
        c.close()
    print(json.dumps({"points": out, "stats": stats}), flush=True)


# ---- driver (runs on the host, builds the testbed) ------------------------------------------------


def machine() -> str:
    cpu = "?"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB, kernel {platform.release()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--total", type=size_arg, default=256 * MiB, help="bytes per request (default 256M)"
    )
    ap.add_argument(
        "--file-size", type=size_arg, default=1 << 30, help="size of the served file (default 1G)"
    )
    ap.add_argument("--blocks", default="64K,128K,256K,512K,1M,2M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=16)
    ap.add_argument("--buffer-size", type=size_arg, default=4 * MiB)
    ap.add_argument("--mtu", type=int, default=1500, help="MTU of the veth pair (default 1500)")
    ap.add_argument("--posix-params", default="use_uring=true")
    ap.add_argument(
        "--iud-params", default="", help="IO_URING_DMABUF params k=v,k=v (default: none)"
    )
    ap.add_argument("--out", default="", help="append the markdown table to this file")
    ap.add_argument("--client", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        client_main(a)
        return 0

    nixl_runtime.use_project_plugins()
    if not testbed.plugin_dir_ready():
        sys.exit("no plugin folder with IO_URING_DMABUF: run bash ci/build.sh")
    blocks = [size_arg(b) for b in a.blocks.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    with testbed.Testbed(mtu=a.mtu) as bed:
        path = os.path.join(bed.tmp, "kv.bin")
        with open(path, "wb") as f:
            for _ in range(a.file_size // (64 * MiB)):
                f.write(os.urandom(64 * MiB))
        with open(path, "rb") as f:  # into the page cache
            while f.read(64 * MiB):
                pass
        common = [
            "--buffers",
            str(a.buffers),
            "--buffer-size",
            str(a.buffer_size),
            "--allow-net-only",
        ]
        iud = [x for kv in a.iud_params.split(",") if kv for x in ("--param", kv)]
        pi, _ = bed.start_node("iud", [f"kv={path}"], "--port", "8888", *common, *iud)
        posix = ["--backend", "POSIX"] + [
            x for kv in a.posix_params.split(",") if kv for x in ("--param", kv)
        ]
        pp, _ = bed.start_node("posix", [f"kv={path}"], "--port", "8889", *common, *posix)
        cfg = dict(
            total=a.total,
            path=path,
            file_size=os.path.getsize(path),
            blocks=blocks,
            rounds=a.rounds,
            seed=1,
            nodes=[["iud", 8888], ["posix", 8889]],
            pids={"iud": pi.pid, "posix": pp.pid},
        )
        p = bed.client(
            [sys.executable, os.path.abspath(__file__), "--client", json.dumps(cfg)],
            stdout=subprocess.PIPE,
            text=True,
        )
        print(
            f"pids: iud node {pi.pid}, posix node {pp.pid}, client {p.pid}",
            file=sys.stderr,
            flush=True,
        )
        out, _ = p.communicate(timeout=3600)
        if p.returncode:
            sys.exit(f"bench client failed ({p.returncode})")
        res = json.loads(out.strip().splitlines()[-1])
    load1 = os.getloadavg()
    pts = res["points"]
    bad = [x for x in pts if x["verified"] is False]

    def gbps(bs, node, net_only):
        return {
            x["round"]: x["bytes"] / x["seconds"] / 1e9
            for x in pts
            if x["block"] == bs and x["node"] == node and x["net_only"] == net_only
        }

    def span(v):
        return f"{statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"

    def paired(bs, node):
        # Read and UCX-only of the same node in the same round ran back to back; their ratio
        # is less exposed to the load of the (shared) machine than a ratio of two medians.
        c, r = gbps(bs, node, True), gbps(bs, node, False)
        return [r[k] / c[k] for k in sorted(r)]

    lines = [
        f"## Remote READ, page cache, {fmt_size(a.total)} per request, MTU {a.mtu}",
        "",
        f"- date: {started}; machine: {machine()}; load average before/after: "
        f"{load0[0]:.2f}/{load1[0]:.2f} (shared machine: other jobs were running)",
        f"- command: `{' '.join(['.venv/bin/python', 'bench/remote_bench.py'] + sys.argv[1:])}`",
        f"- nodes: {a.buffers} x {fmt_size(a.buffer_size)} DRAM staging buffers each; IO_URING_DMABUF params `{a.iud_params or 'defaults'}`; POSIX params `{a.posix_params}`; "
        f"UCX_TLS=tcp over a veth pair between two network namespaces; {a.rounds} rounds; "
        f"GB/s = median (min-max) over rounds; 'of UCX-only' = median (min-max) over rounds of "
        f"read GB/s / UCX-only GB/s of the same node in the same round",
        f"- verified: every block of round 0 of both nodes compared with the file ({'all equal' if not bad else f'{len(bad)} MISMATCHED'})",
        "",
        "| block | UCX-only, iud node | IO_URING_DMABUF | of UCX-only | UCX-only, posix node | POSIX | of UCX-only | IUD / POSIX |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for bs in blocks:
        ci, ri = list(gbps(bs, "iud", True).values()), list(gbps(bs, "iud", False).values())
        cp, rp = list(gbps(bs, "posix", True).values()), list(gbps(bs, "posix", False).values())
        pi_, pp_ = paired(bs, "iud"), paired(bs, "posix")
        rel = lambda v: f"{statistics.median(v):.0%} ({min(v):.0%}-{max(v):.0%})"  # noqa: E731
        lines.append(
            f"| {fmt_size(bs)} | {span(ci)} | {span(ri)} | {rel(pi_)} | {span(cp)} | {span(rp)} | "
            f"{rel(pp_)} | {statistics.median(ri) / statistics.median(rp):.2f} |"
        )
    lines += [
        "",
        "CPU seconds per GB moved (median over rounds; user+system of the node process, "
        "all threads, and of the client process; kernel TCP work done in softirq context "
        "is not always charged to them):",
        "",
        "| block | node UCX-only | node IO_URING_DMABUF | node UCX-only (posix) | node POSIX | client (iud read) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cpu(bs, node, net_only, who):
        v = [
            sum(x[who]) / (x["bytes"] / 1e9)
            for x in pts
            if x["block"] == bs and x["node"] == node and x["net_only"] == net_only
        ]
        return f"{statistics.median(v):.2f}"

    for bs in blocks:
        lines.append(
            f"| {fmt_size(bs)} | {cpu(bs, 'iud', True, 'node_cpu')} | {cpu(bs, 'iud', False, 'node_cpu')} | "
            f"{cpu(bs, 'posix', True, 'node_cpu')} | {cpu(bs, 'posix', False, 'node_cpu')} | "
            f"{cpu(bs, 'iud', False, 'client_cpu')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    print("node counters:", json.dumps(res["stats"]))
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
