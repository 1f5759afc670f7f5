"""Where a speculative request's prompt pass goes: the MTP drafter's join piece by piece.

    PYTHONPATH=src python3 scripts/gpu_profile_join.py [DEVICE [BATCH [PROMPT_LEN]]]   # cuda 1 512

On the embedded model with its MTP head (bf16 on CUDA, fp32 elsewhere), for fold and
circular: a StepGenerator with every step captured generates 2 tokens for ``BATCH``
fresh random prompts of ``PROMPT_LEN`` tokens, 2 runs untimed and 4 timed. Each timed
call below is wrapped in device synchronisations (outside graph captures) and reported
as its median: the prompt pass (``extend``; a static one runs the head's keys and
values of the prompt inside it), the generator's join, and inside it the drafter's join
(``join_cached`` after a static pass, else ``join`` with its pieces: KV reset, the
head's keys and values of the prompt) and its first drafts (``_run_join``: a graph
replay, or eagerly ``_draft`` and the rotary rows' gather). Then the same with Python's
garbage collector off, and on CUDA one join under the profiler (kernels and host ops by
CPU time). Synchronised timers add their own waits: compare the pieces with each other.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

import replayssm.engine.device_drafters as device_drafters
import replayssm.engine.generator as generator
import replayssm.engine.kv_cache as kv_cache
from replayssm.bench.e2e import E2EConfig, load_model, make_drafter, mode_engine_options
from replayssm.cli.common import check_model
from replayssm.engine.adapter import HybridEngine


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    length = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = E2EConfig(model=check_model("--model", "embedded"), drafter="mtp", device=dev,
                    dtype="bf16" if cuda else "fp32", prompt_len=length, max_new_tokens=4)
    model, _, _ = load_model(cfg)
    times: dict[str, list[float]] = {}
    profile_next = []

    def wrap(owner, name, label):
        f = getattr(owner, name)

        def timed(*a, **k):
            if cuda and torch.cuda.is_current_stream_capturing():
                return f(*a, **k)
            if profile_next and label in ("  drafter.join", "  drafter.join_cached"):
                profile_next.clear()
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                    out = f(*a, **k)
                print(prof.key_averages(group_by_stack_n=6).table(sort_by="cpu_time_total", row_limit=30,
                                                                  max_name_column_width=50, max_src_column_width=90))
                return out
            sync()
            t = time.perf_counter()
            out = f(*a, **k)
            sync()
            times.setdefault(label, []).append(time.perf_counter() - t)
            return out

        setattr(owner, name, timed)

    wrap(HybridEngine, "extend", "extend")
    wrap(generator.StepGenerator, "_join", "join")
    wrap(device_drafters.DeviceMTPDrafter, "join", "  drafter.join")
    wrap(device_drafters.DeviceMTPDrafter, "join_cached", "  drafter.join_cached")
    wrap(kv_cache.KVCache, "reset_many", "    cache.reset_many")
    wrap(device_drafters.DeviceMTPDrafter, "_prompt_kv", "    _prompt_kv")
    wrap(kv_cache.KVCache, "advance", "    cache.advance")
    wrap(device_drafters.DeviceMTPDrafter, "_run_join", "    _run_join")
    wrap(device_drafters.DeviceMTPDrafter, "_draft", "    _draft")
    wrap(device_drafters.DeviceMTPDrafter, "_rope_at", "      rotary rows")
    wrap(generator.StepGenerator, "_launch", "launch")
    g = torch.Generator().manual_seed(3)
    for mode in ("fold", "circular"):
        eng = HybridEngine(model, num_slots=batch, window=4, max_len=length + 64, **mode_engine_options(mode, cfg))
        drafter = make_drafter(cfg, eng, model)
        gen = generator.StepGenerator(eng, drafter, num_draft=3, eos_token_ids=(), graphs=cuda)
        gen.capture()
        if eng.prompt_graphs is not None:
            eng.prompt_graphs.prepare(batch, length * batch, longest=length)

        def once():
            prompts = torch.randint(0, 256, (batch, length), generator=g).tolist()
            return gen.generate(prompts, [2] * batch)

        for _ in range(2):
            once()
        times.clear()
        runs = [once() for _ in range(4)]
        print(f"== {mode} B={batch} P={length}: prefill_s p50 "
              f"{1e3 * statistics.median(r.prefill_s for r in runs):.2f} ms", eng.prompt_passes)
        for label, values in times.items():
            print(f"   {label:<20} {1e3 * statistics.median(values):8.3f} ms  x{len(values) // 4}")
        times.clear()
        gc.disable()
        runs = [once() for _ in range(4)]
        gc.enable()
        print(f"   GC off: prefill_s p50 {1e3 * statistics.median(r.prefill_s for r in runs):.2f} ms, "
              f"join {1e3 * statistics.median(times['join']):.2f} ms")
        if cuda:
            profile_next.append(1)
            once()
        del gen, drafter, eng


if __name__ == "__main__":
    main()
