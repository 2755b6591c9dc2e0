"""Plugin init/fini idempotency, each scenario in a fresh process (see init_fini_child.py):
get_plugin_params before create_backend, several agents each with their own engine, agents
destroyed while others keep working, a new engine after all are gone, and interpreter exit with
a live engine. The child must print CHILD-OK and exit 0 (no crash in fini or teardown) without
logging plugin errors."""

from __future__ import annotations

import os
import subprocess
import sys

import iud_helpers as H
import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init_fini_child.py")


@pytest.mark.parametrize(
    "scenario", ["params-only", "params-then-two-agents", "exit-with-live-engine"]
)
def test_init_fini(plugin_so, tmp_path, scenario):
    env = dict(os.environ)  # NIXL_PLUGIN_DIR was set by conftest
    p = subprocess.run(
        [sys.executable, CHILD, scenario, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = (
        f"child {scenario}: rc={p.returncode}\n--- stdout ---\n{p.stdout}"
        f"\n--- stderr ---\n{p.stderr}"
    )
    assert p.returncode == 0, report
    assert "CHILD-OK" in p.stdout, report
    errors = H.plugin_error_lines(p.stderr)
    assert not errors, report
