"""Issue 16's concurrency pattern through the real NIXL agent, each run in a process of its own
(concurrent_reg_child.py), so that heap corruption shows as the process's signal and the test
names it with the end of its stderr: one agent, 4 threads, each with its own file and 16 MiB
DRAM buffer, 3 WRITE/READ round trips of 64 x 64 KiB (odd rounds prepped, even rounds not),
every byte checked.

NIXL 1.5.1 takes no locks in sync mode NONE, the Python default without a listen thread
(nixl_cu12/_api.py: default_sync_mode; src/core/sync.h: NONE makes every lock a no-op), and its
registration lists race when threads register, deregister and prepare at once: helgrind and
ASan frames in bench/results/issue16-nixl-sync-none.md. The tests therefore run what users
should do, several times each:
- sync mode RW (and STRICT), threads registering and deregistering their own memory and files;
- sync mode NONE, memory and files registered before the threads start and deregistered after
  they joined, the threads only preparing, posting and releasing requests.
The plugin's own side of the NONE pattern, without NIXL's lists, is the asan driver's concreg
phase under ASan and valgrind (ci/reliability.sh); tests/engine.rs checks that an MD handed
back after its deregistration is refused."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import iud_helpers as H
import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "concurrent_reg_child.py")
RUNS = int(os.environ.get("IUD_CONCREG_RUNS", "6"))
THREADS, ROUNDS = 4, 3
# Address-space cap of each child (a run needs < 4 GiB): NIXL's POSIX backend, with its lists
# corrupted in sync mode NONE, was seen allocating until the OOM killer stopped it at 23 GiB.
CHILD_AS = 6 << 30


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS, CHILD_AS))


def run_child(backend: str, sync: str, tmp_path, upfront: bool, runs: int) -> None:
    for i in range(runs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        args = [sys.executable, CHILD, backend, sync, str(d), str(THREADS), str(ROUNDS)]
        if upfront:
            args.append("upfront")
        p = subprocess.run(
            args, capture_output=True, text=True, timeout=180, preexec_fn=_cap_memory
        )
        if p.returncode != 0:
            what = (
                f"killed by {signal.Signals(-p.returncode).name}"
                if p.returncode < 0
                else f"exit {p.returncode}"
            )
            tail = "\n".join(p.stderr.splitlines()[-25:])
            pytest.fail(
                f"run {i + 1} of {runs} ({backend}, sync {sync}"
                f"{', registered up front' if upfront else ''}): {what}\n{tail}"
            )
        lines = p.stdout.splitlines()
        assert lines and lines[-1].startswith("ok:"), p.stdout
        errors = H.plugin_error_lines(p.stdout + p.stderr)
        assert not errors, f"run {i + 1}: the plugin logged errors:\n" + "\n".join(errors)


@pytest.mark.parametrize("sync", ["rw", "strict"])
def test_threads_registering_their_own_memory_with_a_locking_agent(backend, tmp_path, sync):
    run_child(backend, sync, tmp_path, upfront=False, runs=RUNS if sync == "rw" else 1)


def test_threads_on_a_default_agent_with_registration_outside_the_threads(backend, tmp_path):
    if backend == "POSIX":
        pytest.skip("POSIX locks its I/O queue only when the agent's sync mode asks for it")
    run_child(backend, "none", tmp_path, upfront=True, runs=RUNS)
