"""``replayssm closed-loop``: long greedy generations under every strategy, each feeding
its own tokens back, against plain greedy decoding.

``replayssm drift`` teacher-forces one GDN layer: every variant sees the same inputs, so
an error in the state never changes what comes next. Here a whole model generates: each
variant's committed state shapes its logits, its logits pick its tokens, and its tokens
are its next inputs. A state that has left the recurrence shows up as generated tokens
that differ from plain decoding's.

For every request (prompt), ``--tokens`` new tokens are decoded greedily, end-of-text
ignored, by:

* ``plain``: no drafter, one token per step through the recurrence (the reference);
* each strategy (``snapshot``, ``fold``, ``circular``) verifying n-gram (prompt lookup)
  drafts of ``--num-draft`` tokens, through :class:`StepGenerator` (``--generator
  static``, the graphed engine) or :class:`SpeculativeGenerator` (``eager``);
* ``open-loop`` (a control, not a strategy; eager): ``circular`` whose flush folds the
  ring's corrected deltas ``u`` (rounded to the activation dtype) into the checkpoint in
  closed form instead of replaying raw records, the drift tool's control
  (:func:`replayssm.strategies.open_loop.open_loop_fold`) as a strategy the engine can
  decode with (:class:`~replayssm.strategies.open_loop.OpenLoopControlStrategy`). DESIGN.md section 3 forbids this fold.

Measured per variant and request: the first generated position whose token differs from
plain decoding's (``None``: never, over all ``--tokens``), and every ``--every``
committed tokens (at the first step boundary at or after each multiple) the committed
state's error ``||S - S64|| / ||S64||`` over all GDN layers, where ``S64`` comes from a
float64 copy of the model teacher-forced on that variant's own committed tokens (the
library's reference recurrence in float64 on the CPU, plain prefill of the same stream).

Exit status: 0 when no strategy with exact outputs (``snapshot``, ``fold``) diverges
from plain decoding; 1 when one does (the contract of DESIGN.md section 5 broken);
2 for bad arguments. ``circular`` (outputs to rounding) and the control are reported.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass

import torch

from ..strategies import STRATEGY_NAMES
from ..strategies.open_loop import OpenLoopControlStrategy

CONTROL = "open-loop"
PLAIN = "plain"
EXACT_OUTPUTS = ("snapshot", "fold")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The ``model`` of a run on the tiny random model (random prompts) instead of a checkpoint.
TINY = "tiny"


@dataclass(frozen=True)
class ClosedLoopConfig:
    """One closed-loop run. ``model``: a checkpoint directory, or :data:`TINY`;
    ``prompts``: texts for a checkpoint (``()``: the beginnings of held-out files)."""

    model: str = TINY
    tokens: int = 2048
    requests: int = 2
    prompt_len: int = 16
    prompts: tuple[str, ...] = ()
    every: int = 64
    strategies: tuple[str, ...] = STRATEGY_NAMES
    control: bool = True
    num_draft: int = 3
    generator: str = "static"
    dtype: str = "float32"
    device: torch.device = torch.device("cpu")
    seed: int = 0


# ---------------------------------------------------------------------- the control
# The control: replayssm.strategies.open_loop (one class for drift and closed-loop).
OpenLoopCircular = OpenLoopControlStrategy


# ---------------------------------------------------------------------- float64 reference
class Float64Reference:
    """A float64 copy of the model on the CPU that teacher-forces token streams through
    the library's reference recurrence (plain prefill, one slot per request), so the
    committed GDN state at any position of a stream can be compared with a variant's."""

    def __init__(self, model, num_requests: int, max_len: int):
        from ..engine.adapter import HybridEngine

        model64 = copy.deepcopy(model).to("cpu", torch.float64).eval()
        self.engine = HybridEngine(model64, strategy="fold", num_slots=num_requests, window=1, max_len=max_len,
                                   state_dtype=torch.float64, backend="reference", prefill="recurrence")
        self.slots = [self.engine.alloc() for _ in range(num_requests)]
        self.streams: list[list[int]] = [[] for _ in range(num_requests)]
        # States already computed, by (request, stream): variants that generate the same
        # tokens and sample at the same step boundaries (the strategies) share one run.
        self.cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def reset(self) -> None:
        """Fresh slots (the cache of computed states stays)."""
        for i, s in enumerate(self.slots):
            self.engine.free(s)
            self.slots[i] = self.engine.alloc()
            self.streams[i] = []

    def states(self, request: int, stream: list[int]) -> torch.Tensor:
        """The committed states ``[layers, HV, V, K]`` (float64) after ``stream``; the
        slot advances over the new tokens when ``stream`` extends what it has seen, and
        restarts from zero otherwise (another variant's diverged stream)."""
        key = (request, tuple(stream))
        if key in self.cache:
            return self.cache[key]
        seen = self.streams[request]
        if stream[: len(seen)] != seen:
            self.engine.free(self.slots[request])
            self.slots[request] = self.engine.alloc()
            seen = self.streams[request] = []
        new = stream[len(seen):]
        if new:
            self.engine.extend([self.slots[request]], [new], prompt=not seen)
            seen.extend(new)
        strat = self.engine.strategy
        states = torch.stack([strat.committed_state(j, [self.slots[request]])[0]
                              for j in range(self.engine.pool.num_layers)])
        self.cache[key] = states
        return states


