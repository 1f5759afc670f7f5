"""``replayssm bench e2e``: end-to-end tokens per second, plain decoding vs each strategy.

For every batch size, the same prompts are generated with:

* ``plain``: no drafter, one token per request per step (the exact recurrence);
* each strategy (``snapshot``, ``fold``, ``circular``): speculative decoding with a
  drafter (prompt lookup by default; the checkpoint's MTP head with ``--drafter mtp``)
  proposing ``--num-draft`` tokens, verified in one window of ``num_draft + 1``.

Generation is greedy and ignores end-of-sequence tokens, so every request produces
exactly ``--max-new-tokens`` tokens and every mode does the same work. The tool reports
generated tokens per second of the decoding loop (prompt prefill excluded; also
reported with it), the mean tokens emitted per request-step, and the draft acceptance
rate.

It also compares every strategy's tokens with plain decoding's: per row
``matches_plain`` (all tokens equal), ``agreement`` (the fraction of generated tokens
equal to plain's, position by position) and ``prefix_agreement`` (the fraction inside
each request's common prefix with plain). Which differences fail the run:

* ``circular`` never does: its verify outputs come from a closed form and equal the
  recurrence only to rounding (``exact_outputs`` is False), so its agreement is
  reported, not checked.
* An exact strategy (``snapshot``, ``fold``) in fp32 does: greedy speculative decoding
  must emit exactly the tokens of plain greedy decoding (DESIGN.md section 5). These
  rows are ``strict`` and a difference is listed in ``mismatches``; the exit status is 1.
* An exact strategy in bf16/fp16 does not: GPU matmuls round a token's logits
  differently depending on how many rows share the step, so a near-tie can flip. The
  difference is printed as a NOTE and listed in ``differences``. The equality contract
  is checked in fp32 (the CPU tests) and with the engine's ``fixed_shape`` mode
  (tests/gpu/test_engine_gpu.py).

The model is a local Hugging Face checkpoint (``--model DIR``) or an embedded
random-weight Qwen3.5 model built in process: ``tiny`` (4 layers, GDN heads
``H=2, HV=4, K=V=16``; the CPU default) or ``qwen3.5-shapes`` (8 layers with the GDN and
attention geometry of Qwen3.5-35B-A3B, ``H=16, HV=32, K=V=128``, hidden 2048; the CUDA
default), so that the GDN state traffic per layer is the real one. Random models fall
into short loops under greedy decoding, which is what lets prompt lookup hit.

On CUDA each configuration is generated once untimed first, at full length (Triton
compiles then), and then ``--repeats`` times; the median is reported. On the CPU the
numbers only prove the code path.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..ops.dispatch import BACKENDS, resolve
from .args import int_list, name_list
from .progress import ProgressBar, write_outputs

STRATEGY_NAMES = ("snapshot", "fold", "circular")
STRICT_DTYPES = ("fp32",)  # model dtypes in which an exact strategy must match plain
PLAIN = "plain"
DRAFTERS = ("ngram", "mtp")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EMBEDDED = ("tiny", "qwen3.5-shapes")

# The embedded benchmark model: Qwen3.5-35B-A3B's GDN and attention geometry (see
# replayssm.bench.memory.MODELS) in 8 layers (6 GDN + 2 attention, full_attention_interval
# 4 as in the release) with a dense MLP, random weights and the byte-level vocabulary.
QWEN35_SHAPES = dict(
    hidden_size=2048, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, initializer_range=0.02,
)

# Prompts for real checkpoints (any tokenizer); request i gets prompt i mod len.
TEXT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then explain its complexity.",
    "List the planets of the solar system in order from the Sun, with one fact about each.",
    "Explain step by step how to compute 37 * 43 without a calculator.",
    "Summarise the rules of chess for someone who has never played.",
    "Translate into French: The weather is nice today and we are going to the beach.",
    "Give a recipe for pancakes with a list of ingredients and numbered steps.",
    "What is the difference between a list and a tuple in Python? Give examples.",
    "Describe the water cycle in a short paragraph.",
)


@dataclass
class E2EConfig:
    """Everything an e2e run depends on (validated by :meth:`check`)."""

    model: str | None = None  # a local checkpoint directory; None: the embedded model
    embedded: str = "tiny"
    strategies: tuple[str, ...] = STRATEGY_NAMES
    plain: bool = True
    batches: tuple[int, ...] = (1, 4, 16)
    num_draft: int = 3
    max_new_tokens: int = 256
    prompt_len: int = 64
    drafter: str = "ngram"
    device: str = "cpu"
    dtype: str = "bf16"
    backend: str = "auto"
    repeats: int = 3
    seed: int = 0

    def check(self) -> None:
        for name in ("num_draft", "max_new_tokens", "prompt_len", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {list(self.batches)}")
        bad = [s for s in self.strategies if s not in STRATEGY_NAMES]
        if bad or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be distinct names from {STRATEGY_NAMES}, got {list(self.strategies)}")
        if not self.strategies and not self.plain:
            raise ValueError("nothing to run: no strategies and no plain decoding")
        if self.embedded not in EMBEDDED:
            raise ValueError(f"embedded must be one of {EMBEDDED}, got {self.embedded!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.drafter == "mtp" and self.model is None:
            raise ValueError("drafter 'mtp' needs --model (a checkpoint with mtp.* weights)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.model is not None and not Path(self.model).is_dir():
            raise ValueError(f"model must be a checkpoint directory, got {self.model!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but CUDA is not available")

    @property
    def modes(self) -> tuple[str, ...]:
        return ((PLAIN,) if self.plain else ()) + tuple(self.strategies)


# ---------------------------------------------------------------------- model and prompts
def load_model(cfg: E2EConfig):
    """``(model, description, tokenizer or None)`` for ``cfg``."""
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    if cfg.model is None:
        from ..engine.tiny import build_tiny_model

        overrides = QWEN35_SHAPES if cfg.embedded == "qwen3.5-shapes" else {}
        model = build_tiny_model("qwen3_5", seed=cfg.seed, dtype=dtype, device=device, **overrides)
        return model, f"embedded {cfg.embedded} (random weights)", None
    from ..engine.loading import load_model as load_checkpoint
    from ..engine.loading import load_tokenizer

    model = load_checkpoint(cfg.model, dtype=dtype, device=str(device))
    return model, cfg.model, load_tokenizer(cfg.model)


def make_prompts(cfg: E2EConfig, batch: int, vocab: int, tokenizer) -> list[list[int]]:
    """``batch`` prompts of exactly ``prompt_len`` tokens: random token ids for the
    embedded model, :data:`TEXT_PROMPTS` (repeated to length) for a checkpoint."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(cfg.seed + batch)
        # the embedded models' vocabulary is bytes + end of text: draw bytes only
        return torch.randint(0, min(vocab, 256), (batch, cfg.prompt_len), generator=g).tolist()
    out = []
    for i in range(batch):
        ids = tokenizer(TEXT_PROMPTS[i % len(TEXT_PROMPTS)])["input_ids"]
        while len(ids) < cfg.prompt_len:
            ids = ids + ids
        out.append(ids[: cfg.prompt_len])
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(model, mode: str, prompts: list[list[int]], cfg: E2EConfig, on_done=None) -> tuple[dict, list[list[int]]]:
    """Generate ``prompts`` with ``mode`` (``plain`` or a strategy); returns its row and
    the generated tokens of the last run."""
    from ..engine.adapter import HybridEngine
    from ..engine.generator import SpeculativeGenerator

    device = torch.device(cfg.device)
    window = cfg.num_draft + 1
    engine = HybridEngine(
        model, strategy="fold" if mode == PLAIN else mode, num_slots=len(prompts), window=window,
        max_len=cfg.prompt_len + cfg.max_new_tokens + window, backend=cfg.backend,
    )
    drafter = None if mode == PLAIN else make_drafter(cfg, engine)
    gen = SpeculativeGenerator(engine, drafter, num_draft=cfg.num_draft, eos_token_ids=())
    if device.type == "cuda":
        # Compile and autotune outside the timed runs, at full length: steps late in a
        # generation bring shapes a short warm-up never meets (a warm-up of 2 windows
        # left the first of two timed runs 4-7x slower than the second on an H200).
        gen.generate(prompts, cfg.max_new_tokens)
    runs = []
    for _ in range(cfg.repeats):
        _sync(device)
        res = gen.generate(prompts, cfg.max_new_tokens)
        runs.append(res)
        if on_done:
            on_done()
    decode = [r.decode_tokens_per_second for r in runs]
    e2e = [r.tokens_per_second for r in runs]
    last = runs[-1]
    row = {
        "mode": mode,
        "batch": len(prompts),
        "tokens_per_s": statistics.median(decode),
        "tokens_per_s_with_prefill": statistics.median(e2e),
        "tokens_per_s_runs": decode,
        "generated_tokens": last.num_generated,
        "steps": last.steps,
        "mean_accept_length": last.mean_accept_length,
        "acceptance_rate": last.acceptance_rate if mode != PLAIN else None,
        "prefill_s": statistics.median(r.prefill_s for r in runs),
        "decode_s": statistics.median(r.decode_s for r in runs),
        "drafter": None if mode == PLAIN else cfg.drafter,
        "state_bytes": engine.state_nbytes(),
    }
    tokens = last.tokens
    del gen, drafter, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, tokens


