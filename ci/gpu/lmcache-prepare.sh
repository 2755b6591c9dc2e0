#!/usr/bin/env bash
# Prepares LMCache 0.5.6 for the GPU machine (cp312, no internet there): lmcache and the modules
# its StorageManager / NIXL storage path imports (the list in ci/clients-setup.sh) that the GPU
# image lacks, as wheels in .device/lmcache/wheels (git-ignored via .device/; wheels, not
# unpacked, to stay small for the carry), each without its dependencies. The image already has
# pyyaml, requests, sortedcontainers, prometheus-client, py-cpuinfo, psutil, aiohttp, aiofiles,
# transformers, numba, numpy and torch (the device tool's KINDS.md package list, 2026-11-17).
# About 26 MB: with .device/gpu (48 MB) over the 64 MiB carry, so it travels in a second call
# while the machine is still warm (.device/gpu stays there between calls). On the GPU machine:
#   mkdir -p /tmp/lmsite && for w in .device/lmcache/wheels/*.whl; do unzip -q -o "$w" -d /tmp/lmsite; done
#   PYTHONPATH=/tmp/lmsite:$PWD/.device/gpu/site IUD_PLUGIN_SO=$PWD/.device/gpu/libplugin_IO_URING_DMABUF.so \
#       python3 tests/gpu/lmcache_cuda.py "$OUT/lmcache-cuda.json"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=.device/lmcache
rm -rf "$out"; mkdir -p "$out/wheels"
P=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --only-binary=:all: --no-deps -q --disable-pip-version-check -d "$out/wheels")
python3 -m pip download "${P[@]}" lmcache==0.5.6 cachetools aiofile caio msgspec "pyzmq>=25" \
    cryptography cffi pycparser
du -sh "$out/wheels"
