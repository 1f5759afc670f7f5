#!/usr/bin/env bash
# The state kernels beside the peer's (SGLang 0.5.23), in one run on one GPU: for each of
# the peer's benchmark configurations (6 layers per graph, bf16 activations, batches
# 1/16/64/256) the peer's runner and `replayssm bench kernels`, then one table of floor
# multiples (scripts/peer_table.py). Needs the peer folder (its README) at PEER.
#
#   PEER=.peer RESULTS=benchmarks/results scripts/gpu_peer_bench.sh [extra bench kernels options]
#
# Configurations: fp32 state T=4 n=3 L=16, bf16 state T=4 n=3 L=16, fp32 state T=8 n=6
# L=32 (override with CONFIGS="name dtype T n L; ..."). Writes
# RESULTS/kernels_<card>_<cfg>.json, RESULTS/kernels_peer_<card>_<cfg>.json and
# RESULTS/kernels_peer_table_<card>.md, <card> the GPU's model in lower case (h200, h100;
# CARD overrides it). About 1.5 minutes per configuration.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
PEER=${PEER:-.peer}
RESULTS=${RESULTS:-benchmarks/results}
CONFIGS=${CONFIGS:-"fp32_t4 float32 4 3 16; bf16_t4 bfloat16 4 3 16; fp32_t8 float32 8 6 32"}
BATCHES=${BATCHES:-1,16,64,256}
export PYTHONPATH="${SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}"
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -oE 'H[0-9]+' | tr 'H' 'h')}
if [ -z "$CARD" ]; then echo "gpu_peer_bench.sh: error: no H-series GPU named by nvidia-smi; set CARD" >&2; exit 2; fi
mkdir -p "$RESULTS"
rc=0
table=()
IFS=';' read -ra cfgs <<< "$CONFIGS"
for cfg in "${cfgs[@]}"; do
    read -r name sdt T n L <<< "$cfg"
    echo "=== $name: state $sdt, T=$T, n=$n, L=$L"
    "$PYTHON" "$PEER/bench_peer.py" --sglang "$PEER/sglang_0523" --state-dtype "$sdt" --T "$T" --accept "$n" --ring "$L" \
        --batches "$BATCHES" --out "$RESULTS/kernels_peer_${CARD}_$name.json" | tail -n 6 || rc=$?
    "$PYTHON" -m replayssm.cli bench kernels --layers 6 --state-dtype "$sdt" --window "$T" --accept "$n" --ring-len "$L" \
        --batches "$BATCHES" --quiet --json "$RESULTS/kernels_${CARD}_$name.json" "$@" | tail -n 12 || rc=$?
    table+=("$name=$RESULTS/kernels_${CARD}_$name.json,$RESULTS/kernels_peer_${CARD}_$name.json")
done
"$PYTHON" scripts/peer_table.py "${table[@]}" | tee "$RESULTS/kernels_peer_table_${CARD}.md" || rc=$?
exit "$rc"
