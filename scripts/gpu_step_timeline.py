"""Where a closed batch's decode time goes, step by step: one ``StepGenerator.generate``
of ``bench e2e``'s shapes, its steps' live rows, buckets and times, beside each
bucket's steady step cost.

    PYTHONPATH=src python3 scripts/gpu_step_timeline.py [--mode circular] [--batch 256] [--reps 20]

The model, engine and drafter are ``bench e2e``'s (``qwen3.5-shapes``, bf16, the forced
drafter at P = 0.8, 64 prompt + 128 new tokens, one request a slot: the closed batch
the ``bench e2e`` rows time). Every step is captured first and one untimed run meets
every shape; then one timed run. Printed per step: live rows, bucket, its
``StepStats.seconds`` and whether it was launched ahead. Then every bucket the run
used is replayed alone (``--reps`` graph replays between two CUDA events, on slots
freshly allocated and not prefilled: a step's cost does not depend on its tokens) and
the run is split into

* ``steady``: the steps the run would take without a drain (its decode tokens, the
  prompt passes' first tokens not counted, at the full bucket's tokens a step) at the
  full bucket's cost;
* ``buckets``: the sum of each step's bucket cost, so ``buckets - steady`` is what the
  drain's smaller (and padded) steps cost;
* the rest of the decode time: the host between steps (reads not overlapped, launches).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from replayssm.bench.e2e import E2EConfig, load_model, make_drafter, make_prompts, mode_engine_options, request_budgets
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.generator import StepGenerator


def bucket_cost_ms(gen: StepGenerator, rows: int, reps: int) -> float:
    """The steady cost of one replay of bucket ``rows``'s step, on ``rows`` fresh slots."""
    eng = gen.engine
    slots = eng.alloc_many(rows)
    try:
        step = gen._step(rows)
        step.set_rows(slots)
        for _ in range(3):
            step.run()
        if not step.out.is_cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                step.run()
            return 1e3 * (time.perf_counter() - t0) / reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step.run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    finally:
        eng.free_many(slots)


class HostTimes:
    """Host seconds spent inside some of a generator's methods (wrapped on the instance),
    and when the first ``_launch`` began, from the run's start."""

    def __init__(self, obj, names):
        self.total = collections.Counter()
        self.calls = collections.Counter()
        self.first_launch = None
        self.t_start = None
        for name in names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.total[name] += t1 - t0
                self.calls[name] += 1
                if name == "_launch" and self.first_launch is None:
                    self.first_launch = t0 - self.t_start
        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="circular", choices=("plain", "fold", "circular"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20, help="graph replays per bucket (each up to 4 KV tokens)")
    ap.add_argument("--device", default="cuda", help="cpu: the tiny model in fp32, to try the script")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    cfg = E2EConfig(random_model="qwen3.5-shapes" if cuda else "tiny", device=a.device,
                    dtype="bf16" if cuda else "fp32", drafter="forced", acceptance=(0.8,), max_new_tokens=128,
                    prompt_len=64, ring_len=16)
    if 4 * (a.reps + 3) > cfg.longest:
        raise SystemExit(f"--reps {a.reps}: the bucket replays would pass the engine's {cfg.longest} KV tokens")
    model, _, _ = load_model(cfg)
    n = cfg.requests(a.batch)
    plain = a.mode == "plain"
    window = 1 if plain else cfg.window
    engine = HybridEngine(model, num_slots=a.batch, window=window, max_len=cfg.longest + window,
                          **mode_engine_options(a.mode, cfg))
    drafter = None if plain else make_drafter(cfg, engine, model)
    if drafter is not None:
        drafter.set_acceptance(0.8)
    gen = StepGenerator(engine, drafter, num_draft=cfg.num_draft, eos_token_ids=(), graphs=cuda)
    gen.capture()
    with torch.inference_mode():
        gen.generate(make_prompts(cfg, n, 256, None, warmup=True), request_budgets(cfg, n, warmup=True))
        prompts, budgets = make_prompts(cfg, n, 256, None), request_budgets(cfg, n)
        host = HostTimes(gen, ("_admit", "_prefill_pass", "_launch", "_decode_step", "_release"))
        if cuda:
            torch.cuda.synchronize()
        host.t_start = time.perf_counter()
        res = gen.generate(prompts, budgets)
        wall = time.perf_counter() - host.t_start
        s = res.stats
        step_buckets = [gen._bucket(r) for r in s.rows]
        per_bucket = collections.Counter(step_buckets)
        used = sorted(per_bucket)
        cost = {b: bucket_cost_ms(gen, b, a.reps) for b in used}
    print(f"{a.mode} batch {a.batch}: {res.steps} steps, {res.num_generated} tokens, decode {1e3 * res.decode_s:.2f} ms "
          f"({1e3 * res.decode_s / res.steps:.3f} a step; step p50 {1e3 * statistics.median(s.seconds):.3f})")
    print(" step  live bucket  tokens  seconds ms  ahead  bucket cost ms")
    for i, (rows, b, sec, ahead, emitted) in enumerate(zip(s.rows, step_buckets, s.seconds, s.ahead, s.emitted)):
        print(f"{i:5d} {rows:5d} {b:6d} {emitted:7d} {1e3 * sec:11.3f} {'yes' if ahead else 'no':>6} {cost[b]:15.3f}")
    full = cost[gen._bucket(a.batch)]
    first = s.emitted[0] / s.rows[0]  # tokens a live request takes a step, before any stops
    rate = sum(e for e, r in zip(s.emitted, s.rows) if r == a.batch) / sum(r for r in s.rows if r == a.batch)
    # the decode steps' tokens: each request's first token comes from its prompt pass
    steady = (res.num_generated - n) / (a.batch * rate) * full
    buckets = sum(cost[b] for b in step_buckets)
    print(f"tokens a step at the full batch {rate:.3f} (first step {first:.3f}); bucket costs ms: "
          + ", ".join(f"{b}: {cost[b]:.3f} x {per_bucket[b]}" for b in used))
    print(f"wall {1e3 * wall:.2f} ms: prefill passes {1e3 * res.prefill_s:.2f}, the first launch at "
          f"{1e3 * host.first_launch:.2f}, the steps' seconds {1e3 * sum(s.seconds):.2f}; host ms inside "
          + ", ".join(f"{k} {1e3 * v:.2f} ({host.calls[k]} calls)" for k, v in host.total.items()))
    print(f"decode {1e3 * res.decode_s:.2f} ms = steady {steady:.2f} + the drain's buckets {buckets - steady:.2f} "
          f"+ the rest (host between steps, replays beside the buckets' alone) {1e3 * res.decode_s - buckets:.2f}")


if __name__ == "__main__":
    main()
