"""The NIXL plugin folder the tests load, chosen once per process before NIXL is imported
(NIXL's plugin manager is a process singleton that reads NIXL_PLUGIN_DIR when it starts).

IUD_PLUGIN_DIR names it; by default it is <wheel libs>/iud-plugins, as ci/build.sh lays it out,
and where that does not exist yet, a private folder with the NIXL wheel's own plugins only
(enough for IUD_TEST_BACKEND=POSIX runs). NIXL_PLUGIN_DIR and IUD_PLUGIN_DIR are both set to it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import tempfile

from nixl_io_uring_dmabuf.tools.locate import first_wheel


def use_test_plugin_dir() -> str:
    """Sets NIXL_PLUGIN_DIR and IUD_PLUGIN_DIR (see the module doc); returns the folder."""
    wheel = first_wheel()
    libs, bundled = (wheel.libs, wheel.bundled) if wheel else (None, None)
    plugin_dir = os.environ.get("IUD_PLUGIN_DIR") or (
        os.path.join(libs, "iud-plugins") if libs else ""
    )
    if not os.path.isdir(plugin_dir) and libs:
        # Not built yet: a private directory with the wheel's plugins only (enough for
        # IUD_TEST_BACKEND=POSIX runs).
        plugin_dir = tempfile.mkdtemp(prefix="iud-nixl-plugins-")
        for p in glob.glob(os.path.join(libs, "plugins", "libplugin_*.so")):
            os.symlink(p, os.path.join(plugin_dir, os.path.basename(p)))
    os.environ["NIXL_PLUGIN_DIR"] = plugin_dir
    os.environ["IUD_PLUGIN_DIR"] = plugin_dir
    # The wheel's plugins find their private libraries through RPATH $ORIGIN/.., which only
    # works from a plugin directory directly inside the wheel's library folder. For the
    # temporary directory, preload those libraries so that dlopen finds them by soname.
    if libs and os.path.dirname(os.path.abspath(plugin_dir)) != os.path.abspath(libs):
        wanted = [os.path.join(libs, "libnixl_common.so"), os.path.join(libs, "libfile_utils.so")]
        wanted += glob.glob(os.path.join(bundled, "liburing-*.so*"))
        wanted += glob.glob(os.path.join(bundled, "libaio-*.so*"))
        for w in wanted:
            try:
                ctypes.CDLL(w, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass

    return plugin_dir
