"""Short transfers are completed by resubmitting the remainder.

A pipe registered as a FILE fd gives short reads naturally: a read returns as soon as some bytes
are in the pipe, and the writer thread here trickles the data in small pieces. The READ must
still end DONE with every byte in place. (Offsets are ignored by the kernel for pipes, so the
plugin's offset arithmetic on resubmission does not matter here; a single descriptor keeps the
stream order defined.) WRITE into a pipe drained slowly by a reader thread is the mirror case."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import iud_helpers as H

TOTAL = 1 * H.MiB


def register_pipe_end(rig, fd):
    try:
        return rig.reg_fd(fd, TOTAL)
    except H.nixl_errors() as e:
        pytest.skip(f"the backend does not accept a pipe as a FILE fd ({e!r}), so short "
                    "transfers cannot be provoked this way")


def test_short_reads_are_resubmitted(rig, rng, known_posix_failure):
    known_posix_failure("a short read fails the whole request (no resubmission)")
    data = H.rand_bytes(rng, TOTAL)
    pieces = []
    pos = 0
    while pos < TOTAL:
        n = min(int(rng.integers(1, 48 * H.KiB)), TOTAL - pos)
        pieces.append((pos, n))
        pos += n
    rfd, wfd = os.pipe()
    stop = threading.Event()

    def writer():
        try:
            for p, n in pieces:
                if stop.is_set():
                    return
                os.write(wfd, data[p:p + n].tobytes())
                time.sleep(0.0005)
        except OSError:
            pass  # the test failed and closed the pipe

    try:
        register_pipe_end(rig, rfd)
        buf = H.Buf(TOTAL).fill(rng)
        rig.reg_dram(buf)
        h = rig.xfer("READ", [(buf.addr, TOTAL)], [(0, TOTAL, rfd)])
        th = threading.Thread(target=writer, daemon=True)
        st = rig.agent.transfer(h)
        th.start()
        try:
            st = rig.poll(h, st, 60, "READ from a trickling pipe")
        finally:
            stop.set()
            rig.close()
            os.close(rfd)  # unblocks the writer if it waits on a full pipe
            rfd = -1
            th.join(10)
        assert st == "DONE", f"READ from a pipe fed in {len(pieces)} pieces ended {st}"
        assert np.array_equal(buf.arr, data), "READ from pipe: " + H.first_diff(buf.arr, data)
    finally:
        rig.close()
        if rfd >= 0:
            os.close(rfd)
        os.close(wfd)


def test_short_writes_are_resubmitted(rig, rng, known_posix_failure):
    known_posix_failure("a short write fails the whole request (no resubmission)")
    data = H.rand_bytes(rng, TOTAL)
    rfd, wfd = os.pipe()
    got = bytearray()
    stop = threading.Event()

    sizes = np.random.default_rng(int(rng.integers(1 << 62)))

    def reader():
        while len(got) < TOTAL and not stop.is_set():
            chunk = os.read(rfd, int(sizes.integers(512, 16 * H.KiB)))
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.0005)

    try:
        register_pipe_end(rig, wfd)
        buf = H.Buf(TOTAL)
        buf.arr[:] = data
        rig.reg_dram(buf)
        h = rig.xfer("WRITE", [(buf.addr, TOTAL)], [(0, TOTAL, wfd)])
        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            rig.run(h, 60, what="WRITE into a slowly drained pipe")
        except BaseException:
            stop.set()
            rig.close()
            os.close(wfd)  # the reader sees EOF
            wfd = -1
            th.join(10)
            raise
        th.join(30)
        assert len(got) == TOTAL, f"reader got {len(got)} of {TOTAL} bytes"
        out = np.frombuffer(bytes(got), np.uint8)
        assert np.array_equal(out, data), "WRITE into pipe: " + H.first_diff(out, data)
    finally:
        stop.set()
        rig.close()
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
