"""vLLM on a GPU through the storage connector (issue 27): time to first token of 8k- and
32k-token prompts recomputed, served from storage by the connector (IO_URING_DMABUF or NIXL's
GDS_MT behind it, page-cache or O_DIRECT slot files), and restored by vLLM's own CPU offload +
`fs` tier from a new engine; decode tokens/s with stores running; the tokens of every variant
compared with recompute. Runs on the GPU machine (ci/gpu/vllm-run.sh sets up the environment).

    python3 bench/vllm_connector_gpu.py model DIR              # random Llama-3.1-8B-shaped model
    python3 bench/vllm_connector_gpu.py engines --model DIR --work W plain iud-pc ...
    python3 bench/vllm_connector_gpu.py report --work W --out FILE.md

Each variant is one engine in a new process (in-process engine core,
VLLM_ENABLE_V1_MULTIPROCESSING=0); its rounds append to W/results.jsonl as they finish, so a
device call that ends early keeps what ran. Prompts are token ids from fixed seeds: the same in
every variant. TTFT = wall time of `LLM.generate` of one prompt with max_tokens 1.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import time

from vllm_gpu_variants import (
    BLOCK,
    CHECK_TOKENS,
    DECODE_BATCH,
    DECODE_PAIRS,
    DECODE_PROMPT,
    DECODE_TOKENS,
    DTYPE,
    GPU_BLOCKS,
    GRAPHS,
    LLAMA_8B,
    MAX_MODEL_LEN,
    SHARED,
    TIERS,
    VARIANTS,
    base_variant,
    engine_args,
    kind_of,
    kv_config,
    prompt_ids,
    reuses,
    store_of,
    test_prompts,
    tier_role,
    tier_store,
    variant_name,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# ----------------------------------------------------------------------------------- the model


def make_model(model_dir: str) -> None:
    """A random-weights LlamaForCausalLM of Llama-3.1-8B's shape, made by transformers on the GPU
    and saved as safetensors, with a word-level tokenizer ("w<id>" is token id) built here."""
    if os.path.isfile(os.path.join(model_dir, ".complete")):
        print(f"model: {model_dir} exists")
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.monotonic()
    tmp = model_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, LLAMA_8B["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_MODEL_LEN,
    ).save_pretrained(tmp)
    torch.manual_seed(0)
    dtype = getattr(torch, DTYPE)
    torch.set_default_dtype(dtype)
    cfg = LlamaConfig(**LLAMA_8B)
    cfg.dtype = dtype
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp, max_shard_size="5GB")
    del model
    with open(os.path.join(tmp, ".complete"), "w") as f:
        json.dump({"params": n, **LLAMA_8B}, f)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.rename(tmp, model_dir)
    print(
        f"model: {n / 1e9:.2f} B parameters saved to {model_dir} in {time.monotonic() - t0:.1f} s"
    )


# ------------------------------------------------------------------------------ engine (child)
def damage_slots(store: str, every: int) -> list[int]:
    """Zeroes the first 4 KiB of every `every`-th committed slot of rank 0 (from its journal),
    behind a running engine's back: its scheduler still lists them, so the damage is found only
    by the worker's check after the load. Returns the slots damaged."""
    from nixl_io_uring_dmabuf.vllm_connector import journal, layout

    with open(os.path.join(store, "store.json")) as f:
        geo = layout.Geometry.from_manifest(json.load(f))
    with open(os.path.join(store, "rank0of1", "commits.log"), "rb") as f:
        recs, _, _ = journal.parse(f.read())
    slots = sorted({r.slot for r in recs if r.type == journal.COMMIT})[::every]
    for s in slots:
        fi, off = geo.locate(s)
        fd = os.open(geo.slot_path(store, 0, fi), os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(4096), off)
            if geo.devices:
                os.fsync(fd)  # through the device's page cache to the medium the store reads
        finally:
            os.close(fd)
    return slots


