#!/usr/bin/env bash
# Issue 26 on the GPU machine, in one device call of at most ~8 minutes: what clients wait for,
# VRAM <-> page-cache file, IO_URING_DMABUF against GDS_MT alternated (bench/gpu_vram_bench.py
# --tables req, bench/per_request.py):
#   1. per request (make_prepped_xfer + post + DONE + release, and the repost figure), READ and
#      WRITE, 16 KiB x 8192 .. 2 MiB x 512 plus a contiguous READ per size, one process;
#   2. the same with 4 processes at once per backend (one agent and one file each), make_prepped;
#   3. the prep profile: make_prepped_xfer / initialize_xfer + release at 8192 descriptors.
# Every request is verified byte for byte. Needs .device/gpu from ci/gpu/prepare.sh (carried).
# Writes $OUT/per-request-<step>.md, $OUT/machine.txt and the steps' logs in
# $OUT/per-request-logs.tgz (the device tool brings back at most 8 files).
#   bash ci/gpu/per-request.sh            # steps 1proc 4proc prep (about 8 minutes)
#     (IUD_REQ_BACKENDS replaces their backends, IO_URING_DMABUF,GDS_MT)
#   bash ci/gpu/per-request.sh write      # the buffered WRITE profile (about 4 minutes)
#   bash ci/gpu/per-request.sh write-probe  # larger staged WRITEs: workers, buffers, pieces (4 min)
#   bash ci/gpu/per-request.sh slots        # the vLLM connector's slot layout (about 2 minutes)
#   bash ci/gpu/per-request.sh write-bound  # buffered-write bound of 1 and 4 files, no NIXL (1 min)
#   bash ci/gpu/per-request.sh huge-pages   # a worker's copy with staging memory on 4 KiB or huge
#     pages, bench/staging_copy_bound.c, no NIXL (1 min)
#     (IUD_PROBE_BACKENDS, IUD_PROBE_POINTS, IUD_PROBE_OPS=READ, IUD_PROBE_PROCS=4 and
#     IUD_PROBE_PROFILE=prep replace write-probe's backends, points, op, process count and
#     profile; IUD_PROBE_BACKENDS, IUD_PROBE_POINTS, IUD_PROBE_SECONDS, IUD_PROBE_ROUNDS and
#     IUD_PROBE_MEMORY=dram read-probe's backends, points, summed request seconds per
#     measurement, rounds and memory)
#   bash ci/gpu/per-request.sh read-probe   # small scattered READs beside contiguous ones, with
#     12, 14 and 16 page-cache workers and the plugin's own prepXfer time in the log (3 minutes)
#   bash ci/gpu/per-request.sh read-bound   # page-cache random reads by 8, 9 and 16 threads, fio, and by
#     1, 14 and 16 threads into staging-like memory, bench/pread_bound.c (1 min)
#   bash ci/gpu/per-request.sh latency      # 8-128 MiB READs: the per-request timeline (first / last
#     I/O, first / last copy; bench/profile_timeline.py) with page_cache_spin_us 0, 50, 200 (3 min)
#
# IUD_GPU_DRYRUN=1 runs the same three steps here, on the CPU machine, with the project's .venv
# and plugin (ci/build.sh), host memory (--memory dram), POSIX in place of GDS_MT and tiny points:
# a check of this script's command lines and the benchmark's code paths, not a measurement.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/iud-per-request-out}
mkdir -p "$OUT"
if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
    source ci/env.sh
    libs="$(iud_nixl_libs)"
    export LD_LIBRARY_PATH="$libs:$(dirname "$libs")/nixl_cu12.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export NIXL_PLUGIN_DIR=$IUD_PLUGIN_DIR
    PY=$IUD_PY
    common=(--memory dram --req_backends IO_URING_DMABUF,POSIX+copy --dir "${IUD_DRYRUN_DIR:-/tmp}")
    small=(--req_points 16K:64,64K:32,2M:4 --kv_region_mib 16 --req_seconds 0.02 --kv_rounds 2)
    prep=(--prep_descs 1024 --prep_seconds 0.02 --kv_rounds 2)
    budget=(120 120 60)
