"""Replays of vLLM's NIXL call sequences (reference: nixl-clients.md §1).

1. NixlConnector with the plugin listed: kv_connector_extra_config.backends = ["UCX",
   "IO_URING_DMABUF"] gives every backend an empty param dict; the worker registers all KV
   regions with one register_memory(backends=...) call, preps every block with
   prep_xfer_dlist("NIXL_INIT_AGENT", ...), exchanges metadata, pulls blocks over UCX with
   make_prepped_xfer("READ", ..., notif_msg), polls check_xfer_state once per engine step, reads
   the telemetry, releases and deregisters at shutdown. The plugin only sees registerMem /
   deregisterMem of the KV cache; the test proves that listing it does not break start-up, the
   P/D transfer or shutdown. Three KV layouts: FlashAttention (K and V regions per layer),
   FlashInfer (one region per layer, K-half and V-half descriptor lists), MLA (18 KiB blocks).
2. The proposed file-offload shape (vLLM OBJ tier template, llm-d StorageOffloadEngine, GDS RFC
   #54777): the KV memory registered once; per job one file per block, register_memory(files,
   "FILE"), initialize_xfer (un-prepped) against the own agent name, transfer, poll,
   deregister, release (the OBJ engine's order), close; two jobs in flight at once.
   Shape "obj": a contiguous block per file and files.trim() as the remote list; shape "gds":
   FILE -> per-(layer, K/V) KV regions; "gds-mla": the same with MLA's 18 KiB blocks
   (512-byte aligned, also with O_DIRECT).

DRAM stands in for VRAM on CPU; the VRAM variants (regions >= 1 GiB for the connector) run on
the GPU machine.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import replay_lib as R
from replay_lib import GiB

# Llama-3.1-8B-like geometry: block 16 tokens, 8 KV heads, head dim 128, bf16.
PAGE, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, 2
KV_BLOCK = PAGE * KV_HEADS * HEAD_DIM * DTYPE  # 32 KiB per (layer, K or V, block)
MLA_BLOCK = PAGE * 576 * DTYPE  # 18 KiB, 512 B aligned only


class KVCache:
    """vLLM's registered KV cache of one worker, and its local descriptor list in vLLM's order
    (descriptor id = region_id * num_blocks + block_id; FlashInfer: K halves, then V halves).

    Content: chunk (region r, block b) = bytes [b * block_len, (b + 1) * block_len) of the
    stream of key "<tag>/region<r>", so every block of every region is unique."""

    def __init__(self, kind: str, layout: str, layers: int, num_blocks: int, tag: str):
        self.kind, self.layout, self.tag = kind, layout, tag
        self.num_blocks = num_blocks
        if layout == "flash_attn":  # split_k_and_v: 2 regions per layer
            self.n_regions, self.block_len, self.halves = 2 * layers, KV_BLOCK, 1
        elif layout == "flashinfer":  # blocks-first, K and V share a region
            self.n_regions, self.block_len, self.halves = layers, 2 * KV_BLOCK, 2
        elif layout == "mla":
            self.n_regions, self.block_len, self.halves = layers, MLA_BLOCK, 1
        else:
            raise ValueError(layout)
        self.region_len = num_blocks * self.block_len
        self.regions = [R.Mem(kind, self.region_len) for _ in range(self.n_regions)]
        self.desc_len = self.block_len // self.halves

    def fill(self, ledger: R.Ledger, name: str) -> None:
        for r, m in enumerate(self.regions):
            m.write(0, ledger.make(f"{name}/region{r}", self.region_len))

    def caches_data(self):
        """register_kv_caches' tuples: (data_ptr, numel * elem_size, device_id, "")."""
        return [(m.addr, self.region_len, max(m.dev, 0), "") for m in self.regions]

    def blocks_data(self):
        out = []
        for half in range(self.halves):
            for m in self.regions:
                for b in range(self.num_blocks):
                    out.append(
                        (
                            m.addr + b * self.block_len + half * self.desc_len,
                            self.desc_len,
                            max(m.dev, 0),
                        )
                    )
        return out

    def desc_ids(self, blocks) -> np.ndarray:
        ids = []
        for half in range(self.halves):
            for r in range(self.n_regions):
                ids.extend((half * self.n_regions + r) * self.num_blocks + b for b in blocks)
        return np.asarray(ids, dtype=np.int64)

    def piece(self, desc_id: int):
        """(region, byte offset in the region, length) of a descriptor id."""
        half, rest = divmod(int(desc_id), self.n_regions * self.num_blocks)
        r, b = divmod(rest, self.num_blocks)
        return r, b * self.block_len + half * self.desc_len, self.desc_len


