#!/usr/bin/env bash
# Issue 19's measurements on one H200: prompt prefill against its compute floor, time to
# first token and latency per request, MTP drafting, with Hugging Face generate beside.
#
#   scripts/gpu_prefill_bench.sh              # every stage
#   scripts/gpu_prefill_bench.sh tests mtp    # some of them
#
# Stages (results in $RESULTS, default benchmarks/results; $TAG, default h200, names the card):
#   tests       the prefill GPU tests (tests/gpu/test_prefill_gpu.py)  -> gpu_tests_prefill_$TAG.log
#   prefill64   qwen3.5-shapes bf16, one 64-token prompt               -> e2e_prefill64_$TAG.{json,log}
#   prefill2048 qwen3.5-shapes bf16, 2048-token prompts at batch 1, 16 -> e2e_prefill2048_$TAG.{json,log}
#   decode      qwen3.5-shapes bf16, plain and fold (oracle P = 0.8) at batch 1 and 64: the decode
#               step's no-regression figures                           -> e2e_decode_$TAG.{json,log}
#   mtp         the embedded model drafted by its MTP head, 512-token prompts and 256 new
#               tokens at batch 1, 16, 64 (HF up to 16)                -> e2e_mtp_$TAG.{json,log}
#   mtp-loaded  the same model and drafter on a loaded server: 4 x batch requests through batch
#               slots at batch 16, 64 (each joins as a slot frees up)  -> e2e_mtp_loaded_$TAG.{json,log}
#   profile     the step profile with the MTP drafter timed alone      -> profile_step_mtp_$TAG.{json,log}
#   prefill-profile  one prompt pass of 16 x 2048 and of 1 x 2048 tokens, its kernels by GPU
#               time                                                   -> prefill_profile_$TAG.log
#   conv-ab     the 16 x 2048 prompt pass per conv block setting (channels x tokens: 256x16, the
#               default, 512x16, 256x32, 256x64)                    -> prefill_conv_ab_$TAG.log
#   join-profile  a speculative request's prompt pass piece by piece (the MTP drafter's join),
#               one 512-token prompt                               -> profile_join_$TAG.log
#   mixed       qwen3.5-shapes, 16 requests of 512-4096 prompt and 64-256 new tokens, whole prompts
#               per pass and passes of 2048 tokens between decode steps -> e2e_mixed{,_chunked}_$TAG.*
# At the end, scripts/prefill_targets.py prints every target of the issue beside its
# measured value (PASS / MISS; a MISS makes the exit status 1).
#
# fla-core (the `gpu` extra) runs the GDN layers of prompts; the first lines say whether
# it imports. Wheels the machine lacks may be put in .gpu_wheels/ (installed first).
# PYTHON selects the interpreter (default python3). Expected runtime: 15-25 minutes,
# much of it Hugging Face's static cache compiling and Triton compiling our kernels.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results}
TAG=${TAG:-h200}
LIMIT=${LIMIT:-540}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .gpu_wheels/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
"$PYTHON" -m replayssm.cli info
"$PYTHON" -c "from replayssm.engine.adapter import CHUNK_KERNEL_INSTALL, load_chunk_kernel
print('fla-core chunk kernel:', 'importable' if load_chunk_kernel() else 'MISSING: ' + CHUNK_KERNEL_INSTALL)"
rc=0
. scripts/gpu_stage.sh  # stage NAME SECONDS CMD...
e2e() {  # e2e NAME ARGS...: one `replayssm bench e2e` run, JSON and log under NAME
    local name=$1; shift
    stage "${name}_$TAG" "$LIMIT" "$PYTHON" -m replayssm.cli bench e2e --quiet --json "$RESULTS/${name}_$TAG.json" "$@"
}
SHAPES=(--random qwen3.5-shapes --dtype bf16)
ORACLE=(--strategies fold --drafter oracle --acceptance 0.8)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests prefill64 prefill2048 decode mtp profile mixed)
for what in "${stages[@]}"; do
    case $what in
        tests) stage "gpu_tests_prefill_$TAG" "$LIMIT" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v -s --tb=short -rfE \
                   tests/gpu/test_prefill_gpu.py ;;
        prefill64) e2e e2e_prefill64 "${SHAPES[@]}" "${ORACLE[@]}" --batches 1 --prompt-len 64 --max-new-tokens 64 ;;
        prefill2048) e2e e2e_prefill2048 "${SHAPES[@]}" "${ORACLE[@]}" --batches 1,16 --prompt-len 2048 \
                   --max-new-tokens 64 ;;
        decode) e2e e2e_decode "${SHAPES[@]}" "${ORACLE[@]}" --batches 1,64 --prompt-len 64 --max-new-tokens 256 \
                   --hf-max-batch 1 ;;
        mtp) e2e e2e_mtp --model embedded --drafter mtp --batches 1,16,64 --prompt-len 512 --max-new-tokens 256 \
                   --hf-max-batch 16 ;;
        mtp-loaded) e2e e2e_mtp_loaded --model embedded --drafter mtp --batches 16,64 --prompt-len 512 \
                   --max-new-tokens 256 --requests-per-slot 4 --no-hf ;;
        prefill-profile) stage "prefill_profile_$TAG" "$LIMIT" "$PYTHON" scripts/gpu_prefill_profile.py \
                   --cases 16x2048,1x2048 --top 40 ;;
        conv-ab) stage "prefill_conv_ab_$TAG" "$LIMIT" "$PYTHON" scripts/gpu_prefill_profile.py \
                   --cases 16x2048 --top 8 --conv 256x16,512x16,256x32,256x64 ;;
        join-profile) stage "profile_join_$TAG" "$LIMIT" "$PYTHON" scripts/gpu_profile_join.py cuda 1 512 ;;
        profile) stage "profile_step_mtp_$TAG" "$LIMIT" "$PYTHON" scripts/gpu_profile_step.py --model embedded --drafter mtp \
                   --modes plain,snapshot,fold,circular --batches 1,16,64 --json "$RESULTS/profile_step_mtp_$TAG.json" ;;
        mixed) e2e e2e_mixed "${SHAPES[@]}" "${ORACLE[@]}" --batches 16 --prompt-len 512-4096 \
                   --max-new-tokens 64-256 --no-hf
               e2e e2e_mixed_chunked "${SHAPES[@]}" "${ORACLE[@]}" --batches 16 --prompt-len 512-4096 \
                   --max-new-tokens 64-256 --no-hf --prefill-chunk 2048 ;;
        *) echo "unknown stage $what"; rc=2 ;;
    esac
done
echo "=== issue 19 targets"
"$PYTHON" scripts/prefill_targets.py "$RESULTS" --tag "$TAG" || rc=1
exit $rc
