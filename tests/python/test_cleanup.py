"""Kernel resources follow NIXL's lifetimes: a deregistered FILE is no longer held by the
engine's io_uring (fixed-file table), a deregistered DRAM region is no longer pinned as a fixed
buffer, and destroying the agent closes the engine's ring.

Observed through /proc/self/fdinfo of the process's io_uring descriptors, which lists the
registered files ("UserFiles:") and buffers ("UserBufs:")."""

from __future__ import annotations

import gc
import os

import iud_helpers as H
import pytest
from support.rings import registered, ring_fds


def rings() -> dict:
    """{ring fd: (registered file paths, registered buffer "addr/len" strings)}"""
    return {fd: registered(fd) for fd in ring_fds()}


def holders_of(path: str) -> list[int]:
    real = os.path.realpath(path)
    return [fd for fd, (files, _) in rings().items() if real in files]


def buffer_holders(addr: int) -> list[int]:
    return [
        fd for fd, (_, bufs) in rings().items() if any(b.startswith(f"0x{addr:x}/") for b in bufs)
    ]


def exercise(rig, path, mode, rng):
    """Register path (fd or path mode) + a buffer, WRITE and READ once, release the handles.
    Returns (file registration, buffer registration, fd or None, buffer)."""
    fd = None
    if mode == "fd":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        dev = fd
        freg = rig.reg_fd(fd, 1 * H.MiB)
    else:
        dev, freg = rig.reg_path(path, 1 * H.MiB, "rw,create")
    buf = H.Buf(1 * H.MiB).fill(rng)
    breg = rig.reg_dram(buf)
    for op in ("WRITE", "READ"):
        h = rig.xfer(op, [(buf.addr, buf.size)], [(0, buf.size, dev)])
        rig.run(h, 30, what=op)
        rig.release(h)
    return freg, breg, fd, buf


@pytest.mark.parametrize("mode", ["fd", "path"])
def test_file_released_at_deregistration(rig, rng, tmp_path, mode, is_plugin):
    path = str(tmp_path / "held.bin")
    freg, breg, fd, buf = exercise(rig, path, mode, rng)
    if is_plugin and not holders_of(path):
        pytest.skip("the engine did not put this file in a fixed-file table")
    rig.dereg(freg)
    if fd is not None:
        os.close(fd)
    held = holders_of(path)
    assert not held, (
        f"after deregister_memory of the FILE ({mode} mode) the file is still in "
        f"the fixed-file table of io_uring fd(s) {held}: the kernel keeps it open "
        "(its space is not freed if deleted, its filesystem cannot be unmounted) "
        "until some later operation on the engine"
    )


def test_buffer_released_at_deregistration(rig, rng, tmp_path, is_plugin):
    freg, breg, fd, buf = exercise(rig, str(tmp_path / "b.bin"), "fd", rng)
    if is_plugin and not buffer_holders(buf.addr):
        pytest.skip("the engine did not register this region as a fixed buffer")
    rig.dereg(breg)
    held = buffer_holders(buf.addr)
    rig.dereg(freg)
    os.close(fd)
    assert not held, (
        f"after deregister_memory of the DRAM region it is still a fixed buffer "
        f"(pinned) of io_uring fd(s) {held}"
    )


@pytest.mark.parametrize("mode", ["fd", "path"])
def test_file_released_by_the_next_operation(rig, rng, tmp_path, mode):
    """Weaker than the test above: whatever deferral the engine uses, once another request has
    run on it, a deregistered file must be out of its fixed-file table."""
    path = str(tmp_path / "held.bin")
    freg, breg, fd, buf = exercise(rig, path, mode, rng)
    rig.dereg(freg)
    if fd is not None:
        os.close(fd)
    other = str(tmp_path / "other.bin")
    ofd = os.open(other, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rig.reg_fd(ofd, buf.size)
        h = rig.xfer("WRITE", [(buf.addr, buf.size)], [(0, buf.size, ofd)])
        rig.run(h, 30, what="WRITE to another file")
        rig.release(h)
        held = holders_of(path)
        assert not held, (
            f"deregistered file still in the fixed-file table of io_uring fd(s) "
            f"{held} after another request ran on the engine"
        )
    finally:
        rig.close()
        os.close(ofd)


def test_agent_destruction_closes_the_ring(backend, rng, tmp_path):
    def scenario():
        agent = H.make_agent(backend)
        rig = H.Rig(agent, backend)
        exercise(rig, str(tmp_path / "r.bin"), "path", rng)
        fds = set(rings())
        rig.close()
        return fds

    gc.collect()
    before = set(rings())
    during = scenario()
    gc.collect()
    after = set(rings())
    if backend == H.PLUGIN:
        assert during - before, "no io_uring descriptor appeared for the engine"
    assert not (after - before), (
        f"io_uring descriptors {sorted(after - before)} are still open "
        "after the agent (and its engine) were destroyed"
    )
    assert not holders_of(str(tmp_path / "r.bin"))
