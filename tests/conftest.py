"""pytest setup shared by every suite under tests/ (python, reliability, gpu, remote).

Environment:
  IUD_TEST_BACKEND   backend under test (default IO_URING_DMABUF; POSIX validates the harness)
  IUD_TEST_PARAMS    extra backend params, "k=v,k=v"
  IUD_PLUGIN_DIR     NIXL plugin directory (support/plugin_dir.py); NIXL_PLUGIN_DIR is set from
                     it here, before nixl is imported.
"""

from __future__ import annotations

import gc
import os
import sys

from support.plugin_dir import use_test_plugin_dir

use_test_plugin_dir()

import iud_helpers as H  # noqa: E402
import pytest  # noqa: E402


def pytest_report_header(config):
    return [
        f"IUD_TEST_BACKEND={H.test_backend()} params={H.default_params(H.test_backend())} "
        f"NIXL_PLUGIN_DIR={os.environ['NIXL_PLUGIN_DIR']}"
    ]


@pytest.fixture(scope="session")
def backend() -> str:
    return H.test_backend()


@pytest.fixture(scope="session")
def is_plugin(backend) -> bool:
    return backend == H.PLUGIN


@pytest.fixture(scope="session")
def plugin_so(backend) -> str:
    """Our plugin as NIXL loads it. Missing: a failure when it is the backend under test."""
    path = os.path.join(os.environ["NIXL_PLUGIN_DIR"], f"libplugin_{H.PLUGIN}.so")
    if not os.path.exists(path):
        msg = f"{path} does not exist (run ci/build.sh)"
        if backend == H.PLUGIN:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def rng(request):
    import numpy as np

    seed = int.from_bytes(os.urandom(8), "little")
    print(f"rng seed for {request.node.name}: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def rig(backend):
    agent = H.make_agent(backend)
    r = H.Rig(agent, backend)
    yield r
    r.close()
    del r, agent
    gc.collect()


@pytest.fixture
def known_posix_failure(request, backend):
    """Mark the test xfail when run against POSIX, for a documented POSIX limitation."""

    def mark(reason: str):
        if backend == "POSIX":
            request.node.add_marker(pytest.mark.xfail(reason="POSIX: " + reason, strict=False))

    return mark


@pytest.fixture
def stderr_log(capfd):
    """Returns a function giving the stderr written since its previous call."""
    capfd.readouterr()

    def take() -> str:
        out, err = capfd.readouterr()
        sys.stdout.write(out)
        sys.stdout.write(err)  # keep it visible in the failure report
        return err

    return take


@pytest.fixture(scope="session")
def direct_ok(tmp_path_factory) -> bool:
    d = tmp_path_factory.mktemp("odirect-probe")
    try:
        fd = os.open(str(d / "probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.fixture
def need_direct(direct_ok):
    if not direct_ok:
        pytest.skip("the test directory's filesystem does not support O_DIRECT")
