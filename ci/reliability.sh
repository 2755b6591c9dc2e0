#!/usr/bin/env bash
# Reliability checks of the IO_URING_DMABUF plugin (docs/reliability.md): fault injection, integrity at
# volume, concurrency, leaks, sanitizers and fuzzing.
#
#   bash ci/reliability.sh            # short versions (CI size, a few minutes)
#   bash ci/reliability.sh --quick    # only the Python suites (fault matrix, leaks, stress) + soak
#   bash ci/reliability.sh --soak     # the long versions (hours): 100 GiB / 10^6 descriptors soak,
#                                     # 10^5 leak cycles, 10-minute stress and fuzz targets
#
# Stages (each runs even if an earlier one failed; exit status non-zero if any failed):
#   pytest   tests/reliability (fault matrix, leak cycles, 8-thread stress in sync NONE and RW)
#   soak     tests/reliability/soak.py through real NIXL, every byte verified
#   asan     tests/asan/driver.cpp (ASan+UBSan) against the release plugin and against a plugin
#            whose C++ shim is built with ASan (target/asan-plugin); its concreg phase is issue
#            16's pattern (4 threads registering and transferring at once) on the engine itself
#   valgrind the same driver without sanitizers under memcheck, against the release plugin
#   tsan     tests/reliability/tsan (8-thread engine stress) with -Zsanitizer=thread (nightly)
#   fuzz     fuzz/ targets params, path_meta, plan (cargo-fuzz, nightly)
# Where nightly Rust exists, the nightly's rust-src (tsan) and cargo-fuzz (fuzz) are installed by the
# stage itself; a tool still missing (nightly, valgrind, or an install that failed) makes its stage
# print "SKIP: <reason>" and report SKIP with that reason, never pass.
# Environment: IUD_REL_STAGES="pytest soak ..." selects stages; IUD_REL_FUZZ_S overrides the
# seconds per fuzz target; IUD_REL_OUT (default
# target/reliability) receives the JSON figures.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

mode=short
case "${1:-}" in
    --soak) mode=soak ;;
    --quick) mode=quick ;;
    ""|--ci) mode=short ;;
    *) echo "usage: $0 [--quick|--soak]" >&2; exit 2 ;;
esac

if [ "$mode" = soak ]; then
    SOAK_ARGS="--gib 100 --descs 1000000"; LEAK_CYCLES=100000; STRESS_S=600
    FUZZ_S=600; DRIVER_CYCLES=100000; DRIVER_ITERS=400; TSAN_ITERS=2000; VG_CYCLES=2000
    CONCREG_REPS=1000
else
    SOAK_ARGS="--gib 2 --descs 20000 --file-mib 512 --mem-mib 128"; LEAK_CYCLES=10000; STRESS_S=5
    FUZZ_S=60; DRIVER_CYCLES=10000; DRIVER_ITERS=40; TSAN_ITERS=100; VG_CYCLES=200
    CONCREG_REPS=20
fi
FUZZ_S="${IUD_REL_FUZZ_S:-$FUZZ_S}"
default_stages="pytest soak asan valgrind tsan fuzz"
[ "$mode" = quick ] && default_stages="pytest soak"
stages="${IUD_REL_STAGES:-$default_stages}"

export IUD_REL_OUT="${IUD_REL_OUT:-$IUD_TARGET/reliability}"
mkdir -p "$IUD_REL_OUT"
work="$(mktemp -d /var/tmp/iud-reliability.XXXXXX)"
trap 'rm -rf "$work"' EXIT

if [ ! -x "$IUD_PY" ] || [ -z "$IUD_PLUGIN_DIR" ]; then bash ci/setup.sh; source ci/env.sh; fi
bash ci/build.sh >/dev/null
export NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"

declare -A result
skip_reason=""
run_stage() {  # name, command...
    local name="$1"; shift
    echo "== $name: $*"
    local t0=$SECONDS
    skip_reason=""
    "$@"
    local rc=$?
    if [ "$rc" -eq 0 ]; then result[$name]="pass ($((SECONDS - t0)) s)"
    elif [ "$rc" -eq 77 ]; then result[$name]="SKIP (${skip_reason:-no reason given})"
    else result[$name]="FAIL (exit $rc, $((SECONDS - t0)) s; log in $IUD_REL_OUT)"; fi
}

# A stage that cannot run here says why on the console and returns 77 (counted as SKIP).
skip_stage() { skip_reason="$1"; echo "SKIP: $1"; return 77; }

have_nightly() { rustup run nightly rustc --version >/dev/null 2>&1; }

# -Zbuild-std (tsan) needs the nightly's rust-src component: installed here when rustup can.
have_rust_src() {
    local sysroot
    sysroot="$(rustup run nightly rustc --print sysroot 2>/dev/null)" || return 1
    [ -f "$sysroot/lib/rustlib/src/rust/library/Cargo.lock" ] && return 0
    echo "installing rust-src for the nightly toolchain (rustup component add rust-src --toolchain nightly)"
    rustup component add rust-src --toolchain nightly >/dev/null 2>&1 &&
        [ -f "$sysroot/lib/rustlib/src/rust/library/Cargo.lock" ]
}

# cargo-fuzz from crates.io (a few minutes to build, once per machine) when nightly is there.
have_cargo_fuzz() {
    cargo fuzz --version >/dev/null 2>&1 && return 0
    echo "installing cargo-fuzz (cargo install --locked cargo-fuzz; once per machine)"
    cargo install -q --locked cargo-fuzz >/dev/null 2>&1 && cargo fuzz --version >/dev/null 2>&1
}

