"""A real I/O error in the middle of a regular file (EIO from the filesystem, provoked by
tests/support/fuse_faultfs.py) fails the request with "ERR" or an exception from transfer() /
check_xfer_state(), the plugin logs exactly one ERROR line, and the agent keeps working: the
good part of the same file and a plain disk file still read correctly.

The kernel first returns the bytes before the failing page (a short read), so this also covers
the plugin's resubmission of a remainder that then fails."""

from __future__ import annotations

import gc
import os

import iud_helpers as H
import numpy as np
import pytest
from support.mounts import FuseMount

SIZE = 8 * H.MiB


@pytest.fixture
def faultfs(tmp_path):
    mounts = []

    def start(mode, content):
        m = FuseMount(str(tmp_path / f"mnt{len(mounts)}"), mode, content)
        mounts.append(m)
        return m

    yield start
    gc.collect()
    for m in mounts:
        m.stop()


def _eio_scenario(backend, is_plugin, rng, fs, content, stderr_log, tmp_path, path_mode):
    agent = H.make_agent(backend)
    rig = H.Rig(agent, backend)
    fd = None
    try:
        if path_mode:
            dev, _ = rig.reg_path(fs.path, SIZE, "rw")
        else:
            fd = os.open(fs.path, os.O_RDWR)
            dev = fd
            rig.reg_fd(fd, SIZE)
        buf = H.Buf(SIZE).fill(rng)
        rig.reg_dram(buf)
        stderr_log()
        c = 512 * H.KiB
        out = rig.attempt(
            lambda: rig.xfer(
                "READ",
                [(buf.addr + i, c) for i in range(0, SIZE, c)],
                [(i, c, dev) for i in range(0, SIZE, c)],
            )
        )
        log = stderr_log()
        assert out.stage != "timeout", "READ over an EIO range still PROC after 30 s"
        assert out.failed, f"READ over a range that returns EIO completed ({out})"
        assert out.stage in ("post", "check"), f"EIO surfaced at {out.stage}"
        assert out.release_exc is None, f"release after EIO raised {out.release_exc!r}"
        if is_plugin:
            lines = H.plugin_error_lines(log)
            assert len(lines) == 1, f"expected one plugin ERROR line for EIO, got:\n{log}"
        # the good part of the same file, same agent, same registration
        good = 4 * H.MiB
        buf.fill(rng)
        h = rig.xfer("READ", [(buf.addr, good)], [(0, good, dev)])
        rig.run(h, 60, what="READ of the good part of the file after EIO")
        rig.release(h)
        del h
        assert np.array_equal(buf.arr[:good], content[:good]), (
            "good part after EIO: " + H.first_diff(buf.arr[:good], content[:good])
        )
        # and a plain disk file
        p = str(tmp_path / "plain.bin")
        data = H.rand_bytes(rng, 1 * H.MiB)
        with open(p, "wb") as f:
            f.write(data.tobytes())
        pfd = os.open(p, os.O_RDWR)
        try:
            rig.reg_fd(pfd, data.size)
            buf.fill(rng)
            h = rig.xfer("READ", [(buf.addr, data.size)], [(0, data.size, pfd)])
            rig.run(h, 60, what="READ of a disk file after EIO")
            rig.release(h)
            del h
            assert np.array_equal(buf.arr[: data.size], data)
        finally:
            rig.close()
            os.close(pfd)
    finally:
        rig.close()
        if fd is not None:
            os.close(fd)


@pytest.mark.privileged
@pytest.mark.parametrize("path_mode", [False, True], ids=["fd", "path"])
def test_eio_fails_the_request(backend, is_plugin, rng, faultfs, stderr_log, tmp_path, path_mode):
    bad = 5 * H.MiB + 777
    content = H.rand_bytes(rng, SIZE)
    fs = faultfs(f"eio:{bad}", content)
    _eio_scenario(backend, is_plugin, rng, fs, content, stderr_log, tmp_path, path_mode)
    gc.collect()  # the agent and its engine go away before the unmount
    stats = fs.stop()
    assert stats.get("eio", 0) > 0, f"the filesystem never returned EIO: {stats}"
