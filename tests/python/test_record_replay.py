"""Recording mode: the `record` parameter writes one JSON line per registration, prepared
request (with both descriptor lists) and post; bench/replay.py replays such a file through NIXL."""

import json
import os
import subprocess
import sys

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_recording_captures_registrations_requests_and_posts_and_replays(tmp_path):
    rec = tmp_path / "pattern.jsonl"
    agent = nixl_agent(f"rec-{os.getpid()}", nixl_agent_config(backends=[]))
    agent.create_backend("IO_URING_DMABUF", {"record": str(rec)})
    block, count = 8192, 16
    buf = np.random.randint(1, 256, block * count, dtype=np.uint8)
    path = tmp_path / "data.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        m = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        f = agent.register_memory([(0, buf.nbytes, fd, "")], "FILE")
        # Every other block: two runs that cannot merge, so the recorded I/O count is known.
        idx = list(range(0, count, 2))
        local = agent.get_xfer_descs([(buf.ctypes.data + i * block, block, 0) for i in idx], "DRAM")
        remote = agent.get_xfer_descs([(i * block, block, fd) for i in idx], "FILE")
        h = agent.initialize_xfer("WRITE", local, remote, agent.name)
        for _ in range(2):
            s = agent.transfer(h)
            while s == "PROC":
                s = agent.check_xfer_state(h)
            assert s == "DONE"
        agent.release_xfer_handle(h)
        agent.deregister_memory(m)
        agent.deregister_memory(f)
    finally:
        os.close(fd)
    events = [json.loads(l) for l in open(rec)]
    kinds = [e["event"] for e in events]
    assert kinds.count("register") == 2 and kinds.count("deregister") == 2
    assert kinds.count("prep") == 1 and kinds.count("post") == 2 and kinds.count("release") == 1
    prep = next(e for e in events if e["event"] == "prep")
    assert (
        prep["op"] == "WRITE"
        and prep["local_kind"] == "DRAM_SEG"
        and prep["remote_kind"] == "FILE_SEG"
    )
    assert prep["count"] == len(idx) and prep["ios_after_merge"] == len(idx)
    assert prep["remote"] == [[i * block, block, fd] for i in idx]
    assert all(e["status"] == "DONE" for e in events if e["event"] == "post")

    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "replay.py"),
            str(rec),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"replayed 1 requests, {2 * len(idx)} descriptors" in out.stdout, out.stdout
