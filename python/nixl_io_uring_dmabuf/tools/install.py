"""Installs the plugin into a NIXL plugin folder and takes it out again, exactly.

NIXL keys plugins by file name: `libplugin_<NAME>.so` in the plugin folder is what
`create_backend("<NAME>")` loads (NIXL src/core/nixl_plugin_manager.cpp, composePluginPath and
discoverPluginsFromDir). So the plugin is installed as libplugin_IO_URING_DMABUF.so and, with
`--as NAME`, also as libplugin_NAME.so, which then replaces NIXL's own backend of that name in
every process that reads this folder.

Every change is recorded in a manifest (.iud-install.json) in the folder; a file that was there
before is moved, untouched, into .iud-backup/ (NIXL only lists the folder itself, not its
subfolders). Uninstall undoes the recorded changes and moves the originals back, so the folder
ends up byte for byte as it was.

A private folder (`--plugin-dir D`) gets the plugin plus links to the wheel's own plugins, so
that one NIXL_PLUGIN_DIR still offers POSIX, UCX, ... The wheel's plugins find their libraries
through RPATH $ORIGIN/.., and $ORIGIN is the folder of the path NIXL opens (the link), so those
links only work when D sits directly in the wheel's library folder (.nixl_cuXX.mesonpy.libs/D).
Anywhere else the folder gets the plugin only, and the installer says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Callable

from nixl_io_uring_dmabuf import ALIASES, PLUGIN_NAME, __version__, plugin_library
from nixl_io_uring_dmabuf.tools import nixlenv
from nixl_io_uring_dmabuf.tools.locate import NixlWheel, find_wheels, wheel_for_folder

MANIFEST = ".iud-install.json"
BACKUP_DIR = ".iud-backup"


class InstallError(Exception):
    """A refusal with a message for the user (nothing half-done is left behind)."""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def plugin_file(folder: str, name: str) -> str:
    return os.path.join(folder, f"libplugin_{name}.so")


@dataclasses.dataclass
class Target:
    folder: str
    wheel: NixlWheel | None  # the wheel whose plugins can be linked beside ours, if any
    default: bool  # the wheel's own plugins/ folder (read without NIXL_PLUGIN_DIR)


def targets(plugin_dir: str | None, wheels: list[NixlWheel]) -> list[Target]:
    if plugin_dir:
        return [Target(os.path.abspath(plugin_dir), wheel_for_folder(plugin_dir, wheels), False)]
    if not wheels:  # nixlenv.check() says so first, with the fix; this is the last guard
        raise InstallError(
            "no NIXL wheel found for this Python (neither nixl-cu12 nor nixl-cu13 is installed); "
            "python -m nixl_io_uring_dmabuf doctor prints the command that installs one"
        )
    return [Target(w.plugins, w, True) for w in wheels]


def _load(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return {"version": 1, "created_dir": False, "entries": []}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _save(folder: str, manifest: dict) -> None:
    path = os.path.join(folder, MANIFEST)
    if not manifest["entries"]:
        if os.path.exists(path):
            os.unlink(path)
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _copy_atomic(src: str, dest: str) -> None:
    tmp = dest + ".iud-tmp"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)


def _entry(manifest: dict, path: str) -> dict | None:
    return next((e for e in manifest["entries"] if e["path"] == path), None)


def _backup(folder: str, dest: str, say: Callable[[str], None]) -> str:
    """Moves the file NIXL would load as `dest` aside, unchanged (rename keeps bytes, mode,
    times and, for a link, the link itself)."""
    bdir = os.path.join(folder, BACKUP_DIR)
    os.makedirs(bdir, exist_ok=True)
    backup = os.path.join(bdir, os.path.basename(dest))
    if os.path.lexists(backup):
        raise InstallError(f"{backup} already exists and is not in {MANIFEST}; move it away first")
    os.rename(dest, backup)
    say(f"  moved the existing {os.path.basename(dest)} to {backup}")
    return backup


def install(
    aliases: list[str],
    plugin_dir: str | None = None,
    say: Callable[[str], None] = print,
    rerun: str | None = None,
) -> list[Target]:
    """Installs into the plugin folder of every NIXL runtime wheel of this environment (or into
    `plugin_dir`). Without `plugin_dir` it first checks that `import nixl` works here and
    refuses, with the one command that fixes it, when it does not: a plugin in a folder that
    the environment's NIXL never loads would only look installed."""
    for a in aliases:
        if a not in ALIASES:
            raise InstallError(f"--as {a}: must be one of {', '.join(ALIASES)}")
    lib = plugin_library()
    digest = sha256(lib)
    names = [PLUGIN_NAME] + [a for a in dict.fromkeys(aliases) if a != PLUGIN_NAME]
    env = nixlenv.check()
    if not env.ok:
        if plugin_dir is None:
            raise InstallError("\n".join(env.error_lines(rerun)))
        say(f"note: Python clients here cannot use NIXL yet: {env.problem} Fix: {env.fix}")
    done = targets(plugin_dir, find_wheels())
    for t in done:
        created = not os.path.isdir(t.folder)
        os.makedirs(t.folder, exist_ok=True)
        manifest = _load(t.folder)
        manifest["created_dir"] = manifest["created_dir"] or created
        manifest["package_version"] = __version__
        say(f"{t.folder}:")
        if not t.default:
            _link_wheel_plugins(t, manifest, names, say)
        for name in names:
            dest = plugin_file(t.folder, name)
            entry = _entry(manifest, dest)
            if entry is None:
                backup = _backup(t.folder, dest, say) if os.path.lexists(dest) else None
                entry = {"path": dest, "name": name, "kind": "plugin", "backup": backup}
                manifest["entries"].append(entry)
            elif entry["kind"] == "link":  # a link we made earlier now becomes the plugin
                os.unlink(dest)
                entry.update(kind="plugin", backup=None)
            _copy_atomic(lib, dest)
            entry["sha256"] = digest
            what = "the plugin" if name == PLUGIN_NAME else f"the plugin serving as {name}"
            say(f"  installed {what}: {dest}")
        _save(t.folder, manifest)
        _explain(t, names, say, env)
    if os.environ.get("NIXL_PLUGIN_DIR") and plugin_dir is None:
        say(
            f"note: NIXL_PLUGIN_DIR={os.environ['NIXL_PLUGIN_DIR']} is set in this shell: NIXL "
            "reads that folder instead of the wheel's plugins/ folder, so unset it (or use "
            "--plugin-dir) for processes that should load what was installed here"
        )
    say(
        "undo: python -m nixl_io_uring_dmabuf install --uninstall"
        + (f" --plugin-dir {plugin_dir}" if plugin_dir else "")
    )
    return done


