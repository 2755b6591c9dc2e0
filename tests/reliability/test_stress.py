"""Concurrency through the real NIXL runtime: 8 threads on one agent, in NIXL sync modes NONE and
RW, for --stress-seconds each (default 5). Each thread loops over a random mix of
  * round trip: WRITE then READ of a random descriptor set (un-prepped or prepped), bytes checked;
  * release in flight: post a 16 MiB O_DIRECT READ and release it at once, while the other threads
    keep checking their own requests on the same engine; the buffer must be quiet afterwards;
  * repost: post the same READ handle 3 times, each checked;
  * (RW mode only) register and deregister an extra DRAM buffer and a path-mode file.
The counts per kind are printed and appended to $IUD_REL_OUT/stress.jsonl."""

from __future__ import annotations

import json
import os
import threading
import time

import iud_helpers as H
import numpy as np
import pytest
import rel
from support.descriptors import fitting

pytestmark = pytest.mark.slow

OUT = os.environ.get("IUD_REL_OUT", os.path.join(rel.HERE, "..", "..", "target", "reliability"))
THREADS = 8
REGION = 16 * H.MiB


class Worker:
    def __init__(self, rig, t, seed, fd, dfd, tmp_path, rw):
        self.rig, self.t, self.fd, self.dfd, self.rw = rig, t, fd, dfd, rw
        self.base = t * REGION
        self.rng = np.random.default_rng(seed)
        self.tmp = tmp_path
        self.src, self.dst = H.Buf(REGION), H.Buf(REGION)
        self.regs = [rig.reg_dram(self.src), rig.reg_dram(self.dst)]
        self.counts = {
            "roundtrip": 0,
            "release_inflight": 0,
            "release_was_proc": 0,
            "repost": 0,
            "register_cycle": 0,
            "bytes": 0,
        }
        self.error = None

    def roundtrip(self):
        rig = self.rig
        direct = self.rng.random() < 0.5
        fd = self.dfd if direct else self.fd
        sizes, foff, moff = fitting(self.rng, REGION, 63, 4096 if direct else 512)
        self.src.fill(self.rng)
        self.dst.arr[:] = 0
        ms = [(self.src.addr + int(m), int(s)) for m, s in zip(moff, sizes)]
        md = [(self.dst.addr + int(m), int(s)) for m, s in zip(moff, sizes)]
        fl = [(self.base + int(f), int(s), fd) for f, s in zip(foff, sizes)]
        if self.rng.random() < 0.5:
            hs, hd, hf = rig.prep_mem(ms), rig.prep_mem(md), rig.prep_file(fl)
            idx = list(range(len(sizes)))
            w = rig.prepped_xfer("WRITE", hs, idx, hf, idx)
            r = rig.prepped_xfer("READ", hd, idx, hf, idx)
            lists = (hs, hd, hf)
        else:
            w, r = rig.xfer("WRITE", ms, fl), rig.xfer("READ", md, fl)
            lists = ()
        rig.run(w, 120, what=f"thread {self.t} WRITE")
        rig.run(r, 120, what=f"thread {self.t} READ")
        rig.release(w)
        rig.release(r)
        for h in lists:
            rig.agent.release_dlist_handle(h)
            rig.dlists.remove(h)
        for m, s in zip(moff, sizes):
            if not np.array_equal(self.dst.arr[m : m + s], self.src.arr[m : m + s]):
                raise AssertionError(
                    f"thread {self.t}: descriptor mem {m} size {s}: "
                    + H.first_diff(self.dst.arr[m : m + s], self.src.arr[m : m + s])
                )
        self.counts["roundtrip"] += 1
        self.counts["bytes"] += 2 * int(sizes.sum())

    def release_inflight(self):
        rig = self.rig
        c = H.MiB
        h = rig.xfer(
            "READ",
            [(self.dst.addr + i, c) for i in range(0, REGION, c)],
            [(self.base + i, c, self.dfd) for i in range(0, REGION, c)],
        )
        st = rig.agent.transfer(h)
        rig.release(h)
        snap = self.dst.arr.copy()
        time.sleep(0.01)
        if not np.array_equal(snap, self.dst.arr):
            raise AssertionError(f"thread {self.t}: buffer changed after release returned")
        self.counts["release_inflight"] += 1
        self.counts["release_was_proc"] += st == "PROC"

    def repost(self):
        rig = self.rig
        n = 256 * H.KiB
        self.src.fill(self.rng)
        w = rig.xfer("WRITE", [(self.src.addr, n)], [(self.base, n, self.fd)])
        rig.run(w, 60, what="repost WRITE")
        rig.release(w)
        r = rig.xfer("READ", [(self.dst.addr, n)], [(self.base, n, self.fd)])
        for k in range(3):
            self.dst.arr[:n] = k
            rig.run(r, 60, what=f"repost {k}")
            if not np.array_equal(self.dst.arr[:n], self.src.arr[:n]):
                raise AssertionError(
                    f"thread {self.t}: repost {k}: "
                    + H.first_diff(self.dst.arr[:n], self.src.arr[:n])
                )
        rig.release(r)
        self.counts["repost"] += 1

    def register_cycle(self):
        rig = self.rig
        b = H.Buf(H.MiB)
        rb = rig.reg_dram(b)
        dev, rf = rig.reg_path(str(self.tmp / f"t{self.t}.bin"), H.MiB, "rw,create")
        w = rig.xfer("WRITE", [(b.addr, 65536)], [(0, 65536, dev)])
        rig.run(w, 60, what="register cycle WRITE")
        rig.release(w)
        rig.dereg(rf)
        rig.dereg(rb)
        self.counts["register_cycle"] += 1

    def __call__(self, deadline):
        try:
            while time.monotonic() < deadline:
                x = self.rng.random()
                if x < 0.5:
                    self.roundtrip()
                elif x < 0.7:
                    self.release_inflight()
                elif x < 0.85 or not self.rw:
                    self.repost()
                else:
                    self.register_cycle()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            import traceback

            self.error = f"thread {self.t}: {e!r}\n{traceback.format_exc()}"


