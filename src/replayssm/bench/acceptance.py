"""``replayssm bench acceptance``: how many draft tokens a trained model accepts.

For each drafter (n-gram prompt lookup, the checkpoint's MTP head, the draft model) and
each verify window ``T`` (``T - 1`` drafts per step), greedy decoding of held-out
prompts (cuts of standard-library files the model never trained on, see
:mod:`replayssm.train.data`) under one strategy reports:

* **tokens per step**: tokens emitted per request per target step, ``accepted + 1``
  (the verify window's bonus token); at most ``T``;
* **accepted per step**: draft tokens accepted per request per step;
* **acceptance rate**: accepted over drafted;
* whether the tokens equal plain greedy decoding's through the same decoding loop
  (they must, for an exact strategy).

Beside them, the model's held-out loss measured in the same run (cross-entropy in nats
per token over windows of the held-out stream), since acceptance means little without
knowing how good the model is.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..strategies import STRATEGY_NAMES
from .args import device_name, int_list, name_list, output_path, positive_int

DRAFTERS = ("ngram", "mtp", "model")
GENERATOR_OF = {"ngram": "static", "mtp": "static", "model": "eager"}


def heldout_prompts(tokenizer, files, count: int, prompt_len: int) -> tuple[list[list[int]], list[str]]:
    """``count`` prompts of ``prompt_len`` tokens, one per file of ``files`` (the
    held-out ones, :func:`replayssm.train.data.heldout_files`; path order, files too
    short skipped), each cut from a third of the way into its file (past the licence
    header and module docstring most files open with). Returns the token lists and the
    files' relative paths."""
    prompts, names = [], []
    for f in files:
        ids = tokenizer.encode(f.text, add_special_tokens=False)
        if len(ids) < 3 * prompt_len:
            continue
        start = len(ids) // 3
        prompts.append(ids[start : start + prompt_len])
        names.append(f.rel)
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out files are long enough for {count} prompts of "
                         f"{prompt_len} tokens; lower --prompts or --prompt-len")
    return prompts, names


