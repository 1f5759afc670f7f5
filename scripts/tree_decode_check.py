#!/usr/bin/env python3
"""Greedy speculative decoding with MTP draft trees against plain greedy decoding, over a long run.

    python scripts/tree_decode_check.py                       # embedded model, fp32, CPU, 1024 tokens
    python scripts/tree_decode_check.py --tokens 2048 --trees 3,2,1 2,2,2 --strategies fold circular

For every strategy and tree shape, the static-step generator decodes the held-out
prompts greedily with the MTP head's top-k trees (tree verify, greedy tree acceptance,
commit of the accepted path, KV compaction), and its tokens are compared with plain
greedy decoding of the same prompts through the same strategy. Prints, per run,
whether every token agrees (or the first difference) and the tokens per step; exits 0
when all agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tree_decode_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="checkpoint directory or 'embedded' (default)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens to generate per prompt (default 1024)")
    parser.add_argument("--prompts", type=int, default=2, help="held-out prompts (default 2)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--trees", nargs="+", default=["3,2,1", "2,2,2"],
                        help="children per depth (default 3,2,1 2,2,2)")
    parser.add_argument("--strategies", nargs="+", default=["fold", "circular", "snapshot"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from replayssm.bench.acceptance import heldout_prompts
    from replayssm.corpus import heldout_files
    from replayssm.engine.adapter import HybridEngine
    from replayssm.engine.device_drafters import DeviceMTPDrafter
    from replayssm.engine.drafters import load_mtp_head
    from replayssm.engine.generator import StepGenerator
    from replayssm.engine.loading import embedded_model_dir, load_model, load_tokenizer
    from replayssm.engine.trees import StaticTree, parse_branching

    path = str(embedded_model_dir(args.model)) if args.model.startswith("embedded") else args.model
    prompts, files = heldout_prompts(load_tokenizer(path), heldout_files(), args.prompts, args.prompt_len)
    model = load_model(path, dtype="float32", device="cpu")
    trees = [StaticTree.from_branching(parse_branching(t)) for t in args.trees]
    window = max(t.num_nodes for t in trees)
    runs, ok = [], True
    for strategy in args.strategies:
        def engine():
            return HybridEngine(model, strategy=strategy, num_slots=len(prompts), window=window,
                                max_len=args.prompt_len + args.tokens + window + 4)
        plain = StepGenerator(engine()).generate(prompts, args.tokens)
        for tree in trees:
            eng = engine()
            t0 = time.perf_counter()
            r = StepGenerator(eng, DeviceMTPDrafter(eng, load_mtp_head(eng, path), tree=tree), tree=tree).generate(
                prompts, args.tokens)
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                     for x, y in zip(r.tokens, plain.tokens)]
            same = r.tokens == plain.tokens
            ok &= same
            runs.append(dict(strategy=strategy, tree=tree.describe(), nodes=tree.num_nodes, equal=same,
                             first_difference=first, tokens=sum(len(t) for t in r.tokens),
                             tokens_per_step=r.mean_accept_length, seconds=time.perf_counter() - t0))
            print(f"{strategy:<9} tree {tree.describe():<7} ({tree.num_nodes} nodes): "
                  f"{'equal' if same else 'DIFFERENT at ' + str(first)} over {runs[-1]['tokens']} tokens, "
                  f"{r.mean_accept_length:.2f} tokens/step", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(model=args.model, prompts=files, prompt_len=args.prompt_len, tokens=args.tokens,
                           dtype="float32", device="cpu", runs=runs), fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
