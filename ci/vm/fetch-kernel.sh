#!/usr/bin/env bash
# One-time setup for the NVMe lab (ci/vm/README.md):
#   - installs qemu-system-x86 and cpio from Debian if they are missing;
#   - downloads the newest Debian cloud-amd64 kernel (trixie-backports or sid) with
#     `apt-get download` and unpacks it with `dpkg -x` under ci/vm/work/kernel/<release>/;
#   - writes ci/vm/work/kernel-<release>.env (KVER=..., KERNEL=..., MODULES=...) for run-lab.sh,
#     and ci/vm/work/kernel.env (the default kernel) when KVER was not given.
#
# The extra suites go into their own sources file with pin priority 1, so that nothing on the
# system is ever upgraded from them; only the kernel packages are downloaded (never installed).
#
# Usage: ci/vm/fetch-kernel.sh [--tools-only]   (--tools-only: install qemu and cpio, nothing else)
#
# Environment:
#   KVER=7.2.13+deb14-cloud-amd64   fetch this kernel release instead of the newest cloud one
#                                   (any flavour: KVER=7.3.4+deb13-amd64 is the generic kernel)
#   LAB_SUITES="trixie-backports sid"  suites to look in (default)
#   LAB_NO_APT_UPDATE=1             skip `apt-get update` of the lab suites (lists already there)
#
# To use any other kernel instead, skip this script's kernel part and run
#   KERNEL=/path/to/bzImage [MODULES=/path/to/lib/modules/<release>] ci/vm/run-lab.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$here/work"
suites="${LAB_SUITES:-trixie-backports sid}"
sources=/etc/apt/sources.list.d/iud-lab-kernel.sources
prefs=/etc/apt/preferences.d/iud-lab-kernel

log() { printf 'fetch-kernel: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# --- host tools -----------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v cpio >/dev/null || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    sudo_ apt-get update -qq
    sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 still missing after apt-get install"
command -v cpio >/dev/null || die "cpio still missing after apt-get install"
[ "${1:-}" = "--tools-only" ] && exit 0

# --- the lab suites, pinned so that they never upgrade anything ----------------------------
want_sources="Types: deb
URIs: http://deb.debian.org/debian
Suites: $suites
Components: main
Architectures: amd64
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
want_prefs=""
for s in $suites; do
    want_prefs+="# iud NVMe lab (ci/vm/fetch-kernel.sh): kernel downloads only, never upgrade from here
Package: *
Pin: release n=$s
Pin-Priority: 1

"
done
if [ "$(cat "$sources" 2>/dev/null)" != "$want_sources" ]; then
    log "writing $sources ($suites)"
    printf '%s\n' "$want_sources" | sudo_ tee "$sources" >/dev/null
    LAB_NO_APT_UPDATE=
fi
if [ "$(cat "$prefs" 2>/dev/null)" != "${want_prefs%$'\n'}" ]; then
    log "writing $prefs (pin priority 1)"
    printf '%s' "${want_prefs%$'\n'}" | sudo_ tee "$prefs" >/dev/null
fi
if [ -z "${LAB_NO_APT_UPDATE:-}" ]; then
    log "apt-get update (lab suites only)"
    # Only the lab's sources file: the system's own lists are left as they are.
    sudo_ apt-get update -qq -o Dir::Etc::sourcelist="$sources" -o Dir::Etc::sourceparts=- \
        -o APT::Get::List-Cleanup=0
fi

# --- pick the kernel ------------------------------------------------------------------------
# Kernel packages of the 7.x layout: linux-binary-<release> holds vmlinuz, linux-modules-<release>
# the modules; both carry the same version. The release string sorts like a version.
explicit="${KVER:+1}"
if [ -z "${KVER:-}" ]; then
    KVER="$(apt-cache pkgnames linux-binary- | grep -E '^linux-binary-[0-9][^ ]*-cloud-amd64$' \
        | sed 's/^linux-binary-//' | sort -V | tail -1)"
    [ -n "$KVER" ] || die "no linux-binary-*-cloud-amd64 package in $suites"
fi
bin_pkg="linux-binary-$KVER"
mod_pkg="linux-modules-$KVER"
# The newest version of the package among the lab suites (pin 1 hides it from the candidate).
pkgver() { apt-cache show "$1" 2>/dev/null | sed -n 's/^Version: //p' | sort -V | tail -1; }
ver="$(pkgver "$bin_pkg")"
[ -n "$ver" ] || die "package $bin_pkg not found (apt-cache pkgnames linux-binary- | grep cloud)"
log "kernel $KVER (package version $ver)"

dest="$work/kernel/$KVER"
if [ -f "$dest/.complete" ]; then
    log "already unpacked in $dest"
else
    dl="$work/debs"
    mkdir -p "$dl"
    rm -rf "$dest" && mkdir -p "$dest"
    (cd "$dl" && apt-get download -q "$bin_pkg=$ver" 2>&1 | grep -v 'unsandboxed as root' >&2 || true)
    if [ -n "$(pkgver "$mod_pkg")" ]; then
        (cd "$dl" && apt-get download -q "$mod_pkg=$ver" 2>&1 | grep -v 'unsandboxed as root' >&2 || true)
    fi
    shopt -s nullglob
    debs=("$dl"/linux-binary-"${KVER}"_*.deb "$dl"/linux-modules-"${KVER}"_*.deb)
    [ ${#debs[@]} -gt 0 ] || die "apt-get download of $bin_pkg=$ver produced no .deb"
    for d in "${debs[@]}"; do
        log "unpacking $(basename "$d")"
        dpkg -x "$d" "$dest"
    done
    touch "$dest/.complete"
    rm -f "${debs[@]}"
fi

# --- locate vmlinuz and the modules --------------------------------------------------------
kernel=""
for c in "$dest/usr/lib/modules/$KVER/vmlinuz" "$dest/lib/modules/$KVER/vmlinuz" "$dest/boot/vmlinuz-$KVER"; do
    [ -f "$c" ] && { kernel="$c"; break; }
done
[ -n "$kernel" ] || kernel="$(find "$dest" -name 'vmlinuz*' -type f -print -quit)"
[ -n "$kernel" ] || die "no vmlinuz in $dest"
modules=""
for c in "$dest/usr/lib/modules/$KVER" "$dest/lib/modules/$KVER"; do
    [ -f "$c/modules.dep" ] || [ -d "$c/kernel" ] && { modules="$c"; break; }
done

envf="$work/kernel-$KVER.env"
cat >"$envf" <<EOF
# Written by ci/vm/fetch-kernel.sh; read by ci/vm/run-lab.sh unless KERNEL is set.
KVER=$KVER
KERNEL=$kernel
MODULES=$modules
EOF
also=""
if [ -z "$explicit" ]; then
    cp "$envf" "$work/kernel.env"
    also=" and $work/kernel.env"
fi
log "wrote $envf$also:"
sed 's/^/    /' "$envf" >&2
