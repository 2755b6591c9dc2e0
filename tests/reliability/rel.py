"""Helpers of the reliability suite: exact NIXL statuses, kernel-resource snapshots (fds, io_uring
fixed files and buffers, RSS), a FUSE fault filesystem mount, and a bystander request that proves
other requests on the same engine are unaffected by a fault."""

from __future__ import annotations

import os
import time

import iud_helpers as H
import numpy as np
from support.mounts import RULES, FuseMount
from support.rings import ring_fds, ring_tables

HERE = os.path.dirname(os.path.abspath(__file__))

STATUS_OF_EXC = {
    "nixlBackendError": "NIXL_ERR_BACKEND",
    "nixlCancelledError": "NIXL_ERR_CANCELED",
    "nixlInvalidParamError": "NIXL_ERR_INVALID_PARAM",
    "nixlMismatchError": "NIXL_ERR_MISMATCH",
    "nixlNotAllowedError": "NIXL_ERR_NOT_ALLOWED",
    "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
    "nixlNotPostedError": "NIXL_ERR_NOT_POSTED",
    "nixlNotSupportedError": "NIXL_ERR_NOT_SUPPORTED",
    "nixlRepostActiveError": "NIXL_ERR_REPOST_ACTIVE",
    "nixlUnknownError": "NIXL_ERR_UNKNOWN",
    "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
}


def status_name(value) -> str:
    """NIXL_SUCCESS, NIXL_IN_PROG, NIXL_ERR_... for a status the bindings returned (an enum
    member or an int)."""
    name = getattr(value, "name", None)
    if name:
        return name
    import nixl._bindings as b

    for n in dir(b):
        if n.startswith("NIXL_") and int(getattr(b, n)) == int(value):
            return n
    return str(value)


def exc_status(e: BaseException) -> str:
    return STATUS_OF_EXC.get(type(e).__name__, type(e).__name__)


# ---- kernel resources -------------------------------------------------------------------------


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    return 0


def non_ring_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - len(ring_fds())


class Snapshot:
    """fds of the process and the fixed-file/fixed-buffer tables of every io_uring it holds."""

    # fds of the test harness itself (pipes to FUSE daemons), not of the engine
    harness: set = set()

    def __init__(self):
        fds = {}
        for x in os.listdir("/proc/self/fd"):
            link = _link(int(x))
            if link != "?" and int(x) not in Snapshot.harness:  # "?": listdir's own fd
                fds[int(x)] = link
        self.fds = sorted(fds)
        self.links = fds
        self.rings = {fd: ring_tables(fd) for fd in ring_fds()}

    def tables(self) -> tuple[int, int]:
        f = sum(v[0] for v in self.rings.values())
        b = sum(v[1] for v in self.rings.values())
        return f, b

    def diff(self, later: Snapshot, closed_ok: bool = False) -> str:
        out = []
        gone = set(self.fds) - set(later.fds)
        new = set(later.fds) - set(self.fds)
        if new:
            out.append("new fds " + ", ".join(f"{fd}->{later.links[fd]}" for fd in sorted(new)))
        if gone and not closed_ok:
            out.append(f"closed fds {sorted(gone)}")
        if self.tables() != later.tables():
            out.append(f"io_uring (fixed files, fixed buffers) {self.tables()} -> {later.tables()}")
        return "; ".join(out)


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


# ---- running requests and recording the exact status ------------------------------------------


class Result:
    def __init__(self, stage: str, status: str, release: str = "NIXL_SUCCESS"):
        self.stage, self.status, self.release = stage, status, release

    @property
    def failed(self) -> bool:
        return self.stage != "done"

    def __repr__(self) -> str:
        return f"<{self.stage}: {self.status}; release {self.release}>"


def run_request(rig, make, timeout: float = 60.0, release: bool = True) -> Result:
    """make() creates a request; it is posted and polled through the agent's C++ binding so the
    exact nixl_status_t (or the exception class NIXL raises for it) is recorded."""
    errs = H.nixl_errors()
    try:
        h = make()
    except errs as e:
        return Result("prep", exc_status(e), release="-")
    ag = rig.agent.agent
    stage, status = "post", None
    try:
        st = ag.postXferReq(h._handle, b"")
        deadline = time.monotonic() + timeout
        while int(st) == 1:  # NIXL_IN_PROG
            stage = "check"
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"request still in progress after {timeout} s\n" + H.uring_diagnostics()
                )
            st = ag.getXferStatus(h._handle)
        status = status_name(st)
        if int(st) == 0:
            stage = "done"
    except errs as e:
        status = exc_status(e)
    rel = "-"
    if release:
        try:
            rig.release(h)
            rel = "NIXL_SUCCESS"
        except errs as e:
            rel = exc_status(e)
    return Result(stage, status, rel)


