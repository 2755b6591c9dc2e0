"""Round trips over >= 1000 descriptors of mixed sizes (512 B .. 16 MiB), every variant:
buffered / O_DIRECT, fd mode / path mode, prepped / un-prepped. WRITE from buffer A, check the
file byte for byte, READ into buffer B (pre-filled with other random bytes), check B byte for
byte, including the gaps between descriptors (which must keep their old bytes)."""

from __future__ import annotations

import gc
import os

import iud_helpers as H
import numpy as np
import pytest
from support.descriptors import Layout, mixed_layout


def open_fds_to(path: str) -> list[int]:
    real = os.path.realpath(path)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                out.append(int(fd))
        except OSError:
            pass
    return out


def roundtrip(
    rig: H.Rig,
    rng,
    path: str,
    *,
    direct: bool,
    mode: str,
    prepped: bool,
    layout: Layout | None = None,
    log=None,
) -> None:
    lay = layout or mixed_layout(rng, direct)
    assert lay.n >= 1000
    a = H.Buf(lay.mem_size).fill(rng)
    b = H.Buf(lay.mem_size).fill(rng)
    background = b.arr.copy()
    fd = None
    if mode == "fd":
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644
        )
        dev = fd
        file_reg = rig.reg_fd(fd, lay.file_size)
    else:
        dev, file_reg = rig.reg_path(
            path, lay.file_size, "rw,direct,create" if direct else "rw,create"
        )
    try:
        ra = rig.reg_dram(a)
        rb = rig.reg_dram(b)
        mem_a = [(a.addr + int(m), int(s)) for m, s in zip(lay.mem_off, lay.sizes)]
        mem_b = [(b.addr + int(m), int(s)) for m, s in zip(lay.mem_off, lay.sizes)]
        files = [(int(f), int(s), dev) for f, s in zip(lay.file_off, lay.sizes)]
        what = f"({lay.n} descs, {lay.total} B, direct={direct}, {mode} mode, prepped={prepped})"

        if prepped:
            ha, hb, hf = rig.prep_mem(mem_a), rig.prep_mem(mem_b), rig.prep_file(files)
            order = rng.permutation(lay.n)  # request order differs from list order
            w = rig.prepped_xfer("WRITE", ha, order, hf, order)
            r = rig.prepped_xfer("READ", hb, order[::-1], hf, order[::-1])
        else:
            w = rig.xfer("WRITE", mem_a, files)
            r = rig.xfer("READ", mem_b, files)

        rig.run(w, what="WRITE " + what)
        got = H.read_file(fd if fd is not None else path)
        want = H.expected_file(lay, a.arr)
        assert got.size == lay.file_size, f"file size {got.size} != {lay.file_size} {what}"
        assert np.array_equal(got, want), (
            "file after WRITE " + what + ": " + H.first_diff(got, want)
        )

        rig.run(r, what="READ " + what)
        want_b = H.expected_mem(lay, a.arr, background)
        assert np.array_equal(b.arr, want_b), (
            "buffer B after READ " + what + ": " + H.describe_mem_mismatch(lay, b.arr, want_b)
        )

        rig.release(w)
        rig.release(r)
        rig.dereg(ra)
        rig.dereg(rb)
        rig.dereg(file_reg)
        if log is not None:
            errs = H.plugin_error_lines(log())
            assert not errs, f"successful round trip logged errors: {errs}"
        if mode == "path":
            gc.collect()
            assert open_fds_to(path) == [], (
                f"path-mode file {path} still open in this process after deregistration"
            )
    finally:
        if fd is not None:
            os.close(fd)


@pytest.mark.parametrize("prepped", [False, True], ids=["unprepped", "prepped"])
@pytest.mark.parametrize("mode", ["fd", "path"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_roundtrip(rig, rng, tmp_path, direct, mode, prepped, is_plugin, stderr_log, request):
    if direct:
        request.getfixturevalue("need_direct")
    roundtrip(
        rig,
        rng,
        str(tmp_path / "rt.bin"),
        direct=direct,
        mode=mode,
        prepped=prepped,
        log=stderr_log if is_plugin else None,
    )


# Non-default engine parameters (IO_URING_DMABUF only): a ring much smaller than the request,
# no fixed buffers / fixed files, no splitting, and heavy splitting. Smaller layouts (~50 MiB)
# but still >= 1000 descriptors.
PARAM_SETS = {
    "ring16": {"ring_entries": "16"},
    "nofixed": {"fixed_buffers": "off", "fixed_files": "false"},
    "nosplit": {"max_io_size": "0"},
    "split64k": {"max_io_size": "65536"},
}


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("pset", list(PARAM_SETS))
def test_roundtrip_params(is_plugin, plugin_so, rng, tmp_path, direct, pset, stderr_log, request):
    if not is_plugin:
        pytest.skip("engine parameters of IO_URING_DMABUF")
    if direct:
        request.getfixturevalue("need_direct")
    agent = H.make_agent(H.PLUGIN, PARAM_SETS[pset])
    rig = H.Rig(agent, H.PLUGIN)
    try:
        lay = mixed_layout(rng, direct, n_small=950, n_medium=60, n_large=3)
        roundtrip(
            rig,
            rng,
            str(tmp_path / "rt.bin"),
            direct=direct,
            mode="fd",
            prepped=(pset in ("ring16", "split64k")),
            layout=lay,
            log=stderr_log,
        )
    finally:
        rig.close()
