"""``replayssm bench e2e``: the options of :mod:`replayssm.bench.e2e` (resolved into its
:class:`~replayssm.bench.e2e.E2EConfig`, with the device's defaults), and its table."""

from __future__ import annotations

import argparse

import torch

from ..bench.e2e import DRAFTERS, DTYPES, HF_CACHES, RANDOM_MODELS, STATE_DTYPES, E2EConfig
from ..engine.adapter import PREFILL_MODES
from ..ops.dispatch import BACKENDS
from ..strategies import STRATEGY_NAMES
from . import common
from .args import branching, device_name, int_list, name_list, num_draft, output_path, positive_int


def _probabilities(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated probabilities, got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct probabilities in [0, 1], got {text!r}")
    return values


def _lengths(text: str) -> int | tuple[int, int]:
    """``"64"`` -> 64; ``"512-4096"`` -> ``(512, 4096)``: a range each request draws its
    length from (uniform, seeded)."""
    lo, sep, hi = text.strip().partition("-")
    try:
        values = (int(lo),) if not sep else (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or a range LO-HI, got {text!r}") from None
    if any(v < 1 for v in values) or (sep and values[0] > values[1]):
        raise argparse.ArgumentTypeError(f"expected a positive integer or a range LO-HI with 1 <= LO <= HI, "
                                         f"got {text!r}")
    return values[0] if not sep else values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = E2EConfig()
    parser.add_argument("--model", default=None,
                        help="local Hugging Face checkpoint directory, or 'embedded': the trained checkpoint in the "
                             "package (the default unless --random)")
    parser.add_argument("--random", choices=RANDOM_MODELS, default=None,
                        help="instead of --model, a random-weight model built in process, for shape benchmarks: "
                             "qwen3.5-shapes (Qwen3.5-35B-A3B's GDN and attention geometry) or tiny")
    parser.add_argument("--strategies", type=name_list(STRATEGY_NAMES, allow_none=True), default=STRATEGY_NAMES,
                        help="comma-separated, or 'none' (default all three)")
    parser.add_argument("--no-plain", action="store_true", help="skip our plain decoding")
    parser.add_argument("--plain-ring", action="store_true",
                        help="also time plain decoding through circular's ring (mode plain-ring), on a pool of window "
                             "--num-draft + 1 and ring --plain-ring-len")
    parser.add_argument("--plain-from", type=positive_int, default=None, metavar="B",
                        help="the speculative modes' batch buckets of at least B rows take plain steps (the engine's "
                             "choice per bucket; circular's plain steps then decode through a ring of "
                             "--plain-ring-len); default: every step speculates")
    parser.add_argument("--plain-ring-len", type=positive_int, default=None,
                        help=f"ring length L of plain-ring: a power of two >= 2 (num_draft + 1); a flush every "
                             f"L - 2 (num_draft + 1) + 1 tokens (default {d.plain_ring_len})")
    parser.add_argument("--ring-len", type=positive_int, default=None, metavar="L",
                        help="circular's ring length for its speculative steps: a power of two >= 2 (num_draft + 1); "
                             "a row flushes every ~(L - 2 (num_draft + 1) + 1) / accepted tokens steps, at L = "
                             "2 (num_draft + 1) at every one (default: the engine's, the least power >= 4 (num_draft + 1))")
    parser.add_argument("--hf", type=name_list(tuple(HF_CACHES), allow_none=True), default=d.hf,
                        help="Hugging Face generate baselines: dynamic (its default cache) and/or static "
                             "(cache_implementation='static'), comma-separated, or 'none' (default both)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines (= --hf none)")
    parser.add_argument("--hf-max-batch", type=positive_int, default=None,
                        help="time the Hugging Face baselines only at batches up to this (default all)")
    parser.add_argument("--batches", type=int_list, default=None, help="batch sizes (default 1,16,64 on CUDA, 2 on the CPU)")
    parser.add_argument("--num-draft", type=num_draft, default=d.num_draft,
                        help=f"draft tokens per step, at most 15 (default {d.num_draft})")
    parser.add_argument("--max-new-tokens", type=_lengths, default=None,
                        help="generated tokens per request, or a range LO-HI each request draws its own from "
                             "(uniform, seeded; default 128; 12 on the CPU)")
    parser.add_argument("--prompt-len", type=_lengths, default=None,
                        help="prompt tokens per request, or a range LO-HI as for --max-new-tokens (default 64; 8 on "
                             "the CPU)")
    parser.add_argument("--requests-per-slot", type=positive_int, default=d.requests_per_slot, metavar="K",
                        help="K x batch requests through batch slots, each joining as a slot frees up: a loaded "
                             "server, where a finished request's slot goes to the next one (default 1: one closed "
                             "batch, whose last steps run as its slowest requests drain)")
    parser.add_argument("--prefill", choices=PREFILL_MODES, default=d.prefill,
                        help="GDN prompt kernel: auto (fla-core's chunked kernel on CUDA in bf16/fp16 when it "
                             "imports: the 'gpu' extra), chunk (that kernel, an error without it) or recurrence")
    parser.add_argument("--prefill-chunk", type=positive_int, default=None,
                        help="prompt tokens per prefill pass; passes then alternate with the running requests' "
                             "decode steps (default: whole prompts per pass)")
    parser.add_argument("--drafter", choices=DRAFTERS, default=d.drafter,
                        help="ngram (prompt lookup), oracle (set acceptance on the strategy's own tokens), forced "
                             "(a seeded draw sets how many drafts each step accepts, whatever the numerics; a "
                             "benchmark of step cost), the checkpoint's mtp head, or a draft model (--draft-model) "
                             "inside the static step")
    parser.add_argument("--draft-model", default=None, metavar="DIR",
                        help="the draft model's checkpoint directory (or embedded-draft) for --drafter model; it must "
                             "share --model's tokenizer")
    parser.add_argument("--tree", type=branching, default=(), metavar="BRANCHING",
                        help="verify draft trees of this shape (children per depth, e.g. 3,2,1; the ngram or mtp "
                             "drafter) instead of chains of --num-draft")
    parser.add_argument("--chain-from", type=positive_int, default=None, metavar="B",
                        help="with --tree: the batch buckets of at least B rows verify the tree's spine (its best "
                             "chain) instead of the whole tree (the engine's choice per bucket); default: every "
                             "speculative step verifies the tree")
    parser.add_argument("--acceptance", type=_probabilities, default=d.acceptance,
                        help="oracle and forced drafters: probabilities of accepting each draft token after an "
                             "accepted one, one run per value (default 0,0.5,0.8,0.95)")
    parser.add_argument("--device", type=device_name, default=None, help="default cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="model dtype (default bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default=d.state_dtype,
                        help="dtype of the GDN checkpoints (default fp32; with bf16 no strategy is held to plain "
                             "decoding's tokens)")
    parser.add_argument("--backend", choices=BACKENDS, default=d.backend, help="op backend (auto: Triton on CUDA)")
    parser.add_argument("--no-graphs", action="store_true", help="run the static steps eagerly on CUDA (no graphs)")
    parser.add_argument("--no-run-ahead", action="store_true",
                        help="launch each decode step after the read of the one before (default: queued before it "
                             "where no request can reach its budget; StepGenerator(run_ahead=))")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed generations per configuration (default 3; 1 on the CPU)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the random model and the prompts")
    parser.add_argument("--json", type=output_path(".json"), default=None, help="write the rows here")
    parser.add_argument("--plot", type=output_path(".png"), default=None, help="write a PNG of tokens/s against acceptance here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args):
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        cuda = torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        cuda = False  # check() reports the bad device

    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if cuda else cpu)

    if args.random is not None and args.model is not None:
        raise ValueError(f"--random {args.random} builds a model in process; it takes no --model")
    model = None
    if args.random is None:
        from ..engine.loading import EMBEDDED

        model = common.check_model("--model", args.model or EMBEDDED)  # "embedded": the checkpoint in the package
    draft_model = None
    if args.draft_model is not None:
        if args.drafter != "model":
            raise ValueError(f"--draft-model is only used with --drafter model, not --drafter {args.drafter}")
        draft_model = common.check_model("--draft-model", args.draft_model)
        if model is not None:
            common.check_same_tokenizer("--draft-model", draft_model, model)
    elif args.drafter == "model":
        raise ValueError("--drafter model needs --draft-model DIR (and a checkpoint: --model, not --random)")
    config = E2EConfig(
        model=model, random_model=args.random or "tiny", strategies=tuple(args.strategies),
        plain=not args.no_plain, plain_ring=args.plain_ring,
        plain_ring_len=args.plain_ring_len if args.plain_ring_len is not None else E2EConfig.plain_ring_len,
        ring_len=args.ring_len, hf=() if args.no_hf else tuple(args.hf), hf_max_batch=args.hf_max_batch,
        batches=tuple(pick(args.batches, (1, 16, 64), (2,))),
        num_draft=args.num_draft, max_new_tokens=pick(args.max_new_tokens, 128, 12),
        prompt_len=pick(args.prompt_len, 64, 8), drafter=args.drafter, acceptance=tuple(args.acceptance),
        prefill=args.prefill, prefill_chunk=args.prefill_chunk, draft_model=draft_model,
        device=device, dtype=pick(args.dtype, "bf16", "fp32"), state_dtype=args.state_dtype, backend=args.backend, graphs=not args.no_graphs,
        repeats=pick(args.repeats, 3, 1), seed=args.seed, tree=tuple(args.tree), plain_from=args.plain_from,
        chain_from=args.chain_from, requests_per_slot=args.requests_per_slot, run_ahead=not args.no_run_ahead,
    )
    # A ring length that no mode reads is an error, not ignored (the config cannot tell a given
    # length from its default, so this check is the command line's).
    if args.plain_ring_len is not None and not config.plain_ring_used:
        raise ValueError("--plain-ring-len is only used with --plain-ring, or --plain-from with circular")
    return config


def check_args(args) -> None:
    """Cross-option checks before any work (``cli`` turns the ValueError into one line)."""
    config_from_args(args).check()


def main(args) -> int:
    from ..bench.e2e import plot_e2e, print_table, run_e2e

    from ..progress import write_json

    cfg = config_from_args(args)
    # A run stopped at a time limit keeps its finished batches (marked "complete": false).
    partial = None if args.json is None else (lambda r: write_json(args.json, r))
    result = run_e2e(cfg, progress=not args.quiet, on_batch=partial)
    print_table(result)
    common.write_outputs(result, args.json, None, "")
    if args.plot is not None:
        plot_e2e(result, args.plot)
        print(f"wrote {args.plot}")
    return 1 if result["mismatches"] else 0