# ---- FUSE fault filesystem ----------------------------------------------------------------------


def fault_mount(root, rules: str, content: np.ndarray) -> FuseMount:
    """The rules file system (tests/support/fuse_rules.py) on a fresh folder under `root`; its
    daemon's pipes are the harness's, not the plugin's (Snapshot)."""
    mnt = os.path.join(str(root), f"mnt-{abs(hash(rules)) % 100000}-{time.monotonic_ns()}")
    m = FuseMount(mnt, rules, content, daemon=RULES)
    Snapshot.harness |= m.daemon_fds()
    return m


# ---- the bystander: a request on the same engine that must be unaffected -------------------------


class Bystander:
    """A plain disk file + buffers on the same agent. start() posts a large READ (in flight while
    the fault happens, when the engine keeps it in flight); finish() completes it and checks the
    bytes, then runs a WRITE+READ round trip."""

    SIZE = 16 * H.MiB

    def __init__(self, rig, rng, tmp_path, direct: bool):
        self.rig, self.rng = rig, rng
        self.path = str(tmp_path / "bystander.bin")
        self.content = H.rand_bytes(rng, self.SIZE)
        with open(self.path, "wb") as f:
            f.write(self.content.tobytes())
            os.fsync(f.fileno())
        flags = os.O_RDWR | (os.O_DIRECT if direct else 0)
        self.fd = os.open(self.path, flags)
        self.buf = H.Buf(self.SIZE)
        self.regs = [rig.reg_dram(self.buf), rig.reg_fd(self.fd, self.SIZE)]
        self.h = None
        self.rounds = 0

    def _descs(self):
        c = 256 * H.KiB
        return (
            [(self.buf.addr + i, c) for i in range(0, self.SIZE, c)],
            [(i, c, self.fd) for i in range(0, self.SIZE, c)],
        )

    def start(self):
        self.buf.fill(self.rng)
        mem, files = self._descs()
        self.h = self.rig.xfer("READ", mem, files)
        self.state = self.rig.agent.transfer(self.h)
        assert self.state in ("PROC", "DONE"), f"bystander READ: transfer() gave {self.state}"

    def finish(self, label: str):
        st = self.rig.poll(self.h, self.state, 60, what=f"bystander READ across {label}")
        assert st == "DONE", f"bystander READ across {label} ended {st}"
        self.rig.release(self.h)
        self.h = None
        assert np.array_equal(self.buf.arr, self.content), (
            f"bystander READ across {label}: " + H.first_diff(self.buf.arr, self.content)
        )
        new = H.rand_bytes(self.rng, self.SIZE)
        self.buf.arr[:] = new
        mem, files = self._descs()
        h = self.rig.xfer("WRITE", mem, files)
        self.rig.run(h, 60, what=f"bystander WRITE after {label}")
        self.rig.release(h)
        self.buf.fill(self.rng)
        h = self.rig.xfer("READ", mem, files)
        self.rig.run(h, 60, what=f"bystander READ after {label}")
        self.rig.release(h)
        assert np.array_equal(self.buf.arr, new), (
            f"bystander round trip after {label}: " + H.first_diff(self.buf.arr, new)
        )
        self.content = new
        self.rounds += 1

    def close(self):
        if self.h is not None:
            try:
                self.rig.release(self.h)
            except Exception:
                pass
        for r in self.regs:
            try:
                self.rig.dereg(r)
            except Exception:
                pass
        os.close(self.fd)


class NoBystander:
    """For engines that cannot register DRAM (dram_dmabuf=on on a kernel without the uAPI):
    finish() proves the engine still serves a FILE registration."""

    def __init__(self, rig, tmp_path):
        self.rig, self.path, self.h = rig, str(tmp_path / "nobystander.bin"), None
        self.rounds = 0

    def start(self):
        pass

    def finish(self, label: str):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            r = self.rig.reg_fd(fd, 65536)
            self.rig.dereg(r)
        finally:
            os.close(fd)
        self.rounds += 1

    def close(self):
        pass
