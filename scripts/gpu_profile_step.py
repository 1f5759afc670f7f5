"""Where a graphed decode step's time goes, on a CUDA GPU.

For each (mode, batch) it sets up live requests, captures the step, and reports:

* GPU time per step: replays of the captured step timed with CUDA events (no host
  work between them), against the wall time of a step as the generator takes it:
  replay then the read of its output, and the next replay queued before that read
  (the generator's ``run_ahead``);
* the step's kernels by total GPU time (torch profiler over a few replays), with the
  count of kernels per step;
* for speculative modes, the drafter alone: its update and next proposal
  (``observe`` + ``propose``, what the step runs after the commit) captured in a graph
  of their own at the step's shapes, timed by replays, with its kernel count;
* every kernel summed by part (matrix products, GDN state, conv, attention, norms,
  other) beside each part's bound, from the card's copy and matmul rates measured in
  the same run (:mod:`replayssm.bench.step_bounds`; chains only, not trees).

Drafters: ``oracle`` (set acceptance 0.8 on its reference tokens, a few tensor ops),
``forced`` (each draft accepted with probability 0.8 by a seeded draw, whatever the
numerics: every strategy runs the same accepted counts) or ``mtp`` (the model's MTP head:
the checkpoint's with ``--model``, a random-weight one on the random model).

    PYTHONPATH=src python3 scripts/gpu_profile_step.py --batches 1,64 --modes plain,fold,circular
    PYTHONPATH=src python3 scripts/gpu_profile_step.py --batches 64,256 --modes plain,plain_ring
    PYTHONPATH=src python3 scripts/gpu_profile_step.py --model embedded --drafter mtp --modes plain,fold
    PYTHONPATH=src python3 scripts/gpu_profile_step.py --model embedded --drafter mtp --modes fold --tree 3,2,1 \
        [--chain-from 16]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from replayssm.bench import common
from replayssm.bench.compute_floor import measure_matmul_rate
from replayssm.bench.e2e import E2EConfig, load_model, make_drafter
from replayssm.bench.step_bounds import format_parts, parts_against_bounds, step_bounds
from replayssm.engine.adapter import HybridEngine
from replayssm.engine.device_drafters import ForcedDrafter, OracleDrafter
from replayssm.engine.generator import StepGenerator, StepStats, _Request


def _replay_ms(graph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _kernels(graph) -> tuple[list, float, float]:
    """(CUDA events, GPU us, kernels) per replay of ``graph``, over 5 profiled replays."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return events, sum(e.device_time_total for e in events) / 5, sum(e.count for e in events) / 5


def drafter_alone(gen: StepGenerator, step, reps: int) -> dict:
    """The drafter's share of a step: ``observe`` (every window position emitted, as
    when all drafts are accepted) then ``propose``, on the step's rows and shapes, in
    a CUDA graph of its own. The target's hidden states are random (the cost does not
    depend on their values); the head's cache entries it writes lie past the
    committed lengths."""
    eng, drafter, b, t = gen.engine, gen.drafter, step.rows, step.window
    if getattr(drafter, "tree", None) is not None:  # a tree drafter observes the accepted path
        t = drafter.tree.max_depth + 1
    slot_idx = step.slot_idx
    emitted = gen.windows[slot_idx][:, :t].clone()
    accepted = torch.full((b,), t, dtype=torch.int64, device=eng.device)
    positions = eng.kv.device_lengths[slot_idx][:, None] + torch.arange(t, device=eng.device)
    g = torch.Generator(device=eng.device).manual_seed(0)
    hidden = torch.randn(b * t, eng.config.hidden_size, device=eng.device, dtype=eng.dtype, generator=g)

    def body():
        drafter.observe(slot_idx, emitted, accepted, hidden=hidden, positions=positions)
        drafter.propose(slot_idx)

    graph = common.capture_graph(body, warmup_steps=2)
    ms = _replay_ms(graph, reps)
    _, total, count = _kernels(graph)
    return {"drafter_gpu_ms": ms, "drafter_kernels": count, "drafter_profiled_ms": total / 1e3}


