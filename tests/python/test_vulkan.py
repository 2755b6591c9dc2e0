"""gpu_provider=vulkan on a machine without a GPU: Mesa's lavapipe (a CPU Vulkan driver) backs the
allocations of the plugin's Vulkan allocator (include/iud_vulkan.h), which NIXL then moves as
VRAM through the staging path, byte-verified. Every test skips with one line where no Vulkan
driver is installed (apt-get install mesa-vulkan-drivers gives lavapipe). The CUDA-mapped
variants run on the GPU machine (tests/gpu/test_vulkan_gpu.py)."""

from __future__ import annotations

import iud_helpers as H
import numpy as np
import pytest
from iud_vulkan import EINVAL, ENOTSUP, HOST_VARIANTS, OK, VulkanAlloc, round_trip

MiB = 1 << 20


@pytest.fixture(scope="module")
def vk(plugin_so, backend):
    if backend != H.PLUGIN:
        pytest.skip(f"the Vulkan allocator is part of {H.PLUGIN}, not {backend}")
    v = VulkanAlloc(plugin_so)
    rc, addr = v.try_alloc(4096)
    if rc == ENOTSUP:
        pytest.skip(f"no Vulkan driver here: {v.last_error()}")
    assert rc == OK, f"iud_vulkan_alloc failed with {rc}: {v.last_error()}"
    variant = v.variant(addr)
    v.free(addr)
    if variant not in HOST_VARIANTS:
        pytest.skip(f"variant {variant} needs CUDA (tests/gpu/test_vulkan_gpu.py covers it)")
    print(f"Vulkan allocator variant: {variant}")
    return v


@pytest.mark.parametrize("vram_path", ["staging", "auto"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_round_trip_through_vulkan_allocations(vk, vram_path, direct, direct_ok, rng, tmp_path):
    if direct and not direct_ok:
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    agent = H.make_agent(H.PLUGIN, {"gpu_provider": "vulkan", "vram_path": vram_path})
    for size, block in ((8 * MiB, 256 * 1024), (MiB + 8192, 4096)):
        variant = round_trip(
            agent,
            vk,
            str(tmp_path / f"vk-{size}.bin"),
            size=size,
            block=block,
            direct=direct,
            rng=rng,
        )
        assert variant in HOST_VARIANTS


def test_memory_not_from_the_allocator_is_refused_with_what_to_do(vk, capfd):
    agent = H.make_agent(H.PLUGIN, {"gpu_provider": "vulkan", "vram_path": "staging"})
    buf = H.Buf(MiB)
    capfd.readouterr()
    with pytest.raises(H.nixl_errors()):
        agent.register_memory([(buf.addr, MiB, 0, "")], "VRAM")
    err = capfd.readouterr().err
    assert f"0x{buf.addr:x}" in err and "iud_vulkan_alloc" in err, err


def test_allocator_refuses_bad_arguments_with_a_reason(vk):
    rc, _ = vk.try_alloc(0)
    assert rc == EINVAL and "size 0" in vk.last_error()
    assert vk.lib.iud_vulkan_free(0x1000) == EINVAL
    assert "not the start of an allocation" in vk.last_error()
    assert vk.variant(0x1000) is None
    addr = vk.alloc(3 * 4096)
    try:
        assert vk.variant(addr + 3 * 4096 - 1) == vk.variant(addr)
        rc, _ = vk.try_alloc(4096, device=99)
        assert rc == EINVAL and "does not exist" in vk.last_error()
    finally:
        vk.free(addr)
    assert vk.variant(addr) is None


def test_allocations_survive_an_agent_and_free_after_deregistration(vk, rng, tmp_path):
    """The allocator's registry is process-wide: an allocation outlives the agent that moved
    it, and a second agent moves it again."""
    addr = vk.alloc(MiB)
    try:
        data = np.frombuffer(rng.bytes(MiB), dtype=np.uint8)
        vk.put(addr, data)
        for _i in range(2):
            agent = H.make_agent(H.PLUGIN, {"gpu_provider": "vulkan", "vram_path": "staging"})
            r = agent.register_memory([(addr, MiB, 0, "")], "VRAM")
            agent.deregister_memory(r)
            del agent
        assert np.array_equal(vk.get(addr, MiB), data)
    finally:
        vk.free(addr)
