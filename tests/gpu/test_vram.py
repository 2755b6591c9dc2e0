"""VRAM <-> FILE through the real NIXL runtime on a CUDA GPU (run on the GPU machine by
ci/gpu/run.sh; on a machine without torch.cuda every test skips with one line saying why).

Data is random (torch.randint), never zeros, and verified byte for byte against the source
tensor and against the file's contents.
"""

import os
import threading

import pytest

torch = pytest.importorskip("torch", reason="GPU tests need PyTorch")
if not torch.cuda.is_available():
    pytest.skip(
        "GPU tests need a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True
    )
nixl_api = pytest.importorskip("nixl._api", reason="GPU tests need the NIXL wheel (nixl-cu13)")
nixl_bindings = pytest.importorskip(
    "nixl._bindings", reason="GPU tests need the NIXL wheel (nixl-cu13)"
)

MiB = 1 << 20
GiB = 1 << 30
SCRATCH = os.environ.get("IUD_GPU_SCRATCH", "/tmp")
_counter = [0]
# The route each registration takes is logged once at INFO ("VRAM ... <-> fd N: <route> (why)");
# the tests that check which path ran read it from stderr. Read when the plugin first loads.
os.environ.setdefault("IO_URING_DMABUF_LOG", "info")
ROUTE_NAMES = {"staging": "pinned host staging", "cufile": "cuFile", "dmabuf": "io_uring DMA-BUF"}


