"""Fixtures of the client tests: the clients venv with the project's wheel and a NIXL copy."""

from __future__ import annotations

import clients_env as E
import pytest


@pytest.fixture(scope="session")
def clients(tmp_path_factory):
    """The clients venv (ci/clients-setup.sh) plus, beside it, the project's wheel (pip
    --target) and a copy of its NIXL wheel with the plugin installed --as POSIX into the copy's
    default plugin folder (IO_URING_DMABUF is installed there by its own name too)."""
    py = E.clients_python()
    tmp = tmp_path_factory.mktemp("lmcache")
    pkgs = E.pip_target(E.build_wheel(str(tmp / "wheel")), str(tmp / "pkgs"))
    site = str(tmp / "site")
    E.copy_nixl(site, E.wheel_module_of(py))
    p = E.run(
        [py, "-m", "nixl_io_uring_dmabuf", "install", "--as", "POSIX"], E.child_env([site, pkgs])
    )
    assert p.returncode == 0, p.stderr
    return {"py": py, "pkgs": pkgs, "site": site, "tmp": tmp}


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The tiny random Llama + local tokenizer of vllm_engine.py, made once per session."""
    import vllm_engine

    E.clients_python()
    return vllm_engine.tiny_model(str(tmp_path_factory.mktemp("vllm-model")))
