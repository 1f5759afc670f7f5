"""``replayssm run`` (what ``make run`` calls): the main job on the embedded default model.

The embedded default is the checkpoint shipped in the package: a Qwen3.5-architecture
model (6 GDN and 2 full-attention layers, with an MTP head) trained on the Python
standard library by ``replayssm train`` (BENCHMARKS.md says how, and how well). The job

1. decodes a few Python prompts plainly and prints the text;
2. decodes them speculatively under each strategy, drafting with the model's MTP head,
   and checks that every greedy output equals the plain one token for token;
3. measures what drafting buys on this model: tokens per step and acceptance of n-gram
   lookup, the MTP head and the shipped draft model at window ``T = k + 1``, with the
   model's held-out loss beside them.

It exits non-zero when an exact strategy (snapshot, fold) disagrees with plain decoding.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..strategies import STRATEGY_NAMES
from . import common
from .args import device_name, name_list, num_draft, positive_int

PROMPTS = (
    'def read_config(path):\n    """Read the configuration file at *path* and return a dict."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef list_files(root):\n",
    "    def __repr__(self):\n        return",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_options(parser, draft_use="the acceptance summary")
    parser.add_argument("--strategies", type=name_list(STRATEGY_NAMES), default=STRATEGY_NAMES,
                        help=f"strategies to run, comma-separated (default {','.join(STRATEGY_NAMES)})")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96, help="tokens per request (default 96)")
    parser.add_argument("--batch", type=positive_int, default=len(PROMPTS),
                        help=f"requests ({len(PROMPTS)} prompts, cycled; default {len(PROMPTS)})")
    parser.add_argument("--num-draft", type=num_draft, default=3, help="draft tokens per step, at most 15 (default 3)")
    parser.add_argument("--heldout-windows", type=positive_int, default=8,
                        help="held-out windows of 512 tokens for the loss in the summary (default 8)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")


def check_args(args) -> None:
    args.model = common.check_model("--model", args.model)
    common.check_mtp("--model", args.model)
    args.draft_model = common.check_model("--draft-model", args.draft_model)
    common.check_same_tokenizer("--draft-model", args.draft_model, args.model)
    from ..engine.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    args.texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    args.prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in args.texts]
    args.max_len = common.check_lengths(args.model, args.prompt_ids, args.max_new_tokens, num_draft=args.num_draft,
                                        dtype="auto", device=args.device)


def main(args) -> int:
    from ..bench.acceptance import heldout_loss, measure
    from ..engine.adapter import HybridEngine
    from ..engine.factory import make_drafter
    from ..engine.generator import StepGenerator
    from ..engine.loading import load_model, load_tokenizer, model_label, resolve_device

    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.model)
    texts, prompts = args.texts, args.prompt_ids
    model = load_model(args.model, device=str(device))
    cfg = model.config
    print(f"replayssm run: {model_label(args.model)} model\n  {cfg.num_hidden_layers} layers ({cfg.layer_types.count('linear_attention')} "
          f"GDN, {cfg.layer_types.count('full_attention')} full attention), GDN heads H={cfg.linear_num_key_heads} "
          f"HV={cfg.linear_num_value_heads} K={cfg.linear_key_head_dim} V={cfg.linear_value_head_dim}, "
          f"{cfg.vocab_size} tokens, {model.dtype}, {device}")
    print(f"{args.batch} requests x {args.max_new_tokens} tokens, greedy; drafts: the model's MTP head, k={args.num_draft}")
    max_len = args.max_len

    def run(strategy: str | None):
        window = 1 if strategy is None else args.num_draft + 1
        engine = HybridEngine(model, strategy=strategy or "fold", num_slots=args.batch, window=window,
                              max_len=max_len)
        drafter = None if strategy is None else make_drafter("mtp", engine, model_dir=args.model)
        # static-shape steps: one CUDA graph each on a GPU, the same steps eagerly on the CPU
        gen = StepGenerator(engine, drafter, num_draft=args.num_draft, eos_token_ids=())
        return engine, gen.generate(prompts, args.max_new_tokens)

    t0 = time.perf_counter()
    print("\n[plain] decoding one token per step (exact recurrence) ...", flush=True)
    _, plain = run(None)
    print(f"[plain] {plain.num_generated} tokens, {plain.tokens_per_second:.1f} tok/s")
    for i in range(min(2, args.batch)):
        text = tokenizer.decode(plain.tokens[i], skip_special_tokens=True)
        print(f"[plain] request {i}:\n{_indent(texts[i] + text)}")

    rows, failed = [], []
    for strategy in args.strategies:
        print(f"\n[{strategy}] speculative decoding with MTP drafts ...", flush=True)
        engine, res = run(strategy)
        same = sum(a == b for x, y in zip(res.tokens, plain.tokens) for a, b in zip(x, y))
        total = sum(len(y) for y in plain.tokens)
        agree = res.tokens == plain.tokens
        print(f"[{strategy}] {res.num_generated} tokens in {res.steps} steps, accept length "
              f"{res.mean_accept_length:.2f}, {res.tokens_per_second:.1f} tok/s; greedy output "
              f"{'EQUALS' if agree else 'DIFFERS FROM'} plain decoding ({same}/{total} tokens)")
        print(f"[{strategy}] state memory: {common.describe_memory(engine)}")
        rows.append((strategy, res, same, total, engine))
        if not agree and engine.strategy.exact_outputs:
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

    window = args.num_draft + 1
    loss = heldout_loss(model, tokenizer, windows=args.heldout_windows)
    print(f"\nacceptance on these prompts (fold, T={window}); the model's held-out loss {loss:.3f} nats/token "
          f"({args.heldout_windows} windows of held-out standard-library text)")
    print(f"{'drafter':<12} {'tokens/step':>11} {'acceptance':>10}")
    for kind, label in (("ngram", "n-gram"), ("mtp", "MTP head"), ("model", "draft model")):
        r = measure(model, args.model, prompts, drafter=kind, window=window, max_new_tokens=args.max_new_tokens,
                    draft_model_dir=args.draft_model)
        print(f"{label:<12} {r['tokens_per_step']:>11.2f} {r['acceptance_rate']:>10.0%}")
    print("(bench acceptance measures T = 2, 4, 8 on held-out prompts; BENCHMARKS.md has the H200 table)")

    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    if failed:
        print(f"FAIL: exact strategies {failed} disagree with plain greedy decoding", file=sys.stderr)
        return 1
    print("OK: greedy speculative outputs of the exact strategies equal plain decoding token for token")
    return 0


def _indent(text: str, width: int = 12) -> str:
    """The first ``width`` lines of ``text``, indented for the report."""
    lines = text.splitlines()
    more = len(lines) > width
    return "\n".join("    | " + line for line in lines[:width]) + ("\n    | ..." if more else "")
