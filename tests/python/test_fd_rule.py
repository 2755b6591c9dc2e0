"""The rule for a registered FILE fd, through the real NIXL runtime (mem/file.rs, README
"Closed and reused fds"): after registration the application closes its fd, or closes it and
opens another file under the same number, before the first post or between two posts. The post
is refused with exactly one plugin ERROR line naming fd, file and cause, and no byte moves to
or from either file. Paths: the defaults (inline pwrite / preadv2 / page-cache workers), the
ring through a fixed-file slot (`inline_write_max=0`), the ring on the raw fd
(`fixed_files=false`) and O_DIRECT.

NIXL's POSIX backend, which keeps using the fd number, is not held to this rule."""

from __future__ import annotations

import os

import iud_helpers as H
import numpy as np
import pytest

SIZE = 4 * H.MiB
BLOCK = 256 * H.KiB

PATHS = {
    "defaults": ({}, False),
    "ring, fixed file": ({"inline_write_max": "0", "punt_buffered_min": "0"}, False),
    "ring, raw fd": (
        {"inline_write_max": "0", "punt_buffered_min": "0", "fixed_files": "false"},
        False,
    ),
    "O_DIRECT": ({}, True),
}


@pytest.mark.parametrize("between_posts", [False, True], ids=["before-first-post", "between-posts"])
@pytest.mark.parametrize("fate", ["closed", "reused"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_closed_or_reused_fd_is_refused_and_nothing_moves(
    is_plugin, need_direct, rng, tmp_path, stderr_log, path, op, fate, between_posts
):
    if not is_plugin:
        pytest.skip("NIXL's POSIX backend uses the fd number as it is at each post")
    params, direct = PATHS[path]
    flags = os.O_DIRECT if direct else 0
    a, b = str(tmp_path / "registered.bin"), str(tmp_path / "other.bin")
    with open(a, "wb") as f:
        f.write(H.rand_bytes(rng, SIZE).tobytes())
    b_bytes = H.rand_bytes(rng, SIZE).tobytes()
    with open(b, "wb") as f:
        f.write(b_bytes)
    agent = H.make_agent("IO_URING_DMABUF", params)
    rig = H.Rig(agent, "IO_URING_DMABUF")
    buf = H.Buf(SIZE).fill(rng)
    fd = os.open(a, os.O_RDWR | flags)
    rig.reg_dram(buf)
    rig.reg_fd(fd, SIZE)
    n = SIZE // BLOCK
    # Memory and file order differ, so nothing merges and nothing lines up by accident.
    h = rig.xfer(
        op,
        [(buf.addr + i * BLOCK, BLOCK) for i in range(n)],
        [(((i * 5) % n) * BLOCK, BLOCK, fd) for i in range(n)],
    )
    if between_posts:
        rig.run(h, what="first post")
    with open(a, "rb") as f:
        a_before = f.read()
    mem_before = buf.arr.copy()
    if fate == "closed":
        os.close(fd)
    else:
        other = os.open(b, os.O_RDWR | flags)
        os.dup2(other, fd)
        os.close(other)
    stderr_log()
    try:
        try:
            st = rig.poll(h, agent.transfer(h))
        except H.nixl_errors() as e:
            st = f"raised {type(e).__name__}"
        assert st not in ("DONE", "PROC"), f"the post after the fd was {fate} ended {st}"
        errors = H.plugin_error_lines(stderr_log())
        cause = "is no longer open" if fate == "closed" else "now refers to a different file"
        assert len(errors) == 1, errors
        assert f"fd {fd} registered as FILE for {a}" in errors[0] and cause in errors[0], errors[0]
        with open(a, "rb") as f:
            assert f.read() == a_before, "the registered file changed"
        with open(b, "rb") as f:
            assert f.read() == b_bytes, "the other file changed"
        assert np.array_equal(buf.arr, mem_before), "memory changed"
    finally:
        rig.close()
        if fate == "reused":
            os.close(fd)
