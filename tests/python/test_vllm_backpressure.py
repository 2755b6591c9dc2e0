"""The stores' backpressure (vllm_connector/backpressure.py) on a fake clock: what is admitted
while storage keeps up, what is dropped when it falls behind, and that the queue stays bounded
by the rate storage showed. No vLLM, no storage."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from nixl_io_uring_dmabuf.vllm_connector.backpressure import StoreQueue  # noqa: E402
from nixl_io_uring_dmabuf.vllm_connector.config import StoreConfig  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Req:
    """ReqContext's per-request state (set_state/get_state), as vLLM 0.32-0.34 have it."""

    def __init__(self):
        self._state = {}

    def set_state(self, val):
        self._state[type(val)] = val

    def get_state(self, cls):
        return self._state.get(cls)


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def nothing_held(_key) -> bool:
    return False


def test_no_limit_admits_everything():
    q = StoreQueue(0, 1 << 20, clock=Clock())
    q.started(keys("a", 1000))
    assert q.admit(keys("b", 500), nothing_held, Req()) == keys("b", 500)
    assert q.dropped == 0


def test_before_any_completion_blocks_are_admitted_until_the_oldest_store_is_too_old():
    clock = Clock()
    q = StoreQueue(1.0, 100, clock=clock)
    q.started(q.admit(keys("a", 18), nothing_held, Req()))
    clock.t += 0.5
    assert q.admit(keys("b", 18), nothing_held, Req()) == keys("b", 18)
    q.started(keys("b", 18))
    clock.t += 0.6  # the oldest store is 1.1 s old: storage is behind
    assert q.admit(keys("c", 18), nothing_held, Req()) == []
    assert q.dropped == 18 and q.in_flight == 36


def test_the_queue_is_capped_at_max_seconds_of_the_measured_rate():
    """Storage finishes 10 blocks a second: with max_seconds 2, at most 20 are in flight."""
    clock = Clock()
    q = StoreQueue(2.0, 100, clock=clock)
    offered, fifo = 0, []
    for step in range(200):  # 0.1 s steps; the engine offers 5 blocks a step (50/s)
        q.finished(fifo[:1])  # storage: the oldest block, one per 0.1 s
        del fifo[:1]
        got = q.admit(keys(f"s{step}-", 5), nothing_held, Req())
        q.started(got)
        fifo += got
        offered += 5
        assert q.in_flight <= 20  # 2 s of storage at 10 blocks/s
        clock.t += 0.1
    assert q.rate() == pytest.approx(10)
    assert q.dropped > offered / 2  # storage takes a fifth of what is offered
    assert 19 <= q.peak_in_flight <= 20


def test_blocks_the_store_holds_or_has_in_flight_are_never_dropped_or_counted():
    clock = Clock()
    q = StoreQueue(1.0, 100, clock=clock)
    q.started(keys("a", 4))
    clock.t += 5  # the oldest is 5 s old and nothing completed: no room
    held = set(keys("h", 3))
    offer = keys("h", 3) + keys("a", 4) + keys("n", 2)
    assert q.admit(offer, held.__contains__, Req()) == keys("h", 3) + keys("a", 4)
    assert q.dropped == 2


def test_a_request_with_dropped_blocks_stores_none_after_them():
    """A prefix lookup stops at the first missing block: later blocks of that request would be
    stored for nothing."""
    clock = Clock()
    q = StoreQueue(1.0, 100, clock=clock)
    req = Req()
    q.started(q.admit(keys("r", 4), nothing_held, req))
    clock.t += 1.5
    assert q.admit(keys("s", 4), nothing_held, req) == []  # behind: dropped, request marked
    q.finished(keys("r", 4))  # storage catches up
    assert q.admit(keys("t", 4), nothing_held, req) == []  # still this request's tail
    # another request gets the room: storage did 4 blocks in 1.5 s, so 2 fit in 1 s
    assert q.admit(keys("u", 4), nothing_held, Req()) == keys("u", 2)
    assert q.dropped == 10


def test_an_empty_queue_always_takes_one_block_so_the_rate_is_measured_again():
    clock = Clock()
    q = StoreQueue(0.5, 100, clock=clock)
    q.started(keys("a", 1))
    clock.t += 10  # storage took 10 s for one block: 0.1 blocks/s, cap 0.05 blocks
    q.finished(keys("a", 1))
    got = q.admit(keys("b", 5), nothing_held, Req())
    assert got == keys("b", 1) and q.dropped == 4


def test_drops_are_logged_once_per_interval(caplog):
    clock = Clock()
    q = StoreQueue(1.0, 1 << 20, clock=clock, log_every_s=10)
    q.started(keys("a", 1))
    clock.t += 2
    with caplog.at_level("WARNING", logger="nixl_io_uring_dmabuf.vllm_connector.backpressure"):
        for i in range(50):
            q.admit(keys(f"b{i}-", 2), nothing_held, Req())
            clock.t += 0.1
        clock.t += 10
        q.admit(keys("c", 3), nothing_held, Req())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "2 block(s) (2.0 MiB) dropped" in lines[0]
    assert "101 block(s)" in lines[1] and "(103 in all)" in lines[1]


@pytest.mark.parametrize("bad", [-1, "1", True, None])
def test_store_queue_s_is_checked(bad):
    base = {"path": "/tmp/x", "capacity_bytes": 1 << 20}
    assert StoreConfig.from_extra(base).store_queue_s == 10.0
    assert StoreConfig.from_extra({**base, "store_queue_s": 0}).store_queue_s == 0.0
    with pytest.raises(ValueError, match="store_queue_s"):
        StoreConfig.from_extra({**base, "store_queue_s": bad})
