"""The plugin's Vulkan allocator (include/iud_vulkan.h) through ctypes, and one NIXL round trip
over Vulkan allocations, shared by tests/python/test_vulkan.py (CPU machines, Mesa lavapipe)
and tests/gpu/test_vulkan_gpu.py (the GPU machine).

The allocator is loaded from the same file NIXL loads, so dlopen hands both the same library and
the plugin's engines see the allocations. Bytes are moved in and out of an allocation with
memmove for host-mapped variants and with libcuda's synchronous copies for the CUDA-mapped ones.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

OK, EINVAL, ENOTSUP, EFAIL, EINTERNAL = 0, -1, -2, -3, -4
HOST_VARIANTS = ("host-mapped", "vulkan-dmabuf+host")
CUDA_VARIANTS = ("opaque-fd+cuda", "vulkan-dmabuf+cuda")


class VulkanAlloc:
    """ctypes view of the four exported functions."""

    def __init__(self, plugin_so: str):
        self.lib = lib = ctypes.CDLL(plugin_so)
        lib.iud_vulkan_alloc.argtypes = [
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_uint64),
        ]
        lib.iud_vulkan_alloc.restype = ctypes.c_int
        lib.iud_vulkan_free.argtypes = [ctypes.c_uint64]
        lib.iud_vulkan_free.restype = ctypes.c_int
        lib.iud_vulkan_variant.argtypes = [ctypes.c_uint64]
        lib.iud_vulkan_variant.restype = ctypes.c_char_p
        lib.iud_vulkan_last_error.argtypes = []
        lib.iud_vulkan_last_error.restype = ctypes.c_char_p
        self._cuda = None

    def last_error(self) -> str:
        return (self.lib.iud_vulkan_last_error() or b"").decode()

    def try_alloc(self, size: int, device: int = 0):
        """(rc, address or None)."""
        out = ctypes.c_uint64(0)
        rc = self.lib.iud_vulkan_alloc(device, size, ctypes.byref(out))
        return rc, (out.value if rc == OK else None)

    def alloc(self, size: int, device: int = 0) -> int:
        rc, addr = self.try_alloc(size, device)
        assert rc == OK, f"iud_vulkan_alloc({device}, {size}) = {rc}: {self.last_error()}"
        return addr

    def free(self, addr: int) -> None:
        rc = self.lib.iud_vulkan_free(addr)
        assert rc == OK, f"iud_vulkan_free(0x{addr:x}) = {rc}: {self.last_error()}"

    def variant(self, addr: int):
        v = self.lib.iud_vulkan_variant(addr)
        return v.decode() if v is not None else None

    # ---- bytes in and out ----------------------------------------------------------------
    def _libcuda(self):
        if self._cuda is None:
            cu = ctypes.CDLL("libcuda.so.1")
            ctx = ctypes.c_void_p()
            dev = ctypes.c_int()
            for what, rc in (
                ("cuInit", cu.cuInit(0)),
                ("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0)),
                ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
            ):
                assert rc == 0, f"{what} = {rc}"
            cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
            cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
            self._cuda = (cu, ctx)
        cu, ctx = self._cuda
        assert cu.cuCtxSetCurrent(ctx) == 0
        return cu

    def put(self, addr: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if self.variant(addr) in CUDA_VARIANTS:
            rc = self._libcuda().cuMemcpyHtoD_v2(addr, data.ctypes.data, data.size)
            assert rc == 0, f"cuMemcpyHtoD = {rc}"
        else:
            ctypes.memmove(addr, data.ctypes.data, data.size)

    def get(self, addr: int, size: int) -> np.ndarray:
        out = np.empty(size, dtype=np.uint8)
        if self.variant(addr) in CUDA_VARIANTS:
            rc = self._libcuda().cuMemcpyDtoH_v2(out.ctypes.data, addr, size)
            assert rc == 0, f"cuMemcpyDtoH = {rc}"
        else:
            ctypes.memmove(out.ctypes.data, addr, size)
        return out


def _run(agent, op, local, remote, timeout=120.0):
    h = agent.initialize_xfer(op, local, remote, agent.name)
    try:
        state = agent.transfer(h)
        deadline = time.monotonic() + timeout
        while state == "PROC":
            assert time.monotonic() < deadline, f"{op} still PROC after {timeout} s"
            state = agent.check_xfer_state(h)
        assert state == "DONE", f"{op} ended in {state}"
    finally:
        agent.release_xfer_handle(h)


def round_trip(
    agent,
    vk: VulkanAlloc,
    path: str,
    *,
    size: int,
    block: int,
    direct: bool,
    rng: np.random.Generator,
    device: int = 0,
) -> str:
    """WRITE blocks of one Vulkan allocation to a file and READ them into a second one, in
    reversed memory order and at offsets inside the allocations, through two registrations per
    allocation (the whole allocation, and one starting at a page offset inside it). Verifies the
    file and the destination byte for byte, including bytes outside the descriptors. Returns the
    variant."""
    src_addr, dst_addr = vk.alloc(size, device), vk.alloc(size, device)
    variant = vk.variant(src_addr)
    regs = []
    fd = None
    try:
        src = np.frombuffer(rng.bytes(size), dtype=np.uint8)
        background = np.frombuffer(rng.bytes(size), dtype=np.uint8)
        vk.put(src_addr, src)
        vk.put(dst_addr, background)
        # Descriptors: every other block, starting one page in, so gaps and offsets both occur.
        starts = [4096 + 2 * i * block for i in range((size - 4096) // (2 * block))]
        assert len(starts) >= 2, "allocation too small for the layout"
        count = len(starts)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        os.ftruncate(fd, count * block)
        # The whole source allocation; the destination through a registration starting at a
        # page offset (descriptors then sit at offsets inside a registration that does not
        # start at the allocation).
        regs.append(agent.register_memory([(src_addr, size, device, "")], "VRAM"))
        regs.append(agent.register_memory([(dst_addr + 4096, size - 4096, device, "")], "VRAM"))
        regs.append(agent.register_memory([(0, count * block, fd, "")], "FILE"))
        order = list(reversed(range(count)))  # memory order reversed against file order
        remote = agent.get_xfer_descs([(i * block, block, fd) for i in range(count)], "FILE")
        _run(
            agent,
            "WRITE",
            agent.get_xfer_descs(
                [(src_addr + starts[order[i]], block, device) for i in range(count)], "VRAM"
            ),
            remote,
        )
        on_disk = np.fromfile(path, dtype=np.uint8, count=count * block)
        want = np.concatenate(
            [src[starts[order[i]] : starts[order[i]] + block] for i in range(count)]
        )
        assert np.array_equal(on_disk, want), "file contents differ from the Vulkan memory written"
        _run(
            agent,
            "READ",
            agent.get_xfer_descs(
                [(dst_addr + starts[order[i]], block, device) for i in range(count)], "VRAM"
            ),
            remote,
        )
        got = vk.get(dst_addr, size)
        expect = background.copy()
        for s in starts:
            expect[s : s + block] = src[s : s + block]
        if not np.array_equal(got, expect):
            bad = int(np.flatnonzero(got != expect)[0])
            raise AssertionError(f"destination differs at byte {bad} (variant {variant})")
    finally:
        for r in regs:
            agent.deregister_memory(r)
        if fd is not None:
            os.close(fd)
            os.unlink(path)
        vk.free(src_addr)
        vk.free(dst_addr)
    return variant
