#!/usr/bin/env bash
# Runs on the GPU machine (after ci/gpu/kvbm-prepare.sh here; carry .device/kvbm): KVBM 1.6.1 on
# nixl-cu13 1.3.2 with this plugin installed as GDS_MT and as POSIX (two copies: separate
# instances, as the installer makes them) next to NIXL's own UCX, then ci/gpu/kvbm-disk-tier.py
# for the variants named (default: both; each at most 280 s, so both fit one 10-minute device
# call). Results: $OUT/kvbm-<variant>.json and .log.
#   OUT=$OUT bash ci/gpu/kvbm-run.sh [disk-only] [host-disk]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
K=$PWD/.device/kvbm
S=/tmp/iud-kvbm-site
OUT=${OUT:-/tmp/iud-kvbm-out}
rm -rf "$S"; mkdir -p "$S" "$OUT"
tar -C "$S" -xzf "$K/site.tgz"
python3 -m zipfile -e "$(ls "$K"/kvbm-1.6.1-*.whl)" "$S"  # the GPU machine has no unzip
LIBS=$S/.nixl_cu13.mesonpy.libs
mkdir -p "$LIBS/kvbm-plugins"
ln -sf ../plugins/libplugin_UCX.so "$LIBS/kvbm-plugins/"
for name in GDS_MT POSIX; do cp -f "$K/libplugin_IO_URING_DMABUF.so" "$LIBS/kvbm-plugins/libplugin_$name.so"; done
export NIXL_PLUGIN_DIR=$LIBS/kvbm-plugins PYTHONPATH=$S PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export IO_URING_DMABUF_LOG=${IO_URING_DMABUF_LOG:-info} NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-INFO}
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } 2>&1 | tee "$OUT/kvbm-machine.txt"
rc=0
variants=("$@"); [ ${#variants[@]} -gt 0 ] || variants=(disk-only host-disk)
for variant in "${variants[@]}"; do
    timeout 280 python3 ci/gpu/kvbm-disk-tier.py --variant "$variant" --out "$OUT/kvbm-$variant.json" \
        > "$OUT/kvbm-$variant.log" 2>&1 || rc=1
    grep -E '^(ok  |FAIL|== )' "$OUT/kvbm-$variant.log"
    grep -E 'serving as|NIXL version' "$OUT/kvbm-$variant.log" | sed -n 1,4p
done
exit "$rc"
