#!/usr/bin/env bash
# The kernel benchmark on the GPU machine (H200): one CUDA-graph-captured step per
# strategy on Qwen3.5-35B-A3B GDN shapes at batches 1, 16, 64 and 256, next to the
# one-read floor and plain decoding.
#
#  1. Issue 3's table (T=4, n=3, ring L=auto, fp32 state, 8 layers per graph):
#     benchmarks/results/kernels_h200.json (override with OUT_JSON=...), checked against
#     the targets in benchmarks/kernel_targets.json (scripts/check_kernel_targets.py; a
#     missed target makes the exit status 1).
#  2. Issue 11's table, the peer's benchmark shapes (6 layers per graph, bf16
#     activations): fp32 state T=4 n=3 L=16, bf16 state T=4 n=3 L=16, fp32 state T=8 n=6
#     L=32, each with every strategy and reference step -> ${OUT_JSON%.json}_i11_<cfg>.json;
#     and at fp32 T=4 and T=8, circular with each of its two methods forced at every batch
#     (--tune circular.replay_max_batch=0 / 256) -> ..._i11_<cfg>_closed.json / _replay.json,
#     which shows where the shape table's small-batch switch belongs. The table is
#     printed at the end (scripts/kernel_table.py). Skip with ISSUE11=0.
#
#   scripts/gpu_bench.sh                      # both
#   scripts/gpu_bench.sh --repeats 10         # extra options go to every `replayssm bench kernels`
#
# PYTHON selects the interpreter (default: python). Expected runtime: 2-4 minutes,
# much of it Triton compiling the kernels for each window, ring and dtype.
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

if [ "${ISSUE11:-1}" != "0" ]; then
    extra=("$@")
    base=${OUT_JSON%.json}_i11
    table=()
    for cfg in "fp32_t4 float32 4 3 16" "bf16_t4 bfloat16 4 3 16" "fp32_t8 float32 8 6 32"; do
        read -r name sdt T n L <<< "$cfg"
        common=(--layers 6 --state-dtype "$sdt" --window "$T" --accept "$n" --ring-len "$L" --batches 1,16,64,256 --quiet)
        echo "=== issue 11: $name (state $sdt, T=$T, n=$n, L=$L) at $(( $(date +%s) - start )) s"
        "$PYTHON" -m replayssm.cli bench kernels "${common[@]}" --json "${base}_$name.json" ${extra[@]+"${extra[@]}"} || rc=$?
        table+=("$name=${base}_$name.json")
        if [ "$sdt" = float32 ]; then
            for m in "closed 0" "replay 256"; do
                read -r mname mb <<< "$m"
                "$PYTHON" -m replayssm.cli bench kernels "${common[@]}" --strategies circular --baselines none \
                    --tune "circular.replay_max_batch=$mb" --json "${base}_${name}_$mname.json" ${extra[@]+"${extra[@]}"} || rc=$?
                table+=("$mname=${base}_${name}_$mname.json")
            done
        fi
    done
    echo "=== issue 11 table (x floor; circular[closed|replay]: that method at every batch)"
    "$PYTHON" scripts/kernel_table.py "${table[@]}" || rc=$?
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
