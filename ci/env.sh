# Sourced by every ci/ script: where things live. No side effects beyond exports.
IUD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export IUD_ROOT
export IUD_VENV="${IUD_VENV:-$IUD_ROOT/.venv}"
export IUD_PY="$IUD_VENV/bin/python"
# NIXL wheel pinned by the project; cu12 runs without CUDA on the CPU machines.
export IUD_NIXL_WHEEL="${IUD_NIXL_WHEEL:-nixl-cu12==1.5.1}"
export IUD_TARGET="${CARGO_TARGET_DIR:-$IUD_ROOT/target}"
export IUD_PLUGIN_SO="$IUD_TARGET/release/libio_uring_dmabuf.so"
# The private plugin directory: our plugin under its NIXL name plus links to the wheel's own
# plugins, so one agent can run IO_URING_DMABUF and POSIX side by side.
export IUD_PLUGIN_DIR="$IUD_TARGET/nixl-plugins"
iud_nixl_libs() {
    "$IUD_PY" - <<'PY'
import importlib.util, os, sys
for mod in ("nixl_cu12", "nixl_cu13"):
    spec = importlib.util.find_spec(mod)
    if spec and spec.origin:
        site = os.path.dirname(os.path.dirname(spec.origin))
        libs = os.path.join(site, "." + mod + ".mesonpy.libs")
        if os.path.isdir(libs):
            print(libs); sys.exit(0)
sys.exit("no nixl_cu12/nixl_cu13 wheel in the venv")
PY
}