def compare_tokens(mode: str, tokens: list[list[int]], reference: list[list[int]] | None, dtype: str) -> dict:
    """How ``mode``'s generated ``tokens`` compare with plain decoding's ``reference``
    in model dtype ``dtype`` (see the module doc for the rule).

    Returns ``matches_plain`` (None without a reference or for ``plain`` itself),
    ``agreement`` (generated tokens equal to plain's at the same position, over plain's
    count), ``prefix_agreement`` (tokens inside each request's common prefix with plain,
    over plain's count), ``exact_outputs`` (of the strategy), ``strict`` (whether a
    difference fails the run: an exact strategy in :data:`STRICT_DTYPES`) and ``verdict``:
    ``None`` (nothing compared), ``"equal"``, ``"mismatch"`` (a strict row differs: a
    failure) or ``"differs"`` (a non-strict row differs: reported only).
    """
    from ..strategies import STRATEGIES

    exact = True if mode == PLAIN else STRATEGIES[mode].exact_outputs
    strict = mode != PLAIN and exact and dtype in STRICT_DTYPES
    out = {"matches_plain": None, "agreement": None, "prefix_agreement": None, "exact_outputs": exact,
           "strict": strict, "verdict": None}
    if mode == PLAIN or reference is None:
        return out
    if len(tokens) != len(reference):
        raise ValueError(f"{mode}: {len(tokens)} requests, plain decoding has {len(reference)}")
    total = sum(max(len(a), len(b)) for a, b in zip(tokens, reference))
    same = sum(x == y for a, b in zip(tokens, reference) for x, y in zip(a, b))
    prefix = 0
    for a, b in zip(tokens, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
    equal = tokens == reference
    out.update(matches_plain=equal, agreement=same / total if total else 1.0,
               prefix_agreement=prefix / total if total else 1.0,
               verdict="equal" if equal else ("mismatch" if strict else "differs"))
    return out


def difference_reason(row: dict, dtype: str) -> str:
    """Why a non-strict row may differ from plain decoding (one line for the NOTE)."""
    if not row["exact_outputs"]:
        return (f"{row['mode']} computes verify outputs in closed form, equal to the recurrence only to "
                "rounding, so a near-tie can flip a greedy token")
    return (f"in {dtype}, GPU matmuls round a token's logits differently depending on how many rows "
            "share the step, so a near-tie can flip; greedy equality of exact strategies is checked "
            "in fp32 and with the engine's fixed_shape mode (tests/gpu/test_engine_gpu.py)")


def make_drafter(cfg: E2EConfig, engine):
    from ..engine import drafters

    if cfg.drafter == "ngram":
        return drafters.NgramDrafter()
    head = drafters.load_mtp_head(engine, cfg.model)
    return drafters.MTPDrafter(engine, head)


def run_e2e(cfg: E2EConfig, *, progress: bool = True) -> dict:
    """All rows of the benchmark (see the module doc); JSON-ready."""
    cfg.check()
    device = torch.device(cfg.device)
    model, description, tokenizer = load_model(cfg)
    vocab = model.get_output_embeddings().out_features
    rows, mismatches, differences = [], [], []
    bar = ProgressBar(len(cfg.batches) * len(cfg.modes) * cfg.repeats, "e2e", unit="runs", enabled=progress)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in cfg.batches:
            prompts = make_prompts(cfg, batch, vocab, tokenizer)
            reference = None
            for mode in cfg.modes:
                row, tokens = run_mode(model, mode, prompts, cfg, on_done=lambda: bar.update(1))
                if mode == PLAIN:
                    reference = tokens
                row.update(compare_tokens(mode, tokens, reference, cfg.dtype))
                if row["verdict"] in ("mismatch", "differs"):
                    entry = {"mode": mode, "batch": batch, "agreement": row["agreement"],
                             "prefix_agreement": row["prefix_agreement"]}
                    if row["verdict"] == "mismatch":
                        mismatches.append(entry)
                    else:
                        differences.append({**entry, "reason": "inexact strategy" if not row["exact_outputs"]
                                            else f"{cfg.dtype} rounding"})
                rows.append(row)
            plain_rate = next((r["tokens_per_s"] for r in rows if r["batch"] == batch and r["mode"] == PLAIN), None)
            for r in rows:
                if r["batch"] == batch:
                    r["speedup_vs_plain"] = r["tokens_per_s"] / plain_rate if plain_rate else None
    bar.close()
    _sync(device)
    return {
        "tool": "replayssm bench e2e",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "model": description, "strategies": list(cfg.strategies), "batches": list(cfg.batches)},
        "environment": _environment(device, cfg.backend),
        "smoke": device.type != "cuda",
        "rows": rows,
        "mismatches": mismatches,  # strict rows (exact strategy, fp32) that differ: exit 1
        "differences": differences,  # other rows that differ: reported only
        "elapsed_s": time.perf_counter() - t0,
    }


