"""Time per NIXL call of a register -> transfer -> deregister cycle, single-threaded (issue 48):
how long each backend keeps the caller inside registerMem/deregisterMem, where NIXL's own
registration lists sit unlocked in sync mode NONE (docs/reliability.md section 8).

    .venv/bin/python tests/reliability/registration_timing.py BACKEND [key=value ...] [--cycles 200]

Each cycle registers a fresh 8 MiB DRAM buffer and a 16 MiB file (fd mode), WRITEs 64 x 64 KiB
through initialize_xfer, polls to DONE, releases, deregisters both. Prints the median and p90
(microseconds) of each call. Needs NIXL_PLUGIN_DIR as ci/env.sh sets it."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import iud_helpers as H  # noqa: E402

MEM, FILE = 8 << 20, 16 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("backend")
    ap.add_argument("params", nargs="*", help="backend parameters key=value")
    ap.add_argument("--cycles", type=int, default=200)
    a = ap.parse_args()
    params = H.default_params(a.backend) | dict(kv.split("=", 1) for kv in a.params)
    agent = H.make_agent(a.backend, params=params, name="regtime")
    t: dict[str, list[float]] = {
        k: []
        for k in (
            "registerMem DRAM",
            "registerMem FILE",
            "deregisterMem DRAM",
            "deregisterMem FILE",
            "initialize_xfer",
            "transfer",
            "release",
        )
    }
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        fd = os.open(os.path.join(d, "f.bin"), os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, FILE)
        descs = [(k * 65536, 65536) for k in range(64)]
        files = [(k * 4 * 65536, 65536, fd) for k in range(64)]
        for _ in range(a.cycles):
            b = H.Buf(MEM)
            t0 = time.perf_counter()
            rd = agent.register_memory([(b.addr, MEM, 0, "")], "DRAM")
            t1 = time.perf_counter()
            rf = agent.register_memory([(0, FILE, fd, "")], "FILE")
            t2 = time.perf_counter()
            mem = agent.get_xfer_descs([(b.addr + o, n, 0) for o, n in descs], "DRAM")
            h = agent.initialize_xfer(
                "WRITE", mem, agent.get_xfer_descs(files, "FILE"), agent.name, backends=[a.backend]
            )
            t3 = time.perf_counter()
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            assert st == "DONE", st
            t4 = time.perf_counter()
            agent.release_xfer_handle(h)
            t5 = time.perf_counter()
            agent.deregister_memory(rf)
            t6 = time.perf_counter()
            agent.deregister_memory(rd)
            t7 = time.perf_counter()
            for k, v in zip(t, (t1 - t0, t2 - t1, t7 - t6, t6 - t5, t3 - t2, t4 - t3, t5 - t4)):
                t[k].append(v * 1e6)
        os.close(fd)
    p90 = int(a.cycles * 0.9)
    print(
        f"{a.backend} {params}: "
        + ", ".join(
            f"{k} {statistics.median(v):.0f} us (p90 {sorted(v)[p90]:.0f})" for k, v in t.items()
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
