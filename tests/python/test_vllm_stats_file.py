"""The connector's benchmark counters file (IUD_KV_STATS_FILE) is written by its own thread: the
engine's thread hands over snapshots and never waits for the file system."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from nixl_io_uring_dmabuf.vllm_connector.stats_file import StatsFile  # noqa: E402


def test_the_last_snapshot_published_is_the_file_once_closed(tmp_path):
    s = StatsFile(str(tmp_path / "stats"), 3)
    for n in range(200):
        s.publish({"rank": 3, "store": {"jobs": n}})
    s.close()
    with open(tmp_path / "stats.3") as f:
        assert json.load(f) == {"rank": 3, "store": {"jobs": 199}}
    assert not (tmp_path / "stats.3.tmp").exists()


def test_publish_does_not_wait_for_a_slow_file_system(tmp_path, monkeypatch):
    import threading

    import nixl_io_uring_dmabuf.vllm_connector.stats_file as sf

    real_replace = os.replace
    inside, release = threading.Event(), threading.Event()
    stuck = []

    def stuck_replace(a, b):  # a rename waiting on the journal behind a busy disk
        inside.set()
        stuck.append(release.wait(30))
        real_replace(a, b)

    monkeypatch.setattr(sf.os, "replace", stuck_replace)
    s = StatsFile(str(tmp_path / "stats"), 0)
    s.publish({"n": 0})
    assert inside.wait(30), "the writer thread never wrote"
    for n in range(1, 50):
        s.publish({"n": n})
    # Every publish returned while the writer is still held inside its first rename.
    assert not release.is_set() and stuck == []
    release.set()
    s.close()
    assert stuck and all(stuck)
    with open(tmp_path / "stats.0") as f:
        assert json.load(f) == {"n": 49}


def test_an_unwritable_place_is_logged_not_raised(tmp_path, caplog):
    s = StatsFile(str(tmp_path / "missing-dir" / "stats"), 0)
    s.publish({"n": 1})
    s.close()
    assert "counters not written" in caplog.text
