#!/usr/bin/env python3
"""Dynamo KVBM 1.6.1's own disk tier (G3), on its pinned NIXL (nixl-cu13 1.3.2), with this
plugin installed under the names KVBM creates for storage (GDS_MT and POSIX; ci/gpu/kvbm-run.sh
lays the plugin folder out), moving KV blocks that are checked byte for byte.

Two processes, as vLLM runs KVBM: this one is the scheduler side (kvbm's KvbmLeader and its
vLLM connector leader, PyKvConnectorLeader), the child is the worker side (kvbm's
PyKvConnectorWorker, which builds KVBM's KvbmWorker, its NIXL agent and its device, host and
disk layouts). The scheduler steps vLLM would take are made by hand with the calls
kvbm/vllm_integration/connector_leader.py and connector_worker.py make (vLLM itself is not
needed). Steps:
  1. request A (NBLK full blocks) is prefilled: every (block, layer, K/V) piece of its device
     blocks gets its own random bytes; A finishes, KVBM offloads its blocks;
  2. (host-disk) request C, other tokens, NBLK blocks, pushes A out of the host tier, which holds
     NBLK blocks; the disk tier holds both;
  3. the disk cache file (dynamo-kvbm-disk-cache-*) must hold every piece of A, byte for byte;
  4. the device cache is zeroed; request B = A's tokens + a few: KVBM must match A's NBLK blocks
     and load them (from disk) into B's new device blocks, which must equal A's pieces;
  5. the plugin's call record (IO_URING_DMABUF_RECORD) must show FILE writes and reads.
Variants: host-disk (CPU and disk tiers: disk writes are DRAM -> FILE) and disk-only (no CPU
tier: KVBM moves device blocks to disk directly, VRAM -> FILE through GDS_MT).

    kvbm-disk-tier.py --variant host-disk|disk-only --out result.json [--device cuda|cpu]

--device cpu exists to show where KVBM stops on a machine without CUDA. Exit 0 only when every
check passed; result.json says what passed, what failed and the last step reached.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback

ENGINE = "kvbm-disk-tier"
PAGE, LAYERS, HEADS, HEAD_DIM = 16, 4, 8, 128
NBLK = 4  # blocks per request
DEVICE_BLOCKS = 32
DISK_BLOCKS = 32
TIMEOUT_S = 120


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def piece(block_tag: int, layer: int, kv: int):
    """The bytes of one (block, layer, K/V) piece: PAGE x HEADS x HEAD_DIM bf16, as int16."""
    import numpy as np

    rng = np.random.default_rng([block_tag, layer, kv, 0x6B76626D])
    return rng.integers(-32768, 32767, size=(PAGE, HEADS, HEAD_DIM), dtype=np.int16)


# ---- worker side (child process) --------------------------------------------------------------


def worker_main(conn, device: str, env: dict) -> None:
    os.environ.update(env)
    try:
        import kvbm  # noqa: F401  (imports nixl first, as KVBM does)
        import torch
        from kvbm._core import _vllm_integration as v

        # vLLM's FlashAttention layout: one tensor per layer, (2, blocks, page, heads, head_dim).
        caches = [
            torch.zeros(
                (2, DEVICE_BLOCKS, PAGE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device
            )
            for _ in range(LAYERS)
        ]
        if device == "cuda":
            events = [torch.cuda.Event(enable_timing=False, interprocess=False) for _ in caches]
            for e in events:
                e.record(torch.cuda.current_stream())
            handles = [e.cuda_event for e in events]
        else:
            events, handles = [], [0 for _ in caches]
        w = v.PyKvConnectorWorker(None, ENGINE)
        conn.send(("registering", None))
        w.register_kv_caches(
            DEVICE_BLOCKS, PAGE, 0, 2, [(layer_name(i), t) for i, t in enumerate(caches)], handles
        )
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":  # one model-runner step, in vLLM's order
                meta, fills, finished = arg
                w.bind_connector_metadata(meta)
                for block, tag in fills:  # the "forward pass" computes these blocks
                    for i, t in enumerate(caches):
                        for kv in (0, 1):
                            t.view(torch.int16)[kv, block] = torch.from_numpy(piece(tag, i, kv)).to(
                                device
                            )
                for i, t in enumerate(caches):
                    if events:
                        events[i].record(torch.cuda.current_stream())
                    w.save_kv_layer(layer_name(i), t)
                if device == "cuda":
                    torch.cuda.synchronize()
                sending, recving = w.get_finished(set(finished))
                w.clear_connector_metadata()
                conn.send(("stepped", (sorted(sending or []), sorted(recving or []))))
            elif cmd == "wipe":
                for t in caches:
                    t.zero_()
                conn.send(("wiped", None))
            elif cmd == "compare":  # [(block, tag)]: device bytes against the pieces
                bad = []
                for block, tag in arg:
                    for i, t in enumerate(caches):
                        for kv in (0, 1):
                            got = t.view(torch.int16)[kv, block].cpu().numpy()
                            if not (got == piece(tag, i, kv)).all():
                                bad.append([block, tag, i, kv])
                conn.send(("compared", bad))
            elif cmd == "stop":
                conn.send(("stopped", None))
                return
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# ---- scheduler side ---------------------------------------------------------------------------


class Run:
    def __init__(self, out: str, variant: str):
        self.out, self.result = out, {"variant": variant, "checks": {}, "stage": "start"}

    def stage(self, s: str) -> None:
        # Saved at every stage: a blocking KVBM call that never returns (the run is killed by
        # kvbm-run.sh's timeout) still leaves the last stage reached in the result.
        self.result["stage"] = s
        print(f"== {s}", flush=True)
        self.save()

    def check(self, name: str, ok: bool, detail) -> bool:
        self.result["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def save(self) -> int:
        ok = bool(self.result["checks"]) and all(c["ok"] for c in self.result["checks"].values())
        self.result["passed"] = ok
        with open(self.out, "w") as f:
            json.dump(self.result, f, indent=1)
        return 0 if ok else 1


def recv(conn, want: str, run: Run):
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
        if conn.poll(1):
            kind, arg = conn.recv()
            if kind == "error":
                raise RuntimeError("worker: " + arg)
            if kind == "stage":
                run.stage(arg)
                continue
            if kind == want:
                return arg
            raise RuntimeError(f"worker answered {kind}, expected {want}")
    raise TimeoutError(f"worker gave no {want} in {TIMEOUT_S} s")


def kvbm_disk_fds(pid: int, disk_dir: str) -> list[str]:
    """/proc paths of the KVBM disk files process `pid` holds open under `disk_dir`."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.join(disk_dir, "dynamo-kvbm-disk-cache-")):
            out.append(f"/proc/{pid}/fd/{fd}")
    return out


