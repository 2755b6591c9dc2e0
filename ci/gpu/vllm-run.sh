#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, in steps that fit device calls:
#   bash ci/gpu/vllm-run.sh stash            keep the parts of .device/vllm carried by this call
#                                            (under $IUD_VLLM_HOME); unpack once all have come
#   bash ci/gpu/vllm-run.sh model-bg         make the random Llama-3.1-8B-shaped model in the
#                                            background (setsid: it outlives the call)
#   bash ci/gpu/vllm-run.sh engines V...     bench/vllm_connector_gpu.py's variants, in order
#   bash ci/gpu/vllm-run.sh report           the table, into $OUT/vllm-gpu[-LABEL].md
#   bash ci/gpu/vllm-run.sh probe            what the machine offers for block devices (loop,
#                                            md, tmpfs O_DIRECT), into $OUT/machine-probe.txt
#   bash ci/gpu/vllm-run.sh memdisk N GIB    N loop devices over files in a tmpfs (memory-speed
#                                            block devices, GIB in all), ext4 on each: later
#                                            steps work on the first (LABEL memN); with N > 1
#                                            the connector's slot files are striped over all
#                                            (slot_dirs: the machine has no md to stripe under
#                                            one file system) and fio reads all at once
#   bash ci/gpu/vllm-run.sh rawdisk N GIB    N loop devices over files in a tmpfs of their own,
#                                            no file system: the iud-dev variants put the
#                                            connector's slots on them (IUD_VLLM_DEVICES); kept
#                                            for later calls, made again with another N or GIB
#                                            (rawdisk-off removes them)
#   bash ci/gpu/vllm-run.sh disk             later steps work on the machine's disk again
#   bash ci/gpu/vllm-run.sh fio              fio's O_DIRECT reads in the work folder's file
#                                            system, into $OUT/fio-LABEL.md
#   bash ci/gpu/vllm-run.sh load-probe ARG...  bench/vllm_load_probe.py with these arguments in
#                                            the carried site, appended to $OUT/load-probe.txt
# Steps can follow each other in one call: `... stash model-bg`. Made by ci/gpu/vllm-prepare.sh
# here; everything stays on the machine while it is held (the device tool keeps it warm 30 s).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
H=${IUD_VLLM_HOME:-/root/iud-vllm}
OUT=${OUT:-/tmp/iud-vllm-out}
MODEL=$H/model
WORK=$H/work
LABEL=disk
# The package and benchmark to run: this checkout's, or a snapshot of a commit carried in an
# ignored folder (IUD_SRC=.device/snap), when the checkout may hold work in progress.
SRC=$(realpath "${IUD_SRC:-.}")
mkdir -p "$H/parts" "$OUT" "$WORK"

setup_env() {
    local libs=$H/site/.nixl_cu13.mesonpy.libs w
    # Wheels carried beside the parts (.device/extra), for a dependency found missing after the
    # parts were made: unpacked into the site.
    for w in .device/extra/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" "$H/site"; done
    mkdir -p "$libs/iud-plugins"
    for p in "$libs"/plugins/libplugin_*.so; do ln -sf "../plugins/$(basename "$p")" "$libs/iud-plugins/"; done
    [ -f "$H/.plugin-new" ] && cp -f "$H/.plugin-new" "$H/libplugin_IO_URING_DMABUF.so"
    cp -f "$H/libplugin_IO_URING_DMABUF.so" "$libs/iud-plugins/"
    export NIXL_PLUGIN_DIR=$libs/iud-plugins PYTHONPATH=$H/site:$SRC/python PYTHONUNBUFFERED=1
    # vLLM 0.34 imports `cutlass` (vllm-prepare.sh): its folder, which a .pth would name in a
    # site folder but not on PYTHONPATH.
    [ -d "$H/site/nvidia_cutlass_dsl/dsl_packages" ] && PYTHONPATH+=:$H/site/nvidia_cutlass_dsl/dsl_packages
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export IO_URING_DMABUF_LOG=${IO_URING_DMABUF_LOG:-info} PYTHONHASHSEED=0
    export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    # flashinfer is not carried: vLLM 0.33/0.34's sampler imports it unguarded unless this is 0
    # (vllm/v1/sample/ops/topk_topp_sampler.py, flashinfer_sampler_supported).
    export VLLM_USE_FLASHINFER_SAMPLER=0
    # cuFile (GDS_MT behind the connector) needs udev data for the disk.
    bash ci/gpu/udev-shim.sh /root >/dev/null 2>&1 || true
}

