"""The wheel and its installer: `python -m nixl_io_uring_dmabuf install [--as NAME]
[--plugin-dir D] [--uninstall]`, then real NIXL loading the plugin by the installed name.

Everything runs in child processes over a private copy of the NIXL wheel's files (clients_env),
with NIXL_PLUGIN_DIR unset unless the test composes a private folder: NIXL then reads the copy's
plugins/ folder, the one a user's NIXL reads by default.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile

import clients_env as E
import pytest

# The parameters each name's real callers pass (nixlbench nixl_worker.cpp; the Python agent's
# num_threads mapping for GDS_MT; LMCache passes nixl_backend_params verbatim, often {}).
CLIENT_PARAMS = {
    "IO_URING_DMABUF": {},
    "POSIX": {
        "use_aio": "false",
        "use_uring": "true",
        "use_posix_aio": "false",
        "ios_pool_size": "65536",
        "kernel_queue_size": "256",
    },
    "GDS_MT": {"thread_count": "8"},
    "GDS": {"batch_pool_size": "32", "batch_limit": "128", "max_request_size": "16777216"},
}

ROUND_TRIP = r"""
import json, sys
from nixl_io_uring_dmabuf.tools import roundtrip
names = json.loads(sys.argv[1]); params = json.loads(sys.argv[2]); out = {}
a = roundtrip.new_agent("iud-install-test")
for n in names:
    a.create_backend(n, params.get(n, {}))
    out[n] = {"mems": a.get_backend_mem_types(n), "plugins": a.get_plugin_list()}
    if n != "UCX":  # a network backend: created only, to show it loads
        r = roundtrip.run(a, n, sys.argv[3], 3 << 20, 1 << 20)
        out[n].update(ok=r.ok, detail=r.detail)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return E.build_wheel(str(tmp_path_factory.mktemp("wheel")))


@pytest.fixture
def env(tmp_path, wheel):
    """A NIXL copy and the project's wheel installed next to it (pip --target)."""
    plugins = E.copy_nixl(str(tmp_path / "site"))
    pkgs = E.pip_target(wheel, str(tmp_path / "pkgs"))
    return {
        "plugins": plugins,
        "libs": os.path.dirname(plugins),
        "path": [str(tmp_path / "site"), pkgs],
        "tmp": tmp_path,
    }


def cli(env, *args, **extra):
    return E.run(
        [sys.executable, "-m", "nixl_io_uring_dmabuf", *args],
        E.child_env(env["path"], **extra),
        cwd=str(env["tmp"]),
    )


def round_trip(env, names, **extra):
    data = env["tmp"] / "data"
    data.mkdir(exist_ok=True)
    p = E.run(
        [sys.executable, "-c", ROUND_TRIP, json.dumps(names), json.dumps(CLIENT_PARAMS), str(data)],
        E.child_env(env["path"], **extra),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :]), p.stderr


