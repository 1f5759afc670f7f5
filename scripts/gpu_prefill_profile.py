"""One prompt pass on the GPU: wall time against the GPU's kernel time, the kernels by
GPU time and the host synchronisations, per (batch, prompt length).

    PYTHONPATH=src python3 scripts/gpu_prefill_profile.py                       # the cases below
    PYTHONPATH=src python3 scripts/gpu_prefill_profile.py --cases 1x64,16x2048 --prompt-graphs off
    PYTHONPATH=src python3 scripts/gpu_prefill_profile.py --cases 16x2048 --conv 256x16,512x16,256x32,256x64

The model is ``bench e2e``'s qwen3.5-shapes (random weights, bf16); prompts are random
bytes, fresh requests every pass (slots allocated before the clock starts, freed after).
Wall time: the ``extend(prompt=True)`` call to a synchronised device, median of 5 after
two warm-up passes (which capture a prompt graph's shape). The profiled pass is one more.
``--conv BCxBT,...`` repeats the cases per setting of the conv kernel's channel block
and prompt token block (``replayssm.ops.conv.CONV_BLOCK``, ``CONV_TOKEN_BLOCK``, read at
each launch), each on an engine of its own (its graphs captured with that setting).
``--attention flash,cudnn`` likewise repeats them per SDPA backend of the static passes'
attention (``replayssm.engine.kv_cache.static_attention_backend``, replaced per run).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from replayssm.bench.common import time_prompt_pass
from replayssm.bench.e2e import QWEN35_SHAPES
from replayssm.engine import kv_cache
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.random_model import build_tiny_model
from replayssm.ops import conv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x64,1x400,4x100,1x2048,1x4000,16x2048",
                    help="BATCHxPROMPT_LEN, comma-separated")
    ap.add_argument("--prefill", default="auto", choices=("auto", "chunk", "recurrence"))
    ap.add_argument("--prompt-graphs", default="on", choices=("on", "off"))
    ap.add_argument("--top", type=int, default=12, help="kernels listed per case")
    ap.add_argument("--conv", default="",
                    help="BCxBT settings of the conv kernel (channel block x prompt token block), comma-separated; "
                         "default: the module's")
    ap.add_argument("--attention", default="",
                    help="SDPA backends of the prompt attention (flash, cudnn, efficient), comma-separated; "
                         "default: the module's")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    model = build_tiny_model("qwen3_5", seed=0, dtype=torch.bfloat16, device=torch.device("cuda"), **QWEN35_SHAPES)
    settings = [tuple(int(v) for v in c.split("x")) for c in args.conv.split(",")] if args.conv else [None]
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    attention = [backends[a] for a in args.attention.split(",")] if args.attention else [None]
    for backend in attention:
        if backend is not None:
            kv_cache.static_attention_backend = lambda device, backend=backend: backend
            print(f"##### prompt attention: {backend.name}", flush=True)
        for setting in settings:
            if setting is not None:
                conv.CONV_BLOCK, conv.CONV_TOKEN_BLOCK = setting
                print(f"##### conv: CONV_BLOCK {setting[0]}, CONV_TOKEN_BLOCK {setting[1]}")
            profile_cases(model, cases, args)


def profile_cases(model, cases, args) -> None:
    eng = HybridEngine(model, num_slots=max(b for b, _ in cases), window=1, max_len=max(p for _, p in cases) + 64,
                       prefill=args.prefill, prompt_graphs=args.prompt_graphs == "on")
    print("GDN prompt kernel:", eng.prefill_kernel, "| prompt graphs:", args.prompt_graphs)
    g = torch.Generator().manual_seed(1)
    for batch, length in cases:
        def once(around=None) -> float:
            return time_prompt_pass(eng, batch, length, g, around=around)

        with torch.inference_mode():
            warm = [once(), once()]  # the first captures the shape's graph
            print(f"--- B={batch} P={length}: warm-up passes {', '.join(f'{1e3 * w:.1f}' for w in warm)} ms",
                  flush=True)
            wall = statistics.median(once() for _ in range(5))
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            once(around=prof)  # the profiler records the pass alone, not the slots' alloc and free
        events = prof.key_averages()
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        syncs = {e.key: e.count for e in events if "Synchronize" in e.key or "Memcpy" in e.key}
        print(f"=== B={batch} P={length}: wall p50 {1e3 * wall:.2f} ms; GPU kernels "
              f"{sum(e.self_device_time_total for e in gpu) / 1e3:.2f} ms in {sum(e.count for e in gpu)} kernels; "
              f"passes so far {eng.prompt_passes}; host copies and syncs of the profiled pass {syncs}", flush=True)
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