class Engine:
    def __init__(self, variant: str, model: str, work: str, shared: bool = False):
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        self.variant, self.work = variant, work
        self.SP = SamplingParams
        args = {
            "model": model,
            "tokenizer": model,
            "dtype": DTYPE,
            "seed": 0,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK,
        }
        if variant.endswith(GRAPHS):
            # CUDA graphs for decode batches without torch.compile (no compile time, no triton)
            args.update(
                enforce_eager=False,
                compilation_config={
                    "mode": 0,
                    "cudagraph_mode": "FULL_DECODE_ONLY",
                    "cudagraph_capture_sizes": [1, 2, 4, DECODE_BATCH],
                },
            )
        if GPU_BLOCKS and shared:
            # two engines on the one GPU: a third of the KV blocks each (one 32k prompt takes
            # 2049), within 42 % of the GPU's memory each
            args.update(num_gpu_blocks_override=GPU_BLOCKS // 3, gpu_memory_utilization=0.42)
        elif GPU_BLOCKS:
            args.update(num_gpu_blocks_override=GPU_BLOCKS, gpu_memory_utilization=0.85)
        else:  # vLLM's CPU platform: the fraction of this machine's memory it reserves
            args.update(gpu_memory_utilization=0.15 if shared else 0.3)
        args.update(engine_args(variant))
        cfg = kv_config(variant, work)
        if cfg is not None:
            args["kv_transfer_config"] = KVTransferConfig(**cfg)
        t0 = time.monotonic()
        self.llm = LLM(**args)
        self.start_s = time.monotonic() - t0
        self.flush_seed = 0

    def gen(self, ids, max_tokens: int):
        p = self.SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        return dt, list(out.outputs[0].token_ids), out.num_cached_tokens or 0

    def gen_batch(self, prompts, max_tokens: int) -> float:
        p = self.SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], p, use_tqdm=False)
        return time.perf_counter() - t0

    def reset(self) -> None:
        for _ in range(200):
            if self.llm.reset_prefix_cache():
                return
            self.tick()
        raise RuntimeError("reset_prefix_cache kept failing")

    def tick(self) -> None:
        """One short request: an engine step, in which the connector polls its jobs."""
        self.flush_seed += 1
        self.gen(prompt_ids(6, 7_000_000 + self.flush_seed), 1)

    def stored_blocks(self) -> int:
        kind = VARIANTS[base_variant(self.variant)][0]
        if kind == "cpu":  # vLLM's CPU tier keeps no record outside the engine to count
            return 0
        if kind == "fs":
            return len(glob.glob(os.path.join(self.work, "fs", "**", "*.bin"), recursive=True))
        if kind == "nixltier":  # one file per chunk; 16-token blocks, chunks of one block
            return len(glob.glob(os.path.join(self.work, kind, "*.kv")))
        from nixl_io_uring_dmabuf.vllm_connector import journal

        path = os.path.join(store_of(self.variant, self.work), "rank0of1", "commits.log")
        with open(path, "rb") as f:
            recs, _, _ = journal.parse(f.read())
        return sum(r.type == journal.COMMIT for r in recs)

    def settle(self, quiet: float = 1.0, timeout: float = 60.0) -> dict:
        """Steps the engine until no block has been committed for `quiet` seconds: the stores
        of the last batch are over."""
        if VARIANTS[base_variant(self.variant)][0] is None:
            return {}
        t0, n, last = time.monotonic(), self.stored_blocks(), time.monotonic()
        while time.monotonic() - last < quiet and time.monotonic() - t0 < timeout:
            self.tick()
            time.sleep(0.02)
            m = self.stored_blocks()
            if m != n:
                n, last = m, time.monotonic()
        return {"settle_s": round(last - t0, 3), "stored_blocks": n}

    def flush(self, expected: int, timeout: float = 120.0) -> dict:
        """Steps the engine until `expected` blocks are committed to storage."""
        t0, n = time.monotonic(), self.stored_blocks()
        if VARIANTS[base_variant(self.variant)][0] == "cpu":
            # vLLM's CPU tier: nothing to count; its device-to-host copies of the round (16 GB
            # at 10 GB/s or more) are over after 5 s of engine steps, and the hit rounds' cached
            # tokens show whether they were
            while time.monotonic() - t0 < 5.0:
                self.tick()
            return {"stored_blocks": "-", "expected_blocks": expected, "flush_s": 5.0}
        while n < expected and time.monotonic() - t0 < timeout:
            self.tick()
            time.sleep(0.005)
            n = self.stored_blocks()
        return {
            "stored_blocks": n,
            "expected_blocks": expected,
            "flush_s": round(time.monotonic() - t0, 3),
        }


