#!/usr/bin/env bash
# Runs a real nixlbench binary in storage mode (DRAM <-> FILE, --check_consistency) on three
# routes through the NIXL runtime of the nixl-cu12 wheel:
#   iud        patched nixlbench, --backend IO_URING_DMABUF   (NIXL_PLUGIN_DIR=$IUD_DIR)
#   iud-posix  unmodified nixlbench, --backend POSIX, with the plugin installed as POSIX in a
#              private folder (NIXL_PLUGIN_DIR=$ALIAS_DIR)
#   posix-aio  unmodified nixlbench, --backend POSIX, NIXL's own POSIX (nixlbench's default AIO)
#   posix-uring                         the same with --posix_api_type URING
# Every nixlbench process runs in an empty file directory (no stale file: a READ run reuses an
# existing file without refilling it). Raw output goes to $LOGS/<name>.log, one line per
# measured point to $LOGS/results.tsv.
#
# Usage: run-storage-bench.sh sweep|compare
# Environment: NB_ORIG, NB_PATCHED (nixlbench binaries), IUD_DIR, ALIAS_DIR, WHEEL_DIR (the
# wheel's plugins folder), NIXL_LIBS (LD_LIBRARY_PATH), FILEDIR, LOGS, ROUNDS (compare, 3).
set -uo pipefail
: "${NB_ORIG:?}" "${NB_PATCHED:?}" "${IUD_DIR:?}" "${ALIAS_DIR:?}" "${WHEEL_DIR:?}" "${NIXL_LIBS:?}"
FILEDIR="${FILEDIR:-/var/tmp/nb}"
LOGS="${LOGS:-/tmp/nb-logs}"
ROUNDS="${ROUNDS:-3}"
mkdir -p "$LOGS" "$FILEDIR"
export LD_LIBRARY_PATH="$NIXL_LIBS"

route() { # name -> "binary plugin_dir backend extra-flags"
    case "$1" in
        iud)         echo "$NB_PATCHED $IUD_DIR IO_URING_DMABUF" ;;
        iud-posix)   echo "$NB_ORIG $ALIAS_DIR POSIX" ;;
        posix-aio)   echo "$NB_ORIG $WHEEL_DIR POSIX --posix_api_type AIO" ;;
        posix-uring) echo "$NB_ORIG $WHEEL_DIR POSIX --posix_api_type URING" ;;
    esac
}

# run NAME TAG FLAGS... : one nixlbench process; appends its data rows to results.tsv
run() {
    local name="$1" tag="$2"; shift 2
    read -r bin dir backend extra <<<"$(route "$name")"
    local log="$LOGS/$tag.$name.log" dir_files="$FILEDIR/$tag.$name"
    rm -rf "$dir_files"; mkdir -p "$dir_files"
    local cmd=("$bin" --backend "$backend" $extra --filepath "$dir_files" --check_consistency "$@")
    echo "NIXL_PLUGIN_DIR=$dir ${cmd[*]}" >"$log"
    NIXL_PLUGIN_DIR="$dir" "${cmd[@]}" >>"$log" 2>&1
    local rc=$?
    echo "rc=$rc" >>"$log"
    local fail=0; grep -q "Consistency check failed" "$log" && fail=1
    # data rows: block batch GB/s lat prep p99prep post p99post tx p99tx
    awk -v n="$name" -v t="$tag" -v rc="$rc" -v f="$fail" \
        '/^[0-9]+ +[0-9]+ +[0-9.]+ /{print t"\t"n"\t"$1"\t"$2"\t"$3"\t"$4"\t"$7"\t"$8"\t"$9"\t"$10"\trc="rc"\tcheckfail="f}' \
        "$log" >>"$LOGS/results.tsv"
    rm -rf "$dir_files"
    [ "$rc" = 0 ] && [ "$fail" = 0 ] || echo "FAILED: $log (rc=$rc checkfail=$fail)" >&2
}

busy_start() { BUSY=(); for _ in 1 2; do sh -c 'while :; do :; done' & BUSY+=($!); done; }
BUSY=()
busy_stop() { [ ${#BUSY[@]} = 0 ] && return; for p in "${BUSY[@]}"; do kill "$p"; done; wait "${BUSY[@]}" 2>/dev/null; BUSY=(); }
trap busy_stop EXIT

NAMES=(iud iud-posix posix-aio posix-uring)
echo "loadavg start: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOGS/loadavg.txt"
case "${1:-}" in
sweep)
    for direct in 0 1; do
        for op in WRITE READ; do
            for n in "${NAMES[@]}"; do
                d=""; [ $direct = 1 ] && d="--storage_enable_direct"
                run "$n" "sweep-$op-direct$direct" --op_type "$op" $d \
                    --total_buffer_size 1073741824 --start_block_size 4096 \
                    --max_block_size 16777216 --num_iter 256 --warmup_iter 32
            done
        done
    done ;;
compare)
    for load in 0 2; do
        [ $load = 2 ] && busy_start
        echo "load=$load begin: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOGS/loadavg.txt"
        for r in $(seq 0 $((ROUNDS - 1))); do
            for i in 0 1 2 3; do
                n="${NAMES[$(((i + r) % 4))]}"
                for op in READ WRITE; do
                    run "$n" "cmp-load$load-r$r-$op-1Mx64" --op_type "$op" \
                        --total_buffer_size 268435456 --start_block_size 1048576 \
                        --max_block_size 1048576 --start_batch_size 64 --max_batch_size 64 \
                        --num_iter 16 --warmup_iter 4 --large_blk_iter_ftr 1
                    run "$n" "cmp-load$load-r$r-$op-4Mx1" --op_type "$op" \
                        --total_buffer_size 268435456 --start_block_size 4194304 \
                        --max_block_size 4194304 --num_iter 256 --warmup_iter 16 \
                        --large_blk_iter_ftr 1
                done
            done
        done
        echo "load=$load end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOGS/loadavg.txt"
        [ $load = 2 ] && busy_stop
    done ;;
*) echo "usage: $0 sweep|compare" >&2; exit 2 ;;
esac
echo "loadavg end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOGS/loadavg.txt"
