"""``replayssm run`` (what ``make run`` calls): the main job on the embedded default.

The embedded default is a tiny random-weight Qwen3.5-architecture model built in
process (3 GDN layers + 1 full-attention layer, see :mod:`replayssm.engine.tiny`). The
job decodes a batch of prompts plainly, then speculatively with n-gram drafting under
each strategy, and checks that every greedy output equals the plain one token for
token. It prints accept length, tokens per second and state memory per strategy and
exits non-zero when an exact strategy (snapshot, fold) disagrees with plain decoding.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..bench.args import device_name, name_list, positive_int
from ..strategies import STRATEGY_NAMES

PROMPTS = (
    "The state of a gated delta rule layer",
    "def verify(window):",
    "Speculative decoding drafts tokens, then",
    "1, 2, 3, 5, 8, 13,",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=("qwen3_5", "qwen3_next"), default="qwen3_5",
                        help="architecture of the embedded tiny model")
    parser.add_argument("--strategies", type=name_list(STRATEGY_NAMES), default=STRATEGY_NAMES,
                        help=f"strategies to run, comma-separated (default {','.join(STRATEGY_NAMES)})")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--batch", type=positive_int, default=len(PROMPTS),
                        help=f"requests ({len(PROMPTS)} prompts, cycled; default {len(PROMPTS)})")
    parser.add_argument("--num-draft", type=positive_int, default=3, help="n-gram draft tokens per step (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")


def main(args) -> int:
    from .adapter import HybridEngine
    from .device_drafters import DeviceNgramDrafter
    from .generate import describe_memory
    from .generator import StepGenerator
    from .loading import resolve_device
    from .tiny import build_tiny_model, tiny_tokenizer

    device = resolve_device(args.device)
    tokenizer = tiny_tokenizer()
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    model = build_tiny_model(args.family, seed=args.seed, device=device)
    cfg = model.config
    print(f"replayssm run: embedded tiny {args.family} model (random weights, seed {args.seed}), "
          f"{cfg.num_hidden_layers} layers {cfg.layer_types}, GDN heads H={cfg.linear_num_key_heads} "
          f"HV={cfg.linear_num_value_heads} K={cfg.linear_key_head_dim} V={cfg.linear_value_head_dim}, "
          f"{model.dtype}, {device}")
    print(f"{args.batch} requests x {args.max_new_tokens} tokens, greedy; drafter: n-gram prompt lookup, "
          f"k={args.num_draft}")
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + args.num_draft + 2

    def run(strategy: str | None):
        window = 1 if strategy is None else args.num_draft + 1
        engine = HybridEngine(model, strategy=strategy or "fold", num_slots=args.batch, window=window,
                              max_len=max_len)
        drafter = None if strategy is None else DeviceNgramDrafter()
        # static-shape steps: one CUDA graph each on a GPU, the same steps eagerly here
        gen = StepGenerator(engine, drafter, num_draft=args.num_draft, eos_token_ids=())
        return engine, gen.generate(prompts, args.max_new_tokens)

    t0 = time.perf_counter()
    print("\n[plain] decoding one token per step (exact recurrence) ...", flush=True)
    _, plain = run(None)
    print(f"[plain] {plain.num_generated} tokens, {plain.tokens_per_second:.1f} tok/s")
    text = tokenizer.decode(plain.tokens[0], skip_special_tokens=True)
    print(f"[plain] request 0 continues {PROMPTS[0]!r} with {text[:60]!r}...")

    rows, failed = [], []
    for strategy in args.strategies:
        print(f"\n[{strategy}] speculative decoding with n-gram drafts ...", flush=True)
        engine, res = run(strategy)
        same = sum(a == b for x, y in zip(res.tokens, plain.tokens) for a, b in zip(x, y))
        total = sum(len(y) for y in plain.tokens)
        agree = res.tokens == plain.tokens
        exact = engine.strategy.exact_outputs
        print(f"[{strategy}] {res.num_generated} tokens in {res.steps} steps, accept length "
              f"{res.mean_accept_length:.2f}, {res.tokens_per_second:.1f} tok/s; greedy output "
              f"{'EQUALS' if agree else 'DIFFERS FROM'} plain decoding ({same}/{total} tokens)")
        print(f"[{strategy}] state memory: {describe_memory(engine)}")
        rows.append((strategy, res, same, total, engine))
        if not agree and exact:
            failed.append(strategy)
        elif not agree:
            print(f"[{strategy}] note: {strategy} computes verify outputs in closed form, equal to the "
                  "recurrence only to rounding; a near-tie can flip a greedy token")

    print(f"\n{'strategy':<10} {'tokens':>7} {'steps':>6} {'accept len':>10} {'tok/s':>8} "
          f"{'state/request':>14} {'agree':>11}")
    print(f"{'plain':<10} {plain.num_generated:>7} {plain.steps:>6} {1.0:>10.2f} {plain.tokens_per_second:>8.1f} "
          f"{'':>14} {'-':>11}")
    for strategy, res, same, total, engine in rows:
        per_req = engine.pool.nbytes_per_slot()["total"]
        print(f"{strategy:<10} {res.num_generated:>7} {res.steps:>6} {res.mean_accept_length:>10.2f} "
              f"{res.tokens_per_second:>8.1f} {per_req / 1024:>11.1f} KiB {same:>5}/{total:<5}")
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    if failed:
        print(f"FAIL: exact strategies {failed} disagree with plain greedy decoding", file=sys.stderr)
        return 1
    print("OK: greedy speculative outputs of the exact strategies equal plain decoding token for token")
    return 0
