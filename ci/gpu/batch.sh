#!/usr/bin/env bash
# Runs several ci/gpu/run.sh steps and extra benchmark commands in one device call, each step's
# files in its own folder, and packs everything into one archive under $OUT (the device tool
# brings back at most 8 files per call). Usage on the GPU machine:
#   bash ci/gpu/batch.sh NAME 'STEP_COMMAND' ['STEP_COMMAND' ...]
# where each STEP_COMMAND is run with OUT set to a fresh folder (run.sh writes its files there);
# the archive is $OUT/NAME.tgz (rewritten after each step), and $OUT/NAME.log holds every step's console output.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
name=$1; shift
final=${OUT:-/tmp/iud-batch-out}
work=/tmp/iud-batch/$name
mkdir -p "$final" "$work"
i=0
for cmd in "$@"; do
    i=$((i + 1))
    d="$work/step$i"; mkdir -p "$d"
    echo "== step $i ($(date -u +%T)): $cmd" | tee -a "$final/$name.log"
    t0=$(date +%s)
    OUT="$d" bash -c "$cmd" >"$d/console.txt" 2>&1
    rc=$?
    tail -n 25 "$d/console.txt" >>"$final/$name.log"
    echo "== step $i exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$final/$name.log"
    # Packed after every step, so a call cut off by the device's time limit keeps what finished.
    tar czf "$final/$name.tgz" -C "$work" .
done
