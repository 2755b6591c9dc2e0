"""Bad inputs: each must fail (a nixl exception at initialize_xfer / make_prepped_xfer /
prep_xfer_dlist time for validation errors; "ERR" or an exception from transfer() /
check_xfer_state() for I/O errors), the plugin must log exactly one ERROR line for a failure it
sees, and good transfers on the same agent must keep working afterwards."""

from __future__ import annotations

import os

import iud_helpers as H
import numpy as np
import pytest

FILE_SIZE = 256 * H.KiB


class Good:
    """A known-good file + buffers on the rig; check() does WRITE + READ and compares."""

    def __init__(self, rig, rng, tmp_path):
        self.rig, self.rng = rig, rng
        self.path = str(tmp_path / "good.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self.fd, H.rand_bytes(rng, FILE_SIZE).tobytes())
        self.src, self.dst = H.Buf(FILE_SIZE), H.Buf(FILE_SIZE)
        rig.reg_dram(self.src)
        rig.reg_dram(self.dst)
        rig.reg_fd(self.fd, FILE_SIZE)
        self.checks = 0

    def check(self, after: str):
        self.checks += 1
        self.src.fill(self.rng)
        self.dst.fill(self.rng)
        n = 8
        c = FILE_SIZE // n
        w = self.rig.xfer(
            "WRITE",
            [(self.src.addr + i * c, c) for i in range(n)],
            [(i * c, c, self.fd) for i in range(n)],
        )
        self.rig.run(w, 30, what=f"good WRITE after {after}")
        self.rig.release(w)
        r = self.rig.xfer(
            "READ",
            [(self.dst.addr + i * c, c) for i in range(n)],
            [(i * c, c, self.fd) for i in range(n)],
        )
        self.rig.run(r, 30, what=f"good READ after {after}")
        self.rig.release(r)
        assert np.array_equal(self.dst.arr, self.src.arr), (
            f"good round trip after {after}: " + H.first_diff(self.dst.arr, self.src.arr)
        )
        got = H.read_file(self.path)
        assert np.array_equal(got, self.src.arr), f"good file after {after}: " + H.first_diff(
            got, self.src.arr
        )

    def close(self):
        self.rig.close()
        os.close(self.fd)


@pytest.fixture
def good(rig, rng, tmp_path):
    g = Good(rig, rng, tmp_path)
    g.check("setup")
    yield g
    g.close()


@pytest.fixture
def expect_error(rig, good, stderr_log, is_plugin):
    """expect_error(label, make, stages=..., plugin_sees=True): run make() via rig.attempt,
    assert it failed at one of `stages`, that the plugin logged exactly one ERROR line when
    the plugin (not the agent) is the one that sees the error, and that a good transfer
    still works afterwards. Returns the Outcome."""
    stderr_log()

    def run(label, make, stages=("prep", "post", "check"), plugin_sees=True):
        out = rig.attempt(make)
        log = stderr_log()
        assert out.stage != "timeout", f"{label}: request still PROC after 30 s"
        assert out.failed, f"{label}: expected an error, but the request completed ({out})"
        assert out.stage in stages, f"{label}: failed at {out.stage}, expected one of {stages}"
        assert out.release_exc is None, (
            f"{label}: releasing the failed request raised {out.release_exc!r}"
        )
        if is_plugin and plugin_sees:
            lines = H.plugin_error_lines(log)
            assert len(lines) == 1, (
                f"{label}: expected exactly one ERROR line from the plugin "
                f"on stderr, got {len(lines)}:\n"
                + "\n".join(lines)
                + "\n--- whole stderr ---\n"
                + log
            )
        print(f"{label}: {out}")
        good.check(label)
        return out

    return run


# ---- ranges the agent cannot match to a registration ---------------------------------------


def test_unregistered_memory(rig, good, expect_error):
    fd = good.fd
    outside = H.Buf(8192)  # never registered
    expect_error(
        "unregistered DRAM (READ)",
        lambda: rig.xfer("READ", [(outside.addr, 4096)], [(0, 4096, fd)]),
        stages=("prep",),
        plugin_sees=False,
    )
    expect_error(
        "DRAM range running past its registration (WRITE)",
        lambda: rig.xfer("WRITE", [(good.src.addr + FILE_SIZE - 4096, 8192)], [(0, 8192, fd)]),
        stages=("prep",),
        plugin_sees=False,
    )

    def prepped():
        hl = rig.prep_mem([(outside.addr, 4096)])
        hr = rig.prep_file([(0, 4096, fd)])
        return rig.prepped_xfer("READ", hl, [0], hr, [0])

    expect_error("unregistered DRAM (prepped)", prepped, stages=("prep",), plugin_sees=False)


def test_unregistered_file(rig, good, expect_error, tmp_path):
    fd = good.fd
    expect_error(
        "FILE range past the registered region",
        lambda: rig.xfer("READ", [(good.dst.addr, 8192)], [(FILE_SIZE - 4096, 8192, fd)]),
        stages=("prep",),
        plugin_sees=False,
    )
    other = os.open(str(tmp_path / "unregistered.bin"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(other, b"x" * 8192)
        expect_error(
            "FILE fd never registered",
            lambda: rig.xfer("READ", [(good.dst.addr, 4096)], [(0, 4096, other)]),
            stages=("prep",),
            plugin_sees=False,
        )

        def prepped():
            hl = rig.prep_mem([(good.dst.addr, 4096)])
            hr = rig.prep_file([(0, 4096, other)])
            return rig.prepped_xfer("READ", hl, [0], hr, [0])

        expect_error(
            "FILE fd never registered (prepped)", prepped, stages=("prep",), plugin_sees=False
        )
    finally:
        os.close(other)


# ---- list kinds the backend does not serve ---------------------------------------------------


@pytest.mark.parametrize("prepped", [False, True], ids=["unprepped", "prepped"])
# (FILE as the local list with memory remote is served, as by NIXL's GDS/GDS_MT:
# test_storage_local_list.py.)
@pytest.mark.parametrize("kinds", ["DRAM/DRAM", "FILE/FILE"])
def test_wrong_list_kinds(rig, good, expect_error, kinds, prepped):
    local_kind, remote_kind = kinds.split("/")
    desc = {"DRAM": lambda: (good.dst.addr, 4096, 0), "FILE": lambda: (0, 4096, good.fd)}
    remote_desc = {"DRAM": lambda: (good.src.addr, 4096, 0), "FILE": lambda: (8192, 4096, good.fd)}
    for op in ("READ", "WRITE"):
        if prepped:

            def make(op=op):
                hl = rig.prep_mem([desc[local_kind]()], kind=local_kind)
                hr = rig.prep_file([remote_desc[remote_kind]()], kind=remote_kind)
                return rig.prepped_xfer(op, hl, [0], hr, [0])
        else:

            def make(op=op):
                return rig.xfer(
                    op,
                    [desc[local_kind]()],
                    [remote_desc[remote_kind]()],
                    mem_kind=local_kind,
                    file_kind=remote_kind,
                )

        expect_error(f"{op} local={local_kind} remote={remote_kind}", make, stages=("prep",))


# ---- descriptor pairs that do not match ------------------------------------------------------


def test_mismatched_lengths(rig, good, expect_error):
    fd, d = good.fd, good.dst.addr
    expect_error(
        "length 4096 vs 8192",
        lambda: rig.xfer("READ", [(d, 4096)], [(0, 8192, fd)]),
        stages=("prep",),
        plugin_sees=False,
    )
    expect_error(
        "2 local descriptors vs 1 remote",
        lambda: rig.xfer("READ", [(d, 4096), (d + 4096, 4096)], [(0, 4096, fd)]),
        stages=("prep",),
        plugin_sees=False,
    )

    def prepped():
        hl = rig.prep_mem([(d, 4096), (d + 4096, 4096)])
        hr = rig.prep_file([(0, 8192, fd), (8192, 4096, fd)])
        return rig.prepped_xfer("READ", hl, [0, 1], hr, [0, 0])

    expect_error("prepped length 4096 vs 8192", prepped, stages=("prep",), plugin_sees=False)


# ---- fd problems --------------------------------------------------------------------------


def test_closed_fd(rig, good, expect_error, rng, tmp_path):
    path = str(tmp_path / "closed.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, H.rand_bytes(rng, 65536).tobytes())
    reg = rig.reg_fd(fd, 65536)
    os.close(fd)  # no file is opened until the transfers below, so the number stays free
    expect_error(
        "READ from a closed fd", lambda: rig.xfer("READ", [(good.dst.addr, 4096)], [(0, 4096, fd)])
    )
    expect_error(
        "WRITE to a closed fd",
        lambda: rig.xfer("WRITE", [(good.src.addr, 4096)], [(4096, 4096, fd)]),
    )
    rig.dereg(reg)
    good.check("deregistering the closed fd")


def test_fd_number_reuse(rig, good, rng, tmp_path):
    """Register fd N, deregister and close it, open another file that gets the same number N,
    register it: transfers must reach the new file, not a cached old one."""
    p1, p2 = str(tmp_path / "first.bin"), str(tmp_path / "second.bin")
    d1, d2 = H.rand_bytes(rng, 65536), H.rand_bytes(rng, 65536)
    with open(p2, "wb") as f:
        f.write(d2.tobytes())
    fd = os.open(p1, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, d1.tobytes())
    reg = rig.reg_fd(fd, 65536)
    r = rig.xfer("READ", [(good.dst.addr, 65536)], [(0, 65536, fd)])
    rig.run(r, 30, what="READ of the first file")
    rig.release(r)
    assert np.array_equal(good.dst.arr[:65536], d1), "first file: " + H.first_diff(
        good.dst.arr[:65536], d1
    )
    rig.dereg(reg)
    os.close(fd)
    fd2 = os.open(p2, os.O_RDWR)
    try:
        if fd2 != fd:
            pytest.skip(f"the new file got fd {fd2}, not the reused number {fd}")
        rig.reg_fd(fd2, 65536)
        r = rig.xfer("READ", [(good.dst.addr, 65536)], [(0, 65536, fd2)])
        rig.run(r, 30, what="READ of the second file under the reused fd number")
        rig.release(r)
        got = good.dst.arr[:65536]
        assert not np.array_equal(got, d1), (
            "READ through the reused fd number returned the FIRST (closed) file's bytes"
        )
        assert np.array_equal(got, d2), "second file: " + H.first_diff(got, d2)
        new = H.rand_bytes(rng, 65536)
        good.src.arr[:65536] = new
        w = rig.xfer("WRITE", [(good.src.addr, 65536)], [(0, 65536, fd2)])
        rig.run(w, 30, what="WRITE to the second file")
        rig.release(w)
        assert np.array_equal(H.read_file(p2), new), "WRITE went elsewhere than the new file"
        assert np.array_equal(H.read_file(p1), d1), "WRITE modified the first (closed) file"
    finally:
        rig.close()
        os.close(fd2)


# ---- end of file -----------------------------------------------------------------------------


def test_read_past_eof(rig, good, expect_error, rng, tmp_path):
    path = str(tmp_path / "short.bin")
    size = 64 * H.KiB
    data = H.rand_bytes(rng, size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data.tobytes())
        rig.reg_fd(fd, 1 * H.MiB)  # a region may extend past EOF (files grow by WRITE)
        d = good.dst.addr
        io_stages = ("post", "check")
        expect_error(
            "READ straddling EOF",
            lambda: rig.xfer("READ", [(d, 8192)], [(size - 4096, 8192, fd)]),
            stages=io_stages,
        )
        expect_error(
            "READ entirely past EOF",
            lambda: rig.xfer("READ", [(d, 4096)], [(size + 4096, 4096, fd)]),
            stages=io_stages,
        )
        expect_error(
            "READ of 1 byte at EOF",
            lambda: rig.xfer("READ", [(d, 1)], [(size, 1, fd)]),
            stages=io_stages,
        )
        expect_error(
            "8-descriptor READ with the last one past EOF",
            lambda: rig.xfer(
                "READ",
                [(d + i * 8192, 8192) for i in range(8)],
                [(i * 8192, 8192, fd) for i in range(7)] + [(size, 8192, fd)],
            ),
            stages=io_stages,
        )
        # EOF is judged when the I/O runs: a READ prepared while the range is past EOF works
        # once a WRITE has extended the file.
        r = rig.xfer("READ", [(good.dst.addr, 8192)], [(size, 8192, fd)])
        ext = H.rand_bytes(rng, 8192)
        good.src.arr[:8192] = ext
        w = rig.xfer("WRITE", [(good.src.addr, 8192)], [(size, 8192, fd)])
        rig.run(w, 30, what="WRITE extending the file")
        rig.run(r, 30, what="READ prepared before the file was extended")
        assert np.array_equal(good.dst.arr[:8192], ext), (
            "READ of the extended range: " + H.first_diff(good.dst.arr[:8192], ext)
        )
        assert os.fstat(fd).st_size == size + 8192
    finally:
        rig.close()
        os.close(fd)


def test_repost_after_error(rig, good, rng, tmp_path):
    """A request that failed (READ past EOF) can be posted again once the cause is gone."""
    path = str(tmp_path / "grow.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rig.reg_fd(fd, 65536)
        r = rig.xfer("READ", [(good.dst.addr, 65536)], [(0, 65536, fd)])
        errs = H.nixl_errors()
        try:
            st = rig.poll(r, rig.agent.transfer(r), 30)
        except errs:
            st = "ERR"
        assert st == "ERR", f"READ of an empty file ended {st}"
        data = H.rand_bytes(rng, 65536)
        os.pwrite(fd, data.tobytes(), 0)
        rig.run(r, 30, what="repost after the failed READ")
        assert np.array_equal(good.dst.arr[:65536], data), "repost after error: " + H.first_diff(
            good.dst.arr[:65536], data
        )
    finally:
        rig.close()
        os.close(fd)


# ---- O_DIRECT alignment ----------------------------------------------------------------------


def test_odirect_misaligned(rig, good, expect_error, rng, tmp_path, need_direct):
    path = str(tmp_path / "direct.bin")
    with open(path, "wb") as f:
        f.write(H.rand_bytes(rng, 1 * H.MiB).tobytes())
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        buf = H.Buf(1 * H.MiB)
        rig.reg_dram(buf)
        rig.reg_fd(fd, 1 * H.MiB)
        b = buf.addr
        for op in ("READ", "WRITE"):
            expect_error(
                f"O_DIRECT {op} at file offset 100",
                lambda op=op: rig.xfer(op, [(b, 4096)], [(100, 4096, fd)]),
            )
            expect_error(
                f"O_DIRECT {op} of length 1000",
                lambda op=op: rig.xfer(op, [(b, 1000)], [(0, 1000, fd)]),
            )
            expect_error(
                f"O_DIRECT {op} from buffer address +1",
                lambda op=op: rig.xfer(op, [(b + 1, 4096)], [(0, 4096, fd)]),
            )
        # aligned I/O on the same fd still works
        want = H.read_file(path)[:65536].copy()
        r = rig.xfer("READ", [(b, 65536)], [(0, 65536, fd)])
        rig.run(r, 30, what="aligned O_DIRECT READ after the misaligned ones")
        assert np.array_equal(buf.arr[:65536], want), H.first_diff(buf.arr[:65536], want)
    finally:
        rig.close()
        os.close(fd)


# ---- path mode -------------------------------------------------------------------------------


def test_path_mode_errors(rig, good, expect_error, stderr_log, is_plugin, rng, tmp_path):
    errs = H.nixl_errors()
    stderr_log()

    def registration_fails(label, meta_path, modes, dev_id=None):
        with pytest.raises(errs) as ei:
            rig.reg_path(meta_path, 65536, modes, dev_id=dev_id)
        log = stderr_log()
        print(f"{label}: {ei.value!r}")
        if is_plugin:
            lines = H.plugin_error_lines(log)
            assert len(lines) == 1, (
                f"{label}: expected one plugin ERROR line, got {len(lines)}:\n" + log
            )
        good.check(label)

    missing = str(tmp_path / "does-not-exist.bin")
    registration_fails("path mode: missing file without create", missing, "rw")
    assert not os.path.exists(missing)

    p = str(tmp_path / "a.bin")
    dev, _ = rig.reg_path(p, 65536, "rw,create")
    registration_fails(
        "path mode: devId reused for another file", str(tmp_path / "b.bin"), "rw,create", dev_id=dev
    )

    ro = str(tmp_path / "ro.bin")
    content = H.rand_bytes(rng, 65536)
    with open(ro, "wb") as f:
        f.write(content.tobytes())
    rodev, _ = rig.reg_path(ro, 65536, "ro")
    expect_error(
        "path mode: WRITE to a file registered ro",
        lambda: rig.xfer("WRITE", [(good.src.addr, 4096)], [(0, 4096, rodev)]),
    )
    assert np.array_equal(H.read_file(ro), content), "the ro file was modified"
    r = rig.xfer("READ", [(good.dst.addr, 65536)], [(0, 65536, rodev)])
    rig.run(r, 30, what="READ from the ro file")
    assert np.array_equal(good.dst.arr[:65536], content)
