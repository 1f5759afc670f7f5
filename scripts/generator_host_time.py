#!/usr/bin/env python3
"""Host time per decode step of :class:`StepGenerator`, without a model step.

    OMP_NUM_THREADS=1 python scripts/generator_host_time.py --batch 256 --window 4

Every step of the generator is replaced by a stub whose body only writes a prepared
output (each row emits ``--emit`` tokens, none of them an end-of-sequence token), so
the call's CPU time outside its prompt passes is the loop's own host work: choosing the
bucket, ``set_rows``, the read of the output, the stop decision, the KV host lengths,
the emitted tokens and the statistics (CPU time of the process, one thread: other load
on a shared machine does not count). What does not scale with the steps (allocating and
freeing the requests' slots, the call's set-up) is measured by a run of the same
requests with a budget of one token (no decode step) and taken off. Prints
microseconds per step, the least of ``--repeats`` runs (and the whole run's host time,
the slots' set-up and release included: a change to those shows there, not in the net
figure), for uniform budgets (no row
finishes before the last step) and for mixed ones (rows finish and waiting requests
join all along, so most steps also pay for new rows and for the joins' eager work).
On the CPU a step's body runs before ``run()`` returns, so the figures are the host's
whole work per step with or without overlap; on a GPU, overlap hides the bookkeeping
part of it behind the next step's device time.
"""

from __future__ import annotations

import argparse
import time

import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import ForcedDrafter
from replayssm.engine.generator import StepGenerator
from replayssm.engine.random_model import build_tiny_model


def stub(gen: StepGenerator, emit: int) -> None:
    """Build every bucket's step, then make each one's body write ``emit`` tokens per row."""
    gen.capture()
    for step in gen._steps.values():
        out = torch.full_like(step.out, -1)
        out[:, 0] = emit
        out[:, 1 : 1 + emit] = 7  # a token that is no end-of-sequence token
        step._body = lambda step=step, out=out: step.out.copy_(out)


def run(batch: int, window: int, emit: int, budgets: list[int], overlap: bool | None) -> tuple[float, int]:
    """``(CPU seconds of one generate call outside its prompt passes, decode steps)``."""
    model = build_tiny_model("qwen3_5", seed=0)
    eng = HybridEngine(model, strategy="fold", num_slots=batch, window=window, max_len=max(budgets) + window + 8)
    drafter = ForcedDrafter(0.5, model.config.vocab_size) if window > 1 else None
    kwargs = {} if overlap is None else {"overlap": overlap}
    gen = StepGenerator(eng, drafter, num_draft=window - 1, **kwargs) if drafter else StepGenerator(eng, **kwargs)
    stub(gen, emit)
    prefill = [0.0]
    prefill_pass = gen._prefill_pass

    def timed_pass(*args, **kwargs):
        t = time.process_time()
        try:
            return prefill_pass(*args, **kwargs)
        finally:
            prefill[0] += time.process_time() - t

    gen._prefill_pass = timed_pass
    prompts = [[1 + i % 200, 2, 3] for i in range(len(budgets))]
    t = time.process_time()
    res = gen.generate(prompts, budgets)
    return time.process_time() - t - prefill[0], res.steps


def host_times(batch: int, window: int, emit: int, budgets: list[int], overlap: bool | None) -> tuple[float, float, int]:
    """``(net us per step, whole run's host ms, steps)``: the net figure takes off a
    one-token run of the same requests (their slots' allocation and release, the call's
    set-up); the whole run keeps them, so a change to those costs shows there too."""
    seconds, steps = run(batch, window, emit, budgets, overlap)
    fixed, _ = run(batch, window, emit, [1] * len(budgets), overlap)
    return 1e6 * (seconds - fixed) / steps, 1e3 * seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=4, help="1: plain decoding; k + 1 with k drafts")
    ap.add_argument("--emit", type=int, default=None, help="tokens per row per step (default: the window)")
    ap.add_argument("--tokens", type=int, default=400, help="budget of every request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overlap", choices=("on", "off", "default"), default="default")
    a = ap.parse_args()
    torch.set_num_threads(1)
    emit = a.emit or a.window
    overlap = None if a.overlap == "default" else a.overlap == "on"
    uniform = [a.tokens] * a.batch
    # twice the batch, budgets spread from a quarter to the whole: rows finish and join throughout
    mixed = [a.tokens // 4 + (i * 37) % (3 * a.tokens // 4) for i in range(2 * a.batch)]
    with torch.inference_mode():
        for name, budgets in (("uniform", uniform), ("mixed", mixed)):
            runs = [host_times(a.batch, a.window, emit, budgets, overlap) for _ in range(a.repeats)]
            us = min(r[0] for r in runs)
            ms, steps = min((r[1], r[2]) for r in runs)
            print(f"batch {a.batch} window {a.window} {name:>7} budgets: {us:8.1f} us of host work per step "
                  f"(net of slot set-up); whole run {ms:7.1f} ms of host time over {steps} steps")


if __name__ == "__main__":
    main()
