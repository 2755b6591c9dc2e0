"""VRAM <-> FILE through the real NIXL runtime with gpu_provider=rocm, on a machine without an
AMD GPU: the plugin loads the fake HSA runtime of tests/rocm_double (IUD_HSA_LIBRARY), whose
"VRAM" is host memory it allocates and tracks; this test allocates that memory through the
double (ctypes, the same loaded copy the plugin uses), registers it as VRAM and moves random
data through the staging path (hsa_amd_memory_lock'ed buffers, hsa_amd_memory_async_copy with
completion signals), verified byte for byte in the file and in memory.

Needs a C compiler (cc, or $CC). Runs in the CPU CI; with IUD_TEST_BACKEND=POSIX it skips.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys

import iud_helpers as H
import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SRC = os.path.join(REPO, "tests", "rocm_double", "fake_hsa.c")


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    """The compiled double, loaded here and named to the plugin through IUD_HSA_LIBRARY."""
    if H.test_backend() != H.PLUGIN:
        pytest.skip("the ROCm provider is the plugin's; nothing to test against POSIX")
    out = str(tmp_path_factory.mktemp("rocm-double") / "libfake_hsa.so")
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-Wall", "-fvisibility=hidden", "-pthread", "-o", out, SRC],
        check=True,
    )
    prev = os.environ.get("IUD_HSA_LIBRARY")
    # The plugin reads it when its first VRAM registration loads the ROCm provider (once per
    # process); no other test of this process uses gpu_provider=rocm.
    os.environ["IUD_HSA_LIBRARY"] = out
    yield load_double(out)
    if prev is None:
        os.environ.pop("IUD_HSA_LIBRARY", None)
    else:
        os.environ["IUD_HSA_LIBRARY"] = prev


def load_double(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.fake_hsa_alloc_vram.restype = ctypes.c_void_p
    lib.fake_hsa_alloc_vram.argtypes = [ctypes.c_size_t]
    lib.fake_hsa_free_vram.argtypes = [ctypes.c_void_p]
    lib.fake_hsa_locked_ranges.restype = ctypes.c_int
    return lib


def vram(lib, size: int) -> tuple[int, np.ndarray]:
    addr = lib.fake_hsa_alloc_vram(size)
    assert addr, f"fake_hsa_alloc_vram({size})"
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
    return addr, arr


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_rocm_vram_staging_round_trip_through_nixl(double, rng, tmp_path, direct, direct_ok):
    if direct and not direct_ok:
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    alloc = 8 * H.MiB
    src_base, src = vram(double, alloc)
    dst_base, dst = vram(double, alloc)
    src[:] = H.rand_bytes(rng, alloc)
    dst[:] = H.rand_bytes(rng, alloc)
    background = dst.copy()

    # Registrations start inside their allocations; descriptors of mixed sizes, memory order
    # reversed against file order; 256 KiB staging buffers so pieces wrap around the pool.
    reg_off = 3 * H.ALIGN + (0 if direct else 100)
    reg_len = 6 * H.MiB
    sizes = (
        [4096, 65536, 1 << 20, 12288, 3 * H.MiB // 2, 4096 * 37]
        if direct
        else [1, 4095, 65537, 1 << 20, 77777, 3 * H.MiB // 2, 123]
    )
    n = len(sizes)
    file_offs = np.cumsum([0] + sizes[:-1]).tolist()
    mem_offs, pos = [0] * n, 0
    for i in reversed(range(n)):
        mem_offs[i] = pos
        pos += sizes[i] + (H.ALIGN if direct else 7)
    assert pos < reg_len
    file_size = sum(sizes)

    params = {
        "gpu_provider": "rocm",
        "vram_path": "staging",
        "staging_buffer_size": "262144",
        "staging_buffers": "4",
    }
    agent = H.make_agent(H.PLUGIN, params, name="rocm-double")
    rig = H.Rig(agent, H.PLUGIN)
    path = str(tmp_path / "rocm.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        os.ftruncate(fd, file_size)
        for base in (src_base, dst_base):
            rig.regs.append(agent.register_memory([(base + reg_off, reg_len, 0, "")], "VRAM"))
        rig.reg_fd(fd, file_size)
        files = [(f, s, fd) for f, s in zip(file_offs, sizes)]
        w = rig.xfer(
            "WRITE",
            [(src_base + reg_off + m, s, 0) for m, s in zip(mem_offs, sizes)],
            files,
            mem_kind="VRAM",
        )
        rig.run(w, what="VRAM WRITE (rocm, staging)")
        on_disk = H.read_file(fd, file_size)
        want_file = np.concatenate(
            [src[reg_off + m : reg_off + m + s] for m, s in zip(mem_offs, sizes)]
        )
        assert np.array_equal(on_disk, want_file), "file after WRITE: " + H.first_diff(
            on_disk, want_file
        )

        r = rig.xfer(
            "READ",
            [(dst_base + reg_off + m, s, 0) for m, s in zip(mem_offs, sizes)],
            files,
            mem_kind="VRAM",
        )
        rig.run(r, what="VRAM READ (rocm, staging)")
        want = background.copy()
        for m, s in zip(mem_offs, sizes):
            want[reg_off + m : reg_off + m + s] = src[reg_off + m : reg_off + m + s]
        assert np.array_equal(dst, want), "VRAM after READ: " + H.first_diff(dst, want)
    finally:
        rig.close()
        del rig, agent
        os.close(fd)
        double.fake_hsa_free_vram(src_base)
        double.fake_hsa_free_vram(dst_base)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_rocm_scattered_small_blocks_packed_through_staging(
    double, rng, tmp_path, direct, direct_ok
):
    """KV-cache pattern: many small blocks at random VRAM slots against random file slots, so no
    descriptors merge and the staging path packs several pieces into each buffer (one batched copy
    per buffer). Mixed block sizes (4-64 KiB, plus odd sizes when buffered) with a 256 KiB buffer
    exercise packing, alignment inside a buffer and a pool that wraps around many times; a second
    round reuses the prepared handles."""
    if direct and not direct_ok:
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    slot = 64 * 1024
    nslots = 192
    alloc = nslots * slot + H.MiB
    src_base, src = vram(double, alloc)
    dst_base, dst = vram(double, alloc)
    src[:] = H.rand_bytes(rng, alloc)
    dst[:] = H.rand_bytes(rng, alloc)
    background = dst.copy()
    choices = (
        [4096, 16384, 65536, 8192, 40960] if direct else [16384, 65536, 4096, 1000, 16385, 65535]
    )
    sizes = [int(rng.choice(choices)) for _ in range(nslots)]
    mem_slots = rng.permutation(nslots).tolist()
    file_slots = rng.permutation(nslots).tolist()
    file_size = nslots * slot
    params = {
        "gpu_provider": "rocm",
        "vram_path": "staging",
        "staging_buffer_size": "262144",
        "staging_buffers": "4",
    }
    agent = H.make_agent(H.PLUGIN, params, name="rocm-kv")
    rig = H.Rig(agent, H.PLUGIN)
    path = str(tmp_path / "rocm-kv.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        os.ftruncate(fd, file_size)
        for base in (src_base, dst_base):
            rig.regs.append(agent.register_memory([(base, nslots * slot, 0, "")], "VRAM"))
        rig.reg_fd(fd, file_size)
        files = [(f * slot, s, fd) for f, s in zip(file_slots, sizes)]
        w = rig.xfer(
            "WRITE",
            [(src_base + m * slot, s, 0) for m, s in zip(mem_slots, sizes)],
            files,
            mem_kind="VRAM",
        )
        r = rig.xfer(
            "READ",
            [(dst_base + m * slot, s, 0) for m, s in zip(mem_slots, sizes)],
            files,
            mem_kind="VRAM",
        )
        for round_ in range(2):
            if round_:
                src[:] = H.rand_bytes(rng, alloc)
            rig.run(w, what=f"scattered VRAM WRITE round {round_} (rocm, staging)")
            on_disk = H.read_file(fd, file_size)
            for m, f, s in zip(mem_slots, file_slots, sizes):
                got, want = on_disk[f * slot : f * slot + s], src[m * slot : m * slot + s]
                assert np.array_equal(got, want), (
                    f"file slot {f} ({s} B) after WRITE: " + H.first_diff(got, want)
                )
            rig.run(r, what=f"scattered VRAM READ round {round_} (rocm, staging)")
            want = background.copy()
            for m, s in zip(mem_slots, sizes):
                want[m * slot : m * slot + s] = src[m * slot : m * slot + s]
            assert np.array_equal(dst, want), "VRAM after READ: " + H.first_diff(dst, want)
            background = want
    finally:
        rig.close()
        del rig, agent
        os.close(fd)
        double.fake_hsa_free_vram(src_base)
        double.fake_hsa_free_vram(dst_base)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("max_io", [0, 65536], ids=["runs", "max_io_size-64K"])
def test_rocm_pages_end_to_end_in_a_slot_move_in_one_io_per_block(
    double, tmp_path, direct, direct_ok, max_io
):
    """The vLLM connector's slot layout: each block's 16 pages sit at scattered VRAM addresses
    (one per layer) and end to end in its file slot. The staging path reads and writes each
    block's pages as one storage I/O (a run), at most max_io_size long. The plugin's request
    profile (IO_URING_DMABUF_PROFILE=1, logged at INFO) counts the I/Os: the transfers run in a
    child process, since the plugin fixes its log level once per process."""
    if direct and not direct_ok:
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    env = dict(os.environ, IO_URING_DMABUF_PROFILE="1", IO_URING_DMABUF_LOG="info")
    child = subprocess.run(
        [sys.executable, __file__, "slots", str(tmp_path), str(int(direct)), str(max_io)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    ios = [
        int(x)
        for x in re.findall(
            r"profile: request done in [0-9.]+ ms: storage I/O [0-9.]+ ms summed over (\d+) I/Os",
            child.stderr,
        )
    ]
    blocks, block = SLOT_BLOCKS, SLOT_PAGE * SLOT_PAGES
    assert ios == [blocks * (block // max_io if max_io else 1)] * 2, (
        f"I/Os of the WRITE and the READ: {ios}\n{child.stderr}"
    )


SLOT_PAGE, SLOT_PAGES, SLOT_BLOCKS = 16384, 16, 8


def slots_round_trip(lib, tmp: str, direct: bool, max_io: int) -> None:
    """WRITE then READ 8 blocks of the slot layout (see the test above), every byte compared."""
    rng = np.random.default_rng()
    page, pages, blocks = SLOT_PAGE, SLOT_PAGES, SLOT_BLOCKS
    block = page * pages
    layer = 2 * H.MiB  # one VRAM region per page index
    alloc = pages * layer
    src_base, src = vram(lib, alloc)
    dst_base, dst = vram(lib, alloc)
    src[:] = H.rand_bytes(rng, alloc)
    dst[:] = H.rand_bytes(rng, alloc)
    mem_slots = rng.permutation(layer // page)[:blocks].tolist()
    file_slots = (2 * rng.permutation(blocks)).tolist()  # gaps between blocks in the file
    file_size = 2 * blocks * block
    params = {
        "gpu_provider": "rocm",
        "vram_path": "staging",
        "staging_buffer_size": str(H.MiB),
        "staging_buffers": "4",
        "progress_thread": "false",
    }
    if max_io:
        params["max_io_size"] = str(max_io)
    agent = H.make_agent(H.PLUGIN, params, name="rocm-slots")
    rig = H.Rig(agent, H.PLUGIN)
    path = os.path.join(tmp, "rocm-slots.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        os.ftruncate(fd, file_size)
        for base in (src_base, dst_base):
            rig.regs.append(agent.register_memory([(base, alloc, 0, "")], "VRAM"))
        rig.reg_fd(fd, file_size)
        mem = lambda base: [  # noqa: E731 - one expression, used twice
            (base + p * layer + m * page, page, 0) for m in mem_slots for p in range(pages)
        ]
        files = [(f * block + p * page, page, fd) for f in file_slots for p in range(pages)]
        w = rig.xfer("WRITE", mem(src_base), files, mem_kind="VRAM")
        r = rig.xfer("READ", mem(dst_base), files, mem_kind="VRAM")
        rig.run(w, what="slot WRITE (rocm, staging)")
        rig.run(r, what="slot READ (rocm, staging)")
        on_disk = H.read_file(fd, file_size)
        for b, (m, f) in enumerate(zip(mem_slots, file_slots)):
            for p in range(pages):
                want = src[p * layer + m * page : p * layer + (m + 1) * page]
                got = on_disk[f * block + p * page : f * block + (p + 1) * page]
                assert np.array_equal(got, want), (
                    f"block {b} page {p} in the file: " + H.first_diff(got, want)
                )
                back = dst[p * layer + m * page : p * layer + (m + 1) * page]
                assert np.array_equal(back, want), f"block {b} page {p} read back: " + H.first_diff(
                    back, want
                )
    finally:
        rig.close()
        del rig, agent
        os.close(fd)
        lib.fake_hsa_free_vram(src_base)
        lib.fake_hsa_free_vram(dst_base)


def test_rocm_host_memory_registered_as_vram_is_refused_by_name(double, stderr_log):
    agent = H.make_agent(
        H.PLUGIN, {"gpu_provider": "rocm", "vram_path": "staging"}, name="rocm-refuse"
    )
    host = H.Buf(1 << 16)
    with pytest.raises(H.nixl_errors()):
        agent.register_memory([(host.addr, host.size, 0, "")], "VRAM")
    err = stderr_log()
    assert f"VRAM registration 0x{host.addr:x}+{host.size}: not memory of the HSA runtime" in err, (
        err
    )


if __name__ == "__main__":
    # The child of the slot test: python test_rocm_double.py slots TMP DIRECT MAX_IO.
    _, what, tmp, direct, max_io = sys.argv
    assert what == "slots", what
    slots_round_trip(load_double(os.environ["IUD_HSA_LIBRARY"]), tmp, direct == "1", int(max_io))