def state_error(states: torch.Tensor, ref: torch.Tensor) -> float:
    """``||S - S64|| / ||S64||`` over every GDN layer and head of one request."""
    ref = ref.to(torch.float64)
    return float(torch.linalg.vector_norm(states.to("cpu", torch.float64) - ref) /
                 torch.linalg.vector_norm(ref).clamp_min(1e-300))


# ---------------------------------------------------------------------- one variant
def run_variant(name: str, model, prompts: list[list[int]], tokens: int, *, every: int, num_draft: int,
                generator: str, reference: Float64Reference, progress=None) -> dict:
    """Generate ``tokens`` greedily for every prompt with variant ``name`` and sample the
    committed state's error against ``reference`` every ``every`` committed tokens.

    Returns ``{"tokens": [[int]] per request, "samples": [[(position, error)]] per
    request, "steps", "mean_accept_length", "seconds"}``."""
    from ..engine.adapter import HybridEngine
    from ..engine.device_drafters import DeviceNgramDrafter
    from ..engine.drafters import NgramDrafter
    from ..engine.generator import SpeculativeGenerator, StepGenerator

    plain = name == PLAIN
    window = 1 if plain else num_draft + 1
    strategy = "circular" if name == CONTROL else ("fold" if plain else name)
    max_len = max(len(p) for p in prompts) + tokens + window + 2
    engine = HybridEngine(model, strategy=strategy, num_slots=len(prompts), window=window, max_len=max_len)
    if name == CONTROL:
        OpenLoopCircular.install(engine)
    # The generators allocate slots in request order from a fresh pool, in batches;
    # record them.
    slot_of: list[int] = []
    alloc_many = engine.alloc_many

    def recording_alloc_many(n):
        slots = alloc_many(n)
        slot_of.extend(slots)
        return slots

    engine.alloc_many = recording_alloc_many
    if plain:
        gen = SpeculativeGenerator(engine, None)
    elif name == CONTROL or generator == "eager":
        gen = SpeculativeGenerator(engine, NgramDrafter(), num_draft=num_draft)
    else:
        # on_tokens reads the committed state of the step that emitted the tokens: no
        # step may run ahead of the callbacks
        gen = StepGenerator(engine, DeviceNgramDrafter(), num_draft=num_draft, overlap=False)
    reference.reset()
    samples: list[list[tuple[int, float]]] = [[] for _ in prompts]
    produced: list[list[int]] = [[] for _ in prompts]
    next_mark = [0] * len(prompts)

    def on_tokens(i, kept):
        produced[i].extend(kept)
        if progress is not None:
            progress.update(len(kept))
        slot = slot_of[i]
        pos = engine.length(slot)  # committed tokens: the prompt and all generated but the last
        if pos < next_mark[i] or (len(produced[i]) >= tokens and samples[i] and samples[i][-1][0] == pos):
            return
        stream = (prompts[i] + produced[i])[:pos]
        states = torch.stack([engine.strategy.committed_state(j, [slot])[0] for j in range(engine.pool.num_layers)])
        samples[i].append((pos, state_error(states, reference.states(i, stream))))
        next_mark[i] = (pos // every + 1) * every

    t0 = time.perf_counter()
    result = gen.generate(prompts, tokens, on_tokens=on_tokens)
    return dict(tokens=result.tokens, samples=samples, steps=result.steps,
                mean_accept_length=result.mean_accept_length, seconds=time.perf_counter() - t0)


def first_divergence(tokens: list[int], plain: list[int]) -> int | None:
    """Index of the first generated token that differs from plain decoding's, else
    ``None``."""
    for j, (a, b) in enumerate(zip(tokens, plain)):
        if a != b:
            return j
    return None if len(tokens) == len(plain) else min(len(tokens), len(plain))


# ---------------------------------------------------------------------- the run
def build_inputs(args: ClosedLoopConfig):
    """``(model, prompts, description)`` for the arguments: the tiny random model with
    random prompts, or a checkpoint with prompts from ``prompts`` or the beginnings of
    held-out standard-library files."""
    from ..engine.loading import load_model, load_tokenizer, model_label

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    if args.model == TINY:
        from ..engine.random_model import build_tiny_model

        model = build_tiny_model(seed=args.seed, dtype=dtype, device=args.device)
        prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
        return model, prompts, f"tiny random model (seed {args.seed})"
    path = args.model
    model = load_model(path, dtype=dtype, device=str(args.device))
    tok = load_tokenizer(path)
    vocab = model.config.vocab_size
    if args.prompts:
        texts = list(args.prompts)
    else:
        from ..corpus import heldout_files

        held = heldout_files()
        texts = [f.text for f in held[: args.requests]]
    prompts = [tok.encode(t, add_special_tokens=False)[: args.prompt_len] for t in texts][: args.requests]
    if any(not p or max(p) >= vocab for p in prompts):
        raise ValueError("a prompt encodes to no tokens (or to ids outside the model's vocabulary)")
    return model, prompts, model_label(path)


def run_closed_loop(args: ClosedLoopConfig, progress_enabled: bool = True) -> dict:
    """Every variant over the same prompts; the JSON-ready result."""
    from ..progress import ProgressBar

    model, prompts, desc = build_inputs(args)
    variants = [PLAIN, *args.strategies] + ([CONTROL] if args.control else [])
    max_len = max(len(p) for p in prompts) + args.tokens + 2
    reference = Float64Reference(model, len(prompts), max_len)
    out: dict = {}
    total = len(variants) * len(prompts) * args.tokens
    with ProgressBar(total, "closed-loop", unit="tok", enabled=progress_enabled) as bar:
        for name in variants:
            bar.set_description(f"closed-loop {name}")
            out[name] = run_variant(name, model, prompts, args.tokens, every=args.every, num_draft=args.num_draft,
                                    generator=args.generator, reference=reference, progress=bar)
    plain = out[PLAIN]["tokens"]
    rows = {}
    for name in variants:
        r = out[name]
        div = [first_divergence(t, p) for t, p in zip(r["tokens"], plain)]
        errs = [e for per in r["samples"] for _, e in per]
        rows[name] = dict(
            kind="reference" if name == PLAIN else ("control" if name == CONTROL else "strategy"),
            exact_outputs=name in EXACT_OUTPUTS, diverged_at=div, diverged=any(d is not None for d in div),
            state_error_first=max((per[0][1] for per in r["samples"] if per), default=None),
            state_error_last=max((per[-1][1] for per in r["samples"] if per), default=None),
            state_error_max=max(errs, default=None), samples=[[list(x) for x in per] for per in r["samples"]],
            steps=r["steps"], mean_accept_length=r["mean_accept_length"], seconds=r["seconds"],
            tokens=r["tokens"],
        )
    failed = [n for n in variants if rows[n]["exact_outputs"] and rows[n]["diverged"]]
    from .common import environment

    return dict(
        config=dict(model=desc, dtype=args.dtype, device=str(args.device), requests=len(prompts),
                    prompt_lengths=[len(p) for p in prompts], tokens=args.tokens, every=args.every,
                    num_draft=args.num_draft, generator=args.generator, seed=args.seed),
        environment=environment(args.device, "auto"), variants=rows, failed=failed,
        control_diverged=rows[CONTROL]["diverged"] if CONTROL in rows else None, exit_code=1 if failed else 0,
    )


def print_report(result: dict, file=None) -> None:
    """The table: per variant, where each request first diverges, the state error's
    first, last and largest sample, the mean accepted length, and the verdict."""
    file = sys.stdout if file is None else file
    c = result["config"]
    print(f"closed loop: {c['model']}, {c['dtype']} on {c['device']}, {c['requests']} request(s) x {c['tokens']} "
          f"greedy tokens, n-gram drafts k={c['num_draft']} ({c['generator']} generator for the strategies)", file=file)
    print(f"{'variant':10} {'diverges at':>18} {'state first':>12} {'state last':>11} {'state max':>10} "
          f"{'accept':>7}  result", file=file)
    for name, r in result["variants"].items():
        div = ",".join("never" if d is None else str(d) for d in r["diverged_at"])
        if r["kind"] == "reference":
            verdict = "reference"
        elif r["kind"] == "control":
            verdict = "control: diverged" if r["diverged"] else "control: did not diverge"
        elif r["exact_outputs"]:
            verdict = "FAIL" if r["diverged"] else "pass"
        else:
            verdict = "reported (outputs to rounding)" + (": diverged" if r["diverged"] else "")

        def fmt(x):
            return "-" if x is None else f"{x:.2e}"

        print(f"{name:10} {div:>18} {fmt(r['state_error_first']):>12} {fmt(r['state_error_last']):>11} "
              f"{fmt(r['state_error_max']):>10} {r['mean_accept_length']:>7.2f}  {verdict}", file=file)
    if result["failed"]:
        print(f"result: {', '.join(result['failed'])} diverged from plain decoding", file=file)
    else:
        print("result: no strategy with exact outputs diverges from plain decoding", file=file)
