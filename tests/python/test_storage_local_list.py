"""The storage side as the *local* list, through the real NIXL runtime: NIXL's own storage
backends (GDS, GDS_MT) accept the file as either list and read the op as the file's direction
(READ: file -> memory, WRITE: memory -> file). Dynamo's KVBM 1.6.1 onboards disk blocks this way
(local FILE_SEG, remote VRAM_SEG, READ), so the plugin serving as GDS_MT must too."""

from __future__ import annotations

import os

import iud_helpers as H
import numpy as np


def test_file_as_local_list_moves_the_bytes_the_op_names(rig, rng, tmp_path, known_posix_failure):
    known_posix_failure(
        "NIXL's POSIX refuses a local FILE_SEG list (posix_backend.cpp: "
        "'Local memory type must be DRAM_SEG'); GDS and GDS_MT accept it"
    )
    n, block = 64, 16 << 10
    src = H.Buf(n * block).fill(rng)
    dst = H.Buf(n * block).fill(rng)
    path = str(tmp_path / "kv.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rf = rig.reg_fd(fd, n * block)
        rs, rd = rig.reg_dram(src), rig.reg_dram(dst)
        # scattered: file slot i holds memory block perm[i]
        perm = rng.permutation(n)
        files = [(int(i) * block, block, fd) for i in range(n)]
        mem = lambda b: [(b.addr + int(p) * block, block) for p in perm]  # noqa: E731
        local = rig.agent.get_xfer_descs([H._triple(d) for d in files], "FILE")
        remote = rig.agent.get_xfer_descs([H._triple(d) for d in mem(src)], "DRAM")
        w = rig.agent.initialize_xfer("WRITE", local, remote, rig.name, backends=[rig.backend])
        rig.handles.append(w)
        rig.run(w, what="WRITE, file as the local list")
        got = H.read_file(fd)
        want = np.concatenate([src.arr[int(p) * block : (int(p) + 1) * block] for p in perm])
        assert np.array_equal(got, want), "file after WRITE: " + H.first_diff(got, want)

        remote = rig.agent.get_xfer_descs([H._triple(d) for d in mem(dst)], "DRAM")
        r = rig.agent.initialize_xfer("READ", local, remote, rig.name, backends=[rig.backend])
        rig.handles.append(r)
        rig.run(r, what="READ, file as the local list")
        assert np.array_equal(dst.arr, src.arr), "memory after READ: " + H.first_diff(
            dst.arr, src.arr
        )
        rig.release(w)
        rig.release(r)
        for x in (rs, rd, rf):
            rig.dereg(x)
    finally:
        os.close(fd)
