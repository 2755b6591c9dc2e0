#!/usr/bin/env bash
# Formatters and linters, warnings as errors (ci/test.sh runs this as its lint stage):
#   1. rustfmt: `cargo fmt --all --check` over the workspace (the plugin, bench, ci/vm/lab), then
#      `rustfmt --check` over the crates outside it (fuzz/, tests/reliability/tsan/: their own
#      workspaces, which need nightly or extra dependencies to resolve, so cargo fmt is not
#      pointed at them).
#   2. clippy: `cargo clippy --workspace --all-targets --release -- -D warnings`. The lints the
#      project allows, each with its reason, are in the crate roots (src/lib.rs, src/ffi/bridge.rs).
#   3. ruff (Python): `ruff format --check` and `ruff check`, rules in ruff.toml.
# Every stage runs even if an earlier one failed; the exit status is non-zero if any did.
# rustfmt and clippy are rustup components; a toolchain without them gets them here.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$IUD_ROOT"

for component in rustfmt clippy; do
    cmd=fmt
    [ "$component" = clippy ] && cmd=clippy
    if ! cargo "$cmd" --version >/dev/null 2>&1; then
        echo "ci/lint.sh: installing the rustup component $component"
        rustup component add "$component"
    fi
done

status=0
echo "== rustfmt (cargo fmt --all --check; rustfmt --check on fuzz/ and tests/reliability/tsan/)"
cargo fmt --all --check || status=1
rustfmt --check --edition 2021 fuzz/fuzz_targets/*.rs tests/reliability/tsan/src/main.rs || status=1

echo "== clippy (cargo clippy --workspace --all-targets --release -- -D warnings)"
cargo clippy --workspace --all-targets --release -- -D warnings || status=1

# --- ruff (Python) ----------------------------------------------------------------------------
# `ruff format --check` and `ruff check` over the repository (ruff.toml: rules and exclusions),
# with the ruff pinned here, installed into the project venv when missing.
RUFF_VERSION=0.17.6
have_ruff=$("$IUD_PY" -m ruff --version 2>/dev/null || true)
if [ "$have_ruff" != "ruff $RUFF_VERSION" ]; then
    echo "ci/lint.sh: installing ruff==$RUFF_VERSION into $IUD_VENV"
    "$IUD_PY" -m pip install -q --disable-pip-version-check "ruff==$RUFF_VERSION"
fi
echo "== ruff (ruff format --check .; ruff check .)"
"$IUD_PY" -m ruff format --check . || status=1
"$IUD_PY" -m ruff check . || status=1
# ---------------------------------------------------------------------------------------------

if [ "$status" -eq 0 ]; then echo "lint: ok"; else echo "lint: FAILED"; fi
exit "$status"
