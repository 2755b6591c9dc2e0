"""The benchmarks as tools: iud-bench's KV-cache workload (real NIXL, real plugin, POSIX side by
side, every block verified) writes its results folder; ci/bench.sh answers --help without setup
or a build, with the binary's own flag list, and names its results folder on its last line;
bench/gpu_vram_bench.py stops at once without a GPU and runs its KV logic on host memory.
No timing thresholds: only what ran, what was written and whether the bytes matched."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
from nixl_io_uring_dmabuf.tools.locate import first_wheel

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

BACKENDS = "IO_URING_DMABUF,POSIX:use_uring=true,POSIX:use_aio=true"
# A tiny KV sweep and contiguous sweep: 3 KV block sizes x 2 ops x 3 rounds x 3 backends.
TINY = [
    "--backend",
    BACKENDS,
    "--op_type",
    "BOTH",
    "--workload",
    "kv,contig",
    "--total_buffer_size",
    "8M",
    "--kv_region_size",
    "4M",
    "--kv_request_size",
    "512K",
    "--kv_start_block_size",
    "4K",
    "--kv_max_block_size",
    "16K",
    "--start_block_size",
    "4K",
    "--max_block_size",
    "16K",
    "--batch_sizes",
    "1,4",
    "--randomize_location_mode",
    "blockaligned",
    "--duration_ms",
    "20",
    "--warmup_iter",
    "2",
    "--check_consistency",
]


def _cargo():
    c = shutil.which("cargo") or os.path.expanduser("~/.cargo/bin/cargo")
    if not os.path.exists(c):
        pytest.fail("cargo is not installed (the project builds with Rust)")
    return c


@pytest.fixture(scope="module")
def iud_bench():
    """target/release/iud-bench, built if needed (a no-op when ci/bench.sh or cargo test built it)."""
    r = subprocess.run(
        [_cargo(), "build", "--release", "-q", "-p", "iud-bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    return os.path.join(target, "release", "iud-bench")


def _env():
    """Our environment plus the wheel's library folder (libnixl_capi.so, which iud-bench loads)."""
    env = dict(os.environ)
    wheel = first_wheel()
    assert wheel, "no nixl_cu12/nixl_cu13 wheel in this Python"
    libs = wheel.libs
    env["LD_LIBRARY_PATH"] = libs + (
        ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
    )
    return env


