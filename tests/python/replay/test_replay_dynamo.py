"""Replay of Dynamo KVBM's disk tier (G3) (reference: nixl-clients.md §3, S6).

Dynamo is Rust (nixl-sys); the Python calls below are the same agent calls one for one:
  * agent "kvbm-worker-<id>"; build_agent() creates its backends with get_plugin_params()
    defaults: POSIX, plus IO_URING_DMABUF where the patched worker (or the V2 path's
    DYN_KVBM_NIXL_BACKEND_IO_URING_DMABUF=true) adds it in place of GDS_MT;
  * layouts registered with no backend filter, so every backend that takes the memory kind
    gets them: the pinned host pool (G2, one DRAM region, fully contiguous blocks), the device
    layers (G1, layer-separate: one region per layer, [K/V][block] pieces; DRAM stands in for
    VRAM on CPU) and the disk file;
  * the disk file: mkostemp("<dir>/dynamo-kvbm-disk-cache-XXXXXX", O_CLOEXEC), O_DIRECT added
    with fcntl(F_SETFL) (unless DYN_KVBM_DISK_DISABLE_O_DIRECT), fallocate(num_blocks x block
    bytes), registered as one FILE descriptor (0, size, fd) -- devId = fd, kept linked;
  * transfers: un-prepped create_xfer_req(op, local, remote, own name, no backend) per batch,
    post_xfer_req, then get_xfer_status every 5 ms while pending, several batches in flight:
      - offload G2 -> G3 (WRITE, one descriptor per block: both sides fully contiguous),
      - onboard G3 -> G2 (READ "flipped": host memory is the local list),
      - G1 <-> G3 direct (the GDS capability): one descriptor per (layer, K/V) on both sides,
        2 x layers descriptors per block, WRITE and READ.
Every block and piece is checked byte for byte in the file and in memory.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
import time

import pytest
import replay_lib as R
from replay_lib import PLUGIN, KiB

POLL_S = 0.005
MAX_TRANSFER_BATCH_SIZE = 8
MAX_CONCURRENT_TRANSFERS = 4


class Layout:
    def __init__(self, layers, piece):
        self.layers, self.piece = layers, piece
        self.block_bytes = layers * 2 * piece  # fully contiguous block

    def in_block(self, layer, kv):
        return (layer * 2 + kv) * self.piece


def _transfers(agent, op, local_kind, batches, chosen: set):
    """Issue batches of (local descs, remote descs), up to MAX_CONCURRENT_TRANSFERS in flight,
    each polled with get_xfer_status every 5 ms until done."""
    _in_flight(agent, [(op, local_kind, lo, re) for lo, re in batches], chosen)


def _in_flight(agent, items, chosen: set):
    """items: (op, local kind, local descs, remote descs); any mix of directions in flight."""
    pending, queue = [], list(items)
    while queue or pending:
        while queue and len(pending) < MAX_CONCURRENT_TRANSFERS:
            op, kind, local, remote = queue.pop(0)
            h = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, kind),
                agent.get_xfer_descs(remote, "FILE"),
                agent.name,
            )
            chosen.add((kind, agent.query_xfer_backend(h)))
            pending.append([h, agent.transfer(h), op])
        time.sleep(POLL_S)
        for item in list(pending):
            h, state, op = item
            if state == "PROC":
                state = item[1] = agent.check_xfer_state(h)
            if state != "PROC":
                pending.remove(item)
                agent.release_xfer_handle(h)
                assert state == "DONE", f"{op} batch ended {state}"


@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "disable-odirect"])
@pytest.mark.parametrize("backends", ["plugin", "posix+plugin"])
@pytest.mark.parametrize("kind", R.mem_kinds())
def test_kvbm_disk_tier(kind, backends, direct, plugin_so, tmp_path, rng, stderr_log):
    """backends "plugin": the worker creates only IO_URING_DMABUF (in place of POSIX/GDS_MT),
    so every request goes to it. "posix+plugin": the plugin in place of GDS_MT next to POSIX,
    as worker.rs builds it; NIXL then picks one of the two for each un-prepped DRAM<->FILE
    request that names no backend (not under the application's control: it varies between
    runs), while VRAM<->FILE requests can only go to the plugin."""
    if backends == "posix+plugin" and R.BACKEND != PLUGIN:
        pytest.skip("needs the plugin next to POSIX")
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    if kind == "VRAM":
        R.torch_cuda()
    created = ["POSIX", PLUGIN] if backends == "posix+plugin" else [R.BACKEND]
    chosen = replay(created, kind, direct, str(tmp_path), rng)
    print(f"backends NIXL chose (local kind, backend): {sorted(chosen)}")
    if backends == "plugin":
        assert {b for _, b in chosen} == {R.BACKEND}, f"NIXL chose {chosen}"
    else:
        assert {b for _, b in chosen} <= {"POSIX", PLUGIN}, f"NIXL chose {chosen}"
        if kind == "VRAM":
            assert ("VRAM", PLUGIN) in chosen and ("VRAM", "POSIX") not in chosen, chosen
    R.no_plugin_errors(stderr_log, f"Dynamo KVBM replay ({kind}, direct={direct})")


def replay(created, kind, direct, workdir, rng) -> set:
    """The KVBM disk-tier sequence with the backends `created` (in that order, each with its
    get_plugin_params defaults); returns the (local kind, backend) pairs NIXL chose."""
    from nixl._api import nixl_agent, nixl_agent_config

    if kind == "VRAM":
        lay = Layout(layers=32, piece=32 * KiB)  # Llama-3.1-8B: 2 MiB blocks
        n_host, n_dev, n_disk = 64, 128, 256
    else:
        lay = Layout(layers=8, piece=32 * KiB)  # 512 KiB blocks
        n_host, n_dev, n_disk = 32, 32, 64
    ledger = R.Ledger(f"dynamo-{kind}-{direct}")

    agent = nixl_agent(f"kvbm-worker-{os.getpid()}", nixl_agent_config(backends=[]))
    for b in created:
        agent.create_backend(b, agent.get_plugin_params(b))

    # G2 host pool and G1 device layers, registered to every backend that takes the kind.
    host = R.Mem("DRAM", n_host * lay.block_bytes)
    host_reg = agent.register_memory([(host.addr, host.size, 0, "")], "DRAM")
    dev_layers = [R.Mem(kind, 2 * n_dev * lay.piece) for _ in range(lay.layers)]
    dev_reg = agent.register_memory([(m.addr, m.size, m.dev, "") for m in dev_layers], kind)

    def dev_piece(layer, kv, block):  # layer-separate, outer dim K/V
        return (kv * n_dev + block) * lay.piece

    # G3 disk file.
    size = n_disk * lay.block_bytes
    fd, path = tempfile.mkstemp(prefix="dynamo-kvbm-disk-cache-", dir=workdir)
    if direct:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    os.posix_fallocate(fd, 0, size)
    disk_reg = agent.register_memory([(0, size, fd, "")], "FILE")
    chosen: set = set()

    # Fill the host blocks and the device pieces with unique chunks.
    for b in range(n_host):
        host.write(b * lay.block_bytes, ledger.make(f"host{b}", lay.block_bytes))
    for layer, m in enumerate(dev_layers):
        for kv in range(2):
            m.write(kv * n_dev * lay.piece, ledger.make(f"dev-l{layer}-kv{kv}", n_dev * lay.piece))
    disk_has: dict[int, tuple] = {}  # disk block -> ("host", chunk name) or ("dev", block)

    def batches(pairs, make):
        pairs = list(pairs)
        return [
            make(pairs[i : i + MAX_TRANSFER_BATCH_SIZE])
            for i in range(0, len(pairs), MAX_TRANSFER_BATCH_SIZE)
        ]

    # 1. Offload G2 -> G3: per-block descriptors, half of the disk.
    disk_perm = [int(x) for x in rng.permutation(n_disk)]
    off_pairs = list(zip(range(n_host), disk_perm[:n_host]))

    def per_block(pairs):
        return (
            [(host.addr + h * lay.block_bytes, lay.block_bytes, 0) for h, _ in pairs],
            [(d * lay.block_bytes, lay.block_bytes, fd) for _, d in pairs],
        )

    _transfers(agent, "WRITE", "DRAM", batches(off_pairs, per_block), chosen)
    for h, d in off_pairs:
        disk_has[d] = ("host", f"host{h}")

    # 2. G1 -> G3 direct: per-(layer, K/V) descriptors, into other disk blocks.
    g1_pairs = list(
        zip([int(x) for x in rng.permutation(n_dev)], disk_perm[n_host : n_host + n_dev])
    )

    def per_piece(pairs):
        local, remote = [], []
        for b, d in pairs:
            for layer in range(lay.layers):
                for kv in range(2):
                    m = dev_layers[layer]
                    local.append((m.addr + dev_piece(layer, kv, b), lay.piece, m.dev))
                    remote.append((d * lay.block_bytes + lay.in_block(layer, kv), lay.piece, fd))
        return local, remote

    _transfers(agent, "WRITE", kind, batches(g1_pairs, per_piece), chosen)
    for b, d in g1_pairs:
        disk_has[d] = ("dev", b)

    def expect_block(d):
        src, b = disk_has[d]
        if src == "host":
            return [(b, 0, lay.block_bytes)]
        # chunk "dev-l<layer>-kv<kv>" is the K (or V) half of a layer region: block b of it
        # starts at b * piece in its stream
        return [
            (f"dev-l{layer}-kv{kv}", b * lay.piece, lay.piece)
            for layer in range(lay.layers)
            for kv in range(2)
        ]

    def check_block(get, d, what):
        pos = 0
        for name, off, n in expect_block(d):
            ledger.check(get(pos, n), name, f"{what} (disk block {d}, bytes {pos}..)", offset=off)
            pos += n

    for d in disk_has:
        check_block(
            lambda pos, n, d=d: R.file_bytes(fd, d * lay.block_bytes + pos, n),
            d,
            "file after offload",
        )

    def poison_dev(blocks):
        for b in blocks:
            for layer, m in enumerate(dev_layers):
                for kv in range(2):
                    m.write(dev_piece(layer, kv, b), ledger.poison(f"dev{layer}", lay.piece))

    def check_dev(pairs):
        """Device block b must hold disk block d, piece by piece."""
        for b, d in pairs:
            for (name, off, _n), (layer, kv) in zip(
                expect_pieces(d), [(x, y) for x in range(lay.layers) for y in range(2)]
            ):
                got = dev_layers[layer].read(dev_piece(layer, kv, b), lay.piece)
                ledger.check(
                    got,
                    name,
                    f"device block {b} layer {layer} kv {kv} after READ of disk block {d}",
                    offset=off,
                )

    def expect_pieces(d):
        """expect_block(d) cut into (layer, K/V) pieces."""
        out = []
        for name, off, n in expect_block(d):
            for k in range(0, n, lay.piece):
                out.append((name, off + k, lay.piece))
        return out

    # 3. Onboard G3 -> G2 (READ, host memory local): every written disk block, in batches,
    #    into poisoned host blocks.
    written = [d for d in disk_perm if d in disk_has]
    for start in range(0, len(written), n_host):
        chunk = written[start : start + n_host]
        targets = [int(x) for x in rng.permutation(n_host)[: len(chunk)]]
        for h in targets:
            host.write(h * lay.block_bytes, ledger.poison(f"host{h}", lay.block_bytes))
        pairs = list(zip(targets, chunk))
        _transfers(agent, "READ", "DRAM", batches(pairs, per_block), chosen)
        for h, d in pairs:
            check_block(
                lambda pos, n, h=h: host.read(h * lay.block_bytes + pos, n),
                d,
                f"host block {h} after onboard",
            )

    # 4. G3 -> G1 direct READ: disk blocks written from the host, into poisoned device blocks.
    from_host = [d for d in written if disk_has[d][0] == "host"][:n_dev]
    dev_targets = [int(x) for x in rng.permutation(n_dev)[: len(from_host)]]
    poison_dev(dev_targets)
    pairs = list(zip(dev_targets, from_host))
    _transfers(agent, "READ", kind, batches(pairs, per_piece), chosen)
    check_dev(pairs)

    # 5. Both directions in flight at once: offload new host contents over the disk blocks
    #    that came from the host, while the disk blocks that came from the device are read
    #    back into (poisoned) device blocks.
    for h in range(n_host):
        host.write(h * lay.block_bytes, ledger.make(f"host-gen2-{h}", lay.block_bytes))
    over = list(zip(range(n_host), from_host))
    from_dev = [d for d in written if disk_has[d][0] == "dev"][:n_dev]
    dev_targets = [int(x) for x in rng.permutation(n_dev)[: len(from_dev)]]
    poison_dev(dev_targets)
    back = list(zip(dev_targets, from_dev))
    items = []
    for wb, rb in itertools.zip_longest(batches(over, per_block), batches(back, per_piece)):
        items += [("WRITE", "DRAM") + wb] if wb else []
        items += [("READ", kind) + rb] if rb else []
    _in_flight(agent, items, chosen)
    check_dev(back)
    for h, d in over:
        disk_has[d] = ("host", f"host-gen2-{h}")
        check_block(
            lambda pos, n, d=d: R.file_bytes(fd, d * lay.block_bytes + pos, n),
            d,
            "file after the mixed phase",
        )

    # Drop: deregister, close; the temp file is removed by the test.
    agent.deregister_memory(disk_reg)
    agent.deregister_memory(dev_reg)
    agent.deregister_memory(host_reg)
    os.close(fd)
    os.unlink(path)
    return chosen


_PRIVATE_DIR_CHILD = r"""
import sys
import numpy as np
sys.path[:0] = sys.argv[3:]
import test_replay_dynamo as D
from nixl._api import nixl_agent, nixl_agent_config
probe = nixl_agent("probe", nixl_agent_config(backends=[]))
# Each name reports the kinds of NIXL's own backend of that name (src/ffi/alias.rs) and our params.
for name, mems in (("GDS_MT", ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]), ("POSIX", ["DRAM_SEG", "FILE_SEG"])):
    assert probe.get_plugin_mem_types(name) == mems and \
        "ring_entries" in probe.get_plugin_params(name), name + " is not IO_URING_DMABUF"
