"""``replayssm closed-loop``: the options of :mod:`replayssm.bench.closed_loop`, and its
report."""

from __future__ import annotations

import argparse
import os

from ..bench.closed_loop import DTYPES, TINY
from ..strategies import STRATEGY_NAMES
from . import common
from .args import device_name, name_list, nonneg_int, num_draft, output_path, positive_int, utf8_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (the trained checkpoint in the package; default), a checkpoint directory, "
                             f"or '{TINY}' (random weights, built in process)")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="greedy tokens per request (default 2048)")
    parser.add_argument("--requests", type=positive_int, default=2, help="prompts decoded together (default 2)")
    parser.add_argument("--prompt-len", type=positive_int, default=16,
                        help="prompt tokens (random ids for tiny; a cut of each prompt otherwise; default 16)")
    parser.add_argument("--prompt", action="append", type=utf8_text,
                        help="prompt text for a checkpoint (repeatable; default: held-out standard-library files)")
    parser.add_argument("--every", type=positive_int, default=64, help="committed tokens between state samples")
    parser.add_argument("--strategies", type=name_list(STRATEGY_NAMES), default=STRATEGY_NAMES,
                        help=f"strategies to run (default {','.join(STRATEGY_NAMES)})")
    parser.add_argument("--no-control", action="store_true", help="leave out the open-loop control")
    parser.add_argument("--num-draft", type=num_draft, default=3, help="n-gram draft tokens per step (default 3)")
    parser.add_argument("--generator", choices=("static", "eager"), default="static",
                        help="the strategies' decoding loop: StepGenerator (static, default) or SpeculativeGenerator")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="model dtype (default float32; bfloat16 makes the control round u to bf16)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seed of the tiny model and its prompts")
    parser.add_argument("--json", type=output_path(".json"), default=None, help="write the full result here")
    parser.add_argument("--plot", type=output_path(".png"), default=None, help="write the plot here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_args(args) -> None:
    if args.model != TINY:
        from ..engine.loading import EMBEDDED_MODELS

        if args.model not in EMBEDDED_MODELS and not os.path.exists(args.model):
            raise ValueError(f"--model {args.model!r} is neither {TINY!r}, 'embedded' nor a checkpoint directory")
        args.model = common.check_model("--model", args.model)
    elif args.prompt:
        raise ValueError("--prompt needs a checkpoint --model (the tiny model has random prompts)")
    if args.every > args.tokens:
        raise ValueError(f"--every {args.every} exceeds --tokens {args.tokens}")
    if args.model != TINY:
        from ..engine.loading import read_config, text_config

        limit = text_config(read_config(args.model)).get("max_position_embeddings")
        if isinstance(limit, int) and args.prompt_len + args.tokens > limit:
            raise ValueError(f"--tokens {args.tokens}: --prompt-len {args.prompt_len} + {args.tokens} exceed the "
                             f"model's max_position_embeddings {limit}")
    common.check_plot(args.plot)


def config_from_args(args):
    """The :class:`~replayssm.bench.closed_loop.ClosedLoopConfig` of checked options."""
    from ..bench.closed_loop import ClosedLoopConfig
    from ..engine.loading import resolve_device

    return common.config_from(ClosedLoopConfig, args, prompts=tuple(args.prompt or ()),
                              strategies=tuple(args.strategies), control=not args.no_control,
                              device=resolve_device(args.device))


def main(args) -> int:
    from ..bench.closed_loop import print_report, run_closed_loop

    result = run_closed_loop(config_from_args(args), progress_enabled=not args.quiet)
    print_report(result)
    common.write_outputs(result, args.json, args.plot, "closed_loop")
    return result["exit_code"]
