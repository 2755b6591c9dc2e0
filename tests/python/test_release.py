"""Releasing a request while it is in flight cancels and drains it: release returns without
error, no I/O of the released request touches the buffer afterwards, and the next requests on
the same agent work and move the right bytes."""

from __future__ import annotations

import os
import time

import iud_helpers as H
import numpy as np
import pytest

SIZE = 64 * H.MiB
CHUNK = 1 * H.MiB
ROUNDS = 4


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_release_inflight(rig, rng, tmp_path, need_direct, known_posix_failure, backend, op):
    known_posix_failure(
        "release of an in-flight request neither cancels nor drains its I/O; "
        "the next request on the engine then hangs or completes early"
    )
    timeout = 15 if backend == "POSIX" else 60
    path = str(tmp_path / "inflight.bin")
    content = H.rand_bytes(rng, SIZE)
    with open(path, "wb") as f:
        f.write(content.tobytes())
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        buf = H.Buf(SIZE).fill(rng)
        rig.reg_dram(buf)
        rig.reg_fd(fd, SIZE)
        mem = [(buf.addr + i, CHUNK) for i in range(0, SIZE, CHUNK)]
        files = [(i, CHUNK, fd) for i in range(0, SIZE, CHUNK)]
        in_flight = 0
        for k in range(ROUNDS):
            h = rig.xfer(op, mem, files)
            st = rig.agent.transfer(h)
            assert st in ("PROC", "DONE"), f"round {k}: transfer() returned {st}"
            in_flight += st == "PROC"
            t0 = time.monotonic()
            rig.release(h)  # an exception here fails the test
            took = time.monotonic() - t0
            # drained: nothing of the released request may land in the buffer any more
            buf.fill(rng)
            snap = buf.arr.copy()
            time.sleep(0.1)
            assert np.array_equal(buf.arr, snap), (
                f"round {k}: buffer changed after release_xfer_handle returned ({took:.4f} s) - "
                "the released request's I/O was not drained: " + H.first_diff(buf.arr, snap)
            )
        assert in_flight > 0, (
            "transfer() never returned PROC for a 64 MiB O_DIRECT request, "
            "so releasing an in-flight request was not exercised"
        )

        # the agent and engine still work: READ the file back, WRITE new data, READ again
        if op == "WRITE":
            content = H.read_file(path)  # whatever the cancelled writes left behind
        buf.fill(rng)
        rig.run(rig.xfer("READ", mem, files), timeout, what="READ after release")
        assert np.array_equal(buf.arr, content), "READ after release: " + H.first_diff(
            buf.arr, content
        )
        new = H.rand_bytes(rng, SIZE)
        buf.arr[:] = new
        rig.run(rig.xfer("WRITE", mem, files), timeout, what="WRITE after release")
        got = H.read_file(path)
        assert np.array_equal(got, new), "file after WRITE after release: " + H.first_diff(got, new)
        buf.fill(rng)
        rig.run(rig.xfer("READ", mem, files), timeout, what="second READ after release")
        assert np.array_equal(buf.arr, new), "second READ after release: " + H.first_diff(
            buf.arr, new
        )
    finally:
        rig.close()
        os.close(fd)