def _environment(device: torch.device, backend: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "backend": resolve(backend, device)}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = E2EConfig()
    parser.add_argument("--model", default=None, help="local Hugging Face checkpoint directory (default: the embedded model)")
    parser.add_argument("--embedded", choices=EMBEDDED, default=None,
                        help="embedded model without --model (default qwen3.5-shapes on CUDA, tiny on the CPU)")
    parser.add_argument("--strategies", type=name_list(STRATEGY_NAMES, allow_none=True), default=STRATEGY_NAMES, help="comma-separated (default all three)")
    parser.add_argument("--no-plain", action="store_true", help="skip plain decoding")
    parser.add_argument("--batches", type=int_list, default=None, help="batch sizes (default 1,4,16,64 on CUDA, 1,2 on the CPU)")
    parser.add_argument("--num-draft", type=int, default=d.num_draft, help=f"draft tokens per step (default {d.num_draft})")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="generated tokens per request (default 256; 16 on the CPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 64; 8 on the CPU)")
    parser.add_argument("--drafter", choices=DRAFTERS, default=d.drafter, help="ngram (prompt lookup) or the checkpoint's mtp head")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="model dtype (default bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--backend", choices=BACKENDS, default=d.backend)
    parser.add_argument("--repeats", type=int, default=None, help="timed generations per configuration (default 3; 1 on the CPU)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of tokens/s against batch size here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args) -> E2EConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"

    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if cuda else cpu)

    return E2EConfig(
        model=args.model, embedded=pick(args.embedded, "qwen3.5-shapes", "tiny"), strategies=tuple(args.strategies),
        plain=not args.no_plain, batches=tuple(pick(args.batches, (1, 4, 16, 64), (1, 2))), num_draft=args.num_draft,
        max_new_tokens=pick(args.max_new_tokens, 256, 16), prompt_len=pick(args.prompt_len, 64, 8), drafter=args.drafter,
        device=device, dtype=pick(args.dtype, "bf16", "fp32"), backend=args.backend, repeats=pick(args.repeats, 3, 1),
        seed=args.seed,
    )


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    c = result["config"]
    print(
        f"replayssm bench e2e: {c['model']}, {c['dtype']}, {result['environment']['device']} ({result['environment']['backend']}), "
        f"{c['prompt_len']} prompt + {c['max_new_tokens']} new tokens per request, {c['num_draft']} drafts ({c['drafter']}), "
        f"greedy, median of {c['repeats']}",
        file=file,
    )
    if result["smoke"]:
        print("SMOKE RUN on the CPU: the numbers prove the code path, not the speed", file=file)
    print(f"{'mode':<9} {'batch':>5} {'tok/s':>10} {'vs plain':>9} {'tok/s+prefill':>14} {'tokens/step':>12} "
          f"{'accepted':>9} {'== plain':>9}", file=file)
    for r in result["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        same = _same_cell(r)
        vs = "-" if r.get("speedup_vs_plain") is None else f"{r['speedup_vs_plain']:.2f}x"
        print(f"{r['mode']:<9} {r['batch']:>5} {r['tokens_per_s']:>10.1f} {vs:>9} {r['tokens_per_s_with_prefill']:>14.1f} "
              f"{r['mean_accept_length']:>12.2f} {acc:>9} {same:>9}", file=file)
    if any(r.get("verdict") in ("mismatch", "differs") for r in result["rows"]):
        print("== plain: the share of tokens equal to plain's; NO: a failure (exact strategy in "
              f"{'/'.join(STRICT_DTYPES)}), ~: reported only", file=file)
    rows = {(r["mode"], r["batch"]): r for r in result["rows"]}
    notes: dict[str, list[str]] = {}
    for d in result.get("differences", []):
        reason = difference_reason(rows[(d["mode"], d["batch"])], c["dtype"])
        notes.setdefault(reason, []).append(
            f"{d['mode']} at batch {d['batch']} ({_pct(d['agreement'])} of tokens agree, "
            f"{_pct(d['prefix_agreement'])} before the first difference)")
    for reason, which in notes.items():
        print(f"NOTE: differs from plain decoding, reported only: {', '.join(which)}. Why: {reason}", file=file)
    if result["mismatches"]:
        print(f"FAIL: greedy speculative decoding with an exact strategy in {c['dtype']} differs from plain decoding for "
              + ", ".join(f"{m['mode']} at batch {m['batch']} ({_pct(m['agreement'])} of tokens agree)"
                          for m in result["mismatches"]), file=file)


def _same_cell(row: dict) -> str:
    """The table's ``== plain`` cell: ``-``, ``yes``, ``NO x%`` (a strict failure) or
    ``~x%`` (a reported difference)."""
    verdict = row.get("verdict")
    if verdict is None:
        return "-"
    if verdict == "equal":
        return "yes"
    return f"NO {_pct(row['agreement'])}" if verdict == "mismatch" else f"~{_pct(row['agreement'])}"


def _pct(x: float) -> str:
    """``x`` as a percentage with one decimal; below 1 never shown as 100.0%."""
    return f"{min(x * 100, 99.9) if x < 1 else 100:.1f}%"


def main(args) -> int:
    try:
        cfg = config_from_args(args)
        cfg.check()
    except ValueError as e:
        print(f"replayssm bench e2e: {e}", file=sys.stderr)
        return 2
    result = run_e2e(cfg, progress=not args.quiet)
    print_table(result)
    write_outputs(result, args.json, args.plot, "plot_e2e")
    return 1 if result["mismatches"] else 0
