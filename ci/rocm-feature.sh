#!/usr/bin/env bash
# The `rocm` cargo feature (hip-runtime-sys for HIP device count and pointer attributes), built
# against Debian's own HIP packages; no GPU needed.
#
# hip-runtime-sys 0.1.2's build script panics unless $HIP_PATH/include/hip/hip_runtime_api.h
# exists (it tries `hipconfig -p`, HIP_PATH, ROCM_PATH, /opt/rocm, /opt/rocm/hip) and links
# libamdhip64. Debian bookworm main has both: libamdhip64-dev 5.2.3 puts the header in
# /usr/include/hip and libamdhip64.so in the multiarch lib dir, so HIP_PATH=/usr is enough.
# The install pulls 8 packages (libamdhip64-dev, libamdhip64-5, libhiprtc-builtins5,
# libhsa-runtime-dev, libhsa-runtime64-1, libhsakmt1, libamd-comgr2, libamd-comgr-dev):
# 18.5 MB download, 79 MiB installed, about 10 s.
#
# Stages:
#   1. cargo check --release --features rocm of the library and its tests (shared target dir:
#      check writes no library, so the plugin build is untouched). About 15 s.
#   2. only with IUD_ROCM_FEATURE_TEST=1: build and run the ROCm tests with the feature, linked
#      against Debian's libamdhip64 (which finds no GPU here, so HIP reports no device and the HSA
#      view decides), in target/rocm-feature so that the shared libio_uring_dmabuf.so is not
#      replaced by a build that needs libamdhip64. A build from scratch: docs/semantics.md (ROCm memory).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ! -f /usr/include/hip/hip_runtime_api.h ] && [ -z "${HIP_PATH:-}" ]; then
    echo "ci/rocm-feature.sh: installing libamdhip64-dev from Debian's archive"
    start=$(date +%s)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libamdhip64-dev >/dev/null
    echo "ci/rocm-feature.sh: installed in $(( $(date +%s) - start )) s"
fi
export HIP_PATH="${HIP_PATH:-/usr}"

echo "== cargo check --release --features rocm (HIP_PATH=$HIP_PATH)"
start=$(date +%s)
cargo check --release --features rocm --lib --tests
echo "cargo check --features rocm: ok in $(( $(date +%s) - start )) s"

if [ "${IUD_ROCM_FEATURE_TEST:-0}" = 1 ]; then
    echo "== cargo test --release --features rocm (target/rocm-feature)"
    start=$(date +%s)
    CARGO_TARGET_DIR="$IUD_TARGET/rocm-feature" cargo test --release --features rocm --test rocm_provider
    CARGO_TARGET_DIR="$IUD_TARGET/rocm-feature" cargo test --release --features rocm --lib gpu::rocm
    echo "cargo test --features rocm: ok in $(( $(date +%s) - start )) s"
else
    echo "== cargo test --features rocm: skipped (set IUD_ROCM_FEATURE_TEST=1; builds a second target dir)"
fi
