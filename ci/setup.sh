#!/usr/bin/env bash
# Installs what the build, tests and benchmark need on a fresh Debian machine that has Rust, gcc
# and Python: a C++ compiler, libclang (bindgen), the venv module, and a venv with the NIXL wheel.
# Idempotent and quiet when everything is already there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v g++ >/dev/null || need+=(g++)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
command -v losetup >/dev/null || need+=(mount)
if [ ${#need[@]} -gt 0 ]; then
    echo "ci/setup.sh: installing ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$IUD_PY" ]; then
    python3 -m venv "$IUD_VENV"
fi
if ! "$IUD_PY" -c 'import nixl_cu12' 2>/dev/null && ! "$IUD_PY" -c 'import nixl_cu13' 2>/dev/null; then
    echo "ci/setup.sh: installing $IUD_NIXL_WHEEL into $IUD_VENV"
    # --no-deps: the wheel's torch requirement is only needed for tensor registration (2 GB).
    "$IUD_PY" -m pip install -q --no-deps "$IUD_NIXL_WHEEL" "nixl==${IUD_NIXL_WHEEL##*==}"
fi
"$IUD_PY" -c 'import numpy, pytest' 2>/dev/null || "$IUD_PY" -m pip install -q numpy pytest
