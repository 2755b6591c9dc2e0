"""Two "hosts" on one machine for tests and benchmarks: network namespaces joined by a veth pair.

Host A (10.77.0.1) runs etcd and storage nodes, host B (10.77.0.2) runs clients; UCX talks TCP over
the veth pair, so every byte crosses a real (virtual) network link and nothing listens outside the
two namespaces. Every process started here is tracked, and ``down()`` kills them and deletes the
namespaces (which destroys the veth pair) even after a failure. Needs root and iproute2.
"""

from __future__ import annotations

import glob
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: The folder that holds the nixl_io_uring_dmabuf package (python/ in a checkout): the PYTHONPATH
#: of the processes started here, so they import this same copy.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = os.path.dirname(PACKAGE_ROOT)
A_IP, B_IP = "10.77.0.1", "10.77.0.2"


def _tcp_tls() -> str:
    """UCX_TLS for TCP between the two hosts. NIXL 1.5.1's UCX backend refuses UCX_TLS=tcp alone
    on a machine with NVIDIA GPUs ("does not enable CUDA memory support. Add cuda_copy", seen on
    the H200 machine, bench/results/2026-12-01-gpu-h200-issue13.md), so there cuda_copy is added;
    the bytes of DRAM requests still go over TCP."""
    return "tcp,cuda_copy" if os.path.exists("/dev/nvidiactl") else "tcp"


class TestbedUnavailable(RuntimeError):
    """The machine cannot host the two namespaces (not root, no iproute2, no netns support)."""


def find_etcd() -> str | None:
    """etcd from IUD_ETCD, PATH, or where ci/remote-setup.sh unpacks Debian's etcd-server."""
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    for c in (
        os.environ.get("IUD_ETCD"),
        shutil.which("etcd"),
        os.path.join(target, "remote-tools", "usr", "bin", "etcd"),
    ):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")


class Testbed:
    def __init__(self, tag: str | None = None, mtu: int = 1500):
        tag = tag or str(os.getpid())
        self.ns_a, self.ns_b = f"iuds-{tag}-a", f"iuds-{tag}-b"
        self.veth_a, self.veth_b = f"iuds{tag}a"[:15], f"iuds{tag}b"[:15]
        self.mtu = mtu
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="iuds-testbed-")
        self._up = False

    # ---- namespaces ----------------------------------------------------------------------------

    @staticmethod
    def sweep_stale() -> None:
        """Delete namespace pairs left by a testbed whose process was killed (SIGKILL skips
        down()): names iuds-<pid>-a/b whose pid no longer exists."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            m = re.match(r"(iuds-(\d+)-[ab])\b", line)
            if not m or os.path.exists(f"/proc/{m[2]}"):
                continue
            pids = subprocess.run(
                ["ip", "netns", "pids", m[1]], capture_output=True, text=True
            ).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", m[1]], capture_output=True)

    def up(self) -> Testbed:
        if os.geteuid() != 0:
            raise TestbedUnavailable("needs root to create network namespaces")
        if not shutil.which("ip"):
            raise TestbedUnavailable("iproute2 ('ip') is not installed; run ci/remote-setup.sh")
        self.sweep_stale()
        try:
            _run("ip", "netns", "add", self.ns_a)
            self._up = True
            _run("ip", "netns", "add", self.ns_b)
            _run("ip", "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
            _run("ip", "link", "set", self.veth_a, "netns", self.ns_a)
            _run("ip", "link", "set", self.veth_b, "netns", self.ns_b)
            for ns, dev, ip in ((self.ns_a, self.veth_a, A_IP), (self.ns_b, self.veth_b, B_IP)):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu))
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            self.down()
            raise TestbedUnavailable(f"cannot create the namespace pair: {e}") from None
        return self

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self._up:
            for ns in (self.ns_a, self.ns_b):
                # Anything still inside (a child of a tracked process) goes too.
                r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                for pid in r.stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._up = False
        if not os.environ.get("IUD_KEEP_TESTBED"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    # ---- processes -----------------------------------------------------------------------------

    def env(self, host: str, **extra) -> dict:
        """Environment for a process on host "a" or "b": UCX over TCP on that host's veth only."""
        e = dict(os.environ)
        e.update(
            UCX_TLS=_tcp_tls(),
            UCX_NET_DEVICES=self.veth_a if host == "a" else self.veth_b,
            PYTHONPATH=PACKAGE_ROOT + os.pathsep + e.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
        )
        e.update({k: str(v) for k, v in extra.items() if v is not None})
        for k, v in extra.items():
            if v is None:
                e.pop(k, None)
        return e

    def spawn(
        self, host: str, argv: list[str], env: dict | None = None, **popen
    ) -> subprocess.Popen:
        ns = self.ns_a if host == "a" else self.ns_b
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env or self.env(host), **popen)
        self.procs.append(p)
        return p

    def start_etcd(self, timeout: float = 30.0) -> str:
        """etcd on host A; returns its client URL (for NIXL_ETCD_ENDPOINTS)."""
        etcd = find_etcd()
        if not etcd:
            raise TestbedUnavailable(
                "etcd not found (apt: etcd-server; ci/remote-setup.sh unpacks it)"
            )
        url = f"http://{A_IP}:2379"
        log = os.path.join(self.tmp, "etcd.log")
        data = tempfile.mkdtemp(prefix="etcd-", dir=self.tmp)
        p = self.spawn(
            "a",
            [
                etcd,
                "--name",
                "iuds",
                "--data-dir",
                data,
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "iuds=http://127.0.0.1:2380",
            ],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = open(log).read()
            if "ready to serve client requests" in text:
                return url
            if p.poll() is not None:
                raise RuntimeError(f"etcd exited with {p.returncode}:\n{text[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"etcd not ready within {timeout:.0f} s:\n{open(log).read()[-2000:]}")

    def start_node(
        self,
        name: str,
        exports: list[str],
        *args: str,
        etcd: str | None = None,
        timeout: float = 60.0,
        env_extra: dict | None = None,
    ) -> tuple[subprocess.Popen, str]:
        """A storage node on host A; returns the process and the path of its stderr log."""
        log = os.path.join(self.tmp, f"node-{name}-{len(self.procs)}.log")
        argv = [sys.executable, "-m", "nixl_io_uring_dmabuf.storage_node", "serve", "--name", name]
        for e in exports:
            argv += ["--export", e]
        env = self.env("a", NIXL_ETCD_ENDPOINTS=etcd, **(env_extra or {}))
        p = self.spawn(
            "a",
            argv + list(args),
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
        )
        deadline = time.monotonic() + timeout
        line = ""
        while not line.startswith("READY") and time.monotonic() < deadline:
            line = read_line(p, deadline - time.monotonic())
            if not line:
                break
        if not line.startswith("READY"):
            raise RuntimeError(
                f"node {name} did not start (exit {p.poll()}): {line!r}\n{open(log).read()[-3000:]}"
            )
        return p, log

    def client(self, argv: list[str], etcd: str | None = None, **popen) -> subprocess.Popen:
        """A client process on host B."""
        return self.spawn("b", argv, env=self.env("b", NIXL_ETCD_ENDPOINTS=etcd), **popen)


def read_line(p: subprocess.Popen, timeout: float) -> str:
    """One line of p's stdout within timeout ("" on EOF or timeout)."""
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return ""
        return p.stdout.readline()
    finally:
        sel.close()


def plugin_dir_ready() -> bool:
    d = os.environ.get("NIXL_PLUGIN_DIR", "")
    return bool(d) and bool(glob.glob(os.path.join(d, "libplugin_IO_URING_DMABUF.so")))
