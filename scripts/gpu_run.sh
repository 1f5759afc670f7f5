#!/usr/bin/env bash
# Everything the GPU machine must confirm, in stages, each with its own time limit:
#
#   scripts/gpu_run.sh tests bench        # kernel GPU tests, then the kernel benchmark
#   scripts/gpu_run.sh tests-engine       # engine and tool GPU tests (the engine's kernels' GPU twins in
#                                         # tests/engine included)
#   scripts/gpu_run.sh drift e2e          # the 32768-token drift run (DRIFT_ARGS, default --inputs random:
#                                         # the synthetic inputs BENCHMARKS.md cites), end-to-end tok/s
#   scripts/gpu_run.sh profile            # each op of a step timed alone (PROFILE_ARGS="--variants ...")
#   scripts/gpu_run.sh train              # replayssm train --size default (TRAIN_MINUTES, default 8.5;
#                                         # TRAIN_ARGS adds options), checkpoint into $TRAIN_OUT
#                                         # (default out/train_$TAG, kept between calls)
#   scripts/gpu_run.sh train-draft        # the draft model (--size small, the shipped tokenizer;
#                                         # DRAFT_MINUTES, default 1.5) into $DRAFT_OUT
#                                         # (default out/draft_$TAG)
#   scripts/gpu_run.sh acceptance         # replayssm bench acceptance: the shipped model, drafts
#                                         # from n-gram, its MTP head and $DRAFT_OUT, T = 2, 4, 8
#   scripts/gpu_run.sh closed-loop        # replayssm closed-loop on the shipped model, 8192 tokens
#                                         # (CLOSED_LOOP_TOKENS), $CLOSED_LOOP_DTYPE (default float32)
#   scripts/gpu_run.sh trees              # bench e2e on the shipped model with MTP drafts at batches
#                                         # 1, 4, 16, 64: the depth-3 chain, the 3,2,1 tree, and the
#                                         # tree with its spine from $CHAIN_FROM rows (default 16); then
#                                         # the shipped draft model's chain and 3,2,1 tree
#   scripts/gpu_run.sh targets-spec       # the speculative end-to-end rows the open targets are read
#                                         # from: qwen3.5-shapes with forced acceptance 0.8 at batches
#                                         # 64 and 256 (fold, circular), the embedded model's MTP drafts
#                                         # at batches 1, 16, 64 (512 + 256 tokens)
#   scripts/gpu_run.sh targets-plain      # plain decoding through the ring (plain_ring kernels, fp32 and
#                                         # bf16 states, batches 64, 256; plain-ring end to end) and the
#                                         # 2048-token prompt rows (batches 1 and 16) with their floor
#   scripts/gpu_run.sh parts              # the forced step's kernels by part against each part's bound
#                                         # (plain, circular, fold at batches 256 and 64)
#   scripts/gpu_run.sh timeline           # the forced row's closed batch at 256 step by step (circular,
#                                         # plain): steady steps, the drain's buckets, the host
#   scripts/gpu_run.sh tunes              # the shape table's ring decoding and closed-form rows against
#                                         # the variants in $TUNES (default: DEFAULT_TUNES below), batches
#                                         # 64 and 256, the table's own rows first and again last; for
#                                         # reading whether another card wants other rows
#
# Results go to $RESULTS (default benchmarks/results, under the names BENCHMARKS.md
# cites; $TAG, default h200, names the card):
#   tests         gpu_tests_kernels_$TAG.log
#   tests-engine  gpu_tests_engine_$TAG.log
#   bench         kernels_$TAG.log, kernels_$TAG.json (+ _i11_*.json, issue 11's table)
#   drift         drift.log, drift_$TAG.json, drift_$TAG.png
#   e2e           e2e.log, e2e_$TAG.json, e2e_$TAG.png
#   profile       profile_ops_$TAG.log, profile_ops_$TAG.json
#   train         train_$TAG.log, the checkpoint (+ train_log.json, loss.png) in $TRAIN_OUT
#   train-draft   train_draft_$TAG.log, the checkpoint in $DRAFT_OUT
#   acceptance    acceptance_$TAG.log, acceptance_$TAG.json, acceptance_$TAG.png
#   closed-loop   closed_loop_${CLOSED_LOOP_DTYPE}_$TAG.{log,json,png}
#   trees         e2e_trees_{chain,tree,spine,model_chain,model_tree}_$TAG.{log,json}
#   targets-spec  e2e_forced_b{64,256}_$TAG.{log,json}, e2e_mtp_$TAG.{log,json}
#   targets-plain kernels_plain_ring_{float32,bfloat16}_$TAG.{log,json}, e2e_plain_ring_$TAG.{log,json},
#                 e2e_prefill2048_$TAG.{log,json}
#   parts         profile_step_parts_$TAG.{log,json}
#   timeline      step_timeline_{circular,plain}_b256_$TAG.log
#   tunes         kernels_tune_{NAME}_$TAG.{log,json} per variant, kernels_tunes_$TAG.log (their table)
# A test stage fails (exit 1) when pytest passed no GPU test: all skipped (no CUDA
# device) or none collected must not read as success. Wheels of packages the machine
# lacks (fla-core for chunked prefill and training, with flash-linear-attention and
# einops) may be put in .gpu_wheels/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-benchmarks/results}
TAG=${TAG:-h200}
# The training stage's checkpoint: budget 8.5 minutes (data, tokenizer and saving, about
# 20 s, come on top), so that it fits a 10-minute command.
TRAIN_OUT=${TRAIN_OUT:-out/train_$TAG}
DRAFT_OUT=${DRAFT_OUT:-out/draft_$TAG}
CLOSED_LOOP_DTYPE=${CLOSED_LOOP_DTYPE:-float32}
# The tunes stage's variants, NAME:STATE_DTYPE:WHAT[:FAMILY.PARAM=VALUE,...], WHAT being
# ring (plain_ring) or circular; a variant without overrides is the table as it stands.
# The defaults are the launch shapes the table's notes name for these rows (ops/tuning.py),
# each a value the table allows.
DEFAULT_TUNES="ring_f32:float32:ring
ring_f32_bv32_w1:float32:ring:ring_decode.block_v=32,ring_decode.num_warps=1
ring_f32_bv128_w4:float32:ring:ring_decode.block_v=128,ring_decode.num_warps=4
ring_f32_ahead2:float32:ring:ring_decode.records_ahead=2
ring_f32_apart:float32:ring:ring_decode.split_flush=2,ring_decode.block_v=32,ring_decode.token_block_v=64,ring_decode.flush_warps=2
ring_f32_r168:float32:ring:ring_decode.max_registers=168
ring_f32_again:float32:ring
ring_bf16:bfloat16:ring
ring_bf16_in_order:bfloat16:ring:ring_decode.split_flush=1
ring_bf16_tok64:bfloat16:ring:ring_decode.token_block_v=64
ring_bf16_flush64:bfloat16:ring:ring_decode.block_v=64
ring_bf16_r96:bfloat16:ring:ring_decode.max_registers=96
ring_bf16_again:bfloat16:ring
circ_f32:float32:circular
circ_f32_stages3:float32:circular:closed_form.num_stages=3
circ_f32_bv32:float32:circular:closed_form.block_v=32
circ_f32_uncapped:float32:circular:closed_form.max_registers=0
circ_f32_early:float32:circular:closed_form.early_tile=1
circ_f32_kc32:float32:circular:closed_form.k_chunk=32
circ_f32_again:float32:circular"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .gpu_wheels/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PYTHON" -m replayssm.cli info
rc=0
. scripts/gpu_stage.sh  # stage NAME SECONDS CMD...
require_passed() {  # require_passed NAME: the stage's pytest summary must count passed tests
    if ! grep -Eq '^=+ .*\b[0-9]+ passed' "$RESULTS/$1.log"; then
        echo "=== $1: FAILED: no GPU test passed (all skipped, or none collected)"
        [ $rc -ne 0 ] || rc=1
    fi
}
for what in "$@"; do
    case $what in
        tests) stage "gpu_tests_kernels_$TAG" "${TESTS_LIMIT:-300}" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v --tb=short -rfE \
                   tests/gpu/test_kernels_gpu.py tests/gpu/test_chunked_gpu.py tests/gpu/test_graph_step.py
               require_passed "gpu_tests_kernels_$TAG" ;;
        tests-engine) stage "gpu_tests_engine_$TAG" "${TESTS_LIMIT:-300}" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v --tb=short -rfE \
                   tests/gpu/test_engine_gpu.py tests/gpu/test_graphed_engine.py tests/engine tests/bench
               require_passed "gpu_tests_engine_$TAG" ;;
        bench) stage "kernels_$TAG" "${BENCH_LIMIT:-300}" env OUT_JSON="$RESULTS/kernels_$TAG.json" PYTHON="$PYTHON" RING_SWEEP=0 scripts/gpu_bench.sh ;;
        profile) stage "profile_ops_$TAG" "${PROFILE_LIMIT:-300}" "$PYTHON" scripts/gpu_profile_ops.py --batches 1,16,64,256 \
                   --json "$RESULTS/profile_ops_$TAG.json" ${PROFILE_ARGS:-} ;;
        drift) stage drift "${DRIFT_LIMIT:-300}" "$PYTHON" -m replayssm.cli drift ${DRIFT_ARGS:---inputs random} --json "$RESULTS/drift_$TAG.json" --plot "$RESULTS/drift_$TAG.png" --quiet ;;
        e2e) stage e2e "${E2E_LIMIT:-240}" "$PYTHON" -m replayssm.cli bench e2e --json "$RESULTS/e2e_$TAG.json" --plot "$RESULTS/e2e_$TAG.png" ${E2E_ARGS:-} ;;
        train) mkdir -p "$(dirname "$TRAIN_OUT")"
               stage "train_$TAG" "${TRAIN_LIMIT:-590}" "$PYTHON" -m replayssm.cli train --size default \
                   --out "$TRAIN_OUT" --overwrite --minutes "${TRAIN_MINUTES:-8.5}" ${TRAIN_ARGS:-} ;;
        train-draft) mkdir -p "$(dirname "$DRAFT_OUT")"
               stage "train_draft_$TAG" "${TRAIN_LIMIT:-590}" "$PYTHON" -m replayssm.cli train --size small \
                   --tokenizer src/replayssm/models/default --out "$DRAFT_OUT" --overwrite --minutes "${DRAFT_MINUTES:-1.5}" ;;
        acceptance) stage "acceptance_$TAG" "${ACCEPTANCE_LIMIT:-300}" "$PYTHON" -m replayssm.cli bench acceptance \
                   --draft-model "$DRAFT_OUT" --json "$RESULTS/acceptance_$TAG.json" --plot "$RESULTS/acceptance_$TAG.png" ;;
        closed-loop) stage "closed_loop_${CLOSED_LOOP_DTYPE}_$TAG" "${CLOSED_LOOP_LIMIT:-480}" "$PYTHON" -m replayssm.cli closed-loop \
                   --model embedded --tokens "${CLOSED_LOOP_TOKENS:-8192}" --requests 2 --dtype "$CLOSED_LOOP_DTYPE" \
                   --json "$RESULTS/closed_loop_${CLOSED_LOOP_DTYPE}_$TAG.json" \
                   --plot "$RESULTS/closed_loop_${CLOSED_LOOP_DTYPE}_$TAG.png" ;;
        trees) for cfg in "chain|--num-draft 3" "tree|--tree 3,2,1" "spine|--tree 3,2,1 --chain-from ${CHAIN_FROM:-16}" \
                          "model_chain|--drafter model --draft-model embedded-draft --num-draft 3" \
                          "model_tree|--drafter model --draft-model embedded-draft --tree 3,2,1"; do
                   name=${cfg%%|*}
                   # shellcheck disable=SC2086  # the options split into words on purpose
                   stage "e2e_trees_${name}_$TAG" "${E2E_LIMIT:-240}" "$PYTHON" -m replayssm.cli bench e2e --model embedded \
                       --drafter mtp --strategies circular,fold --no-hf --batches 1,4,16,64 ${cfg#*|} \
                       --json "$RESULTS/e2e_trees_${name}_$TAG.json"
               done ;;
        targets-spec)
               for b in 64 256; do
                   stage "e2e_forced_b${b}_$TAG" "${E2E_LIMIT:-170}" "$PYTHON" -m replayssm.cli bench e2e --random qwen3.5-shapes \
                       --drafter forced --acceptance 0.8 --dtype bf16 --num-draft 3 --no-hf --strategies fold,circular \
                       --ring-len 16 --batches "$b" --json "$RESULTS/e2e_forced_b${b}_$TAG.json"
               done
               stage "e2e_mtp_$TAG" "${E2E_LIMIT:-170}" "$PYTHON" -m replayssm.cli bench e2e --model embedded --drafter mtp \
                   --batches 1,16,64 --prompt-len 512 --max-new-tokens 256 --no-hf --strategies fold \
                   --json "$RESULTS/e2e_mtp_$TAG.json" ;;
        targets-plain)
               for sdt in float32 bfloat16; do
                   stage "kernels_plain_ring_${sdt}_$TAG" "${BENCH_LIMIT:-60}" "$PYTHON" -m replayssm.cli bench kernels \
                       --layers 6 --window 4 --accept 3 --ring-len 16 --batches 64,256 --state-dtype "$sdt" \
                       --strategies none --baselines plain_decode,plain_ring --quiet \
                       --json "$RESULTS/kernels_plain_ring_${sdt}_$TAG.json"
               done
               stage "e2e_plain_ring_$TAG" "${E2E_LIMIT:-150}" "$PYTHON" -m replayssm.cli bench e2e --random qwen3.5-shapes \
                   --dtype bf16 --batches 64,256 --no-hf --plain-ring --plain-ring-len 16 --strategies none \
                   --json "$RESULTS/e2e_plain_ring_$TAG.json"
               stage "e2e_prefill2048_$TAG" "${E2E_LIMIT:-150}" "$PYTHON" -m replayssm.cli bench e2e --random qwen3.5-shapes \
                   --dtype bf16 --batches 1,16 --prompt-len 2048 --max-new-tokens 16 --no-hf --strategies none \
                   --json "$RESULTS/e2e_prefill2048_$TAG.json" ;;
        tunes)
               ring=(); circular=()  # label=json per kind, for kernel_table.py
               while IFS=: read -r name sdt what over; do
                   [ -n "$name" ] || continue
                   if [ "$what" = ring ]; then sel=(--strategies none --baselines plain_ring)
                   else sel=(--strategies circular --baselines none); fi
                   tune=(); for t in ${over//,/ }; do tune+=(--tune "$t"); done
                   json="$RESULTS/kernels_tune_${name}_$TAG.json"
                   rm -f "$json"  # only this run's variants go into the table
                   stage "kernels_tune_${name}_$TAG" "${BENCH_LIMIT:-60}" "$PYTHON" -m replayssm.cli bench kernels \
                       --layers 6 --window 4 --accept 3 --ring-len 16 --batches 64,256 --state-dtype "$sdt" \
                       "${sel[@]}" "${tune[@]}" --quiet --json "$json"
                   [ -f "$json" ] || continue
                   if [ "$what" = ring ]; then ring+=("$name=$json"); else circular+=("$name=$json"); fi
               done <<< "${TUNES:-$DEFAULT_TUNES}"
               # one row per ring variant and batch; circular's variants as columns of one row per batch
               { [ ${#ring[@]} -eq 0 ] || "$PYTHON" scripts/kernel_table.py "${ring[@]}"
                 [ ${#circular[@]} -eq 0 ] || "$PYTHON" scripts/kernel_table.py "${circular[@]}"; } \
                   | tee "$RESULTS/kernels_tunes_$TAG.log" ;;
        parts) stage "profile_step_parts_$TAG" "${PROFILE_LIMIT:-300}" "$PYTHON" scripts/gpu_profile_step.py --drafter forced \
                   --modes plain,circular,fold --batches 256,64 --top 16 --reps 30 --json "$RESULTS/profile_step_parts_$TAG.json" ;;
        timeline)
               for m in circular plain; do
                   stage "step_timeline_${m}_b256_$TAG" "${E2E_LIMIT:-150}" "$PYTHON" scripts/gpu_step_timeline.py \
                       --mode "$m" --batch 256
               done ;;
        *) echo "unknown stage $what"; rc=2 ;;
    esac
done
exit $rc
