"""``replayssm train``: the options of :mod:`replayssm.train` (a
:class:`~replayssm.train.run.TrainConfig`), and the run."""

from __future__ import annotations

import argparse
import os
import sys

from ..corpus import HELDOUT_PERCENT
from ..train.model import SIZES
from .args import device_name, nonneg_float, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True,
                        help="checkpoint directory to write (created; must be empty or absent unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty --out")
    parser.add_argument("--size", choices=tuple(SIZES), default="default",
                        help="model preset: default (fits 16 MB in bf16 with the tokenizer), small (a draft model), "
                             "tiny (tests)")
    parser.add_argument("--vocab", type=positive_int, default=4096,
                        help="tokenizer size: byte-level BPE with this many tokens (258 = bytes only; default 4096)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="reuse the tokenizer of this checkpoint instead of training one (a draft model must "
                             "share its target's)")
    parser.add_argument("--minutes", type=positive_float, default=10.0,
                        help="time budget in minutes; training stops when it is spent (default 10)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="stop after this many optimizer steps (default: only the time budget)")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per training window (default 512)")
    parser.add_argument("--batch", type=positive_int, default=32, help="windows per step (default 32)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--warmup", type=positive_int, default=100, help="warm-up steps (default 100)")
    parser.add_argument("--mtp-weight", type=nonneg_float, default=0.5,
                        help="weight of the MTP head's loss in the total (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the window sampling")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--heldout-percent", type=positive_float, default=HELDOUT_PERCENT,
                        help=f"share of files held out, chosen by a hash of their path (default {HELDOUT_PERCENT:g}; "
                             "the evaluation tools read the default's held-out files)")
    parser.add_argument("--eval-every", type=positive_int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-windows", type=positive_int, default=64, help="held-out windows per evaluation")
    parser.add_argument("--max-files", type=positive_int, default=None,
                        help="read only the first N source files in path order (quick runs, tests)")
    parser.add_argument("--source", metavar="DIR", default=None,
                        help="train on the .py files of this directory instead of the standard library")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the saved weights (default bfloat16)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_args(args) -> None:
    """What needs several options or a look at the disk; ``ValueError`` naming the option."""
    from ..train.run import TrainConfig  # noqa: F401  (import errors surface here, before work)

    if os.path.exists(args.out):
        if not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out!r} exists and is not a directory")
        if os.listdir(args.out) and not args.overwrite:
            raise ValueError(f"--out {args.out!r} is not empty (pass --overwrite to write into it)")
    else:
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            raise ValueError(f"--out: folder {parent!r} does not exist")
    if args.heldout_percent >= 100:
        raise ValueError(f"--heldout-percent must be below 100, got {args.heldout_percent:g}")
    if args.seq_len < 3:
        raise ValueError(f"--seq-len must be at least 3 (the MTP head predicts two tokens ahead), got {args.seq_len}")
    if args.tokenizer is not None:
        if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
            raise ValueError(f"--tokenizer {args.tokenizer!r} has no tokenizer.json")
    elif args.vocab < 258:
        raise ValueError(f"--vocab must be at least 258 (256 bytes + 2 special tokens), got {args.vocab}")
    if args.source is not None and not os.path.isdir(args.source):
        raise ValueError(f"--source {args.source!r} is not a directory")
    # The split is decided by paths alone: check both sides are non-empty before any
    # text is read (a walk of the tree, no file opened).
    from ..corpus import is_heldout, list_sources

    rels = list_sources(args.source)[: args.max_files]
    held = sum(is_heldout(r, args.heldout_percent) for r in rels)
    if held == 0 or held == len(rels):
        side = "no file is held out" if held == 0 else "every file is held out"
        raise ValueError(f"{side} of the {len(rels)} source files; change --heldout-percent or --max-files")
    from ..engine.loading import resolve_device
    from ..train.model import gdn_kernel_path

    gdn_kernel_path(resolve_device(args.device))  # fla without CUDA: say so now


def config_from_args(args):
    from ..train.run import TrainConfig

    return TrainConfig(
        out=args.out, size=args.size, vocab=args.vocab, tokenizer=args.tokenizer, minutes=args.minutes,
        steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr, warmup=args.warmup,
        mtp_weight=args.mtp_weight, seed=args.seed, device=args.device, heldout_percent=args.heldout_percent,
        eval_every=args.eval_every, eval_windows=args.eval_windows, max_files=args.max_files, source=args.source,
        save_dtype=args.save_dtype, quiet=args.quiet,
    )


def main(args) -> int:
    from ..train.run import run_training

    try:
        run_training(config_from_args(args), log=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:  # found only once the text is read (no held-out file, a stream too short)
        print(f"replayssm train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0
