"""The plugin knows which NIXL release loaded it, and refuses a release line whose plugin ABI it
was not verified for (src/ffi/nixl_release.rs, docs/nixl-releases.md).

Three sources must agree on the release: the installed wheel's metadata, NIXL's own start-up
line ("NIXL version: X", logged by libnixl_common at INFO) and the plugin's reading of it. The
verdict follows plugin-manifest's nixl_versions_tested / nixl_abi_lines. Each case runs in a
fresh process: the plugin decides once per process. ci/nixl-matrix.sh runs this file under every
tested release and under nixl-cu13 0.10.1 (a 31-slot engine vtable), where the refusal cases run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import iud_helpers as H
import pytest
import tomllib

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

ALLOW = "IO_URING_DMABUF_ALLOW_UNTESTED_NIXL"

CHILD = r"""
import json, os, sys
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
name, path = sys.argv[1], sys.argv[2]
out = {}
a = nixl_agent("release-check", nixl_agent_config(backends=[]))
try:
    a.create_backend(name, {})
    out["created"] = True
except Exception as e:
    out["created"] = False
    out["error"] = f"{type(e).__name__}: {e}"
# NIXL's own POSIX backend in the same process: the runtime itself works.
a.create_backend("POSIX", {})
src = np.frombuffer(os.urandom(1 << 16), dtype=np.uint8).copy()
dst = np.zeros_like(src)
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, src.size)
mem = a.register_memory([(src.ctypes.data, src.size, 0, ""), (dst.ctypes.data, dst.size, 0, "")],
                        "DRAM", backends=["POSIX"])
fil = a.register_memory([(0, src.size, fd, "")], "FILE", backends=["POSIX"])
for op, buf in (("WRITE", src), ("READ", dst)):
    h = a.initialize_xfer(op, a.get_xfer_descs([(buf.ctypes.data, buf.size, 0)], "DRAM"),
                          a.get_xfer_descs([(0, buf.size, fd)], "FILE"), "release-check",
                          backends=["POSIX"])
    st = a.transfer(h)
    while st == "PROC":
        st = a.check_xfer_state(h)
    assert st == "DONE", f"POSIX {op}: {st}"
    a.release_xfer_handle(h)
out["posix_roundtrip"] = bool((src == dst).all())
a.deregister_memory(mem, backends=["POSIX"])
a.deregister_memory(fil, backends=["POSIX"])
os.close(fd)
print("RESULT " + json.dumps(out))
"""


def installed_release() -> str:
    """The version of the wheel `nixl` dispatches to, from its metadata."""
    import nixl._api as api

    pkg = api.__name__.split(".")[0]  # nixl_cu12 / nixl_cu13
    return importlib.metadata.version(pkg.replace("_", "-"))


def verdict(version: str) -> str:
    with open(os.path.join(REPO, "plugin-manifest", f"{H.PLUGIN}.toml"), "rb") as f:
        plugin = tomllib.load(f)["plugin"]
    if version in plugin["nixl_versions_tested"]:
        return "tested"
    line = ".".join(version.split(".")[:2])
    return "line-verified" if line in plugin["nixl_abi_lines"] else "unverified"


def run_child(tmp_path, extra_env=None):
    env = dict(os.environ)  # NIXL_PLUGIN_DIR was set by conftest
    env.update({"NIXL_LOG_LEVEL": "INFO", "IO_URING_DMABUF_LOG": "debug"})
    env.pop(ALLOW, None)
    env.update(extra_env or {})
    p = subprocess.run(
        [sys.executable, "-c", CHILD, H.PLUGIN, str(tmp_path / "posix.bin")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = f"child rc={p.returncode}\n--- stdout ---\n{p.stdout}\n--- stderr ---\n{p.stderr}"
    assert p.returncode == 0, report
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, report
    result = json.loads(line[len("RESULT ") :])
    assert result["posix_roundtrip"], "NIXL's POSIX round trip lost bytes\n" + report
    return result, p.stderr, report


def test_plugin_reads_the_runtime_release(plugin_so, tmp_path):
    version = installed_release()
    result, err, report = run_child(tmp_path)
    nixl_says = re.findall(r"NIXL version: (\S+)", err)
    assert nixl_says == [version], f"NIXL logged {nixl_says}, the wheel is {version}\n{report}"
    ours = re.findall(rf"{H.PLUGIN}: NIXL (\S+) \((\S*libnixl_common[^)]*)\)", err)
    assert [v for v, _ in ours] == [version], (
        f"the plugin read {ours}, the wheel is {version}\n{report}"
    )
    v = verdict(version)
    if v == "unverified":
        assert not result["created"], (
            f"NIXL {version} is of an unverified line but the plugin loaded\n{report}"
        )
        assert "is not of a release line this plugin was verified for" in err, report
        assert H.plugin_error_lines(err), f"the refusal logged no error line\n{report}"
    else:
        assert result["created"], (
            f"NIXL {version} ({v}): create_backend failed: {result.get('error')}\n{report}"
        )
        assert not H.plugin_error_lines(err), report
        phrase = "a tested release" if v == "tested" else "is not one of the releases tested"
        assert phrase in err, f"NIXL {version} ({v}): no line saying {phrase!r}\n{report}"


def test_override_loads_an_unverified_release(plugin_so, tmp_path):
    version = installed_release()
    if verdict(version) != "unverified":
        pytest.skip(
            f"NIXL {version} is of a verified release line; ci/nixl-matrix.sh runs this under nixl-cu13 0.10.1"
        )
    # Only create_backend: 0.10's engine vtable has 4 more slots before loadLocalMD, so a
    # registration would call the wrong method. That is why the release is refused by default.
    result, err, report = run_child(tmp_path, {ALLOW: "1"})
    assert result["created"], (
        f"{ALLOW}=1 but create_backend failed: {result.get('error')}\n{report}"
    )
    assert "loading anyway because" in err, report