def profile(model, mode: str, batch: int, k: int, reps: int, top: int, drafter_kind: str = "oracle",
            cfg: E2EConfig | None = None, branching: tuple[int, ...] = (), chain_from: int | None = None,
            rates: dict | None = None, accept: int | None = None) -> dict:
    from replayssm.engine.trees import StaticTree

    plain = mode in ("plain", "plain_ring")
    tree_nodes = StaticTree.from_branching(branching, "cpu").num_nodes if branching and not plain else 0
    window = 1 if plain else tree_nodes or k + 1
    # plain_ring: plain steps through circular's ring (bench e2e's plain-ring mode, its ring of 16)
    options = (dict(strategy="circular", ring_len=16, plain_via_ring=True) if mode == "plain_ring"
               else dict(strategy="fold" if mode == "plain" else mode))
    engine = HybridEngine(model, **options, num_slots=batch, window=window, max_len=64 + (reps + 40) * window + window)
    tree = StaticTree.from_branching(branching, engine.device) if tree_nodes else None
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, min(vocab, 256), (batch, 64), generator=g).tolist()
    refs = torch.randint(0, min(vocab, 256), (batch, 64 + (reps + 40) * window), generator=g).tolist()
    if plain:
        drafter = None
    elif drafter_kind == "mtp":
        drafter = make_drafter(cfg, engine, model, tree=tree)
    elif drafter_kind == "forced":
        drafter = ForcedDrafter(0.8, vocab)
    else:
        drafter = OracleDrafter(refs, 0.8, vocab)
    gen = StepGenerator(engine, drafter, num_draft=k, tree=tree, chain_from=chain_from if tree is not None else None)
    with torch.inference_mode():
        reqs = [_Request(i, -1, p, 10**6, ids=np.array(p, dtype=np.int64)) for i, p in enumerate(prompts)]
        for r, slot in zip(reqs, engine.alloc_many(batch)):
            r.slot, r.generation = slot, engine.pool.generation(slot)
        gen._prefill_pass(reqs, StepStats(), None)
        step = gen._step(batch)
        step.set_rows([r.slot for r in reqs], [r.generation for r in reqs])
        for _ in range(5):
            step.run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step.run()
            step.out[:batch].tolist()
        wall_ms = (time.perf_counter() - t0) / 10 * 1e3
        # the generator's loop with each next step queued before the read (run_ahead)
        step.run()
        t0 = time.perf_counter()
        for _ in range(10):
            gen._read(step, batch, True)
        ahead_ms = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
        gpu_ms = _replay_ms(step.graph, reps)
        events, total, count = _kernels(step.graph)
        alone = drafter_alone(gen, step, reps) if drafter is not None else {}
        context = engine.kv.device_lengths[step.slot_idx].double().mean().item()
    parts = None
    if rates is not None and tree is None:  # the bounds' byte model is a chain's
        bounds = step_bounds(engine, rows=batch, window=window, accept=1 if plain else accept or k,
                             context=context, copy_bw=rates["copy_Bps"], matmul_rate=rates["matmul_flops_per_s"])
        parts = parts_against_bounds([(e.key, e.device_time_total / 5) for e in events], bounds)
    kernels = sorted(events, key=lambda e: -e.device_time_total)[:top]
    rows = [{"kernel": e.key[:90], "us_per_step": e.device_time_total / 5, "calls_per_step": e.count / 5}
            for e in kernels]
    print(f"\n== {mode} batch {batch} (T={window}): GPU {gpu_ms:.3f} ms/step (graph replays), wall {wall_ms:.3f} "
          f"ms/step (replay + output read), {ahead_ms:.3f} with the next replay queued before the read; "
          f"profiled {total / 1e3:.3f} ms in {count:.0f} kernels per step")
    if alone:
        print(f"   drafter {drafter_kind} alone (observe + propose): GPU {alone['drafter_gpu_ms']:.3f} ms in "
              f"{alone['drafter_kernels']:.0f} kernels, {alone['drafter_gpu_ms'] / gpu_ms:.0%} of the step")
    for r in rows:
        print(f"   {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}")
    if parts is not None:
        print(f"   by part, against each part's bound (context {context:.0f} tokens):")
        print(format_parts(parts))
    return {"mode": mode, "batch": batch, "window": window, "drafter": None if plain else drafter_kind,
            "tree": list(branching) if tree is not None else None, "chain_from": chain_from if tree is not None else None,
            "gpu_ms": gpu_ms, "wall_ms": wall_ms, "wall_run_ahead_ms": ahead_ms, "kernels_per_step": count,
            "profiled_ms": total / 1e3, "top": rows, "context": context, "parts": parts,
            **alone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="plain,snapshot,fold,circular")
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--model", default=None, help="a checkpoint directory or 'embedded' (default: the random "
                                                   "qwen3.5-shapes model in bf16)")
    ap.add_argument("--drafter", choices=("oracle", "forced", "mtp"), default="oracle")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tree", default="", metavar="BRANCHING",
                    help="speculative modes verify a draft tree of this branching per depth (e.g. 3,2,1; mtp drafter)")
    ap.add_argument("--chain-from", type=int, default=None, metavar="B",
                    help="with --tree, buckets of at least B rows verify the tree's spine as a chain")
    ap.add_argument("--accept", type=int, default=None,
                    help="tokens a request commits a speculative step, for the state's byte bound (default: "
                         "--num-draft, about the mean at acceptance 0.8)")
    ap.add_argument("--no-bounds", action="store_true", help="skip the parts' bounds (and measuring the rates)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="FAMILY.PARAM=VALUE",
                    help="override a row of the kernels' shape table (replayssm/ops/tuning.py) for the whole run "
                         "(e.g. exact_read_only.block_v=64)")
    args = ap.parse_args()
    if args.accept is not None and not 1 <= args.accept <= args.num_draft + 1:
        ap.error(f"--accept must be between 1 and --num-draft + 1 ({args.num_draft + 1}), got {args.accept}")
    branching = tuple(int(x) for x in args.tree.split(",")) if args.tree else ()
    if branching and args.drafter != "mtp":
        ap.error("--tree takes the mtp drafter (--drafter mtp)")
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
    model_dir = None
    if args.model is not None:
        from replayssm.engine.loading import resolve_model_path

        model_dir = str(resolve_model_path(args.model))  # "embedded": the checkpoint in the package
    cfg = E2EConfig(model=model_dir, random_model="qwen3.5-shapes", device="cuda", dtype="bf16", drafter=args.drafter)
    model, description, _ = load_model(cfg)
    rates = None
    if not args.no_bounds:
        device = torch.device("cuda")
        rates = {"copy_Bps": common.copy_bandwidth(device),
                 "matmul_flops_per_s": measure_matmul_rate(device, model.dtype)["flops_per_s"]}
        print(f"copy rate {rates['copy_Bps'] / 1e9:.0f} GB/s, matmul rate {rates['matmul_flops_per_s'] / 1e12:.1f} "
              f"TFLOP/s ({model.dtype})")
    out = [profile(model, m, int(b), args.num_draft, args.reps, args.top, args.drafter, cfg, branching, args.chain_from,
                   rates, args.accept)
           for b in args.batches.split(",") for m in args.modes.split(",")]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"card": torch.cuda.get_device_name(), "model": description, "rates": rates, "rows": out},
                      fh, indent=1)


if __name__ == "__main__":
    main()
