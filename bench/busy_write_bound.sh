#!/usr/bin/env bash
# Buffered WRITE per request on a busy machine next to the bound one thread reaches (issue 26,
# item 5): are IO_URING_DMABUF and NIXL's POSIX AIO both at what the kernel gives one writer of
# one file, or is either short of it?
#
# Each round, under the same N busy-loop processes (started once, before the first round):
#   1. iud-bench, per request (make_prepped_xfer + post + DONE + release), scattered KV blocks,
#      WRITE, IO_URING_DMABUF against POSIX AIO (every request verified byte for byte);
#   2. one writer with nothing but pwrite(2) around it, at random aligned offsets of a prefilled,
#      written-back, cached 1 GiB file: bench/write_bound.py (one Python thread, its sources
#      cycling through 512 MiB, cold in the CPU's caches as the benchmark's KV blocks are), and
#      fio (psync, one job, one hot buffer). Buffered writes to one ext4 file serialize on its
#      inode lock, so one writer is the one-file bound.
# Rounds alternate which of the two comes first. Optional: PERF=1 records a cpu-clock profile of
# the first round's iud-bench runs (one backend each) into $OUT/perf-*.data.
#
#   FIO=/path/to/fio bash bench/busy_write_bound.sh [OUT_DIR]
# Environment: ROUNDS (3), LOAD (2 busy loops), POINTS (16K:8192,...,2M:512), DIR (/var/tmp),
#   SECONDS_PER_POINT (0.5), FILE_MIB (1024: the bare writers' file), SOURCE (512M: the bare
#   loop's source), REGION (iud-bench's --req_region_size; its default when unset). Without fio
#   (FIO=none, or unset with none on PATH) its column reads "-".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/env.sh
export LD_LIBRARY_PATH="$(iud_nixl_libs)" NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"
OUT="${1:-/tmp/iud-busy-write}"
ROUNDS="${ROUNDS:-3}" LOAD="${LOAD:-2}" DIR="${DIR:-/var/tmp}"
POINTS="${POINTS:-16K:8192,32K:8192,64K:4096,256K:2048,2M:512}"
SECS="${SECONDS_PER_POINT:-0.5}"
MS="$(awk "BEGIN {print int($SECS * 1000)}")"
FILE_MIB="${FILE_MIB:-1024}" SOURCE="${SOURCE:-512M}"
FIO="${FIO:-$(command -v fio || true)}"
[ "$FIO" != none ] || FIO=""
if [ -n "$FIO" ] && [ ! -x "$FIO" ]; then echo "busy_write_bound.sh: FIO=$FIO is not executable" >&2; exit 2; fi
[ -n "$FIO" ] || echo "busy_write_bound.sh: no fio on PATH (set FIO=/path/to/fio); its column stays empty"
BENCH=target/release/iud-bench
[ -x "$BENCH" ] || cargo build --release -q -p iud-bench
mkdir -p "$OUT"
fio_file="$DIR/iud-busy-write-fio.bin"
# Prefilled and written back, as iud-bench leaves its file (16 MiB writes, fdatasync): cached in
# large folios whose blocks are allocated. On ext4 (Linux 6.18, 2-CPU VM) fio's 64 KiB writes ran
# 0.97 GB/s into such a file, with 75 % of the time in ext4_block_write_begin (perf), and 5.3 GB/s
# into one written without the fdatasync, so fio must start from the same state to be the bound.
[ -z "$FIO" ] || dd if=/dev/urandom of="$fio_file" bs=1M count="$FILE_MIB" status=none conv=fdatasync

loads=()
cleanup() { for p in "${loads[@]}"; do kill "$p" 2>/dev/null || true; done; rm -f "$fio_file"; }
trap cleanup EXIT
for _ in $(seq "$LOAD"); do sh -c 'while :; do :; done' & loads+=($!); done
echo "busy_write_bound.sh: $(date -u +%FT%TZ), $LOAD busy loop(s), kernel $(uname -r), $(nproc) CPUs, points $POINTS"

bench_run() {  # $1 round, $2 backends, $3 perf prefix or ""
    local args=(--backend "$2" --op_type WRITE --workload req --req_points "$POINTS" --req_modes prepped
                --noreq_contig --kv_rounds 1 --duration_ms "$MS"
                --filepath "$DIR" ${REGION:+--req_region_size "$REGION"})
    if [ -n "$3" ]; then
        perf record -q -e cpu-clock -F 2000 -g -o "$OUT/perf-$3.data" -- "$BENCH" "${args[@]}" > "$OUT/bench-r$1-$3.log" 2>&1
    else
        "$BENCH" "${args[@]}" > "$OUT/bench-r$1.log" 2>&1
    fi
}