def test_wheel_carries_the_built_plugin(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        lib = z.read("nixl_io_uring_dmabuf/lib/libplugin_IO_URING_DMABUF.so")
        assert "nixl_io_uring_dmabuf/__main__.py" in names
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    with open(E.PLUGIN_SO, "rb") as f:
        assert lib == f.read()
    assert "nixl_io_uring_dmabuf/lib/libplugin_IO_URING_DMABUF.so,sha256=" in record
    assert "-py3-none-manylinux_2_" in os.path.basename(wheel)  # tests/python/test_wheel_tag.py


@pytest.mark.parametrize("alias", ["GDS_MT", "POSIX", "GDS"])
def test_install_as_alias_into_default_folder_round_trip_and_uninstall(env, alias):
    before = E.snapshot(env["plugins"])
    p = cli(env, "install", "--as", alias)
    assert p.returncode == 0, p.stderr
    assert f"installed the plugin serving as {alias}" in p.stdout
    assert "NIXL reads this folder by default" in p.stdout
    assert "undo: python -m nixl_io_uring_dmabuf install --uninstall" in p.stdout
    assert f"moved the existing libplugin_{alias}.so" in p.stdout
    with open(E.PLUGIN_SO, "rb") as f:
        ours = f.read()
    for name in ("IO_URING_DMABUF", alias):
        with open(os.path.join(env["plugins"], f"libplugin_{name}.so"), "rb") as f:
            assert f.read() == ours, name

    res, log = round_trip(env, ["IO_URING_DMABUF", alias])
    for name in ("IO_URING_DMABUF", alias):
        assert res[name]["ok"], (name, res[name]["detail"])
    assert log.count(f"IO_URING_DMABUF serving as {alias} ") == 1, log
    assert {"DRAM_SEG", "FILE_SEG"} <= set(res[alias]["mems"])

    doc = cli(env, "doctor")
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert f"{alias:16s} IO_URING_DMABUF (this package)" in doc.stdout

    p = cli(env, "install", "--uninstall")
    assert p.returncode == 0, p.stderr
    assert f"restored the original libplugin_{alias}.so" in p.stdout
    assert E.snapshot(env["plugins"]) == before


def test_reinstall_keeps_the_first_backup(env):
    before = E.snapshot(env["plugins"])
    assert cli(env, "install", "--as", "POSIX").returncode == 0
    p = cli(env, "install", "--as", "POSIX,GDS_MT")
    assert p.returncode == 0, p.stderr
    assert "moved the existing libplugin_POSIX.so" not in p.stdout  # already ours
    assert "moved the existing libplugin_GDS_MT.so" in p.stdout
    p = cli(env, "install", "--uninstall", "--as", "GDS_MT")
    assert p.returncode == 0 and "restored the original libplugin_GDS_MT.so" in p.stdout
    assert cli(env, "install", "--uninstall").returncode == 0
    assert E.snapshot(env["plugins"]) == before


def test_uninstall_keeps_a_file_changed_since_install(env):
    before = E.snapshot(env["plugins"])
    assert cli(env, "install", "--as", "POSIX").returncode == 0
    target = os.path.join(env["plugins"], "libplugin_POSIX.so")
    with open(target, "ab") as f:
        f.write(b"changed")
    p = cli(env, "install", "--uninstall")
    assert "kept" in p.stdout and "changed since install" in p.stdout
    assert os.path.exists(os.path.join(env["plugins"], ".iud-install.json"))
    p = cli(env, "install", "--uninstall", "--force")
    assert p.returncode == 0 and "restored the original libplugin_POSIX.so" in p.stdout
    assert E.snapshot(env["plugins"]) == before


def test_private_folder_inside_the_wheel_links_its_plugins(env):
    before = E.snapshot(env["libs"])
    private = os.path.join(env["libs"], "iud-private")
    p = cli(env, "install", "--as", "POSIX", "--plugin-dir", private)
    assert p.returncode == 0, p.stderr
    assert "linked the wheel's plugins" in p.stdout
    assert f"export NIXL_PLUGIN_DIR={private}" in p.stdout
    assert os.path.islink(os.path.join(private, "libplugin_UCX.so"))
    assert not os.path.islink(os.path.join(private, "libplugin_POSIX.so"))
    # The wheel's default folder is untouched: only the private folder serves POSIX.
    assert E.snapshot(env["plugins"]) == {
        k[len("plugins/") :]: v for k, v in before.items() if k.startswith("plugins/")
    }
    res, _ = round_trip(env, ["POSIX", "UCX"], NIXL_PLUGIN_DIR=private)
    assert res["POSIX"]["ok"], res["POSIX"]["detail"]
    # UCX (a linked wheel plugin) loaded through the link: its RPATH $ORIGIN/.. resolved.
    assert "UCX" in res["UCX"]["plugins"] and res["UCX"]["mems"]
    p = cli(env, "install", "--uninstall", "--plugin-dir", private)
    assert p.returncode == 0 and "removed the folder" in p.stdout
    assert E.snapshot(env["libs"]) == before


def test_private_folder_elsewhere_gets_the_plugin_only(env):
    private = str(env["tmp"] / "elsewhere")
    p = cli(env, "install", "--as", "POSIX", "--plugin-dir", private)
    assert p.returncode == 0, p.stderr
    assert "RPATH $ORIGIN/.." in p.stdout
    assert sorted(n for n in os.listdir(private) if n.endswith(".so")) == [
        "libplugin_IO_URING_DMABUF.so",
        "libplugin_POSIX.so",
    ]
    res, _ = round_trip(env, ["POSIX"], NIXL_PLUGIN_DIR=private)
    assert res["POSIX"]["ok"], res["POSIX"]["detail"]
    assert sorted(res["POSIX"]["plugins"]) == ["IO_URING_DMABUF", "POSIX"]
    assert cli(env, "install", "--uninstall", "--plugin-dir", private).returncode == 0
    assert not os.path.exists(private)


def test_refusals_name_the_cause(env):
    p = cli(env, "install", "--as", "UCX")
    assert p.returncode == 1 and "--as UCX: must be one of POSIX, GDS_MT, GDS" in p.stderr
    # -S: no site-packages, so the project venv's own NIXL wheel is out of sight too.
    p = E.run(
        [sys.executable, "-S", "-m", "nixl_io_uring_dmabuf", "install"],
        E.child_env(env["path"][1:]),
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert (
        "error: `import nixl` fails in this Python environment (ModuleNotFoundError: No module "
        "named 'nixl')" in p.stderr
    ), p.stderr
    assert (
        f"\nfix: {sys.executable} -m pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy\n"
        in p.stderr
    ), p.stderr
    assert not os.listdir(env["plugins"]) or "libplugin_IO_URING_DMABUF.so" not in os.listdir(
        env["plugins"]
    ), "a refused install left the plugin behind"


def test_dynamo_recipe_install_as_gds_mt_and_posix(env):
    """The Dynamo recipe: `install --as GDS_MT,POSIX` into the default folder, then Dynamo KVBM's
    disk-tier calls (build_agent() creates GDS_MT and POSIX with get_plugin_params defaults;
    the replay in tests/python/replay/test_replay_dynamo.py) with no NIXL_PLUGIN_DIR."""
    p = cli(env, "install", "--as", "GDS_MT,POSIX")
    assert p.returncode == 0, p.stderr
    replay = os.path.join(E.REPO, "tests", "python", "replay")
    work = env["tmp"] / "dynamo"
    work.mkdir()
    p = E.run(
        [
            sys.executable,
            "-c",
            DYNAMO_CHILD,
            str(work),
            replay,
            os.path.join(E.REPO, "tests", "python"),
        ],
        E.child_env(env["path"]),
    )
    assert p.returncode == 0 and "CHILD OK" in p.stdout, p.stderr[-3000:]
    assert p.stderr.count("IO_URING_DMABUF serving as GDS_MT ") == 1
    assert p.stderr.count("IO_URING_DMABUF serving as POSIX ") == 1


DYNAMO_CHILD = r"""
import sys
import numpy as np
sys.path[:0] = sys.argv[2:]
import test_replay_dynamo as D
chosen = D.replay(["GDS_MT", "POSIX"], "DRAM", True, sys.argv[1], np.random.default_rng(11))
print("CHOSEN", sorted(chosen))
print("CHILD OK")
"""


def test_bench_command_round_trips(env):
    assert cli(env, "install").returncode == 0
    p = cli(
        env,
        "bench",
        "--size",
        "4M",
        "--block",
        "1M",
        "--iters",
        "1",
        "--dir",
        str(env["tmp"]),
        "--backends",
        "IO_URING_DMABUF,POSIX",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith(("IO_URING_DMABUF ", "POSIX "))]
    assert len(rows) == 2 and all(r.endswith("OK") for r in rows), p.stdout
