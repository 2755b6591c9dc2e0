"""`doctor`: what a NIXL process on this machine would load under each backend name, and whether
it moves bytes.

The static part (folders, which file is whose) reads the file system only. The live part runs in
a child process, because NIXL reads NIXL_PLUGIN_DIR once per process: it creates each backend
that the plugin serves, prints the memory kinds NIXL reports for it, and does a small DRAM ->
FILE -> DRAM round trip in a temporary folder.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile

from nixl_io_uring_dmabuf import ALIASES, PLUGIN_NAME, __version__, plugin_library
from nixl_io_uring_dmabuf.install import MANIFEST, plugin_file, sha256
from nixl_io_uring_dmabuf.locate import find_wheels


def _owner(path: str, ours: str) -> str:
    if not os.path.exists(path):
        return "absent"
    if sha256(path) == ours:
        return "IO_URING_DMABUF (this package)"
    folder = os.path.dirname(path)
    mf = os.path.join(folder, MANIFEST)
    if os.path.exists(mf):
        with open(mf, encoding="utf-8") as f:
            for e in json.load(f)["entries"]:
                if e["path"] == path and e["kind"] == "plugin":
                    return "IO_URING_DMABUF (another version, installed by this tool)"
    return "NIXL's own" if not os.path.islink(path) else f"link to {os.readlink(path)}"


def report(live: bool = True, directory: str | None = None, out=print) -> int:
    """Prints the report; returns 0 when every name the plugin serves passed the live check."""
    out(f"nixl_io_uring_dmabuf {__version__}, Python {platform.python_version()}, "
        f"kernel {platform.release()}")
    try:
        lib = plugin_library()
        ours = sha256(lib)
        out(f"plugin library: {lib}")
    except FileNotFoundError as e:
        out(f"plugin library: MISSING ({e})")
        return 1
    disabled = "/proc/sys/kernel/io_uring_disabled"
    if os.path.exists(disabled):
        v = open(disabled).read().strip()
        out(f"io_uring_disabled = {v}" + ("" if v == "0" else " (io_uring is restricted: the "
                                            "plugin cannot create its ring)"))
    wheels = find_wheels()
    if not wheels:
        out("NIXL wheels: none (pip install nixl-cu12 or nixl-cu13)")
        return 1
    env_dir = os.environ.get("NIXL_PLUGIN_DIR")
    folders = []
    for w in wheels:
        out(f"NIXL wheel {w.module}: {w.libs}")
        folders.append(w.plugins)
    if env_dir:
        out(f"NIXL_PLUGIN_DIR={env_dir}: NIXL reads this folder instead of the wheel's plugins/")
        folders = [env_dir]
    served = []
    for folder in folders:
        out(f"plugin folder {folder}:")
        for name in (PLUGIN_NAME,) + ALIASES:
            owner = _owner(plugin_file(folder, name), ours)
            out(f"  {name:16s} {owner}")
            if owner.startswith("IO_URING_DMABUF") and name not in served:
                served.append(name)
    if not served:
        out("the plugin is not installed where NIXL looks: python -m nixl_io_uring_dmabuf install")
        return 1
    if not live:
        return 0
    out("live check (child process; one 1 MiB round trip per name):")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        code = ("import sys, json\nfrom nixl_io_uring_dmabuf import roundtrip\n"
                "a = roundtrip.new_agent('iud-doctor')\n"
                "for n in json.loads(sys.argv[1]):\n"
                "    try:\n"
                "        a.create_backend(n)\n"
                "        mems = a.get_backend_mem_types(n)\n"
                "        r = roundtrip.run(a, n, sys.argv[2], 1 << 20, 1 << 18)\n"
                "        print(f'  {n:16s} mems={mems} round trip ' + ('OK' if r.ok else "
                "'FAILED: ' + r.detail), flush=True)\n"
                "    except Exception as e:\n"
                "        print(f'  {n:16s} FAILED: {e!r}', flush=True)\n")
        p = subprocess.run([sys.executable, "-c", code, json.dumps(served), tmp], env=env,
                           capture_output=True, text=True, timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("  "):  # the child's own lines, not NIXL's INFO logging
            out(line)
    for line in p.stderr.splitlines():
        if "serving as" in line or "ERROR" in line:
            out(f"  plugin log: {line.strip()}")
    ok = p.returncode == 0 and "FAILED" not in p.stdout and p.stdout.strip() != ""
    if p.returncode != 0:
        out(f"  the child process failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
    return 0 if ok else 1