chosen = D.replay(["GDS_MT", "POSIX"], "DRAM", sys.argv[2] == "1", sys.argv[1],
                  np.random.default_rng(7))
print("CHOSEN", sorted(chosen))
print("CHILD OK")
"""


@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "disable-odirect"])
def test_unpatched_dynamo_via_private_plugin_dir(direct, plugin_so, tmp_path):
    """No Dynamo change: a private NIXL_PLUGIN_DIR holding the plugin under both names that
    build_agent() creates (libplugin_GDS_MT.so and libplugin_POSIX.so, two copies), so
    whichever of the two NIXL picks for a request, it is IO_URING_DMABUF."""
    import shutil
    import subprocess
    import sys

    import iud_helpers as H

    if R.BACKEND != PLUGIN:
        pytest.skip("only meaningful for the plugin")
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    pdir = tmp_path / "private-plugins"
    pdir.mkdir()
    for name in ("GDS_MT", "POSIX"):
        shutil.copy(plugin_so, pdir / f"libplugin_{name}.so")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, NIXL_PLUGIN_DIR=str(pdir))
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _PRIVATE_DIR_CHILD,
            str(work),
            "1" if direct else "0",
            os.path.dirname(R.__file__),
            os.path.dirname(H.__file__),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "CHILD OK" in p.stdout, (
        f"child exited {p.returncode}:\n{out[-4000:]}"
    )
    assert not H.plugin_error_lines(p.stderr), f"plugin errors:\n{p.stderr[-3000:]}"
    print([ln for ln in p.stdout.splitlines() if ln.startswith("CHOSEN")])
