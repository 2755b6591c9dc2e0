"""The wheel ci/wheel.sh builds carries a manylinux tag that is true for the plugin inside it.

python/iud_build.py tags the wheel manylinux_2_N_<arch>, N being the newest GLIBC_2.* symbol
version the plugin needs. Checked here independently of the backend's own ELF reader: the tag
against `readelf`'s view of the library, the library's DT_NEEDED list against what manylinux
allows, the whole wheel against auditwheel's policy (`auditwheel show`, from PyPI, into a venv
kept under target/), and what the tag means to pip: installable where glibc is 2.N or newer,
refused below.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
PLUGIN_SO = os.path.join(TARGET, "release", "libio_uring_dmabuf.so")
AUDITWHEEL = "auditwheel==6.8.2"
# The C and C++ runtime: all the plugin may link. CUDA, cuFile, HSA and Vulkan are dlopen'ed.
SYSTEM_LIBS = {
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


def backend():
    spec = importlib.util.spec_from_file_location(
        "iud_build", os.path.join(REPO, "python", "iud_build.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def readelf(*args: str) -> str:
    tool = shutil.which("readelf")
    if tool is None:
        pytest.fail("readelf is not installed (binutils)")
    return subprocess.run([tool, "-W", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(path, platform tag) of the wheel as ci/wheel.sh builds it: pip wheel of python/."""
    if not os.path.isfile(PLUGIN_SO):
        pytest.fail(f"{PLUGIN_SO} missing: run ci/build.sh")
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "-w",
            str(out),
            os.path.join(REPO, "python"),
        ],
        check=True,
        env=dict(os.environ, IUD_PLUGIN_SO=PLUGIN_SO),
        timeout=300,
    )
    (name,) = os.listdir(out)
    m = re.fullmatch(r"nixl_io_uring_dmabuf-[^-]+-py3-none-(.+)\.whl", name)
    assert m, name
    return str(out / name), m.group(1)


@pytest.fixture(scope="module")
def auditwheel():
    """A python that has auditwheel: $IUD_AUDITWHEEL_PY, else a venv under target/ made once."""
    if os.environ.get("IUD_AUDITWHEEL_PY"):
        return os.environ["IUD_AUDITWHEEL_PY"]
    venv = os.path.join(TARGET, "auditwheel-" + AUDITWHEEL.split("==")[1])
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        tmp = f"{venv}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True, timeout=300)
        p = subprocess.run(
            [
                os.path.join(tmp, "bin", "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                AUDITWHEEL,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, (
            f"pip install {AUDITWHEEL} failed (PyPI unreachable? set "
            f"IUD_AUDITWHEEL_PY to a python that has it):\n{p.stderr}"
        )
        try:
            os.rename(tmp, venv)  # (run through bin/python, so the move breaks no script)
        except OSError:  # another run made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return py


def test_tag_is_manylinux_at_the_newest_glibc_version_the_plugin_needs(wheel):
    path, tag = wheel
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    assert m, f"{os.path.basename(path)}: not a manylinux tag"
    assert m.group(2) == platform.machine()
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert f"Tag: py3-none-{tag}\n" in meta, meta

    # readelf -V: "File: libc.so.6 ..." then that file's "Name: GLIBC_2.34 ..." lines.
    glibc, lib = [], None
    for line in readelf("-V", PLUGIN_SO).splitlines():
        f = re.search(r"File: (\S+)", line)
        if f:
            lib = f.group(1)
        v = re.search(r"Name: GLIBC_2\.(\d+)", line)
        if (
            v
            and lib
            and lib.startswith(("libc.", "libm.", "libpthread.", "libdl.", "librt.", "ld-linux"))
        ):
            glibc.append(int(v.group(1)))
    assert glibc, "readelf shows no GLIBC_2.* version needed"
    assert int(m.group(1)) == max(glibc), (tag, sorted(set(glibc)))


def test_plugin_links_only_the_c_and_cxx_runtime():
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", PLUGIN_SO))
    assert "libc.so.6" in needed, needed
    assert set(needed) <= SYSTEM_LIBS, f"links more than manylinux allows: {needed}"


def test_auditwheel_show_says_the_wheel_is_consistent_with_its_tag(wheel, auditwheel):
    path, tag = wheel
    p = subprocess.run(
        [auditwheel, "-m", "auditwheel", "show", path],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    text = " ".join(p.stdout.split())  # auditwheel wraps its lines
    m = re.search(r'is consistent with the following platform tag: "([^"]+)"', text)
    assert m, text
    assert m.group(1) == tag, f"the wheel says {tag}, auditwheel: {text}"
    c = re.search(r'This constrains the platform tag to "([^"]+)"', text)
    assert c is None or c.group(1) == tag, text


def test_pip_installs_it_where_glibc_is_new_enough_and_refuses_it_below(wheel, tmp_path):
    path, tag = wheel
    minor, arch = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag).groups()

    def dry_run(plat: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--no-deps",
                "--disable-pip-version-check",
                "--only-binary=:all:",
                "--platform",
                plat,
                "--target",
                str(tmp_path / plat),
                path,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )

    ok = dry_run(tag)
    assert ok.returncode == 0 and "Would install nixl-io-uring-dmabuf" in ok.stdout, ok.stderr
    older = dry_run(f"manylinux_2_{int(minor) - 1}_{arch}")
    assert older.returncode != 0
    assert "is not a supported wheel on this platform" in older.stderr, older.stderr


def test_build_refuses_a_plugin_that_links_a_vendor_library(tmp_path):
    """A library with libcuda.so.1 in DT_NEEDED gets no manylinux tag, so no wheel."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (ci/setup.sh installs g++)")
    (tmp_path / "cuda.c").write_text("int cuInit(unsigned flags) { return (int)flags; }\n")
    (tmp_path / "plugin.c").write_text("int cuInit(unsigned);\nint f(void) { return cuInit(0); }\n")
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(tmp_path / "libcuda.so"),
            str(tmp_path / "cuda.c"),
        ],
        check=True,
    )
    plugin = str(tmp_path / "libplugin.so")
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-o",
            plugin,
            str(tmp_path / "plugin.c"),
            f"-L{tmp_path}",
            "-lcuda",
        ],
        check=True,
    )
    assert "libcuda.so.1" in readelf("-d", plugin)
    with pytest.raises(ValueError, match=r"links libcuda\.so\.1: .*load vendor libraries with dl"):
        backend().platform_tag(plugin)
    # The real plugin passes the same function, with the tag the wheel carries.
    assert backend().platform_tag(PLUGIN_SO).startswith("manylinux_2_")
