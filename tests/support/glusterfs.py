"""A real GlusterFS volume on this machine, mounted by two "nodes" (network namespaces), for the
tests of one KV store shared across nodes.

    with GlusterBed(tmp_path) as bed:
        bed.mounts["a"], bed.mounts["b"]   # the volume's FUSE mounts of node a and node b
        bed.on("a", argv)                  # argv run in node a's network namespace
        bed.python("a", py)                # an interpreter wrapper that runs `py` on node a

Three network namespaces joined by a bridge: the server (glusterd and the brick process,
10.78.0.1) and the nodes a (10.78.0.2) and b (10.78.0.3). glusterd runs with its own working
and run folders and CLI socket under the bed's folder, so nothing of a system glusterd is used
or touched. Each node mounts the volume with `mount -t glusterfs` inside its namespace, so its
FUSE client talks to the brick over the bridge; the mounts themselves appear in this mount
namespace (nsenter enters the network namespace only), where every process can reach them.

The volume gets VOLUME_OPTIONS and the mounts MOUNT_OPTIONS: what the store needs on GlusterFS
(docs/vllm-many-engines.md, "Across nodes"). `down()` unmounts, stops the daemons and deletes the
namespaces even after a failure; `sweep_stale()` clears what a killed test left.

Needs root, iproute2, nsenter, /dev/fuse and GlusterFS (ci/glusterfs-setup.sh);
`unavailable()` says why not, or None.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import time

SERVER_IP = "10.78.0.1"
NODE_IPS = {"a": "10.78.0.2", "b": "10.78.0.3"}
SETUP = os.path.join(os.path.dirname(__file__), "..", "..", "ci", "glusterfs-setup.sh")

# Client-side caches that let one node act on stale data of another: write-behind acknowledges
# a write before the brick has it (the next lock holder on another node does not see it);
# stat-prefetch (md-cache) answers sizes from its cache; quick-read serves small files' bytes
# cached at open; open-behind delays opens. Each lost journal records across nodes when on.
VOLUME_OPTIONS = {
    "performance.write-behind": "off",
    "performance.stat-prefetch": "off",
    "performance.quick-read": "off",
    "performance.open-behind": "off",
    "performance.read-ahead": "off",
    "performance.io-cache": "off",
}
# The kernel's caches: attributes and names (a renamed store.json, another node's files) are
# asked of the volume every time; direct-io-mode keeps file bytes out of the page cache, so a
# slot another node rewrote is read as it is now.
MOUNT_OPTIONS = "attribute-timeout=0,entry-timeout=0,negative-timeout=0,direct-io-mode=enable"

_PREFIX = "iudg"


class GlusterUnavailable(RuntimeError):
    pass


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, FUSE mounts)"
    for tool in ("ip", "nsenter", "glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None:
            return f"no {tool} (bash ci/glusterfs-setup.sh installs GlusterFS)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def install() -> str | None:
    """Runs ci/glusterfs-setup.sh (apt) when GlusterFS or iproute2 is missing and this is root.
    Returns why the bed cannot run, or None."""
    if os.geteuid() == 0 and unavailable():
        r = subprocess.run(["bash", SETUP], capture_output=True, text=True, timeout=600)
        if r.returncode:
            return f"ci/glusterfs-setup.sh failed: {r.stderr.strip()[-300:]}"
    return unavailable()


def open_bed(folder) -> GlusterBed:
    """A bed that is up, GlusterFS installed first where needed; GlusterUnavailable says why
    not (the tests skip with it)."""
    why = install()
    if why:
        raise GlusterUnavailable(why)
    bed = GlusterBed(folder)
    try:
        bed.up()
    except BaseException:
        bed.down()
        raise
    return bed


def _run(argv: list[str], timeout: float = 60) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise GlusterUnavailable(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


class GlusterBed:
    def __init__(self, folder, tag: str | None = None):
        self.tag = tag or str(os.getpid())
        self.folder = os.path.join(str(folder), f"{_PREFIX}-{self.tag}")
        self.ns = {n: f"{_PREFIX}-{self.tag}-{n}" for n in ("srv", "a", "b")}
        self.volume = f"iud{self.tag}"
        self.brick = os.path.join(self.folder, "brick")
        self.run_dir = os.path.join(self.folder, "run")
        self.logs = os.path.join(self.folder, "log")
        self.sock = os.path.join(self.run_dir, "glusterd.sock")
        self.mounts = {n: os.path.join(self.folder, f"mnt-{n}") for n in NODE_IPS}
        self._made_ns: list[str] = []
        self._mounted: list[str] = []

    # ---- set-up --------------------------------------------------------------------------
    def __enter__(self) -> GlusterBed:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        sweep_stale()
        for d in (self.brick, self.run_dir, self.logs, *self.mounts.values()):
            os.makedirs(d, exist_ok=True)
        self._network()
        self._glusterd()
        self._create_volume()
        for node, where in self.mounts.items():
            self.mount(node, where)

    def _network(self) -> None:
        for ns in self.ns.values():
            _run(["ip", "netns", "add", ns])
            self._made_ns.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        srv = self.ns["srv"]
        _run(["ip", "-n", srv, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", srv, "addr", "add", f"{SERVER_IP}/24", "dev", "br0"])
        _run(["ip", "-n", srv, "link", "set", "br0", "up"])
        for node, ip in NODE_IPS.items():
            outer, inner = f"{_PREFIX}{self.tag}{node}s"[:15], f"{_PREFIX}{self.tag}{node}n"[:15]
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", outer, "netns", srv])
            _run(["ip", "link", "set", inner, "netns", self.ns[node]])
            _run(["ip", "-n", srv, "link", "set", outer, "master", "br0", "up"])
            _run(["ip", "-n", self.ns[node], "addr", "add", f"{ip}/24", "dev", inner])
            _run(["ip", "-n", self.ns[node], "link", "set", inner, "up"])

    def _glusterd(self) -> None:
        vol = os.path.join(self.folder, "glusterd.vol")
        work = os.path.join(self.folder, "glusterd")
        os.makedirs(work, exist_ok=True)
        with open(vol, "w") as f:
            f.write(
                "volume management\n"
                "    type mgmt/glusterd\n"
                f"    option working-directory {work}\n"
                f"    option run-directory {self.run_dir}\n"
                f"    option glusterd-sockfile {self.sock}\n"
                "    option transport-type socket\n"
                f"    option transport.socket.bind-address {SERVER_IP}\n"
                "    option ping-timeout 0\n"
                "    option event-threads 1\n"
                "end-volume\n"
            )
        pid = os.path.join(self.run_dir, "glusterd.pid")
        log = os.path.join(self.logs, "glusterd.log")
        _run(self.on("srv", ["glusterd", "-f", vol, "-p", pid, "-l", log]))
        deadline = time.monotonic() + 60
        while subprocess.run(self._cli("volume", "list"), capture_output=True).returncode:
            if time.monotonic() > deadline:
                raise GlusterUnavailable(f"glusterd did not answer within 60 s ({log})")
            time.sleep(0.2)

    def _cli(self, *args: str) -> list[str]:
        log = os.path.join(self.logs, "cli.log")
        return self.on("srv", ["gluster", "--mode=script", f"--glusterd-sock={self.sock}"]) + [
            f"--log-file={log}",
            *args,
        ]

    def gluster(self, *args: str) -> str:
        """The gluster CLI against this bed's glusterd."""
        return _run(self._cli(*args))

    def _create_volume(self) -> None:
        # force: the brick is a folder on the root file system, which glusterd refuses otherwise
        self.gluster("volume", "create", self.volume, f"{SERVER_IP}:{self.brick}", "force")
        for key, value in VOLUME_OPTIONS.items():
            self.gluster("volume", "set", self.volume, key, value)
        self.gluster("volume", "start", self.volume)

    def mount(self, node: str, where: str, options: str = MOUNT_OPTIONS) -> None:
        """Mounts the volume at `where` from `node`'s namespace (`options`: mount -o's)."""
        os.makedirs(where, exist_ok=True)
        log = os.path.join(self.logs, f"mount-{node}-{os.path.basename(where)}.log")
        opts = ",".join(o for o in (options, f"log-file={log}") if o)
        src = f"{SERVER_IP}:/{self.volume}"
        self._mounted.append(where)
        _run(self.on(node, ["mount", "-t", "glusterfs", "-o", opts, src, where]))
        if not os.path.ismount(where):
            raise GlusterUnavailable(f"node {node}: {src} is not mounted at {where} ({log})")

    def unmount(self, where: str) -> None:
        if os.path.ismount(where):
            r = subprocess.run(["umount", where], capture_output=True)
            if r.returncode:
                subprocess.run(["umount", "-l", where], capture_output=True)
        if where in self._mounted:
            self._mounted.remove(where)

    # ---- use -----------------------------------------------------------------------------
    def on(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run in the network namespace of `node` ("srv", "a" or "b")."""
        return ["nsenter", f"--net=/run/netns/{self.ns[node]}", *argv]

    def python(self, node: str, py: str) -> str:
        """An executable that runs `py` with the same arguments on `node`."""
        path = os.path.join(self.folder, f"python-on-{node}")
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec {" ".join(self.on(node, [py]))} "$@"\n')
        os.chmod(path, 0o755)
        return path

    def versions(self) -> str:
        return _run(["glusterfs", "--version"]).splitlines()[0]

    # ---- tear-down -----------------------------------------------------------------------
    def down(self) -> None:
        for where in list(self._mounted):
            self.unmount(where)
        for ns in reversed(self._made_ns):  # clients, then the brick and glusterd
            _stop_all_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made_ns = []
        # the brick process logs where glusterd tells it, under /var/log/glusterfs/bricks
        brick_log = self.brick.strip("/").replace("/", "-") + ".log"
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/var/log/glusterfs/bricks", brick_log))


def _stop_all_in(ns: str) -> None:
    """SIGTERM to every process in `ns` (glusterfsd removes its socket then), SIGKILL after 10 s."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = [int(p) for p in pids.split()]
    sockets = [s for p in pids for s in _socket_args(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.1)
        if not pids:
            break
    for path in sockets:  # a brick's socket under /var/run/gluster outlives the brick
        with contextlib.suppress(OSError):
            os.unlink(path)


def _socket_args(pid: int) -> list[str]:
    """The unix socket a gluster process was told to listen on (its `-S PATH` argument)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-S"]


def sweep_stale() -> None:
    """Unmounts and deletes what a bed whose test process was killed left (names carry its pid)."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    for mnt in mounts:
        m = re.search(rf"/{_PREFIX}-(\d+)/mnt-[^/]+$", mnt)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        m = re.match(rf"({_PREFIX}-(\d+)-(srv|a|b))\b", line)
        if m and not os.path.exists(f"/proc/{m[2]}"):
            _stop_all_in(m[1])
            subprocess.run(["ip", "netns", "del", m[1]], capture_output=True)
    for log in glob.glob(f"/var/log/glusterfs/bricks/*-{_PREFIX}-*-brick.log"):
        m = re.search(rf"-{_PREFIX}-(\d+)-brick\.log$", log)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            with contextlib.suppress(OSError):
                os.unlink(log)


def bed_for_tests(tmp_path_factory, skip):
    """The bed a test module shares (wrap in pytest.fixture(scope="module")): skip(why) when
    GlusterFS cannot run here; torn down after the module."""
    try:
        b = open_bed(tmp_path_factory.mktemp("gluster"))
    except GlusterUnavailable as e:
        skip(f"GlusterFS: {e}")
    print(b.versions())
    try:
        yield b
    finally:
        b.down()
