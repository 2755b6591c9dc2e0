"""pytest setup for tests/reliability: reuses the fixtures of tests/python/conftest.py (plugin
directory, backend, rng, rig, stderr_log, need_direct) so both suites drive the same NIXL runtime
the same way."""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))

_spec = importlib.util.spec_from_file_location(
    "iud_python_conftest", os.path.join(HERE, "..", "python", "conftest.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)  # sets NIXL_PLUGIN_DIR before nixl is imported

backend = _base.backend
is_plugin = _base.is_plugin
plugin_so = _base.plugin_so
rng = _base.rng
rig = _base.rig
stderr_log = _base.stderr_log
direct_ok = _base.direct_ok
need_direct = _base.need_direct
pytest_report_header = _base.pytest_report_header


def pytest_addoption(parser):
    parser.addoption("--soak-gib", type=float, default=None,
                     help="bytes (GiB) the soak test moves (default: the short CI size)")
    parser.addoption("--soak-descs", type=int, default=None,
                     help="minimum number of descriptors the soak test moves")
    parser.addoption("--leak-cycles", type=int, default=None,
                     help="register/transfer/deregister cycles of the leak test")
    parser.addoption("--stress-seconds", type=float, default=None,
                     help="seconds of the 8-thread stress test per sync mode")