else
    G=$PWD/.device/gpu
    SITE=$G/site
    LIBS=$SITE/.nixl_cu13.mesonpy.libs
    [ -f "$G/libplugin_IO_URING_DMABUF.so" ] || { echo "ci/gpu/per-request.sh: no $G (run ci/gpu/prepare.sh and carry .device/gpu)" >&2; exit 2; }
    mkdir -p "$LIBS/iud-plugins"
    for p in "$LIBS"/plugins/libplugin_*.so; do ln -sf "../plugins/$(basename "$p")" "$LIBS/iud-plugins/"; done
    cp -f "$G/libplugin_IO_URING_DMABUF.so" "$LIBS/iud-plugins/"
    export NIXL_PLUGIN_DIR=$LIBS/iud-plugins PYTHONPATH=$SITE PYTHONUNBUFFERED=1
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export IO_URING_DMABUF_LOG=${IO_URING_DMABUF_LOG:-info}
    PY=python3
    # cuFile (GDS_MT) needs udev data for the disk.
    bash ci/gpu/udev-shim.sh /tmp /root > "$OUT/udev-shim.txt" 2>&1
    common=(--req_backends "${IUD_REQ_BACKENDS:-IO_URING_DMABUF,GDS_MT}" --dir /tmp)
    small=(--req_seconds 0.2 --kv_rounds 3)
    prep=(--prep_descs 8192 --prep_seconds 0.3 --kv_rounds 3)
    budget=(220 170 70)
