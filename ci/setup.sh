#!/usr/bin/env bash
# Installs what the build, tests and benchmark need on a fresh Debian machine that has Rust, gcc
# and Python: a C++ compiler, libclang (bindgen), the venv module, and a venv with the NIXL wheel.
# Idempotent and quiet when everything is already there.
#
# Detection asks dpkg for the exact packages, never a file glob: a glob over llvm's lib folder
# also matched libclang-cpp.so.14 (package libclang-cpp14, which many machines have), so
# libclang-dev was never installed and bindgen failed on fresh machines. `ci/setup.sh --needs`
# prints the missing packages and exits; IUD_DPKG_ADMINDIR points dpkg at another status
# database (tests/python/test_setup.py uses it to replay machine states).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# Debian packages, each for one step: g++ compiles the C++ shim (cc crate), libclang-dev is the
# libclang.so that bindgen loads plus clang's own headers, python3-venv makes .venv, mount gives
# losetup for the loop-device tests.
IUD_APT_PACKAGES=(g++ libclang-dev python3-venv mount)

pkg_installed() {  # name: exit 0 when dpkg has it in state "installed"
    local st
    st="$(dpkg-query ${IUD_DPKG_ADMINDIR:+--admindir="$IUD_DPKG_ADMINDIR"} -W -f='${db:Status-Status}' "$1" 2>/dev/null)" || return 1
    [ "$st" = installed ]
}

need=()
for p in "${IUD_APT_PACKAGES[@]}"; do pkg_installed "$p" || need+=("$p"); done
if [ "${1:-}" = --needs ]; then
    echo "${need[*]}"
    exit 0
fi

if [ ${#need[@]} -gt 0 ]; then
    iud_apt_install ci/setup.sh "${need[@]}"
fi

if [ ! -x "$IUD_PY" ]; then
    python3 -m venv "$IUD_VENV"
fi
# Python packages: the test runner and numpy first, the NIXL wheel last and without its
# dependencies. nixl-cu12 declares torch (2 GB) although only torch-tensor registration uses it;
# installing it with --no-deps after everything else keeps pip's resolver from printing a
# missing-torch "ERROR" that reads like a failure.
if ! "$IUD_PY" -c 'import numpy, pytest' 2>/dev/null; then
    echo "ci/setup.sh: installing numpy and pytest into $IUD_VENV"
    "$IUD_PY" -m pip install -q --disable-pip-version-check numpy pytest
fi
if ! "$IUD_PY" -c 'import nixl_cu12' 2>/dev/null && ! "$IUD_PY" -c 'import nixl_cu13' 2>/dev/null; then
    echo "ci/setup.sh: installing $IUD_NIXL_WHEEL into $IUD_VENV without torch (only needed to register torch tensors; the plugin and tests pass raw addresses)"
    "$IUD_PY" -m pip install -q --disable-pip-version-check --no-deps "$IUD_NIXL_WHEEL" "nixl==${IUD_NIXL_WHEEL##*==}"
fi
