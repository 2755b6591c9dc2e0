"""Whether a caller's checkXfer waits while O_DIRECT stores keep a slow disk busy: DRAM ->
O_DIRECT file WRITEs of N scattered 64 KiB pages through the real NIXL runtime, polled every
5 ms like an inference engine's step, each check_xfer_state timed.

A slow disk on this machine (root, cgroup v1 blkio; a loop device throttled to 100 MB/s):

    truncate -s 3G /tmp/disk.img; L=$(losetup -f --show /tmp/disk.img); mkfs.ext4 -q -F $L
    mkdir -p /mnt/slow; mount $L /mnt/slow
    mkdir -p /sys/fs/cgroup/blkio/iudslow
    echo "$(lsblk -dno MAJ:MIN $L | tr -d ' ') 104857600" \\
        > /sys/fs/cgroup/blkio/iudslow/blkio.throttle.write_bps_device
    sh -c 'echo $$ > /sys/fs/cgroup/blkio/iudslow/tasks; exec python3 bench/poll_stall_cpu.py \\
        /mnt/slow/f.bin "{\\"progress_thread\\": \\"true\\"}"'

Prints one JSON line: the post time and total time of each round, and the check times.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python")
)
import iud_helpers as H  # noqa: E402


def main() -> int:
    path, params = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    n, page = int(os.environ.get("N", "2048")), 64 << 10
    agent = H.make_agent("IO_URING_DMABUF", params)
    rig = H.Rig(agent, "IO_URING_DMABUF")
    buf = H.Buf(n * page).fill(np.random.default_rng(1))
    rig.reg_dram(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, 4 * n * page)
    rig.reg_fd(fd, 4 * n * page)
    mem = np.random.default_rng(2).permutation(n)
    polls, rounds = [], []
    for rep in range(3):
        h = rig.xfer(
            "WRITE",
            [(buf.addr + int(m) * page, page) for m in mem],
            [((rep % 4) * n * page + i * page, page, fd) for i in range(n)],
        )
        t0 = time.perf_counter()
        state = agent.transfer(h)
        post = time.perf_counter() - t0
        while state != "DONE":
            time.sleep(0.005)
            t = time.perf_counter()
            state = agent.check_xfer_state(h)
            polls.append(time.perf_counter() - t)
            if state not in ("PROC", "DONE"):
                raise RuntimeError(f"transfer state {state}")
        rounds.append(
            {"post_ms": round(post * 1e3, 2), "total_s": round(time.perf_counter() - t0, 3)}
        )
        rig.release(h)
    p = np.array(polls) * 1e3
    print(
        json.dumps(
            {
                "params": params,
                "rounds": rounds,
                "checks": len(p),
                "check_ms_p50": round(float(np.median(p)), 3),
                "check_ms_p99": round(float(np.percentile(p, 99)), 3),
                "check_ms_max": round(float(p.max()), 3),
            }
        )
    )
    rig.close()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
