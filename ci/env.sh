# Sourced by every ci/ script: where things live. No side effects beyond exports.
IUD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export IUD_ROOT
export IUD_VENV="${IUD_VENV:-$IUD_ROOT/.venv}"
export IUD_PY="$IUD_VENV/bin/python"
# NIXL wheel pinned by the project; cu12 runs without CUDA on the CPU machines.
export IUD_NIXL_WHEEL="${IUD_NIXL_WHEEL:-nixl-cu12==1.5.1}"
# matplotlib for the benchmark's plot (ci/bench.sh) and the tests of that plot (ci/test.sh).
export IUD_MATPLOTLIB="${IUD_MATPLOTLIB:-matplotlib==3.11.2}"
export IUD_TARGET="${CARGO_TARGET_DIR:-$IUD_ROOT/target}"
export IUD_PLUGIN_SO="$IUD_TARGET/release/libio_uring_dmabuf.so"
# The private plugin directory: our plugin under its NIXL name plus links to the wheel's own
# plugins, so one agent can run IO_URING_DMABUF and POSIX side by side. It must sit directly in
# the wheel's library folder: the wheel's plugins find their libraries through RPATH $ORIGIN/..,
# and $ORIGIN is the folder of the path NIXL dlopens (the link), not of the link's target.
# Empty until ci/setup.sh has installed the wheel; source this file again after setup.
iud_plugin_dir() {
    local d
    for d in "$IUD_VENV"/lib/python3*/site-packages/.nixl_cu1[23].mesonpy.libs; do
        if [ -d "$d" ]; then echo "$d/iud-plugins"; return 0; fi
    done
    return 1
}
IUD_PLUGIN_DIR="$(iud_plugin_dir || true)"
export IUD_PLUGIN_DIR
# Installs $IUD_MATPLOTLIB into the venv unless matplotlib imports already (a side effect only
# when called: ci/bench.sh and ci/test.sh call it after ci/setup.sh).
iud_ensure_matplotlib() {
    if ! "$IUD_PY" -c 'import matplotlib' 2>/dev/null; then
        echo "${1:-ci}: installing $IUD_MATPLOTLIB into $IUD_VENV (for results.png)"
        "$IUD_PY" -m pip install -q --disable-pip-version-check "$IUD_MATPLOTLIB"
    fi
}
# Debian packages for the ci/ scripts, as root or through sudo: the package lists are updated
# once per script run. Usage: iud_apt_install WHO [apt-get option...] PACKAGE...
iud_sudo() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
iud_apt_update() {
    if [ -z "${IUD_APT_UPDATED:-}" ]; then
        iud_sudo apt-get update -qq
        IUD_APT_UPDATED=1
    fi
}
iud_apt_install() {
    local who=$1 a opts=() pkgs=()
    shift
    for a in "$@"; do if [[ $a == -* ]]; then opts+=("$a"); else pkgs+=("$a"); fi; done
    echo "$who: installing ${pkgs[*]} (apt-get)"
    iud_apt_update
    # apt's notice about apt-utils is noise on a machine without it; real errors still show.
    iud_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${opts[@]}" "${pkgs[@]}" \
        >/dev/null 2> >(grep -v '^debconf: delaying package configuration' >&2)
}
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