@torch.no_grad()
def heldout_loss(model, tokenizer, *, windows: int, seq_len: int = 512, files=None) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``windows`` windows
    of ``seq_len`` tokens spread evenly over the held-out stream (``files``, default
    :func:`replayssm.train.data.heldout_files`, joined by the end-of-text token as in
    training)."""
    from ..train.data import heldout_stream
    from ..train.run import heldout_windows

    stream = heldout_stream(tokenizer, files)
    w = heldout_windows(stream, windows, seq_len + 1).to(model.device)
    total = 0.0
    for i in range(0, w.shape[0], 8):
        x = w[i : i + 8]
        logits = model(input_ids=x[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                                   reduction="sum").item()
    return total / (w.shape[0] * seq_len)


def measure(model, model_dir: str, prompts: list[list[int]], *, drafter: str, window: int, max_new_tokens: int,
            strategy: str = "fold", draft_model_dir: str | None = None, eager: bool = False) -> dict:
    """Greedy decoding of ``prompts`` with ``drafter`` and ``window - 1`` drafts per step
    (``window == 1``: plain decoding, no drafter), end-of-text ignored. The draft model
    (and plain decoding with ``eager``) runs the eager loop, the others the static step.
    Returns the tokens and the statistics of one row of the table."""
    from ..engine.adapter import HybridEngine
    from ..engine.generate import make_drafter
    from ..engine.generator import SpeculativeGenerator, StepGenerator

    max_len = max(len(p) for p in prompts) + max_new_tokens + window + 2
    engine = HybridEngine(model, strategy=strategy, num_slots=len(prompts), window=window, max_len=max_len)
    kind = "none" if window == 1 else drafter
    d = make_drafter(kind, engine, model_dir=model_dir, draft_model_dir=draft_model_dir, batch=len(prompts),
                     max_len=max_len)
    if kind == "model" or eager:  # the draft model decodes on the host between steps
        gen = SpeculativeGenerator(engine, d, num_draft=max(1, window - 1), eos_token_ids=())
    else:
        gen = StepGenerator(engine, d, num_draft=max(1, window - 1), eos_token_ids=())
    t0 = time.perf_counter()
    r = gen.generate(prompts, max_new_tokens)
    return dict(drafter=kind, window=window, tokens=r.tokens, steps=r.steps, tokens_per_step=r.mean_accept_length,
                accepted_per_step=r.mean_accept_length - 1.0, acceptance_rate=r.acceptance_rate if r.drafted else None,
                drafted=r.drafted, accepted=r.accepted, seconds=time.perf_counter() - t0)


def run_acceptance(args, progress_enabled: bool = True) -> dict:
    from ..engine.loading import load_model, load_tokenizer, model_label
    from .common import environment
    from .progress import ProgressBar

    from ..train.data import heldout_files

    tok = load_tokenizer(args.model)
    held = heldout_files()
    prompts, files = heldout_prompts(tok, held, args.prompts, args.prompt_len)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    loss = heldout_loss(model, tok, windows=args.heldout_windows, files=held)
    runs = [(d, t) for d in args.drafters for t in args.windows]
    rows = []
    # Plain decoding through the same loop as each drafter: the graphed static step for
    # n-gram and MTP, the eager loop for the draft model. In 16-bit the two loops round
    # differently (fused kernels, other GEMM shapes), so only like compares with like.
    loops = sorted({GENERATOR_OF[d] for d in args.drafters})
    plain: dict[str, dict] = {}
    with ProgressBar(len(runs) + len(loops), "acceptance", unit="run", enabled=progress_enabled) as bar:
        for loop in loops:
            plain[loop] = measure(model, args.model, prompts, drafter="none", window=1,
                                  max_new_tokens=args.max_new_tokens, strategy=args.strategy, eager=loop == "eager")
            bar.update()
        for d, t in runs:
            bar.set_description(f"acceptance {d} T={t}")
            row = measure(model, args.model, prompts, drafter=d, window=t, max_new_tokens=args.max_new_tokens,
                          strategy=args.strategy, draft_model_dir=args.draft_model)
            row["loop"] = GENERATOR_OF[d]
            row["equals_plain"] = row.pop("tokens") == plain[row["loop"]]["tokens"]
            rows.append(row)
            bar.update()
    dev = next(model.parameters()).device
    return dict(
        config=dict(model=model_label(args.model),
                    draft_model=model_label(args.draft_model) if "model" in args.drafters else None,
                    dtype=str(model.dtype).replace("torch.", ""), device=str(dev), strategy=args.strategy,
                    prompts=len(prompts), prompt_files=files, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens, windows=list(args.windows), drafters=list(args.drafters)),
        environment=environment(dev, "auto"), heldout_loss=loss, heldout_windows=args.heldout_windows,
        plain_steps={k: v["steps"] for k, v in plain.items()}, rows=rows,
        exit_code=0 if all(r["equals_plain"] for r in rows) or args.strategy == "circular" else 1,
    )


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    c = result["config"]
    print(f"acceptance: {c['model']} ({c['dtype']}, {c['device']}), {c['prompts']} held-out prompts of "
          f"{c['prompt_len']} tokens, {c['max_new_tokens']} greedy tokens each, strategy {c['strategy']}", file=file)
    print(f"held-out loss {result['heldout_loss']:.3f} nats/token ({result['heldout_windows']} windows of 512)",
          file=file)
    print(f"{'drafter':<8} {'T':>2} {'tokens/step':>11} {'accepted/step':>13} {'acceptance':>10} {'steps':>6} "
          f"{'== plain':>8}", file=file)
    for r in result["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(f"{r['drafter']:<8} {r['window']:>2} {r['tokens_per_step']:>11.2f} {r['accepted_per_step']:>13.2f} "
              f"{rate:>10} {r['steps']:>6} {'yes' if r['equals_plain'] else 'NO':>8}", file=file)


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="checkpoint directory, or 'embedded' (the trained model in the package; default)")
    parser.add_argument("--draft-model", default="embedded-draft",
                        help="draft model for the 'model' drafter (default 'embedded-draft', shipped beside it)")
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
    parser.add_argument("--json", type=output_path(".json"), default=None, help="write the result here")
    parser.add_argument("--plot", type=output_path(".png"), default=None, help="write the plot here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_args(args) -> None:
    from ..engine.generate import _check_model_dir
    from ..engine.loading import load_tokenizer, resolve_model_path

    if any(t < 2 for t in args.windows):
        raise ValueError(f"--windows must all be at least 2 (one draft per step), got {args.windows}")
    args.model = resolve_model_path(args.model)
    _check_model_dir("--model", args.model)
    if "model" in args.drafters:
        args.draft_model = resolve_model_path(args.draft_model)
        _check_model_dir("--draft-model", args.draft_model)
        if load_tokenizer(args.draft_model).get_vocab() != load_tokenizer(args.model).get_vocab():
            raise ValueError(f"--draft-model {args.draft_model!r} does not share the target's tokenizer")
    if "mtp" in args.drafters:
        from ..engine.generate import _has_mtp_weights

        if not _has_mtp_weights(args.model):
            raise ValueError(f"--drafters mtp: {args.model!r} has no mtp.* weights")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib (pip install 'replayssm[plot]')") from None
    args.checked = True


def main(args) -> int:
    if not getattr(args, "checked", False):
        check_args(args)
    result = run_acceptance(args, progress_enabled=not args.quiet)
    print_table(result)
    from .progress import write_outputs

    write_outputs(result, args.json, args.plot, "acceptance")
    if result["exit_code"]:
        print("FAIL: an exact strategy's speculative tokens differ from plain greedy decoding", file=sys.stderr)
    return result["exit_code"]
