"""pytest setup for the remote-storage tests: two network namespaces as two hosts (testbed.py).

IUD_REMOTE_SETUP=0 keeps the tests from running ci/remote-setup.sh (apt) on a machine without
package access; IUD_ETCD names an etcd binary carried there.

Host A runs etcd and the storage node, host B the client processes (client_worker.py); UCX talks
TCP over a veth pair between them. Needs root, iproute2, etcd (ci/remote-setup.sh installs the
last two) and the plugin folder from ci/build.sh; without them every test skips with the reason.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

from nixl_io_uring_dmabuf.storage_node import nixl_runtime, testbed  # noqa: E402

nixl_runtime.use_project_plugins()

WORKER = os.path.join(os.path.dirname(__file__), "client_worker.py")
MiB = 1 << 20


def _remote_setup() -> dict:
    """Run ci/remote-setup.sh once if iproute2 or etcd is missing (apt; a machine without
    network access keeps what it has). Returns {package: why it is still missing}."""
    script = os.path.join(REPO, "ci", "remote-setup.sh")

    def needs():
        r = subprocess.run(["bash", script, "--needs"], capture_output=True, text=True)
        return r.stdout.split()

    missing = needs()
    if not missing:
        return {}
    if os.environ.get("IUD_REMOTE_SETUP") == "0":  # machines without apt access (the GPU host)
        return {p: "not installed (IUD_REMOTE_SETUP=0: not installing)" for p in missing}
    if os.geteuid() != 0:
        return {
            p: "not installed, and not root to install it (run ci/remote-setup.sh)" for p in missing
        }
    r = subprocess.run(["bash", script], capture_output=True, text=True, timeout=300)
    why = (
        f"ci/remote-setup.sh failed: {r.stderr.strip()[-300:]}" if r.returncode else "not installed"
    )
    return {p: why for p in needs()}


@pytest.fixture(scope="session")
def remote_setup():
    return _remote_setup()


@pytest.fixture
def bed(remote_setup):
    if "iproute2" in remote_setup:
        pytest.skip(f"iproute2: {remote_setup['iproute2']}")
    if not testbed.plugin_dir_ready():
        pytest.skip(
            "no plugin folder with IO_URING_DMABUF (run bash ci/build.sh; NIXL_PLUGIN_DIR="
            f"{os.environ.get('NIXL_PLUGIN_DIR')!r})"
        )
    b = testbed.Testbed()
    try:
        b.up()
    except testbed.TestbedUnavailable as e:
        pytest.skip(f"two-host testbed unavailable: {e}")
    try:
        yield b
    finally:
        b.down()


@pytest.fixture
def etcd(bed, remote_setup):
    if "etcd-server" in remote_setup:
        pytest.skip(f"etcd: {remote_setup['etcd-server']}")
    try:
        return bed.start_etcd()
    except testbed.TestbedUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def data_file(bed):
    """A random 48 MiB read-only export."""
    path = os.path.join(bed.tmp, "kv.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(48 * MiB))
    return path


class Worker:
    """A client_worker.py process on host B; call() sends one command and returns its answer."""

    def __init__(self, bed, etcd=None, name="w"):
        self.log = os.path.join(bed.tmp, f"client-{name}-{len(bed.procs)}.log")
        self.p = bed.client(
            [sys.executable, WORKER],
            etcd=etcd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.events = []
        assert self.next(60).get("event") == "ready", self.tail()

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def tail(self) -> str:
        return f"client log {self.log}:\n" + open(self.log).read()[-3000:]

    def next(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(
                f"client worker gave no answer within {timeout:.0f} s (hung)\n{self.tail()}"
            )
        if line is None:
            pytest.fail(f"client worker exited ({self.p.poll()})\n{self.tail()}")
        return json.loads(line)

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def answer(self, timeout: float = 120) -> dict:
        while True:
            r = self.next(timeout)
            if "event" in r:
                self.events.append(r)
                continue
            return r

    def call(self, timeout: float = 120, **cmd) -> dict:
        self.send(**cmd)
        return self.answer(timeout)


@pytest.fixture
def worker(bed):
    made = []

    def make(etcd=None, name="w"):
        w = Worker(bed, etcd, name)
        made.append(w)
        return w

    return make
