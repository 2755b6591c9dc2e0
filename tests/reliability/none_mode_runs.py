"""Sync mode NONE, many runs: the plugin against NIXL's POSIX backend (docs/reliability.md, "Sync mode
NONE"). Each run is one process of tests/python/concurrent_reg_child.py: one agent in sync mode
NONE (nixl_agent_config(backends=[]) without a listen thread), 4 threads, each registering its
own 16 MiB DRAM buffer and file, 3 verified WRITE/READ round trips of 64 x 64 KiB, then
deregistering. With --shape issue48 each run is one process of
tests/python/sync_none_shape_child.py instead (issue 48's client shape: single-threaded round
trips first, then 4 threads each registering two fresh DRAM buffers and its file per round trip,
64 descriptors of random sizes, reposts, whole-file checks). The backends alternate run by run,
so both see the same machine load.

    .venv/bin/python tests/reliability/none_mode_runs.py [--runs 100] [--backends IO_URING_DMABUF,POSIX]
        [--shape concreg|issue48] [--gdb-crashes N]

Prints one line per run and a table: ok, error (exit 1: a NIXL error or a wrong byte, with its
first line), crash (a signal, with glibc's message), timeout. With --gdb-crashes N, afterwards
runs each backend's child under gdb until N crashes were caught (at most --gdb-tries, default
10 x N, tries) and
prints the crashing thread's frames, so a crash can be placed (inside libnixl or the plugin).
Needs the plugin installed as ci/build.sh does (NIXL_PLUGIN_DIR from ci/env.sh)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHILDREN = {
    # issue 16's pattern: one 16 MiB buffer and file registered per thread, 64 x 64 KiB
    "concreg": (
        os.path.join(HERE, "..", "python", "concurrent_reg_child.py"),
        ["none", "{d}", "4", "3"],
    ),
    # issue 48's client shape: two fresh buffers and the file registered per round trip,
    # 64 descriptors of random sizes, reposts, whole-file checks
    "issue48": (os.path.join(HERE, "..", "python", "sync_none_shape_child.py"), ["{d}", "4", "3"]),
}
SHAPE = "concreg"
# A run needs < 4 GiB; NIXL's POSIX backend with corrupted lists was seen allocating 23 GiB.
CHILD_AS = 6 << 30


def cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS, CHILD_AS))
    # stderr goes to a file: a child logging in a loop stops at 1 GiB (SIGXFSZ, a crash)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))


def classify(rc: int | None, err: str) -> tuple[str, str]:
    if rc is None:
        return "timeout", "still running after 180 s"
    if rc == 0:
        return "ok", ""
    if rc < 0:
        glibc = [ln for ln in err.splitlines() if re.search(r"free|corrupt|malloc|chunk|abort", ln)]
        return "crash", f"{signal.Signals(-rc).name}" + (f": {glibc[-1].strip()}" if glibc else "")
    # Who raised it: the plugin logs one ERROR line per failure, NIXL one E line for its own
    # refusals (its lists lost a registration). The first of them in the log decides: after
    # NIXL's own refusal (createXferReq finding no registration, its section gone) the plugin
    # can still refuse an MD NIXL hands back a second time at agent teardown.
    logged = [
        (ln.strip(), "plugin" if re.search(r"\bERROR\b.*io_uring_dmabuf", ln) else "NIXL")
        for ln in err.splitlines()
        if re.search(r"\bERROR\b.*io_uring_dmabuf", ln) or re.match(r"E\d{4} ", ln.strip())
    ]
    raised = [(ln.strip(), "NIXL") for ln in err.splitlines() if "Error" in ln and "thread" in ln]
    rest = [(ln, "NIXL") for ln in err.strip().splitlines()[-1:]] or [(f"exit {rc}", "NIXL")]
    first, who = (logged or raised or rest)[0]
    return "error", f"{who}: {first[:240]}"


def child_args(backend: str, d: str) -> list[str]:
    child, rest = CHILDREN[SHAPE]
    return [sys.executable, child, backend] + [a.format(d=d) for a in rest]


def head_and_tail(f, keep: int = 1 << 20) -> str:
    """The first and last `keep` bytes of a child's stderr: a NIXL backend whose lists broke
    was seen logging gigabytes in a loop, more than the runner should hold."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= 2 * keep:
        data = f.read()
    else:
        data = f.read(keep) + b"\n[...]\n"
        f.seek(size - keep)
        data += f.read()
    return data.decode(errors="replace")


def one_run(backend: str, d: str) -> tuple[str, str]:
    args = child_args(backend, d)
    with tempfile.TemporaryFile(dir=d) as err:
        try:
            p = subprocess.run(
                args, stdout=subprocess.DEVNULL, stderr=err, timeout=180, preexec_fn=cap_memory
            )
        except subprocess.TimeoutExpired:
            return classify(None, "")
        return classify(p.returncode, head_and_tail(err))


def gdb_frames(backend: str, d: str) -> str | None:
    """Runs the child under gdb; the crashing thread's frames, or None when it did not crash."""
    cmd = [
        "gdb",
        "-q",
        "-batch",
        "-ex",
        "set pagination off",
        "-ex",
        "handle SIGPIPE nostop",
        "-ex",
        "run",
        "-ex",
        "bt 25",
        "--args",
    ] + child_args(backend, d)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    if "received signal" not in out:
        return None
    start = out.index("received signal")
    return "\n".join(
        ln for ln in out[start:].splitlines() if ln.startswith("#") or "received signal" in ln
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--backends", default="IO_URING_DMABUF,POSIX")
    ap.add_argument("--gdb-crashes", type=int, default=0)
    ap.add_argument(
        "--shape",
        choices=sorted(CHILDREN),
        default="concreg",
        help="concreg: issue 16's pattern (default); issue48: issue 48's client shape",
    )
    ap.add_argument(
        "--gdb-tries",
        type=int,
        default=0,
        help="runs under gdb per backend (default 10 x --gdb-crashes)",
    )
    a = ap.parse_args()
    global SHAPE
    SHAPE = a.shape
    backends = a.backends.split(",")
    counts = {b: collections.Counter() for b in backends}
    examples = {b: collections.defaultdict(list) for b in backends}
    for i in range(a.runs):
        for b in backends if i % 2 == 0 else list(reversed(backends)):
            d = tempfile.mkdtemp(prefix="iud-none-", dir="/var/tmp")
            try:
                kind, what = one_run(b, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            counts[b][kind] += 1
            if what and len(examples[b][kind]) < 5:
                examples[b][kind].append(what)
            print(f"run {i + 1} {b}: {kind} {what}", flush=True)
    print("\n| backend | runs | ok | error | crash | timeout |\n|---|---:|---:|---:|---:|---:|")
    for b in backends:
        c = counts[b]
        print(
            f"| {b} | {sum(c.values())} | {c['ok']} | {c['error']} | {c['crash']} | {c['timeout']} |"
        )
    for b in backends:
        for kind, whats in examples[b].items():
            for w in whats:
                print(f"- {b} {kind}: {w}")
    for b in backends:
        caught = 0
        for _ in range(a.gdb_tries or 10 * a.gdb_crashes):
            if caught >= a.gdb_crashes:
                break
            d = tempfile.mkdtemp(prefix="iud-none-gdb-", dir="/var/tmp")
            try:
                frames = gdb_frames(b, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            if frames:
                caught += 1
                print(f"\n{b}: crash under gdb:\n{frames}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
