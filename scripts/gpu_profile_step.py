"""Where a graphed decode step's time goes, on a CUDA GPU.

For each (mode, batch) it sets up live requests, captures the step, and reports:

* GPU time per step: replays of the captured step timed with CUDA events (no host
  work between them), against the wall time of a step as the generator takes it
  (replay plus the read of its output);
* the step's kernels by total GPU time (torch profiler over a few replays), with the
  count of kernels per step.

    PYTHONPATH=src python3 scripts/gpu_profile_step.py --batches 1,64 --modes plain,fold,circular
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from replayssm.bench.e2e import QWEN35_SHAPES
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import OracleDrafter
from replayssm.engine.generator import StepGenerator, _Request
from replayssm.engine.random_model import build_tiny_model


def profile(model, mode: str, batch: int, k: int, reps: int, top: int) -> dict:
    window = 1 if mode == "plain" else k + 1
    engine = HybridEngine(model, strategy="fold" if mode == "plain" else mode, num_slots=batch, window=window,
                          max_len=64 + (reps + 40) * window + window)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 256, (batch, 64), generator=g).tolist()
    refs = torch.randint(0, 256, (batch, 64 + (reps + 40) * window), generator=g).tolist()
    drafter = None if mode == "plain" else OracleDrafter(refs, 0.8, vocab)
    gen = StepGenerator(engine, drafter, num_draft=k)
    with torch.inference_mode():
        reqs = [_Request(i, engine.alloc(), p, 10**6) for i, p in enumerate(prompts)]
        gen._prefill(reqs, None)
        step = gen._step(batch)
        step.set_rows([r.slot for r in reqs])
        for _ in range(5):
            step.run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step.run()[:batch].tolist()
        wall_ms = (time.perf_counter() - t0) / 10 * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step.graph.replay()
        end.record()
        torch.cuda.synchronize()
        gpu_ms = start.elapsed_time(end) / reps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step.graph.replay()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / 5
    count = sum(e.count for e in events) / 5
    kernels = sorted(events, key=lambda e: -e.device_time_total)[:top]
    rows = [{"kernel": e.key[:90], "us_per_step": e.device_time_total / 5, "calls_per_step": e.count / 5}
            for e in kernels]
    print(f"\n== {mode} batch {batch} (T={window}): GPU {gpu_ms:.3f} ms/step (graph replays), wall {wall_ms:.3f} "
          f"ms/step (replay + output read); profiled {total / 1e3:.3f} ms in {count:.0f} kernels per step")
    for r in rows:
        print(f"   {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}")
    return {"mode": mode, "batch": batch, "window": window, "gpu_ms": gpu_ms, "wall_ms": wall_ms,
            "kernels_per_step": count, "profiled_ms": total / 1e3, "top": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="plain,snapshot,fold,circular")
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="FAMILY.PARAM=VALUE",
                    help="override a row of the kernels' shape table (replayssm/ops/tuning.py) for the whole run "
                         "(e.g. exact_read_only.block_v=64)")
    args = ap.parse_args()
    import contextlib

    from replayssm.ops import tuning

    overrides = contextlib.ExitStack()
    for item in args.set:
        target, _, value = item.partition("=")
        family, _, param = target.partition(".")
        try:
            overrides.enter_context(tuning.override(family, **{param: int(value)}))
        except ValueError as e:
            ap.error(str(e))
        print(f"set {family}.{param} = {value}")
    model = build_tiny_model("qwen3_5", seed=0, dtype=torch.bfloat16, device="cuda", **QWEN35_SHAPES)
    out = [profile(model, m, int(b), args.num_draft, args.reps, args.top)
           for b in args.batches.split(",") for m in args.modes.split(",")]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"card": torch.cuda.get_device_name(), "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
