"""Child process of issue 48's client shape (test_sync_none_shape.py, tests/reliability/
none_mode_runs.py --shape issue48): one agent in the default sync mode NONE shared by THREADS
Python threads.

First, single-threaded, two round trips (a buffered file, then an O_DIRECT one). Then each thread
opens its own buffered file (16 MiB long) and does ROUNDS round trips; each round trip registers
two fresh DRAM buffers and the file (fd mode, 16 MiB), moves 64 descriptors of random sizes up to
64 KiB at random non-overlapping file and memory offsets (WRITE from one buffer, READ into the
other, every byte checked), even rounds through initialize_xfer plus a repost of both requests
with new bytes, odd rounds through prep_xfer_dlist + make_prepped_xfer; then releases its handles
and deregisters the three registrations. At the end each thread compares its whole file with a
shadow copy of everything it wrote, so a byte written to or read from another thread's file
shows as a wrong byte.

    python sync_none_shape_child.py BACKEND DIR [THREADS] [ROUNDS] [XFER_EVERY] [PIECES]

XFER_EVERY (default 1): only every XFER_EVERY-th round trip moves data; the others register the
two buffers and the file and deregister them again (the derived shape that shows NIXL's list race
with any backend, because registration then dominates each thread's time).
PIECES (default 1): each DRAM buffer is registered as PIECES descriptors of one register_memory
call (NIXL then holds its list across PIECES backend calls); round trips that move data use
gcd(PIECES, 64) pieces, so that every descriptor lies in one piece.
IUD_SHAPE_SYNC=rw|strict (environment) creates the agent with that sync mode instead of NONE.

Exit 0 when every byte matched; 1 with a message otherwise. A crash of the process (heap
corruption) shows as a signal to the parent."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # iud_helpers; tests/ for support
import iud_helpers as H  # noqa: E402
from support.descriptors import slotted  # noqa: E402

FILE = 16 * H.MiB
DESCS = 64
MAX_DESC = 64 * H.KiB
# Memory buffers: 64 descriptors of at most 64 KiB each, at random non-overlapping offsets.
MEM = 2 * DESCS * MAX_DESC
POLL_S = 60
PIECES = 1


def layout(rng: np.random.Generator, direct: bool):
    """64 (size, memory offset, file offset): random sizes up to 64 KiB (4 KiB multiples for
    O_DIRECT), file offsets random inside 64 disjoint 256 KiB slots of the file, memory offsets
    random inside 64 disjoint 128 KiB slots of the buffers, both in shuffled orders."""
    unit = 4096 if direct else 1
    sizes = rng.integers(1, MAX_DESC // unit, size=DESCS, endpoint=True) * unit
    foff = slotted(rng, sizes, FILE, unit)
    moff = slotted(rng, sizes, MEM, unit)
    return [(int(z), m, f) for z, m, f in zip(sizes, moff, foff)]


def wait(agent, h, what: str) -> None:
    st = agent.transfer(h)
    deadline = time.monotonic() + POLL_S
    while st == "PROC":
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} still PROC after {POLL_S} s")
        st = agent.check_xfer_state(h)
    if st != "DONE":
        raise AssertionError(f"{what} ended {st}")


def check(what: str, descs, src: H.Buf, dst: H.Buf, shadow: np.ndarray) -> None:
    for i, (z, m, f) in enumerate(descs):
        if not np.array_equal(dst.arr[m : m + z], src.arr[m : m + z]):
            raise AssertionError(
                f"{what} descriptor {i} (file offset {f}, {z} bytes): "
                + H.first_diff(dst.arr[m : m + z], src.arr[m : m + z])
            )
        shadow[f : f + z] = src.arr[m : m + z]


def round_trip(
    agent,
    backend: str,
    fd: int,
    rng,
    r: int,
    direct: bool,
    shadow: np.ndarray,
    tag: str,
    move: bool = True,
) -> None:
    descs = layout(rng, direct)
    src, dst = H.Buf(MEM), H.Buf(MEM)
    src.fill(rng)
    dst.arr[:] = 0
    pieces = PIECES if not move else math.gcd(PIECES, DESCS)  # a descriptor stays in one piece
    piece = MEM // pieces
    regs = [
        agent.register_memory([(b.addr + k * piece, piece, 0, "") for k in range(pieces)], "DRAM")
        for b in (src, dst)
    ]
    regs.append(agent.register_memory([(0, FILE, fd, "")], "FILE"))
    if not move:
        for reg in reversed(regs):
            agent.deregister_memory(reg)
        return
    s = [(src.addr + m, z, 0) for z, m, _ in descs]
    d = [(dst.addr + m, z, 0) for z, m, _ in descs]
    fl = [(f, z, fd) for z, _, f in descs]
    dlists = []
    if r % 2:
        hs = agent.prep_xfer_dlist("NIXL_INIT_AGENT", s, "DRAM", backends=[backend])
        hd = agent.prep_xfer_dlist("NIXL_INIT_AGENT", d, "DRAM", backends=[backend])
        hf = agent.prep_xfer_dlist(agent.name, fl, "FILE", backends=[backend])
        dlists = [hs, hd, hf]
        idx = list(range(DESCS))
        w = agent.make_prepped_xfer("WRITE", hs, idx, hf, idx, backends=[backend])
        rd = agent.make_prepped_xfer("READ", hd, idx, hf, idx, backends=[backend])
        posts = 1
    else:
        lf = agent.get_xfer_descs(fl, "FILE")
        w = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(s, "DRAM"), lf, agent.name, backends=[backend]
        )
        rd = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(d, "DRAM"), lf, agent.name, backends=[backend]
        )
        posts = 2
    for p in range(posts):
        if p:  # the repost: new bytes through the same two requests
            src.fill(rng)
            dst.arr[:] = 0
        wait(agent, w, f"{tag} round {r} WRITE post {p}")
        wait(agent, rd, f"{tag} round {r} READ post {p}")
        check(f"{tag} round {r} post {p}", descs, src, dst, shadow)
    agent.release_xfer_handle(w)
    agent.release_xfer_handle(rd)
    for h in dlists:
        agent.release_dlist_handle(h)
    for reg in reversed(regs):
        agent.deregister_memory(reg)


def check_file(fd: int, shadow: np.ndarray, tag: str) -> None:
    got = H.read_file(fd, FILE)
    if not np.array_equal(got, shadow):
        raise AssertionError(
            f"{tag}: the file differs from what this thread wrote to it: "
            + H.first_diff(got, shadow)
        )


def open_file(d: str, name: str, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(os.path.join(d, name), flags, 0o644)
    os.ftruncate(fd, FILE)
    return fd


def worker(agent, backend: str, t: int, d: str, rounds: int, xfer_every: int, errors: list) -> None:
    try:
        rng = np.random.default_rng([os.getpid(), t])
        fd = open_file(d, f"t{t}.bin", False)
        shadow = np.zeros(FILE, dtype=np.uint8)
        try:
            for r in range(rounds):
                round_trip(
                    agent,
                    backend,
                    fd,
                    rng,
                    r,
                    False,
                    shadow,
                    f"thread {t} (fd {fd})",
                    move=r % xfer_every == 0,
                )
            check_file(fd, shadow, f"thread {t} (fd {fd})")
        finally:
            os.close(fd)
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"thread {t}: {e!r}\n{traceback.format_exc()}")


def main() -> int:
    backend, d = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    xfer_every = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    global PIECES
    PIECES = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    sync = os.environ.get("IUD_SHAPE_SYNC", "none")
    from nixl._api import nixl_thread_sync_t

    mode = {
        "none": None,
        "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    }[sync]
    # mode None: nixl_agent_config(backends=[]), whose default is sync mode NONE
    agent = H.make_agent(backend, sync_mode=mode, name="shape48")
    rng = np.random.default_rng([os.getpid(), 99])
    for direct in (False, True):
        fd = open_file(d, f"single-{'direct' if direct else 'buffered'}.bin", direct)
        try:
            shadow = np.zeros(FILE, dtype=np.uint8)
            round_trip(agent, backend, fd, rng, 0, direct, shadow, "single-threaded")
            check_file(fd, shadow, "single-threaded")
        finally:
            os.close(fd)
    errors: list = []
    ts = [
        threading.Thread(target=worker, args=(agent, backend, t, d, rounds, xfer_every, errors))
        for t in range(threads)
    ]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    print(
        f"ok: {threads} threads x {rounds} round trips (every {xfer_every}. moving data), "
        f"{backend}, sync {sync}, registering per round trip"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
