#!/usr/bin/env bash
# The CPU benchmark (iud-bench, DRAM <-> page-cache file) on 2 CPUs of the GPU machine
# (taskset), quiet and with 2 busy-loop processes on the same 2 CPUs: a quiet 2-core
# machine that this project's shared 2-core VM cannot give while other work runs. Needs
# .device/gpu from ci/gpu/prepare.sh plus .device/gpu/iud-bench (stripped target/release/iud-bench).
# Usage: bash ci/gpu/cpu2.sh [extra iud-bench flags]; writes $OUT/cpu2-{quiet,busy}/results.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
L=$PWD/.device/gpu/site/.nixl_cu13.mesonpy.libs
mkdir -p "$L/iud-plugins"
for p in "$L"/plugins/libplugin_*.so; do ln -sf "../plugins/$(basename "$p")" "$L/iud-plugins/"; done
cp -f .device/gpu/libplugin_IO_URING_DMABUF.so "$L/iud-plugins/"
export LD_LIBRARY_PATH=$L:$PWD/.device/gpu/site/nixl_cu13.libs NIXL_PLUGIN_DIR=$L/iud-plugins
B=${IUD_CPU2_BACKENDS:-IO_URING_DMABUF,IO_URING_DMABUF:punt_buffered_min=0,POSIX:use_uring=true,POSIX:use_aio=true}
CPUS=${IUD_CPU2_CPUS:-2,3}
for mode in quiet busy; do
    load=(); [ "$mode" = busy ] && load=(--background_load 2)
    echo "== cpu2 $mode: taskset -c $CPUS iud-bench --backend $B ${load[*]} $*"
    taskset -c "$CPUS" .device/gpu/iud-bench --backend "$B" --op_type BOTH --total_buffer_size 1G \
        --kv_start_block_size 4K --kv_max_block_size 2M --kv_request_size 64M --kv_regions 2 \
        --kv_region_size 256M --kv_rounds 3 --num_iter 0 --duration_ms 250 --warmup_iter 10 \
        --check_consistency --filepath /tmp --out_dir "${OUT:-/tmp}/cpu2-$mode" "${load[@]}" "$@" \
        > "${OUT:-/tmp}/cpu2-$mode.txt" 2>&1
    echo "exit $?"; grep -A14 "summary" "${OUT:-/tmp}/cpu2-$mode.txt" | sed -n 1,40p
done
