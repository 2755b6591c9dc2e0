"""Child process for test_init_fini.py: one scenario per run, in a fresh process, so that the
plugin's first load (nixl_plugin_init), repeated loads and the unload at exit (nixl_plugin_fini,
engine and subscriber teardown) are all exercised. Prints CHILD-OK at the end.

usage: init_fini_child.py <scenario> <workdir>"""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import iud_helpers as H  # noqa: E402
import numpy as np  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

scenario, workdir = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))


def agent(name):
    return nixl_agent(name, nixl_agent_config(backends=[]))


class Files:
    """One file + buffers registered on an agent, with a verified WRITE/READ cycle."""

    def __init__(self, a, tag):
        self.rig = H.Rig(a, H.PLUGIN)
        self.path = os.path.join(workdir, tag + ".bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.src, self.dst = H.Buf(512 * H.KiB), H.Buf(512 * H.KiB)
        self.rig.reg_dram(self.src)
        self.rig.reg_dram(self.dst)
        self.rig.reg_fd(self.fd, self.src.size)
        self.tag = tag

    def cycle(self):
        self.src.fill(rng)
        self.dst.fill(rng)
        c = 32 * H.KiB
        n = self.src.size // c
        w = self.rig.xfer(
            "WRITE",
            [(self.src.addr + i * c, c) for i in range(n)],
            [(i * c, c, self.fd) for i in range(n)],
        )
        self.rig.run(w, 30, what=self.tag)
        r = self.rig.xfer(
            "READ",
            [(self.dst.addr + i * c, c) for i in range(n)],
            [(i * c, c, self.fd) for i in range(n)],
        )
        self.rig.run(r, 30, what=self.tag)
        self.rig.release(w)
        self.rig.release(r)
        assert np.array_equal(self.dst.arr, self.src.arr), (
            self.tag + ": " + H.first_diff(self.dst.arr, self.src.arr)
        )

    def close(self):
        self.rig.close()
        os.close(self.fd)


if scenario == "params-only":
    a = agent("p")
    assert a.get_plugin_params(H.PLUGIN), "get_plugin_params returned nothing"
    assert a.get_plugin_mem_types(H.PLUGIN)

elif scenario == "params-then-two-agents":
    a1 = agent("a1")
    params = a1.get_plugin_params(H.PLUGIN)
    assert params, "get_plugin_params returned nothing"
    a1.create_backend(H.PLUGIN, {})
    a2 = agent("a2")
    assert a2.get_plugin_params(H.PLUGIN) == params
    a2.create_backend(H.PLUGIN, {})
    f1, f2 = Files(a1, "a1"), Files(a2, "a2")
    for _ in range(3):
        f1.cycle()
        f2.cycle()
    f1.close()
    del f1, a1
    gc.collect()
    f2.cycle()  # the other agent's engine is unaffected by the first one's destruction
    a3 = agent("a3")
    a3.create_backend(H.PLUGIN, {})
    f3 = Files(a3, "a3")
    f3.cycle()
    f2.cycle()
    f2.close()
    f3.close()
    del f2, f3, a2, a3
    gc.collect()
    a4 = agent("a4")  # after every engine is gone
    a4.create_backend(H.PLUGIN, {})
    f4 = Files(a4, "a4")
    f4.cycle()
    f4.close()

elif scenario == "exit-with-live-engine":
    # registrations and a completed handle still alive when the interpreter exits
    a = agent("live")
    a.create_backend(H.PLUGIN, {})
    f = Files(a, "live")
    f.cycle()
    w = f.rig.xfer("WRITE", [(f.src.addr, 4096)], [(0, 4096, f.fd)])
    f.rig.run(w, 30)
    # no cleanup: the interpreter's shutdown tears the agent and engine down

else:
    sys.exit(f"unknown scenario {scenario}")

print("CHILD-OK", flush=True)
