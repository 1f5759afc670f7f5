#!/usr/bin/env bash
# Tuning sweep of the kernels' block sizes and product precision on the GPU machine:
# one `bench kernels` run per setting, table rows only. Used to pick the defaults.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
run() {  # run LABEL ENV... -- ARGS...
    local label=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    echo "## $label"
    env "${envs[@]}" "$PYTHON" -m replayssm.cli bench kernels --baselines none --quiet "$@" 2>&1 \
        | grep -E "^(snapshot|fold|circular) " || echo "(failed)"
}
B=${BATCHES:-1,64,256}
for dot in ieee tf32; do
    for bv in 32 64; do
        for kc in 32 64; do
            run "circular dot=$dot BV=$bv KC=$kc" REPLAYSSM_CHUNKED_DOT=$dot REPLAYSSM_CHUNKED_BV=$bv REPLAYSSM_CHUNKED_KC=$kc -- \
                --strategies circular --batches "$B"
        done
    done
done
for bv in 8 16 32 64; do
    run "fold+snapshot BV<=$bv" REPLAYSSM_BLOCK_V=$bv -- --strategies fold,snapshot --batches "$B"
done
