"""Integrity at volume through the real NIXL runtime: random descriptor lists, unique per-chunk
patterns, mixed READ/WRITE, buffered and O_DIRECT, every byte verified.

    python tests/reliability/soak.py --gib 100 --descs 1000000      # the full soak (hours)
    python tests/reliability/soak.py --gib 2 --descs 20000           # CI size

A shadow copy of the file (in memory) holds what every byte must be. Each request picks a random
layout: non-overlapping file ranges in random order, non-overlapping memory ranges in another
random order, sizes 512 B .. 4 MiB (4 KiB multiples for O_DIRECT requests). WRITE fills each
descriptor's memory with a pattern derived from a chunk id that is never reused and updates the
shadow; READ fills the memory span with a sentinel, reads, and checks every descriptor's bytes
against the shadow and every byte between descriptors against the sentinel (overruns). One in
ten READ handles is posted a second time (repost) and checked again. At the end the whole file
is read back with plain pread and compared with the shadow. Prints one JSON summary line;
exit status 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# As pytest.ini's pythonpath: tests/python (iud_helpers), tests/ (support) and python/ (the package).
sys.path[:0] = [
    os.path.join(HERE, "..", "python"),
    os.path.join(HERE, ".."),
    os.path.join(HERE, "..", "..", "python"),
]


def _setup():
    from support.plugin_dir import use_test_plugin_dir

    use_test_plugin_dir()  # NIXL_PLUGIN_DIR before nixl is imported


class Patterns:
    """Unique per-chunk bytes, cheaply: chunk `cid` is a window of a random 16 MiB block
    starting at a position derived from cid, XOR the low byte of cid (never 0). Two chunks differ
    unless both their window start and id byte collide."""

    L = 16 << 20

    def __init__(self, rng):
        import numpy as np

        r = np.frombuffer(rng.bytes(self.L), np.uint8)
        self.block = np.concatenate([r, r])  # windows of up to L bytes never wrap

    def window(self, cid: int, size: int):
        x = (cid * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        start = (x >> 20) % self.L
        xb = (cid % 255) + 1
        return self.block[start : start + size] ^ xb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB to move (READ + WRITE)")
    ap.add_argument("--descs", type=int, default=20000, help="minimum descriptors to move")
    ap.add_argument("--file-mib", type=int, default=1024, help="size of the soak file")
    ap.add_argument("--mem-mib", type=int, default=256, help="size of the registered DRAM")
    ap.add_argument("--max-desc-kib", type=int, default=4096)
    ap.add_argument("--max-descs-per-req", type=int, default=4096)
    ap.add_argument("--dir", default="/var/tmp", help="directory of the soak file")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--params", default="", help="backend params k=v,k=v")
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    a = ap.parse_args(argv)

    _setup()
    import iud_helpers as H
    import numpy as np
    from support.descriptors import spread

    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    rng = np.random.default_rng(seed)
    MiB = H.MiB
    fsize, msize = a.file_mib * MiB, a.mem_mib * MiB
    params = dict(kv.split("=", 1) for kv in a.params.split(",") if kv) or None
    agent = H.make_agent(H.PLUGIN, params, name="soak")
    rig = H.Rig(agent, H.PLUGIN)
    d = tempfile.mkdtemp(prefix="iud-soak-", dir=a.dir)
    path = os.path.join(d, "soak.bin")
    fd_b = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd_b, fsize)
    try:
        fd_d = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        fd_d = None
    shadow = np.zeros(fsize, np.uint8)
    buf = H.Buf(msize)
    rig.reg_dram(buf)
    rig.reg_fd(fd_b, fsize)
    if fd_d is not None:
        rig.reg_fd(fd_d, fsize)
    st = {
        "seed": seed,
        "requests": 0,
        "reads": 0,
        "writes": 0,
        "reposts": 0,
        "descriptors": 0,
        "bytes": 0,
        "bytes_verified": 0,
        "direct_requests": 0,
        "mismatched_bytes": 0,
        "mismatched_descriptors": 0,
        "overrun_bytes": 0,
        "errors": 0,
        "file_mib": a.file_mib,
        "final_file_check": None,
    }
    first_bad = []
    next_chunk = 1
    pats = Patterns(rng)
    target_bytes = int(a.gib * (1 << 30))
    t0 = time.monotonic()
    last_print = t0
    try:
        while st["bytes"] < target_bytes or st["descriptors"] < a.descs:
            direct = fd_d is not None and rng.random() < 0.4
            unit = 4096 if direct else 1
            n = int(rng.integers(1, a.max_descs_per_req + 1))
            # mostly small, some large: log-uniform sizes
            lo, hi = np.log(512), np.log(a.max_desc_kib * 1024)
            sizes = np.exp(rng.uniform(lo, hi, n)).astype(np.int64)
            sizes = np.maximum(unit, sizes // unit * unit)
            budget = min(msize, fsize) // 2
            while sizes.sum() > budget:
                sizes = np.maximum(unit, sizes // 2 // unit * unit)
            fstart = spread(rng, sizes, fsize)
            mstart = spread(rng, sizes, msize)
            if direct:
                fstart = fstart // 4096 * 4096
                mstart = mstart // 4096 * 4096
                # re-space after rounding: keep them non-overlapping by construction
                order = np.argsort(fstart)
                pos = 0
                for i in order:
                    fstart[i] = max(fstart[i], pos)
                    pos = fstart[i] + sizes[i]
                order = np.argsort(mstart)
                pos = 0
                for i in order:
                    mstart[i] = max(mstart[i], pos)
                    pos = mstart[i] + sizes[i]
                if (
                    fstart.max() + sizes[fstart.argmax()] > fsize
                    or mstart.max() + sizes[mstart.argmax()] > msize
                ):
                    continue
            fd = fd_d if direct else fd_b
            total = int(sizes.sum())
            mem_descs = [(buf.addr + int(m), int(s)) for m, s in zip(mstart, sizes)]
            file_descs = [(int(f), int(s), fd) for f, s in zip(fstart, sizes)]
            ml, fl, sl = mstart.tolist(), fstart.tolist(), sizes.tolist()
            arr = buf.arr
            write = rng.random() < 0.5
            if write:
                for i in range(n):
                    v = pats.window(next_chunk + i, sl[i])
                    arr[ml[i] : ml[i] + sl[i]] = v
                    shadow_next = v
                    shadow[fl[i] : fl[i] + sl[i]] = shadow_next
                next_chunk += n
                h = rig.xfer("WRITE", mem_descs, file_descs)
                rig.run(h, 300, what="soak WRITE")
                rig.release(h)
                st["writes"] += 1
            else:
                lo_m, hi_m = int(mstart.min()), int((mstart + sizes).max())
                sentinel = int(rng.integers(0, 256))
                h = rig.xfer("READ", mem_descs, file_descs)
                posts = 2 if rng.random() < 0.1 else 1
                for p in range(posts):
                    arr[lo_m:hi_m] = sentinel
                    rig.run(h, 300, what="soak READ")
                    mask = np.ones(hi_m - lo_m, bool)
                    for i in range(n):
                        m, f, sz = ml[i], fl[i], sl[i]
                        mask[m - lo_m : m - lo_m + sz] = False
                        if not np.array_equal(arr[m : m + sz], shadow[f : f + sz]):
                            nb = int((arr[m : m + sz] != shadow[f : f + sz]).sum())
                            st["mismatched_bytes"] += nb
                            st["mismatched_descriptors"] += 1
                            if len(first_bad) < 5:
                                first_bad.append(
                                    {
                                        "request": st["requests"],
                                        "descriptor": i,
                                        "size": sz,
                                        "file": f,
                                        "mem": m,
                                        "direct": direct,
                                        "bytes": nb,
                                        "detail": H.first_diff(arr[m : m + sz], shadow[f : f + sz]),
                                    }
                                )
                    over = int((arr[lo_m:hi_m][mask] != sentinel).sum())
                    st["overrun_bytes"] += over
                    st["bytes_verified"] += total
                    if p:
                        st["reposts"] += 1
                rig.release(h)
                st["reads"] += 1
            st["requests"] += 1
            st["descriptors"] += n
            st["bytes"] += total
            st["direct_requests"] += int(direct)
            now = time.monotonic()
            if now - last_print > 30:
                last_print = now
                print(
                    f"soak: {st['bytes'] / (1 << 30):.1f} GiB, {st['descriptors']} descriptors,"
                    f" {st['requests']} requests, mismatches {st['mismatched_bytes']}, "
                    f"{now - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        # every byte of the file, through an independent path
        os.fsync(fd_b)
        diff = 0
        step = 64 * MiB
        for off in range(0, fsize, step):
            got = np.frombuffer(os.pread(fd_b, step, off), np.uint8)
            diff += int((got != shadow[off : off + len(got)]).sum())
        st["final_file_check"] = f"{fsize} bytes, {diff} differ"
        st["mismatched_bytes"] += diff
    except Exception as e:  # noqa: BLE001 - reported in the summary
        st["errors"] += 1
        st["error"] = repr(e)[:500]
    finally:
        st["seconds"] = round(time.monotonic() - t0, 1)
        st["gib"] = round(st["bytes"] / (1 << 30), 3)
        st["first_mismatches"] = first_bad
        rig.close()
        os.close(fd_b)
        if fd_d is not None:
            os.close(fd_d)
        os.unlink(path)
        os.rmdir(d)
    line = json.dumps(st)
    print(line, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")
    ok = st["mismatched_bytes"] == 0 and st["overrun_bytes"] == 0 and st["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
