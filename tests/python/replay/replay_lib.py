"""Shared pieces of the client replay tests (tests/python/replay/test_replay_*.py).

Each replay drives the plugin through NIXL's Python API with the exact sequence of agent calls
and the descriptor shapes of one client (vLLM, LMCache, Dynamo KVBM, nixlbench), as written down
in docs/clients.md. This module only holds what they share:

* ``Ledger``: unique per-chunk fill patterns (a counter hashed with a per-chunk seed; no byte is
  ever 0) and a byte-for-byte check that, on a mismatch, says what the wrong bytes are: zeros
  (never written), the poison the destination was filled with before a READ (never landed),
  another chunk's bytes (foreign / stale / shifted data) or garbage.
* ``Mem``: a memory region the replay can fill and read back, either DRAM (page-aligned mmap, the
  CPU stand-in) or VRAM (a torch CUDA tensor, for the GPU variants).
* ``wait``: the client's completion loop (poll ``check_xfer_state`` with its sleep).
"""

from __future__ import annotations

import hashlib
import os
import time

import iud_helpers as H
import numpy as np
import pytest

PLUGIN = H.PLUGIN
# The backend the replays drive: the plugin, or NIXL's POSIX with IUD_TEST_BACKEND=POSIX (which
# validates the replays themselves, DRAM/FILE only) -- what the clients use today.
BACKEND = H.test_backend()
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ONES = np.uint64(0x0101010101010101)


def _seed(key: str) -> np.uint64:
    return np.uint64(
        int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    )


def pattern(key: str, n: int, offset: int = 0) -> np.ndarray:
    """Bytes [offset, offset + n) of the fill stream of chunk ``key``: each 8-byte word is the
    word index plus seed(key), multiplied and xor-shifted (a bijection, so words never repeat
    within a stream and streams of different keys do not line up), with the low bit of every
    byte set, so no chunk is ever zeros and no byte is ever 0."""
    w0 = offset // 8
    w1 = (offset + n + 7) // 8
    with np.errstate(over="ignore"):
        x = np.arange(w0, w1, dtype=np.uint64)
        x += _seed(key)
        x *= _M1
        x ^= x >> np.uint64(29)
        x *= _M2
        x |= _ONES
    return x.view(np.uint8)[offset - w0 * 8 : offset - w0 * 8 + n]