@pytest.fixture(scope="module")
def kv_run(iud_bench, tmp_path_factory, request):
    """One tiny iud-bench run with a background load, its stdout and results folder."""
    request.getfixturevalue("plugin_so")  # IO_URING_DMABUF must be in NIXL_PLUGIN_DIR
    d = tmp_path_factory.mktemp("bench")
    out = d / "results"
    r = subprocess.run(
        [iud_bench, *TINY, "--filepath", str(d), "--background_load", "1", "--out_dir", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r, out


def test_kv_workload_writes_verified_results_folder(kv_run):
    r, out = kv_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert sorted(os.listdir(out)) == ["results.csv", "results.md"]
    rows = list(csv.DictReader(open(out / "results.csv")))
    kv = [x for x in rows if x["workload"] == "kv"]
    contig = [x for x in rows if x["workload"] == "contig"]
    # Every backend at every KV point, three rounds each, verified byte for byte.
    assert sorted({(x["op"], int(x["block"]), x["backend"]) for x in kv}) == sorted(
        (op, b, be)
        for op in ("READ", "WRITE")
        for b in (4096, 8192, 16384)
        for be in BACKENDS.split(",")
    )
    for x in kv:
        assert x["verified"] == "yes", x
        assert x["rounds"] == "3" and len(x["gbps_rounds"].split(";")) == 3, x
        # 512 KiB per request, and never more blocks than 8 MiB of file holds with gaps.
        assert int(x["descs"]) == min(
            512 * 1024 // int(x["block"]), 8 * 1024 * 1024 // int(x["block"]) // 2
        ), x
    assert len(contig) == 2 * 3 * 2 * 3 and all(x["verified"] == "yes" for x in contig)
    for x in rows:
        assert (
            float(x["gbps"]) > 0
            and math.isfinite(float(x["cpu_s_per_gb"]))
            and float(x["cpu_s_per_gb"]) >= 0
        ), x
        assert x["background_load"] == "1", x
        if x["backend_index"] == "1":
            assert float(x["ratio_vs_baseline"]) == 1.0, x
    assert sum(float(x["cpu_s_per_gb"]) for x in rows) > 0, "no point used any CPU time"
    md = open(out / "results.md").read()
    assert "- background load: 1 CPU-bound busy-loop process" in md
    assert md.index("## KV-cache pattern") < md.index("## nixlbench-style sweep")
    assert re.search(
        r"^\| READ \| 16K \| 32 \|( [0-9.]+ \|){6} [0-9.]+x \| [0-9.]+x \| yes \|$", md, re.M
    ), md
    assert "consistency: 0 point(s) failed in total" in r.stdout
    # The busy processes were killed and reaped with the run.
    pids = re.search(
        r"background load: 1 CPU-bound busy-loop process\(es\) \(pids (\d+)", r.stdout
    ).group(1)
    assert not os.path.exists(f"/proc/{pids}"), f"background load process {pids} outlived the run"


def test_results_plot(kv_run):
    pytest.importorskip(
        "matplotlib",
        reason="matplotlib is not in this venv: ci/bench.sh installs it, the test command does not",
    )
    r, out = kv_run
    assert r.returncode == 0, r.stdout[-4000:]
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "plot_results.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    png = open(out / "results.png", "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    w, h = struct.unpack(">II", png[16:24])
    # 3 columns (GB/s, ratio, CPU); one row per KV op and per contiguous (op, batch): 6 rows.
    assert w > h / 2 > 0, (w, h)


def _copy_without_setup(tmp_path):
    """ci/bench.sh and the flag list alone: --help must not need env.sh, setup or a build."""
    (tmp_path / "ci").mkdir()
    (tmp_path / "bench" / "src").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "ci", "bench.sh"), tmp_path / "ci" / "bench.sh")
    shutil.copy(
        os.path.join(REPO, "bench", "src", "usage.txt"), tmp_path / "bench" / "src" / "usage.txt"
    )
    return tmp_path / "ci" / "bench.sh"


