"""The connector's KV events through vLLM's own offloading classes, without an engine, for vLLM
0.32 (the clients venv's default), 0.33 and 0.34 (each one's folder first on PYTHONPATH), over
the rig of vllm_connector_api_driver.py: the manager's OffloadingEvents after stores, an
eviction, damage found on lookup and on load, a new manager's replay and reset_cache, and what
vLLM's scheduler-side OffloadingEventsTracker makes of them (BlockStored / BlockRemoved with
medium STORAGE). Run in the clients venv:

    python vllm_events_driver.py STORE_DIR BACKEND   ->   prints "RESULT <json>"
"""

from __future__ import annotations

import dataclasses
import json
import sys

from vllm_connector_api_driver import SLOT, Rig, keys_of, run_job, store


def spec_with_events(rig: Rig, enabled: bool = True, **extra):
    """The spec as vLLM builds it for an engine whose kv_events_config has
    enable_kv_cache_events (OffloadingConfig.enable_kv_cache_events)."""
    from nixl_io_uring_dmabuf.vllm_connector import NixlStorageOffloadingSpec

    cfg = dataclasses.replace(rig.config(**extra), enable_kv_cache_events=enabled)
    return NixlStorageOffloadingSpec(cfg)


def seeds(keys) -> list[int]:
    return sorted(k[0] for k in keys)


def taken(mgr) -> list[dict]:
    """The manager's events, each as {removed, seeds, medium, removal_expected, ctx}."""
    out = []
    for e in mgr.take_events():
        ctx = getattr(e, "req_context", None)
        out.append(
            {
                "removed": e.removed,
                "seeds": seeds(e.keys),
                "medium": e.medium.value,
                "removal_expected": e.removal_expected,
                "ctx": None if ctx is None else ctx.req_id,
            }
        )
    return out


def stored(*s, ctx=None) -> dict:
    return {
        "removed": False,
        "seeds": sorted(s),
        "medium": "STORAGE",
        "removal_expected": True,
        "ctx": ctx,
    }


def removed(*s) -> dict:
    return {
        "removed": True,
        "seeds": sorted(s),
        "medium": "STORAGE",
        "removal_expected": False,
        "ctx": None,
    }


def zero_slot(mgr, rig, key) -> None:
    from nixl_io_uring_dmabuf.vllm_connector import layout

    fi, off = mgr.catalog.geo.locate(mgr.catalog.slot_of(bytes(key))[0])
    with open(layout.slot_file(rig.root, 0, 1, int(fi)), "r+b") as f:
        f.seek(int(off))
        f.write(bytes(SLOT))


def external_hash(block_hash: bytes):
    """A block hash as vLLM publishes it (the low 64 bits as an int by default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; else the bytes, here as hex)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = maybe_convert_block_hash(block_hash)
    return h.hex() if isinstance(h, bytes) else h


def translated(events) -> list[dict]:
    """vLLM's own translation of OffloadingEvents into KV cache events (the scheduler's
    OffloadingEventsTracker, self_describing_kv_events off: one placeholder BlockStored per key
    carrying the key's block hash)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    out = []
    for ev in tracker.take_events(events):
        out.append(
            {
                "type": type(ev).__name__,
                "medium": ev.medium,
                "hashes": [h.hex() if isinstance(h, bytes) else h for h in ev.block_hashes],
                "group_idx": ev.group_idx,
            }
        )
    return out


