#!/usr/bin/env bash
# Prepares what tests/remote needs on the GPU machine besides .device/gpu (ci/gpu/prepare.sh):
# iproute2's `ip` (the image may lack it; there is no apt there) with the shared libraries it
# needs beyond glibc, from Debian 12's amd64 debs (apt-get download + dpkg -x). Output:
# .device/remote (git-ignored, ~1 MB), carried by the device tool next to .device/gpu;
# `ci/gpu/run.sh remote` puts .device/remote/bin first on PATH.
#   bin/ip     a wrapper: runs lib/ip through the image's own dynamic loader with
#              --library-path lib, so the bundled libraries serve `ip` alone and do not leak
#              (as LD_LIBRARY_PATH would) into the processes `ip netns exec` starts
#   lib/       the `ip` binary and the closure of its NEEDED libraries, less glibc's
# Needs glibc >= 2.34 on the image (the newest symbol version these binaries use).
# etcd (the etcd cases of tests/remote; the p2p ones do without): Debian 12's etcd-server binary is
# 21.5 MB (already stripped), too big to carry as it is. With IUD_REMOTE_ETCD=1 it is carried
# xz-compressed (5.8 MB, etcd.xz), which run.sh unpacks into /tmp with Python's lzma.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=$PWD/.device/remote
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"; mkdir -p "$out/bin" "$out/lib" "$work/debs" "$work/root"
debs="iproute2 libbpf1 libelf1 libmnl0 libbsd0 libmd0 libcap2 zlib1g"
[ "${IUD_REMOTE_ETCD:-0}" = 1 ] && debs="$debs etcd-server"
o=()
[ "$(dpkg --print-architecture)" = amd64 ] ||
    { o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64); mkdir -p /tmp/amd64/partial; }
dl() { (cd "$work/debs" && apt-get "${o[@]}" download -q $debs 2>&1 | grep -v "^W: Download is performed unsandboxed" || true); }
dl
if [ "$(ls "$work/debs" | wc -l)" -lt "$(wc -w <<<"$debs")" ]; then
    apt-get "${o[@]}" update -qq; rm -f "$work"/debs/*; dl
fi
for f in "$work"/debs/*.deb; do dpkg -x "$f" "$work/root"; done
cp "$work/root/bin/ip" "$out/lib/ip"
# The NEEDED closure of ip, found in the unpacked debs (glibc's own libraries are not there:
# the image's are used).
todo=("$out/lib/ip")
while [ ${#todo[@]} -gt 0 ]; do
    f=${todo[0]}; todo=("${todo[@]:1}")
    for n in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        [ -e "$out/lib/$n" ] && continue
        src=$(find "$work/root" -name "$n" -print -quit)
        [ -n "$src" ] || continue
        cp -L "$src" "$out/lib/$n"; todo+=("$out/lib/$n")
    done
done
strip --strip-unneeded "$out"/lib/*
cat >"$out/bin/ip" <<'SH'
#!/bin/sh
# iproute2's ip from .device/remote/lib (ci/gpu/remote-prepare.sh) through the image's loader.
d=$(dirname "$(dirname "$(readlink -f "$0")")")/lib
exec /lib64/ld-linux-x86-64.so.2 --library-path "$d" "$d/ip" "$@"
SH
chmod +x "$out/bin/ip"
if [ "${IUD_REMOTE_ETCD:-0}" = 1 ]; then
    xz -9 -T0 -c "$work/root/usr/bin/etcd" >"$out/etcd.xz"
fi
ls -la "$out/lib"
"$out/bin/ip" -V
du -sh "$out"
