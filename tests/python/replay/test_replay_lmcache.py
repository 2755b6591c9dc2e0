"""Replays of LMCache's NIXL storage backends (reference: nixl-clients.md §2.1, §2.2).

In-process NixlStorageBackend (agent "NixlAgent_<uuid>", backends=[], progress thread on,
sync mode STRICT; nixl_backend_params passed verbatim to create_backend; the chunk buffer
registered as one descriptor per chunk and prepped with agent name ""):
  * static pool: pool_size O_CREAT files (never truncated, registered (0, chunk, fd, "") before
    they hold data), prepped with the own agent name; put/get batches are one make_prepped_xfer
    each, polled every 1 ms; eviction returns slots to the pool, so slots are rewritten with
    other keys' chunks (stale data would show as foreign bytes).
  * dynamic (pool_size 0): per batch open <path>/<url-quoted key> (O_CREAT|O_RDWR for puts,
    O_RDONLY for gets), register, get_xfer_descs, prep with the own name, transfer, poll,
    release, deregister, close; async puts (nixl_async_put) stay in flight while gets open new
    fds from another thread, so fd numbers are reused between registrations. Failure cases: a
    missing file is a miss before NIXL is called; a truncated file makes the transfer fail cleanly
    (nixlBackendError, which LMCache turns into a miss) and leaves the agent usable; a write that
    fails at I/O time (file size limit, in a child process) fails cleanly and the client unlinks
    the file.
Multi-process L2 adapters (own keys file_path, use_direct_io, file_size, shard_dirs,
max_capacity_gb in the backend params; L1 arena = one DRAM registration, every page prepped):
  * nixl_store: pool_size files of file_size (several page slots each), a store flattens all
    objects of a batch into one make_prepped_xfer (NIXL merges consecutive pages), polled every
    10 ms from asyncio; deletes free slots, later stores reuse them out of order.
  * nixl_store_dynamic: one file per object key (optionally in 2-level shard dirs): temp file
    O_TRUNC -> register whole object -> WRITE -> deregister -> close -> rename; loads reopen the
    final file O_RDWR. Many stores/loads run concurrently as asyncio tasks.

DRAM stands in for the LMCache cuda buffer on CPU; the VRAM variant of the static pool runs on
the GPU machine with the real Llama-3.2-1B chunk size (8 MiB).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import quote as url_quote

import iud_helpers as H
import pytest
import replay_lib as R
from replay_lib import PLUGIN, KiB


def _nixl():
    import nixl._bindings as nixlBind
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixlBind


def _chunk_bytes(kind: str) -> int:
    # One LMCache chunk = 256 tokens x layers x 2 x kv_heads x head_dim x bf16.
    if kind == "VRAM":
        return 256 * 16 * 2 * 8 * 64 * 2  # Llama-3.2-1B: 8 MiB
    return 256 * 4 * 2 * 2 * 64 * 2  # a 4-layer toy model: 512 KiB


class InProcessAgent:
    """NixlStorageAgent: agent creation and init_mem_handlers."""

    def __init__(self, kind: str, buffer: R.Mem, page: int, backend_params: dict):
        nixl_agent, nixl_agent_config, sync_t, _ = _nixl()
        self.kind, self.page = kind, page
        self.agent_name = "NixlAgent_" + str(uuid.uuid4())
        conf = nixl_agent_config(
            backends=[], enable_prog_thread=True, sync_mode=sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = nixl_agent(self.agent_name, conf)
        self.agent.create_backend(R.BACKEND, backend_params)
        dev = buffer.dev
        addrs = range(buffer.addr, buffer.addr + buffer.size, page)
        self.mem_reg = self.agent.register_memory(
            [(a, page, dev, "") for a in addrs], mem_type=kind
        )
        xfer = self.agent.get_xfer_descs([(a, page, dev) for a in addrs], mem_type=kind)
        self.mem_handle = self.agent.prep_xfer_dlist("", xfer, mem_type=kind)

    def post_blocking(self, handle) -> None:
        state = self.agent.transfer(handle)
        while state != "DONE" and state != "ERR":
            state = self.agent.check_xfer_state(handle)  # nixlBackendError propagates
            if state != "DONE" and state != "ERR":
                time.sleep(0.001)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")


class Pages:
    """The paged allocator of the chunk buffer: a free list of page indices."""

    def __init__(self, buffer: R.Mem, page: int, rng):
        self.buffer, self.page = buffer, page
        self.free = [int(i) for i in rng.permutation(buffer.size // page)]
        self.lock = threading.Lock()

    def alloc(self, n):
        with self.lock:
            out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "chunk buffer exhausted"
        return out

    def release(self, pages):
        with self.lock:
            self.free.extend(pages)

    def write(self, idx, data):
        self.buffer.write(idx * self.page, data)

    def read(self, idx):
        return self.buffer.read(idx * self.page, self.page)


def _key(i: int, rng) -> str:
    # CacheEngineKey.to_string(): fmt@model@world_size@worker_id@chunk_hash
    return f"vllm@meta-llama/Llama-3.2-1B@1@0@{int(rng.integers(1 << 62)):x}{i:04x}"


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("kind", R.mem_kinds())
def test_static_pool(kind, direct, plugin_so, tmp_path, rng, stderr_log):
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    page = _chunk_bytes(kind)
    n_pages, pool_size = 32, 24
    ledger = R.Ledger(f"lmcache-static-{kind}-{direct}")
    buffer = R.Mem(kind, n_pages * page)
    # nixl_backend_params as a user copies them from LMCache's POSIX example: passed verbatim.
    lm = InProcessAgent(kind, buffer, page, {"use_uring": "true"})
    pages = Pages(buffer, page, rng)

    # NixlFilePool
    path = str(tmp_path / "nixl-cache")
    os.makedirs(path, exist_ok=True)
    flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0)
    fds = []
    for i in reversed(range(pool_size)):
        fds.append(
            os.open(os.path.join(path, f"obj_{i}_{uuid.uuid4().hex[0:4]}.bin"), flags, 0o644)
        )
    free_slots = list(reversed(range(pool_size)))  # pop() hands out 0, 1, 2, ...
    # init_storage_handlers_file: the files are empty; each is registered for one chunk.
    storage_reg = lm.agent.register_memory([(0, page, fd, "") for fd in fds], mem_type="FILE")
    lm.agent.get_xfer_descs([(0, page, fd) for fd in fds], mem_type="FILE")
    storage_handle = lm.agent.prep_xfer_dlist(
        lm.agent_name, [(0, page, fd) for fd in fds], mem_type="FILE"
    )
    where: dict[str, int] = {}  # key -> pool slot

    def put(keys):
        mem = pages.alloc(len(keys))
        for k, p in zip(keys, mem):
            pages.write(p, ledger.make(k, page))
        slots = [free_slots.pop() for _ in keys]
        h = lm.agent.make_prepped_xfer("WRITE", lm.mem_handle, mem, storage_handle, slots)
        lm.post_blocking(h)
        lm.agent.release_xfer_handle(h)
        pages.release(mem)
        where.update(zip(keys, slots))

    def get(keys):
        mem = pages.alloc(len(keys))
        for p in mem:
            pages.write(p, ledger.poison(f"page{p}", page))
        h = lm.agent.make_prepped_xfer(
            "READ", lm.mem_handle, mem, storage_handle, [where[k] for k in keys]
        )
        lm.post_blocking(h)
        lm.agent.release_xfer_handle(h)
        for k, p in zip(keys, mem):
            ledger.check(pages.read(p), k, f"get of {k} (slot {where[k]}) into page {p}")
        pages.release(mem)

    def evict(keys):
        for k in keys:
            free_slots.append(where.pop(k))  # no file I/O: the slot is just reused

    serial = 0
    for rnd in range(3):
        live = list(where)
        n_new = len(free_slots)
        new = [_key(serial + i, rng) for i in range(n_new)]
        serial += n_new
        for i in range(0, n_new, 8):  # batches of up to 8 chunks
            put(new[i : i + 8])
        live += new
        order = [live[int(i)] for i in rng.permutation(len(live))]
        for i in range(0, len(order), 6):
            get(order[i : i + 6])
        evict(order[: pool_size // 2 + rnd])

    # Every slot file holds exactly the chunk of the key that owns it.
    for k, slot in where.items():
        got = R.file_bytes(fds[slot], 0, page + 1)
        assert got.size == page, f"slot {slot} file is {got.size} bytes, expected {page}"
        ledger.check(got, k, f"file of slot {slot} ({k})")

    # close(): release both prepped lists, deregister storage and memory, close the pool.
    lm.agent.release_dlist_handle(storage_handle)
    lm.agent.release_dlist_handle(lm.mem_handle)
    lm.agent.deregister_memory(storage_reg)
    lm.agent.deregister_memory(lm.mem_reg)
    for fd in fds:
        os.close(fd)
    R.no_plugin_errors(stderr_log, f"LMCache static pool replay ({kind}, direct={direct})")


# ---- in-process dynamic mode -----------------------------------------------------------------


class DynamicBackend:
    """NixlDynamicStorageBackend (FILE) put/get, with NixlDynamicStorageAgent's handlers."""

    def __init__(self, lm: InProcessAgent, pages: Pages, path: str, direct: bool, ledger):
        self.lm, self.pages, self.path, self.ledger = lm, pages, path, ledger
        self.direct_flag = os.O_DIRECT if direct else 0
        self.misses = 0

    def path_of(self, key: str) -> str:
        flat = key.replace("/", "_").replace("@", "_")
        return os.path.join(self.path, url_quote(flat, safe=""))

    def acquire(self, keys, mem, write: bool):
        """_build_descs + create_batched_storage_handler + make_prepped_xfer."""
        a = self.lm.agent
        flags = ((os.O_CREAT | os.O_RDWR) if write else os.O_RDONLY) | self.direct_flag
        mode = (0o644,) if write else ()
        fds, paths = [], []
        try:
            for k in keys:
                p = self.path_of(k)
                fds.append(os.open(p, flags, *mode))
                paths.append(p)
        except OSError:
            for fd in fds:
                os.close(fd)
            if write:
                for p in paths:
                    os.unlink(p)
            raise
        page = self.pages.page
        reg = a.register_memory([(0, page, fd, "") for fd in fds], "FILE")
        xfer_descs = a.get_xfer_descs([(0, page, fd) for fd in fds], "FILE")
        handler = a.prep_xfer_dlist(self.lm.agent_name, xfer_descs, mem_type="FILE")
        h = a.make_prepped_xfer(
            "WRITE" if write else "READ", self.lm.mem_handle, mem, handler, list(range(len(keys)))
        )
        return fds, paths, reg, handler, h

    def release_storage(self, reg, handler, fds):
        self.lm.agent.release_dlist_handle(handler)
        self.lm.agent.deregister_memory(reg)
        for fd in fds:
            os.close(fd)

    def put_sync(self, keys):
        mem = self.pages.alloc(len(keys))
        for k, p in zip(keys, mem):
            self.pages.write(p, self.ledger.make(k, self.pages.page))
        fds, paths, reg, handler, h = self.acquire(keys, mem, True)
        try:
            self.lm.post_blocking(h)
        except Exception:
            for p in paths:
                os.unlink(p)
            raise
        finally:
            self.lm.agent.release_xfer_handle(h)
            self.release_storage(reg, handler, fds)
            self.pages.release(mem)

    async def put_async(self, keys):
        """nixl_async_put: post, then a task polls every 1 ms and cleans up."""
        mem = self.pages.alloc(len(keys))
        for k, p in zip(keys, mem):
            self.pages.write(p, self.ledger.make(k, self.pages.page))
        fds, paths, reg, handler, h = self.acquire(keys, mem, True)
        state = self.lm.agent.transfer(h)
        try:
            while state != "DONE" and state != "ERR":
                state = self.lm.agent.check_xfer_state(h)
                await asyncio.sleep(0.001)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
        finally:
            self.lm.agent.release_xfer_handle(h)
            self.release_storage(reg, handler, fds)
            if state != "DONE":
                for p in paths:
                    os.unlink(p)
            self.pages.release(mem)

    def get(self, keys):
        """storage_to_mem: returns the pages (or None for a miss); a miss has no NIXL call."""
        _, _, _, nixlBind = _nixl()
        mem = self.pages.alloc(len(keys))
        for p in mem:
            self.pages.write(p, self.ledger.poison(f"page{p}", self.pages.page))
        try:
            fds, paths, reg, handler, h = self.acquire(keys, mem, False)
        except FileNotFoundError:
            self.pages.release(mem)
            self.misses += 1
            return None
        try:
            try:
                self.lm.post_blocking(h)
                ok = True
            except nixlBind.nixlBackendError:
                ok = False  # "Batch Transfer failed": treated as a miss
            finally:
                self.lm.agent.release_xfer_handle(h)
                self.release_storage(reg, handler, fds)
        except Exception:
            self.pages.release(mem)
            raise
        if not ok:
            self.pages.release(mem)
            self.misses += 1
            return None
        return mem

    def check(self, keys, mem):
        for k, p in zip(keys, mem):
            self.ledger.check(self.pages.read(p), k, f"dynamic get of {k} into page {p}")
        self.pages.release(mem)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_dynamic_mode(direct, plugin_so, tmp_path, rng, stderr_log):
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    page = _chunk_bytes("DRAM")
    ledger = R.Ledger(f"lmcache-dynamic-{direct}")
    buffer = R.Mem("DRAM", 48 * page)
    lm = InProcessAgent("DRAM", buffer, page, {})
    pages = Pages(buffer, page, rng)
    path = str(tmp_path / "nixl-dyn")
    os.makedirs(path)
    be = DynamicBackend(lm, pages, path, direct, ledger)

    keys = [_key(i, rng) for i in range(40)]
    # Synchronous puts in batches of 4, then async puts overlapping with gets (fd reuse).
    for i in range(0, 16, 4):
        be.put_sync(keys[i : i + 4])

    # The async puts run as tasks of LMCache's event loop thread; the gets come from the
    # caller's thread at the same time (NIXL sync mode STRICT serializes the agent calls).
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        futs = [
            asyncio.run_coroutine_threadsafe(be.put_async(keys[i : i + 3]), loop)
            for i in range(16, 40, 3)
        ]
        got = []
        for i in range(0, 16, 4):  # gets of stored keys while the puts are in flight
            mem = be.get(keys[i : i + 4])
            assert mem is not None, f"get of stored keys {keys[i : i + 4]} missed"
            got.append((keys[i : i + 4], mem))
        for f in futs:
            f.result(timeout=120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()
    for ks, mem in got:
        be.check(ks, mem)
    for i in rng.permutation(40)[:24].reshape(-1, 4):
        ks = [keys[int(j)] for j in i]
        mem = be.get(ks)
        assert mem is not None, f"get of stored keys {ks} missed"
        be.check(ks, mem)
    for k in keys:
        ledger.check(R.file_bytes(be.path_of(k), 0, page), k, f"file of {k}")
        assert os.path.getsize(be.path_of(k)) == page
    log_ok = stderr_log()
    assert not H.plugin_error_lines(log_ok), f"successful dynamic replay logged {log_ok}"

    # Missing file in a batch: the client's open() raises FileNotFoundError -> the whole batch
    # is a miss, no NIXL call is made, the agent is untouched.
    assert be.get([keys[0], "vllm@never-stored@1@0@dead"]) is None
    # A truncated file (a writer died after O_CREAT): the READ must fail cleanly
    # (nixlBackendError -> miss), and release/deregister/close must still work.
    short = _key(999, rng)
    with open(be.path_of(short), "wb") as f:
        f.write(ledger.make(short, page)[: page // 3].tobytes())
    assert be.get([keys[1], short]) is None, "a READ past the end of a file succeeded"
    errs = H.plugin_error_lines(stderr_log())
    if R.BACKEND == PLUGIN:
        assert len(errs) == 1 and "end of file" in errs[0], (
            f"the failed READ should log one plugin error naming end of file, got {errs}"
        )
    assert be.misses == 2
    # The agent is still usable afterwards.
    mem = be.get(keys[2:6])
    assert mem is not None
    be.check(keys[2:6], mem)

    lm.agent.release_dlist_handle(lm.mem_handle)
    lm.agent.deregister_memory(lm.mem_reg)
    R.no_plugin_errors(stderr_log, "LMCache dynamic replay after the failure cases")


# A put whose write fails at I/O time: run in a child process with RLIMIT_FSIZE lowered (EFBIG
# on the second half of each chunk), so the failure comes from the kernel, not from validation.
_WRITE_FAILURE_CHILD = r"""
import json, mmap, os, resource, signal, sys, time, uuid
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
import nixl._bindings as nixlBind
plugin, path, page, direct = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
sys.path[:0] = sys.argv[5:]
import replay_lib
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
name = "NixlAgent_" + str(uuid.uuid4())
agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=True,
                                           sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
agent.create_backend(plugin, {})
n = 4
mm = mmap.mmap(-1, n * page)
buf = np.frombuffer(mm, np.uint8)
for i in range(n):
    buf[i * page:(i + 1) * page] = replay_lib.pattern(f"lmcache-write-failure/chunk{i}", page)
base = buf.ctypes.data
mem_reg = agent.register_memory([(base + i * page, page, 0, "") for i in range(n)], "DRAM")
mem_h = agent.prep_xfer_dlist("", agent.get_xfer_descs([(base + i * page, page, 0) for i in range(n)], "DRAM"), "DRAM")
def put(keys, limit):
    flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0)
    paths = [os.path.join(path, k) for k in keys]
    fds = [os.open(p, flags, 0o644) for p in paths]
    reg = agent.register_memory([(0, page, fd, "") for fd in fds], "FILE")
    xh = agent.prep_xfer_dlist(name, agent.get_xfer_descs([(0, page, fd) for fd in fds], "FILE"), mem_type="FILE")
    h = agent.make_prepped_xfer("WRITE", mem_h, list(range(len(keys))), xh, list(range(len(keys))))
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    err = None
    try:
        state = agent.transfer(h)
        while state != "DONE" and state != "ERR":
            state = agent.check_xfer_state(h)
            if state != "DONE" and state != "ERR":
                time.sleep(0.001)
        if state == "ERR":
            err = "state ERR"
    except nixlBind.nixlBackendError as e:
        err = type(e).__name__ + ": " + str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        agent.release_xfer_handle(h)
        agent.release_dlist_handle(xh)
        agent.deregister_memory(reg)
        for fd in fds:
            os.close(fd)
    if err:
        for p in paths:
            os.unlink(p)           # _unlink_file_descs
    return err, [p for p in paths if os.path.exists(p)]
err, left = put(["k0", "k1", "k2"], page // 2)
err2, left2 = put(["k3", "k4"], 0)
sizes = [os.path.getsize(p) for p in left2]
ok = all(open(p, "rb").read() == buf[i * page:(i + 1) * page].tobytes() for i, p in enumerate(left2))
agent.release_dlist_handle(mem_h)
agent.deregister_memory(mem_reg)
print("RESULT " + json.dumps({"err": err, "left": left, "err2": err2, "sizes": sizes, "ok": ok}))
"""


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_dynamic_put_write_failure_is_clean(direct, plugin_so, tmp_path):
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    page = _chunk_bytes("DRAM")
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _WRITE_FAILURE_CHILD,
            R.BACKEND,
            str(tmp_path),
            str(page),
            "1" if direct else "0",
            os.path.dirname(R.__file__),
            os.path.dirname(H.__file__),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (
        f"child exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    )
    res = json.loads(lines[-1][7:])
    assert res["err"] and "nixlBackendError" in res["err"], (
        f"a put that hits EFBIG must fail with nixlBackendError, got {res['err']!r}"
    )
    assert res["left"] == [], f"client unlink left files behind: {res['left']}"
    errs = H.plugin_error_lines(p.stderr)
    if R.BACKEND == PLUGIN:
        assert any("EFBIG" in e for e in errs), (
            f"the failed write should be logged naming EFBIG, got {errs}\n{p.stderr[-2000:]}"
        )
    assert res["err2"] is None and res["ok"] and res["sizes"] == [page, page], (
        f"the next put after the failure did not work: {res}"
    )


# ---- multi-process L2 adapters ---------------------------------------------------------------


class MPAgent:
    """NixlStorageAgent / DynamicNixlStorageAgent of the MP L2 adapters: backend params carry
    the adapter's own keys; the L1 arena is one registration, every page prepped with ""."""

    def __init__(self, prefix: str, arena: R.Mem, page: int, params: dict, telemetry=False):
        nixl_agent, nixl_agent_config, _, _ = _nixl()
        self.agent_name = prefix + str(uuid.uuid4())
        # capture_telemetry is the one addition to LMCache's config: it lets the test see the
        # descriptor count after NIXL's merging (descCount).
        self.agent = nixl_agent(
            self.agent_name, nixl_agent_config(backends=[], capture_telemetry=telemetry)
        )
        self.agent.create_backend(R.BACKEND, params)
        self.page = page
        self.arena = arena
        self.mem_reg = self.agent.register_memory(
            [(arena.addr, arena.size, 0, "")], mem_type="DRAM"
        )
        xfer = self.agent.get_xfer_descs(
            [(a, page, 0) for a in range(arena.addr, arena.addr + arena.size, page)], "DRAM"
        )
        self.mem_handle = self.agent.prep_xfer_dlist("", xfer, mem_type="DRAM")

    async def post_non_blocking(self, handle) -> None:
        state = self.agent.transfer(handle)
        while state != "DONE" and state != "ERR":
            state = self.agent.check_xfer_state(handle)
            if state != "DONE" and state != "ERR":
                await asyncio.sleep(0.01)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")

    def close(self):
        self.agent.release_dlist_handle(self.mem_handle)
        self.agent.deregister_memory(self.mem_reg)


def _objects(rng, n, max_pages):
    return [
        (f"obj-{i}-{int(rng.integers(1 << 40)):x}", int(rng.integers(1, max_pages + 1)))
        for i in range(n)
    ]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_mp_nixl_store(direct, plugin_so, tmp_path, rng, stderr_log):
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    page, pages_per_file, pool_size = 64 * KiB, 8, 6
    file_size = page * pages_per_file
    ledger = R.Ledger(f"lmcache-mp-store-{direct}")
    arena = R.Mem("DRAM", 96 * page)
    params = {
        "file_path": str(tmp_path / "l2"),
        "use_direct_io": "true" if direct else "false",
        "file_size": str(file_size),
        "max_capacity_gb": "1",
    }
    mp = MPAgent("NixlAgent_", arena, page, params, telemetry=True)
    a = mp.agent

    os.makedirs(params["file_path"], exist_ok=True)
    flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0)
    fds = [
        os.open(os.path.join(params["file_path"], f"obj_{i}_{uuid.uuid4().hex[0:4]}.bin"), flags)
        for i in range(pool_size)
    ]
    storage_reg = a.register_memory([(0, file_size, fd, "") for fd in fds], mem_type="FILE")
    slots_descs = [
        ((i % pages_per_file) * page, page, fds[i // pages_per_file])
        for i in range(pool_size * pages_per_file)
    ]
    storage_handle = a.prep_xfer_dlist(
        mp.agent_name, a.get_xfer_descs(slots_descs, "FILE"), mem_type="FILE"
    )
    pool = list(range(pool_size * pages_per_file))  # NixlObjPool
    l1_free = list(range(arena.size // page))
    stored: dict[str, list[int]] = {}
    merged_seen = []

    def l1_alloc(n):
        # L1 objects are contiguous page runs (MemoryObj address/phy_size).
        for s in range(len(l1_free)):
            run = l1_free[s : s + n]
            if len(run) == n and run[-1] - run[0] == n - 1:
                del l1_free[s : s + n]
                return run
        raise AssertionError("L1 arena exhausted")

    async def store(objs):
        mem_flat, slots_flat, done = [], [], []
        for key, n in objs:
            if key in stored:
                continue
            mem = l1_alloc(n)
            for j, p in enumerate(mem):
                arena.write(p * page, ledger.make(f"{key}/p{j}", page))
            slots, pool[:] = pool[:n], pool[n:]
            assert len(slots) == n
            mem_flat += mem
            slots_flat += slots
            done.append((key, slots, mem))
        h = a.make_prepped_xfer("WRITE", mp.mem_handle, mem_flat, storage_handle, slots_flat)
        await mp.post_non_blocking(h)
        merged_seen.append((len(mem_flat), a.get_xfer_telemetry(h).descCount))
        a.release_xfer_handle(h)
        for key, slots, mem in done:
            stored[key] = slots
            l1_free.extend(mem)

    async def load(keys):
        mem_flat, slots_flat, plan = [], [], []
        for key in keys:
            slots = stored[key]
            mem = l1_alloc(len(slots))
            for p in mem:
                arena.write(p * page, ledger.poison(f"l1-{p}", page))
            mem_flat += mem
            slots_flat += slots
            plan.append((key, mem))
        h = a.make_prepped_xfer("READ", mp.mem_handle, mem_flat, storage_handle, slots_flat)
        await mp.post_non_blocking(h)
        a.release_xfer_handle(h)
        for key, mem in plan:
            for j, p in enumerate(mem):
                ledger.check(
                    arena.read(p * page, page),
                    f"{key}/p{j}",
                    f"load of {key} page {j} (slot {stored[key][j]}) into L1 page {p}",
                )
            l1_free.extend(mem)

    def delete(keys):
        for k in keys:
            pool.extend(stored.pop(k))  # batched_free: slots go to the end of the list

    async def scenario():
        for _rnd in range(3):
            objs = _objects(rng, 14, 4)
            batches = [objs[i : i + 4] for i in range(0, len(objs), 4)]
            fit, used = [], 0
            for b in batches:
                need = sum(n for _, n in b)
                if used + need <= len(pool):
                    fit.append(b)
                    used += need
            await asyncio.gather(*(store(b) for b in fit))  # concurrent store tasks
            keys = list(stored)
            order = [keys[int(i)] for i in rng.permutation(len(keys))]
            await asyncio.gather(*(load(order[i : i + 3]) for i in range(0, len(order), 3)))
            delete(order[: len(order) // 2])

    asyncio.run(scenario())
    assert any(d < n for n, d in merged_seen), (
        f"NIXL never merged consecutive pages (indices, descCount): {merged_seen}"
    )
    for key, slots in stored.items():
        for j, s in enumerate(slots):
            off, _, fd = slots_descs[s]
            ledger.check(R.file_bytes(fd, off, page), f"{key}/p{j}", f"slot {s} of {key}")

    a.release_dlist_handle(storage_handle)
    mp.close()
    a.deregister_memory(storage_reg)
    for fd in fds:
        os.close(fd)
    R.no_plugin_errors(stderr_log, f"LMCache MP nixl_store replay (direct={direct})")


@pytest.mark.parametrize("shard_dirs", [False, True], ids=["flat", "sharded"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_mp_nixl_store_dynamic(direct, shard_dirs, plugin_so, tmp_path, rng, stderr_log):
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    page = 64 * KiB
    ledger = R.Ledger(f"lmcache-mp-dyn-{direct}-{shard_dirs}")
    arena = R.Mem("DRAM", 128 * page)
    base = str(tmp_path / "l2dyn")
    params = {
        "file_path": base,
        "use_direct_io": "true" if direct else "false",
        "shard_dirs": "true" if shard_dirs else "false",
        "max_capacity_gb": "0.5",
    }
    mp = MPAgent("DynNixlAgent_", arena, page, params)
    a = mp.agent
    os.makedirs(base, exist_ok=True)
    model, kv_rank, group = "meta-llama/Llama-3.1-8B", 3, 0

    def file_path(chunk_hex):
        name = f"{model.replace('/', '--')}_{kv_rank:08x}_{group:x}_{chunk_hex}.bin"
        if shard_dirs:
            return os.path.join(base, chunk_hex[:2], chunk_hex[2:4], name)
        return os.path.join(base, name)

    def flags(create):
        f = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        return f | (os.O_DIRECT if direct else 0)

    def register_single_file(fd, n):
        reg = a.register_memory([(0, n * page, fd, "")], mem_type="FILE")
        xd = a.get_xfer_descs([(k * page, page, fd) for k in range(n)], mem_type="FILE")
        return reg, a.prep_xfer_dlist(mp.agent_name, xd, mem_type="FILE")

    async def transfer(op, mem, handler):
        h = a.make_prepped_xfer(op, mp.mem_handle, mem, handler, list(range(len(mem))))
        try:
            await mp.post_non_blocking(h)
        finally:
            a.release_xfer_handle(h)

    async def dynamic_store(mem, chunk_hex):
        final = file_path(chunk_hex)
        tmp = f"{final}.tmp.{uuid.uuid4().hex}"
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        fd = os.open(tmp, flags(True))
        try:
            reg, xh = register_single_file(fd, len(mem))
            try:
                await transfer("WRITE", mem, xh)
            finally:
                a.release_dlist_handle(xh)
                a.deregister_memory(reg)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, final)

    async def dynamic_load(mem, chunk_hex):
        fd = os.open(file_path(chunk_hex), flags(False))
        try:
            reg, xh = register_single_file(fd, len(mem))
            try:
                await transfer("READ", mem, xh)
            finally:
                a.release_dlist_handle(xh)
                a.deregister_memory(reg)
        finally:
            os.close(fd)

    objs = [(f"{int(rng.integers(1 << 63)):016x}", int(rng.integers(1, 5))) for _ in range(24)]
    free = list(range(arena.size // page))

    def alloc(n):
        for s in range(len(free)):
            run = free[s : s + n]
            if len(run) == n and run[-1] - run[0] == n - 1:
                del free[s : s + n]
                return run
        raise AssertionError("L1 arena exhausted")

    async def scenario():
        placed = []
        for h, n in objs:
            mem = alloc(n)
            for j, p in enumerate(mem):
                arena.write(p * page, ledger.make(f"{h}/p{j}", page))
            placed.append((h, mem))
        await asyncio.gather(*(dynamic_store(mem, h) for h, mem in placed))
        for _, mem in placed:
            free.extend(mem)
        for h, n in objs:
            assert os.path.getsize(file_path(h)) == n * page  # get_stored_size
        loads = []
        for h, n in objs:
            mem = alloc(n)
            for p in mem:
                arena.write(p * page, ledger.poison(f"l1-{p}", page))
            loads.append((h, mem))
        await asyncio.gather(*(dynamic_load(mem, h) for h, mem in loads))
        for h, mem in loads:
            for j, p in enumerate(mem):
                ledger.check(arena.read(p * page, page), f"{h}/p{j}", f"load of {h} page {j}")
        # A key that was never stored: open() raises before any NIXL call (a miss).
        with pytest.raises(FileNotFoundError):
            await dynamic_load(loads[0][1][:1], "f" * 16)

    asyncio.run(scenario())
    leftovers = [f for _, _, fs in os.walk(base) for f in fs if ".tmp." in f]
    assert not leftovers, f"temp files left: {leftovers}"
    mp.close()
    R.no_plugin_errors(stderr_log, f"LMCache MP nixl_store_dynamic replay (direct={direct})")


# ---- the whitelist, bypassed without patching LMCache --------------------------------------


def test_whitelist_bypass_private_plugin_dir(plugin_so, tmp_path):
    """LMCache accepts only GDS/GDS_MT/POSIX/HF3FS (files). Without patching it, the plugin can
    be installed as libplugin_POSIX.so in a private NIXL_PLUGIN_DIR and LMCache configured with
    nixl_backend: POSIX. This runs the LMCache replays above in a child pytest where the
    backend name is POSIX and NIXL_PLUGIN_DIR holds only the plugin (under both names), and
    checks from the plugin's own log that every "POSIX" engine was IO_URING_DMABUF."""
    import shutil

    if R.BACKEND != PLUGIN:
        pytest.skip("only meaningful for the plugin")
    pdir = tmp_path / "private-plugins"
    pdir.mkdir()
    shutil.copy(plugin_so, pdir / "libplugin_POSIX.so")
    shutil.copy(plugin_so, pdir / f"libplugin_{PLUGIN}.so")  # for the plugin_so fixture
    env = dict(
        os.environ, IUD_TEST_BACKEND="POSIX", IUD_PLUGIN_DIR=str(pdir), IO_URING_DMABUF_LOG="debug"
    )
    env.pop("NIXL_PLUGIN_DIR", None)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "dram or dynamic_mode or mp_nixl_store",
            "--basetemp",
            str(tmp_path / "child"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"child pytest exited {p.returncode}:\n{out[-5000:]}"
    created = [ln for ln in out.splitlines() if "IO_URING_DMABUF engine created" in ln]
    assert len(created) >= 8, f"the POSIX engines were not the plugin:\n{out[-3000:]}"
    summary = [ln for ln in p.stdout.splitlines() if " passed" in ln]
    print(summary)
    assert summary and "failed" not in summary[-1]