bound_run() {  # $1 round: the bare writers, one block size after another
    local p bs sizes
    # One Python thread's pwrite(2) loop, cold source, written-back file.
    sizes="$(for p in ${POINTS//,/ }; do printf '%s,' "${p%%:*}"; done)"
    python3 bench/write_bound.py --dir "$DIR" --file_mib "$FILE_MIB" --blocks "${sizes%,}" --files 1 \
        --footprints "$SOURCE" --threads 1 --seconds "$SECS" --writeback > "$OUT/bare-r$1.md"
    [ -n "$FIO" ] || return 0
    for p in ${POINTS//,/ }; do
        bs="${p%%:*}"
        "$FIO" --name=bound --filename="$fio_file" --size="${FILE_MIB}M" --rw=randwrite --bs="$bs" --ioengine=psync --invalidate=0 --fallocate=none \
            --numjobs=1 --time_based=1 --runtime="${MS}ms" --randrepeat=0 --output-format=json \
            > "$OUT/fio-r$1-$bs.json"
    done
}

for r in $(seq "$ROUNDS"); do
    echo "round $r/$ROUNDS"
    if [ "${PERF:-0}" = 1 ] && [ "$r" = 1 ]; then
        bench_run 1 IO_URING_DMABUF iud
        bench_run 1 POSIX:use_aio=true aio
    fi
    # Odd rounds: the plugin, AIO, the bare writers; even rounds: the bare writers, AIO, the plugin.
    if [ $((r % 2)) = 1 ]; then
        bench_run "$r" IO_URING_DMABUF,POSIX:use_aio=true ""; bound_run "$r"
    else
        bound_run "$r"; bench_run "$r" POSIX:use_aio=true,IO_URING_DMABUF ""
    fi
done
python3 - "$OUT" "$ROUNDS" "$POINTS" "$SOURCE" <<'PY'
import json, math, os, re, statistics, sys
sys.path.insert(0, "bench")
from write_bound import MiB, size_arg  # the sizes as the bare writer printed them
out, rounds, points, source = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
source_mib = size_arg(source) // MiB
rows = {}
for r in range(1, rounds + 1):
    log = open(f"{out}/bench-r{r}.log").read()
    for p in points:
        bs, n = p.split(":")
        m = re.search(rf"^WRITE {bs} x {n} round 1/1: \[A\] make_prepped ([\d.]+) GB/s .* ok \[B\] make_prepped ([\d.]+) GB/s .* ok$", log, re.M)
        if not m:
            sys.exit(f"no verified per-round line for WRITE {bs} x {n} in bench-r{r}.log")
        plugin, aio = (m[1], m[2]) if r % 2 else (m[2], m[1])
        fio_json = f"{out}/fio-r{r}-{bs}.json"
        fio = json.load(open(fio_json))["jobs"][0]["write"]["bw_bytes"] / 1e9 if os.path.exists(fio_json) else math.nan
        kib = size_arg(bs) >> 10
        bare = re.search(rf"^\| {kib} KiB \| 1 \| {source_mib} MiB \| ([\d.]+) \|$", open(f"{out}/bare-r{r}.md").read(), re.M)
        if not bare:
            sys.exit(f"no {kib} KiB row in bare-r{r}.md")
        rows.setdefault(p, []).append((float(plugin), float(aio), fio, float(bare[1])))
print("| WRITE, one file | IO_URING_DMABUF GB/s | POSIX AIO GB/s | bare pwrite, cold source | fio psync | plugin / bare | AIO / bare | plugin / fio | plugin / AIO |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for p, v in rows.items():
    a, c, f, b = (statistics.median(x[i] for x in v) for i in range(4))
    ratio = lambda i, j: statistics.median(x[i] / x[j] for x in v)
    num = lambda x, fmt: "-" if math.isnan(x) else format(x, fmt)
    bs, n = p.split(":")
    print(f"| {bs} x {n} | {a:.3f} | {c:.3f} | {b:.3f} | {num(f, '.3f')} | {ratio(0, 3):.2f} | {ratio(1, 3):.2f} | "
          f"{num(ratio(0, 2), '.2f')} | {ratio(0, 1):.2f}x |")
print(f"(medians of {rounds} rounds; the ratios are medians of each round's own ratio)")
PY
grep -h "consistency:" "$OUT"/bench-r*.log | sort | uniq -c
