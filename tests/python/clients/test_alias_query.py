"""Serving under another name, queryMem, and what NIXL's telemetry records for the plugin.

The plugin is installed with the project's installer into a private copy of the NIXL wheel
(clients_env), then real NIXL loads it by the aliased name in a child process.
"""

from __future__ import annotations

import json
import os
import sys

import clients_env as E
import pytest

CHILD = r"""
import json, os, sys
from nixl._api import nixl_agent, nixl_agent_config
from nixl_io_uring_dmabuf.tools import roundtrip
names, params, data = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
out = {}
for rep in range(2):  # two agents each: the "serving as" line must still appear once per name
    for n in names:  # one agent per name: NIXL refuses GDS next to GDS_MT in one agent
        a = nixl_agent(f"alias-{rep}-{n}", nixl_agent_config(backends=[]))
        a.create_backend(n, params.get(n, {}))
        r = roundtrip.run(a, n, data, 2 << 20, 1 << 20)
        out[n] = {"ok": r.ok, "detail": r.detail, "mems": a.get_backend_mem_types(n),
                  "plugin_mems": a.get_plugin_mem_types(n), "params": a.get_backend_params(n)}
print("RESULT " + json.dumps(out))
"""

NIXLBENCH_POSIX = {
    "use_aio": "false",
    "use_uring": "true",
    "use_posix_aio": "false",
    "ios_pool_size": "65536",
    "kernel_queue_size": "256",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("alias")
    plugins = E.copy_nixl(str(tmp / "site"))
    pkgs = E.pip_target(E.build_wheel(str(tmp / "wheel")), str(tmp / "pkgs"))
    path = [str(tmp / "site"), pkgs]
    p = E.run(
        [sys.executable, "-m", "nixl_io_uring_dmabuf", "install", "--as", "POSIX,GDS_MT,GDS"],
        E.child_env(path),
    )
    assert p.returncode == 0, p.stderr
    (tmp / "data").mkdir()
    return {"path": path, "data": str(tmp / "data"), "plugins": plugins}


def child(env, names, params, **extra):
    p = E.run(
        [sys.executable, "-c", CHILD, json.dumps(names), json.dumps(params), env["data"]],
        E.child_env(env["path"], **extra),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :]), p.stderr


def test_each_alias_serves_logs_once_and_reports_that_backends_kinds(env):
    params = {
        "POSIX": NIXLBENCH_POSIX,
        "GDS_MT": {"thread_count": "8"},
        "GDS": {"batch_pool_size": "32", "batch_limit": "128"},
    }
    res, log = child(env, ["POSIX", "GDS_MT", "GDS", "IO_URING_DMABUF"], params)
    for n in ("POSIX", "GDS_MT", "GDS", "IO_URING_DMABUF"):
        assert res[n]["ok"], (n, res[n]["detail"])
    for n in ("POSIX", "GDS_MT", "GDS"):
        assert log.count(f"IO_URING_DMABUF serving as {n} ") == 1, log
    assert "serving as IO_URING_DMABUF" not in log
    # The kinds NIXL 1.5.1's own backends report (POSIX {DRAM, FILE}; GDS, GDS_MT {DRAM, VRAM,
    # FILE}), from the engine and, before any engine, from the library's file name.
    assert res["POSIX"]["mems"] == ["DRAM_SEG", "FILE_SEG"]
    assert res["POSIX"]["plugin_mems"] == ["DRAM_SEG", "FILE_SEG"]
    for n in ("GDS_MT", "GDS"):
        assert res[n]["mems"] == res[n]["plugin_mems"] == ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]
    assert res["IO_URING_DMABUF"]["mems"] == ["DRAM_SEG", "VRAM_SEG", "BLK_SEG", "FILE_SEG"]
    # get_backend_params: the parameters the engine was created with, as the caller passed them.
    assert res["POSIX"]["params"]["use_uring"] == "true"


def test_alias_parameters_are_mapped_or_ignored_with_one_debug_line(env):
    params = {
        "POSIX": NIXLBENCH_POSIX,
        "GDS_MT": {"thread_count": "8"},
        "GDS": {"batch_pool_size": "32", "batch_limit": "128", "max_request_size": "8388608"},
    }
    res, log = child(env, ["POSIX", "GDS_MT", "GDS"], params, IO_URING_DMABUF_LOG="debug")
    assert all(res[n]["ok"] for n in res), res
    lines = [ln for ln in log.splitlines() if "without a meaning" in ln]
    # one line per engine created (two agents x three names)
    assert len(lines) == 4, lines  # GDS_MT passes nothing without a meaning
    posix = [ln.split("ignored: ", 1)[1] for ln in lines if "POSIX parameters" in ln]
    assert len(posix) == 2
    for ln in posix:  # the caller's map is unordered
        assert set(ln.split(", ")) == {
            "use_aio=false",
            "use_uring=true",
            "use_posix_aio=false",
            "ios_pool_size=65536",
        }, ln
    assert "POSIX parameters mapped: kernel_queue_size=256 -> ring_entries=256" in log
    assert "GDS_MT parameters mapped: thread_count=8 -> cufile_threads=8" in log
    assert "GDS parameters mapped: max_request_size=8388608 -> max_io_size=8388608" in log


