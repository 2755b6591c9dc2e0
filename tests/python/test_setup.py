"""ci/setup.sh decides what to install from dpkg's own records of the exact packages. Replays
machine states through a private dpkg status database (IUD_DPKG_ADMINDIR): the state that fooled
the old file glob (libclang-cpp14 present, libclang-dev absent) must ask for libclang-dev."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SETUP_PACKAGES = ["g++", "libclang-dev", "python3-venv", "mount"]


def needs(tmp_path, installed):
    if shutil.which("dpkg-query") is None:
        pytest.skip("no dpkg-query: ci/setup.sh targets Debian")
    admin = tmp_path / "dpkg"
    (admin / "info").mkdir(parents=True)
    (admin / "updates").mkdir()
    (admin / "status").write_text(
        "".join(
            f"Package: {p}\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1\n\n"
            for p in installed
        )
    )
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "ci", "setup.sh"), "--needs"],
        capture_output=True,
        text=True,
        env=dict(os.environ, IUD_DPKG_ADMINDIR=str(admin)),
        check=True,
    )
    return r.stdout.split()


def test_libclang_cpp_alone_does_not_count_as_libclang(tmp_path):
    state = ["g++", "python3-venv", "mount", "libclang-cpp14", "libllvm14", "llvm-14"]
    assert needs(tmp_path, state) == ["libclang-dev"]


def test_a_bare_machine_needs_every_package(tmp_path):
    assert needs(tmp_path, ["gcc", "python3"]) == SETUP_PACKAGES


def test_nothing_is_installed_when_everything_is_there(tmp_path):
    assert needs(tmp_path, SETUP_PACKAGES + ["libclang-cpp14"]) == []


def test_this_machine_has_what_setup_installs():
    # ci/test.sh ran setup first, so the real dpkg database must have every package now.
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "ci", "setup.sh"), "--needs"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.split() == [], f"setup left out: {r.stdout}"
