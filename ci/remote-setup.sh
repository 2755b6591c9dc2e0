#!/usr/bin/env bash
# What the remote-storage tests (tests/remote) and bench/remote_bench.py need besides ci/setup.sh:
# iproute2 (`ip netns`, veth) from apt, and an etcd binary. etcd comes from Debian's etcd-server
# package, unpacked into target/remote-tools with `apt-get download` + `dpkg-deb -x` rather than
# installed: installing it would also enable and start a system etcd service on machines with
# systemd. An etcd already on PATH (or named by IUD_ETCD) is used as it is. Idempotent and quiet
# when everything is there. `ci/remote-setup.sh --needs` prints what is missing and exits.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

tools="$IUD_TARGET/remote-tools"
etcd_bin=""
for c in "${IUD_ETCD:-}" "$(command -v etcd || true)" "$tools/usr/bin/etcd"; do
    if [ -n "$c" ] && [ -x "$c" ]; then etcd_bin="$c"; break; fi
done
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -n "$etcd_bin" ] || need+=(etcd-server)
if [ "${1:-}" = --needs ]; then
    echo "${need[*]}"
    exit 0
fi
[ ${#need[@]} -gt 0 ] || exit 0

if ! command -v ip >/dev/null 2>&1; then
    iud_apt_install ci/remote-setup.sh iproute2
fi
if [ -z "$etcd_bin" ]; then
    echo "ci/remote-setup.sh: unpacking Debian's etcd-server into $tools (apt-get download)"
    mkdir -p "$tools/debs"
    if ! (cd "$tools/debs" && apt-get download -qq etcd-server 2>/dev/null); then
        iud_apt_update
        (cd "$tools/debs" && apt-get download -qq etcd-server)
    fi
    # The newest download, picked without `ls | head`: under pipefail a reader that stops early
    # can kill the writer with SIGPIPE (exit 141) and the whole script with it.
    deb=""
    for d in "$tools"/debs/etcd-server_*.deb; do
        if [ -z "$deb" ] || [ "$d" -nt "$deb" ]; then deb="$d"; fi
    done
    dpkg-deb -x "$deb" "$tools"
    # etcd prints 4 lines; `| head -n 1` exited after the first and etcd died of SIGPIPE when it
    # wrote the rest (35 of 200 tries), failing the script on fresh machines. sed reads to the end.
    "$tools/usr/bin/etcd" --version | sed -n 1p
fi
