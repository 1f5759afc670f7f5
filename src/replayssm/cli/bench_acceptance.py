"""``replayssm bench acceptance``: the options of :mod:`replayssm.bench.acceptance`, and
its table."""

from __future__ import annotations

import argparse
import sys

from ..bench.acceptance import DRAFTERS
from ..strategies import STRATEGY_NAMES
from . import common
from .args import branching, device_name, int_list, name_list, output_path, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_options(parser, draft_use="the 'model' drafter")
    parser.add_argument("--drafters", type=name_list(DRAFTERS), default=DRAFTERS,
                        help=f"comma-separated (default {','.join(DRAFTERS)})")
    parser.add_argument("--windows", type=int_list, default=(2, 4, 8),
                        help="verify windows T (T - 1 drafts per step; default 2,4,8)")
    parser.add_argument("--prompts", type=positive_int, default=8, help="held-out prompts (default 8)")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="tokens per prompt (default 128)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="greedy tokens per prompt (default 128)")
    parser.add_argument("--heldout-windows", type=positive_int, default=32,
                        help="held-out windows of 512 tokens for the loss (default 32)")
    parser.add_argument("--strategy", choices=STRATEGY_NAMES, default="fold", help="strategy (default fold)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="model dtype (auto: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--tree", dest="trees", type=branching, action="append", default=None, metavar="BRANCHING",
                        help="compare draft trees (of the mtp and ngram drafters) instead: children per depth, e.g. "
                             "3,2,1 (repeatable); each beside the chains of its depth and of its node count, "
                             "teacher-forced")
    parser.add_argument("--fit-tree", type=positive_int, default=None, metavar="N",
                        help="with --tree: also fit a tree of at most N nodes from --probe-tree measured on the next "
                             "--prompts held-out files")
    parser.add_argument("--probe-tree", type=branching, default=(4, 2, 2),
                        help="the probe tree --fit-tree measures (default 4,2,2: 29 nodes)")
    parser.add_argument("--json", type=output_path(".json"), default=None, help="write the result here")
    parser.add_argument("--plot", type=output_path(".png"), default=None, help="write the plot here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_args(args) -> None:
    from ..engine.factory import MAX_WINDOW

    if any(t < 2 for t in args.windows):
        raise ValueError(f"--windows must all be at least 2 (one draft per step), got {args.windows}")
    if any(t > MAX_WINDOW for t in args.windows):
        raise ValueError(f"--windows must all be at most {MAX_WINDOW}, got {args.windows}")
    args.model = common.check_model("--model", args.model)
    if "model" in args.drafters:
        args.draft_model = common.check_model("--draft-model", args.draft_model)
        common.check_same_tokenizer("--draft-model", args.draft_model, args.model)
    if "mtp" in args.drafters:
        common.check_mtp("--drafters mtp", args.model)
    common.check_plot(args.plot)
    check_trees(args)


def check_trees(args) -> None:
    from ..engine.trees import StaticTree
    from ..ops.trees import MAX_TREE_NODES

    trees = args.trees or ()
    if args.fit_tree is not None and not trees:
        raise ValueError("--fit-tree needs --tree (the trees to compare the fitted one with)")
    if trees and args.plot is not None:
        raise ValueError("--plot draws the drafter / window table; a --tree comparison writes its table and --json")
    for name, br in [("--tree", t) for t in trees] + [("--probe-tree", args.probe_tree)]:
        n = StaticTree.from_branching(br).num_nodes
        if n > MAX_TREE_NODES:
            raise ValueError(f"{name} {','.join(map(str, br))} has {n} nodes; at most {MAX_TREE_NODES}")
    if args.fit_tree is not None and not 2 <= args.fit_tree <= MAX_TREE_NODES:
        raise ValueError(f"--fit-tree must be in [2, {MAX_TREE_NODES}] nodes, got {args.fit_tree}")
    if trees and not {"mtp", "ngram"} & set(args.drafters):
        raise ValueError("--tree compares the draft trees of the mtp and ngram drafters; --drafters must name one")


def main(args) -> int:
    from ..bench.acceptance import AcceptanceConfig, print_table, run_acceptance

    cfg = common.config_from(AcceptanceConfig, args, drafters=tuple(args.drafters), windows=tuple(args.windows),
                             trees=tuple(args.trees or ()), fit_tree=args.fit_tree or 0)
    result = run_acceptance(cfg, progress_enabled=not args.quiet)
    print_table(result)
    common.write_outputs(result, args.json, args.plot, "acceptance")
    if result["exit_code"]:
        print("FAIL: an exact strategy's speculative tokens differ from plain greedy decoding", file=sys.stderr)
    return result["exit_code"]
