#!/usr/bin/env bash
# Builds nixlbench (NIXL's benchmark, benchmark/nixlbench in ai-dynamo/nixl) against the NIXL
# runtime of a Python environment's PyPI wheel (nixl-cu12 / nixl-cu13), without building NIXL:
# the binary loads the wheel's libnixl.so, so it runs the same runtime, and reads the same
# plugin folder, as the Python clients of that environment. Two binaries: nixlbench as it is
# (OUT/orig/nixlbench) and with this folder's patch, which adds --backend IO_URING_DMABUF
# (OUT/patched/nixlbench).
#
#   bash contrib/nixlbench/build-nixlbench.sh --nixl-src DIR [--python PY] [--out DIR] [--no-apt]
#
#   --nixl-src DIR  a checkout of ai-dynamo/nixl (nixlbench's sources and NIXL's C++ API headers;
#                   nothing of it is built or changed; PyPI has no NIXL source distribution)
#   --python PY     the interpreter of the environment whose NIXL wheel to use (default: python3
#                   on PATH, i.e. the activated venv); the wheel is the one `import nixl` loads
#   --out DIR       build folder (default ./nixlbench-build); nothing is written elsewhere
#   --no-apt        do not install Debian packages (they must be there)
#
# Debian 12 packages it installs when missing (apt-get update first): g++ meson ninja-build
# pkg-config libgflags-dev libasio-dev libtomlplusplus-dev. Two gaps of Debian 12 are bridged
# inside OUT: libasio-dev ships no asio.pc, and toml++ 3.3 names its header toml.h where nixlbench
# includes toml++/toml.hpp (3.4): a pkg-config file each and a one-line include shim.
#
# The binaries carry the wheel's library folders as RUNPATH, so they run without
# LD_LIBRARY_PATH. libnixl.so finds its own libraries (libstream.so, libserdes.so, the bundled
# ones) through its RPATH $ORIGIN, which works only when it is loaded from its real folder: the
# build links against symlinks in OUT/prefix (with -rpath-link to the real folders) but runs the
# real files.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nixl_src="" py="python3" out="nixlbench-build" apt=1
while [ $# -gt 0 ]; do
    case "$1" in
        --nixl-src) nixl_src="$2"; shift 2 ;;
        --python) py="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --no-apt) apt=0; shift ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "build-nixlbench.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
die() { echo "build-nixlbench.sh: error: $*" >&2; exit 1; }
[ -n "$nixl_src" ] || die "--nixl-src DIR is required (git clone https://github.com/ai-dynamo/nixl)"
[ -f "$nixl_src/benchmark/nixlbench/meson.build" ] || die "$nixl_src has no benchmark/nixlbench/meson.build"
nixl_src="$(cd "$nixl_src" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The wheel: the runtime module `import nixl` loads (else the only nixl_cuXX installed).
read -r mod site < <("$py" - <<'PY'
import importlib.util, os, sys
mod = None
try:
    import nixl
    mod = nixl._pkg.__name__
except Exception:
    found = [m for m in ("nixl_cu13", "nixl_cu12") if importlib.util.find_spec(m)]
    mod = found[0] if len(found) == 1 else None
if mod is None:
    print("- -")
else:
    spec = importlib.util.find_spec(mod)
    print(mod, os.path.dirname(os.path.dirname(spec.origin)))
PY
)
[ "$mod" != "-" ] || die "no NIXL wheel for $py: python -m nixl_io_uring_dmabuf doctor says what to install"
libs="$site/.$mod.mesonpy.libs"
bundled="$site/$mod.libs"
[ -f "$libs/libnixl.so" ] || die "$libs/libnixl.so is missing"
echo "build-nixlbench.sh: NIXL runtime $mod from $site"

pkgs=(g++ meson ninja-build pkg-config libgflags-dev libasio-dev libtomlplusplus-dev)
need=()
for p in "${pkgs[@]}"; do
    st="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)"
    [ "$st" = installed ] || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    [ "$apt" = 1 ] || die "missing Debian packages: ${need[*]}"
    sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    echo "build-nixlbench.sh: installing ${need[*]} (apt-get)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# A NIXL "prefix" for nixlbench's meson: the headers NIXL's meson.build installs, from the
