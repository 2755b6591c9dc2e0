#!/usr/bin/env bash
# The project's main benchmark job: IO_URING_DMABUF against NIXL's own POSIX backend (io_uring and
# libaio queues), DRAM <-> FILE, READ and WRITE, through the real NIXL runtime of the wheel, on a
# temporary file in /tmp (buffered), every point verified outside the timed loop:
#   0. per request, what clients wait for (printed first): makeXferReq over prepped lists + post +
#      poll to done + release per request, split prep / post->done / release, beside createXferReq
#      per request and the repost figure; scattered KV blocks 16 KiB x 8192 .. 2 MiB x 512 and a
#      contiguous READ of the same descriptors; every request verified (2 x 1 GiB DRAM regions,
#      a 2 GiB file);
#   1. the KV-cache pattern: 4 KiB .. 2 MiB blocks at random slots of two registered 256 MiB DRAM
#      regions against random, pairwise non-adjacent file offsets (nothing can merge), up to
#      64 MiB (at most 8192 blocks) per request; all backends alive at once, 3 rounds with the
#      backend order rotated, medians;
#   2. the nixlbench-style sweep: 4 KiB .. 16 MiB blocks, 1 and 64 descriptors per request, file
#      blocks of a request shuffled (--randomize_location_mode blockaligned), one run per point.
# Every row has GB/s and CPU seconds per GB (getrusage of the benchmark process over the timed
# loop). Runs setup, the plugin build and the bench crate (bench/, binary iud-bench) first, and
# installs matplotlib into .venv for the plot (ci/env.sh pins it; ci/test.sh installs it too, for
# the tests of the plot). `--workload kv,contig` leaves the per-request tables out.
#
# Results go to target/bench-results/<UTC time>-<host>/ (results.md, results.csv, results.png,
# stdout.txt); the last line printed names that folder. target/ because it is git-ignored build
# output: a run never dirties the work tree and is not mistaken for the curated, committed records
# in bench/results/; the time stamp keeps runs apart and the host name keeps machines apart.
# `--out_dir DIR` picks another folder.
#
# Extra arguments go to iud-bench and override the defaults below (later flags win), e.g.
#   bash ci/bench.sh --background_load 2          # a busy machine: 2 busy-loop processes
#   bash ci/bench.sh --storage_enable_direct --filepath /var/tmp
#   bash ci/bench.sh --workload kv --op_type READ --kv_max_block_size 256K
# `bash ci/bench.sh --help` prints this job's defaults and iud-bench's flags (bench/src/usage.txt,
# the text the binary prints) without setup or a build. Takes about 25 minutes on the 2-core machine,
# 20 of them the per-request tables (scattered 16-32 KiB buffered WRITEs of 128-256 MiB take about
# a second each there); `--workload kv,contig` is the former 5-minute job.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The defaults this job passes to iud-bench (printed by --help from this same list).
defaults=(
    --backend 'IO_URING_DMABUF,POSIX:use_uring=true,POSIX:use_aio=true'
    --op_type BOTH
    --workload req,kv,contig
    --total_buffer_size 1G
    --kv_start_block_size 4K --kv_max_block_size 2M --kv_request_size 64M
    --kv_regions 2 --kv_region_size 256M --kv_rounds 3
    --start_block_size 4096 --max_block_size 16M
    --batch_sizes 1,64 --randomize_location_mode blockaligned
    --num_iter 0 --duration_ms 500 --warmup_iter 10
    --check_consistency
)

for a in "$@"; do
    case "$a" in
    --help | -help | -h | --help=true | -help=true)
        cat <<EOF
bash ci/bench.sh [iud-bench flags...]

The main benchmark job: sets up (ci/setup.sh, plus matplotlib in .venv, pinned in
ci/env.sh), builds the plugin and iud-bench, runs iud-bench through the real NIXL runtime, and writes results.md, results.csv,
results.png and stdout.txt into target/bench-results/<UTC time>-<host>/ (or --out_dir DIR). The
last line printed names that folder.

Defaults passed to iud-bench (extra flags come after them, so they win):
  ${defaults[*]}

EOF
        cat "$here/../bench/src/usage.txt"
        exit 0
        ;;
    esac
done

source "$here/env.sh"
cd "$IUD_ROOT"

# The results folder: --out_dir from the arguments (the last one wins, as in iud-bench), else a
# new folder under target/bench-results.
out=""
prev=""
for a in "$@"; do
    case "$a" in
    --out_dir=* | -out_dir=*) out="${a#*=}" ;;
    esac
    if [ "$prev" = --out_dir ] || [ "$prev" = -out_dir ]; then out="$a"; fi
    prev="$a"
done
if [ -z "$out" ]; then
    out="$IUD_TARGET/bench-results/$(date -u +%Y%m%dT%H%M%SZ)-$(hostname -s 2>/dev/null || echo host)"
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"

bash ci/setup.sh
source ci/env.sh  # again: the plugin dir is known only once the wheel is installed
iud_ensure_matplotlib ci/bench.sh
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
echo "# ci/bench.sh at git $rev" | tee "$out/stdout.txt"

export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"
export IUD_BENCH_GIT="$rev"
rc=0
"$IUD_TARGET/release/iud-bench" "${defaults[@]}" --out_dir "$out" "$@" 2>&1 | tee -a "$out/stdout.txt" || rc=${PIPESTATUS[0]}
if [ -s "$out/results.csv" ]; then
    "$IUD_PY" bench/plot_results.py "$out" || rc=1
else
    echo "ci/bench.sh: no results.csv, so no plot (iud-bench exit $rc)"
fi
echo "results: $out"
exit "$rc"