def _worker(backends, kv: KVCache):
    """NixlConnectorWorker.__init__ + register_kv_caches, as vLLM calls them."""
    from nixl._api import nixl_agent, nixl_agent_config

    # Any non-UCX backend listed: nixl_agent_config(backends=..., capture_telemetry=True); the
    # wrapper then calls create_backend(name, {}) for each (num_threads is 0 in this branch).
    agent = nixl_agent(
        str(uuid.uuid4()), nixl_agent_config(backends=backends, capture_telemetry=True)
    )
    descs = agent.get_reg_descs(kv.caches_data(), kv.kind)
    agent.register_memory(descs, backends=backends)
    xfer_descs = agent.get_xfer_descs(kv.blocks_data(), kv.kind)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", xfer_descs)
    return agent, descs, local


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
@pytest.mark.parametrize("kind", R.mem_kinds())
def test_nixl_connector_with_plugin_listed(kind, layout, plugin_so, rng, stderr_log):
    from nixl._api import nixl_agent, nixl_agent_config

    probe = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
    have_ucx = "UCX" in probe.get_plugin_list()
    del probe
    if kind == "DRAM" and not have_ucx:
        pytest.skip("the UCX plugin is not in NIXL_PLUGIN_DIR (needed for the P/D transfer)")
    backends = ["UCX", R.BACKEND] if have_ucx else [R.BACKEND]
    layers = 4
    if kind == "VRAM":
        # Real sizes: every KV region >= 1 GiB (vLLM registers tens of GiB at 60k blocks).
        bl = {"flash_attn": KV_BLOCK, "flashinfer": 2 * KV_BLOCK, "mla": MLA_BLOCK}[layout]
        num_blocks = GiB // bl + 17
    else:
        num_blocks = 64
    ledger = R.Ledger(f"vllm-pd-{kind}-{layout}")

    t0 = time.monotonic()
    prefill_kv = KVCache(kind, layout, layers, num_blocks, "prefill")
    decode_kv = KVCache(kind, layout, layers, num_blocks, "decode")
    if have_ucx:  # contents only matter for the P/D transfer
        prefill_kv.fill(ledger, "prefill")
        for r, m in enumerate(decode_kv.regions):
            m.write(0, ledger.poison(f"decode/region{r}", decode_kv.region_len))

    prefill, p_descs, p_local = _worker(backends, prefill_kv)
    decode, d_descs, d_local = _worker(backends, decode_kv)
    assert R.BACKEND in prefill.backends and R.BACKEND in decode.backends
    startup = time.monotonic() - t0
    print(
        f"{layout} {kind}: {kv_desc(prefill_kv)}; start-up (alloc, fill, register, prep; "
        f"2 workers) {startup:.2f} s"
    )

    if have_ucx:
        # Handshake: the decode worker loads the prefill worker's metadata and preps its blocks.
        remote_name = decode.add_remote_agent(prefill.get_agent_metadata())
        r_handle = decode.prep_xfer_dlist(remote_name, prefill_kv.blocks_data(), kind)
        # One request: decode pulls a random subset of prefill blocks into its own block ids.
        n_req = min(24, num_blocks // 2)
        remote_blocks = rng.choice(num_blocks, n_req, replace=False)
        local_blocks = rng.choice(num_blocks, n_req, replace=False)
        r_ids, l_ids = prefill_kv.desc_ids(remote_blocks), decode_kv.desc_ids(local_blocks)
        notif = b"req-0:1"
        h = decode.make_prepped_xfer("READ", d_local, l_ids, r_handle, r_ids, notif_msg=notif)
        assert decode.query_xfer_backend(h) == "UCX", (
            "the P/D transfer must go to UCX; the storage plugin cannot reach a remote agent"
        )
        state = R.wait(decode, h, decode.transfer(h), 0.0)  # polled once per engine step
        assert state == "DONE", f"P/D READ ended {state}"
        tel = decode.get_xfer_telemetry(h)
        assert tel.totalBytes == len(l_ids) * decode_kv.desc_len
        decode.release_xfer_handle(h)
        # The producer learns of the completion through the notification.
        deadline, got = time.monotonic() + 30, []
        while not got and time.monotonic() < deadline:
            got = prefill.get_new_notifs().get(decode.name, [])
            time.sleep(0.001)
        assert got == [notif], f"prefill worker got notifications {got!r}"

        # Byte for byte: requested decode descriptors hold the prefill bytes; the rest is poison.
        moved = {}
        for li, ri in zip(l_ids, r_ids):
            moved[int(li)] = int(ri)
        for li, ri in moved.items():
            r, off, n = decode_kv.piece(li)
            pr, poff, _ = prefill_kv.piece(ri)
            ledger.check(
                decode_kv.regions[r].read(off, n),
                f"prefill/region{pr}",
                f"decode desc {li} <- prefill desc {ri}",
                offset=poff,
            )
        untouched = [
            i
            for i in range(prefill_kv.n_regions * num_blocks * prefill_kv.halves)
            if i not in moved
        ]
        if kind == "VRAM":
            untouched = [untouched[int(k)] for k in rng.choice(len(untouched), 256, replace=False)]
        for li in untouched:
            r, off, n = decode_kv.piece(li)
            ledger.check_untouched(
                decode_kv.regions[r].read(off, n),
                f"decode/region{r}",
                off,
                f"decode desc {li} (not requested)",
            )
        decode.release_dlist_handle(r_handle)
        decode.remove_remote_agent(remote_name)

    # Shutdown, as vLLM: release prepped lists, deregister the KV caches.
    t1 = time.monotonic()
    for agent, local, descs in ((decode, d_local, d_descs), (prefill, p_local, p_descs)):
        agent.release_dlist_handle(local)
        agent.deregister_memory(descs)
    print(f"shutdown {time.monotonic() - t1:.2f} s")
    R.no_plugin_errors(stderr_log, f"vLLM NixlConnector replay ({layout}, {kind})")


def kv_desc(kv: KVCache) -> str:
    return (
        f"{kv.n_regions} regions x {kv.region_len / GiB:.3f} GiB, "
        f"{kv.n_regions * kv.num_blocks * kv.halves} descriptors of {kv.desc_len} B"
    )


# ---- the proposed file-offload shape ---------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("shape", ["obj", "gds", "gds-mla"])
@pytest.mark.parametrize("kind", R.mem_kinds())
def test_file_offload_jobs(kind, shape, direct, plugin_so, tmp_path, rng, stderr_log):
    from nixl._api import nixl_agent, nixl_agent_config

    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    layers, num_blocks, job_blocks = 4, 64, 8
    ledger = R.Ledger(f"vllm-offload-{kind}-{shape}-{direct}")
    agent = nixl_agent(f"StorageOffloadEngine-{uuid.uuid4()}", nixl_agent_config(backends=[]))
    agent.create_backend(R.BACKEND, {})

    if shape == "obj":
        # One primary buffer, a block = `stride` contiguous bytes (all layers), registered once.
        stride = 2 * layers * KV_BLOCK
        primary = R.Mem(kind, num_blocks * stride)
        regions = [primary]
        mem_reg = agent.register_memory([(primary.addr, primary.size, primary.dev, "")], kind)
        file_len = stride

        def mem_pieces(bid):  # (region, offset, len, file offset)
            return [(0, bid * stride, stride, 0)]
    else:
        # The KV cache: 2 x layers regions (K, V) of 32 KiB blocks, or for MLA one region per
        # layer of 18 KiB blocks (512 B aligned only); FILE -> VRAM per region block piece.
        n_reg, piece = (layers, MLA_BLOCK) if shape == "gds-mla" else (2 * layers, KV_BLOCK)
        regions = [R.Mem(kind, num_blocks * piece) for _ in range(n_reg)]
        mem_reg = agent.register_memory(
            agent.get_reg_descs([(m.addr, m.size, m.dev, "") for m in regions], kind)
        )
        file_len = n_reg * piece

        def mem_pieces(bid):
            return [(r, bid * piece, piece, r * piece) for r in range(n_reg)]

    def fill_block(bid, name):
        for r, off, n, foff in mem_pieces(bid):
            regions[r].write(off, ledger.make(name, file_len)[foff : foff + n])

    def poison_block(bid):
        for r, off, n, _ in mem_pieces(bid):
            regions[r].write(off, ledger.poison(f"block{bid}", file_len)[:n])

    flags_w = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    flags_r = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def submit(op, blocks, keys):
        """One offloading job: open, register, initialize_xfer, transfer (not yet polled)."""
        if op == "WRITE":
            paths = [str(tmp_path / f"{k}.tmp.{uuid.uuid4().hex[:8]}") for k in keys]
            fds = [os.open(p, flags_w, 0o644) for p in paths]
        else:
            paths = [str(tmp_path / f"{k}.bin") for k in keys]
            fds = [os.open(p, flags_r) for p in paths]
        files = agent.register_memory([(0, file_len, fd, "") for fd in fds], "FILE")
        local, remote = [], []
        for bid, fd in zip(blocks, fds):
            for r, off, n, foff in mem_pieces(bid):
                local.append((regions[r].addr + off, n, regions[r].dev))
                remote.append((foff, n, fd))
        xfer = agent.get_xfer_descs(local, kind)
        if shape == "obj":
            remote_descs = files.trim()  # the OBJ engine / llm-d pass the trimmed reg list
        else:
            remote_descs = agent.get_xfer_descs(remote, "FILE")
        h = agent.initialize_xfer(op, xfer, remote_descs, agent.name)
        return {
            "op": op,
            "h": h,
            "state": agent.transfer(h),
            "files": files,
            "fds": fds,
            "paths": paths,
            "keys": keys,
            "blocks": blocks,
        }

    def finish(job):
        state = R.wait(agent, job["h"], job["state"], 0.001)
        # The OBJ engine's order: deregister the job's registrations, then release the request
        # (which still refers to them), then close the files.
        agent.deregister_memory(job["files"])
        agent.release_xfer_handle(job["h"])
        for fd in job["fds"]:
            os.close(fd)
        assert state == "DONE", f"{job['op']} job ended {state}"
        if job["op"] == "WRITE":  # temp file + rename, like the fs tier
            for p, k in zip(job["paths"], job["keys"]):
                os.rename(p, str(tmp_path / f"{k}.bin"))

    # Store 4 jobs of 8 blocks, two in flight at a time.
    order = rng.permutation(num_blocks)[: 4 * job_blocks]
    keys = {int(b): f"{rng.integers(1 << 62):016x}" for b in order}
    for b in order:
        fill_block(int(b), keys[int(b)])
    jobs = [[int(b) for b in order[i : i + job_blocks]] for i in range(0, len(order), job_blocks)]
    for a, b in zip(jobs[0::2], jobs[1::2]):
        ja = submit("WRITE", a, [keys[x] for x in a])
        jb = submit("WRITE", b, [keys[x] for x in b])
        finish(jb)
        finish(ja)
    for b, k in keys.items():
        path = str(tmp_path / f"{k}.bin")
        assert os.path.getsize(path) == file_len, f"file of block {b}: size {os.path.getsize(path)}"
        ledger.check(R.file_bytes(path, 0, file_len), k, f"file of block {b} after the store job")

    # Load every stored key into other (poisoned) block ids, two jobs in flight.
    targets = [int(b) for b in rng.permutation(num_blocks)[: len(order)]]
    for t in targets:
        poison_block(t)
    src = list(keys.values())
    rjobs = [
        (targets[i : i + job_blocks], src[i : i + job_blocks])
        for i in range(0, len(src), job_blocks)
    ]
    for (ta, ka), (tb, kb) in zip(rjobs[0::2], rjobs[1::2]):
        ja = submit("READ", ta, ka)
        jb = submit("READ", tb, kb)
        finish(ja)
        finish(jb)
    for t, k in zip(targets, src):
        for r, off, n, foff in mem_pieces(t):
            ledger.check(
                regions[r].read(off, n), k, f"block {t} piece (region {r}) after load", offset=foff
            )

    # A load of a key that was never stored: the client's open() fails; nothing reaches NIXL.
    with pytest.raises(FileNotFoundError):
        submit("READ", [targets[0]], ["0" * 16])
    agent.deregister_memory(mem_reg)
    R.no_plugin_errors(stderr_log, f"vLLM file-offload replay ({shape}, {kind})")
