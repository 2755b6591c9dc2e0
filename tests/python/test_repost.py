"""A completed request handle can be posted again (transfer(h) after DONE), and each post moves
the data as it is at that moment."""

from __future__ import annotations

import os

import iud_helpers as H
import numpy as np
import pytest
from support.descriptors import place

N_DESC = 96
POSTS = 4


def layout(rng, direct):
    sizes = rng.integers(512, 256 * H.KiB, N_DESC)
    if direct:
        sizes = (sizes + H.ALIGN - 1) // H.ALIGN * H.ALIGN
    sizes = sizes.astype(np.int64)
    return sizes, place(sizes), int(sizes.sum())


@pytest.mark.parametrize("prepped", [False, True], ids=["unprepped", "prepped"])
@pytest.mark.parametrize("kind", ["buffered-fd", "odirect-path"])
def test_repost(rig, rng, tmp_path, kind, prepped, request):
    direct = kind.startswith("odirect")
    if direct:
        request.getfixturevalue("need_direct")
    sizes, off, total = layout(rng, direct)
    path = str(tmp_path / "repost.bin")
    fd = None
    if kind == "buffered-fd":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        dev = fd
        rig.reg_fd(fd, total)
    else:
        dev, _ = rig.reg_path(path, total, "rw,direct,create")
    try:
        src, dst = H.Buf(total), H.Buf(total)
        rig.reg_dram(src)
        rig.reg_dram(dst)
        # memory side reversed relative to the file, so a stale or mixed-up mapping shows
        mem_src = [(src.addr + int(total - o - s), int(s)) for o, s in zip(off, sizes)]
        mem_dst = [(dst.addr + int(total - o - s), int(s)) for o, s in zip(off, sizes)]
        files = [(int(o), int(s), dev) for o, s in zip(off, sizes)]
        if prepped:
            hs, hd, hf = rig.prep_mem(mem_src), rig.prep_mem(mem_dst), rig.prep_file(files)
            idx = list(range(N_DESC))
            w = rig.prepped_xfer("WRITE", hs, idx, hf, idx)
            r = rig.prepped_xfer("READ", hd, idx, hf, idx)
        else:
            w = rig.xfer("WRITE", mem_src, files)
            r = rig.xfer("READ", mem_dst, files)

        def expect_file():
            out = np.empty(total, np.uint8)
            for (a, s), (o, _, _) in zip(mem_src, files):
                out[o : o + s] = src.arr[a - src.addr : a - src.addr + s]
            return out

        for k in range(POSTS):
            src.fill(rng)
            dst.fill(rng)
            rig.run(w, what=f"WRITE post #{k + 1}")
            got = H.read_file(path)
            want = expect_file()
            assert np.array_equal(got, want), f"file after WRITE post #{k + 1}: " + H.first_diff(
                got, want
            )
            rig.run(r, what=f"READ post #{k + 1}")
            assert np.array_equal(dst.arr, src.arr), (
                f"buffer after READ post #{k + 1}: " + H.first_diff(dst.arr, src.arr)
            )

        # READ reposted with the file changed underneath (and the buffer scrambled) each time
        for k in range(POSTS):
            new = H.rand_bytes(rng, total)
            with open(path, "r+b", buffering=0) as f:
                f.write(new.tobytes())
                os.fsync(f.fileno())
            dst.fill(rng)
            rig.run(r, what=f"READ-only post #{k + 1}")
            want = np.empty(total, np.uint8)
            for (a, s), (o, _, _) in zip(mem_dst, files):
                want[a - dst.addr : a - dst.addr + s] = new[o : o + s]
            assert np.array_equal(dst.arr, want), (
                f"buffer after READ-only post #{k + 1}: " + H.first_diff(dst.arr, want)
            )
    finally:
        rig.close()
        if fd is not None:
            os.close(fd)
