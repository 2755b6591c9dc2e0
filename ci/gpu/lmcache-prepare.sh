#!/usr/bin/env bash
# Prepares LMCache 0.5.6 for the GPU machine (cp312, no internet there): lmcache without its
# dependencies plus the modules its StorageManager / NIXL storage path imports (the list in
# ci/clients-setup.sh), as wheels in .device/lmcache/wheels (git-ignored via .device/; wheels,
# not unpacked, to stay small for the carry). numpy and hf_xet are left out (the GPU image's
# Python has numpy; hf_xet only serves Hub downloads): about 52 MB. Run after ci/gpu/prepare.sh;
# carry .device/lmcache and .device/gpu; on the GPU machine:
#   mkdir -p /tmp/lmsite && for w in .device/lmcache/wheels/*.whl; do unzip -q -o "$w" -d /tmp/lmsite; done
#   PYTHONPATH=/tmp/lmsite:$PWD/.device/gpu/site IUD_PLUGIN_SO=$PWD/.device/gpu/libplugin_IO_URING_DMABUF.so \
#       python3 tests/gpu/lmcache_cuda.py "$OUT/lmcache-cuda.json"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=.device/lmcache
rm -rf "$out"; mkdir -p "$out/wheels"
P=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --only-binary=:all:
   -q --disable-pip-version-check -d "$out/wheels")
python3 -m pip download "${P[@]}" --no-deps lmcache==0.5.6
python3 -m pip download "${P[@]}" pyyaml requests cachetools sortedcontainers "prometheus_client<=0.24.1" \
    py-cpuinfo psutil aiohttp aiofile aiofiles msgspec "pyzmq>=25" "transformers>=5.4" cryptography numba
rm -f "$out"/wheels/numpy-*.whl "$out"/wheels/hf_xet-*.whl
du -sh "$out/wheels"
