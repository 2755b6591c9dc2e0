"""nixlbench's storage mode, call for call (benchmark/nixlbench, nixl_worker.cpp + main.cpp),
with unique per-block patterns instead of nixlbench's constant 0xbb/0xaa fill so that
``--check_consistency`` catches misplaced blocks too.

What nixlbench does for a storage backend (no etcd, one process):
  * agent "initiator", progress thread off (--enable_pt false), sync mode RW when
    --num_threads > 1; createBackend(name, getPluginParams(name) [+ POSIX's own params]).
  * allocateMemory: buffer_size = total_buffer_size / (num_initiator_dev * num_threads)
    (page-rounded with --storage_enable_direct); --num_files files
    "<filepath>/nixlbench_<backend>_test_file_initiator_<i>" opened O_RDWR|O_CREAT|O_LARGEFILE
    [|O_DIRECT] 0744; per thread one FILE region (next offset of the next file, round robin),
    filled before it is registered (READ runs fill only what the file lacks); per thread one
    memory buffer; registerMem with opt_args.backends = [the backend].
  * per block size (doubling from --start_block_size to --max_block_size) and batch size: local
    list of a thread = batch descriptors at addr + (j * block % buffer); remote list
    (exchangeIOV) = descriptor k of all threads in turn goes to file k % num_files at an offset
    that advances by one block each time the files wrap; createXferReq(op, local, remote,
    "initiator") once, then postXferReq / getXferStatus (spinning) num_iter / num_threads times
    (/ large_blk_iter_ftr above 1 MiB), after warmup_iter the same way; releaseXferReq.
  * --check_consistency: after the point, the file (WRITE) or the buffer (READ) is compared.
  * deallocate: deregister the FILE regions, close each fd once, deregister the buffers.

This module is imported by test_replay_nixlbench.py and by its child process (the private
NIXL_PLUGIN_DIR run, where the plugin is loaded under the file name libplugin_POSIX.so).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import replay_lib as R

LARGE_BLOCK_SIZE = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")


def posix_params(params: dict) -> dict:
    """What nixlbench adds for --backend POSIX with the default --posix_api_type AIO."""
    out = dict(params)
    out.update(
        {
            "use_aio": "true",
            "use_uring": "false",
            "use_posix_aio": "false",
            "ios_pool_size": "65536",
            "kernel_queue_size": "256",
        }
    )
    return out


def run(
    backend: str,
    *,
    kind="DRAM",
    op="WRITE",
    num_threads=1,
    num_files=1,
    direct=False,
    filepath: str,
    total_buffer_size: int,
    block_sizes,
    batch_sizes,
    num_iter=16,
    warmup_iter=16,
    large_blk_iter_ftr=16,
    ledger: R.Ledger,
    max_batch_bytes=None,
    log=print,
):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    sync = (
        nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        if num_threads > 1
        else nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
    )
    name = "initiator"
    agent = nixl_agent(
        name, nixl_agent_config(backends=[], enable_prog_thread=False, sync_mode=sync)
    )
    params = agent.get_plugin_params(backend)
    if backend == "POSIX":
        params = posix_params(params)
    agent.create_backend(backend, params)
    only = [backend]

    # ---- allocateMemory
    num_devices = 1
    buffer_size = total_buffer_size // (num_devices * num_threads)
    if direct:
        buffer_size = (buffer_size + PAGE - 1) // PAGE * PAGE
    num_buffers = num_threads * num_devices
    assert num_files <= num_buffers and num_buffers % num_files == 0, (
        "nixlbench refuses this num_files / num_threads combination"
    )
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_LARGEFILE", 0) | (os.O_DIRECT if direct else 0)
    files = []  # [fd, file_size, next offset]
    for i in range(num_files):
        path = os.path.join(filepath, f"nixlbench_{backend.lower()}_test_file_{name}_{i}")
        size = os.stat(path).st_size if op == "READ" and os.path.exists(path) else 0
        files.append([os.open(path, flags, 0o744), size, 0])
    file_regs, file_iovs, fidx = [], [], 0
    for _t in range(num_threads):
        f = files[fidx]
        off = f[2]
        f[2] += buffer_size
        if not (op == "READ" and off + buffer_size <= f[1]):
            R.pwrite_all(f[0], ledger.make(f"init/file{fidx}", f[2])[off:], off)
            f[1] = max(f[1], f[2])
        file_iovs.append((off, buffer_size, f[0]))
        file_regs.append(
            agent.register_memory([(off, buffer_size, f[0], "")], "FILE", backends=only)
        )
        fidx = (fidx + 1) % num_files
    mems, mem_regs = [], []
    for _t in range(num_threads):
        m = R.Mem(kind, buffer_size)
        mems.append(m)
        mem_regs.append(
            agent.register_memory([(m.addr, buffer_size, m.dev, "")], kind, backends=only)
        )

    points = []
    try:
        for bs in block_sizes:
            for batch in batch_sizes:
                if bs * batch > buffer_size:
                    continue
                if batch > 1 and max_batch_bytes and bs * batch > max_batch_bytes:
                    continue  # the replay's own cap, to keep CI short
                points.append(
                    _point(
                        agent,
                        backend,
                        kind,
                        op,
                        mems,
                        files,
                        num_threads,
                        buffer_size,
                        bs,
                        batch,
                        num_iter,
                        warmup_iter,
                        large_blk_iter_ftr,
                        ledger,
                    )
                )
                p = points[-1]
                log(
                    f"{op:5s} block {bs:>9d} batch {batch:>3d} threads {num_threads} "
                    f"files {num_files}: {p['iters']:>3d} iter/thread, {p['gbps']:.2f} GB/s "
                    f"(consistency checked)"
                )
    finally:
        # ---- deallocateMemory
        for r in file_regs:
            agent.deregister_memory(r, backends=only)
        for f in files:
            os.close(f[0])
        for r in mem_regs:
            agent.deregister_memory(r, backends=only)
        _poisons.clear()
    return points


def _point(
    agent,
    backend,
    kind,
    op,
    mems,
    files,
    num_threads,
    buffer_size,
    bs,
    batch,
    num_iter,
    warmup_iter,
    ftr,
    ledger,
):
    # createTransferDescLists
    local = []
    for m in mems:
        lst = []
        for j in range(batch):
            off = (j * bs) % buffer_size
            if off + bs > buffer_size:
                off = 0
            lst.append((m.addr + off, bs, m.dev))
        local.append(lst)
    # exchangeIOV (storage): file k % num_files, offset advancing when the files wrap
    remote, fd_idx, file_off = [], 0, 0
    for _t in range(num_threads):
        lst = []
        for _ in range(batch):
            lst.append((file_off, bs, files[fd_idx][0]))
            fd_idx += 1
            if fd_idx >= len(files):
                fd_idx, file_off = 0, file_off + bs
        remote.append(lst)

    tag = f"{op}-{bs}x{batch}"
    chunks = {}
    for t in range(num_threads):
        for j, ((addr, n, _), (foff, _, fd)) in enumerate(zip(local[t], remote[t])):
            chunk = chunks[t, j] = ledger.make(f"{tag}/t{t}/j{j}", n)
            if op == "WRITE":
                mems[t].write(addr - mems[t].addr, chunk)
            else:
                R.pwrite_all(fd, chunk, foff)
                off = addr - mems[t].addr
                mems[t].write(off, _poison(ledger, t, buffer_size)[off : off + n])

    iters = num_iter // num_threads
    skip = warmup_iter // num_threads
    if bs > LARGE_BLOCK_SIZE:
        skip //= ftr
        iters //= ftr
    assert iters >= 1, "num_iter / num_threads / large_blk_iter_ftr must be >= 1"
    if skip > 0:
        _exec(agent, backend, kind, op, local, remote, skip)
    t0 = time.monotonic()
    _exec(agent, backend, kind, op, local, remote, iters)
    wall = time.monotonic() - t0

    # --check_consistency
    for t in range(num_threads):
        for j, ((addr, n, _), (foff, _, fd)) in enumerate(zip(local[t], remote[t])):
            what = f"{op} block {bs} batch {batch} thread {t} descriptor {j}"
            if op == "WRITE":
                got, what = R.file_bytes(fd, foff, n), f"{what}: file fd {fd} offset {foff}"
            else:
                got, what = mems[t].read(addr - mems[t].addr, n), f"{what}: memory"
            if not np.array_equal(got, chunks[t, j]):
                ledger.check(got, f"{tag}/t{t}/j{j}", what)  # raises, saying what is wrong
    total = num_threads * iters * batch * bs
    return {"block": bs, "batch": batch, "iters": iters, "gbps": total / max(wall, 1e-9) / 1e9}


_poisons: dict = {}


def _poison(ledger, t, size):
    """The poison written over a thread's READ destinations (one stream per thread)."""
    key = (ledger.scenario, t, size)
    if key not in _poisons:
        for k in [k for k in _poisons if k[0] != ledger.scenario]:
            del _poisons[k]
        _poisons[key] = ledger.poison(f"buffer{t}", size)
    return _poisons[key]


def _exec(agent, backend, kind, op, local, remote, num_iter):
    """execTransfer: one thread per list, each execTransferLoop with pipeline depth 1."""
    errors = []

    def loop(t):
        try:
            ld = agent.get_xfer_descs(local[t], kind)
            rd = agent.get_xfer_descs(remote[t], "FILE")
            req = agent.initialize_xfer(op, ld, rd, "initiator", backends=[backend])
            try:
                for _ in range(num_iter):
                    state = agent.transfer(req)
                    while state == "PROC":
                        state = agent.check_xfer_state(req)
                    if state != "DONE":
                        raise AssertionError(f"thread {t}: transfer ended {state}")
            finally:
                agent.release_xfer_handle(req)
        except BaseException as e:  # reported from the main thread
            errors.append(e)

    if len(local) == 1:
        loop(0)
    else:
        ths = [threading.Thread(target=loop, args=(t,)) for t in range(len(local))]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    if errors:
        raise errors[0]
