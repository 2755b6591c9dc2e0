"""What the connector's engine tests do to a store's file system between two prompts of one
engine (vllm_engine.run_engine's `between`), run by the engine's process and waited for:

    python store_fs_hooks.py has-commits STORE N   rank 0's journal holds N COMMITs
    python store_fs_hooks.py has-failed STATS N    the worker's counters file (IUD_KV_STATS_FILE,
                                                   rank 0) shows N failed stores, none in flight
    python store_fs_hooks.py fill FOLDER           fill FOLDER's file system to the last byte
    python store_fs_hooks.py free FOLDER           remove the filler again

The has-* checks exit 0 when it holds, 3 when not (yet): run them as ["@poll", ...], which
steps the engine until they hold (the worker writes COMMITs and counts failures when vLLM polls
it, which an engine in this process does only inside `generate`).
"""

from __future__ import annotations

import errno
import json
import os
import sys


def commits(store: str) -> int:
    from nixl_io_uring_dmabuf.vllm_connector import journal

    try:
        with open(os.path.join(store, "rank0of1", "commits.log"), "rb") as f:
            recs, _, _ = journal.parse(f.read())
    except FileNotFoundError:
        return 0
    return sum(r.type == journal.COMMIT for r in recs)


def stats(path: str) -> dict:
    try:
        with open(path + ".0") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def fill(folder: str) -> None:
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (1 << 20, 1 << 16, 4096, 1):
            data = b"\xff" * chunk
            while True:
                try:
                    if os.write(fd, data) < chunk:
                        break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    st = os.statvfs(folder)
    if st.f_bavail:
        sys.exit(f"store_fs_hooks: {folder} still has {st.f_bavail} free block(s)")
    print(f"store_fs_hooks: filled {folder}", flush=True)


def main(argv):
    what = argv[1]
    if what == "has-commits":
        sys.exit(0 if commits(argv[2]) >= int(argv[3]) else 3)
    elif what == "has-failed":
        st = stats(argv[2])
        sys.exit(
            0
            if st.get("store", {}).get("failed", 0) >= int(argv[3]) and st.get("in_flight", 0) == 0
            else 3
        )
    elif what == "fill":
        fill(argv[2])
    elif what == "free":
        os.unlink(os.path.join(argv[2], "filler"))
        print(f"store_fs_hooks: freed {argv[2]}", flush=True)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
