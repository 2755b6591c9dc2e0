"""Child process of test_concurrent_reg.py (issue 16 §5): one agent, THREADS Python threads, each
opening its own file, registering a 16 MiB DRAM buffer and the file, doing ROUNDS WRITE/READ round
trips of 64 descriptors x 64 KiB (odd rounds prepped: prep_xfer_dlist + make_prepped_xfer, even
rounds initialize_xfer), every byte checked, then deregistering both.

    python concurrent_reg_child.py BACKEND SYNC DIR [THREADS] [ROUNDS] [upfront]
SYNC: none (the default agent: no listen thread, NIXL_THREAD_SYNC_NONE), rw or strict.
upfront: the main thread registers every buffer and file before the threads start and
deregisters them after they joined (the sequence that is safe in sync mode NONE); the threads
only prepare, post and release requests.
Exit 0 when every thread finished and every byte matched; 1 with a message otherwise. A crash
of the process (heap corruption) shows as a signal to the parent."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import iud_helpers as H  # noqa: E402

BUF = 16 * H.MiB
DESCS = 64
DESC = 64 * H.KiB
# A transfer still PROC after this many seconds fails the run (a run takes a few seconds).
POLL_S = 60
# Random start delay per thread (ms), to vary how the threads' calls overlap.
JITTER_MS = float(os.environ.get("CONCREG_JITTER_MS", "0"))


class Slot:
    """One thread's file and buffer, and their registrations."""

    def __init__(self, d: str, t: int):
        self.fd = os.open(os.path.join(d, f"t{t}.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.buf = H.Buf(BUF)
        self.mem = self.fil = None

    def register(self, agent) -> None:
        self.mem = agent.register_memory([(self.buf.addr, BUF, 0, "")], "DRAM")
        self.fil = agent.register_memory([(0, BUF, self.fd, "")], "FILE")

    def deregister(self, agent) -> None:
        agent.deregister_memory(self.fil)
        agent.deregister_memory(self.mem)
        os.close(self.fd)


def worker(
    agent, backend: str, t: int, d: str, slot: Slot | None, rounds: int, errors: list
) -> None:
    try:
        rng = np.random.default_rng([os.getpid(), t])
        if JITTER_MS:
            time.sleep(float(rng.uniform(0, JITTER_MS)) / 1000)
        upfront = slot is not None
        if not upfront:
            slot = Slot(d, t)
            slot.register(agent)
        fd, buf = slot.fd, slot.buf
        half = BUF // 2
        for r in range(rounds):
            # descriptors: a random permutation of 64 KiB slots, source in the lower half of the
            # buffer, destination in the upper half
            slots = rng.permutation(half // DESC)[:DESCS]
            src = [(buf.addr + int(s) * DESC, DESC, 0) for s in slots]
            dst = [(buf.addr + half + int(s) * DESC, DESC, 0) for s in slots]
            fl = [(i * DESC, DESC, fd) for i in range(DESCS)]
            buf.fill(rng)
            if r % 2:
                hs = agent.prep_xfer_dlist("NIXL_INIT_AGENT", src, "DRAM", backends=[backend])
                hd = agent.prep_xfer_dlist("NIXL_INIT_AGENT", dst, "DRAM", backends=[backend])
                hf = agent.prep_xfer_dlist(agent.name, fl, "FILE", backends=[backend])
                idx = list(range(DESCS))
                w = agent.make_prepped_xfer("WRITE", hs, idx, hf, idx, backends=[backend])
                rd = agent.make_prepped_xfer("READ", hd, idx, hf, idx, backends=[backend])
            else:
                hs = hd = hf = None
                lf = agent.get_xfer_descs(fl, "FILE")
                w = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(src, "DRAM"), lf, agent.name, backends=[backend]
                )
                rd = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(dst, "DRAM"), lf, agent.name, backends=[backend]
                )
            for h, op in ((w, "WRITE"), (rd, "READ")):
                st = agent.transfer(h)
                deadline = time.monotonic() + POLL_S
                while st == "PROC":
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"thread {t} round {r} {op} still PROC after {POLL_S} s"
                        )
                    st = agent.check_xfer_state(h)
                if st != "DONE":
                    raise AssertionError(f"thread {t} round {r} {op} ended {st}")
            agent.release_xfer_handle(w)
            agent.release_xfer_handle(rd)
            for h in (hs, hd, hf):
                if h is not None:
                    agent.release_dlist_handle(h)
            for i, s in enumerate(slots):
                a, b = int(s) * DESC, half + int(s) * DESC
                if not np.array_equal(buf.arr[a : a + DESC], buf.arr[b : b + DESC]):
                    raise AssertionError(
                        f"thread {t} round {r} descriptor {i}: "
                        + H.first_diff(buf.arr[b : b + DESC], buf.arr[a : a + DESC])
                    )
        if not upfront:
            slot.deregister(agent)
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"thread {t}: {e!r}\n{traceback.format_exc()}")


def main() -> int:
    backend, sync, d = sys.argv[1], sys.argv[2], sys.argv[3]
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    upfront = len(sys.argv) > 6 and sys.argv[6] == "upfront"
    from nixl._api import nixl_thread_sync_t

    mode = {
        "none": None,
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    }[sync]
    agent = H.make_agent(backend, sync_mode=mode, name="concreg")
    errors: list = []
    slots = [Slot(d, t) for t in range(threads)] if upfront else [None] * threads
    for s in slots:
        if s is not None:
            s.register(agent)
    ts = [
        threading.Thread(target=worker, args=(agent, backend, t, d, slots[t], rounds, errors))
        for t in range(threads)
    ]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    for s in slots:
        if s is not None:
            s.deregister(agent)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    print(
        f"ok: {threads} threads x {rounds} round trips, {backend}, sync {sync}"
        + (", registered up front" if upfront else ", registering in the threads")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