fi
{
    date -u; uname -r; nproc; free -g | sed -n 1,2p
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())' 2>/dev/null || echo "no torch"
    cat "${G:-.}/BUILD" 2>/dev/null || echo "plugin build: unknown (no .device/gpu/BUILD; ci/gpu/stage-plugin.sh writes it)"
} 2>&1 | tee "$OUT/machine.txt"
rc=0
step() {  # name budget_s args...: one benchmark run, its table on stdout and in $OUT/NAME.md
    local name=$1 b=$2; shift 2
    echo "== $name ($(date -u +%T)): gpu_vram_bench.py $*"
    timeout $((b + 60)) "$PY" bench/gpu_vram_bench.py "${common[@]}" --budget_s "$b" "$@" \
        > "$OUT/$name.md" 2> "$OUT/$name.log" || { echo "$name: exit $?"; rc=1; }
    grep -E '^(\||## |- )' "$OUT/$name.md" | cut -c1-400
}
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(1proc 4proc prep)
for st in "${steps[@]}"; do
    case "$st" in
    1proc)  # make_prepped per request and the repost figure (initialize_xfer's prep is in `prep`)
        step per-request-1proc "${budget[0]}" --tables req --req_modes prepped,repost "${small[@]}" ;;
    4proc)  # 4 processes at once per backend, each its own agent and file; make_prepped only
        step per-request-4proc "${budget[1]}" --tables req --req_processes 4 --req_no_contig "${small[@]}" --kv_rounds 2 ;;
    prep)
        step per-request-prep "${budget[2]}" --tables prep "${prep[@]}" ;;
    write)  # the buffered WRITE profile (about 4 minutes: its own device call): writers per file
        # (auto = 2, 1, 4, no limit) against GDS_MT, per request, on the usual file (large
        # page-cache folios) and on one prefilled 4 KiB at a time (small folios)
        wv=(--tables req --req_ops WRITE --req_no_contig --req_modes prepped)
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            wv+=(--req_backends IO_URING_DMABUF,POSIX+copy,IUD-fw1,IUD-fw4,IUD-fw0 "${small[@]}"); b=60
        else
            wv+=(--req_backends IO_URING_DMABUF,GDS_MT,IUD-fw1,IUD-fw4,IUD-fw0 --req_points 64K:4096,256K:2048,2M:512
                 --req_seconds 0.2 --kv_rounds 2); b=110
        fi
        step per-request-write-large-folios "$b" "${wv[@]}"
        step per-request-write-small-folios "$b" "${wv[@]}" --req_prefill_write 4096 ;;
    write-probe)  # where large staged WRITEs lose to GDS_MT (about 4 minutes): more workers on
        # one file; a small staging pool (its buffers stay in the CPU cache between the device's
        # copy into them and the write out of them, as GDS_MT's bounce buffers may); smaller
        # write pieces; IO_URING_DMABUF_PROFILE=1 logs each request's split into the step's log
        wv=(--tables req --req_ops ${IUD_PROBE_OPS:-WRITE} --req_no_contig --req_modes prepped)
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            wv+=(--req_backends IO_URING_DMABUF,POSIX+copy,IUD-pct16fw0 "${small[@]}"); b=60
        else
            wv+=(--req_backends ${IUD_PROBE_BACKENDS:-IO_URING_DMABUF,GDS_MT,IUD-pct16fw0,IUD-stage-512Kx16,IUD-stage-1Mx16,IUD-swp512K}
                 --req_points ${IUD_PROBE_POINTS:-256K:2048,2M:512} --req_seconds 0.2 --kv_rounds 2
                 --req_processes ${IUD_PROBE_PROCS:-1}); b=180
        fi
        IO_URING_DMABUF_PROFILE=${IUD_PROBE_PROFILE:-1} step per-request-write-probe "$b" "${wv[@]}" ;;
    read-probe)  # issue 26 item 4: what bounds small scattered READs (about 3 minutes): the
        # storage stage's threads (IUD-pctN: N page-cache workers instead of 8), and the
        # plugin's own share of make_prepped_xfer (the log's "profile: prepXfer" lines)
        rv=(--tables req --req_ops READ --req_modes prepped)
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            rv+=(--req_backends IO_URING_DMABUF,POSIX+copy,IUD-pct16 "${small[@]}"); b=60
        else
            rv+=(--req_backends ${IUD_PROBE_BACKENDS:-IO_URING_DMABUF,IUD-pct12,IUD-pct14,IUD-pct16,GDS_MT}
                 --req_points ${IUD_PROBE_POINTS:-16K:8192,32K:8192,64K:4096,256K:2048}
                 --req_seconds ${IUD_PROBE_SECONDS:-0.2} --kv_rounds ${IUD_PROBE_ROUNDS:-3}
                 ${IUD_PROBE_MEMORY:+--memory $IUD_PROBE_MEMORY}); b=240
        fi
        # (IUD_PROBE_PROFILE=1 also times every I/O, which slows the requests themselves)
        IO_URING_DMABUF_PROFILE=${IUD_PROBE_PROFILE:-prep} step per-request-read-probe "$b" "${rv[@]}" ;;
    read-bound)  # the storage stage alone: random reads of a cached file by 8, 9, 16 threads
        echo "== read-bound ($(date -u +%T)): bench/fio_reference.py --buffered"
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            echo "read-bound: skipped in the dry run (needs fio; the GPU machine carries it in .device/gpu/fio)"
        else
            "$PY" bench/fio_reference.py --fio "$G/fio/fio" --dir /tmp --buffered --jobs 8,9,16 \
                --sizes 16384,32768,65536 --seconds 2 --span 2147483648 | tee "$OUT/read-bound.md" || rc=1
            # The same reads into a 4 MiB ring of memory per thread (as the workers fill staging
            # buffers) by 1, 14 (the default workers on 16 CPUs) and 16 threads, random offsets
            # and one sequential 2 MiB reference.
            dd if=/dev/urandom of=/tmp/iud-pread-bound bs=1M count=2048 status=none && cat /tmp/iud-pread-bound > /dev/null
            for t in 1 14 16; do
                for p in 16384 32768 65536 2097152; do
                    "$G/pread_bound" /tmp/iud-pread-bound "$t" "$p" $((t * 64 << 20)) $((4 << 20)) 1 1 5
                done
                "$G/pread_bound" /tmp/iud-pread-bound "$t" 2097152 $((t * 64 << 20)) $((4 << 20)) 0 1 5
            done | tee -a "$OUT/read-bound.md" || rc=1
            rm -f /tmp/iud-pread-bound
        fi ;;
    slots)  # the vLLM connector's layout (about 2 minutes): 64 pages of 32 KiB per block,
        # scattered in VRAM, end to end in the file; IUD-maxio32K caps runs at one page (the
        # plugin before staged runs). The scattered rows beside them have no two pages adjacent.
        sv=(--tables req --req_ops READ,WRITE --req_no_contig --req_modes prepped --req_slot_pages 64)
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            sv+=(--req_backends IO_URING_DMABUF,POSIX+copy,IUD-maxio32K --req_points 32K:128 --kv_region_mib 16
                 --req_seconds 0.02 --kv_rounds 2 --req_slot_pages 16); b=60
        else
            sv+=(--req_backends IO_URING_DMABUF,GDS_MT,IUD-maxio32K --req_points 32K:8192 --req_seconds 0.2 --kv_rounds 3); b=150
        fi
        step per-request-slots "$b" "${sv[@]}" ;;
    latency)  # where a mid-size request's fixed time goes (about 3 minutes): 8-128 MiB READs with
        # the per-request timeline (IO_URING_DMABUF_PROFILE=1) and idle workers watching for jobs
        lv=(--tables req --req_ops READ --req_modes prepped)
        if [ "${IUD_GPU_DRYRUN:-0}" = 1 ]; then
            lv+=(--req_backends IO_URING_DMABUF,IUD-spin200 "${small[@]}"); b=60
        else
            lv+=(--req_backends ${IUD_PROBE_BACKENDS:-IO_URING_DMABUF,IUD-spin50,IUD-spin200}
                 --req_points ${IUD_PROBE_POINTS:-64K:128,1M:32,4M:32} --req_seconds 0.2 --kv_rounds 3); b=200
        fi
        IO_URING_DMABUF_LOG=info IO_URING_DMABUF_PROFILE=1 step per-request-latency "$b" "${lv[@]}"
        "$PY" bench/profile_timeline.py "$OUT/per-request-latency.log" | tee "$OUT/latency-timeline.md" || rc=1 ;;
    huge-pages)  # one worker's copy out of and into staging-like memory, 4 KiB pages against
        # transparent huge pages (the staging pool's mapping since 3b583d0), no NIXL (1 minute)
        echo "== huge-pages ($(date -u +%T)): bench/staging_copy_bound.c"
        scb=${G:-$OUT}/staging_copy_bound
        [ -x "$scb" ] || gcc -O2 -o "$scb" bench/staging_copy_bound.c || rc=1
        f=${IUD_DRYRUN_DIR:-/tmp}/iud-staging-copy
        mkdir -p "$(dirname "$f")"
        dry=$([ "${IUD_GPU_DRYRUN:-0}" = 1 ] && echo 1 || echo 0)
        dd if=/dev/urandom of="$f" bs=1M count=$([ "$dry" = 1 ] && echo 64 || echo 1024) status=none && sync
        cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1 | sed 's/^/THP: /' | tee "$OUT/huge-pages.md"
        for op in write read; do
            for p in 262144 2097152; do
                for w in 8388608 67108864; do
                    "$scb" "$f" "$op" "$p" "$w" "$([ "$dry" = 1 ] && echo 1 || echo 3)" "$([ "$dry" = 1 ] && echo 0.05 || echo 1)" || rc=1
                done
            done
        done | tee -a "$OUT/huge-pages.md"
        rm -f "$f" "$OUT/staging_copy_bound" ;;
    write-bound)  # one file's and four files' buffered-write bound, no NIXL (under 2 minutes):
        # files as prefilled (dirty), then written back (fdatasync), as per_request.py leaves its
        # file after its first WRITE point
        echo "== write-bound ($(date -u +%T)): bench/write_bound.py"
        : > "$OUT/write-bound.md"
        for wb in "" --writeback; do
            "$PY" bench/write_bound.py --dir "${IUD_DRYRUN_DIR:-/tmp}" --blocks 64K,256K,2M --files 1,4 --footprints 8M $wb \
                --seconds "$([ "${IUD_GPU_DRYRUN:-0}" = 1 ] && echo 0.05 || echo 0.5)" \
                --file_mib "$([ "${IUD_GPU_DRYRUN:-0}" = 1 ] && echo 64 || echo 1024)" | tee -a "$OUT/write-bound.md" || rc=1
        done ;;
    *) echo "ci/gpu/per-request.sh: unknown step $st (1proc, 4proc, prep, write, write-probe, read-probe, read-bound, latency, slots, write-bound, huge-pages)" >&2; rc=2 ;;
    esac
done
# The device tool brings back at most 8 files: the tables stay, the logs go into one archive.
(cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf per-request-logs.tgz ./*.log && rm -f ./*.log)
echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "total: exit $rc ($(date -u +%T))"
exit "$rc"
