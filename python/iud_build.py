"""In-tree PEP 517 build backend: a manylinux wheel holding nixl_io_uring_dmabuf and the plugin.

The plugin library comes from $IUD_PLUGIN_SO, else <target>/release/libio_uring_dmabuf.so
($CARGO_TARGET_DIR or ../target), as `cargo build --release` leaves it. It is stored in the
wheel as nixl_io_uring_dmabuf/lib/libplugin_IO_URING_DMABUF.so. No network, no dependencies.

The platform tag is read from the library itself (PEP 600): manylinux_2_<N>_<arch>, where 2.N is
the newest GLIBC_2.* symbol version it needs, so the tag follows the glibc the library was
linked against. The build refuses a library that needs (DT_NEEDED) anything beyond the C and C++
runtime: vendor libraries (libcuda, libcufile, HSA, Vulkan) are dlopen'ed at run time, never
linked. auditwheel checks the rest of the policy (libstdc++ and libgcc_s symbol versions):
tests/python/test_wheel_tag.py runs `auditwheel show` on the built wheel.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import struct
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "nixl_io_uring_dmabuf"
PLUGIN_IN_WHEEL = f"{PACKAGE}/lib/libplugin_IO_URING_DMABUF.so"

# The glibc libraries, whose GLIBC_2.* versions set the tag, and what else the library may need:
# the C++ runtime, which every manylinux policy allows (libstdc++ at the policy's GLIBCXX level).
GLIBC_LIBS = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}
SYSTEM_LIBS = GLIBC_LIBS | {"libgcc_s.so.1", "libstdc++.so.6"}
ELF_ARCH = {62: "x86_64", 183: "aarch64"}  # e_machine: EM_X86_64, EM_AARCH64


def _project():
    text = open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8").read()
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the two fields needed here
        name = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M).group(1)
        version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
        summary = re.search(r'^description\s*=\s*"([^"]+)"', text, re.M).group(1)
        return {
            "name": name,
            "version": version,
            "description": summary,
            "requires-python": ">=3.9",
            "scripts": {"nixl-io-uring-dmabuf": f"{PACKAGE}.tools.cli:main"},
        }
    p = tomllib.loads(text)["project"]
    return {
        "name": p["name"],
        "version": p["version"],
        "description": p["description"],
        "requires-python": p.get("requires-python", ""),
        "scripts": p.get("scripts", {}),
    }


def plugin_source() -> str:
    path = os.environ.get("IUD_PLUGIN_SO")
    if not path:
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(HERE, "..", "target")
        path = os.path.join(target, "release", "libio_uring_dmabuf.so")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"plugin library {path} not found: run `cargo build --release --lib` (ci/build.sh) "
            "first, or set IUD_PLUGIN_SO"
        )
    return path


def elf_needs(path: str) -> tuple[str, list[str], dict[str, set[str]]]:
    """(arch, DT_NEEDED libraries, {library: symbol versions needed from it}) of a 64-bit
    little-endian ELF shared library, from its .dynamic and .gnu.version_r sections."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    (shoff,) = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]

    def string(strtab: int, off: int) -> str:
        start = sections[strtab][4] + off
        return data[start : data.index(b"\0", start)].decode()

    needed: list[str] = []
    versions: dict[str, set[str]] = {}
    for _, sh_type, _, _, offset, size, link, info, _, _ in sections:
        if sh_type == 6:  # SHT_DYNAMIC: (d_tag, d_val) pairs; DT_NEEDED = 1, DT_NULL = 0
            for pos in range(offset, offset + size, 16):
                tag, val = struct.unpack_from("<qQ", data, pos)
                if tag == 0:
                    break
                if tag == 1:
                    needed.append(string(link, val))
        elif sh_type == 0x6FFFFFFE:  # SHT_GNU_verneed: `info` Elf64_Verneed entries
            pos = offset
            for _ in range(info):
                _, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, pos)
                names = versions.setdefault(string(link, file_off), set())
                apos = pos + aux
                for _ in range(cnt):
                    _, _, _, name_off, anext = struct.unpack_from("<IHHII", data, apos)
                    names.add(string(link, name_off))
                    apos += anext
                pos += nxt
    return ELF_ARCH.get(machine, f"machine{machine}"), needed, versions


def platform_tag(path: str) -> str:
    """manylinux_2_N_<arch> for the library at `path`; ValueError when no manylinux tag fits."""
    arch, needed, versions = elf_needs(path)
    if arch not in ELF_ARCH.values():
        raise ValueError(f"{path}: no manylinux tag for ELF {arch}")
    extra = [lib for lib in needed if lib not in SYSTEM_LIBS]
    if extra:
        raise ValueError(
            f"{path} links {', '.join(extra)}: a manylinux wheel may need only "
            f"{', '.join(sorted(SYSTEM_LIBS))}; load vendor libraries with dlopen"
        )
    glibc = [v for lib, names in versions.items() if lib in GLIBC_LIBS for v in names]
    private = [v for v in glibc if not re.fullmatch(r"GLIBC_2\.\d+(\.\d+)?", v)]
    if private:
        raise ValueError(
            f"{path} needs glibc's {', '.join(sorted(private))}, which no manylinux policy allows"
        )
    minor = max((int(v.split(".")[1]) for v in glibc), default=17)
    return f"manylinux_2_{minor}_{arch}"


def _tag(plugin: str) -> str:
    return f"py3-none-{platform_tag(plugin)}"


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    proj = _project()
    dist = proj["name"].replace("-", "_")
    version = proj["version"]
    plugin = plugin_source()
    tag = _tag(plugin)
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
    files.append((PLUGIN_IN_WHEEL, open(plugin, "rb").read(), 0o755))
    metadata = (
        f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {version}\n"
        f"Summary: {proj['description']}\nLicense: Apache-2.0\n"
    )
    if proj["requires-python"]:
        metadata += f"Requires-Python: {proj['requires-python']}\n"
    wheel = f"Wheel-Version: 1.0\nGenerator: iud_build\nRoot-Is-Purelib: false\nTag: {tag}\n"
    entry = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in proj["scripts"].items())
    files += [
        (f"{dist_info}/METADATA", metadata.encode(), 0o644),
        (f"{dist_info}/WHEEL", wheel.encode(), 0o644),
        (f"{dist_info}/entry_points.txt", entry.encode(), 0o644),
    ]
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
