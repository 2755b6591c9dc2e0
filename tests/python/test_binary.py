"""The plugin binary as NIXL loads it: exports the two plugin entry points plus exactly the
Vulkan allocator functions declared in include/iud_vulkan.h, and links neither NIXL nor CUDA
(both are reached at run time only: NIXL through the plugin ABI, CUDA and Vulkan by dlopen)."""

from __future__ import annotations

import os
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
    out = subprocess.run(
        [_tool("nm"), "-D", "--defined-only", plugin_so], check=True, capture_output=True, text=True
    ).stdout
    syms = {ln.split()[-1]: ln.split()[-2] for ln in out.splitlines() if len(ln.split()) >= 2}
    for name in ("nixl_plugin_init", "nixl_plugin_fini"):
        assert name in syms, f"{name} is not a defined dynamic symbol of {plugin_so}:\n{out}"
        assert syms[name] in ("T", "t", "W"), f"{name} has symbol type {syms[name]}"


def _header_functions():
    """Function names declared in include/iud_vulkan.h (comments stripped)."""
    header = os.path.join(os.path.dirname(__file__), "..", "..", "include", "iud_vulkan.h")
    with open(header) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    return set(re.findall(r"\b(iud_\w+)\s*\(", text))


def test_exports_exactly_the_entry_points_and_the_documented_vulkan_api(plugin_so):
    out = subprocess.run(
        [_tool("nm"), "-D", "--defined-only", plugin_so], check=True, capture_output=True, text=True
    ).stdout
    exported = {ln.split()[-1] for ln in out.splitlines() if len(ln.split()) >= 2}
    documented = _header_functions()
    assert documented >= {"iud_vulkan_alloc", "iud_vulkan_free", "iud_vulkan_variant"}, documented
    allowed = {"nixl_plugin_init", "nixl_plugin_fini"} | documented
    assert exported == allowed, (
        f"undocumented exports: {sorted(exported - allowed)}; "
        f"documented but missing: {sorted(allowed - exported)}"
    )


def test_no_nixl_or_cuda_link_dependency(plugin_so):
    out = subprocess.run(
        [_tool("ldd"), plugin_so], check=True, capture_output=True, text=True
    ).stdout
    bad = [
        ln.strip()
        for ln in out.splitlines()
        if re.search(r"\blib(nixl|cuda|cudart|cufile|vulkan)\w*\.so", ln)
    ]
    assert not bad, f"{plugin_so} links against NIXL/CUDA libraries:\n" + "\n".join(bad)
    missing = [ln.strip() for ln in out.splitlines() if "not found" in ln]
    assert not missing, "unresolved link dependencies:\n" + "\n".join(missing)


def test_vulkan_header_compiles_and_matches_the_library(plugin_so, tmp_path):
    """A C program built against include/iud_vulkan.h, linked to the plugin file, calls the
    argument checks of the allocator (no Vulkan driver needed)."""
    include = os.path.join(os.path.dirname(__file__), "..", "..", "include")
    src = tmp_path / "use_header.c"
    src.write_text(r"""
#include <stdio.h>
#include <string.h>
#include "iud_vulkan.h"
int main(void) {
    uint64_t addr = 0;
    if (iud_vulkan_variant(4096) != NULL) return 10;
    if (iud_vulkan_free(4096) != IUD_VK_EINVAL) return 11;
    if (strstr(iud_vulkan_last_error(), "iud_vulkan_free") == NULL) return 12;
    if (iud_vulkan_alloc(0, 4096, NULL) != IUD_VK_EINVAL) return 13;
    if (iud_vulkan_alloc(0, 0, &addr) != IUD_VK_EINVAL || addr != 0) return 14;
    puts("ok");
    return 0;
}
""")
    exe = tmp_path / "use_header"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run(
        [
            cc,
            "-std=c99",
            "-Wall",
            "-Werror",
            "-I",
            include,
            str(src),
            plugin_so,
            f"-Wl,-rpath,{os.path.dirname(plugin_so)}",
            "-o",
            str(exe),
        ],
        check=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (
        run.returncode,
        run.stdout,
        run.stderr,
    )
