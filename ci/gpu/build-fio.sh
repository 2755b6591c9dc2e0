#!/usr/bin/env bash
# Builds a static fio (io_uring and psync engines; no optional libraries) for the GPU machine,
# which has no fio and no internet: the O_DIRECT target of the VRAM benchmark is "≥95 % of what
# fio reaches on the same disk". Source: Debian's fio package (deb-src added in its own sources
# file). Output: $1 (default .device/gpu/fio/fio).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${1:-.device/gpu/fio/fio}
work=${FIO_BUILD_DIR:-/tmp/iud-fio-build}
mkdir -p "$(dirname "$out")" "$work"
if [ ! -x "$work/fio-static" ]; then
    if [ ! -f /etc/apt/sources.list.d/iud-src.sources ]; then
        suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
        printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$suite" \
            > /etc/apt/sources.list.d/iud-src.sources
        apt-get update -qq -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/iud-src.sources -o Dir::Etc::sourceparts=-
    fi
    (cd "$work" && apt-get source -qq --download-only fio && tar xzf fio_*.orig.tar.gz)
    src=$(find "$work" -maxdepth 1 -type d -name 'fio-*' -print -quit)
    (cd "$src" && ./configure --build-static --disable-native --disable-rdma --disable-gfapi --disable-rados \
        --disable-rbd --disable-pmem --disable-numa --disable-http --disable-libzbc --disable-xnvme \
        --disable-tcmalloc --disable-dfs --disable-libnfs >/dev/null && make -j"$(nproc)" fio >/dev/null)
    strip -o "$work/fio-static" "$src/fio"
fi
cp "$work/fio-static" "$out"
"$out" --version
