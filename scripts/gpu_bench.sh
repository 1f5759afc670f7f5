#!/usr/bin/env bash
# Issue 3's kernel benchmark on the GPU machine (H200): one CUDA-graph-captured step per
# strategy on Qwen3.5-35B-A3B GDN shapes at batches 1, 16, 64 and 256, next to the
# one-read floor and plain decoding. Prints the table, writes
# benchmarks/results/kernels_h200.json (override with OUT_JSON=...), and checks it
# against the targets in benchmarks/kernel_targets.json (scripts/check_kernel_targets.py;
# a missed target makes the exit status 1).
#
#   scripts/gpu_bench.sh                      # the defaults the committed JSON uses
#   scripts/gpu_bench.sh --ring-len 64        # extra options go to `replayssm bench kernels`
#
# PYTHON selects the interpreter (default: python). Expected runtime: 1-3 minutes,
# most of it Triton compiling the kernels on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
OUT_JSON=${OUT_JSON:-benchmarks/results/kernels_h200.json}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
fi
"$PYTHON" -m replayssm.cli info
start=$(date +%s)
rc=0
"$PYTHON" -m replayssm.cli bench kernels --json "$OUT_JSON" "$@" || rc=$?
echo "bench kernels took $(( $(date +%s) - start )) s; results in $OUT_JSON"
if [ -f "$OUT_JSON" ]; then
    "$PYTHON" scripts/check_kernel_targets.py "$OUT_JSON" || rc=$?
fi

# Evidence for the ring length: circular alone at the two neighbours of the default
# (the byte model picks 32 at this shape). Skip with RING_SWEEP=0.
if [ "${RING_SWEEP:-1}" != "0" ]; then
    for L in 16 64; do
        "$PYTHON" -m replayssm.cli bench kernels --strategies circular --baselines none --ring-len "$L" \
            --quiet --json "${OUT_JSON%.json}_ring$L.json" "$@" || rc=$?
    done
fi
echo "total $(( $(date +%s) - start )) s"
exit "$rc"
