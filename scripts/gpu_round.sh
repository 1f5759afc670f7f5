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
2)
  timeout 150 $K -m pytest -q -x -m gpu .k/tests/gpu/test_chunked_gpu.py -k "closed_form or flush" -p no:cacheprovider 2>&1 | tail -8
  V="kc128=closed_form.k_chunk:128 ns1=closed_form.num_stages:1 tf32c=closed_form.tf32_coefficients:1 bv128=closed_form.block_v:128 bv128nw8=closed_form.block_v:128,closed_form.num_warps:8 mr160=closed_form.flush_max_registers:160 mr128=closed_form.flush_max_registers:128"
  timeout 170 $K .k/scripts/gpu_profile_ops.py --batches 64,256 --only "mixed" --variants $V --json $R/prof2_sweep.json 2>&1 | grep -v " replay " | tail -70
  N="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats -k regex:_flush_coefficients_kernel|_window_outputs_kernel|_fold_kernel|_recurrence_kernel --launch-skip 5 --launch-count 5"
  PYTHONPATH=.k/src timeout 150 $N python3 .k/scripts/gpu_ncu_kernels.py --batch 256 > $R/ncu_fp32.txt 2>&1
  grep -E "^  _|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Compute \(SM\) Throughput|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued|Block Limit Reg|stalled" $R/ncu_fp32.txt | cut -c1-220 | head -90
  ;;
3)
  timeout 150 $K -m pytest -q -x -m gpu .k/tests/gpu/test_chunked_gpu.py -k "closed_form or flush" -p no:cacheprovider 2>&1 | tail -8
  V="cw1=closed_form.coef_warps:1 cw2=closed_form.coef_warps:2 fbv32=closed_form.flush_block_v:32 fbv128=closed_form.flush_block_v:128 tf32c=closed_form.tf32_coefficients:1 combo=closed_form.coef_warps:1,closed_form.flush_block_v:32,closed_form.tf32_coefficients:1"
  timeout 200 $K .k/scripts/gpu_profile_ops.py --batches 16,64,256 --only "mixed" --variants $V --json $R/prof3_sweep.json 2>&1 | grep -v " replay " | tail -80
  ;;
4)
  timeout 150 $K -m pytest -q -x -m gpu .k/tests/gpu/test_chunked_gpu.py -k "closed_form or flush or graph" -p no:cacheprovider 2>&1 | tail -8
  V="ov1=closed_form.overlap:1 ns3=closed_form.num_stages:3 kc32=closed_form.k_chunk:32 ov1ns3=closed_form.overlap:1,closed_form.num_stages:3"
  timeout 150 $K .k/scripts/gpu_profile_ops.py --batches 16,64,256 --only "closed_form" --variants $V --json $R/prof4_sweep.json 2>&1 | grep -v -e " replay " -e "history 6" -e "flush 3" | tail -80
  V="ro64=exact_read_only.block_v:64 ro32=exact_read_only.block_v:32 w32=exact_write.block_v:32 w128=exact_write.block_v:128"
  timeout 150 $K .k/scripts/gpu_profile_ops.py --batches 64,256 --state-dtype bfloat16 --only "plain decode,fold verify,fold commit,snapshot verify" --variants $V --json $R/prof4_bf16.json 2>&1 | tail -40
  ;;
esac