stash() {
    cp -f .device/vllm/part-* .device/vllm/SHA256SUMS "$H/parts/" 2>/dev/null
    # A plugin built after the parts were made (ci/gpu/prepare.sh), carried beside them: it
    # replaces the parts' copy.
    [ -f .device/gpu/libplugin_IO_URING_DMABUF.so ] && cp -f .device/gpu/libplugin_IO_URING_DMABUF.so "$H/.plugin-new"
    # fio for the fio step (ci/gpu/build-fio.sh), carried once in .device/tools and kept on
    # the machine.
    [ -x .device/tools/fio ] && cp -f .device/tools/fio "$H/fio"
    ls -la "$H/parts"
    [ -f "$H/.unpacked" ] && return 0
    local p
    for p in $(awk '{print $2}' "$H/parts/SHA256SUMS"); do
        [ -f "$H/parts/$p" ] || { echo "stash: $p not here yet"; return 0; }
    done
    (cd "$H/parts" && sha256sum -c SHA256SUMS) || return 1
    # No xz binary needed: Python's tarfile reads the xz stream.
    cat "$H"/parts/part-* | python3 -c 'import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$H" \
        && touch "$H/.unpacked" && rm -f "$H"/parts/part-* && du -sh "$H/site"
}

engines() {
    setup_env
    { date -u; nvidia-smi -L; df -h /root | tail -1; } 2>&1 | tee -a "$OUT/vllm-machine.txt"
    for _ in $(seq 1 150); do [ -f "$MODEL/.complete" ] && break; sleep 2; done
    tail -n 2 "$H/model.log" 2>/dev/null
    python3 "$SRC/bench/vllm_connector_gpu.py" engines --model "$MODEL" --work "$WORK" "$@" 2>&1 \
        | tee -a "$OUT/vllm-engines.log" | grep -E '^\[|^==|Error|error|Traceback' | cut -c1-600
    local r=${PIPESTATUS[0]}
    report >/dev/null
    return "$r"
}

# The table of the current work folder; tokens are checked against an earlier plain engine's
# (IUD_VLLM_REF, a results.jsonl carried in the checkout) when this folder has none.
report() {
    local ref=${IUD_VLLM_REF:-}
    python3 "$SRC/bench/vllm_connector_gpu.py" report --work "$WORK" --out "$OUT/vllm-gpu-$LABEL.md" \
        ${ref:+--ref "$ref"} || return 1
    cp -f "$WORK/results.jsonl" "$OUT/results-$LABEL.jsonl" 2>/dev/null
    return 0
}

probe() {
    {
        date -u; uname -r; nvidia-smi -L
        grep -E 'MemTotal|MemAvailable' /proc/meminfo; df -h /root | tail -1
        modprobe raid0 2>&1; modprobe loop 2>&1
        ls /sys/module | grep -E '^(md_mod|raid0|loop|dm_mod)$'
        cat /proc/mdstat 2>&1
        command -v mdadm losetup mkfs.ext4 dmsetup
        losetup --version
        mkdir -p /dev/shm/iud-dio && python3 -c 'import os, sys
try:
    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_RDWR | os.O_DIRECT)); print("tmpfs O_DIRECT: yes")
except OSError as e:
    print("tmpfs O_DIRECT:", e)' /dev/shm/iud-dio/f
        rm -rf /dev/shm/iud-dio
    } >"$OUT/machine-probe.txt" 2>&1
    cat "$OUT/machine-probe.txt"
}

# Removes every memory disk this script made (mounts, loop devices, tmpfs).
memdisk_off() {
    local m
    for m in /mnt/iud-mem*/d*; do mountpoint -q "$m" && umount "$m"; done
    for m in /mnt/iud-tmpfs/mem*.img; do
        [ -e "$m" ] && losetup -j "$m" | cut -d: -f1 | xargs -r -n1 losetup -d
    done
    mountpoint -q /mnt/iud-tmpfs && umount /mnt/iud-tmpfs
    return 0
}

rawdisk() {
    local n=$1 gib=$2 t=/mnt/iud-rawtmpfs dev i devs=()
    if [ "$(cat "$t/.shape" 2>/dev/null)" != "$n $gib" ]; then
        rawdisk_off
        mkdir -p "$t"
        mount -t tmpfs -o "size=$((gib + 1))g" tmpfs "$t" || return 1
        for i in $(seq 1 "$n"); do
            truncate -s "$((gib * 1024 / n))M" "$t/raw-$i.img"
            losetup --find --direct-io=on "$t/raw-$i.img" 2>/dev/null \
                || losetup --find "$t/raw-$i.img" || return 1
        done
        echo "$n $gib" >"$t/.shape"
        losetup -l | tee -a "$OUT/vllm-machine.txt"
    fi
    for i in $(seq 1 "$n"); do
        dev=$(losetup -j "$t/raw-$i.img" | cut -d: -f1 | sed -n 1p)
        [ -n "$dev" ] || return 1
        devs+=("$dev")
    done
    IUD_VLLM_DEVICES=$(IFS=:; echo "${devs[*]}")
    export IUD_VLLM_DEVICES
    echo "rawdisk: $IUD_VLLM_DEVICES"
}

