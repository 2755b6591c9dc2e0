#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository root, after
# ci/gpu/prepare.sh laid out .device/gpu here: the doctor, the GPU tests and the VRAM benchmark,
# each writing its output under $OUT (the device tool brings that folder back).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
G=$PWD/.device/gpu
SITE=$G/site
LIBS=$SITE/.nixl_cu13.mesonpy.libs
OUT=${OUT:-/tmp/iud-gpu-out}
mkdir -p "$OUT" "$LIBS/iud-plugins"
for p in "$LIBS"/plugins/libplugin_*.so; do ln -sf "../plugins/$(basename "$p")" "$LIBS/iud-plugins/"; done
cp -f "$G/libplugin_IO_URING_DMABUF.so" "$LIBS/iud-plugins/"
export NIXL_PLUGIN_DIR=$LIBS/iud-plugins PYTHONPATH=$SITE PYTHONUNBUFFERED=1 IUD_DOCTOR=$G/iud-doctor
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export IO_URING_DMABUF_LOG=${IO_URING_DMABUF_LOG:-info}
cat "$G/BUILD" 2>/dev/null || echo "plugin build: unknown (no $G/BUILD; ci/gpu/stage-plugin.sh writes it)"
# Vulkan (gpu_provider=vulkan): the loader debs carried in .device/gpu/vk, unpacked into a
# private folder (not /) and found through LD_LIBRARY_PATH; NVIDIA's ICD where the driver mount
# has it. Without them the doctor reports Vulkan absent and tests/gpu/test_vulkan_gpu.py skips.
VK_ROOT=/tmp/iud-vk
if ls "$G"/vk/*.deb >/dev/null 2>&1; then
    rm -rf "$VK_ROOT"; mkdir -p "$VK_ROOT"
    for f in "$G"/vk/*.deb; do dpkg -x "$f" "$VK_ROOT"; done
    export LD_LIBRARY_PATH=$VK_ROOT/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
fi
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
step=${1:-all}
# cuFile (NIXL's GDS/GDS_MT, compared in the benchmark) needs udev data for the disk.
bash ci/gpu/udev-shim.sh /tmp /root 2>&1 | tee "$OUT/udev-shim.txt"
{
    date -u; uname -r; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
    df -h /tmp /root | cat
} 2>&1 | tee "$OUT/machine.txt"
if [ "$step" = all ] || [ "$step" = doctor ]; then
    "$G/iud-doctor" 2>&1 | tee "$OUT/doctor.txt"
fi
if [ "$step" = all ] || [ "$step" = tests ]; then
    timeout 900 python3 -m pytest -v -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
fi
if [ "$step" = vulkan ]; then
    # The Vulkan part alone (also inside `doctor` and `tests`).
    "$G/iud-doctor" 2>&1 | sed -n '/^vulkan:/,/^cuFile/p' | tee "$OUT/doctor-vulkan.txt"
    timeout 600 python3 -m pytest -v -s -rs -p no:cacheprovider tests/gpu/test_vulkan_gpu.py 2>&1 | tee "$OUT/gpu-vulkan.txt"
fi
if [ "$step" = all ] || [ "$step" = replay ]; then
    # The client replays' VRAM variants (tests/python/replay; they skip on CPU machines).
    IUD_PLUGIN_DIR=$LIBS/iud-plugins timeout 600 python3 -m pytest -v -p no:cacheprovider -rs tests/python/replay -k vram 2>&1 | tee "$OUT/gpu-replay.txt"
fi
if [ "$step" = remote ]; then
    # tests/remote on this machine: storage node and client in two network namespaces (root and
    # `ip netns`; else each case skips with the reason), client VRAM over UCX's CUDA transports.
    # No apt here (IUD_REMOTE_SETUP=0): `ip` from .device/remote (ci/gpu/remote-prepare.sh) where
    # the image has none, etcd from its etcd.xz where carried (else the etcd cases skip).
    R=$PWD/.device/remote
    export IUD_REMOTE_SETUP=0
    ip -V >/dev/null 2>&1 || export PATH=$R/bin:$PATH  # none, or one that does not run
    if [ -f "$R/etcd.xz" ] && [ -z "${IUD_ETCD:-}" ]; then
        python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
            "$R/etcd.xz" /tmp/iud-etcd && chmod +x /tmp/iud-etcd && export IUD_ETCD=/tmp/iud-etcd
    fi
    { echo "ip: $(command -v ip) ($(ip -V 2>&1))"; echo "etcd: ${IUD_ETCD:-none}"; } 2>&1 | tee "$OUT/gpu-remote.txt"
    timeout 300 python3 -m pytest -v -rs -p no:cacheprovider tests/remote/test_remote_vram.py \
        tests/remote/test_remote.py -k "vram or concurrently" 2>&1 | tee -a "$OUT/gpu-remote.txt"
fi
if [ "$step" = all ] || [ "$step" = bench ]; then
    # The KV and contiguous tables (the per-request table 0 has its own step, `per-request`: its
    # rounds would take this step's whole time budget).
    timeout 560 python3 bench/gpu_vram_bench.py --tables kv,contig --dir /tmp --timeout 30 2>"$OUT/bench-pagecache.log" | tee "$OUT/bench-pagecache.md"
    timeout 560 python3 bench/gpu_vram_bench.py --tables kv,contig --dir /root --direct --timeout 30 2>"$OUT/bench-direct.log" | tee "$OUT/bench-direct.md"
fi
if [ "$step" = per-request ]; then
    # Issue 26's per-request tables and prep profile (ci/gpu/per-request.sh; its steps may follow:
    # `bash ci/gpu/run.sh per-request write` for the buffered WRITE profile).
    OUT="$OUT" bash ci/gpu/per-request.sh "${@:2}"
fi
if [ "$step" = bench-args ]; then
    # One page-cache benchmark run with the given arguments (IUD_BENCH_ARGS), e.g. opt-in variants.
    # shellcheck disable=SC2086
    timeout 560 python3 bench/gpu_vram_bench.py $IUD_BENCH_ARGS 2>"$OUT/bench-args.log" | tee "$OUT/bench-args.md"
fi
if [ "$step" = all ] || [ "$step" = bench ] || [ "$step" = fio ]; then
    # What fio reaches on the same disk, for the O_DIRECT ">= 95 % of fio" target.
    timeout 300 python3 bench/fio_reference.py --fio "$G/fio/fio" --dir /root 2>&1 | tee "$OUT/fio-reference.md"
fi
if [ "$step" = load-probe ]; then
    # Where the vLLM connector's load job spends its time, and the bounds of the same machine
    # (bench/vllm_load_probe.py; its arguments follow the step's name).
    timeout 500 python3 bench/vllm_load_probe.py --dir /tmp/iud-probe "${@:2}" 2>"$OUT/load-probe.log" | tee "$OUT/load-probe.txt"
fi
