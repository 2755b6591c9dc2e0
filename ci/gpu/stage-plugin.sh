#!/usr/bin/env bash
# Rebuilds the plugin and the doctor into .device/gpu (laid out by ci/gpu/prepare.sh) and writes
# .device/gpu/BUILD: the commit, whether the tree had changes, and the library's sha256. The GPU
# machine's copy of the repository can carry an older .git, so its `git rev-parse` does not say
# what was built; ci/gpu/per-request.sh and ci/gpu/run.sh print BUILD instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
G=.device/gpu
[ -d "$G/site" ] || { echo "ci/gpu/stage-plugin.sh: no $G/site; run ci/gpu/prepare.sh first" >&2; exit 2; }
cargo build --release --lib --bin iud-doctor
strip -o "$G/libplugin_IO_URING_DMABUF.so" target/release/libio_uring_dmabuf.so
strip -o "$G/iud-doctor" target/release/iud-doctor
# A stripped library that does not load is found here, not as a crash on the GPU machine.
readelf -h -S "$G/libplugin_IO_URING_DMABUF.so" >/dev/null
# Only what goes into the library counts as a change.
changes=$(git status --porcelain -- src build.rs Cargo.toml Cargo.lock nixl-headers plugin-manifest)
dirty=${changes:+ with uncommitted changes}
echo "plugin built from $(git rev-parse --short HEAD)$dirty, sha256 $(sha256sum "$G/libplugin_IO_URING_DMABUF.so" | cut -c1-16), $(date -u +%FT%TZ)" | tee "$G/BUILD"