rawdisk_off() {
    local m t=/mnt/iud-rawtmpfs
    for m in "$t"/raw-*.img; do
        [ -e "$m" ] && losetup -j "$m" | cut -d: -f1 | xargs -r -n1 losetup -d
    done
    mountpoint -q "$t" && umount "$t"
    unset IUD_VLLM_DEVICES
    return 0
}

memdisk() {
    local n=$1 gib=$2 t=/mnt/iud-tmpfs m dev i dirs=()
    LABEL=mem$n
    m=/mnt/iud-$LABEL
    WORK=$m/d1/work
    if ! mountpoint -q "$m/d1"; then
        memdisk_off
        mkdir -p "$t"
        mount -t tmpfs -o "size=$((gib + 1))g" tmpfs "$t" || return 1
        for i in $(seq 1 "$n"); do
            truncate -s "$((gib * 1024 / n))M" "$t/$LABEL-$i.img"
            # direct I/O to the backing file where tmpfs takes it (kernel 6.6+), else its page
            # cache
            dev=$(losetup --find --show --direct-io=on "$t/$LABEL-$i.img" 2>/dev/null) \
                || dev=$(losetup --find --show "$t/$LABEL-$i.img") || return 1
            mkdir -p "$m/d$i"
            mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev" \
                && mount "$dev" "$m/d$i" || return 1
        done
        { losetup -l; grep "$m" /proc/mounts; } 2>&1 | tee -a "$OUT/vllm-machine.txt"
    fi
    mkdir -p "$WORK"
    for i in $(seq 1 "$n"); do dirs+=("$m/d$i/slots"); done
    if [ "$n" -gt 1 ]; then
        # bench/vllm_connector_gpu.py gives these to the connector as slot_dirs; FIO_DIRS
        # makes fio read from every device at once
        IUD_VLLM_SLOT_DIRS=$(IFS=:; echo "${dirs[*]}")
        FIO_DIRS=$IUD_VLLM_SLOT_DIRS
        export IUD_VLLM_SLOT_DIRS
        mkdir -p "${dirs[@]}"
    else
        unset IUD_VLLM_SLOT_DIRS
        FIO_DIRS=$WORK
    fi
}

fio_here() {
    # reads only (what a load waits for), block sizes around the connector's slot reads
    timeout 200 python3 bench/fio_reference.py --fio "$H/fio" --dir "${FIO_DIRS:-$WORK}" --ops read \
        --sizes 1048576,2097152,8388608 --depths 16,64 --numjobs 1,4 --span $((2 << 30)) \
        2>&1 | tee "$OUT/fio-$LABEL.md"
}

load_probe() {
    setup_env
    echo "== load-probe $*" | tee -a "$OUT/load-probe.txt"
    timeout 300 python3 "$SRC/bench/vllm_load_probe.py" "$@" 2>>"$OUT/load-probe.log" \
        | tee -a "$OUT/load-probe.txt"
    return "${PIPESTATUS[0]}"
}

rc=0
while [ $# -gt 0 ]; do
    step=$1; shift
    case "$step" in
    stash) stash || rc=1 ;;
    model-bg)
        [ -f "$MODEL/.complete" ] || setsid nohup python3 "$SRC/bench/vllm_connector_gpu.py" model "$MODEL" \
            > "$H/model.log" 2>&1 < /dev/null &
        ;;
    engines) engines "$@" || rc=1; break ;;   # the rest of the arguments are variants
    report) report || rc=1 ;;
    load-probe) load_probe "$@" || rc=1; break ;;   # the rest of the arguments are the probe's
    probe) probe ;;
    memdisk) memdisk "$1" "$2" || { echo "memdisk $1 $2 failed"; rc=1; break; }; shift 2 ;;
    disk) LABEL=disk WORK=$H/work FIO_DIRS=$H/work; unset IUD_VLLM_SLOT_DIRS ;;
    memdisk-off) memdisk_off ;;
    rawdisk) rawdisk "$1" "$2" || { echo "rawdisk $1 $2 failed"; rc=1; break; }; shift 2 ;;
    rawdisk-off) rawdisk_off ;;
    fio) fio_here || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
    esac
done
exit "$rc"
