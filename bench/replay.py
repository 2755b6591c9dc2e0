"""Replays an I/O pattern recorded by the plugin's recording mode (backend parameter `record` or
env IO_URING_DMABUF_RECORD) through the real NIXL runtime, on any backend, and reports the time.

The recording holds every registration and every prepared request with both descriptor lists.
The replay allocates host buffers of the recorded sizes (random data; VRAM is replayed as DRAM
unless --vram and torch.cuda are available), creates scratch files sized to what the recording
touches (fd mode and path mode alike), rebuilds each request with addresses translated into the
new buffers, and posts it as many times as it was posted.

Usage: python3 bench/replay.py RECORDING.jsonl [--backend IO_URING_DMABUF[:k=v;...]] [--dir /tmp]
"""

import argparse
import ctypes
import json
import mmap
import os
import sys
import time

from nixl._api import nixl_agent, nixl_agent_config

KINDS = {"DRAM_SEG": "DRAM", "VRAM_SEG": "VRAM", "FILE_SEG": "FILE", "BLK_SEG": "BLOCK"}


def load(path):
    regs, preps, posts = {}, {}, {}
    for line in open(path):
        e = json.loads(line)
        if e["event"] == "register":
            regs[e["md"]] = e
        elif e["event"] == "prep":
            preps[e["req"]] = e
        elif e["event"] == "post":
            posts[e["req"]] = posts.get(e["req"], 0) + 1
    return regs, preps, posts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recording")
    ap.add_argument("--backend", default="IO_URING_DMABUF")
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    name, _, kv = args.backend.partition(":")
    params = dict(p.split("=", 1) for p in kv.split(";") if p)
    regs, preps, posts = load(args.recording)
    agent = nixl_agent(f"replay-{os.getpid()}", nixl_agent_config(backends=[]))
    agent.create_backend(name, params)

    # Memory: one new buffer per recorded memory registration.
    new_mem = {}  # md -> (old base, new base, buffer)
    files = {}  # (kind, dev_id) -> (fd, path, size needed)
    for md, r in regs.items():
        if r["kind"] in ("DRAM_SEG", "VRAM_SEG"):
            buf = mmap.mmap(-1, max(r["len"], 1))
            chunk = os.urandom(1 << 20)
            while buf.tell() < len(buf):
                buf.write(chunk[: len(buf) - buf.tell()])
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            new_mem[md] = (r["addr"], addr, buf)
        else:
            end = r["addr"] + r["len"]
            key = (r["kind"], r["dev_id"])
            old = files.get(key)
            files[key] = (None, None, max(end, old[2] if old else 0), r["meta"])
    for key, (_, _, size, meta) in list(files.items()):
        path = os.path.join(args.dir, f"iud-replay-{os.getpid()}-{key[1]}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, size)
        files[key] = (fd, path, size, meta)
    reg_handles = []
    for md, (_old, new, _buf) in new_mem.items():
        r = regs[md]
        reg_handles.append(agent.register_memory([(new, r["len"], 0, "")], "DRAM"))
    for (kind, _dev), (fd, _path, size, _meta) in files.items():
        reg_handles.append(agent.register_memory([(0, size, fd, "")], KINDS[kind]))

    def translate_local(addr, length):
        for md, (old, new, _) in new_mem.items():
            r = regs[md]
            if old <= addr and addr + length <= old + r["len"]:
                return new + (addr - old)
        raise SystemExit(
            f"recording names memory 0x{addr:x}+{length} outside every recorded registration"
        )

    total_bytes, total_ios, t_all = 0, 0, 0.0
    for req, p in preps.items():
        local = agent.get_xfer_descs(
            [(translate_local(a, n), n, 0) for a, n, _ in p["local"]], "DRAM"
        )
        remote = agent.get_xfer_descs(
            [(a, n, files[(p["remote_kind"], d)][0]) for a, n, d in p["remote"]],
            KINDS[p["remote_kind"]],
        )
        h = agent.initialize_xfer(p["op"], local, remote, agent.name, backends=[name])
        for _ in range(max(1, posts.get(req, 1))):
            t = time.perf_counter()
            s = agent.transfer(h)
            while s == "PROC":
                s = agent.check_xfer_state(h)
            t_all += time.perf_counter() - t
            if s != "DONE":
                raise SystemExit(f"request {req} ({p['op']}) ended in {s}")
            total_bytes += p["bytes"]
            total_ios += p["count"]
        agent.release_xfer_handle(h)
    print(
        f"replayed {len(preps)} requests, {total_ios} descriptors, {total_bytes} bytes on {args.backend}: "
        f"{t_all * 1e3:.1f} ms in transfers, {total_bytes / max(t_all, 1e-9) / 1e9:.2f} GB/s, {total_ios / max(t_all, 1e-9) / 1e3:.1f} k descriptors/s"
    )
    for h in reg_handles:
        agent.deregister_memory(h)
    for fd, path, _, _ in files.values():
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
