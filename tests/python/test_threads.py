"""8 Python threads posting on one agent at once: random descriptor sets, prepped and un-prepped
requests, WRITE then READ, every byte checked. Once with the default agent (sync mode NONE:
registrations done up front, threads only create/post/poll/release requests) and once with
sync_mode RW (threads also register and deregister their own memory and files concurrently)."""

from __future__ import annotations

import os
import threading

import iud_helpers as H
import numpy as np
import pytest
from support.descriptors import fitting

THREADS = 8
ITERS = 12
REGION = 4 * H.MiB


class Worker:
    def __init__(self, rig, t, seed, fd, base, tmp_path, register_here):
        self.rig, self.t, self.fd, self.base = rig, t, fd, base
        self.rng = np.random.default_rng(seed)
        self.tmp_path = tmp_path
        self.register_here = register_here
        self.src, self.dst = H.Buf(REGION), H.Buf(REGION)
        self.error = None
        self.regs = []
        self.dev = fd
        self.path = None
        if not register_here:
            self.register()

    def register(self):
        self.regs.append(self.rig.reg_dram(self.src))
        self.regs.append(self.rig.reg_dram(self.dst))
        if self.register_here and self.t % 2 == 1:
            # odd threads in RW mode: their own path-mode file, registered from the thread
            self.path = str(self.tmp_path / f"thread{self.t}.bin")
            self.dev, r = self.rig.reg_path(self.path, REGION, "rw,create")
            self.base = 0
            self.regs.append(r)

    def one(self, it):
        rig, rng = self.rig, self.rng
        sizes, foff, moff = fitting(rng, REGION, 48)
        self.src.fill(rng)
        self.dst.fill(rng)
        before = self.dst.arr.copy()
        ms = [(self.src.addr + int(m), int(s)) for m, s in zip(moff, sizes)]
        md = [(self.dst.addr + int(m), int(s)) for m, s in zip(moff, sizes)]
        fl = [(self.base + int(f), int(s), self.dev) for f, s in zip(foff, sizes)]
        what = f"thread {self.t} iteration {it} ({len(sizes)} descs)"
        if it % 2:
            hs, hd, hf = rig.prep_mem(ms), rig.prep_mem(md), rig.prep_file(fl)
            idx = list(range(len(sizes)))
            w = rig.prepped_xfer("WRITE", hs, idx, hf, idx)
            r = rig.prepped_xfer("READ", hd, idx, hf, idx)
        else:
            hs = hd = hf = None
            w, r = rig.xfer("WRITE", ms, fl), rig.xfer("READ", md, fl)
        rig.run(w, what="WRITE " + what)
        rig.run(r, what="READ " + what)
        rig.release(w)
        rig.release(r)
        for h in (hs, hd, hf):
            if h is not None:
                rig.agent.release_dlist_handle(h)
                rig.dlists.remove(h)
        want = before
        for m, s in zip(moff, sizes):
            want[m : m + s] = self.src.arr[m : m + s]
        assert np.array_equal(self.dst.arr, want), what + ": " + H.first_diff(self.dst.arr, want)
        # and the file itself
        top = int(foff[-1] + sizes[-1])
        if self.path is None:
            raw = os.pread(self.fd, top, self.base)
        else:
            with open(self.path, "rb") as fh:
                raw = fh.read(top)
        got = np.frombuffer(raw, np.uint8)
        wantf = np.empty(top, np.uint8)
        for fo, m, s in zip(foff, moff, sizes):
            wantf[fo : fo + s] = self.src.arr[m : m + s]
        assert np.array_equal(got, wantf), what + " (file): " + H.first_diff(got, wantf)

    def __call__(self):
        try:
            if self.register_here:
                self.register()
            for it in range(ITERS):
                self.one(it)
            if self.register_here:
                for r in self.regs:
                    self.rig.dereg(r)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            import traceback

            self.error = f"thread {self.t}: {e!r}\n{traceback.format_exc()}"


def run_threads(rig, rng, tmp_path, register_here):
    path = str(tmp_path / "shared.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rig.reg_fd(fd, THREADS * REGION)
        workers = [
            Worker(rig, t, int(rng.integers(1 << 62)), fd, t * REGION, tmp_path, register_here)
            for t in range(THREADS)
        ]
        threads = [threading.Thread(target=w, daemon=True) for w in workers]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=180)
        hung = [i for i, th in enumerate(threads) if th.is_alive()]
        assert not hung, f"threads {hung} did not finish within 180 s"
        errors = [w.error for w in workers if w.error]
        assert not errors, "\n".join(errors)
    finally:
        rig.close()
        os.close(fd)


def test_threads_default_agent(rig, rng, tmp_path, backend):
    if backend == "POSIX":
        pytest.skip("POSIX locks its I/O queue only when the agent's sync mode asks for it")
    run_threads(rig, rng, tmp_path, register_here=False)


def test_threads_rw_agent(backend, rng, tmp_path):
    from nixl._api import nixl_thread_sync_t

    agent = H.make_agent(backend, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    run_threads(H.Rig(agent, backend), rng, tmp_path, register_here=True)