def test_bench_sh_help_needs_no_setup_and_is_the_binary_flag_list(iud_bench, tmp_path):
    script = _copy_without_setup(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no cargo on PATH either
    r = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert not r.stderr
    assert sorted(os.listdir(tmp_path)) == ["bench", "ci"], "--help created files"
    binary = subprocess.run([iud_bench, "--help"], capture_output=True, text=True, timeout=60)
    assert (
        binary.returncode == 0
        and binary.stdout == open(os.path.join(REPO, "bench", "src", "usage.txt")).read()
    )
    assert r.stdout.endswith(binary.stdout), "ci/bench.sh --help does not end with iud-bench --help"
    # The job's defaults are flags the binary lists, and the binary accepts them all.
    defaults = r.stdout.split("so they win):\n", 1)[1].split("\n", 1)[0].split()
    flags = set(re.findall(r"^  --(\w+)", binary.stdout, re.M))
    used = [a[2:] for a in defaults if a.startswith("--")]
    assert used and set(used) <= flags, set(used) - flags
    bad = subprocess.run(
        [iud_bench, *defaults, "--bogus_flag", "1"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown flag --bogus_flag" in bad.stderr, bad.stderr


def test_bench_sh_names_its_results_folder_on_the_last_line(tmp_path, plugin_so):
    py = os.path.join(REPO, ".venv", "bin", "python")
    if not os.path.exists(py) or subprocess.run([py, "-c", "import matplotlib"]).returncode != 0:
        pytest.skip(
            "matplotlib is not in .venv: ci/bench.sh would install it, the test command does not"
        )
    out = tmp_path / "out"
    args = [a for a in TINY if a not in ("--check_consistency",)]
    r = subprocess.run(
        [
            "bash",
            os.path.join(REPO, "ci", "bench.sh"),
            *args,
            "--workload",
            "kv",
            "--kv_rounds",
            "1",
            "--filepath",
            str(tmp_path),
            "--out_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last == f"results: {out}", last
    assert sorted(os.listdir(out)) == ["results.csv", "results.md", "results.png", "stdout.txt"]
    assert "- git: " in open(out / "results.md").read()
    assert "# ci/bench.sh at git" in open(out / "stdout.txt").read()


def _has_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_gpu_bench_stops_at_once_without_a_gpu(tmp_path):
    if _has_cuda():
        pytest.skip(
            "a CUDA GPU is here: the benchmark would run (tests/gpu and ci/gpu/run.sh cover it)"
        )
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "gpu_vram_bench.py"), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert (
        "needs torch with CUDA" in r.stderr or "torch.cuda.is_available() is False" in r.stderr
    ), r.stderr
    assert "ci/gpu/run.sh" in r.stderr and not r.stdout
    assert os.listdir(tmp_path) == [], "it created files before stopping"


def test_a_round_cut_by_the_time_budget_is_not_called_hung():
    """2026-12-05: a GDS_MT round that the benchmark's --budget_s ended after 29 s was noted as
    "hung (> 29 s)" in the H200 table; only a round that outlives --kv_timeout is a hang."""
    spec = importlib.util.spec_from_file_location(
        "per_request", os.path.join(REPO, "bench", "per_request.py")
    )
    per_request = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(per_request)
    budget = per_request.cut_short("GDS_MT", 2, timeout=150, left=29.4)
    assert (
        budget.startswith("GDS_MT round 3: stopped after 29 s")
        and "--budget_s" in budget
        and "hung" not in budget
    )
    assert (
        per_request.cut_short("GDS_MT", 0, timeout=150, left=400)
        == "GDS_MT round 1: hung (> 150 s)"
    )


def test_gpu_bench_kv_logic_on_host_memory(tmp_path, plugin_so):
    """The KV table's code path (layout, child per backend and round, verification, medians)
    with numpy host memory instead of VRAM: IO_URING_DMABUF against POSIX, 2 rounds."""
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "bench", "gpu_vram_bench.py"),
            "--memory",
            "dram",
            "--tables",
            "kv",
            "--kv_backends",
            "IO_URING_DMABUF,POSIX+copy",
            "--kv_sizes",
            "4K,64K",
            "--kv_region_mib",
            "4",
            "--kv_file_mib",
            "4",
            "--kv_blocks",
            "48",
            "--kv_seconds",
            "0.02",
            "--kv_rounds",
            "2",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    first = next(i for i, l in enumerate(lines) if l.startswith("## "))
    assert lines[first].startswith("## Table 1: KV-cache pattern")
    rows = [l for l in lines if re.match(r"^\| (READ|WRITE) \|", l)]
    assert len(rows) == 4, r.stdout
    for row in rows:
        assert row.endswith("| yes |") and "n/a" not in row, row
    # 48 blocks asked; a 4 MiB file holds only 32 blocks of 64 KiB with a gap between any two.
    assert re.search(r"^\| READ \| 4 KiB \| 48 \|", r.stdout, re.M), r.stdout
    assert re.search(r"^\| READ \| 64 KiB \| 32 \|", r.stdout, re.M), r.stdout
    assert r.stderr.count(" round 0 ") == 8 and r.stderr.count(" round 1 ") == 8, r.stderr[-3000:]
    assert os.listdir(tmp_path) == [], "the KV file was left behind"


def test_per_request_workload_is_printed_first_and_verifies_every_request(
    iud_bench, tmp_path, plugin_so
):
    """--workload req: make_prepped / initialize / repost per backend, scattered and contiguous,
    every request checked; its table comes before the KV table in stdout and results.md."""
    out = tmp_path / "results"
    r = subprocess.run(
        [
            iud_bench,
            "--backend",
            BACKENDS,
            "--op_type",
            "BOTH",
            "--workload",
            "kv,req",
            "--req_points",
            "16K:32,64K:8",
            "--req_region_size",
            "2M",
            "--total_buffer_size",
            "2M",
            "--kv_region_size",
            "1M",
            "--kv_request_size",
            "256K",
            "--kv_start_block_size",
            "16K",
            "--kv_max_block_size",
            "16K",
            "--kv_rounds",
            "2",
            "--duration_ms",
            "10",
            "--warmup_iter",
            "1",
            "--filepath",
            str(tmp_path),
            "--out_dir",
            str(out),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert r.stdout.index("Per request (what clients wait for)") < r.stdout.index(
        "KV-cache READ summary"
    )
    rows = list(csv.DictReader(open(out / "results.csv")))
    req = [x for x in rows if x["workload"].startswith("req")]
    want = {
        (w, op, lay, b, be)
        for w in ("req", "req-init", "req-repost")
        for be in range(3)
        for (op, lay) in (("READ", "kv"), ("WRITE", "kv"), ("READ", "contig"))
        for b in (16384, 65536)
    }
    assert {
        (x["workload"], x["op"], x["layout"], int(x["block"]), int(x["backend_index"])) for x in req
    } == want
    for x in req:
        assert x["verified"] == "yes" and x["rounds"] == "2" and float(x["gbps"]) > 0, x
        assert int(x["descs"]) == (32 if x["block"] == "16384" else 8), x
    md = open(out / "results.md").read()
    assert md.index("## Per request") < md.index("## KV-cache pattern")
    assert re.search(
        r"^\| READ contiguous \| 64K \| 8 \| [0-9.]+ \| [0-9.]+ / [0-9.]+ / [0-9.]+ \|", md, re.M
    ), md
    assert "Scattered READ per request (make_prepped) as a share of the contiguous READ" in md
    assert "per-request consistency: 0 measurement(s) failed" in r.stdout


def test_gpu_bench_per_request_and_prep_tables_on_host_memory(tmp_path, plugin_so):
    """Table 0 (per request) and the prep profile with numpy host memory: IO_URING_DMABUF against
    POSIX, one process and 2 processes at once, every request verified."""
    base = [
        sys.executable,
        os.path.join(REPO, "bench", "gpu_vram_bench.py"),
        "--memory",
        "dram",
        "--req_backends",
        "IO_URING_DMABUF,POSIX+copy",
        "--req_points",
        "16K:32,64K:8",
        "--kv_region_mib",
        "2",
        "--req_seconds",
        "0.01",
        "--kv_rounds",
        "2",
        "--prep_descs",
        "256",
        "--prep_seconds",
        "0.01",
        "--dir",
        str(tmp_path),
    ]
    r = subprocess.run(base + ["--tables", "req,prep"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    heads = [l for l in r.stdout.splitlines() if l.startswith("## ")]
    assert heads[0].startswith("## Table 0: per request") and heads[1].startswith(
        "## Prep profile"
    ), heads
    rows = [
        l
        for l in r.stdout.splitlines()
        if re.match(r"^\| (READ|WRITE)( contiguous)? \| \d+ KiB \|", l)
    ]
    assert len(rows) == 6 and all(l.endswith("| yes |") and "n/a" not in l for l in rows), rows
    prep = [l for l in r.stdout.splitlines() if re.match(r"^\| (READ|WRITE) \| 256 \|", l)]
    assert len(prep) == 4 and all("n/a" not in l for l in prep), prep
    r2 = subprocess.run(
        base + ["--tables", "req", "--req_processes", "2", "--req_no_contig"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r2.returncode == 0, r2.stdout + r2.stderr[-4000:]
    assert "2 processes at once" in r2.stdout
    rows = [l for l in r2.stdout.splitlines() if re.match(r"^\| (READ|WRITE) \| \d+ KiB \|", l)]
    assert len(rows) == 4 and all(l.endswith("| yes |") and "n/a" not in l for l in rows), rows
    assert r2.stderr.count(" proc 1 round 1 ") == 8, r2.stderr[-3000:]
    assert os.listdir(tmp_path) == [], "a benchmark file was left behind"


def test_gpu_per_request_script_dry_run_on_cpu(tmp_path, plugin_so):
    """ci/gpu/per-request.sh with IUD_GPU_DRYRUN=1: its three steps' command lines run here (host
    memory, POSIX for GDS_MT, tiny points), so a typo cannot waste a GPU call."""
    env = dict(
        os.environ,
        IUD_GPU_DRYRUN="1",
        IUD_DRYRUN_DIR=str(tmp_path / "files"),
        OUT=str(tmp_path / "out"),
    )
    os.makedirs(env["IUD_DRYRUN_DIR"])
    r = subprocess.run(
        ["bash", os.path.join(REPO, "ci", "gpu", "per-request.sh")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert r.stdout.rstrip().splitlines()[-1].startswith("total: exit 0")
    out = tmp_path / "out"
    files = set(os.listdir(out))
    assert {
        "machine.txt",
        "per-request-1proc.md",
        "per-request-4proc.md",
        "per-request-prep.md",
        "per-request-logs.tgz",
    } <= files and len(files) <= 8, files
    for name, n in (("per-request-1proc.md", 9), ("per-request-4proc.md", 6)):
        rows = [l for l in open(out / name) if re.match(r"^\| (READ|WRITE)", l)]
        assert len(rows) == n and all(l.rstrip().endswith("| yes |") for l in rows), (name, rows)
    assert "## Prep profile" in open(out / "per-request-prep.md").read()
    assert os.listdir(tmp_path / "files") == []


def test_gpu_latency_step_dry_run_reads_the_plugins_request_timeline(tmp_path, plugin_so):
    """ci/gpu/per-request.sh latency with IUD_GPU_DRYRUN=1: the plugin's per-request profile
    lines (src/xfer/profile.rs) reach bench/profile_timeline.py's table, one row per backend and
    point, each over real requests whose I/Os were reaped within the request's time."""
    env = dict(
        os.environ,
        IUD_GPU_DRYRUN="1",
        IUD_DRYRUN_DIR=str(tmp_path / "files"),
        OUT=str(tmp_path / "out"),
    )
    os.makedirs(env["IUD_DRYRUN_DIR"])
    r = subprocess.run(
        ["bash", os.path.join(REPO, "ci", "gpu", "per-request.sh"), "latency"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    rows = [
        l.split("|")[1:-1]
        for l in open(tmp_path / "out" / "latency-timeline.md")
        if re.match(r"^\| (IO_URING_DMABUF|IUD-spin200) \|", l)
    ]
    assert len(rows) == 12, rows
    for cells in rows:
        requests, total, first_io, last_io = (
            int(cells[5]),
            float(cells[6]),
            float(cells[9]),
            float(cells[10]),
        )
        assert requests > 0 and 0 < first_io <= last_io <= total, cells
    assert os.listdir(tmp_path / "files") == []


def test_gpu_huge_pages_step_dry_run_copies_with_both_page_sizes(tmp_path):
    """ci/gpu/per-request.sh huge-pages with IUD_GPU_DRYRUN=1: bench/staging_copy_bound.c builds
    and runs here, one line per op, piece, window and page size, each a real rate; nothing is left
    behind."""
    env = dict(
        os.environ,
        IUD_GPU_DRYRUN="1",
        IUD_DRYRUN_DIR=str(tmp_path / "files"),
        OUT=str(tmp_path / "out"),
    )
    os.makedirs(env["IUD_DRYRUN_DIR"])
    r = subprocess.run(
        ["bash", os.path.join(REPO, "ci", "gpu", "per-request.sh"), "huge-pages"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    lines = re.findall(
        r"^(write|read) piece (\d+) window (\d+) round 1 (4 KiB|huge) pages: ([\d.]+) GB/s",
        open(tmp_path / "out" / "huge-pages.md").read(),
        re.M,
    )
    assert len(set(l[:4] for l in lines)) == 16 and all(float(l[4]) > 0 for l in lines), lines
    assert os.listdir(tmp_path / "files") == []
    assert "staging_copy_bound" not in os.listdir(tmp_path / "out")


def test_busy_write_bound_script_tables_both_backends_beside_the_bare_writer(
    iud_bench, tmp_path, plugin_so
):
    """bench/busy_write_bound.sh at toy sizes, without fio: every round's requests verified, and
    one table row per point with the plugin, AIO and the bare pwrite loop (fio's column '-')."""
    env = dict(
        os.environ,
        FIO="none",
        ROUNDS="2",
        LOAD="1",
        POINTS="16K:64,64K:32",
        SECONDS_PER_POINT="0.05",
        FILE_MIB="64",
        SOURCE="16M",
        REGION="4M",
        DIR=str(tmp_path),
    )
    r = subprocess.run(
        ["bash", os.path.join(REPO, "bench", "busy_write_bound.sh"), str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    for point in ("16K x 64", "64K x 32"):
        row = re.search(
            rf"^\| {point} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| - \| [\d.]+ \| [\d.]+ \| - \| ([\d.]+)x \|$",
            r.stdout,
            re.M,
        )
        assert row and all(float(g) > 0 for g in row.groups()), r.stdout
    assert re.search(r"^ +2 consistency: 0 point\(s\) failed in total$", r.stdout, re.M), r.stdout
    assert not list(tmp_path.glob("iud-write-bound-*")), "the bare writer's file was left behind"
