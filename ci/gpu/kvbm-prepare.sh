#!/usr/bin/env bash
# Prepares Dynamo KVBM 1.6.1 on its pinned NIXL for the GPU machine (cp312, no internet there):
# .device/kvbm (git-ignored via .device/) with
#   libplugin_IO_URING_DMABUF.so   the plugin, stripped
#   kvbm-1.6.1-*.whl               KVBM as PyPI ships it (abi3; unpacked there)
#   site.tgz                       nixl 1.3.2 + nixl-cu13 1.3.2 (cp312): the Python packages and the
#                                  library closure of libnixl, libnixl_build (KVBM links both), the
#                                  bindings and the UCX plugin with its transports
# Carry .device/kvbm with the working tree; ci/gpu/kvbm-run.sh runs there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=.device/kvbm
rm -rf "$out"; mkdir -p "$out/wheels" "$out/site"
cargo build --release --lib
strip -o "$out/libplugin_IO_URING_DMABUF.so" target/release/libio_uring_dmabuf.so
P=(-q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64)
python3 -m pip download "${P[@]}" -d "$out" kvbm==1.6.1
python3 -m pip download "${P[@]}" -d "$out/wheels" nixl-cu13==1.3.2 nixl==1.3.2
(cd "$out/site" && for w in ../wheels/*.whl; do unzip -q -o "$w"; done)
python3 - "$out/site" <<'PY'
import os, shutil, subprocess, sys
os.chdir(sys.argv[1])
L, B = ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs"
roots = [f"{L}/libnixl.so", f"{L}/libnixl_build.so", f"{L}/plugins/libplugin_UCX.so"]
roots += [os.path.join("nixl_cu13", f) for f in os.listdir("nixl_cu13") if f.endswith(".so")]
ucx = os.path.join(B, "ucx")
roots += [os.path.join(ucx, f) for f in os.listdir(ucx) if ".so" in f and "perftest" not in f
          and "_ib" not in f and "rdmacm" not in f] if os.path.isdir(ucx) else []
index = {}
for d in (L, B):
    for f in os.listdir(d):
        index.setdefault(f, os.path.join(d, f))
keep, todo = set(), list(roots)
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(f)
    for line in subprocess.run(["readelf", "-d", f], capture_output=True, text=True).stdout.splitlines():
        if "(NEEDED)" in line and (name := line.split("[")[1].rstrip("]")) in index:
            todo.append(index[name])
for d in (L, B):
    for root, _, files in os.walk(d):
        for f in files:
            if os.path.join(root, f) not in keep:
                os.remove(os.path.join(root, f))
for d in os.listdir("."):
    if d not in ("nixl", "nixl_cu13", L, B):
        shutil.rmtree(d) if os.path.isdir(d) else os.remove(d)
PY
find "$out/site" -name '*.so*' -type f -exec strip --strip-debug {} +
tar -C "$out/site" -czf "$out/site.tgz" .
rm -rf "$out/wheels" "$out/site"
du -sh "$out"; ls -la "$out"