def doctor_lines():
    """The doctor's report (ci/gpu/run.sh sets IUD_DOCTOR; a local build has target/release)."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    exe = os.environ.get("IUD_DOCTOR") or os.path.join(
        here, "..", "..", "target", "release", "iud-doctor"
    )
    if not os.path.exists(exe):
        pytest.skip(
            f"no iud-doctor at {exe} (set IUD_DOCTOR): cannot tell what this machine offers"
        )
    return subprocess.run([exe], capture_output=True, text=True, check=True).stdout.splitlines()


def doctor_says(prefix):
    for line in doctor_lines():
        if line.strip().startswith(prefix):
            return line.strip()[len(prefix) :].strip()
    raise AssertionError(f"the doctor printed no line starting with {prefix!r}")


def make_agent(params):
    _counter[0] += 1
    name = f"gpu-test-{os.getpid()}-{_counter[0]}"
    agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=[]))
    agent.create_backend("IO_URING_DMABUF", params)
    return agent


def random_tensor(nbytes, device="cuda"):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)


def open_file(path, direct, size):
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    os.ftruncate(fd, size)
    return fd


def file_bytes(path, size):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read(size)), dtype=torch.uint8)


def run(agent, op, local, remote):
    h = agent.initialize_xfer(op, local, remote, agent.name)
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    agent.release_xfer_handle(h)
    assert state == "DONE", f"{op} ended in {state}"


def round_trip(agent, block, count, direct, path, src_offset=0, file_offset=0):
    """WRITE count blocks of VRAM to the file, READ them into a second tensor, verify both."""
    total = block * count
    src = random_tensor(src_offset + total)
    dst = torch.zeros(src_offset + total, dtype=torch.uint8, device="cuda")
    dst[:] = 7  # a known non-zero filler that must be overwritten
    fd = open_file(path, direct, file_offset + total)
    try:
        m_src = agent.register_memory([(src.data_ptr(), src.numel(), 0, "")], "VRAM")
        m_dst = agent.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "VRAM")
        m_file = agent.register_memory([(0, file_offset + total, fd, "")], "FILE")
        # Memory order reversed against file order, so nothing lines up by accident.
        order = list(reversed(range(count)))
        remote = agent.get_xfer_descs(
            [(file_offset + i * block, block, fd) for i in range(count)], "FILE"
        )
        run(
            agent,
            "WRITE",
            agent.get_xfer_descs(
                [(src.data_ptr() + src_offset + order[i] * block, block, 0) for i in range(count)],
                "VRAM",
            ),
            remote,
        )
        run(
            agent,
            "READ",
            agent.get_xfer_descs(
                [(dst.data_ptr() + src_offset + order[i] * block, block, 0) for i in range(count)],
                "VRAM",
            ),
            remote,
        )
        torch.cuda.synchronize()
        assert torch.equal(src[src_offset:], dst[src_offset:]), (
            "VRAM read back differs from VRAM written"
        )
        on_disk = file_bytes(path, file_offset + total)[file_offset:]
        expect = src[src_offset:].view(count, block).flip(0).reshape(-1).cpu()
        assert torch.equal(on_disk, expect), "file contents differ from the VRAM written"
        for m in (m_src, m_dst, m_file):
            agent.deregister_memory(m)
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("block", [4096, 64 * 1024, MiB, 16 * MiB, 64 * MiB])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_staging_round_trip(block, direct):
    agent = make_agent({"vram_path": "staging"})
    count = max(2, min(64, (128 * MiB) // block))
    round_trip(agent, block, count, direct, f"{SCRATCH}/iud-gpu-{block}-{direct}.bin")


@pytest.mark.parametrize(
    "block,count",
    [(16 * 1024, 4096), (64 * 1024, 1024), (256 * 1024, 256)],
    ids=["16KiB", "64KiB", "256KiB"],
)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize(
    "copy", ["auto", "kernel", "dma-kernel", "kernel-misaligned", "auto-kstreams1"]
)
def test_staging_scattered_small_blocks_round_trip(block, count, direct, copy, capfd):
    """KV-cache pattern on the staging path: blocks at random VRAM slots against random file
    slots (nothing merges), so the plugin packs several pieces per staging buffer and moves each
    buffer to the GPU with one call: the batched copy (auto) or the scatter kernel (staging_copy
    kernel / dma-kernel; "kernel-misaligned" shifts every VRAM block by 8 bytes, which the kernel
    cannot take, so those buffers fall back to the batched copy; "auto-kstreams1": the kernels on
    one device stream instead of four in turn, staging_kernel_streams=1). WRITE, then READ into a second
    tensor, verified byte for byte in VRAM, around the blocks, and in the file; the log names the
    copy call that ran."""
    if direct and copy == "kernel-misaligned":
        pytest.skip(
            "the misaligned fallback is covered by the buffered case (O_DIRECT adds nothing to it)"
        )
    nslots = count + count // 4  # spare slots: memory and file both have holes
    shift = 8 if copy == "kernel-misaligned" else 0
    src_all = random_tensor(nslots * block + shift)
    dst_all = random_tensor(nslots * block + shift)
    src, dst = src_all[shift:], dst_all[shift:]
    background = dst.clone()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    mem = torch.randperm(nslots, generator=g)[:count].tolist()
    fil = torch.randperm(nslots, generator=g)[:count].tolist()
    path = f"{SCRATCH}/iud-gpu-kv-{block}-{direct}-{copy}.bin"
    fd = open_file(path, direct, nslots * block)
    how, _, streams = copy.replace("-misaligned", "").partition("-kstreams")
    agent = make_agent(
        {"vram_path": "staging", "staging_copy": how, "staging_kernel_streams": streams or "4"}
    )
    capfd.readouterr()
    try:
        m_src = agent.register_memory([(src_all.data_ptr(), src_all.numel(), 0, "")], "VRAM")
        m_dst = agent.register_memory([(dst_all.data_ptr(), dst_all.numel(), 0, "")], "VRAM")
        m_file = agent.register_memory([(0, nslots * block, fd, "")], "FILE")
        remote = agent.get_xfer_descs([(f * block, block, fd) for f in fil], "FILE")
        run(
            agent,
            "WRITE",
            agent.get_xfer_descs([(src.data_ptr() + m * block, block, 0) for m in mem], "VRAM"),
            remote,
        )
        run(
            agent,
            "READ",
            agent.get_xfer_descs([(dst.data_ptr() + m * block, block, 0) for m in mem], "VRAM"),
            remote,
        )
        torch.cuda.synchronize()
        on_disk = file_bytes(path, nslots * block).view(nslots, block)
        src_rows, dst_rows = src.view(nslots, block), dst.view(nslots, block)
        want = background.view(nslots, block).clone()
        mem_t, fil_t = torch.tensor(mem), torch.tensor(fil)
        want[mem_t.cuda()] = src_rows[mem_t.cuda()]
        assert torch.equal(on_disk[fil_t], src_rows[mem_t.cuda()].cpu()), (
            "file slots differ from the VRAM blocks written"
        )
        assert torch.equal(dst_rows, want), (
            "VRAM after READ differs (blocks read, or the slots around them)"
        )
        for m in (m_src, m_dst, m_file):
            agent.deregister_memory(m)
    finally:
        os.close(fd)
        os.unlink(path)
    log = capfd.readouterr().err
    # Once per process: the first test of the process that packs pieces logs the copy call.
    copy_lines = [
        line
        for line in log.splitlines()
        if "staging copies of packed pieces use" in line
        or "cuMemcpyBatchAsync returned" in line
        or "scatter kernel" in line
    ]
    print("\n".join(copy_lines) or "(the copy call was logged by an earlier test of this process)")


def test_auto_round_trip_uses_a_working_path(capfd):
    """vram_path=auto moves the bytes, and over the path the doctor predicts for VRAM <-> FILE
    on this machine (cuFile only when really direct, else staging: the DMA-BUF path needs a raw
    NVMe block device)."""
    predicted = doctor_says("VRAM <-> FILE:").split()[0]
    assert predicted in ROUTE_NAMES, f"doctor's VRAM <-> FILE answer: {predicted}"
    agent = make_agent({})
    capfd.readouterr()
    round_trip(agent, MiB, 32, True, f"{SCRATCH}/iud-gpu-auto.bin")
    log = capfd.readouterr().err
    routes = [
        line
        for line in log.splitlines()
        if "<-> fd " in line
        and line.split("<-> fd ", 1)[1].split(": ", 1)[-1].startswith(tuple(ROUTE_NAMES.values()))
    ]
    assert routes, f"no route line in the plugin's log:\n{log[-2000:]}"
    taken = {name for name, text in ROUTE_NAMES.items() for line in routes if f": {text} (" in line}
    assert taken == {predicted}, f"auto took {taken}, the doctor predicted {predicted}: {routes}"


def test_registration_over_2_5_gib_with_descriptors_crossing_slab_boundaries():
    agent = make_agent({"vram_path": "staging", "staging_buffer_size": str(4 * MiB)})
    size = 5 * GiB // 2 + 4096
    src = random_tensor(size)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.fill_(3)
    path = f"{SCRATCH}/iud-gpu-slabs.bin"
    block = 24 * MiB
    # Each descriptor straddles a 1 GiB slab boundary (offsets relative to the registration).
    starts = [GiB - 8 * MiB, 2 * GiB - 12 * MiB, 4096, size - block]
    fd = open_file(path, True, len(starts) * block)
    try:
        m_src = agent.register_memory([(src.data_ptr(), size, 0, "")], "VRAM")
        m_dst = agent.register_memory([(dst.data_ptr(), size, 0, "")], "VRAM")
        m_file = agent.register_memory([(0, len(starts) * block, fd, "")], "FILE")
        remote = agent.get_xfer_descs([(i * block, block, fd) for i in range(len(starts))], "FILE")
        run(
            agent,
            "WRITE",
            agent.get_xfer_descs([(src.data_ptr() + s, block, 0) for s in starts], "VRAM"),
            remote,
        )
        run(
            agent,
            "READ",
            agent.get_xfer_descs([(dst.data_ptr() + s, block, 0) for s in starts], "VRAM"),
            remote,
        )
        torch.cuda.synchronize()
        for s in starts:
            assert torch.equal(src[s : s + block], dst[s : s + block]), f"block at {s} differs"
        untouched = dst[GiB + 64 * MiB : GiB + 128 * MiB]
        assert bool((untouched == 3).all()), "bytes outside the descriptors were written"
        for m in (m_src, m_dst, m_file):
            agent.deregister_memory(m)
    finally:
        os.close(fd)
        os.unlink(path)


def test_forced_dmabuf_refuses_cleanly_without_the_kernel_uapi(capfd):
    uapi = doctor_says("io_uring DMA-BUF uAPI:")
    if uapi.startswith("available"):
        pytest.skip(
            "this kernel has the io_uring DMA-BUF uAPI, so vram_path=dmabuf is not refused at registration (the NVMe lab covers that path)"
        )
    agent = make_agent({"vram_path": "dmabuf"})
    t = random_tensor(8 * MiB)
    capfd.readouterr()
    # The plugin answers NIXL_ERR_NOT_SUPPORTED; NIXL's agent reports every failed registration
    # as NIXL_ERR_BACKEND ("registration failed for the specified or all potential backends",
    # nixl_agent.cpp, seen on the H200 with nixl-cu13 1.5.1), so the log line carries the cause.
    with pytest.raises(nixl_bindings.nixlBackendError):
        agent.register_memory([(t.data_ptr(), t.numel(), 0, "")], "VRAM")
    log = capfd.readouterr().err
    assert "vram_path=dmabuf cannot work here" in log, (
        f"no refusal line naming the cause:\n{log[-2000:]}"
    )
    # The backend still moves DRAM afterwards.
    buf = torch.randint(0, 256, (MiB,), dtype=torch.uint8)
    back = torch.zeros(MiB, dtype=torch.uint8)
    path = f"{SCRATCH}/iud-gpu-after-refusal.bin"
    fd = open_file(path, False, MiB)
    try:
        agent.register_memory([(buf.data_ptr(), MiB, 0, ""), (back.data_ptr(), MiB, 0, "")], "DRAM")
        agent.register_memory([(0, MiB, fd, "")], "FILE")
        remote = agent.get_xfer_descs([(0, MiB, fd)], "FILE")
        run(agent, "WRITE", agent.get_xfer_descs([(buf.data_ptr(), MiB, 0)], "DRAM"), remote)
        run(agent, "READ", agent.get_xfer_descs([(back.data_ptr(), MiB, 0)], "DRAM"), remote)
        assert torch.equal(buf, back)
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("block", [4096, MiB, 16 * MiB])
def test_cufile_round_trip(block):
    """vram_path=cufile through libcufile (compatibility mode on machines without nvidia-fs or
    P2PDMA). cuFile wants O_DIRECT files."""
    agent = make_agent({"vram_path": "cufile"})
    round_trip(
        agent,
        block,
        max(2, min(32, (64 * MiB) // block)),
        True,
        f"{SCRATCH}/iud-gpu-cufile-{block}.bin",
    )


@pytest.mark.parametrize("block", [MiB, 16 * MiB])
def test_cufile_batch_api_round_trip(block):
    """vram_path=cufile with cufile_api=batch (cuFile's batch API, polled by checkXfer). Run in a
    child process with a deadline: NIXL's GDS backend, which uses the same API, hangs in cuFile's
    compatibility mode on the project's GPU machine. The plugin's batch sub-path must round-trip
    in both modes (in compatibility mode it did, 2-100x slower than threads: session-3 results);
    a hang or error fails with what happened."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_vram as t; "
        f"a = t.make_agent({{'vram_path': 'cufile', 'cufile_api': 'batch'}}); "
        f"t.round_trip(a, {block}, {max(2, min(32, (64 * MiB) // block))}, True, {SCRATCH!r} + '/iud-gpu-cufile-batch-{block}.bin'); "
        f"print('BATCH ROUND TRIP VERIFIED')"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        outcome = f"exit {r.returncode}: {(r.stdout + r.stderr).strip()[-600:]}"
        ok = r.returncode == 0 and "BATCH ROUND TRIP VERIFIED" in r.stdout
    except subprocess.TimeoutExpired:
        outcome, ok = "no completion within 120 s (hung)", False
    print(outcome)
    assert ok, f"cuFile batch API round trip: {outcome}"


@pytest.mark.parametrize("path", ["staging", "staging-kv", "cufile"])
def test_transfers_are_ordered_after_kernels_already_queued(path):
    """Applications post right after launching the kernel that fills a buffer (cuFile's copies
    run on the default stream, so that works with GDS). A ~100 ms kernel queued ahead of the
    fill makes any copy that does not wait for the default stream read stale bytes (WRITE) or
    be overwritten afterwards (READ). "staging-kv": 16 KiB blocks in reverse memory order (no
    two merge), so the READ's buffers go through the scatter kernel on four streams, three of
    them created during that request, after its post ordered the streams that existed then."""
    block = 16 * 1024 if path == "staging-kv" else 16 * MiB
    agent = make_agent({"vram_path": path.removesuffix("-kv")})
    n = 64 * MiB
    nb = n // block
    expected = random_tensor(n)
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    path_name = f"{SCRATCH}/iud-gpu-order-{path}.bin"
    fd = open_file(path_name, True, n)
    # File block i holds memory block nb-1-i.
    local = lambda t: agent.get_xfer_descs(  # noqa: E731 - one expression, used twice
        [(t.data_ptr() + (nb - 1 - i) * block, block, 0) for i in range(nb)], "VRAM"
    )
    try:
        agent.register_memory([(src.data_ptr(), n, 0, ""), (dst.data_ptr(), n, 0, "")], "VRAM")
        agent.register_memory([(0, n, fd, "")], "FILE")
        remote = agent.get_xfer_descs([(i * block, block, fd) for i in range(nb)], "FILE")
        torch.cuda._sleep(200_000_000)
        src.copy_(expected)  # queued behind the sleep on the default stream
        run(agent, "WRITE", local(src), remote)
        on_disk = file_bytes(path_name, n).view(nb, block)
        assert torch.equal(on_disk, expected.view(nb, block).flip(0).cpu()), (
            "WRITE read the buffer before the kernel that fills it"
        )
        torch.cuda._sleep(200_000_000)
        dst.fill_(7)  # queued behind the sleep; the READ must land after it
        run(agent, "READ", local(dst), remote)
        torch.cuda.synchronize()
        assert torch.equal(dst, expected), "READ landed before a kernel queued ahead of it"
    finally:
        os.close(fd)
        os.unlink(path_name)


@pytest.mark.privileged
@pytest.mark.parametrize("mode", ["fd", "path"])
def test_staging_round_trip_with_a_block_device(mode):
    """VRAM <-> BLK_SEG through the staging path: a loop device (O_DIRECT) over a file, in fd mode
    and path mode, random data in 1 MiB and 4 KiB descriptors verified in VRAM and on the device.
    Skips where no loop device can be set up (one line says why)."""
    import shutil
    import subprocess

    if shutil.which("losetup") is None:
        pytest.skip("no losetup on this machine")
    size = 64 * MiB
    image = f"{SCRATCH}/iud-gpu-blk-{mode}.img"
    with open(image, "wb") as f:
        f.truncate(size)
    r = subprocess.run(
        ["losetup", "--find", "--show", "--direct-io=on", image], capture_output=True, text=True
    )
    if r.returncode != 0:
        os.unlink(image)
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    dev = r.stdout.strip()
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    try:
        agent = make_agent({"vram_path": "staging"})
        src, dst = random_tensor(size), torch.zeros(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        agent.register_memory(
            [(src.data_ptr(), size, 0, ""), (dst.data_ptr(), size, 0, "")], "VRAM"
        )
        dev_id = fd if mode == "fd" else 4242
        agent.register_memory(
            [(0, size, dev_id, "" if mode == "fd" else f"rw,direct:{dev}")], "BLOCK"
        )
        pieces = [(i * MiB, MiB) for i in range(32)] + [
            (32 * MiB + i * 4096, 4096) for i in range(64)
        ]
        # Memory holds the pieces in reverse order, so nothing lines up with the device by accident.
        mem_off, pos = [0] * len(pieces), 0
        for k in reversed(range(len(pieces))):
            mem_off[k], pos = pos, pos + pieces[k][1]
        remote = agent.get_xfer_descs([(off, n, dev_id) for off, n in pieces], "BLOCK")
        run(
            agent,
            "WRITE",
            agent.get_xfer_descs(
                [(src.data_ptr() + mem_off[k], n, 0) for k, (_, n) in enumerate(pieces)], "VRAM"
            ),
            remote,
        )
        run(
            agent,
            "READ",
            agent.get_xfer_descs(
                [(dst.data_ptr() + mem_off[k], n, 0) for k, (_, n) in enumerate(pieces)], "VRAM"
            ),
            remote,
        )
        torch.cuda.synchronize()
        used = pos
        assert torch.equal(src[:used], dst[:used]), "VRAM read back from the block device differs"
        with open(dev, "rb") as f:
            on_dev = torch.frombuffer(bytearray(f.read(used)), dtype=torch.uint8)
        expect = torch.cat(
            [src[mem_off[k] : mem_off[k] + n] for k, (_, n) in enumerate(pieces)]
        ).cpu()
        assert torch.equal(on_dev, expect), "block device contents differ from the VRAM written"
    finally:
        os.close(fd)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        os.unlink(image)


def test_four_threads_stage_concurrently_on_one_agent():
    """Registration happens first (NIXL registers under its exclusive lock); then four threads
    post and poll their own requests on the shared engine at once."""
    agent = make_agent({"vram_path": "staging", "staging_buffers": "4"})
    block, count, threads_n = 2 * MiB, 16, 4
    total = block * count
    srcs = [random_tensor(total) for _ in range(threads_n)]
    dsts = [torch.zeros(total, dtype=torch.uint8, device="cuda") for _ in range(threads_n)]
    path = f"{SCRATCH}/iud-gpu-threads.bin"
    fd = open_file(path, True, threads_n * total)
    errors = []
    try:
        for t in srcs + dsts:
            agent.register_memory([(t.data_ptr(), total, 0, "")], "VRAM")
        agent.register_memory([(0, threads_n * total, fd, "")], "FILE")

        def worker(i):
            try:
                remote = agent.get_xfer_descs(
                    [(i * total + k * block, block, fd) for k in range(count)], "FILE"
                )
                for _ in range(3):
                    run(
                        agent,
                        "WRITE",
                        agent.get_xfer_descs(
                            [(srcs[i].data_ptr() + k * block, block, 0) for k in range(count)],
                            "VRAM",
                        ),
                        remote,
                    )
                    run(
                        agent,
                        "READ",
                        agent.get_xfer_descs(
                            [(dsts[i].data_ptr() + k * block, block, 0) for k in range(count)],
                            "VRAM",
                        ),
                        remote,
                    )
                    torch.cuda.synchronize()
                    if not torch.equal(srcs[i], dsts[i]):
                        errors.append(f"thread {i}: data differs")
                        return
                    dsts[i].zero_()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {i}: {e!r}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("path", ["staging", "cufile"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("fate", ["closed", "reused"])
def test_a_closed_or_reused_fd_is_refused_and_nothing_moves(path, op, fate, capfd):
    """The fd rule on the VRAM paths (mem/file.rs): after one post, the application closes the
    registered fd (or closes it and opens another file under its number); the next post is
    refused naming fd and cause, and neither file nor the VRAM changes. Through I/O the
    registration's own duplicate fd would still reach the registered file, so the refusal is
    what keeps the application's view and the registration's in agreement."""
    size = 8 * MiB
    agent = make_agent({"vram_path": path})
    a, b = f"{SCRATCH}/iud-gpu-fdrule-{path}-a.bin", f"{SCRATCH}/iud-gpu-fdrule-{path}-b.bin"
    direct = path == "cufile"  # cuFile wants O_DIRECT files
    with open(b, "wb") as f:
        f.write(os.urandom(size))
    b_bytes = file_bytes(b, size)
    vram = random_tensor(size)
    fd = open_file(a, direct, size)
    m_vram = agent.register_memory([(vram.data_ptr(), size, 0, "")], "VRAM")
    m_file = agent.register_memory([(0, size, fd, "")], "FILE")
    local = agent.get_xfer_descs([(vram.data_ptr() + i * MiB, MiB, 0) for i in range(8)], "VRAM")
    remote = agent.get_xfer_descs([((7 - i) * MiB, MiB, fd) for i in range(8)], "FILE")
    h = agent.initialize_xfer(op, local, remote, agent.name)
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    assert state == "DONE", state
    torch.cuda.synchronize()
    a_before, vram_before = file_bytes(a, size), vram.clone()
    if fate == "closed":
        os.close(fd)
    else:
        other = os.open(b, os.O_RDWR | (os.O_DIRECT if direct else 0))
        os.dup2(other, fd)
        os.close(other)
    capfd.readouterr()
    try:
        try:
            state = agent.transfer(h)
        except Exception as e:  # NIXL raises the backend's error status
            state = f"raised {type(e).__name__}"
        assert state not in ("DONE", "PROC"), f"the post after the fd was {fate} returned {state}"
        cause = "is no longer open" if fate == "closed" else "now refers to a different file"
        lines = [
            ln
            for ln in capfd.readouterr().err.splitlines()
            if f"fd {fd} registered as FILE for {a}" in ln
        ]
        assert len(lines) == 1 and cause in lines[0], lines
        torch.cuda.synchronize()
        assert torch.equal(file_bytes(a, size), a_before), "the registered file changed"
        assert torch.equal(file_bytes(b, size), b_bytes), "the other file changed"
        assert torch.equal(vram, vram_before), "VRAM changed"
    finally:
        agent.release_xfer_handle(h)
        agent.deregister_memory(m_file)
        agent.deregister_memory(m_vram)
        if fate == "reused":
            os.close(fd)
        os.unlink(a)
        os.unlink(b)
