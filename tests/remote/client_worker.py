"""A client process for the remote tests: runs on host B, driven by JSON lines on stdin.

Each command line gets exactly one JSON answer line on stdout (events such as "submitted" come
before it, marked with "event"). Data is verified byte for byte here: the worker reads the
expected bytes straight from the export's path (the two namespaces share the filesystem; the
client library never does), so a wrong, stale or missing byte fails the command.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import traceback

import numpy as np
from nixl_io_uring_dmabuf.storage_node import StorageClient, StorageError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support
from support.descriptors import scattered_blocks  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BUF = 64 * MiB


def say(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def file_size(path: str) -> int:
    """Size of a file or block device (getsize says 0 for a device)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


class HostBuf:
    """The client's destination/source memory in DRAM (an anonymous mmap)."""

    mem = "DRAM"

    def __init__(self, size):
        self.mm = mmap.mmap(-1, size)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = self.arr.ctypes.data

    def get(self, addr, ln):
        o = addr - self.base
        return self.arr[o : o + ln]

    def put(self, off, data):
        self.arr[off : off + len(data)] = data

    def fill(self, off, ln, byte):
        self.arr[off : off + ln] = byte


class CudaBuf:
    """The same in VRAM (a torch CUDA tensor on GPU 0); reads copy back to the host to compare."""

    mem = "VRAM"

    def __init__(self, size):
        import torch

        self.torch = torch
        self.t = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        self.base = self.t.data_ptr()

    def get(self, addr, ln):
        o = addr - self.base
        return self.t[o : o + ln].cpu().numpy()

    def put(self, off, data):
        self.t[off : off + len(data)].copy_(self.torch.from_numpy(np.ascontiguousarray(data)))
        self.torch.cuda.synchronize()

    def fill(self, off, ln, byte):
        self.t[off : off + ln].fill_(byte)
        self.torch.cuda.synchronize()  # the poison must land before the node's bytes do


