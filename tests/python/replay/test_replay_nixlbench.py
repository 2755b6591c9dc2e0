"""Replay of nixlbench's storage mode (reference: nixl-clients.md §5, S7): block sizes 4 KiB ..
64 MiB doubling, batch sizes, one or more threads and files, WRITE and READ runs, every point
checked (--check_consistency) with unique per-block patterns. The call sequence is in
nixlbench_replay.py.

Two ways to run nixlbench on the plugin are covered (docs/clients.md):
  * the patched nixlbench (--backend IO_URING_DMABUF): the sweep tests below;
  * the unpatched nixlbench with --backend POSIX and a private NIXL_PLUGIN_DIR where the plugin
    is installed as libplugin_POSIX.so: the child-process test at the end (the plugin manager
    is per process, so NIXL_PLUGIN_DIR can only be changed in a new process).

Sizes are scaled down for the 2-core CI machine (few iterations per point; the buffer per
thread is one 64 MiB block); the VRAM variant (--initiator_seg_type VRAM) runs on the GPU
machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import iud_helpers as H
import nixlbench_replay as NB
import pytest
import replay_lib as R
from replay_lib import KiB, MiB

ALL_BLOCKS = [4 * KiB << i for i in range(15)]  # 4 KiB .. 64 MiB


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize(
    "direct,num_threads,num_files",
    [
        pytest.param(False, 1, 1, id="buffered-1thread-1file"),
        pytest.param(False, 2, 2, id="buffered-2threads-2files"),
        pytest.param(False, 2, 1, id="buffered-2threads-1file"),
        pytest.param(True, 2, 2, id="odirect-2threads-2files"),
    ],
)
@pytest.mark.parametrize("kind", R.mem_kinds())
def test_storage_sweep(kind, direct, num_threads, num_files, op, plugin_so, tmp_path, stderr_log):
    if kind == "VRAM":
        R.torch_cuda()
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    ledger = R.Ledger(f"nixlbench-{kind}-{op}-{direct}-{num_threads}-{num_files}")
    points = NB.run(
        R.BACKEND,
        kind=kind,
        op=op,
        num_threads=num_threads,
        num_files=num_files,
        direct=direct,
        filepath=str(tmp_path),
        total_buffer_size=num_threads * 64 * MiB,
        block_sizes=ALL_BLOCKS,
        batch_sizes=[1, 4, 16],
        num_iter=4 * num_threads,
        warmup_iter=2 * num_threads,
        large_blk_iter_ftr=4,
        ledger=ledger,
        max_batch_bytes=16 * MiB,
    )
    assert {p["block"] for p in points} == set(ALL_BLOCKS)
    R.no_plugin_errors(stderr_log, f"nixlbench {op} sweep")


_PRIVATE_DIR_CHILD = r"""
import sys
sys.path[:0] = sys.argv[3:]
import nixlbench_replay as NB, replay_lib as R
from nixl._api import nixl_agent, nixl_agent_config
probe = nixl_agent("probe", nixl_agent_config(backends=[]))
plugins = probe.get_plugin_list()
mems = probe.get_plugin_mem_types("POSIX")
params = probe.get_plugin_params("POSIX")
print("PLUGINS", plugins, "MEMS", mems, "PARAMS", sorted(params))
assert plugins == ["POSIX"], plugins
# Serving as POSIX the plugin reports POSIX's kinds (DRAM, FILE; src/ffi/alias.rs) but its own
# parameters.
assert "ring_entries" in params and mems == ["DRAM_SEG", "FILE_SEG"], "POSIX here is not IO_URING_DMABUF"
for op in ("WRITE", "READ"):
    NB.run("POSIX", op=op, num_threads=2, num_files=2, direct=sys.argv[2] == "1",
           filepath=sys.argv[1], total_buffer_size=2 * 16 * 1024 * 1024,
           block_sizes=[4096 << i for i in range(0, 13, 3)], batch_sizes=[1, 8],
           num_iter=8, warmup_iter=4, large_blk_iter_ftr=4,
           ledger=R.Ledger("nixlbench-private-dir-" + op))
print("CHILD OK")
"""


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_unpatched_nixlbench_via_private_plugin_dir(direct, plugin_so, tmp_path):
    """nixlbench --backend POSIX with NIXL_PLUGIN_DIR=<dir holding only our plugin as
    libplugin_POSIX.so>: NIXL loads the plugin under the name POSIX, nixlbench's POSIX params
    (use_aio, ios_pool_size, kernel_queue_size, ...) are ignored, the sweep runs and checks."""
    if R.BACKEND != R.PLUGIN:
        pytest.skip("only meaningful for the plugin")
    if direct and not R.direct_supported(str(tmp_path)):
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
    pdir = tmp_path / "private-plugins"
    pdir.mkdir()
    shutil.copy(plugin_so, pdir / "libplugin_POSIX.so")
    data = tmp_path / "data"
    data.mkdir()
    env = dict(os.environ, NIXL_PLUGIN_DIR=str(pdir))
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            _PRIVATE_DIR_CHILD,
            str(data),
            "1" if direct else "0",
            os.path.dirname(R.__file__),
            os.path.dirname(H.__file__),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "CHILD OK" in p.stdout, (
        f"child exited {p.returncode}:\n{out[-4000:]}"
    )
    assert not H.plugin_error_lines(p.stderr), f"plugin errors:\n{p.stderr[-3000:]}"
    names = sorted(os.listdir(data))
    assert names == [f"nixlbench_posix_test_file_initiator_{i}" for i in range(2)], names
