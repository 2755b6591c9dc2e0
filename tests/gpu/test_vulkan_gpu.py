"""gpu_provider=vulkan on the GPU machine (run by ci/gpu/run.sh, step `tests` or `vulkan`):
memory from the plugin's Vulkan allocator (include/iud_vulkan.h, through ctypes on the plugin
file NIXL loads), filled with random bytes through libcuda, registered as VRAM, written to a file
and read back into a second Vulkan allocation by NIXL with vram_path=staging, verified byte for
byte. Skips with one line where no Vulkan loader or driver is present (ci/gpu/run.sh unpacks the
loader carried in .device/gpu/vk and points VK_DRIVER_FILES at NVIDIA's ICD)."""

import os
import sys

import pytest

np = pytest.importorskip("numpy", reason="the Vulkan GPU test needs numpy")
nixl_api = pytest.importorskip("nixl._api", reason="GPU tests need the NIXL wheel (nixl-cu13)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from iud_vulkan import ENOTSUP, OK, VulkanAlloc, round_trip  # noqa: E402

MiB = 1 << 20
SCRATCH = os.environ.get("IUD_GPU_SCRATCH", "/tmp")
PLUGIN_SO = os.path.join(os.environ.get("NIXL_PLUGIN_DIR", ""), "libplugin_IO_URING_DMABUF.so")
_counter = [0]


@pytest.fixture(scope="module")
def vk():
    if not os.path.exists(PLUGIN_SO):
        pytest.skip(f"{PLUGIN_SO} does not exist (NIXL_PLUGIN_DIR is set by ci/gpu/run.sh)")
    v = VulkanAlloc(PLUGIN_SO)
    rc, addr = v.try_alloc(4096)
    if rc == ENOTSUP:
        pytest.skip(f"no Vulkan loader or driver: {v.last_error()}")
    assert rc == OK, f"iud_vulkan_alloc failed with {rc}: {v.last_error()}"
    print(f"\nVulkan allocator variant on device 0: {v.variant(addr)}")
    v.free(addr)
    return v


def make_agent(params):
    _counter[0] += 1
    agent = nixl_api.nixl_agent(
        f"gpu-vk-{os.getpid()}-{_counter[0]}", nixl_api.nixl_agent_config(backends=[])
    )
    agent.create_backend("IO_URING_DMABUF", params)
    return agent


@pytest.mark.parametrize(
    "size,block", [(64 * MiB, MiB), (4 * MiB + 8192, 4096), (256 * MiB, 16 * MiB)]
)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_vulkan_staging_round_trip(vk, size, block, direct):
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    agent = make_agent({"gpu_provider": "vulkan", "vram_path": "staging"})
    variant = round_trip(
        agent,
        vk,
        f"{SCRATCH}/iud-gpu-vk-{size}-{direct}.bin",
        size=size,
        block=block,
        direct=direct,
        rng=rng,
    )
    print(
        f"variant {variant}: {size} B allocations, {block} B blocks, {'O_DIRECT' if direct else 'buffered'}: verified"
    )


def test_vulkan_auto_path_moves_the_memory_and_reports_its_choice(vk):
    """vram_path=auto: whatever the ladder picks (dmabuf needs the io_uring DMA-BUF uAPI and an
    NVMe target; cuFile and staging otherwise) must move the bytes correctly."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    agent = make_agent({"gpu_provider": "vulkan"})
    round_trip(
        agent, vk, f"{SCRATCH}/iud-gpu-vk-auto.bin", size=16 * MiB, block=MiB, direct=True, rng=rng
    )


def test_plain_cuda_memory_is_refused_by_the_vulkan_provider(vk):
    """Memory the allocator did not make cannot be mapped back to a Vulkan allocation."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    agent = make_agent({"gpu_provider": "vulkan", "vram_path": "staging"})
    with pytest.raises(Exception):  # noqa: B017 - any error, as long as nothing is written
        agent.register_memory([(t.data_ptr(), MiB, 0, "")], "VRAM")


def test_free_releases_memory(vk):
    """Allocate and free 64 x 256 MiB (16 GiB in all, one at a time): a leak of the CUDA import
    or the Vulkan memory would show as growing device memory use."""
    torch = pytest.importorskip("torch")
    free0, _ = torch.cuda.mem_get_info()
    for _ in range(64):
        vk.free(vk.alloc(256 * MiB))
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 < 512 * MiB, f"device memory in use grew by {(free0 - free1) >> 20} MiB"
