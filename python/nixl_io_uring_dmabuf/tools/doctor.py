"""`doctor`: what a NIXL process on this machine would load under each backend name, and whether
it moves bytes.

First what `import nixl` loads in this environment (nixlenv.py: torch's CUDA build, the NIXL
packages, an `import nixl` in a child); when it fails, the report ends there with the one command
that fixes it. The static part (folders, which file is whose) reads the file system only; the
folder that counts is the one NIXL reads: NIXL_PLUGIN_DIR, else the plugins/ folder of the
runtime wheel `import nixl` loads. The live part runs in a child process, because NIXL reads NIXL_PLUGIN_DIR once per process: it creates each backend
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
from nixl_io_uring_dmabuf.tools import nixlenv
from nixl_io_uring_dmabuf.tools.install import MANIFEST, plugin_file, sha256
from nixl_io_uring_dmabuf.tools.locate import find_wheels


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
    """Prints the report; returns 0 when every name the plugin serves passed the live check.
    Every problem it finds ends the report with one `error:` line and one `fix:` command."""
    out(
        f"nixl_io_uring_dmabuf {__version__}, Python {platform.python_version()} "
        f"({sys.executable}), kernel {platform.release()}"
    )
    try:
        lib = plugin_library()
        ours = sha256(lib)
        out(f"plugin library: {lib}")
    except FileNotFoundError as e:
        out(f"error: plugin library missing: {e}")
        out(
            "fix: pip install target/wheels/nixl_io_uring_dmabuf-*.whl  (built by bash ci/wheel.sh)"
        )
        return 1
    disabled = "/proc/sys/kernel/io_uring_disabled"
    if os.path.exists(disabled):
        with open(disabled) as f:
            v = f.read().strip()
        out(
            f"io_uring_disabled = {v}"
            + ("" if v == "0" else " (io_uring is restricted: the plugin cannot create its ring)")
        )
    env = nixlenv.check()
    for line in env.describe():
        out(line)
    if not env.ok:
        lines = env.error_lines("python -m nixl_io_uring_dmabuf doctor")
        out("error: " + lines[0])
        for line in lines[1:]:
            out(line)
        return 1
    wheels = find_wheels()
    env_dir = os.environ.get("NIXL_PLUGIN_DIR")
    loaded = next((w for w in wheels if w.module == env.loads), None)
    for w in wheels:
        out(
            f"NIXL wheel {w.module}: {w.libs}"
            + (" (the one `import nixl` loads)" if w is loaded else "")
        )
    if env_dir:
        out(f"NIXL_PLUGIN_DIR={env_dir}: NIXL reads this folder instead of the wheel's plugins/")
        read = env_dir
    elif loaded is not None:
        read = loaded.plugins
    else:
        out(
            f"error: `import nixl` loads {env.loads}, whose library folder (libnixl.so and "
            "plugins/) was not found"
        )
        out(f"fix: {nixlenv.pip_command(['--force-reinstall', env.loads.replace('_', '-')])}")
        return 1
    served = []
    for folder in dict.fromkeys([read] + [w.plugins for w in wheels]):
        tag = "" if folder == read else " (not read by NIXL in this environment)"
        out(f"plugin folder {folder}:{tag}")
        for name in (PLUGIN_NAME,) + ALIASES:
            owner = _owner(plugin_file(folder, name), ours)
            out(f"  {name:16s} {owner}")
            if folder == read and owner.startswith("IO_URING_DMABUF") and name not in served:
                served.append(name)
    if not served:
        out(f"error: the plugin is not in the folder NIXL reads here ({read})")
        out(
            "fix: python -m nixl_io_uring_dmabuf install"
            + (f" --plugin-dir {env_dir}" if env_dir else "")
        )
        return 1
    if not live:
        return 0
    out("live check (child process; one 1 MiB round trip per name):")
    env_vars = dict(os.environ)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        code = (
            "import sys, json\nfrom nixl_io_uring_dmabuf.tools import roundtrip\n"
            "a = roundtrip.new_agent('iud-doctor')\n"
            "for n in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        a.create_backend(n)\n"
            "        mems = a.get_backend_mem_types(n)\n"
            "        r = roundtrip.run(a, n, sys.argv[2], 1 << 20, 1 << 18)\n"
            "        print(f'  {n:16s} mems={mems} round trip ' + ('OK' if r.ok else "
            "'FAILED: ' + r.detail), flush=True)\n"
            "    except Exception as e:\n"
            "        print(f'  {n:16s} FAILED: {e!r}', flush=True)\n"
        )
        try:
            p = subprocess.run(
                [sys.executable, "-c", code, json.dumps(served), tmp],
                env=env_vars,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired:
            out("error: the live check did not finish within 300 s")
            out(
                "fix: NIXL_LOG_LEVEL=INFO IO_URING_DMABUF_LOG=debug python -m nixl_io_uring_dmabuf "
                "doctor  (shows where it stops)"
            )
            return 1
    for line in p.stdout.splitlines():
        if line.startswith("  "):  # the child's own lines, not NIXL's INFO logging
            out(line)
    for line in p.stderr.splitlines():
        if "serving as" in line or "ERROR" in line:
            out(f"  plugin log: {line.strip()}")
    ok = p.returncode == 0 and "FAILED" not in p.stdout and p.stdout.strip() != ""
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        out(f"error: the live check's process failed (exit {p.returncode}): {last}")
        out(
            "fix: NIXL_LOG_LEVEL=INFO python -m nixl_io_uring_dmabuf doctor  (NIXL reports plugin "
            "load failures only at that level)"
        )
    elif not ok:
        out("error: a live round trip failed (lines above)")
        out(
            "fix: NIXL_LOG_LEVEL=INFO IO_URING_DMABUF_LOG=debug python -m nixl_io_uring_dmabuf "
            "doctor  (the plugin's reason is in its log)"
        )
    return 0 if ok else 1