class Ledger:
    """The chunks a replay wrote, by key, so a mismatch can be classified."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.sizes: dict[str, int] = {}
        self.poisons: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.scenario}/{name}"

    def make(self, name: str, n: int) -> np.ndarray:
        k = self.key(name)
        self.sizes[k] = max(n, self.sizes.get(k, 0))
        return pattern(k, n)

    def poison(self, name: str, n: int) -> np.ndarray:
        k = self.key("poison/" + name)
        self.sizes[k] = max(n, self.sizes.get(k, 0))
        self.poisons.add(k)
        return pattern(k, n)

    def check(self, got: np.ndarray, name: str, what: str, offset: int = 0) -> None:
        """got must equal bytes [offset, offset + len) of chunk ``name``."""
        want = pattern(self.key(name), got.size, offset)
        if not np.array_equal(got, want):
            raise AssertionError(f"{what}: {self.explain(got, self.key(name), want, offset)}")

    def check_untouched(self, got: np.ndarray, poison_name: str, offset: int, what: str) -> None:
        """got (bytes [offset, ...) of a poisoned destination) must still hold the poison."""
        want = pattern(self.key("poison/" + poison_name), got.size, offset)
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(
                f"{what}: {bad.size} bytes outside every descriptor were overwritten, first at "
                f"{int(bad[0])}: " + self._classify(got, int(bad[0]), offset, None)
            )

    def explain(self, got: np.ndarray, key: str, want: np.ndarray, offset: int) -> str:
        bad = np.flatnonzero(got != want)
        if bad.size == 0:
            return (
                "no difference on re-check (bytes changed while being compared: I/O still "
                "landing after DONE/release)"
            )
        i = int(bad[0])
        return (
            f"{bad.size} of {got.size} bytes differ from chunk {key} (first at byte {i}, "
            f"last at {int(bad[-1])}; got 0x{int(got[i]):02x}, expected "
            f"0x{int(want[i]):02x}); at the first difference: "
            + self._classify(got, i, offset, key)
        )

    def _classify(self, got: np.ndarray, i: int, offset: int, own: str | None) -> str:
        w = min(64, got.size - i)
        win = got[i : i + w]
        if not win.any():
            return "zeros (never written, or a hole in the file)"
        for k in sorted(self.sizes):
            if k in self.poisons and np.array_equal(win, pattern(k, w, offset + i)):
                return f"still the poison {k} (the READ did not land there)"
        for k, size in sorted(self.sizes.items()):
            if k == own or offset + i + w > size:
                continue
            if np.array_equal(win, pattern(k, w, offset + i)):
                return f"foreign bytes: chunk {k} at the same offset (wrong slot, stale or mixed-up data)"
        # Shifted data: search the first 8 bytes in the known chunks (only on failure; at most
        # 1 GiB of patterns is regenerated for the search).
        if w >= 8:
            budget = GiB
            for k, size in sorted(self.sizes.items()):
                if size > budget:
                    continue
                budget -= size
                full = pattern(k, size)
                cand = np.flatnonzero(full[: size - w + 1] == win[0])
                for j in range(1, 8):
                    cand = cand[full[cand + j] == win[j]]
                for h in cand[:64]:
                    h = int(h)
                    if np.array_equal(full[h : h + w], win):
                        return (
                            f"bytes of chunk {k} from its offset {h} (expected offset "
                            f"{offset + i}): misplaced or shifted data"
                        )
        return "garbage (matches no chunk, poison or zeros)"


# ---- memory regions ------------------------------------------------------------------------


def torch_cuda():
    """torch with a CUDA device, or skip with one line saying why."""
    try:
        import torch
    except ImportError:
        pytest.skip("VRAM variant: PyTorch is not installed (runs on the GPU machine)")
    if not torch.cuda.is_available():
        pytest.skip("VRAM variant: torch.cuda.is_available() is False (runs on the GPU machine)")
    return torch


class Mem:
    """One allocation the replay registers: DRAM (mmap, page aligned) or VRAM (torch CUDA)."""

    def __init__(self, kind: str, size: int):
        self.kind = kind
        self.size = size
        if kind == "DRAM":
            self._buf = H.Buf(size)
            self.addr = self._buf.addr
            self.dev = 0
        elif kind == "VRAM":
            torch = torch_cuda()
            self._t = torch.empty(size, dtype=torch.uint8, device="cuda")
            self.addr = self._t.data_ptr()
            self.dev = self._t.get_device()
        else:
            raise ValueError(kind)

    def write(self, off: int, data: np.ndarray) -> None:
        if self.kind == "DRAM":
            self._buf.arr[off : off + data.size] = data
        else:
            import torch

            self._t[off : off + data.size].copy_(torch.from_numpy(data))

    def read(self, off: int, n: int) -> np.ndarray:
        if self.kind == "DRAM":
            return self._buf.arr[off : off + n].copy()
        import torch

        torch.cuda.synchronize()
        return self._t[off : off + n].cpu().numpy()


def mem_kinds():
    """pytest params: DRAM (CPU, stands in for VRAM) and VRAM (GPU machine only)."""
    return [pytest.param("DRAM", id="dram"), pytest.param("VRAM", id="vram")]


# ---- files -----------------------------------------------------------------------------------


def file_bytes(path_or_fd, off: int, n: int) -> np.ndarray:
    """Buffered read of [off, off + n) (an fd is reopened through /proc, so O_DIRECT fds work)."""
    path = f"/proc/self/fd/{path_or_fd}" if isinstance(path_or_fd, int) else path_or_fd
    with open(path, "rb", buffering=0) as f:
        f.seek(off)
        data = f.read(n)
    return np.frombuffer(data, dtype=np.uint8)


def pwrite_all(fd: int, data: np.ndarray, off: int) -> None:
    """Write through a page-aligned bounce buffer (works for O_DIRECT fds when off/len align)."""
    buf = H.Buf(max(data.size, 1))
    buf.arr[: data.size] = data
    view = memoryview(buf.arr)[: data.size]
    done = 0
    while done < data.size:
        done += os.pwrite(fd, view[done:], off + done)


def direct_supported(directory: str) -> bool:
    try:
        fd = os.open(
            os.path.join(directory, ".odirect-probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644
        )
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(directory, ".odirect-probe"))
    return True


# ---- completion ------------------------------------------------------------------------------


def wait(agent, handle, state: str, sleep_s: float, timeout: float = 120.0) -> str:
    """A client's completion loop: check_xfer_state until DONE or ERR, sleeping sleep_s between
    checks (0 = vLLM's per-engine-step poll). nixlBackendError propagates, as in the clients."""
    deadline = time.monotonic() + timeout
    while state not in ("DONE", "ERR"):
        if time.monotonic() > deadline:
            raise AssertionError(f"transfer still {state} after {timeout:.0f} s")
        if sleep_s:
            time.sleep(sleep_s)
        state = agent.check_xfer_state(handle)
    return state


def no_plugin_errors(log, what: str) -> None:
    """A replay that succeeded must not have logged plugin ERROR lines."""
    errs = H.plugin_error_lines(log())
    assert not errs, f"{what} succeeded but the plugin logged errors: {errs}"
