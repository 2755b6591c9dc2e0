"""Shared helpers for the Python test suite of the IO_URING_DMABUF NIXL plugin.

Everything here drives the plugin through NIXL's public Python API (``nixl._api``) the way a
user does: an agent with no default backends, one storage backend created with
``create_backend``, DRAM as the local list, FILE as the "remote" list and the agent's own name
as the remote agent.

The backend under test is ``IUD_TEST_BACKEND`` (default ``IO_URING_DMABUF``); running the suite
with ``IUD_TEST_BACKEND=POSIX`` exercises NIXL's own POSIX backend (io_uring queue) through the
same tests, which is how the harness itself is validated.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from support.descriptors import Layout

PLUGIN = "IO_URING_DMABUF"
ALIGN = 4096
MiB = 1 << 20
KiB = 1 << 10

# Lines the plugin's tracing subscriber writes for a failure ("<time> ERROR io_uring_dmabuf::..").
PLUGIN_ERROR_LINE = re.compile(r"\bERROR\b.*\bio_uring_dmabuf\b")

_names = itertools.count()


def nixl_errors():
    """All exception classes the NIXL bindings raise (nixlBackendError, nixlNotFoundError, ...)."""
    import nixl._bindings as b

    errs = tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error"))
    assert errs, "nixl._bindings exposes no nixl*Error classes"
    return errs


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def test_backend() -> str:
    return os.environ.get("IUD_TEST_BACKEND", PLUGIN)


test_backend.__test__ = False  # not a pytest test


def default_params(backend: str) -> dict:
    """Backend params for the backend under test; IUD_TEST_PARAMS='k=v,k=v' overrides."""
    params = {"use_uring": "true"} if backend == "POSIX" else {}
    extra = os.environ.get("IUD_TEST_PARAMS", "").strip()
    if extra:
        for kv in extra.split(","):
            k, _, v = kv.partition("=")
            params[k.strip()] = v.strip()
    return params


class Buf:
    """A page-aligned anonymous-mmap DRAM buffer exposed as a numpy uint8 array."""

    def __init__(self, size: int):
        self.size = size
        mapped = max(ALIGN, (size + ALIGN - 1) // ALIGN * ALIGN)
        self._mm = mmap.mmap(-1, mapped)
        self.arr = np.frombuffer(self._mm, dtype=np.uint8)[:size]
        self.addr = self.arr.ctypes.data
        assert self.addr % ALIGN == 0

    def fill(self, rng: np.random.Generator) -> Buf:
        self.arr[:] = np.frombuffer(rng.bytes(self.size), dtype=np.uint8)
        return self


def rand_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()


def read_file(path_or_fd, size: int | None = None) -> np.ndarray:
    """Buffered view of a file's bytes. An fd (possibly O_DIRECT) is reopened via /proc/self/fd."""
    path = f"/proc/self/fd/{path_or_fd}" if isinstance(path_or_fd, int) else path_or_fd
    with open(path, "rb", buffering=0) as f:
        data = f.read() if size is None else f.read(size)
    return np.frombuffer(data, dtype=np.uint8)


def first_diff(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"shape {a.shape} != {b.shape}"
    bad = np.flatnonzero(a != b)
    if bad.size == 0:
        return (
            "no difference on re-check: the bytes changed between two comparisons, so I/O "
            "was still landing in memory after the request reported DONE or was released"
        )
    i = int(bad[0])
    return (
        f"{bad.size} differing bytes, first at {i} (got 0x{int(a[i]):02x}, "
        f"expected 0x{int(b[i]):02x}), last at {int(bad[-1])}"
    )


def plugin_error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if PLUGIN_ERROR_LINE.search(ln)]


@dataclass
class Outcome:
    stage: str  # "prep" | "post" | "check" | "done" | "timeout"
    exc: BaseException | None = None
    state: str | None = None
    release_exc: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.stage in ("prep", "post", "check")

    def __str__(self) -> str:
        what = repr(self.exc) if self.exc is not None else self.state
        return f"stage={self.stage} ({what})"


