#!/usr/bin/env bash
# Builds the plugin (release) and lays out the private NIXL plugin directory (ci/env.sh):
#   $IUD_PLUGIN_DIR/libplugin_IO_URING_DMABUF.so  (a copy of target/release/libio_uring_dmabuf.so)
#   $IUD_PLUGIN_DIR/libplugin_<wheel plugin>.so    (symlinks to the wheel's own plugins)
# Expects ci/setup.sh to have run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"
cargo build --release --lib "$@"
IUD_PLUGIN_DIR="$(iud_plugin_dir)" || { echo "ci/build.sh: no NIXL wheel in $IUD_VENV; run ci/setup.sh first" >&2; exit 1; }
mkdir -p "$IUD_PLUGIN_DIR"
libs="$(iud_nixl_libs)"
for p in "$libs"/plugins/libplugin_*.so; do
    ln -sf "../plugins/$(basename "$p")" "$IUD_PLUGIN_DIR/$(basename "$p")"
done
cp -f "$IUD_PLUGIN_SO" "$IUD_PLUGIN_DIR/libplugin_IO_URING_DMABUF.so.tmp"
mv -f "$IUD_PLUGIN_DIR/libplugin_IO_URING_DMABUF.so.tmp" "$IUD_PLUGIN_DIR/libplugin_IO_URING_DMABUF.so"
echo "plugin: $IUD_PLUGIN_DIR/libplugin_IO_URING_DMABUF.so"