def main(root: str, backend: str) -> dict:
    import vllm
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    problems: list[str] = []
    seen: dict[str, object] = {}
    rig = Rig(root, backend)  # 16 slots
    is_034 = rig.spec().worker_api.value == "device pointers"

    def expect(what: str, got, want) -> None:
        seen[what] = got
        if got != want:
            problems.append(f"{what}: got {got}, expected {want}")

    # Events off (the engine has no kv_events_config): nothing is collected.
    off_rig = Rig(root + "-off", backend)
    spec = spec_with_events(off_rig, enabled=False)
    mgr, worker = spec.get_manager(), spec.get_worker(off_rig.kv)
    store(off_rig, mgr, worker, 1, keys_of(9), [0], problems)
    expect("events off", [taken(mgr), mgr.catalog.notify is None], [[], True])
    mgr.shutdown()
    worker.shutdown()

    spec = spec_with_events(rig)
    mgr, worker = spec.get_manager(), spec.get_worker(rig.kv)
    expect("new store", taken(mgr), [])
    ctx_name = "r" if is_034 else None  # 0.32/0.33's OffloadingEvent has no req_context
    a, b, c = keys_of(0, 1, 2, 3), keys_of(*range(4, 16)), keys_of(16, 17, 18, 19)
    store(rig, mgr, worker, 2, a, [0, 1, 2, 3], problems)
    expect("store", taken(mgr), [stored(0, 1, 2, 3, ctx=ctx_name)])
    raw = []
    store(rig, mgr, worker, 3, b, list(range(4, 16)), problems)  # the store is full now
    raw += list(mgr.take_events())
    store(rig, mgr, worker, 4, c, [16, 17, 18, 19], problems)  # evicts a (least recently used)
    raw += list(mgr.take_events())
    expect(
        "store into a full store",
        [{"removed": e.removed, "seeds": seeds(e.keys), "medium": e.medium.value} for e in raw],
        [
            {"removed": False, "seeds": list(range(4, 16)), "medium": "STORAGE"},
            {"removed": True, "seeds": [0, 1, 2, 3], "medium": "STORAGE"},
            {"removed": False, "seeds": [16, 17, 18, 19], "medium": "STORAGE"},
        ],
    )
    kv = translated(raw)
    want_kv = (
        [("BlockStored", s) for s in range(4, 16)]
        + [("BlockRemoved", s) for s in (0, 1, 2, 3)]
        + [("BlockStored", s) for s in (16, 17, 18, 19)]
    )
    got_kv = [(ev["type"], ev["hashes"], ev["medium"], ev["group_idx"]) for ev in kv]
    # BlockRemoved names the event's keys together; BlockStored one key each.
    flat = []
    for typ, hashes, medium, group in got_kv:
        flat += [(typ, h, medium, group) for h in hashes]
    expect(
        "vLLM's KV events",
        flat,
        [(typ, external_hash(bytes([s]) * 32), "STORAGE", 0) for typ, s in want_kv],
    )
    seen["vLLM's KV events (first two)"] = kv[:1] + kv[12:13]

    ctx = ReqContext(req_id="r")
    # Damage found on lookup: a miss, and the block is removed.
    zero_slot(mgr, rig, b[0])
    expect("damaged on lookup", [mgr.lookup(b[0], ctx).name, taken(mgr)], ["MISS", [removed(4)]])

    # Damage found on load (the lookup before it passed): the worker's DAMAGED record reaches
    # the manager with complete_load, and the block is removed.
    if mgr.lookup(b[1], ctx) != LookupResult.HIT:
        problems.append("an intact block is not a HIT")
    load = mgr.prepare_load(b[1:2], ctx)
    zero_slot(mgr, rig, b[1])
    worker.report_load_errors = True  # 0.32/0.33: the blocks go to vLLM's load-error path
    kw = {} if vllm.__version__.startswith("0.32") else {"expedited": False}
    side = rig.device_side([20], 0)
    seen["damaged load job"] = run_job(worker, 5, lambda: worker.submit_load(5, load, side, **kw))
    mgr.complete_load(b[1:2], ctx)
    expect("damaged on load", taken(mgr), [removed(5)])

    # A store every rank committed but vLLM has not completed yet is adopted when a full
    # store needs room: stored then, and not again at its complete_store.
    d, e = keys_of(20, 21), keys_of(22, 23, 24)
    out = mgr.prepare_store(d, ctx)
    side = rig.device_side([21, 22], 0)
    run_job(worker, 6, lambda: worker.submit_store(6, side, out.store_spec))
    store(rig, mgr, worker, 7, e, [23, 24, 25], problems)  # evicts 6, 7, 8
    mgr.complete_store(d, ctx)
    expect(
        "adopted before complete_store",
        taken(mgr),
        [stored(20, 21), removed(6, 7, 8), stored(22, 23, 24, ctx=ctx_name)],
    )
    mgr.shutdown()

    # A new manager (a new engine on the store) announces what its replay found.
    spec = spec_with_events(rig)
    mgr = spec.get_manager()
    left = list(range(9, 25))
    expect("replay", taken(mgr), [stored(*left)])

    # reset_cache: every block no load holds leaves, in one event.
    mgr.reset_cache()
    expect("reset_cache", [taken(mgr), mgr.catalog.committed()], [[removed(*left)], []])
    expect("drained", taken(mgr), [])
    mgr.shutdown()
    worker.shutdown()
    return {"vllm": vllm.__version__, "problems": problems, "seen": seen}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2]), default=str), flush=True)
