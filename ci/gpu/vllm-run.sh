#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, in steps that fit device calls:
#   bash ci/gpu/vllm-run.sh stash            keep the parts of .device/vllm carried by this call
#                                            (under $IUD_VLLM_HOME); unpack once all have come
#   bash ci/gpu/vllm-run.sh model-bg         make the random Llama-3.1-8B-shaped model in the
#                                            background (setsid: it outlives the call)
#   bash ci/gpu/vllm-run.sh engines V...     bench/vllm_connector_gpu.py's variants, in order
#   bash ci/gpu/vllm-run.sh report           the table, into $OUT/vllm-gpu.md
# Steps can follow each other in one call: `... stash model-bg`. Made by ci/gpu/vllm-prepare.sh
# here; everything stays on the machine while it is held (the device tool keeps it warm 30 s).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
H=${IUD_VLLM_HOME:-/root/iud-vllm}
OUT=${OUT:-/tmp/iud-vllm-out}
MODEL=$H/model
WORK=$H/work
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
    python3 "$SRC/bench/vllm_connector_gpu.py" report --work "$WORK" --out "$OUT/vllm-gpu.md" >/dev/null
    cp -f "$WORK/results.jsonl" "$OUT/" 2>/dev/null
    return "$r"
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
    report)
        python3 "$SRC/bench/vllm_connector_gpu.py" report --work "$WORK" --out "$OUT/vllm-gpu.md" || rc=1
        cp -f "$WORK/results.jsonl" "$OUT/" 2>/dev/null
        ;;
    *) echo "unknown step $step"; rc=2 ;;
    esac
done
exit "$rc"
