"""The connector's device checksums (checksum.TorchRows: page sums queued on the tensors' device,
folded on the host) against the host algorithm the scheduler uses on file bytes, with real torch
from the clients venv (CPU; on CUDA the worker runs the same self-check at start-up)."""

from __future__ import annotations

import os
import subprocess

import clients_env as E

SCRIPT = r"""
import numpy as np, torch
from nixl_io_uring_dmabuf.vllm_connector import checksum as C
rng = np.random.default_rng(0)
pages = [8192, 4096, 65536]
host = [rng.integers(-128, 128, size=(40, p + 256), dtype=np.int8) for p in pages]
host[2][3, :2] = [0, -128]          # the word -32768 at the largest weight used
rows = C.TorchRows([torch.as_tensor(h) for h in host], pages, max_bytes=1 << 16)  # many batches
ids = np.array([5, 3, 39, 0, 7, 7])
got = rows.block_sums(ids)
want = [C.fold(C.page_sums(host[p][b, :pages[p]].view(np.uint8)) for p in range(3)) for b in ids]
assert got == want, (got, want)
assert rows.block_sums(np.array([], dtype=np.int64)) == []
rows.self_check()
host[1][7, 100] ^= 1                  # one flipped bit changes that block's checksum only
after = C.TorchRows([torch.as_tensor(h) for h in host], pages).block_sums(ids)
assert [a != b for a, b in zip(after, got)] == [False, False, False, False, True, True], after
print("ok")
"""


def test_device_checksums_equal_the_host_algorithm():
    py = E.clients_python()
    env = E.child_env([os.path.join(os.path.dirname(__file__), "..", "..", "..", "python")])
    p = subprocess.run([py, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