def _link_wheel_plugins(
    t: Target, manifest: dict, names: list[str], say: Callable[[str], None]
) -> None:
    if t.wheel is None:
        wheels = find_wheels()
        if wheels:
            say(
                f"  note: the wheel's own plugins (POSIX, UCX, ...) are not linked here: they "
                f"load their libraries through RPATH $ORIGIN/.., which works only from a folder "
                f"directly inside {wheels[0].libs}; NIXL_PLUGIN_DIR={t.folder} offers only "
                f"what is installed in it"
            )
        return
    for src in sorted(os.listdir(t.wheel.plugins)):
        if not (src.startswith("libplugin_") and src.endswith(".so")):
            continue
        if src[len("libplugin_") : -3] in names:
            continue
        dest = os.path.join(t.folder, src)
        if os.path.lexists(dest):
            continue  # ours from an earlier run, or the user's: leave it
        target = os.path.relpath(os.path.join(t.wheel.plugins, src), t.folder)
        os.symlink(target, dest)
        manifest["entries"].append(
            {
                "path": dest,
                "name": src[len("libplugin_") : -3],
                "kind": "link",
                "target": target,
                "backup": None,
            }
        )
    say(f"  linked the wheel's plugins from {t.wheel.plugins}")


def _explain(
    t: Target, names: list[str], say: Callable[[str], None], env: nixlenv.NixlEnv | None = None
) -> None:
    if t.default:
        say("  NIXL reads this folder by default (when NIXL_PLUGIN_DIR is not set)")
        if env is not None and env.loads and t.wheel is not None:
            say(
                f"  `import nixl` loads {env.loads} in this environment"
                + (
                    ": this is its folder"
                    if env.loads == t.wheel.module
                    else f", not {t.wheel.module}: this folder is used only by programs that load "
                    f"{t.wheel.module}'s libnixl.so directly (e.g. a nixlbench built against it)"
                )
            )
    else:
        say(
            f"  use it with: export NIXL_PLUGIN_DIR={t.folder}  (it replaces NIXL's default folder)"
        )
    replaced = [n for n in names if n != PLUGIN_NAME]
    if replaced:
        say(
            f"  create_backend({', '.join(repr(n) for n in replaced)}) now loads IO_URING_DMABUF "
            f"in every process that reads this folder; NIXL's own {', '.join(replaced)} is "
            f"unavailable there until you uninstall"
        )


def uninstall(
    aliases: list[str] | None = None,
    plugin_dir: str | None = None,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> None:
    """Undoes what install recorded (only the `aliases` names when given)."""
    wheels = find_wheels()
    folders = [os.path.abspath(plugin_dir)] if plugin_dir else [w.plugins for w in wheels]
    if not folders:
        raise InstallError("no NIXL wheel found for this Python; name the folder with --plugin-dir")
    for folder in folders:
        if not os.path.exists(os.path.join(folder, MANIFEST)):
            say(f"{folder}: nothing installed by nixl_io_uring_dmabuf")
            continue
        manifest = _load(folder)
        say(f"{folder}:")
        keep = []
        for e in manifest["entries"]:
            if aliases and e["name"] not in aliases:
                keep.append(e)
                continue
            if not _remove(e, force, say):
                keep.append(e)
                continue
            if e.get("backup"):
                os.rename(e["backup"], e["path"])
                say(f"  restored the original {os.path.basename(e['path'])}")
        manifest["entries"] = keep
        _save(folder, manifest)
        bdir = os.path.join(folder, BACKUP_DIR)
        if os.path.isdir(bdir) and not os.listdir(bdir):
            os.rmdir(bdir)
        if not keep and manifest.get("created_dir") and not os.listdir(folder):
            os.rmdir(folder)
            say(f"  removed the folder {folder} (it was created by install)")


def _remove(e: dict, force: bool, say: Callable[[str], None]) -> bool:
    path = e["path"]
    if not os.path.lexists(path):
        say(f"  {path} is already gone")
        return True
    if e["kind"] == "link":
        same = os.path.islink(path) and os.readlink(path) == e["target"]
    else:
        same = not os.path.islink(path) and sha256(path) == e["sha256"]
    if not same and not force:
        say(f"  kept {path}: it changed since install (--force removes it anyway)")
        return False
    os.unlink(path)
    say(f"  removed {path}")
    return True