QUERY = r"""
import json, os, sys
from nixl._api import nixl_agent, nixl_agent_config
d = sys.argv[1]
present = os.path.join(d, "present.bin")
with open(present, "wb") as f:
    f.write(os.urandom(12345))
empty = os.path.join(d, "empty.bin")
open(empty, "wb").close()
metas = [present, os.path.join(d, "absent.bin"), empty, "", "rw,create:" + present]
out = {}
for n in sys.argv[2:]:
    a = nixl_agent(f"q-{n}", nixl_agent_config(backends=[]))
    a.create_backend(n, {"use_uring": "true"} if n == "POSIX" else {})
    out[n] = a.query_memory([(0, 0, 0, m) for m in metas], n, "FILE")
st = os.stat(present)
out["stat"] = {"size": str(st.st_size), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))}
print("RESULT " + json.dumps(out))
"""


def test_query_mem_answers_as_nixl_posix_does(tmp_path):
    # In the suite's own plugin folder (our plugin beside the wheel's POSIX): the same list to both.
    p = E.run(
        [sys.executable, "-c", QUERY, str(tmp_path), "IO_URING_DMABUF", "POSIX"], dict(os.environ)
    )
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    ours, posix = res["IO_URING_DMABUF"], res["POSIX"]
    assert ours[0] == res["stat"] and ours[0]["size"] == "12345"
    assert ours[1] is None and ours[3] is None
    assert ours[2]["size"] == "0"
    assert ours[:4] == posix[:4]  # NIXL's POSIX: the same answers, field for field
    # A path-mode metaInfo is looked up by its path (NIXL's POSIX stats the string as it is).
    assert ours[4] == res["stat"] and posix[4] is None


TELEMETRY = r"""
import json, sys
from nixl._api import nixl_agent, nixl_agent_config
from nixl_io_uring_dmabuf.tools.roundtrip import DramBuffer
import os
a = nixl_agent("telem", nixl_agent_config(backends=[], capture_telemetry=True))
a.create_backend("IO_URING_DMABUF")
n, blk = 8, 64 << 10
buf = DramBuffer(n * blk)
fd = os.open(os.path.join(sys.argv[1], "t.bin"), os.O_RDWR | os.O_CREAT, 0o600)
m = a.register_memory([(buf.addr, n * blk, 0, "")], "DRAM")
f = a.register_memory([(0, n * blk, fd, "")], "FILE")
out = {}
for op in ("WRITE", "READ"):
    h = a.initialize_xfer(op, a.get_xfer_descs([(buf.addr + i * blk, blk, 0) for i in range(n)], "DRAM"),
                          a.get_xfer_descs([(i * blk, blk, fd) for i in range(n)], "FILE"), "telem")
    st = a.transfer(h)
    while st not in ("DONE", "ERR"):
        st = a.check_xfer_state(h)
    t = a.get_xfer_telemetry(h)
    out[op] = {"state": st, "bytes": t.totalBytes, "descs": t.descCount,
               "xfer_us": t.xferDuration, "post_us": t.postDuration}
    a.release_xfer_handle(h)
a.deregister_memory(f); a.deregister_memory(m); os.close(fd)
print("RESULT " + json.dumps(out))
"""


def test_agent_telemetry_records_the_plugins_transfers(tmp_path):
    """NIXL 1.x exports only agent-level telemetry (bytes, descriptors, times, error counts per
    request, for any backend); the per-backend event queue of the engine base class has had no
    reader since ai-dynamo/nixl#1364 (docs/clients.md, "Telemetry")."""
    env = dict(os.environ, PYTHONPATH=os.path.join(E.REPO, "python"))
    p = E.run([sys.executable, "-c", TELEMETRY, str(tmp_path)], env)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    for op in ("WRITE", "READ"):
        assert res[op]["state"] == "DONE"
        assert res[op]["bytes"] == 8 * 64 * 1024 and res[op]["descs"] == 8, res[op]
        assert res[op]["xfer_us"] >= res[op]["post_us"] >= 0
