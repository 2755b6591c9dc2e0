"""Release of an in-flight READ on storage that hangs (docs/semantics.md, "Release of an
in-flight request"; README limit "Release on hung storage"): a FUSE file system
(tests/support/fuse_faultfs.py, mode hang) holds one read for longer than the plugin waits in release. Release
then fails, leaving the request in flight; nothing lands in memory while the storage holds the
read; once the storage answers, the held read's bytes land in memory (the request was still in
flight, as documented), and a second release succeeds."""

from __future__ import annotations

import gc
import os
import select
import time

import iud_helpers as H
import numpy as np
import pytest
from support.mounts import FuseMount

pytestmark = pytest.mark.privileged  # a FUSE mount

SIZE = 8 * H.MiB
HELD_AT = 4 * H.MiB
HOLD_S = 36  # longer than the plugin's wait in release (30 s, src/xfer/driver/mod.rs)


def test_release_on_a_read_the_storage_holds_fails_and_keeps_the_request(
    tmp_path, rng, backend, is_plugin, stderr_log
):
    if not is_plugin:
        pytest.skip("the plugin's release semantics (NIXL's POSIX does not drain on release)")
    content = H.rand_bytes(rng, SIZE)
    fs = FuseMount(str(tmp_path / "mnt"), f"hang:{HELD_AT}:{HOLD_S}", content)
    agent = H.make_agent(backend)
    rig = H.Rig(agent, backend)
    fd = os.open(fs.path, os.O_RDWR)
    try:
        rig.reg_fd(fd, SIZE)
        buf = H.Buf(SIZE)
        buf.arr[:] = ~content  # every byte differs from the file's
        rig.reg_dram(buf)
        c = 512 * H.KiB
        h = rig.xfer(
            "READ",
            [(buf.addr + i, c) for i in range(0, SIZE, c)],
            [(i, c, fd) for i in range(0, SIZE, c)],
        )
        assert agent.transfer(h) in ("PROC", "DONE")
        ready, _, _ = select.select([fs.proc.stdout], [], [], 60)
        assert ready and fs.proc.stdout.readline().strip() == "HELD", "no read reached FUSE"
        assert agent.check_xfer_state(h) == "PROC", "the held read did not hold the request"
        stderr_log()
        with pytest.raises(Exception) as ei:
            agent.release_xfer_handle(h)
        print(f"release: {ei.value!r}")
        assert "the request is kept" in stderr_log()
        snap = buf.arr.copy()
        deadline = time.monotonic() + HOLD_S + 60
        while np.array_equal(buf.arr, snap):  # the held read lands once it is answered
            assert time.monotonic() < deadline, "nothing landed after the storage answered"
            time.sleep(0.2)
        time.sleep(1)
        landed = np.flatnonzero(buf.arr != snap)
        print(f"{landed.size} B landed after the failed release, bytes {landed[0]}-{landed[-1]}")
        assert np.array_equal(buf.arr[landed], content[landed])  # the file's bytes, in place
        agent.release_xfer_handle(h)  # over now: released
        if h in rig.handles:
            rig.handles.remove(h)
        rig.close()
    finally:
        os.close(fd)
        del rig, agent
        gc.collect()
        fs.stop()
