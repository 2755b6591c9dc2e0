"""The tables of bench/vllm_connector_gpu.py's runs (its `report` command): time to first token
per variant against recompute and vLLM's own tiers, the connector's load and store jobs, the
tokens of every checking round against vLLM's recompute and GPU prefix-cache hit, and decode
with stores running. Reads the rounds its engines appended to a results.jsonl."""

from __future__ import annotations

import json
import math
import os
import statistics

from vllm_gpu_variants import (
    CHECK_TOKENS,
    DECODE_BATCH,
    DECODE_PAIRS,
    DECODE_PROMPT,
    DECODE_TOKENS,
    GRAPHS,
    LENGTHS,
    length_name,
)


def load(path: str) -> list[dict]:
    """The rows of a results.jsonl, or of the one in a work folder."""
    if os.path.isdir(path):
        path = os.path.join(path, "results.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


TOKEN_ROUNDS = ("tokens-recompute", "tokens-gpu-hit")


def report(a) -> int:
    recs = load(a.work)
    if a.ref and not any(r["variant"] == "plain" for r in recs):
        # Only the reference tokens of an earlier run of the same model and prompts: a call
        # that runs no plain engine still checks every hit's tokens.
        ref = [r for r in load(a.ref) if r["variant"] == "plain" and r["round"] in TOKEN_ROUNDS]
        recs = ref + recs
    by = {}
    for r in recs:
        by.setdefault((r["variant"], r["round"]), []).append(r)

    def times(variant, rnd, length):
        return [
            x["s"]
            for r in by.get((variant, rnd), [])
            for x in r["rows"]
            if x["prompt"].startswith(length_name(length) + "#")
        ]

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    def tokens(variant, rnd):
        out = {}
        for r in by.get((variant, rnd), []):
            for x in r["rows"]:
                out[x["prompt"]] = x["tokens"]
        return out

    ref = tokens("plain", "tokens-recompute")
    gpu = tokens("plain", "tokens-gpu-hit")
    if a.hit_ref:
        # another GPU model's reference tokens need not match (bf16 kernels differ): every hit
        # is checked against the hit of one of vLLM's own tiers in this run instead
        gpu = tokens(a.hit_ref, "tokens-hit")
        if not gpu:
            raise SystemExit(f"--hit-ref {a.hit_ref}: no tokens-hit round in {a.work}")
    start = next((r for r in recs if r["round"] == "start"), {})
    lines = [
        f"# vLLM {start.get('versions', {}).get('vllm', '?')} on "
        f"{start.get('versions', {}).get('gpu', '?')}: time to first token through the "
        "storage connector",
        "",
    ]
    lines += [f"Versions: `{json.dumps(start.get('versions', {}))}`.", ""]
    rows = [
        ("(a) recompute (no connector)", "plain", ("recompute-1", "recompute-2")),
        ("GPU prefix-cache hit (no connector)", "plain", ("gpu-hit",)),
        (
            "(b) connector, IO_URING_DMABUF (the plugin's default parameters), page-cache file",
            "iud-pc",
            ("hit-1", "hit-2"),
        ),
        (
            "(b) connector, IO_URING_DMABUF (engine-thread-light parameters), page-cache file",
            "iud-pc-light",
            ("hit-1", "hit-2"),
        ),
        ("(b) connector, GDS_MT, page-cache file", "gds-pc", ("hit-1", "hit-2")),
        (
            "(b) connector, IO_URING_DMABUF, page-cache file, new engine",
            "iud-reload",
            ("hit-new-engine",),
        ),
        (
            "(b) connector, page-cache file, sync loads (no async scheduling)",
            "iud-pc-sync",
            ("hit-1", "hit-2"),
        ),
        (
            "(b) connector, page-cache file, sync loads (no async scheduling), new engine",
            "iud-reload-sync",
            ("hit-new-engine",),
        ),
        ("(c) connector, IO_URING_DMABUF, O_DIRECT file", "iud-od", ("hit-1", "hit-2")),
        (
            "(c) connector, IO_URING_DMABUF, O_DIRECT file, new engine",
            "iud-od-reload",
            ("hit-new-engine",),
        ),
        ("(c) connector, O_DIRECT file, 8 staging buffers", "iud-od-8buf", ("hit-1", "hit-2")),
        (
            "(c) connector, O_DIRECT file, 8 staging buffers, new engine",
            "iud-od-8buf-reload",
            ("hit-new-engine",),
        ),
        ("(c) connector, O_DIRECT file, 16 staging buffers", "iud-od-16buf", ("hit-1", "hit-2")),
        (
            "(c) connector, O_DIRECT file, 16 staging buffers, new engine",
            "iud-od-16buf-reload",
            ("hit-new-engine",),
        ),
        ("(c) connector, GDS_MT, O_DIRECT file", "gds-od", ("hit-1", "hit-2")),
        ("(c) connector, IO_URING_DMABUF, raw block devices", "iud-dev", ("hit-1", "hit-2")),
        (
            "(c) connector, IO_URING_DMABUF, raw block devices, new engine",
            "iud-dev-reload",
            ("hit-new-engine",),
        ),
        (
            "connector, page-cache file, another live engine's store",
            "iud-share",
            ("hit-other-engine",),
        ),
        ("vLLM CPU offload (CPUOffloadingSpec), DRAM hit", "cpu", ("hit-1", "hit-2")),
        ("vLLM CPU offload, DRAM hit, sync loads", "cpu-sync", ("hit-1", "hit-2")),
        (
            "vLLM CPU offload, DRAM hit, sync loads (no async scheduling)",
            "cpu-sync-noasync",
            ("hit-1", "hit-2"),
        ),
        ("(d) vLLM CPU offload + fs tier (O_DIRECT), new engine", "fs-load", ("hit-1",)),
        ("vLLM CPU offload, DRAM hit (same engine)", "fs-load", ("cpu-hit",)),
        (
            "vLLM CPU offload + NixlFileTier (page-cache files), new engine",
            "nixltier-load",
            ("hit-1",),
        ),
        ("vLLM CPU offload, DRAM hit, NixlFileTier engine", "nixltier-load", ("cpu-hit",)),
        ("store round (recompute + stores posted), IO_URING_DMABUF", "iud-pc", ("store",)),
    ]
    rec = {
        n: med(times("plain", "recompute-1", n) + times("plain", "recompute-2", n)) for n in LENGTHS
    }
    short, long_ = LENGTHS
    lines += [
        f"| | TTFT {length_name(short)} (ms) | vs recompute | TTFT {length_name(long_)} "
        "(ms) | vs recompute | samples | "
        "tokens equal recompute / GPU hit |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, v, rnds in rows:
        t = {n: [s for rnd in rnds for s in times(v, rnd, n)] for n in LENGTHS}
        if not any(t.values()):
            lines.append(f"| {label} | not run | | | | | |")
            continue
        tk_rnd = {"plain": "tokens-gpu-hit"}.get(v, "tokens-hit")
        got = tokens(v, tk_rnd) if "store" not in rnds else {}
        eq = "-"
        if got and ref:
            eq = (
                f"{sum(got[k] == ref.get(k) for k in got)}/{len(got)} / "
                f"{sum(got[k] == gpu.get(k) for k in got)}/{len(got)}"
            )
        m = {n: med(t[n]) for n in LENGTHS}

        def vs(n, m=m):  # no plain engine in this run: no recompute to compare with
            return "-" if math.isnan(rec[n]) else f"{rec[n] / m[n]:.2f}x"

        lines.append(
            f"| {label} | {1e3 * m[short]:.0f} | {vs(short)} | "
            f"{1e3 * m[long_]:.0f} | {vs(long_)} | "
            f"{len(t[short])}+{len(t[long_])} | {eq} |"
        )
    lines += [
        "",
        "Load and store jobs of the connector (worker counters: bytes / time from "
        "post to the engine step that saw the job done):",
        "",
        "| variant | round | load GB/s | load jobs | engine thread per load job (ms) | "
        "checksums per load job (ms) | store GB/s | store jobs | bad blocks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        kv = r.get("kv")
        if not kv:
            continue
        ld, st = kv.get("load", {}), kv.get("store", {})

        def gbps(d):
            return f"{d['bytes'] / d['seconds'] / 1e9:.1f}" if d.get("seconds") else "-"

        def per_job(d, k):
            return f"{1e3 * d[k] / d['jobs']:.1f}" if d.get("jobs") and k in d else "-"

        if ld.get("jobs") or st.get("jobs"):
            lines.append(
                f"| {r['variant']} | {r['round']} | {gbps(ld)} | {ld.get('jobs', 0)} | "
                f"{per_job(ld, 'post_seconds')} | {per_job(ld, 'sum_seconds')} | "
                f"{gbps(st)} | {st.get('jobs', 0)} | {ld.get('bad_blocks', 0)} |"
            )
    lines += token_table(recs, ref, gpu)
    lines += decode_table(recs)
    lines += [
        "",
        "Engine start-up (s): "
        + ", ".join(f"{r['variant']} {r['start_s']}" for r in recs if r["round"] == "start"),
        "",
        "Flush (stores committed before the hit rounds): "
        + ", ".join(
            f"{r['variant']} {r['stored_blocks']}/{r['expected_blocks']} in {r['flush_s']} s"
            for r in recs
            if r["round"] == "flush"
        ),
    ]
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


def token_table(recs: list[dict], ref: dict, gpu: dict) -> list[str]:
    """Every round that generated CHECK_TOKENS tokens per prompt: how many prompts got exactly
    the tokens of recompute and of vLLM's own GPU prefix-cache hit, and the tokens vLLM
    reported cached (a hit from storage counts them; a recompute does not)."""
    out = [
        "",
        f"Tokens ({CHECK_TOKENS} greedy tokens per prompt) of every checking round:",
        "",
        "| variant | round | equal recompute | equal GPU hit | cached tokens per prompt |",
        "|---|---|---:|---:|---|",
    ]
    for r in recs:
        if not r["round"].startswith("tokens-") or not r["rows"]:
            continue
        rows = r["rows"]
        n = len(rows)
        eq_r = sum(x["tokens"] == ref.get(x["prompt"]) for x in rows)
        eq_g = sum(x["tokens"] == gpu.get(x["prompt"]) for x in rows)
        cached = ", ".join(str(x["cached"]) for x in rows)
        out.append(f"| {r['variant']} | {r['round']} | {eq_r}/{n} | {eq_g}/{n} | {cached} |")
    return out


def decode_table(recs: list[dict]) -> list[str]:
    """Decode with stores running against the same engine's decode of the same batch without
    them (decode_rounds), pooled over the pairs after the warm-up."""

    def pooled(v: str, kind: str) -> dict | None:
        rs = [
            r
            for r in recs
            if r["variant"] == v and r["round"] == f"decode-{kind}" and r.get("decode_steps")
        ]
        if not rs:
            return None
        n = sum(r["decode_steps"] for r in rs)
        st = {}
        for r in rs:
            for k, t in r.get("thread_cpu_s", {}).items():
                st[k] = st.get(k, 0.0) + t
        kv = [r.get("kv", {}).get("store", {}) for r in rs]
        return {
            "tps": sum(r["decode_tokens"] for r in rs) / sum(r["decode_s"] for r in rs),
            "p50": statistics.median(r["step_ms_p50"] for r in rs),
            "p90": statistics.median(r["step_ms_p90"] for r in rs),
            "cpu": sum(r["engine_cpu_ms_per_step"] * r["decode_steps"] for r in rs) / n,
            "rq": sum(r["runqueue_ms_per_step"] * r["decode_steps"] for r in rs) / n,
            "idle": statistics.median(r["machine_cpu"]["idle"] for r in rs),
            "jobs": sum(k.get("jobs", 0) for k in kv),
            "gb": sum(k.get("bytes", 0) for k in kv) / 1e9,
            "threads": sorted(st.items(), key=lambda kv_: -kv_[1])[:4],
            "tps_each": [r["decode_tokens_per_s"] for r in rs],
        }

    variants = list(dict.fromkeys(r["variant"] for r in recs if r["round"] == "decode-new"))
    if not variants:
        return []
    plain = {g: pooled("plain" + g, "new") for g in ("", GRAPHS)}
    out = [
        "",
        f"Decode with stores running: {DECODE_BATCH} new prompts of {DECODE_PROMPT} tokens "
        f"decode {DECODE_TOKENS} tokens while their blocks are stored, then the same batch "
        "again in the same engine (a GPU prefix-cache hit: nothing to store). Decode steps "
        f"only, {DECODE_PAIRS} pairs pooled after a warm-up pair. Engine thread: CPU time and "
        "run-queue wait per decode step (/proc/thread-self/schedstat).",
        "",
        "| variant | tokens/s with stores | without | with / without | vs plain | step ms "
        "p50 / p90, with | without | engine thread CPU ms/step, with / without | run-queue "
        "ms/step, with / without | store jobs, GB | machine idle, with | CPU s by thread "
        "(with stores), top 4 |",
        "|---|---:|---:|---:|---:|---|---|---|---|---|---:|---|",
    ]
    for v in variants:
        w, wo = pooled(v, "new"), pooled(v, "again")
        if w is None or wo is None:
            out.append(f"| {v} | not run | | | | | | | | | | |")
            continue
        ref = plain[GRAPHS if v.endswith(GRAPHS) else ""]
        vs = f"{w['tps'] / ref['tps']:.3f}" if ref else "-"
        thr = ", ".join(f"{k} {t:.2f}" for k, t in w["threads"])
        out.append(
            f"| {v} | {w['tps']:.0f} ({', '.join(f'{x:.0f}' for x in w['tps_each'])}) | "
            f"{wo['tps']:.0f} | {w['tps'] / wo['tps']:.3f} | {vs} | "
            f"{w['p50']:.1f} / {w['p90']:.1f} | {wo['p50']:.1f} / {wo['p90']:.1f} | "
            f"{w['cpu']:.1f} / {wo['cpu']:.1f} | {w['rq']:.2f} / {wo['rq']:.2f} | "
            f"{w['jobs']}, {w['gb']:.1f} | {100 * w['idle']:.0f} % | {thr or '-'} |"
        )
    return out