@dataclass
class Rig:
    """One agent with one backend, plus bookkeeping so teardown releases things in order."""

    agent: object
    backend: str
    handles: list = field(default_factory=list)
    dlists: list = field(default_factory=list)
    regs: list = field(default_factory=list)
    _dev_ids: itertools.count = field(default_factory=lambda: itertools.count(1_000_000))

    @property
    def name(self) -> str:
        return self.agent.name

    # ---- registration -------------------------------------------------------------------
    def reg_dram(self, regions) -> object:
        """regions: Buf, or list of (addr, len)."""
        if isinstance(regions, Buf):
            regions = [(regions.addr, regions.size)]
        r = self.agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
        self.regs.append(r)
        return r

    def reg_fd(self, fd: int, length: int, offset: int = 0) -> object:
        r = self.agent.register_memory([(offset, length, fd, "")], "FILE")
        self.regs.append(r)
        return r

    def new_dev_id(self) -> int:
        return next(self._dev_ids)

    def reg_path(self, path: str, length: int, modes: str = "rw,create", dev_id: int | None = None):
        """Path-mode registration; returns (devId for transfer descriptors, registration)."""
        dev_id = self.new_dev_id() if dev_id is None else dev_id
        r = self.agent.register_memory([(0, length, dev_id, f"{modes}:{path}")], "FILE")
        self.regs.append(r)
        return dev_id, r

    def dereg(self, r) -> None:
        self.agent.deregister_memory(r)
        self.regs.remove(r)

    # ---- requests -----------------------------------------------------------------------
    def dram(self, descs):
        return self.agent.get_xfer_descs([(a, n, 0) for a, n in descs], "DRAM")

    def file(self, descs):
        return self.agent.get_xfer_descs([tuple(d) for d in descs], "FILE")

    def xfer(self, op: str, mem_descs, file_descs, mem_kind="DRAM", file_kind="FILE"):
        """Un-prepped request (initialize_xfer). mem_descs: (addr,len[,dev]) tuples."""
        local = self.agent.get_xfer_descs([_triple(d) for d in mem_descs], mem_kind)
        remote = self.agent.get_xfer_descs([_triple(d) for d in file_descs], file_kind)
        h = self.agent.initialize_xfer(op, local, remote, self.name, backends=[self.backend])
        self.handles.append(h)
        return h

    def prep_mem(self, descs, kind="DRAM"):
        """prep_xfer_dlist for the local (initiator) side."""
        h = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [_triple(d) for d in descs], kind, backends=[self.backend]
        )
        self.dlists.append(h)
        return h

    def prep_file(self, descs, kind="FILE"):
        """prep_xfer_dlist for the loopback (own agent name) side."""
        h = self.agent.prep_xfer_dlist(
            self.name, [_triple(d) for d in descs], kind, backends=[self.backend]
        )
        self.dlists.append(h)
        return h

    def prepped_xfer(self, op: str, hl, li, hr, ri):
        h = self.agent.make_prepped_xfer(
            op, hl, list(map(int, li)), hr, list(map(int, ri)), backends=[self.backend]
        )
        self.handles.append(h)
        return h

    def release(self, h) -> None:
        self.agent.release_xfer_handle(h)
        if h in self.handles:
            self.handles.remove(h)

    def run(self, h, timeout: float = 60.0, what: str = "") -> None:
        """Post h and poll it to completion; AssertionError unless it ends DONE."""
        st = self.agent.transfer(h)
        st = self.poll(h, st, timeout, what)
        assert st == "DONE", f"transfer {what} ended {st}"

    def poll(self, h, st: str, timeout: float = 60.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        spins = 0
        while st == "PROC":
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"transfer {what} still PROC after {timeout:.0f} s\n" + uring_diagnostics()
                )
            spins += 1
            time.sleep(0 if spins < 2000 else 0.0002)
            st = self.agent.check_xfer_state(h)
        return st

    def attempt(self, make, timeout: float = 30.0) -> Outcome:
        """Create a request with make() and run it, recording where (if anywhere) it failed.
        The request is released afterwards; a failing release is recorded too."""
        errs = nixl_errors()
        try:
            h = make()
        except errs as e:
            return Outcome("prep", exc=e)
        out = None
        try:
            st = self.agent.transfer(h)
            if st == "ERR":
                out = Outcome("post", state=st)
            else:
                try:
                    st = self.poll(h, st, timeout)
                except errs as e:
                    out = Outcome("check", exc=e)
                except AssertionError:
                    out = Outcome("timeout", state="PROC")
                else:
                    out = Outcome("check" if st == "ERR" else "done", state=st)
        except errs as e:
            out = Outcome("post", exc=e)
        if out.stage != "timeout":
            try:
                self.release(h)
            except errs as e:
                out.release_exc = e
        return out

    def close(self) -> None:
        for h in list(self.handles):
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                pass
        self.handles.clear()
        for d in list(self.dlists):
            try:
                self.agent.release_dlist_handle(d)
            except Exception:
                pass
        self.dlists.clear()
        for r in list(self.regs):
            try:
                self.agent.deregister_memory(r)
            except Exception:
                pass
        self.regs.clear()


