"""Where a decode loop's time goes between its steps: one ``StepGenerator.generate`` of
``bench e2e``'s shapes under Python's profiler.

    PYTHONPATH=src python3 scripts/gpu_profile_loop.py [--mode circular] [--batch 64] \
        [--requests-per-slot 4] [--top 30]

The model, engine and drafter are ``bench e2e``'s (``qwen3.5-shapes``, bf16, the forced
drafter at P = 0.8, 64 prompt + 128 new tokens); every step is captured first and one
untimed run meets every shape. Then one timed run under ``cProfile``. Printed: the run's
decode time per step against its steps' median (as ``bench e2e``'s
``decode_ms_per_step`` and ``step_ms_p50``), the share of steps launched ahead, and the
loop's functions by cumulative host time (a function that waits for the device counts
the wait: the step's output read, a synchronisation). The prompt passes are there too
(``_prefill_pass``); ``bench e2e`` keeps their time out of the decode rate.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics

import torch

from replayssm.bench.e2e import E2EConfig, load_model, make_drafter, make_prompts, mode_engine_options, request_budgets
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="circular", choices=("plain", "fold", "circular", "snapshot"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--device", default="cuda", help="cpu: the tiny model in fp32, to try the script")
    ap.add_argument("--no-join-ahead", action="store_true", help="StepGenerator(join_ahead=False)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    cfg = E2EConfig(random_model="qwen3.5-shapes" if cuda else "tiny", device=a.device, dtype="bf16" if cuda else "fp32", drafter="forced", acceptance=(0.8,),
                    max_new_tokens=128, prompt_len=64, requests_per_slot=a.requests_per_slot)
    model, _, _ = load_model(cfg)
    n = cfg.requests(a.batch)
    window = 1 if a.mode == "plain" else cfg.window
    engine = HybridEngine(model, num_slots=a.batch, window=window, max_len=cfg.longest + window,
                          **mode_engine_options("plain" if a.mode == "plain" else a.mode, cfg))
    drafter = None if a.mode == "plain" else make_drafter(cfg, engine, model)
    if drafter is not None:
        drafter.set_acceptance(0.8)
    gen = StepGenerator(engine, drafter, num_draft=cfg.num_draft, eos_token_ids=(), graphs=cuda,
                        join_ahead=not a.no_join_ahead)
    gen.capture()
    with torch.inference_mode():
        gen.generate(make_prompts(cfg, n, 256, None, warmup=True), request_budgets(cfg, n, warmup=True))
        prompts, budgets = make_prompts(cfg, n, 256, None), request_budgets(cfg, n)
        prof = cProfile.Profile()
        prof.enable()
        res = gen.generate(prompts, budgets)
        prof.disable()
    s = res.stats
    print(f"{a.mode} batch {a.batch}, {n} requests, joins {'between steps' if a.no_join_ahead else 'ahead'}: {res.steps} steps, decode {1e3 * res.decode_s / res.steps:.3f} "
          f"ms a step against a step p50 of {1e3 * statistics.median(s.seconds):.3f} (mean "
          f"{1e3 * statistics.mean(s.seconds):.3f}); launched ahead {sum(s.ahead) / len(s.ahead):.0%}; "
          f"{len(s.prefills)} prompt passes, {1e3 * res.prefill_s:.1f} ms")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(a.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
