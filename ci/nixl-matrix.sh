#!/usr/bin/env bash
# The NIXL release matrix (docs/nixl-releases.md): the plugin on every NIXL release it claims.
# For each release in plugin-manifest's nixl_versions_tested, in both wheels (cu12, cu13):
#   abi     ci/nixl_abi_probe.py: that wheel's binaries against nixl-headers/ and the built plugin
#   capi    tests/nixl_sys_roundtrip.rs through that release's libnixl_capi.so (nixl-sys stub-api)
#   python  the subset below of tests/python through that release's Python API
# each in its own venv, .venv-nixl/<wheel>-<release> (the two NIXL wheels with --no-deps, numpy,
# pytest), plugin folder laid out by ci/build.sh. A cell's venv (260-370 MB) is removed once its
# legs ran, so the matrix never holds more than one (all nine took 2.9 GB, and a CI run on a
# nearly full disk failed on ENOSPC); IUD_NIXL_MATRIX_KEEP=1 keeps them for local reruns.
# The default wheel (IUD_NIXL_WHEEL) gets only the abi leg: ci/test.sh's main stages run
# everything else on it.
# Then the refusal: under nixl-cu13 0.10.1 (a 31-slot engine vtable) the probe must report the
# mismatch and the plugin must refuse to load (tests/python/test_nixl_release.py).
#
# A release whose nixl_cuXX/_api.py imports torch at the top (1.3.x, 0.10.x) gets torch from the
# clients venv (ci/clients-setup.sh: torch 2.13, the CUDA 13 build, runs on CPU) through a .pth
# file naming a folder of links to that venv's packages, NIXL's own left out. With a CUDA 13
# torch the `nixl` package loads nixl_cu13 only, so such a release's cu12 wheel runs abi and capi.
#
# Env: IUD_NIXL_MATRIX="cu13-1.3.2 cu12-1.4.1" limits the cells; IUD_NIXL_REFUSED="cu13-0.10.1"
# (empty: none). Last line: "nixl matrix: N passed, M failed, K skipped" (ci/test.sh reads it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

SUBSET=(tests/python/test_nixl_release.py
        "tests/python/test_roundtrip.py::test_roundtrip"
        tests/python/test_errors.py tests/python/test_repost.py tests/python/test_release.py
        tests/python/test_init_fini.py tests/python/test_manifest.py tests/python/test_cleanup.py
        tests/python/test_threads.py tests/python/replay/test_replay_dynamo.py)
ROOT="$IUD_ROOT/.venv-nixl"
CLIENTS="${IUD_CLIENTS_VENV:-$IUD_ROOT/.venv-clients}"
LOGS="$IUD_TARGET/test-logs/nixl-matrix"
mkdir -p "$ROOT" "$LOGS"

releases="$(python3 -c 'import tomllib; print(" ".join(tomllib.load(open("plugin-manifest/IO_URING_DMABUF.toml", "rb"))["plugin"]["nixl_versions_tested"]))')"
cells="${IUD_NIXL_MATRIX:-$(for r in $releases; do echo "cu12-$r cu13-$r"; done)}"
refused="${IUD_NIXL_REFUSED-cu13-0.10.1}"
default="${IUD_NIXL_WHEEL#nixl-}"; default="${default/==/-}"   # cu12-1.5.1

pass=0 fail=0 skip=0
result() {  # cell leg status detail
    printf '%-12s %-6s %-4s %s\n' "$1" "$2" "$3" "$4" | tee -a "$LOGS/summary.txt"
    case "$3" in ok) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; *) skip=$((skip + 1)) ;; esac
}

