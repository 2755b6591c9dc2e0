#!/usr/bin/env bash
# DRAM <-> BLK on a block device: IO_URING_DMABUF through the real NIXL runtime (iud-bench,
# target registered as BLOCK = BLK_SEG in fd mode with an O_DIRECT fd) against fio
# (ioengine=io_uring, fixedbufs=1, registerfiles=1, direct=1) on the same device, the same
# range, block sizes, batch = queue depth, READ and WRITE, random and sequential, point by point
# in one run; prints one side-by-side table (IOPS, GB/s, ratio) with machine, command and date.
#
#   bash bench/blk-vs-fio.sh                 a fresh 128 MiB loop device (losetup --direct-io=on,
#                                            4096 B sectors) on an image in /var/tmp, removed after
#   bash bench/blk-vs-fio.sh --device /dev/nvme0n1 --overwrite   any block device (its first
#                                            32 MiB are OVERWRITTEN)
#
# Options (all optional): --sector 512|4096 (loop device), --image-dir DIR (default /var/tmp;
# /dev/shm puts the image in memory, so the device costs little and the software path shows),
# --with-engine (adds a column for the engine without NIXL: ci/vm/lab's iud-lab --bench),
# and everything bench/blk_vs_fio.py takes: --ops WRITE,READ  --layouts rand,seq
# --block-sizes 4K-1M  --batch-sizes 1,32  --duration-ms 300  --reps 3  --poll-modes spin,yield
# --engine-poll spin|yield  --no-check  --log FILE.
# The NVMe counterpart (the engine without NIXL, inside the QEMU lab) is `LAB_BENCH=1 ci/vm/run-lab.sh`.
# Needs root (losetup). With the defaults: 72 points x 3 runs x 3 tools, about 6 minutes on 2 CPUs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../ci/env.sh"
cd "$IUD_ROOT"

cmdline="bash bench/blk-vs-fio.sh${*:+ $*}"
device="" overwrite="" sector=4096 imgdir=/var/tmp with_engine="" pass=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="$2"; shift 2 ;;
        --overwrite) overwrite=1; shift ;;
        --sector) sector="$2"; shift 2 ;;
        --image-dir) imgdir="$2"; shift 2 ;;
        --with-engine) with_engine=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) pass+=("$1"); shift ;;
    esac
done
if [ -n "$device" ] && [ -z "$overwrite" ]; then
    echo "blk-vs-fio: --device $device overwrites the device's first 32 MiB; add --overwrite" >&2
    exit 2
fi

bash ci/setup.sh >&2
bash ci/build.sh >&2
cargo build --release -p iud-bench >&2
if [ -n "$with_engine" ]; then
    cargo build --release -p iud-lab >&2
    pass+=(--engine "$IUD_TARGET/release/iud-lab")
fi
if ! command -v fio >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y fio >&2
fi

img=""
cleanup() {
    if [ -n "$img" ]; then
        [ -n "$device" ] && losetup -d "$device" 2>/dev/null || true
        rm -f "$img"
    fi
}
trap cleanup EXIT INT TERM
if [ -z "$device" ]; then
    img="$(mktemp "$imgdir/iud-blk-vs-fio.XXXXXX.img")"
    truncate -s 128M "$img"
    device="$(losetup -f --show --direct-io=on -b "$sector" "$img")"
fi

rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
measured=(src build.rs Cargo.toml Cargo.lock plugin-manifest nixl-headers bench/Cargo.toml bench/src bench/blk_vs_fio.py)
if [ -n "$(git status --porcelain -- "${measured[@]}" 2>/dev/null)" ]; then
    rev="$rev+uncommitted changes in: $(git status --porcelain -- "${measured[@]}" | awk '{print $2}' | tr '\n' ' ')"
fi
name="$(basename "$(readlink -f "$device")")"
q=/sys/class/block/$name
echo "# DRAM <-> BLK: IO_URING_DMABUF (NIXL, iud-bench) vs fio on the same device"
echo "date:     $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "command:  $cmdline"
echo "git:      $rev"
echo "cpu:      $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | sed -n 1p) ($(nproc) CPUs)"
echo "memory:   $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
echo "kernel:   $(uname -r)"
echo "fio:      $(fio --version)"
echo "device:   $device: $(cat "$q/size" 2>/dev/null || echo '?') sectors, logical block $(cat "$q/queue/logical_block_size") B, max_sectors_kb $(cat "$q/queue/max_sectors_kb"), nr_requests $(cat "$q/queue/nr_requests"), scheduler $(cat "$q/queue/scheduler")"
if [ -f "$q/loop/backing_file" ]; then
    bf="$(cat "$q/loop/backing_file")"
    echo "loop:     backing file $bf (dio $(cat "$q/loop/dio")) on $(df --output=source,fstype "$bf" | tail -1 | tr -s ' ')"
fi
echo "load before: $(uptime)"

export LD_LIBRARY_PATH="$(iud_nixl_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"
python3 bench/blk_vs_fio.py --device "$device" --iud-bench "$IUD_TARGET/release/iud-bench" "${pass[@]}"
echo "load after:  $(uptime)"