class StepClock:
    """Times each step of the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) by
    wrapping its get_output: wall time, the engine thread's CPU time and run-queue wait
    (/proc/thread-self/schedstat), tokens, and whether it was a decode step (every request that
    got a token had one before). With IUD_VLLM_BENCH_SAMPLE=1 a thread also samples the engine
    thread's Python stack every 2 ms during steps, with the kernel function it sleeps in and its
    system call (/proc/<pid>/task/<tid>/wchan and syscall): where the slow steps (over twice the
    round's median) spend their time. Sampling takes the GIL, so it is a diagnostic, off by
    default."""

    def __init__(self, llm):
        core = llm.llm_engine.engine_core
        self._inner = core.get_output
        core.get_output = self._step
        self.steps: list | None = None
        self._seen: set = set()
        self._samples: list | None = None
        if os.environ.get("IUD_VLLM_BENCH_SAMPLE") == "1":
            import threading

            self._tid = threading.get_ident()
            self._task = f"/proc/self/task/{threading.get_native_id()}"
            threading.Thread(target=self._sample, daemon=True, name="bench-sampler").start()

    def start(self) -> None:
        self.steps, self._seen = [], set()

    def stop(self) -> tuple[list, dict]:
        """The round's steps, and the stacks most often sampled in its slow decode steps."""
        steps, self.steps = self.steps or [], None
        dec = sorted(s[0] for s in steps if s[4])
        slow: dict = {}
        if dec:
            limit = 2 * dec[len(dec) // 2]
            for s in steps:
                if s[4] and s[0] > limit:
                    for where in s[5]:
                        slow[where] = slow.get(where, 0) + 1
        kernel: dict = {}
        for where, n in slow.items():
            k = "kernel: " + where.split(" | ")[0]
            kernel[k] = kernel.get(k, 0) + n
        top = dict(sorted(slow.items(), key=lambda kv: -kv[1])[:6])
        top.update(sorted(kernel.items(), key=lambda kv: -kv[1])[:4])
        return steps, top

    def _sample(self) -> None:
        while True:
            time.sleep(0.002)
            samples = self._samples
            if samples is None:
                continue
            f = sys._current_frames().get(self._tid)
            where = []
            while f is not None and len(where) < 3:
                where.append(
                    f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}:{f.f_code.co_name}"
                )
                f = f.f_back
            samples.append(f"{self._kernel_state()} | " + " < ".join(where))

    def _kernel_state(self) -> str:
        """The engine thread's system call number (or `running`) and kernel wait function."""
        try:
            with open(f"{self._task}/syscall") as f:
                call = f.read().split()[0]
            with open(f"{self._task}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            return "?"
        return f"sys {call} {wchan}"

    def _step(self):
        if self.steps is None:
            return self._inner()
        samples: list = []
        c0, t0 = schedstat(), time.perf_counter()
        self._samples = samples
        try:
            out = self._inner()
        finally:
            self._samples = None
        dt, c1 = time.perf_counter() - t0, schedstat()
        ids = [o.request_id for o in out.outputs if o.new_token_ids]
        decode = bool(ids) and all(i in self._seen for i in ids)
        self._seen.update(ids)
        self.steps.append(
            (dt, (c1[0] - c0[0]) / 1e9, (c1[1] - c0[1]) / 1e9, len(ids), decode, samples)
        )
        return out


def schedstat() -> tuple[int, int]:
    """This thread's CPU time and run-queue wait, in ns."""
    with open("/proc/thread-self/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run), int(wait)


def machine_cpu() -> list[int]:
    """The machine's CPU ticks: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def machine_delta(a: list[int], b: list[int]) -> dict:
    d = [y - x for x, y in zip(a, b)]
    total = sum(d) or 1
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {n: round(x / total, 3) for n, x in zip(names, d)}


def step_summary(steps: list) -> dict:
    """Decode steps only: their count, tokens, time, and per step: wall time (p50, p90), the
    engine thread's CPU time and run-queue wait."""
    dec = [s for s in steps if s[4]]
    if not dec:
        return {"decode_steps": 0}
    walls = sorted(s[0] for s in dec)
    n, wall = len(dec), sum(walls)
    return {
        "decode_steps": n,
        "decode_tokens": sum(s[3] for s in dec),
        "decode_s": round(wall, 4),
        "decode_tokens_per_s": round(sum(s[3] for s in dec) / wall, 1),
        "step_ms_p50": round(1e3 * walls[n // 2], 3),
        "step_ms_p90": round(1e3 * walls[min(n - 1, int(n * 0.9))], 3),
        "step_ms_max": round(1e3 * walls[-1], 3),
        "engine_cpu_ms_per_step": round(1e3 * sum(s[1] for s in dec) / n, 3),
        "runqueue_ms_per_step": round(1e3 * sum(s[2] for s in dec) / n, 3),
        "all_steps": len(steps),
        "all_steps_s": round(sum(s[0] for s in steps), 4),
    }


def kv_stats(prefix: str) -> dict:
    try:
        with open(prefix + ".0") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def thread_cpu() -> dict:
    """CPU seconds of this process's threads, summed by name without its number (iud-pagecache,
    iud-progress, python3, NIXL's and CUDA's threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(task + "/comm") as f:
                name = f.read().strip().rstrip("0123456789").rstrip("-_:") or "?"
            with open(task + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(a: dict, b: dict) -> dict:
    """Threads that ended between a and b are missing from b; their time is lost, not negative."""
    d = {k: round(v - a.get(k, 0.0), 3) for k, v in b.items()}
    return {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def delta(a: dict, b: dict) -> dict:
    out = {}
    for d in ("store", "load"):
        x, y = a.get(d, {}), b.get(d, {})
        # poll_max is the engine's longest check_xfer_state so far, not a count
        out[d] = {k: y[k] if k == "poll_max" else y.get(k, 0) - x.get(k, 0) for k in y}
    return out


def marker(work: str, variant: str, what: str) -> str:
    """A file by which the two engines of a shared variant tell each other where they are."""
    return os.path.join(work, f"{variant}.{what}")


def wait_for(path: str, timeout: float = 900.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.1)


def run_variant(
    variant: str, model: str, work: str, results: str, only: str | None, role: str | None = None
) -> None:
    # The worker's counters file (its own thread rewrites it after each poll that ended jobs),
    # in memory unless IUD_VLLM_BENCH_STATS_DIR names a place: run 3 rewrote it from the engine's
    # thread on the disk its O_DIRECT stores kept busy, and decode steps stalled.
    where = os.environ.get("IUD_VLLM_BENCH_STATS_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else work
    )
    stats = os.path.join(where, f"iud-stats-{variant}" + (f"-{role}" if role else ""))
    os.environ["IUD_KV_STATS_FILE"] = stats
    if role == "second":  # starts once the first engine is up (no GPU memory profiled twice)
        wait_for(marker(work, variant, "up"))
    t0 = time.monotonic()
    eng = Engine(variant, model, work, shared=role is not None)
    if role == "first":
        open(marker(work, variant, "up"), "w").close()
    prompts = test_prompts()

    def emit(rnd: str, rows: list, **extra) -> None:
        rec = {"variant": variant, "round": rnd, "rows": rows, **extra}
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
        brief = [(r["prompt"], round(r["s"], 3), r["cached"]) for r in rows]
        print(f"[{variant}] {rnd}: {brief} {json.dumps(extra)[:300]}", flush=True)

    def ttft_round(rnd: str, max_tokens: int = 1) -> None:
        before = kv_stats(stats)
        rows = []
        for name, ids in prompts:
            s, toks, cached = eng.gen(ids, max_tokens)
            rows.append({"prompt": name, "len": len(ids), "s": s, "tokens": toks, "cached": cached})
        emit(rnd, rows, kv=delta(before, kv_stats(stats)))

    emit(
        "start",
        [],
        start_s=round(eng.start_s, 2),
        versions=versions(),
        blocks=[len(ids) // BLOCK for _, ids in prompts],
    )
    expected = sum(len(ids) // BLOCK for _, ids in prompts)
    if only == "decode":
        pass
    elif role == "first":  # stores the prompts, then stays up until the second is done
        ttft_round("store")
        emit("flush", [], **eng.flush(expected))
        open(marker(work, variant, "stored"), "w").close()
        wait_for(marker(work, variant, "done"))
    elif role == "second":  # up while the first stored: served what the first committed
        wait_for(marker(work, variant, "stored"))
        ttft_round("hit-other-engine")
        eng.reset()
        ttft_round("tokens-hit", CHECK_TOKENS)
    elif variant == "plain":
        ttft_round("recompute-1")
        eng.reset()
        ttft_round("recompute-2")
        eng.reset()
        ttft_round("tokens-recompute", CHECK_TOKENS)
        ttft_round("tokens-gpu-hit", CHECK_TOKENS)
        ttft_round("gpu-hit")
    elif reuses(variant):
        ttft_round("hit-new-engine")  # storage -> GPU in an engine that stored nothing
        eng.reset()
        ttft_round("tokens-hit", CHECK_TOKENS)
        eng.reset()
        emit("damage", [], slots=damage_slots(store_of(variant, work), 97)[:50])
        ttft_round("tokens-damaged", CHECK_TOKENS)  # failed loads: vLLM recomputes
        eng.reset()
        ttft_round("tokens-after-damage", CHECK_TOKENS)  # the damaged blocks are gone: misses
    elif tier_role(variant) == "load":
        ttft_round("hit-1")  # file tier -> CPU tier -> GPU (the CPU tier starts empty)
        eng.reset()
        ttft_round("cpu-hit")  # now served by the CPU tier in DRAM
        eng.reset()
        ttft_round("tokens-hit", CHECK_TOKENS)
    else:
        ttft_round("store")  # recompute, stores posted behind it
        emit("flush", [], **eng.flush(expected))
        if tier_role(variant) != "store":
            for i in (1, 2):
                eng.reset()
                ttft_round(f"hit-{i}")
            eng.reset()
            ttft_round("tokens-hit", CHECK_TOKENS)
    if tier_role(variant) != "load" and only != "ttft" and role is None:
        decode_rounds(eng, emit, stats)
    emit("end", [], wall_s=round(time.monotonic() - t0, 1))


def decode_rounds(eng: Engine, emit, stats: str) -> None:
    """Decode with stores running against the same decode without them, in one engine. A pair is
    a batch of new prompts (their blocks are stored while they decode), then, once those stores
    are over, the same batch again (a GPU prefix-cache hit: nothing is left to store). Only
    decode steps are counted. Pair 0 warms up."""
    clock = StepClock(eng.llm)
    for rep in range(DECODE_PAIRS + 1):
        prompts = [
            prompt_ids(DECODE_PROMPT, 5_000_000 + 100_000 * rep + i) for i in range(DECODE_BATCH)
        ]
        for kind in ("new", "again"):
            before, cpu0, m0 = kv_stats(stats), thread_cpu(), machine_cpu()
            clock.start()
            wall = eng.gen_batch(prompts, DECODE_TOKENS + 1)
            steps, slow_stacks = clock.stop()
            summary = step_summary(steps)
            if slow_stacks:
                summary["slow_step_stacks"] = slow_stacks
            extra = {}
            if kind == "new":
                extra = eng.settle()
            emit(
                f"decode-{kind}" if rep else f"decode-warmup-{kind}",
                [],
                pair=rep,
                wall_s=round(wall, 3),
                **summary,
                kv=delta(before, kv_stats(stats)),
                thread_cpu_s=cpu_delta(cpu0, thread_cpu()),
                machine_cpu=machine_delta(m0, machine_cpu()),
                **extra,
            )


def versions() -> dict:
    import torch
    import vllm

    out = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
    }
    try:
        import nixl_cu13

        out["nixl"] = getattr(nixl_cu13, "__version__", "?")
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------- parent commands


def remove_store(store: str) -> None:
    """A connector store: its folder and, when striped, what it keeps in the slot folders (they
    are marked as its own, and the next store takes them)."""
    shutil.rmtree(store, ignore_errors=True)
    for d in filter(None, os.environ.get("IUD_VLLM_SLOT_DIRS", "").split(":")):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)


def child_cmd(v: str, a, results: str, role: str | None = None) -> list[str]:
    return (
        [sys.executable, os.path.abspath(__file__), "child", v, a.model, a.work, results]
        + (["--only", a.only] if a.only else [])
        + (["--role", role] if role else [])
    )


def engines_shared(v: str, a, results: str) -> int:
    """Two engines on one store at once, each in its own process on the one GPU: the first
    stores the prompts and stays up; the second, started once the first is up, loads what the
    first committed. The first stops when the second has (whatever its outcome)."""
    for what in ("up", "stored", "done"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker(a.work, v, what))
    first = subprocess.Popen(child_cmd(v, a, results, "first"))
    second = subprocess.Popen(child_cmd(v, a, results, "second"))
    deadline, rc = time.monotonic() + a.timeout, 0
    for p in (second, first):
        try:
            rc |= p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc |= p.wait() or 1
        open(marker(a.work, v, "done"), "w").close()
    return rc


def engines(a) -> int:
    os.makedirs(a.work, exist_ok=True)
    results = os.path.join(a.work, "results.jsonl")
    rc = 0
    reused = {store_of(v, a.work) for v in a.variants if reuses(v)}
    # the sync-load variants without async scheduling: the connector waits for exactly this
    # check (tokens after damaged sync loads) before it takes them unasked (connector.py)
    os.environ.setdefault("IUD_VLLM_ALLOW_SYNC_LOADS", "1")
    for i, v in enumerate(a.variants):
        if tier_role(v) == "store":  # a tier's storing engine starts it anew
            shutil.rmtree(tier_store(v, a.work), ignore_errors=True)
        store = store_of(v, a.work)
        if not reuses(v):  # its own store, new
            remove_store(store)
        elif not os.path.isdir(store):  # a hit from storage needs what its owner stored
            print(f"== {v}: no store at {store}: run {reuses(v)} before it, in the same call")
            rc = 1
            continue
        # an earlier engine's counters (run_variant)
        for d in ("/dev/shm", a.work, os.environ.get("IUD_VLLM_BENCH_STATS_DIR") or a.work):
            for old in glob.glob(os.path.join(d, f"iud-stats-{v}.*")):
                os.remove(old)
        t0 = time.monotonic()
        if v in SHARED:
            code = engines_shared(v, a, results)
        else:
            code = subprocess.run(child_cmd(v, a, results), timeout=a.timeout).returncode
        print(f"== {v}: rc {code}, {time.monotonic() - t0:.0f} s", flush=True)
        rc |= code
        later = {store_of(x, a.work) for x in a.variants[i + 1 :] if reuses(x)}
        if store not in later and (reuses(v) or store not in reused):
            remove_store(store)  # the disk holds one store at a time
        if kind_of(v) in TIERS and kind_of(v) not in {kind_of(x) for x in a.variants[i + 1 :]}:
            shutil.rmtree(tier_store(v, a.work), ignore_errors=True)  # and so do vLLM's tiers
    return rc


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("dir")
    e = sub.add_parser("engines")
    e.add_argument("--model", required=True)
    e.add_argument("--work", required=True)
    e.add_argument("--timeout", type=int, default=400)
    e.add_argument(
        "--only",
        choices=["decode", "ttft"],
        help="only the decode rounds, or only the time-to-first-token rounds",
    )
    e.add_argument("variants", nargs="+", type=variant_name)
    r = sub.add_parser("report")
    r.add_argument("--work", required=True)
    r.add_argument("--out")
    r.add_argument(
        "--ref", help="results.jsonl whose plain engine's tokens to check against, if none here"
    )
    r.add_argument(
        "--hit-ref",
        help="a variant of this run (e.g. cpu, fs-load) whose tokens-hit the 'equal GPU hit' "
        "column checks against instead of a plain engine's GPU prefix-cache hit",
    )
    c = sub.add_parser("child")
    c.add_argument("variant")
    c.add_argument("model")
    c.add_argument("work")
    c.add_argument("results")
    c.add_argument("--only", choices=["decode", "ttft"])
    c.add_argument("--role", choices=["first", "second"], help="an engine of a shared variant")
    a = ap.parse_args()
    if a.cmd == "model":
        make_model(a.dir)
        return 0
    if a.cmd == "engines":
        return engines(a)
    if a.cmd == "report":
        from vllm_gpu_report import report  # beside this file: the tables of a work folder

        return report(a)
    run_variant(a.variant, a.model, a.work, a.results, a.only, a.role)
    return 0


if __name__ == "__main__":
    sys.exit(main())