def uring_diagnostics() -> str:
    """Ring counters of every io_uring fd of this process and the io_uring worker threads, for
    the message of a transfer that never completes."""
    keys = ("SqHead", "SqTail", "CachedSqHead", "CqHead", "CqTail", "CachedCqTail", "SQEs", "CQEs")
    out = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            if "io_uring" not in os.readlink(f"/proc/self/fd/{fd}"):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                head = f.read(4096).splitlines()
        except OSError:
            continue
        vals = dict(ln.split(":", 1) for ln in head if ln.split(":", 1)[0] in keys)
        out.append(f"io_uring fd {fd}: " + " ".join(f"{k}={v.strip()}" for k, v in vals.items()))
    workers = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        if comm.startswith("iou-"):
            key = f"{comm.split('-')[0]}-{comm.split('-')[1]}@{wchan or '-'}"
            workers[key] = workers.get(key, 0) + 1
    out.append(
        "io_uring threads (kind@wchan: count): "
        + (", ".join(f"{k}: {v}" for k, v in sorted(workers.items())) or "none")
    )
    return "\n".join(out)


def _triple(d):
    return (d[0], d[1], d[2] if len(d) > 2 else 0)


def make_agent(backend: str, params: dict | None = None, sync_mode=None, name: str = "iud"):
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = (
        nixl_agent_config(backends=[])
        if sync_mode is None
        else nixl_agent_config(backends=[], sync_mode=sync_mode)
    )
    agent = nixl_agent(unique_name(name), cfg)
    agent.create_backend(backend, default_params(backend) if params is None else params)
    return agent


# ---- checks for the round-trip tests (layouts: support.descriptors.mixed_layout) ----------


def expected_mem(layout: Layout, src: np.ndarray, background: np.ndarray) -> np.ndarray:
    out = background.copy()
    for s, m in zip(layout.sizes, layout.mem_off):
        out[m : m + s] = src[m : m + s]
    return out


def expected_file(layout: Layout, src: np.ndarray) -> np.ndarray:
    out = np.zeros(layout.file_size, np.uint8)
    for s, m, f in zip(layout.sizes, layout.mem_off, layout.file_off):
        out[f : f + s] = src[m : m + s]
    return out


def describe_mem_mismatch(layout: Layout, got: np.ndarray, want: np.ndarray) -> str:
    for i, (s, m) in enumerate(zip(layout.sizes, layout.mem_off)):
        if not np.array_equal(got[m : m + s], want[m : m + s]):
            return (
                f"descriptor {i} (size {s}, mem off {m}, file off {layout.file_off[i]}): "
                + first_diff(got[m : m + s], want[m : m + s])
            )
    return "outside any descriptor (gap overwritten): " + first_diff(got, want)
