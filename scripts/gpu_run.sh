#!/usr/bin/env bash
# Everything the GPU machine must confirm, in stages, each with its own time limit:
#
#   scripts/gpu_run.sh tests bench        # kernel GPU tests, then the kernel benchmark
#   scripts/gpu_run.sh tests-engine       # engine and tool GPU tests
#   scripts/gpu_run.sh drift e2e          # the 32768-token drift run, end-to-end tok/s
#   scripts/gpu_run.sh profile            # each op of a step timed alone (PROFILE_ARGS="--variants ...")
#
# Results (logs, JSON, PNG) go to $RESULTS (default benchmarks/results/gpu). Wheels of
# packages the machine lacks (fla-core for chunked prefill) may be put in .gpu_wheels/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .gpu_wheels/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PYTHON" -m replayssm.cli info
rc=0
stage() {  # stage NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local r=$?
    tail -n 40 "$RESULTS/$name.log"
    echo "=== $name: exit $r after $(( $(date +%s) - t0 ))s"
    [ $r -eq 0 ] || rc=$r
}
for what in "$@"; do
    case $what in
        tests) stage gpu-tests "${TESTS_LIMIT:-300}" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v --tb=short -rfE \
                   tests/gpu/test_kernels_gpu.py tests/gpu/test_chunked_gpu.py tests/gpu/test_graph_step.py ;;
        tests-engine) stage gpu-tests-engine "${TESTS_LIMIT:-300}" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v --tb=short -rfE \
                   tests/gpu/test_engine_gpu.py tests/bench ;;
        bench) stage bench-kernels "${BENCH_LIMIT:-240}" env OUT_JSON="$RESULTS/kernels_h200.json" PYTHON="$PYTHON" RING_SWEEP=0 scripts/gpu_bench.sh ;;
        profile) stage profile-ops "${PROFILE_LIMIT:-300}" "$PYTHON" scripts/gpu_profile_ops.py --batches 1,16,64,256 \
                   --json "$RESULTS/profile_ops_h200.json" ${PROFILE_ARGS:-} ;;
        drift) stage drift "${DRIFT_LIMIT:-300}" "$PYTHON" -m replayssm.cli drift --json "$RESULTS/drift_h200.json" --plot "$RESULTS/drift_h200.png" --quiet ;;
        e2e) stage e2e "${E2E_LIMIT:-240}" "$PYTHON" -m replayssm.cli bench e2e --json "$RESULTS/e2e_h200.json" --plot "$RESULTS/e2e_h200.png" ${E2E_ARGS:-} ;;
        *) echo "unknown stage $what"; rc=2 ;;
    esac
done
exit $rc