stage_pytest() {
    "$IUD_PY" -m pytest -p no:cacheprovider -q -rs tests/reliability \
        --leak-cycles "$LEAK_CYCLES" --stress-seconds "$STRESS_S"
}

stage_soak() {
    # shellcheck disable=SC2086
    "$IUD_PY" tests/reliability/soak.py $SOAK_ARGS --dir "$work" --out "$IUD_REL_OUT/soak.jsonl"
}

build_driver() {  # output, extra flags...
    local out="$1"; shift
    g++ -std=c++20 -D_GLIBCXX_USE_CXX11_ABI=1 -Wall -Wextra -Werror -O1 -g -fno-omit-frame-pointer \
        "$@" -Inixl-headers tests/asan/driver.cpp -ldl -pthread -o "$out"
}

stage_asan() {
    local d="$IUD_TARGET/asan"
    mkdir -p "$d"
    build_driver "$d/driver-asan" -fsanitize=address,undefined || return 1
    # The shim (C++) instrumented with ASan; the Rust engine's heap goes through ASan's malloc.
    CXXFLAGS="-fsanitize=address -fno-omit-frame-pointer -g" \
        RUSTFLAGS="-C link-arg=-fsanitize=address" CARGO_TARGET_DIR="$IUD_TARGET/asan-plugin" \
        cargo build --release --lib -q || return 1
    local rc=0
    for so in "$IUD_PLUGIN_SO" "$IUD_TARGET/asan-plugin/release/libio_uring_dmabuf.so"; do
        echo "-- driver (ASan+UBSan) on $so"
        mkdir -p "$work/asan"
        ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
            "$d/driver-asan" "$so" "$work/asan" "$DRIVER_CYCLES" "$DRIVER_ITERS" "$CONCREG_REPS" \
            > "$IUD_REL_OUT/asan-$(basename "$(dirname "$(dirname "$so")")").log" 2>&1 || rc=1
        grep -E "^(phase|driver:|FAIL)|ERROR: (Address|Leak)Sanitizer|runtime error" \
            "$IUD_REL_OUT/asan-$(basename "$(dirname "$(dirname "$so")")").log"
    done
    return $rc
}

stage_valgrind() {
    command -v valgrind >/dev/null || { skip_stage "valgrind not installed (apt-get install valgrind)"; return; }
    local d="$IUD_TARGET/asan"
    mkdir -p "$d" "$work/vg"
    build_driver "$d/driver-plain" || return 1
    valgrind --error-exitcode=3 --leak-check=full --errors-for-leak-kinds=definite \
        --show-leak-kinds=definite "$d/driver-plain" "$IUD_PLUGIN_SO" "$work/vg" "$VG_CYCLES" 4 2 \
        > "$IUD_REL_OUT/valgrind.log" 2>&1
    local rc=$?
    grep -E "^(phase|driver:|FAIL)|ERROR SUMMARY|definitely lost" "$IUD_REL_OUT/valgrind.log"
    return $rc
}

stage_tsan() {
    have_nightly || { skip_stage "no nightly Rust toolchain (-Zsanitizer=thread needs nightly: rustup toolchain install nightly)"; return; }
    have_rust_src || { skip_stage "the nightly toolchain lacks rust-src and rustup could not add it (-Zbuild-std needs it)"; return; }
    ( cd tests/reliability/tsan &&
      RUSTFLAGS="-Zsanitizer=thread" TSAN_OPTIONS="halt_on_error=1" \
        cargo +nightly run -q -Zbuild-std --release --target x86_64-unknown-linux-gnu \
        -- "$work" "$TSAN_ITERS" ) > "$IUD_REL_OUT/tsan.log" 2>&1
    local rc=$?
    grep -E "^stress:|WARNING: ThreadSanitizer|SUMMARY" "$IUD_REL_OUT/tsan.log" | sed -n 1,20p
    [ "$rc" -eq 0 ] || { echo "tsan failed (exit $rc); last lines of $IUD_REL_OUT/tsan.log:"; tail -n 15 "$IUD_REL_OUT/tsan.log"; }
    return $rc
}

stage_fuzz() {
    have_nightly || { skip_stage "no nightly Rust toolchain (cargo-fuzz needs nightly: rustup toolchain install nightly)"; return; }
    have_cargo_fuzz || { skip_stage "cargo-fuzz is not installed and cargo install cargo-fuzz failed"; return; }
    local rc=0 t
    for t in params path_meta plan; do
        # fuzz into a scratch copy of the committed corpus (the corpus stays as committed)
        rm -rf "$work/corpus-$t"; cp -r "fuzz/corpus/$t" "$work/corpus-$t"
        ( cd fuzz && cargo +nightly fuzz run "$t" "$work/corpus-$t" -- \
            -max_total_time="$FUZZ_S" -print_final_stats=1 ) > "$IUD_REL_OUT/fuzz-$t.log" 2>&1 || rc=1
        echo "-- $t: $(grep -E '^Done [0-9]+ runs' "$IUD_REL_OUT/fuzz-$t.log" | tail -1)" \
             "$(grep -E 'plan stats' "$IUD_REL_OUT/fuzz-$t.log" | tail -1)"
        grep -E "panicked|ERROR: AddressSanitizer|SUMMARY: libFuzzer" "$IUD_REL_OUT/fuzz-$t.log" | sed -n 1,5p
    done
    return $rc
}

for s in $stages; do run_stage "$s" "stage_$s"; done

echo "== reliability summary ($mode)"
status=0
for s in $stages; do
    echo "$s: ${result[$s]}"
    case "${result[$s]}" in FAIL*) status=1 ;; esac
done
exit $status
