"""pytest setup for tests/reliability: its command-line options. The fixtures (plugin folder,
backend, rng, rig, stderr_log, need_direct) are the ones every suite shares (tests/conftest.py),
so this suite drives the same NIXL runtime the same way as tests/python."""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption(
        "--soak-gib",
        type=float,
        default=None,
        help="bytes (GiB) the soak test moves (default: the short CI size)",
    )
    parser.addoption(
        "--soak-descs",
        type=int,
        default=None,
        help="minimum number of descriptors the soak test moves",
    )
    parser.addoption(
        "--leak-cycles",
        type=int,
        default=None,
        help="register/transfer/deregister cycles of the leak test",
    )
    parser.addoption(
        "--stress-seconds",
        type=float,
        default=None,
        help="seconds of the 8-thread stress test per sync mode",
    )
