#!/usr/bin/env python3
"""Per-thread CPU use of a command's processes while it runs: which threads are busy, and how busy.

Runs the command, samples /proc/<pid>/task/*/stat of it and every descendant each --interval
seconds, and prints one line per interval and thread group (the thread's name with its digits
dropped: iud-pagecache-3 -> iud-pagecache-#) with the group's CPU use in cores (1.00 = one core
busy the whole interval), its busiest thread's, and the thread count. Used to tell a starved
stage from a saturated one (issue 26, item 4): if the page-cache workers run well below one core
each while the thread that polls is at one, the polling thread is what the request waits for.

    python3 bench/thread_cpu.py --interval 0.5 -- python3 bench/gpu_vram_bench.py ...
"""

import argparse
import os
import re
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def descendants(root):
    """root and every process below it (from /proc/*/stat's parent field)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            parent[int(d)] = int(s[s.rindex(")") + 2 :].split()[1])
    out, todo = {root}, [root]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in out:
                out.add(c)
                todo.append(c)
    return out


def sample(pids):
    """{(pid, tid): (group, cpu seconds)} for every thread of pids."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            name = s[s.index("(") + 1 : s.rindex(")")]
            fields = s[s.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
            out[(pid, int(tid))] = (re.sub(r"\d+", "#", name), cpu)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument(
        "--min_cores", type=float, default=0.05, help="groups below this are not printed"
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command")
    proc = subprocess.Popen(cmd)
    t0 = time.monotonic()
    prev, prev_t = sample(descendants(proc.pid)), t0
    while proc.poll() is None:
        time.sleep(a.interval)
        now_t = time.monotonic()
        now = sample(descendants(proc.pid))
        dt = now_t - prev_t
        groups = {}
        for key, (group, cpu) in now.items():
            used = (cpu - prev.get(key, (group, 0.0))[1]) / dt
            total, top, n = groups.get(group, (0.0, 0.0, 0))
            groups[group] = (total + used, max(top, used), n + 1)
        busy = sorted(((v, g) for g, v in groups.items() if v[0] >= a.min_cores), reverse=True)
        line = "  ".join(f"{g}={t:.2f}(max {m:.2f}, {n})" for (t, m, n), g in busy)
        print(f"thread_cpu t={now_t - t0:7.2f}s {line}", file=sys.stderr, flush=True)
        prev, prev_t = now, now_t
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