@pytest.mark.parametrize("mode", ["NONE", "RW"])
def test_eight_threads(request, backend, is_plugin, rng, tmp_path, need_direct, mode):
    if not is_plugin:
        pytest.skip("the stress mix includes plugin-only guarantees (release drains in flight)")
    from nixl._api import nixl_thread_sync_t

    seconds = request.config.getoption("--stress-seconds") or 5.0
    sync = {
        "NONE": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "RW": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    }[mode]
    gc_before = rel.Snapshot()
    agent = H.make_agent(backend, sync_mode=sync)
    rig = H.Rig(agent, backend)
    path = str(tmp_path / "stress.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, THREADS * REGION)
    dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        rig.reg_fd(fd, THREADS * REGION)
        rig.reg_fd(dfd, THREADS * REGION)
        workers = [
            Worker(rig, t, int(rng.integers(1 << 62)), fd, dfd, tmp_path, mode == "RW")
            for t in range(THREADS)
        ]
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=w, args=(deadline,), daemon=True) for w in workers]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=seconds + 180)
        took = time.monotonic() - t0
        hung = [i for i, th in enumerate(threads) if th.is_alive()]
        assert not hung, f"threads {hung} did not finish"
        errors = [w.error for w in workers if w.error]
        total = {k: sum(w.counts[k] for w in workers) for k in workers[0].counts}
        entry = {
            "mode": mode,
            "threads": THREADS,
            "seconds": round(took, 1),
            **total,
            "errors": len(errors),
        }
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "stress.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
        print(json.dumps(entry))
        assert not errors, "\n".join(errors)
        assert total["release_was_proc"] > 0, "no release ever hit an in-flight request"
    finally:
        rig.close()
        os.close(fd)
        os.close(dfd)
        rig = agent = workers = threads = None
        import gc

        gc.collect()
    d = gc_before.diff(rel.Snapshot(), closed_ok=True)
    assert not d, f"after the stress and agent teardown: {d}"
