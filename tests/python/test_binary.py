"""The plugin binary as NIXL loads it: exports the two plugin entry points, and links neither
NIXL nor CUDA (both are reached at run time only: NIXL through the plugin ABI, CUDA by dlopen)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (binutils / libc-bin)")
    return path


def test_exports_plugin_entry_points(plugin_so):
    out = subprocess.run([_tool("nm"), "-D", "--defined-only", plugin_so], check=True,
                         capture_output=True, text=True).stdout
    syms = {ln.split()[-1]: ln.split()[-2] for ln in out.splitlines() if len(ln.split()) >= 2}
    for name in ("nixl_plugin_init", "nixl_plugin_fini"):
        assert name in syms, f"{name} is not a defined dynamic symbol of {plugin_so}:\n{out}"
        assert syms[name] in ("T", "t", "W"), f"{name} has symbol type {syms[name]}"


def test_no_nixl_or_cuda_link_dependency(plugin_so):
    out = subprocess.run([_tool("ldd"), plugin_so], check=True, capture_output=True,
                         text=True).stdout
    bad = [ln.strip() for ln in out.splitlines()
           if re.search(r"\blib(nixl|cuda|cudart|cufile)\w*\.so", ln)]
    assert not bad, f"{plugin_so} links against NIXL/CUDA libraries:\n" + "\n".join(bad)
    missing = [ln.strip() for ln in out.splitlines() if "not found" in ln]
    assert not missing, "unresolved link dependencies:\n" + "\n".join(missing)
