"""The worker's job counters in a JSON file, for benchmarks (IUD_KV_STATS_FILE), written by a
thread of its own: the engine's thread only hands over a copy. Written from the engine's thread,
the file's rename waits on the file system's journal while O_DIRECT stores keep the same disk
busy, and decode steps take 28-53 ms instead of 5.4 (vLLM on the H200,
bench/results/2026-12-03-vllm-gpu-h200.md)."""

from __future__ import annotations

import json
import logging
import os
import threading

logger = logging.getLogger(__name__)


class StatsFile:
    """Writes the latest snapshot given to `publish` to `<path>.<rank>` (a temporary file, then
    renamed over it); snapshots that come while one is written are coalesced."""

    def __init__(self, path: str, rank: int):
        self._final, self._tmp = f"{path}.{rank}", f"{path}.{rank}.tmp"
        self._cond = threading.Condition()
        self._pending: dict | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="iud-kv-stats", daemon=True)
        self._thread.start()

    def publish(self, snapshot: dict) -> None:
        """Queues `snapshot` (a JSON-able dict the caller no longer changes); never waits."""
        with self._cond:
            self._pending = snapshot
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Writes what is pending, then stops the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    return
            try:
                with open(self._tmp, "w") as f:
                    json.dump(snapshot, f)
                os.replace(self._tmp, self._final)
            except OSError as e:
                logger.warning("KV store: counters not written to %s: %s", self._final, e)
