#!/bin/bash
# Kernel rounds on the GPU machine, run from the repo root with the code under test in
# .k/src and the peer kernels in .peer (both carried). Usage: bash .k/scripts/gpu_round.sh N
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p $R
K="env PYTHONPATH=.k/src python3"
B="$K -m replayssm.cli bench kernels --layers 6 --quiet"
P="python3 .peer/bench_peer.py --sglang .peer/sglang_0523"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader
case "$1" in
1)
  timeout 200 $K -m pytest -q -x -m gpu .k/tests/gpu/test_chunked_gpu.py -k "closed_form or flush" -p no:cacheprovider 2>&1 | tail -15
  V="kc32=closed_form.k_chunk:32 kc128=closed_form.k_chunk:128 ns1=closed_form.num_stages:1 ns3=closed_form.num_stages:3 bv32=closed_form.block_v:32 nw8=closed_form.num_warps:8 bv128nw8=closed_form.block_v:128,closed_form.num_warps:8"
  timeout 150 $K .k/scripts/gpu_profile_ops.py --batches 64,256 --only "closed_form" --variants $V --json $R/prof_cf_sweep.json 2>&1 | grep -v "^\[.*replay" | tail -80
  timeout 90 $K .k/scripts/gpu_profile_ops.py --batches 64,256 --state-dtype bfloat16 --json $R/prof_bf16.json 2>&1 | tail -30
  timeout 100 $P --state-dtype float32 --T 4 --accept 3 --ring 16 --batches 16,64,256 --out $R/peer_fp32_t4.json 2>&1 | tail -6
  timeout 120 $B --state-dtype float32 --window 4 --accept 3 --ring-len 16 --batches 16,64,256 --json $R/rs_fp32_t4.json 2>&1 | tail -12
  ;;
esac