# venv for one cell: .venv-nixl/<wheel>-<release>, made once (a stamp holds its spec).
make_venv() {  # wheel release
    local w="$1" r="$2" v="$ROOT/$1-$2" site spec
    spec="nixl==$r nixl-$w==$r | clients: $CLIENTS"
    if [ -f "$v/.iud-spec" ] && [ "$(cat "$v/.iud-spec")" = "$spec" ]; then return 0; fi
    rm -rf "$v"
    python3 -m venv "$v"
    site="$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$v/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps "nixl==$r" "nixl-$w==$r"
    if grep -q '^import torch' "$site/nixl_$w/_api.py"; then
        [ -x "$CLIENTS/bin/python" ] || { echo "no clients venv at $CLIENTS (ci/clients-setup.sh)" >&2; return 1; }
        local csite e view="$v/clients-view"
        csite="$("$CLIENTS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        mkdir -p "$view"
        for e in "$csite"/* ; do
            case "$(basename "$e")" in nixl*|pip|pip-*|setuptools*|_distutils_hack|*.pth|__pycache__) continue ;; esac
            ln -s "$e" "$view/"
        done
        echo "$view" > "$site/iud-clients-view.pth"
        touch "$v/.iud-needs-torch"
    else
        "$v/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir numpy pytest
    fi
    echo "$spec" > "$v/.iud-spec"
}

# The wheel's library folder inside a cell's venv.
cell_libs() { IUD_VENV="$1" bash -c 'source ci/env.sh; iud_nixl_libs'; }

run_cell() {  # cell ("cu13-1.3.2")
    local cell="$1" w="${1%%-*}" r="${1#*-}" v="$ROOT/$1" libs log rc line t0
    t0=$(date +%s)
    if ! make_venv "$w" "$r" > "$LOGS/$cell-setup.log" 2>&1; then
        result "$cell" setup FAIL "venv: $(tail -n 1 "$LOGS/$cell-setup.log")"; return
    fi
    libs="$(cell_libs "$v")"
    IUD_VENV="$v" bash ci/build.sh > "$LOGS/$cell-build.log" 2>&1 || { result "$cell" setup FAIL "plugin folder: see $LOGS/$cell-build.log"; return; }
    local pdir="$libs/iud-plugins"
    local ldpath="$libs:$(dirname "$libs")/nixl_$w.libs"

    rc=0; python3 ci/nixl_abi_probe.py "$libs" --plugin "$IUD_PLUGIN_SO" > "$LOGS/$cell-abi.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then result "$cell" abi ok "$(grep -c '^ok' "$LOGS/$cell-abi.log") checks"
    else result "$cell" abi FAIL "$(grep '^FAIL' "$LOGS/$cell-abi.log" | sed -n 1,2p | tr '\n' ' ')"; fi

    if [ "$cell" = "$default" ]; then
        result "$cell" capi skip "the main cargo stage runs it on the default wheel"
        result "$cell" python skip "the main pytest stage runs the whole suite on the default wheel"
        return
    fi

    # At debug level the plugin names the release it found: proof that this cell's
    # libnixl_capi.so (not another wheel's) ran the tests.
    rc=0
    LD_LIBRARY_PATH="$ldpath" NIXL_PLUGIN_DIR="$pdir" IUD_PLUGIN_DIR="$pdir" IO_URING_DMABUF_LOG=debug \
        "$CAPI_TEST" --test-threads=1 > "$LOGS/$cell-capi.log" 2>&1 || rc=$?
    line="$(grep -E '^test result: ' "$LOGS/$cell-capi.log" | tail -n 1 || true)"
    if [ "$rc" -ne 0 ]; then result "$cell" capi FAIL "exit $rc: ${line:-see $LOGS/$cell-capi.log}"
    elif ! grep -q "IO_URING_DMABUF: NIXL $r (" "$LOGS/$cell-capi.log"; then
        result "$cell" capi FAIL "the plugin did not report NIXL $r: $(grep -o 'IO_URING_DMABUF: NIXL [^ ]*' "$LOGS/$cell-capi.log" | sed -n 1p)"
    else result "$cell" capi ok "${line#test result: }"; fi

    if [ -f "$v/.iud-needs-torch" ] && [ "$w" != cu13 ]; then
        result "$cell" python skip "nixl $r imports torch; the only torch here is CUDA 13, with which the nixl package loads nixl_cu13"
        return
    fi
    rc=0
    LD_LIBRARY_PATH="$ldpath" NIXL_PLUGIN_DIR="$pdir" IUD_PLUGIN_DIR="$pdir" \
        "$v/bin/python" -m pytest -q -rs -p no:cacheprovider "${SUBSET[@]}" > "$LOGS/$cell-python.log" 2>&1 || rc=$?
    line="$(grep -E '^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed)' "$LOGS/$cell-python.log" | tail -n 1 || true)"
    local how=""; [ -f "$v/.iud-needs-torch" ] && how=" (torch from $CLIENTS)"
    if [ "$rc" -eq 0 ]; then result "$cell" python ok "${line}$how"
    else result "$cell" python FAIL "exit $rc: ${line:-see $LOGS/$cell-python.log}"; fi
    echo "  ($cell: $(( $(date +%s) - t0 )) s)"
}

run_refused() {  # cell: a release the plugin must refuse
    local cell="$1" w="${1%%-*}" r="${1#*-}" v="$ROOT/$1" libs rc pdir
    if ! make_venv "$w" "$r" > "$LOGS/$cell-setup.log" 2>&1; then
        result "$cell" setup FAIL "venv: $(tail -n 1 "$LOGS/$cell-setup.log")"; return
    fi
    libs="$(cell_libs "$v")"
    IUD_VENV="$v" bash ci/build.sh > "$LOGS/$cell-build.log" 2>&1 || { result "$cell" setup FAIL "plugin folder: see $LOGS/$cell-build.log"; return; }
    pdir="$libs/iud-plugins"
    rc=0; python3 ci/nixl_abi_probe.py "$libs" --plugin "$IUD_PLUGIN_SO" > "$LOGS/$cell-abi.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then result "$cell" abi ok "mismatch found, as expected: $(grep '^FAIL' "$LOGS/$cell-abi.log" | sed -n 2p | cut -c1-90)"
    else result "$cell" abi FAIL "the probe found no mismatch in a release with another vtable"; fi
    rc=0
    LD_LIBRARY_PATH="$libs:$(dirname "$libs")/nixl_$w.libs" NIXL_PLUGIN_DIR="$pdir" IUD_PLUGIN_DIR="$pdir" \
        "$v/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/test_nixl_release.py > "$LOGS/$cell-python.log" 2>&1 || rc=$?
    local line; line="$(grep -E '^=+ .*(passed|failed|error).* =+$|^[0-9]+ (passed|failed)' "$LOGS/$cell-python.log" | tail -n 1 || true)"
    if [ "$rc" -eq 0 ]; then result "$cell" refuse ok "$line"
    else result "$cell" refuse FAIL "exit $rc: ${line:-see $LOGS/$cell-python.log}"; fi
}

: > "$LOGS/summary.txt"
start=$(date +%s)
# The C API test binary, built once in this environment and then run per cell: cargo itself
# would rebuild for every cell, as clang-sys (bindgen) reruns when LD_LIBRARY_PATH changes.
CAPI_TEST="$(cargo test -q --release --test nixl_sys_roundtrip --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m.get("target", {}).get("name") == "nixl_sys_roundtrip":
        print(m["executable"])')"
[ -x "$CAPI_TEST" ] || { echo "ci/nixl-matrix.sh: could not build tests/nixl_sys_roundtrip.rs" >&2; exit 1; }
drop_venv() {  # cell
    [ "${IUD_NIXL_MATRIX_KEEP:-0}" = 1 ] || rm -rf "${ROOT:?}/$1"
}
for c in $cells; do run_cell "$c"; drop_venv "$c"; done
for c in $refused; do run_refused "$c"; drop_venv "$c"; done
echo "nixl matrix: $pass passed, $fail failed, $skip skipped in $(( $(date +%s) - start )) s (logs in $LOGS)"
[ "$fail" -eq 0 ]
