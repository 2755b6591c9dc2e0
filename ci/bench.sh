#!/usr/bin/env bash
# The project's main benchmark job: IO_URING_DMABUF against NIXL's own POSIX backend (io_uring and
# libaio queues), DRAM <-> FILE, READ and WRITE, 4 KiB .. 16 MiB blocks, 1 and 64 descriptors per
# request, buffered, on a temporary 1 GiB file in /tmp, every point verified (--check_consistency,
# outside the timed loop). The file blocks of a request are shuffled
# (--randomize_location_mode blockaligned), so ops/s counts real I/Os and no backend gains from
# merging neighbouring descriptors; pass --randomize_location_mode none for nixlbench's contiguous
# layout. Runs setup and the plugin build first, then the bench crate
# (bench/, binary iud-bench) over the real NIXL runtime of the wheel.
#
# Extra arguments go to iud-bench and override the defaults (later flags win), e.g.
#   bash ci/bench.sh --storage_enable_direct --filepath /var/tmp
#   bash ci/bench.sh --backend IO_URING_DMABUF,POSIX:use_uring=true --op_type READ --max_block_size 64K
# See `target/release/iud-bench --help`. Takes a few minutes on the 2-core machine.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

bash ci/setup.sh
bash ci/build.sh
cargo build --release -p iud-bench

IUD_PLUGIN_DIR="$(iud_plugin_dir)"
libs="$(iud_nixl_libs)"
rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
# Only what goes into the plugin and the benchmark counts as "the code measured".
measured=(src build.rs Cargo.toml Cargo.lock plugin-manifest nixl-headers bench/Cargo.toml bench/src)
if [ -n "$(git status --porcelain -- "${measured[@]}" 2>/dev/null)" ]; then
    rev="$rev+uncommitted changes in: $(git status --porcelain -- "${measured[@]}" | awk '{print $2}' | tr '\n' ' ')"
fi
echo "# ci/bench.sh at git $rev"

export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"
exec "$IUD_TARGET/release/iud-bench" \
    --backend 'IO_URING_DMABUF,POSIX:use_uring=true,POSIX:use_aio=true' \
    --op_type BOTH \
    --total_buffer_size 1G \
    --start_block_size 4096 --max_block_size 16M \
    --batch_sizes 1,64 --randomize_location_mode blockaligned \
    --num_iter 0 --duration_ms 500 --warmup_iter 10 \
    --check_consistency \
    "$@"
