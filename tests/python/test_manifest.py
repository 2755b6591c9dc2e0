"""What NIXL reports about the plugin (get_plugin_params / get_plugin_mem_types /
get_backend_mem_types), the parameters create_backend accepts, and the parameter table of
docs/parameters.md all agree with plugin-manifest/IO_URING_DMABUF.toml, the single source of
these facts."""

from __future__ import annotations

import os
import re

import iud_helpers as H
import numpy as np
import pytest
import tomllib

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MANIFEST = os.path.join(REPO, "plugin-manifest", f"{H.PLUGIN}.toml")
PARAMS_DOC = os.path.join(REPO, "docs", "parameters.md")


def manifest():
    with open(MANIFEST, "rb") as f:
        m = tomllib.load(f)
    params = {p["name"]: str(p["default"]) for p in m.get("param", [])}
    return m["plugin"], params


def test_manifest_is_consistent():
    plugin, params = manifest()
    assert plugin["name"] == H.PLUGIN
    assert {"DRAM_SEG", "FILE_SEG"} <= set(plugin["mems"]), plugin["mems"]
    assert params, "the manifest defines no [[param]]"
    with open(MANIFEST, "rb") as f:
        raw = tomllib.load(f)
    names = [p["name"] for p in raw["param"]]
    assert len(names) == len(set(names)), f"duplicate param names: {names}"
    for p in raw["param"]:
        assert p.get("doc", "").strip(), f"param {p['name']} has no doc"


def test_plugin_params_match_manifest(plugin_so):
    from nixl._api import nixl_agent, nixl_agent_config

    plugin, params = manifest()
    agent = nixl_agent(H.unique_name("params"), nixl_agent_config(backends=[]))
    assert H.PLUGIN in agent.get_plugin_list(), (
        f"{H.PLUGIN} not in the plugin list {agent.get_plugin_list()}"
    )
    got = agent.get_plugin_params(H.PLUGIN)
    assert got == params, (
        f"get_plugin_params({H.PLUGIN!r}) = {got}\nmanifest params         = {params}"
    )
    mems = agent.get_plugin_mem_types(H.PLUGIN)
    assert list(mems) == list(plugin["mems"]), (
        f"get_plugin_mem_types = {mems}, manifest mems = {plugin['mems']}"
    )
    agent.create_backend(H.PLUGIN, {})
    assert sorted(agent.get_backend_mem_types(H.PLUGIN)) == sorted(plugin["mems"])


def small_roundtrip(agent, rng, tmp_path, tag):
    rig = H.Rig(agent, H.PLUGIN)
    path = str(tmp_path / f"{tag}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        src, dst = H.Buf(1 * H.MiB).fill(rng), H.Buf(1 * H.MiB).fill(rng)
        rig.reg_dram(src)
        rig.reg_dram(dst)
        rig.reg_fd(fd, src.size)
        c = 64 * H.KiB
        n = src.size // c
        rig.run(
            rig.xfer(
                "WRITE",
                [(src.addr + i * c, c) for i in range(n)],
                [(i * c, c, fd) for i in range(n)],
            ),
            30,
            what=tag + " WRITE",
        )
        rig.run(
            rig.xfer(
                "READ",
                [(dst.addr + i * c, c) for i in range(n)],
                [(i * c, c, fd) for i in range(n)],
            ),
            30,
            what=tag + " READ",
        )
        assert np.array_equal(dst.arr, src.arr), tag + ": " + H.first_diff(dst.arr, src.arr)
        assert np.array_equal(H.read_file(path), src.arr), tag + " file"
    finally:
        rig.close()
        os.close(fd)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"file_path": "/tmp/lmcache-style", "use_direct_io": "true"},  # LMCache passes these
        {
            "use_uring": "true",
            "use_aio": "false",
            "ios_pool_size": "65536",
            "kernel_queue_size": "256",
        },  # POSIX keys (nixlbench)
        "manifest-defaults",
    ],
    ids=["empty", "lmcache-keys", "posix-keys", "manifest-defaults"],
)
def test_create_backend_accepts(plugin_so, rng, tmp_path, params):
    if params == "manifest-defaults":
        params = manifest()[1]
    agent = H.make_agent(H.PLUGIN, dict(params), name="create")
    small_roundtrip(agent, rng, tmp_path, "create")


# ---- the parameter table of docs/parameters.md ------------------------------------------------


def _cells(line):
    line = line.strip()
    if not line.startswith("|"):
        return None
    return [c.strip() for c in line.strip("|").split("|")]


def _unquote(cell):
    cell = cell.strip()
    for q in ("`", '"', "'"):
        if len(cell) >= 2 and cell[0] == q and cell[-1] == q:
            cell = cell[1:-1].strip()
    return cell


def doc_param_table():
    """Rows of the docs/parameters.md table whose first column holds manifest param names in
    backticks: {name: (default, description)}."""
    if not os.path.exists(PARAMS_DOC):
        pytest.fail(
            f"{PARAMS_DOC} does not exist; it must document the backend parameters in a "
            "markdown table: | `name` | default | description |"
        )
    with open(PARAMS_DOC, encoding="utf-8") as f:
        lines = f.read().splitlines()
    _, params = manifest()
    tables, cur = [], []
    for ln in lines + [""]:
        cells = _cells(ln)
        if cells is not None:
            cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    for t in tables:
        rows = {}
        for cells in t:
            m = re.fullmatch(r"`([^`]+)`", cells[0]) if cells else None
            if m and len(cells) >= 3:
                rows[m.group(1)] = (_unquote(cells[1]), cells[2])
        if set(rows) & set(params):
            return rows
    pytest.fail(
        "docs/parameters.md has no parameter table: expected a markdown table with rows like "
        "'| `ring_entries` | `512` | description |' whose first column names the "
        f"parameters of {os.path.relpath(MANIFEST, REPO)}"
    )


def test_doc_param_table_matches_manifest():
    _, params = manifest()
    rows = doc_param_table()
    missing = sorted(set(params) - set(rows))
    extra = sorted(set(rows) - set(params))
    assert not missing and not extra, (
        f"docs/parameters.md table vs manifest: missing {missing}, not in the manifest {extra}"
    )
    wrong = {k: (rows[k][0], params[k]) for k in params if rows[k][0] != params[k]}
    assert not wrong, (
        f"docs/parameters.md defaults differ from the manifest (doc, manifest): {wrong}"
    )
    empty = [k for k in params if not rows[k][1].strip()]
    assert not empty, f"docs/parameters.md rows without a description: {empty}"
