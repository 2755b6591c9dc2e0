"""Issue 48's client shape through the real NIXL agent, and the plugin's side of the race it
meets in sync mode NONE.

The shape (sync_none_shape_child.py, one process per run): one agent shared by 4 threads; each
round trip registers two fresh DRAM buffers and the thread's file, moves 64 descriptors of random
sizes at random offsets (WRITE, READ, every byte checked; initialize_xfer plus a repost, or
prep_xfer_dlist + make_prepped_xfer), releases and deregisters; at the end every thread compares
its whole file with what it wrote, so a byte moved to or from another thread's file fails.

In sync mode NONE NIXL 1.5.1 takes no locks, and its registration lists race with any backend:
nixlLocalSection::addDescList looks up its list, calls the backend's registerMem and only then
appends to the list, which another thread's remDescList may meanwhile have emptied and deleted
(docs/reliability.md, "Sync mode NONE"). The longer registerMem takes, the wider that window; the
plugin therefore does nothing slow there (no fixed-buffer pinning, no fixed-file slot): the
first test checks that through the ring's own tables.

- CI: the shape with a locking agent (RW, STRICT), which must always pass, and the registration
  test.
- Opt-in (IUD_SYNC_NONE_SHAPE_RUNS=N, e.g. 20): N runs in sync mode NONE; NIXL's own failures
  (its lists losing a registration: NIXL_ERR_NOT_FOUND, or a glibc heap abort) are counted and
  printed, but a wrong byte, a byte in another thread's file, a read past the end of a 16 MiB
  file or any other plugin error fails the test. The comparison with NIXL's POSIX backend is
  tests/reliability/none_mode_runs.py --shape issue48 (bench/results/2026-12-06-sync-none-shape-
  issue48.md)."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys

import iud_helpers as H
import pytest
from support.rings import ring_tables

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sync_none_shape_child.py")
NONE_RUNS = int(os.environ.get("IUD_SYNC_NONE_SHAPE_RUNS", "0"))
CHILD_AS = 6 << 30
# What NIXL's damaged lists produce by themselves (no plugin frame): its own NOT_FOUND refusals,
# the plugin's refusal of an MD NIXL hands back after deregistering it, glibc's heap checks.
NIXL_OWN = re.compile(r"NIXL_ERR_NOT_FOUND|is not a live registration of this engine")
DATA_ERROR = re.compile(
    r"differing bytes|differs from what this thread wrote|read past end of file"
    r"|refers to a different file|no difference on re-check"
)


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS, CHILD_AS))


def run_child(backend: str, d, sync: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, IUD_SHAPE_SYNC=sync)
    return subprocess.run(
        [sys.executable, CHILD, backend, str(d), "4", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_cap_memory,
        env=env,
    )


def test_registration_takes_no_ring_slot_until_a_request_uses_it(backend, is_plugin, rng, tmp_path):
    """registerMem of DRAM and FILE leaves the ring's fixed-buffer and fixed-file tables alone
    (pinning 8 MiB took 7 ms inside registerMem before, 150x POSIX's registerMem, and widened
    NIXL's list race); the first request takes the slots, deregistration gives them back."""
    if not is_plugin:
        pytest.skip("reads the plugin's own io_uring tables")
    agent = H.make_agent(backend)
    rig = H.Rig(agent, backend)
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o644)
    regs = []
    try:
        size = 8 * H.MiB
        src, dst = H.Buf(size).fill(rng), H.Buf(size)
        base = ring_tables()
        regs += [rig.reg_dram(src), rig.reg_dram(dst), rig.reg_fd(fd, size)]
        assert ring_tables() == base, "registerMem took io_uring slots"
        descs = [(k * 65536, 65536) for k in range(0, size // 65536, 2)]
        files = [(off, n, fd) for off, n in descs]
        for op, buf in (("WRITE", src), ("READ", dst)):
            h = rig.xfer(op, [(buf.addr + off, n) for off, n in descs], files)
            rig.run(h, what=op)
            rig.release(h)
        for off, n in descs:
            assert (dst.arr[off : off + n] == src.arr[off : off + n]).all(), f"offset {off}"
        used = ring_tables()
        assert used == (base[0] + 1, base[1] + 2), (
            f"a request on 2 buffers and 1 file should hold 1 file and 2 buffer slots: {base} -> {used}"
        )
        for r in regs:
            rig.dereg(r)
        assert ring_tables() == base, "deregistration left slots behind"
    finally:
        for r in list(rig.regs):
            rig.dereg(r)
        os.close(fd)


@pytest.mark.parametrize("sync", ["rw", "strict"])
def test_issue48_shape_with_a_locking_agent(backend, tmp_path, sync):
    for i in range(2 if sync == "rw" else 1):
        d = tmp_path / f"run{i}"
        d.mkdir()
        p = run_child(backend, d, sync)
        tail = "\n".join(p.stderr.splitlines()[-25:])
        assert p.returncode == 0, f"run {i + 1} (sync {sync}): exit {p.returncode}\n{tail}"
        assert p.stdout.splitlines()[-1].startswith("ok:"), p.stdout
        errors = H.plugin_error_lines(p.stdout + p.stderr)
        assert not errors, f"run {i + 1}: the plugin logged errors:\n" + "\n".join(errors)


@pytest.mark.skipif(
    NONE_RUNS <= 0,
    reason="opt-in: IUD_SYNC_NONE_SHAPE_RUNS=N runs issue 48's "
    "shape N times in sync mode NONE (about 2 s a run)",
)
def test_issue48_shape_sync_none_moves_no_wrong_byte(backend, tmp_path):
    tally = {"ok": 0, "NIXL's lists": 0, "crash": 0}
    for i in range(NONE_RUNS):
        d = tmp_path / f"run{i}"
        d.mkdir()
        p = run_child(backend, d, "none")
        out = p.stdout + p.stderr
        tail = "\n".join(p.stderr.splitlines()[-25:])
        assert not DATA_ERROR.search(out), f"run {i + 1}: data moved wrongly\n{tail}"
        foreign = [ln for ln in H.plugin_error_lines(out) if not NIXL_OWN.search(ln)]
        assert not foreign, f"run {i + 1}: plugin errors not caused by NIXL's lists:\n" + "\n".join(
            foreign
        )
        if p.returncode == 0:
            tally["ok"] += 1
        elif p.returncode < 0:
            tally["crash"] += 1
            print(
                f"run {i + 1}: {signal.Signals(-p.returncode).name}: "
                + " | ".join(ln for ln in p.stderr.splitlines() if "chunk" in ln or "free" in ln)
            )
        else:
            assert NIXL_OWN.search(out), f"run {i + 1}: exit {p.returncode}\n{tail}"
            tally["NIXL's lists"] += 1
    print(f"{backend}, sync NONE, {NONE_RUNS} runs: {tally}")
