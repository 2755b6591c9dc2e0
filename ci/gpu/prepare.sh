#!/usr/bin/env bash
# Prepares what the GPU machine needs (it has no Rust and no internet): the plugin and the doctor
# built here, and the parts of the nixl-cu13 cp312 wheel that the GPU tests and benchmark load
# (the whole wheel is over the 64 MiB carry limit). Output: .device/gpu (git-ignored), carried
# by the device tool; ci/gpu/run.sh runs there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=.device/gpu
rm -rf "$out"; mkdir -p "$out/wheels" "$out/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$out/wheels" nixl-cu13==1.5.1 nixl==1.5.1
(cd "$out/site" && for w in ../wheels/*.whl; do unzip -q -o "$w"; done)
python3 - "$out/site" <<'PY'
# Keep the Python packages and the shared-library closure of libnixl, the bindings and the
# plugins the GPU runs compare against, and UCX; drop the rest (object stores, EP kernels).
import os, shutil, subprocess, sys
site = sys.argv[1]
os.chdir(site)
roots = [".nixl_cu13.mesonpy.libs/libnixl.so", ".nixl_cu13.mesonpy.libs/libnixl_capi.so",
         "nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so", "nixl_cu13/_utils.cpython-312-x86_64-linux-gnu.so"]
roots += [f".nixl_cu13.mesonpy.libs/plugins/libplugin_{p}.so" for p in ("POSIX", "GDS", "GDS_MT", "UCX")]
# UCX loads its transports with dlopen (no NEEDED entry): keep them, less the perftest modules (7 MB),
# for tests/remote (the storage node over UCX, client VRAM through UCX's CUDA transports).
# The InfiniBand/EFA transports are left out too: the GPU machine has no RDMA device, and they
# pull in libibverbs, libmlx5 and libnl (18 MB) that would push the carry over 64 MiB.
roots += [os.path.join("nixl_cu13.libs/ucx", f) for f in os.listdir("nixl_cu13.libs/ucx")
          if ".so" in f and "perftest" not in f and "_ib" not in f and "rdmacm" not in f] if os.path.isdir("nixl_cu13.libs/ucx") else []
index = {}
for d in (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"):
    for f in os.listdir(d):
        index.setdefault(f, os.path.join(d, f))
keep, todo = set(), list(roots)
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(f)
    for line in subprocess.run(["readelf", "-d", f], capture_output=True, text=True).stdout.splitlines():
        if "(NEEDED)" in line:
            name = line.split("[")[1].rstrip("]")
            if name in index:
                todo.append(index[name])
for d in (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"):
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            if p not in keep:
                os.remove(p)
for d in os.listdir("."):
    if d not in ("nixl", "nixl_cu13", "nixl_meta_utils.py", ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"):
        shutil.rmtree(d) if os.path.isdir(d) else os.remove(d)
PY
rm -rf "$out/wheels"
# Debug sections are dead weight on the GPU machine (and some of the wheel's libraries carry them).
find "$out/site" -name '*.so*' -type f -exec strip --strip-debug {} +
# fio for the O_DIRECT reference (the GPU machine has none).
bash ci/gpu/build-fio.sh "$out/fio/fio"
# The storage stage's bound without the plugin (per-request.sh read-bound).
gcc -O2 -static -pthread -o "$out/pread_bound" bench/pread_bound.c
# A worker's copy with staging memory on 4 KiB or huge pages (per-request.sh huge-pages).
gcc -O2 -static -o "$out/staging_copy_bound" bench/staging_copy_bound.c
# The Vulkan loader and GLVND (NVIDIA's Vulkan ICD library needs libGLdispatch) for
# gpu_provider=vulkan there: the amd64 debs the device README names (under 1 MiB), unpacked by
# ci/gpu/run.sh into a private folder.
mkdir -p "$out/vk"
vk_debs="libvulkan1 libglvnd0 libglx0 libegl1 libgl1 libopengl0 libgles2"
if [ "$(dpkg --print-architecture)" = amd64 ]; then
    # apt-get download needs package lists: a fresh machine has none until apt-get update.
    apt-cache show libvulkan1 >/dev/null 2>&1 || apt-get update -qq
    (cd "$out/vk" && apt-get download -q $vk_debs 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
else
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    mkdir -p /tmp/amd64/partial && apt-get $o update -qq
    (cd "$out/vk" && apt-get $o download -q $vk_debs)
fi
ls "$out"/vk/libvulkan1_*.deb >/dev/null
# The plugin and the doctor, with the build identity in $out/BUILD.
bash ci/gpu/stage-plugin.sh
du -sh "$out"