class Worker:
    def __init__(self):
        self.c = None
        self.b = None

    @property
    def base(self):
        return self.b.base

    def view(self, addr, ln):
        return self.b.get(addr, ln)

    def connect(self, node, addr=None, timeout=30.0, ping=0.5, mem="DRAM"):
        self.b = HostBuf(BUF) if mem == "DRAM" else CudaBuf(BUF)
        self.c = StorageClient(
            node, node_addr=tuple(addr) if addr else None, timeout=timeout, ping_interval=ping
        )
        self.c.register(self.base, BUF, mem=self.b.mem, dev=0)
        return {"name": self.c.name}

    def new_buffer(self, size=BUF):
        """Register another buffer after the first requests (the node must learn it: republished
        metadata) and use it from now on."""
        self.old = getattr(self, "old", []) + [self.b]
        self.b = HostBuf(size) if self.b.mem == "DRAM" else CudaBuf(size)
        self.c.register(self.base, size, mem=self.b.mem, dev=0)
        return {}

    def read_verify(self, file, path, seed, lo=64 * KiB, hi=2 * MiB, budget=BUF, rounds=1):
        size = file_size(path)
        rng = np.random.default_rng(seed)
        total = 0
        for _ in range(rounds):
            blocks = scattered_blocks(rng, size, lo, hi, budget, self.base)
            self.b.fill(0, budget, 0xA5)  # poison: a block that does not land shows up
            n = self.c.read([(file, f, ln, a) for f, ln, a in blocks], mem=self.b.mem)
            with open(path, "rb") as fh:
                for i, (f, ln, a) in enumerate(blocks):
                    want = np.frombuffer(os.pread(fh.fileno(), ln, f), dtype=np.uint8)
                    got = self.view(a, ln)
                    if not np.array_equal(want, got):
                        bad = int(np.argmax(want != got))
                        return {
                            "ok": False,
                            "error": f"block {i} (file offset {f}, {ln} B): first wrong byte at +{bad}: "
                            f"got {int(got[bad])} want {int(want[bad])}",
                        }
            if n != sum(ln for _, ln, _ in blocks):
                return {
                    "ok": False,
                    "error": f"node reported {n} bytes for {sum(ln for _, ln, _ in blocks)}",
                }
            total += n
        return {"ok": True, "bytes": total, "blocks": len(blocks)}

    def write_verify(self, file, path, seed, start, length, lo=64 * KiB, hi=2 * MiB):
        """Write random blocks into [start, start+length) of the export, check the file, read back."""
        rng = np.random.default_rng(seed)
        half = BUF // 2
        blocks, used, off = [], 0, start
        while True:
            ln = int(rng.integers(lo // 4096, hi // 4096 + 1)) * 4096
            if used + ln > half or off + ln > start + length:
                break
            blocks.append((off, ln, self.base + used))
            off += ln + int(rng.integers(0, 4)) * 4096  # scattered: gaps between blocks
            used += ln
        self.b.put(0, np.frombuffer(rng.bytes(used), dtype=np.uint8))
        n = self.c.write([(file, f, ln, a) for f, ln, a in blocks], mem=self.b.mem)
        with open(path, "rb") as fh:
            for i, (f, ln, a) in enumerate(blocks):
                if os.pread(fh.fileno(), ln, f) != self.view(a, ln).tobytes():
                    return {
                        "ok": False,
                        "error": f"after WRITE, file bytes of block {i} (offset {f}) differ",
                    }
        # Read back through the node into the other half.
        back = [(f, ln, a + half) for f, ln, a in blocks]
        self.b.fill(half, used, 0x5A)
        self.c.read([(file, f, ln, a) for f, ln, a in back], mem=self.b.mem)
        for i, ((f, ln, a), (_, _, b)) in enumerate(zip(blocks, back)):
            if not np.array_equal(self.view(a, ln), self.view(b, ln)):
                return {"ok": False, "error": f"read-back of block {i} (offset {f}) differs"}
        return {"ok": True, "bytes": n, "blocks": len(blocks)}

    def big_read(self, file, path, total, block=1 * MiB, timeout=60.0):
        """One long READ (blocks cycle over the file and the buffer); reports how it ended."""
        size = file_size(path)
        nb = total // block
        blocks = [
            (
                file,
                (i * block) % (size - block + 1) // 4096 * 4096,
                block,
                self.base + (i * block) % (BUF - block + 1) // 4096 * 4096,
            )
            for i in range(nb)
        ]
        t0 = time.monotonic()
        p = self.c.submit("READ", blocks, mem=self.b.mem, timeout=timeout)
        say({"event": "submitted", "id": p.req_id})
        try:
            n = p.wait()
            return {"ok": True, "bytes": n, "elapsed": time.monotonic() - t0}
        except StorageError as e:
            return {
                "ok": False,
                "type": type(e).__name__,
                "error": str(e),
                "elapsed": time.monotonic() - t0,
            }

    def retry_read_verify(self, file, path, seed, within=60.0, **kw):
        """read_verify until it succeeds (a node being restarted); reports the failures seen."""
        deadline = time.monotonic() + within
        failures = []
        while True:
            try:
                r = self.read_verify(file, path, seed, **kw)
                r["failures_before"] = failures
                return r
            except StorageError as e:
                failures.append(f"{type(e).__name__}: {e}")
                if time.monotonic() > deadline:
                    return {
                        "ok": False,
                        "error": f"no successful read within {within:.0f} s",
                        "failures": failures[-5:],
                    }
                time.sleep(0.5)

    def stats(self):
        return self.c.stats()

    def close(self):
        if self.c:
            self.c.close()
            self.c = None
        return {}


def main():
    w = Worker()
    say({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "quit":
            w.close()
            say({"ok": True})
            return
        try:
            r = getattr(w, name)(**cmd)
            r.setdefault("ok", True)
        except StorageError as e:
            r = {"ok": False, "type": type(e).__name__, "error": str(e)}
        except Exception as e:
            r = {"ok": False, "type": type(e).__name__, "error": traceback.format_exc()}
        say(r)


if __name__ == "__main__":
    main()
