#!/usr/bin/env bash
# Builds the Python wheel that carries the plugin: nixl_io_uring_dmabuf (installer, doctor,
# bench, the LMCache and vLLM adapters) plus target/release/libio_uring_dmabuf.so stored as
# nixl_io_uring_dmabuf/lib/libplugin_IO_URING_DMABUF.so. Writes target/wheels/*.whl.
# Builds the library first unless IUD_SKIP_CARGO=1. The wheel's build backend is python/iud_build.py
# (no network, no build dependencies). It tags the wheel manylinux_2_N_x86_64, 2.N being the
# newest glibc symbol version the library needs (2.34 when linked on Debian 12), and refuses a
# library that links more than the C and C++ runtime; tests/python/test_wheel_tag.py checks the
# tag with `auditwheel show`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"
if [ "${IUD_SKIP_CARGO:-0}" != 1 ]; then
    cargo build --release --lib
fi
out="$IUD_TARGET/wheels"
mkdir -p "$out"
rm -f "$out"/nixl_io_uring_dmabuf-*.whl
py="$IUD_PY"
[ -x "$py" ] || py=python3
IUD_PLUGIN_SO="$IUD_PLUGIN_SO" "$py" -m pip wheel -q --no-deps --disable-pip-version-check -w "$out" python/
ls "$out"/nixl_io_uring_dmabuf-*.whl
