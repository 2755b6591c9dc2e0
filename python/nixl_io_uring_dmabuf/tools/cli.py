"""The command line: install / uninstall, doctor, bench."""

from __future__ import annotations

import argparse
import os
import sys

from nixl_io_uring_dmabuf import ALIASES, PLUGIN_NAME

_SIZES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    t = text.strip().upper().rstrip("B").rstrip("I")
    unit = t[-1] if t and t[-1] in _SIZES else ""
    return int(t[: len(t) - len(unit)]) * _SIZES[unit]


def _aliases(values: list[str] | None) -> list[str]:
    out = []
    for v in values or []:
        out += [a.strip() for a in v.split(",") if a.strip()]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m nixl_io_uring_dmabuf",
        description="IO_URING_DMABUF for NIXL: install, check, measure.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="put the plugin where NIXL loads it (or take it out)")
    i.add_argument(
        "--as",
        dest="aliases",
        action="append",
        metavar="NAME",
        help=f"also serve under NIXL's backend name NAME ({', '.join(ALIASES)}; "
        "repeatable or comma-separated), for clients that only accept those "
        "names; it replaces NIXL's own backend of that name in that folder",
    )
    i.add_argument(
        "--plugin-dir",
        metavar="D",
        help="compose the private folder D (for NIXL_PLUGIN_DIR=D) instead of "
        "installing into the wheel's own plugins/ folder",
    )
    i.add_argument(
        "--uninstall",
        action="store_true",
        help="undo an earlier install exactly (only the --as names when given)",
    )
    i.add_argument(
        "--force",
        action="store_true",
        help="with --uninstall: remove installed files even if they changed since",
    )
    d = sub.add_parser("doctor", help="what NIXL would load under each name, and a live check")
    d.add_argument("--no-live", action="store_true", help="skip the live round trip")
    d.add_argument("--dir", help="folder for the live check's temporary file")
    b = sub.add_parser("bench", help="time a DRAM->FILE->DRAM round trip through NIXL")
    b.add_argument("--dir", default=os.getcwd(), help="folder for the test file (default: .)")
    b.add_argument("--size", default="256M", help="bytes per direction (default 256M)")
    b.add_argument("--block", default="1M", help="bytes per descriptor (default 1M)")
    b.add_argument(
        "--backends",
        default=PLUGIN_NAME,
        help=f"comma-separated NIXL backend names (default {PLUGIN_NAME}); e.g. "
        f"{PLUGIN_NAME},POSIX to compare",
    )
    b.add_argument("--direct", action="store_true", help="open the file with O_DIRECT")
    b.add_argument("--iters", type=int, default=3, help="round trips per backend (default 3)")
    a = p.parse_args(argv)
    try:
        return _run(a)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a raw traceback: one line, and how to see more
        if os.environ.get("IUD_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        print(
            "  (python -m nixl_io_uring_dmabuf doctor checks this environment; IUD_DEBUG=1 "
            "shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "install":
        from nixl_io_uring_dmabuf.tools.install import InstallError, install, uninstall

        rerun = (
            "python -m nixl_io_uring_dmabuf install"
            + "".join(f" --as {x}" for x in (a.aliases or []))
            + (f" --plugin-dir {a.plugin_dir}" if a.plugin_dir else "")
        )
        try:
            if a.uninstall:
                uninstall(_aliases(a.aliases) or None, a.plugin_dir, a.force)
            else:
                install(_aliases(a.aliases), a.plugin_dir, rerun=rerun)
        except (InstallError, FileNotFoundError, PermissionError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.cmd == "doctor":
        from nixl_io_uring_dmabuf.tools.doctor import report

        return report(live=not a.no_live, directory=a.dir)
    from nixl_io_uring_dmabuf.tools import nixlenv
    from nixl_io_uring_dmabuf.tools.bench import bench

    env = nixlenv.check()
    if not env.ok:
        lines = env.error_lines("python -m nixl_io_uring_dmabuf bench ...")
        print("error: " + "\n".join(lines), file=sys.stderr)
        return 1
    return bench(a.dir, _size(a.size), _size(a.block), _aliases([a.backends]), a.direct, a.iters)


if __name__ == "__main__":
    sys.exit(main())
