"""In-tree PEP 517 build backend: a platform wheel holding nixl_io_uring_dmabuf and the plugin.

The plugin library comes from $IUD_PLUGIN_SO, else <target>/release/libio_uring_dmabuf.so
($CARGO_TARGET_DIR or ../target), as `cargo build --release` leaves it. It is stored in the
wheel as nixl_io_uring_dmabuf/lib/libplugin_IO_URING_DMABUF.so. No network, no dependencies.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sysconfig
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "nixl_io_uring_dmabuf"
PLUGIN_IN_WHEEL = f"{PACKAGE}/lib/libplugin_IO_URING_DMABUF.so"


def _project():
    text = open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8").read()
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the two fields needed here
        name = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M).group(1)
        version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
        summary = re.search(r'^description\s*=\s*"([^"]+)"', text, re.M).group(1)
        return {"name": name, "version": version, "description": summary,
                "requires-python": ">=3.9",
                "scripts": {"nixl-io-uring-dmabuf": f"{PACKAGE}.cli:main"}}
    p = tomllib.loads(text)["project"]
    return {"name": p["name"], "version": p["version"], "description": p["description"],
            "requires-python": p.get("requires-python", ""), "scripts": p.get("scripts", {})}


def plugin_source() -> str:
    path = os.environ.get("IUD_PLUGIN_SO")
    if not path:
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(HERE, "..", "target")
        path = os.path.join(target, "release", "libio_uring_dmabuf.so")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"plugin library {path} not found: run `cargo build --release --lib` (ci/build.sh) "
            "first, or set IUD_PLUGIN_SO")
    return path


def _tag() -> str:
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"py3-none-{plat}"


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    proj = _project()
    dist = proj["name"].replace("-", "_")
    version = proj["version"]
    tag = _tag()
    name = f"{dist}-{version}-{tag}.whl"
    dist_info = f"{dist}-{version}.dist-info"
    files: list[tuple[str, bytes, int]] = []
    pkg_dir = os.path.join(HERE, PACKAGE)
    for root, dirs, names in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "lib"))
        for n in sorted(names):
            if n.endswith(".py"):
                full = os.path.join(root, n)
                arc = os.path.relpath(full, HERE).replace(os.sep, "/")
                files.append((arc, open(full, "rb").read(), 0o644))
    files.append((PLUGIN_IN_WHEEL, open(plugin_source(), "rb").read(), 0o755))
    metadata = (f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {version}\n"
                f"Summary: {proj['description']}\nLicense: Apache-2.0\n")
    if proj["requires-python"]:
        metadata += f"Requires-Python: {proj['requires-python']}\n"
    wheel = f"Wheel-Version: 1.0\nGenerator: iud_build\nRoot-Is-Purelib: false\nTag: {tag}\n"
    entry = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in proj["scripts"].items())
    files += [(f"{dist_info}/METADATA", metadata.encode(), 0o644),
              (f"{dist_info}/WHEEL", wheel.encode(), 0o644),
              (f"{dist_info}/entry_points.txt", entry.encode(), 0o644)]
    record = [_record_line(arc, data) for arc, data, _ in files] + [f"{dist_info}/RECORD,,"]
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), 0o644))
    os.makedirs(wheel_directory, exist_ok=True)
    out = os.path.join(wheel_directory, name)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arc, data, mode in files:
            info = zipfile.ZipInfo(arc, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return name