# source checkout, and the three libraries it links, as links to the wheel's files.
P="$out/prefix"
rm -rf "$P"
mkdir -p "$P/include/utils/serdes" "$P/include/utils/common" "$P/include/backend" "$P/lib/x86_64-linux-gnu"
S="$nixl_src"
cp "$S"/src/api/cpp/{nixl.h,nixl_types.h,nixl_params.h,nixl_descriptors.h} \
   "$S"/src/core/{transfer_request.h,agent_data.h} "$S/src/infra/mem_section.h" \
   "$S/src/core/telemetry/telemetry_event.h" "$P/include/"
cp "$S/src/utils/serdes/serdes.h" "$P/include/utils/serdes/"
cp "$S"/src/utils/common/{nixl_time.h,nixl_log.h} "$P/include/utils/common/"
cp "$S"/src/api/cpp/backend/{backend_engine.h,backend_aux.h,backend_plugin.h} "$P/include/backend/"
for l in libnixl.so libnixl_build.so libserdes.so; do ln -sf "$libs/$l" "$P/lib/x86_64-linux-gnu/$l"; done

# Debian 12's gaps (see the top).
mkdir -p "$out/pc" "$out/shim/toml++"
asio_ver="$(dpkg-query -W -f='${Version}' libasio-dev | sed 's/-.*//; s/^[0-9]*://')"
toml_ver="$(dpkg-query -W -f='${Version}' libtomlplusplus-dev | sed 's/-.*//; s/^[0-9]*://')"
printf 'Name: asio\nDescription: asio (header only)\nVersion: %s\nCflags: -DASIO_STANDALONE\n' \
    "$asio_ver" > "$out/pc/asio.pc"
printf '#pragma once\n#include <toml++/toml.h>\n' > "$out/shim/toml++/toml.hpp"
printf 'Name: tomlplusplus\nDescription: toml++ (header only)\nVersion: %s\nCflags: -I%s -DTOML_HEADER_ONLY=1\n' \
    "$toml_ver" "$out/shim" > "$out/pc/tomlplusplus.pc"

link="-Wl,-rpath-link,$libs -Wl,-rpath-link,$bundled -Wl,-rpath,$libs -Wl,-rpath,$bundled"
for v in orig patched; do
    src="$out/src-$v"
    rm -rf "$src" "$out/build-$v"
    mkdir -p "$src/benchmark"
    cp -r "$S/benchmark/nixlbench" "$src/benchmark/"
    if [ "$v" = patched ]; then
        # git apply outside any repository: inside one (OUT in a checkout) it would silently
        # skip paths outside the current folder; the ceiling stops the search for one at OUT.
        (cd "$src" && GIT_CEILING_DIRECTORIES="$out" git apply \
            "$here/0001-nixlbench-add-IO_URING_DMABUF-storage-backend.patch")
        grep -q XFERBENCH_BACKEND_IO_URING_DMABUF "$src/benchmark/nixlbench/src/utils/utils.h" ||
            die "the patch did not apply to $src"
    fi
    LDFLAGS="$link" PKG_CONFIG_PATH="$out/pc" meson setup "$out/build-$v" "$src/benchmark/nixlbench" \
        -Dnixl_path="$P" --buildtype=release >"$out/meson-$v.log" 2>&1 ||
        { tail -n 30 "$out/meson-$v.log" >&2; die "meson setup failed ($out/meson-$v.log)"; }
    ninja -C "$out/build-$v" >"$out/ninja-$v.log" 2>&1 ||
        { tail -n 30 "$out/ninja-$v.log" >&2; die "ninja failed ($out/ninja-$v.log)"; }
    mkdir -p "$out/$v"
    ln -sf "../build-$v/nixlbench" "$out/$v/nixlbench"
done

for v in orig patched; do
    # every library resolved without LD_LIBRARY_PATH (grep reads to the end: no SIGPIPE)
    if env -u LD_LIBRARY_PATH ldd "$out/$v/nixlbench" | grep 'not found' >&2; then
        die "$out/$v/nixlbench: libraries not found (above)"
    fi
done
echo "build-nixlbench.sh: built $out/orig/nixlbench (as upstream) and $out/patched/nixlbench (--backend IO_URING_DMABUF)"
echo "  they load $libs/libnixl.so and read its plugins/ folder unless NIXL_PLUGIN_DIR is set"
