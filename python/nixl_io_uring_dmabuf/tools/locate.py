"""Where the installed NIXL wheels keep their libraries and plugins (without importing NIXL).

The nixl-cu12 / nixl-cu13 wheels (1.3-1.5) put libnixl.so in site-packages/.nixl_cuXX.mesonpy.libs
and the backend plugins in its plugins/ subfolder. libnixl finds that folder through dladdr on
itself (NIXL src/core/nixl_plugin_manager.cpp, getPluginDir), so it is the folder NIXL reads when
NIXL_PLUGIN_DIR is not set. NIXL_PLUGIN_DIR, when set, replaces it.

This is the one place that knows that layout: the installer, doctor, the storage node and the
tests all ask here. It imports nothing but the standard library, so it can run before NIXL is
imported (NIXL's plugin manager is a process singleton that reads NIXL_PLUGIN_DIR once).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os

WHEEL_MODULES = ("nixl_cu13", "nixl_cu12")


@dataclasses.dataclass(frozen=True)
class NixlWheel:
    module: str  # nixl_cu12 / nixl_cu13
    site: str  # the site-packages folder holding it
    libs: str  # .nixl_cuXX.mesonpy.libs: libnixl.so and friends
    plugins: str  # libs/plugins: the default plugin folder

    @property
    def bundled(self) -> str:
        """nixl_cuXX.libs: the libraries the wheel carries for its plugins (liburing, libaio...)."""
        return os.path.join(self.site, f"{self.module}.libs")

    def plugin_names(self) -> list[str]:
        return sorted(
            os.path.basename(p)[len("libplugin_") : -3]
            for p in glob.glob(os.path.join(self.plugins, "libplugin_*.so"))
        )


def find_wheels() -> list[NixlWheel]:
    """Every NIXL runtime wheel importable from this interpreter, nixl_cu13 first."""
    found = []
    for mod in WHEEL_MODULES:
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if not spec or not spec.origin:
            continue
        site = os.path.dirname(os.path.dirname(spec.origin))
        libs = os.path.join(site, f".{mod}.mesonpy.libs")
        if os.path.isfile(os.path.join(libs, "libnixl.so")):
            found.append(NixlWheel(mod, site, libs, os.path.join(libs, "plugins")))
    return found


def first_wheel() -> NixlWheel | None:
    """The wheel `import nixl` takes without a CUDA build of torch (nixl_cu13, else nixl_cu12);
    None when neither is installed."""
    wheels = find_wheels()
    return wheels[0] if wheels else None


def wheel_for_folder(folder: str, wheels: list[NixlWheel]) -> NixlWheel | None:
    """The wheel whose library folder directly holds `folder` (the only place where the
    wheel's own plugins still load from a link: see install.py)."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(folder)))
    for w in wheels:
        if os.path.realpath(w.libs) == parent:
            return w
    return None
