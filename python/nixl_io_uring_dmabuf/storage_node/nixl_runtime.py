"""Where NIXL finds its plugins, and which metadata exchange this process uses.

NIXL loads plugins from one folder: the wheel's own, or ``NIXL_PLUGIN_DIR`` (which replaces it).
A storage node needs IO_URING_DMABUF next to the wheel's UCX and POSIX plugins; ``ci/build.sh``
lays out such a folder (``iud-plugins``) inside the wheel's library folder. ``use_project_plugins``
points ``NIXL_PLUGIN_DIR`` there unless the caller already set it. It must run before the first
agent is created: NIXL's plugin manager is a process singleton.

Metadata exchange is NIXL's own: through etcd when ``NIXL_ETCD_ENDPOINTS`` is set (NIXL reads it
when an agent is created), and through NIXL's socket listener (``send_local_metadata(ip, port)``,
``fetch_remote_metadata(name, ip, port)``) when the caller names a peer address.
"""

from __future__ import annotations

import os

from ..tools.locate import first_wheel


def wheel_libs() -> str | None:
    """The NIXL wheel's library folder (``.nixl_cu13.mesonpy.libs`` or the cu12 one), if installed."""
    w = first_wheel()
    return w.libs if w else None


def use_project_plugins() -> str | None:
    """Set NIXL_PLUGIN_DIR to the project's plugin folder unless it is set; return the folder."""
    if os.environ.get("NIXL_PLUGIN_DIR"):
        return os.environ["NIXL_PLUGIN_DIR"]
    libs = wheel_libs()
    d = os.path.join(libs, "iud-plugins") if libs else ""
    if d and os.path.isdir(d):
        os.environ["NIXL_PLUGIN_DIR"] = d
        return d
    return None


def progress_delay_us() -> int:
    """Sleep bound of NIXL's UCX progress thread (see make_agent); IUDS_PROGRESS_DELAY_US overrides."""
    return int(os.environ.get("IUDS_PROGRESS_DELAY_US", "1000"))


def etcd_configured() -> bool:
    return bool(os.environ.get("NIXL_ETCD_ENDPOINTS", "").strip())


def default_comm_port() -> int:
    from nixl._api import DEFAULT_COMM_PORT

    return int(DEFAULT_COMM_PORT)


def import_nixl():
    """Import NIXL's Python API, with its log lines on stderr (NIXL's logger prints to stdout,
    which belongs to the application: the CLI's answers, a test worker's JSON lines)."""
    import logging
    import sys

    from nixl import _api

    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)
    return _api


def make_agent(name: str, conf, progress_delay_us: int = 1000):
    """nixl_agent(name, conf) with a sleeping UCX progress thread.

    NIXL's UCX progress thread waits in poll() on the UCX workers' event fds, with the agent's
    pthrDelay as the poll timeout (nixlUcxSharedThread in src/plugins/ucx/ucx_backend.cpp). The
    Python API hard-codes pthrDelay = 0 (nixl_agent.__init__ in nixl/_api.py, 1.5.1 and
    upstream main as of 2026-08), so the thread calls poll() with a zero timeout in a loop and
    keeps a CPU busy even when idle (measured here: an idle agent with the progress thread used
    a third of a CPU of this loaded 2-CPU machine, none without it). On a storage node that
    CPU is needed for TCP and storage. The Python API has no parameter for it, so the binding's
    agent constructor is wrapped for the duration of this call to set pthrDelay; UCX events
    still wake the thread at once, the delay only bounds the sleep between them.
    """
    api = import_nixl()
    real = api.nixlBind.nixlAgent

    def with_delay(agent_name, cfg):
        cfg.pthrDelay = int(progress_delay_us)
        return real(agent_name, cfg)

    api.nixlBind.nixlAgent = with_delay
    try:
        return api.nixl_agent(name, conf)
    finally:
        api.nixlBind.nixlAgent = real
