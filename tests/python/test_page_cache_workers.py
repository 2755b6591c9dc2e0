"""Buffered READs handed to the engine's page-cache worker threads (punt_buffered_min > 0),
through the real NIXL runtime: random data, several requests reposted, a read past the end of
the file and a short file, verified byte for byte; the worker threads must really have run
(their names show in /proc/self/task)."""

from __future__ import annotations

import os

import iud_helpers as H
import numpy as np
import pytest
from support.descriptors import place

PARAMS = {"punt_buffered_min": "65536"}


def worker_threads() -> list[str]:
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if n.startswith("iud-pagecache")]


@pytest.fixture
def wrig(backend, is_plugin):
    if not is_plugin:
        pytest.skip("page-cache workers are IO_URING_DMABUF's")
    agent = H.make_agent(backend, PARAMS)
    r = H.Rig(agent, backend)
    yield r
    r.close()


def test_buffered_reads_on_workers_round_trip(wrig, rng, tmp_path):
    path = str(tmp_path / "punted")
    # 96 descriptors of 64 KiB .. 1 MiB (all punted) plus 4 KiB ones (below the threshold),
    # scattered in memory and file.
    sizes = [int(s) for s in rng.choice([4096, 65536, 262144, 1 << 20], size=96)]
    total = sum(sizes)
    a = H.Buf(total).fill(rng)
    b = H.Buf(total).fill(rng)
    file_off = place(sizes, rng.permutation(len(sizes)))
    mem_off = place(sizes)
    dev, freg = wrig.reg_path(path, total, "rw,create")
    wrig.reg_dram(a)
    wrig.reg_dram(b)
    files = [(int(f), s, dev) for f, s in zip(file_off, sizes)]
    w = wrig.xfer("WRITE", [(a.addr + int(m), s) for m, s in zip(mem_off, sizes)], files)
    wrig.run(w, what="WRITE")
    r = wrig.xfer("READ", [(b.addr + int(m), s) for m, s in zip(mem_off, sizes)], files)
    for rep in range(3):
        b.arr[:] = 0x5A
        wrig.run(r, what=f"READ #{rep}")
        assert np.array_equal(b.arr, a.arr), f"READ #{rep}: " + H.first_diff(b.arr, a.arr)
    assert worker_threads(), "no iud-pagecache thread: the punted reads did not run on the workers"
    wrig.release(w)
    wrig.release(r)


def test_read_past_end_on_workers_fails_cleanly(wrig, rng, tmp_path):
    path = str(tmp_path / "short")
    with open(path, "wb") as f:
        f.write(rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    b = H.Buf(1 << 20).fill(rng)
    dev, _ = wrig.reg_path(path, 1 << 20, "rw")
    wrig.reg_dram(b)
    # 256 KiB at offset 256 KiB: 44,288 bytes exist, then end of file -> the remainder reads 0.
    h = wrig.xfer("READ", [(b.addr, 262144)], [(262144, 262144, dev)])
    with pytest.raises(Exception):  # noqa: B017 - NIXL raises its own type
        wrig.run(h, what="READ past the end")
    wrig.release(h)