def scheduler(run: Run, variant: str, device: str, disk_dir: str, record: str) -> None:
    env = {
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(DISK_BLOCKS),
        "DYN_KVBM_DISK_CACHE_DIR": disk_dir,
        # Offload to disk on the first sight of a block (the default filter wants two).
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "IO_URING_DMABUF_RECORD": record,
    }
    if variant == "host-disk":
        env["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = str(NBLK)
    os.environ.update(env)
    run.result["env"] = env

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker_main, args=(child, device, env), daemon=True)
    proc.start()
    try:
        import kvbm  # noqa: F401
        from kvbm._core import KvbmLeader
        from kvbm._core import _vllm_integration as v

        # PyKvConnectorLeader's constructor holds the GIL until the worker's handshake, so a
        # worker that fails first would leave it waiting: let the worker get as far as
        # register_kv_caches (which waits for the leader) and report an early failure first.
        recv(parent, "registering", run)
        ready = False
        if parent.poll(5):
            ready = recv(parent, "ready", run) is None  # raises the worker's error, if that came
        run.stage("scheduler: KvbmLeader + PyKvConnectorLeader")
        leader = KvbmLeader(1, drt=None)
        lead = v.PyKvConnectorLeader(ENGINE, None, PAGE, leader)
        if not ready:
            recv(parent, "ready", run)

        def step(out, fills=(), finished=()):
            parent.send(("step", (lead.build_connector_metadata(out), list(fills), list(finished))))
            return recv(parent, "stepped", run)

        def empty():
            o = v.SchedulerOutput()
            o.add_num_scheduled_tokens({})
            return o

        def new_request(rid, tokens, blocks, computed):
            if not lead.has_slot(rid):
                lead.create_slot(v.KvbmRequest(rid), tokens)
            return lead.get_num_new_matched_tokens(rid, len(tokens), computed)

        def prefill_and_finish(rid, tokens, blocks, tag0):
            matched = new_request(rid, tokens, blocks, 0)
            run.check(
                f"{rid}: nothing cached before its prefill", matched[0] in (0, None), str(matched)
            )
            lead.update_state_after_alloc(rid, blocks, 0)
            o = v.SchedulerOutput()
            o.add_new_request(rid, tokens, blocks, 0)
            o.add_num_scheduled_tokens({rid: len(tokens)})
            step(o, fills=[(b, tag0 + k) for k, b in enumerate(blocks)])
            saving = lead.request_finished(rid, blocks)
            done, first = False, True
            deadline = time.time() + TIMEOUT_S
            while not done and time.time() < deadline:
                sending, _ = step(empty(), finished=[rid] if first else [])
                first = False
                done = not saving or rid in sending
                time.sleep(0.05)
            run.check(f"{rid}: offload finished", done, f"request_finished said {saving}")

        tokens_a = list(range(1000, 1000 + NBLK * PAGE))
        run.stage("request A: prefill, finish, offload")
        prefill_and_finish("A", tokens_a, list(range(0, NBLK)), 100)
        if variant == "host-disk":
            run.stage("request C: pushes A out of the host tier")
            prefill_and_finish(
                "C", list(range(5000, 5000 + NBLK * PAGE)), list(range(NBLK, 2 * NBLK)), 200
            )

        run.stage("disk file holds every piece of A")
        want = [
            (tag, i, kv) for tag in range(100, 100 + NBLK) for i in range(LAYERS) for kv in (0, 1)
        ]
        files, missing = [], want
        deadline = time.time() + TIMEOUT_S
        while missing and time.time() < deadline:
            # KVBM unlinks its disk file right after creating it (DiskStorage: "File will be
            # deleted when fd closes"): read it through the worker's open fd.
            files = kvbm_disk_fds(proc.pid, disk_dir)
            data = b"".join(open(f, "rb").read() for f in files)
            missing = [w for w in want if data.find(piece(*w).tobytes()) < 0]
            if missing:
                time.sleep(0.5)
        run.check(
            "disk file",
            files and not missing,
            f"{len(files)} file(s), {len(want) - len(missing)}/{len(want)} pieces of A found"
            + (f"; first missing (tag, layer, kv): {missing[:3]}" if missing else ""),
        )

        run.stage("onboard A's blocks into request B")
        parent.send(("wipe", None))
        recv(parent, "wiped", run)
        tokens_b = tokens_a + [7, 7, 7]
        blocks_b = list(range(16, 16 + NBLK + 1))
        matched = new_request("B", tokens_b, blocks_b, 0)
        run.check("B matches A's blocks", matched and matched[0] == NBLK * PAGE, str(matched))
        n = matched[0] or 0
        # vLLM allocates, for a request whose external tokens load asynchronously, blocks for
        # those tokens only (its scheduler sets num_new_tokens = 0 while the load runs) and hands
        # them over; KVBM counts any further block as locally computed tokens.
        lead.update_state_after_alloc("B", blocks_b[: n // PAGE], n)
        loaded = False
        deadline = time.time() + TIMEOUT_S
        while not loaded and time.time() < deadline:  # vLLM: B waits for its remote KVs
            _, recving = step(empty())
            loaded = "B" in recving or not (matched and matched[1])
            time.sleep(0.05)
        run.check("B's load finished", loaded, f"async={matched[1] if matched else None}")
        # Compared as soon as KVBM reports the load finished (vLLM's next step would prefill B's
        # last tokens on top: model work, not storage; a hand-made SchedulerOutput for it was
        # refused by KVBM's slot bookkeeping, "cannot advance computed position", so it is left
        # out rather than guessed).
        parent.send(("compare", [(blocks_b[k], 100 + k) for k in range(NBLK)]))
        bad = recv(parent, "compared", run)
        run.check(
            "B's device blocks == A's pieces",
            not bad,
            f"{NBLK * LAYERS * 2 - len(bad)}/{NBLK * LAYERS * 2} pieces equal"
            + (f"; first bad [block, tag, layer, kv]: {bad[:3]}" if bad else ""),
        )

        run.stage("the plugin's record")
        lines = [json.loads(ln) for ln in open(record)] if os.path.exists(record) else []
        # The file may be either list (KVBM onboards with the disk as the local list, READ):
        # the op names the file's direction either way.
        preps = [
            ln
            for ln in lines
            if ln.get("event") == "prep"
            and "FILE_SEG" in (ln.get("local_kind"), ln.get("remote_kind"))
        ]
        writes = [p for p in preps if p["op"] == "WRITE"]
        reads = [p for p in preps if p["op"] == "READ"]
        kinds = sorted(
            {p["remote_kind"] if p["local_kind"] == "FILE_SEG" else p["local_kind"] for p in preps}
        )
        run.result["record"] = {
            "file_writes": len(writes),
            "file_reads": len(reads),
            "local_kinds": kinds,
            "bytes_written": sum(p["bytes"] for p in writes),
            "bytes_read": sum(p["bytes"] for p in reads),
        }
        run.check(
            "FILE writes and reads went through the plugin", writes and reads, run.result["record"]
        )
        parent.send(("stop", None))
        recv(parent, "stopped", run)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["host-disk", "disk-only"], default="host-disk")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    run = Run(a.out, a.variant)
    disk_dir = tempfile.mkdtemp(prefix="kvbm-disk-", dir=os.environ.get("KVBM_DISK_PARENT", "/tmp"))
    record = os.path.join(disk_dir, "iud-record.jsonl")
    try:
        scheduler(run, a.variant, a.device, disk_dir, record)
    except BaseException as e:  # noqa: BLE001 - reported in the result
        run.result["error"] = f"{type(e).__name__}: {e}"
        run.check(
            f"reached the end (stopped at: {run.result['stage']})",
            False,
            run.result["error"].splitlines()[-1][:400],
        )
        print(run.result["error"], file=sys.stderr)
    return run.save()


if __name__ == "__main__":
    sys.exit(main())
