"""``replayssm bench acceptance``: how many draft tokens a trained model accepts.

For each drafter (n-gram prompt lookup, the checkpoint's MTP head, the draft model) and
each verify window ``T`` (``T - 1`` drafts per step), greedy decoding of held-out
prompts (cuts of standard-library files the model never trained on, see
:mod:`replayssm.corpus`) under one strategy reports:

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

import sys
import time
from dataclasses import dataclass

import torch

DRAFTERS = ("ngram", "mtp", "model")
GENERATOR_OF = {"ngram": "static", "mtp": "static", "model": "eager"}


@dataclass(frozen=True)
class AcceptanceConfig:
    """One acceptance run: the checkpoints (directories), the drafters and windows, the
    held-out prompts and the held-out loss's windows, the strategy, dtype and device."""

    model: str
    draft_model: str | None = None
    drafters: tuple[str, ...] = DRAFTERS
    windows: tuple[int, ...] = (2, 4, 8)
    prompts: int = 8
    prompt_len: int = 128
    max_new_tokens: int = 128
    heldout_windows: int = 32
    strategy: str = "fold"
    dtype: str = "auto"
    device: str = "auto"


def heldout_prompts(tokenizer, files, count: int, prompt_len: int) -> tuple[list[list[int]], list[str]]:
    """``count`` prompts of ``prompt_len`` tokens, one per file of ``files`` (the
    held-out ones, :func:`replayssm.corpus.heldout_files`; path order, files too
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
    :func:`replayssm.corpus.heldout_files`, joined by the end-of-text token as in
    training)."""
    from ..corpus import heldout_stream, heldout_windows

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
    from ..engine.factory import engine_max_len, make_drafter
    from ..engine.generator import SpeculativeGenerator, StepGenerator

    max_len = engine_max_len(max(len(p) for p in prompts), max_new_tokens, window)
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


def run_acceptance(args: AcceptanceConfig, progress_enabled: bool = True) -> dict:
    """Every (drafter, window) row of ``args`` plus plain decoding through each loop the
    drafters use, the held-out loss, the configuration and the environment: the JSON
    result of ``replayssm bench acceptance``."""
    from ..corpus import heldout_files
    from ..engine.loading import load_model, load_tokenizer, model_label
    from ..progress import ProgressBar
    from .common import environment

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
