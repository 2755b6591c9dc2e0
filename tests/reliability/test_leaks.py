"""Leaks: many register -> transfer -> deregister cycles through the real NIXL runtime keep the
process's fds, its RSS and the engine's io_uring (fixed files, fixed buffers, SQ/CQ entries
outstanding) flat.

Cycle: register a DRAM buffer (one of 8, rotating, so fixed-buffer slots are reused), register a
FILE (fd mode with a freshly opened fd, or path mode where the plugin opens the file - alternating),
WRITE 4..64 KiB, READ it back (bytes checked every 16th cycle), release both requests,
deregister both, close the fd. Measured after a warm-up of 10% of the cycles and at the end.

    pytest tests/reliability/test_leaks.py --leak-cycles 100000     # the full run
(default: 2000 cycles, the CI size). Figures go to $IUD_REL_OUT/leaks.jsonl.
"""

from __future__ import annotations

import json
import os
import time

import iud_helpers as H
import numpy as np
import pytest
import rel
from support import rings

pytestmark = pytest.mark.slow

OUT = os.environ.get("IUD_REL_OUT", os.path.join(rel.HERE, "..", "..", "target", "reliability"))


def ring_state(fd):
    """(SQEs pending, CQEs pending) from fdinfo: both 0 when the ring is idle."""
    vals = {}
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for ln in f.read().splitlines()[:40]:
            k, _, v = ln.partition(":")
            vals[k.strip()] = v.strip()
    sq = int(vals.get("SqTail", 0)) - int(vals.get("SqHead", 0))
    cq = int(vals.get("CqTail", 0)) - int(vals.get("CqHead", 0))
    return sq, cq


def measure(ring):
    files, bufs = rings.ring_tables(ring)
    return {
        "fds": rel.non_ring_fds(),
        "rings": len(rings.ring_fds()),
        "fixed_files": files,
        "fixed_buffers": bufs,
        "rss_kib": rel.rss_kib(),
        "sq_cq_pending": ring_state(ring),
    }


def test_register_transfer_deregister_cycles(request, backend, is_plugin, rng, tmp_path):
    if not is_plugin:
        pytest.skip("measures the plugin's own resources")
    cycles = request.config.getoption("--leak-cycles") or 2000
    before = set(rings.ring_fds())
    agent = H.make_agent(backend)
    rig = H.Rig(agent, backend)
    ring = sorted(set(rings.ring_fds()) - before)
    assert len(ring) == 1, f"expected one new io_uring for the engine, got {ring}"
    ring = ring[0]
    bufs = [H.Buf(64 * H.KiB).fill(rng) for _ in range(8)]
    back = H.Buf(64 * H.KiB)
    back_reg = rig.reg_dram(back)
    path = str(tmp_path / "cycle.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * (64 * H.KiB))
    warm = max(1, cycles // 10)
    samples = []
    base = None
    checked = 0
    t0 = time.monotonic()
    for c in range(cycles):
        b = bufs[c % len(bufs)]
        breg = rig.reg_dram(b)
        if c % 2 == 0:
            fd = os.open(path, os.O_RDWR)
            dev, freg = fd, rig.reg_fd(fd, 64 * H.KiB)
        else:
            fd = None
            dev, freg = rig.reg_path(path, 64 * H.KiB, "rw", dev_id=7)
        n = 4096 * (1 + c % 16)
        w = rig.xfer("WRITE", [(b.addr, n)], [(0, n, dev)])
        rig.run(w, 30, what=f"cycle {c} WRITE")
        rig.release(w)
        r = rig.xfer("READ", [(back.addr, n)], [(0, n, dev)])
        rig.run(r, 30, what=f"cycle {c} READ")
        rig.release(r)
        if c % 16 == 0:
            assert np.array_equal(back.arr[:n], b.arr[:n]), f"cycle {c}: " + H.first_diff(
                back.arr[:n], b.arr[:n]
            )
            checked += 1
        rig.dereg(freg)
        rig.dereg(breg)
        if fd is not None:
            os.close(fd)
        if c + 1 == warm:
            base = measure(ring)
            samples.append({"cycle": c + 1, **base})
        elif (c + 1) % max(1, cycles // 10) == 0:
            samples.append({"cycle": c + 1, **measure(ring)})
    end = measure(ring)
    took = time.monotonic() - t0
    rig.dereg(back_reg)
    rig.close()
    w = r = breg = freg = back_reg = None
    del rig, agent
    import gc

    gc.collect()
    after = set(rings.ring_fds())
    summary = {
        "cycles": cycles,
        "seconds": round(took, 1),
        "bytes_checked_cycles": checked,
        "warm": base,
        "end": end,
        "ring_closed": ring not in after,
        "samples": samples,
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "leaks.jsonl"), "a") as f:
        f.write(json.dumps(summary) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}))
    assert end["fds"] == base["fds"], f"fds grew: {base['fds']} -> {end['fds']}"
    assert (end["fixed_files"], end["fixed_buffers"]) == (
        base["fixed_files"],
        base["fixed_buffers"],
    ), f"io_uring tables grew: {base} -> {end}"
    assert end["sq_cq_pending"] == (0, 0), f"ring not idle after the cycles: {end}"
    assert end["rings"] == base["rings"]
    growth = end["rss_kib"] - base["rss_kib"]
    # NIXL's own bookkeeping and the allocator may move a little; a per-cycle leak of even 100
    # bytes over 10^5 cycles would be ~10 MiB.
    assert growth < 8 * 1024, f"RSS grew {growth} KiB over {cycles - warm} cycles"
    assert ring not in after, "the engine's io_uring is still open after the agent went away"
