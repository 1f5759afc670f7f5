"""The decoding loop: plain decoding or speculative decoding over a batch of requests.

Plain decoding (no drafter) feeds each request's last token through
:meth:`HybridEngine.extend` (the exact recurrence, one token per step). Speculative
decoding asks the drafter for up to ``num_draft`` tokens per request, verifies
``[last token] + drafts`` in one :meth:`HybridEngine.verify`, accepts per request
(greedy, or rejection sampling when sampling), commits the accepted prefix and tells
the drafter what was emitted. Requests stop on an end-of-sequence token or after
``max_new_tokens`` and leave the batch; the others continue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..ops.guards import to_device
from .adapter import HybridEngine, token_ids
from .drafters import Drafter
from .sampling import SamplingParams, greedy_accept, rejection_sample, warp_probs


@dataclass
class GenerationResult:
    """Outputs and statistics of one :meth:`SpeculativeGenerator.generate` call.

    Attributes:
        tokens: generated token ids per request (an end-of-sequence token included).
        finish_reasons: ``"eos"`` or ``"length"`` per request.
        steps: target forward passes after the prompt prefill.
        accept_lengths: tokens emitted per request-step (``accepted drafts + 1``), all
            requests and steps together.
        drafted, accepted: draft tokens proposed / accepted in total.
        prefill_s, decode_s: wall time of the prompt prefill passes (every pass, later
            joiners' and every chunk's included) and of the rest of the call (decode
            steps and the host's work between them); together the call's wall time.
        ttft_s: per request, seconds from the call's start to its first token (time to
            first token; queueing for a slot and the prompt prefill included), taken on
            the host once the device has produced the token. ``nan`` for a request that
            never got one (an error ended the call).
        latency_s: per request, seconds from the call's start to its last token.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stats: "StepStats | None" = None
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens emitted per request per target step (1.0 for plain decoding)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """End to end: generated tokens over prefill + decoding time."""
        return self.num_generated / max(1e-9, self.prefill_s + self.decode_s)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.num_generated / max(1e-9, self.decode_s)


@dataclass
class _Request:
    index: int
    slot: int
    prompt: list[int]
    max_new: int
    ids: np.ndarray  # the prompt as checked int64 ids (check_requests), as its prompt passes take them
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    arrival: float = 0.0  # perf_counter() at the call's start: every request arrives then
    ttft: float | None = None  # seconds from arrival to the first token
    done_at: float | None = None  # seconds from arrival to the last token
    filled: int = 0  # prompt tokens prefilled so far
    generation: int = 0  # the pool's allocation generation of ``slot`` when the request took it
    hidden: list = field(default_factory=list)  # target hidden states of earlier prompt chunks

    @property
    def last(self) -> int:
        return self.generated[-1]


def check_generator_args(engine, drafter, drafter_cls: type, sampling, num_draft) -> None:
    """The checks a generator's constructor shares: types, and a window that holds
    ``num_draft`` drafts plus the last token."""
    if not isinstance(engine, HybridEngine):
        raise TypeError(f"engine must be a HybridEngine, got {type(engine).__name__}")
    if drafter is not None and not isinstance(drafter, drafter_cls):
        raise TypeError(f"drafter must be a {drafter_cls.__name__} or None, got {type(drafter).__name__}")
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if drafter is not None:
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            raise ValueError(f"num_draft must be a positive int, got {num_draft!r}")
        if num_draft + 1 > engine.window:
            raise ValueError(f"num_draft + 1 = {num_draft + 1} exceeds the engine's window {engine.window}")


def check_requests(engine: HybridEngine, prompts, max_new_tokens) -> tuple[list[list[int]], list[int],
                                                                             list[np.ndarray]]:
    """Validated ``(prompts, budgets, ids)`` of a ``generate`` call (``ValueError`` naming
    the request at fault): non-empty prompts of token ids (each a sequence of ints, or a
    1-D integer array or CPU tensor: :func:`~replayssm.engine.adapter.token_ids`), positive
    budgets, room for each request within the engine's ``max_len`` and the model's
    ``max_position_embeddings`` (positions past it were never trained: the rotary
    embedding extrapolates). ``prompts`` come back as lists of ints, ``ids`` as the same
    tokens in int64 arrays, which the prompt passes take as they are."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    vocab = engine.vocab_size
    limit = getattr(engine.config, "max_position_embeddings", None)
    ids = [token_ids(p, f"prompts[{i}]", vocab) for i, p in enumerate(prompts)]
    prompts = [x.tolist() for x in ids]  # plain ints, whatever integers the caller gave
    for i, (p, m) in enumerate(zip(prompts, budgets)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_new_tokens must be positive ints, got {m!r} for request {i}")
        if limit is not None and len(p) + m > limit:
            raise ValueError(f"request {i}: prompt {len(p)} + max_new_tokens {m} exceeds the model's "
                             f"max_position_embeddings {limit}")
        if len(p) + m + engine.window > engine.max_len:
            raise ValueError(f"request {i}: prompt {len(p)} + max_new_tokens {m} + window {engine.window} "
                             f"exceeds the engine's max_len {engine.max_len}")
    return prompts, budgets, ids


def _retire(gen, active: list) -> list:
    """Release the finished requests of ``active`` (through ``gen._release``); the rest."""
    gen._release([r for r in active if r.finish])
    return [r for r in active if r.finish is None]


def _free_slots(engine: HybridEngine, reqs) -> list:
    """Free the slots of those of ``reqs`` that hold one, in one engine call; those
    requests (their ``slot`` now -1)."""
    held = [r for r in reqs if r.slot >= 0]
    if held:
        engine.free_many([r.slot for r in held])
        for r in held:
            r.slot = -1
    return held


def _close(gen, result: GenerationResult, reqs) -> None:
    """Release every slot still held (also after an error) and fill in the tokens."""
    gen._release([r for r in reqs if r.slot >= 0])
    result.tokens = [r.generated for r in reqs]
    result.finish_reasons = [r.finish or "length" for r in reqs]
    result.ttft_s = [float("nan") if r.ttft is None else r.ttft for r in reqs]
    result.latency_s = [float("nan") if r.done_at is None else r.done_at for r in reqs]


def _elapsed(device: torch.device, t0: float) -> float:
    """Seconds since ``t0`` once the device's queued work is done."""
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeGenerator:
    """Generate with a :class:`HybridEngine`, with or without a drafter.

    Args:
        engine: the target model's engine (its ``window`` must be ``>= num_draft + 1``
            when a drafter is given).
        drafter: ``None`` for plain decoding, else a :class:`Drafter`.
        num_draft: draft tokens per step (``k``); the verify window is ``k + 1``.
        sampling: greedy (default) or temperature / top-p / top-k sampling.
        eos_token_ids: tokens that end a request.
        seed: seed of the sampling generator (sampling only).
    """

    def __init__(self, engine: HybridEngine, drafter: Drafter | None = None, *, num_draft: int = 3,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Sequence[int] = (), seed: int = 0):
        check_generator_args(engine, drafter, Drafter, sampling, num_draft)
        self.engine = engine
        self.drafter = drafter
        self.num_draft = num_draft
        self.sampling = sampling
        self.eos = {int(t) for t in eos_token_ids}
        self.generator = torch.Generator(device=engine.device)
        self.generator.manual_seed(seed)

    # ------------------------------------------------------------------ sampling
    def _pick(self, logits: torch.Tensor) -> list[int]:
        """One token per row of ``logits [R, V]``."""
        if self.sampling.greedy:
            return logits.argmax(-1).tolist()
        return torch.multinomial(warp_probs(logits, self.sampling), 1, generator=self.generator)[:, 0].tolist()

    def _emit(self, req: _Request, new: list[int]) -> list[int]:
        """Append tokens up to a stop; return what was appended. The host holds ``new``,
        so the device has produced it: the request's first / last token times are
        taken here."""
        kept = []
        for t in new:
            if len(req.generated) >= req.max_new:
                break
            req.generated.append(t)
            kept.append(t)
            if t in self.eos:
                req.finish = "eos"
                break
        if req.finish is None and len(req.generated) >= req.max_new:
            req.finish = "length"
        if kept or req.finish:
            now = time.perf_counter() - req.arrival
            if req.ttft is None and req.generated:
                req.ttft = now
            if req.finish and req.done_at is None:
                req.done_at = now
        return kept

    # ------------------------------------------------------------------ loop
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Generate for a batch of prompts (at most the engine's slots).

        Args:
            prompts: token ids per request (non-empty): lists of ints, or 1-D
                integer arrays or CPU tensors (:func:`check_requests`).
            max_new_tokens: generated-token budget, one for all or one per request.
            on_tokens: called as ``on_tokens(request_index, new_tokens)`` whenever a
                request emits tokens (streaming).
        """
        eng = self.engine
        prompts, budgets, ids = check_requests(eng, prompts, max_new_tokens)
        if len(prompts) > eng.pool.num_free:
            raise ValueError(f"{len(prompts)} prompts but the engine has {eng.pool.num_free} free slots")
        eng.set_prompt_head(None)  # its drafters join eagerly
        with torch.inference_mode():
            return self._generate(prompts, budgets, ids, on_tokens)

    def _generate(self, prompts, budgets, ids, on_tokens) -> GenerationResult:
        eng, drafter = self.engine, self.drafter
        t0 = time.perf_counter()
        reqs = [_Request(i, slot, p, m, ids=x, arrival=t0)
                for i, (slot, p, m, x) in enumerate(zip(eng.alloc_many(len(prompts)), prompts, budgets, ids))]
        result = GenerationResult(tokens=[], finish_reasons=[])
        try:
            out = eng.extend([r.slot for r in reqs], [r.ids for r in reqs], prompt=True)
            firsts = self._pick(out.logits)
            _sync(eng.device)
            result.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for r, tok in zip(reqs, firsts):
                kept = self._emit(r, [tok])
                if on_tokens:
                    on_tokens(r.index, kept)
                if drafter is not None and r.finish is None:
                    hidden = None
                    if drafter.needs_hidden:
                        hidden = out.hidden[out.offsets[r.index] : out.offsets[r.index + 1]]
                    drafter.add(r.index, r.prompt + [tok], hidden)
            self._release([r for r in reqs if r.finish])
            active = [r for r in reqs if r.finish is None]
            while active:
                if drafter is None:
                    self._plain_step(active, result, on_tokens)
                else:
                    self._spec_step(active, result, on_tokens)
                result.steps += 1
                active = _retire(self, active)
            result.decode_s = _elapsed(eng.device, t0)
        finally:
            _close(self, result, reqs)
        return result

    def _release(self, reqs):
        reqs = _free_slots(self.engine, reqs)
        if self.drafter is not None:
            for r in reqs:
                self.drafter.remove(r.index)

    def _plain_step(self, active, result, on_tokens):
        out = self.engine.extend([r.slot for r in active], [[r.last] for r in active])
        for r, tok in zip(active, self._pick(out.logits)):
            kept = self._emit(r, [tok])
            result.accept_lengths.append(1)
            if on_tokens:
                on_tokens(r.index, kept)

    def _spec_step(self, active, result, on_tokens):
        eng, drafter = self.engine, self.drafter
        # Never draft past the budget: a step emits at most drafts + 1 tokens.
        counts = [min(self.num_draft, r.max_new - len(r.generated) - 1) for r in active]
        drafts = drafter.propose([r.index for r in active], counts, self.sampling, self.generator)
        for d, c in zip(drafts, counts):
            if len(d.tokens) > c:
                raise RuntimeError(f"drafter {drafter.name!r} proposed {len(d.tokens)} tokens, asked for {c}")
        out = eng.verify([r.slot for r in active], [[r.last] + d.tokens for r, d in zip(active, drafts)])
        if self.sampling.greedy:
            argmax = out.logits.argmax(-1).tolist()
            decided = [greedy_accept(argmax[out.offsets[i] : out.offsets[i + 1]], d.tokens)
                       for i, d in enumerate(drafts)]
        else:
            decided = self._rejection(out, drafts)
        eng.commit([n + 1 for n, _ in decided])
        for i, (r, d, (n, nxt)) in enumerate(zip(active, drafts, decided)):
            new = d.tokens[:n] + [nxt]
            result.drafted += len(d.tokens)
            result.accepted += n
            result.accept_lengths.append(n + 1)
            kept = self._emit(r, new)
            if on_tokens:
                on_tokens(r.index, kept)
            if r.finish is None:
                hidden = out.hidden[out.offsets[i] : out.offsets[i] + n + 1] if drafter.needs_hidden else None
                drafter.observe(r.index, new, hidden)

    def _rejection(self, out, drafts) -> list[tuple[int, int]]:
        """Rejection sampling over the padded windows of a verified step."""
        dev = self.engine.device
        b = len(drafts)
        t = max(out.lengths)
        p_flat = warp_probs(out.logits, self.sampling)  # [N, V]
        v = p_flat.shape[-1]
        p = p_flat.new_zeros(b, t, v)
        d_pad = torch.zeros(b, max(t - 1, 0), dtype=torch.long, device=dev)
        stochastic = any(d.q is not None for d in drafts)
        q = p_flat.new_zeros(b, max(t - 1, 0), v) if stochastic else None
        for i, d in enumerate(drafts):
            n = len(d.tokens)
            p[i, : n + 1] = p_flat[out.offsets[i] : out.offsets[i + 1]]
            if n:
                d_pad[i, :n] = torch.tensor(d.tokens, device=dev)
                if stochastic:
                    if d.q is None:
                        raise RuntimeError("a drafter mixed sampled and deterministic drafts in one step")
                    q[i, :n] = d.q
        num = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long, device=dev)
        accepted, nxt = rejection_sample(p, d_pad, q, num, self.generator)
        return list(zip(accepted.tolist(), nxt.tolist()))


# ---------------------------------------------------------------------- static steps
class _Running(NamedTuple):
    """A launched step whose outputs the host has not read yet."""

    step: object  # the StaticStep
    t0: float  # perf_counter() at its launch
    ahead: bool  # launched before the host's bookkeeping of the step before it
    left: np.ndarray  # [R] int64: each row's budget left before the step (tokens it may still emit)
    #: the requests of its rows, in row order (padding rows after them); one that
    #: stopped at an earlier step (a step run ahead of that step's read) is a dead row
    reqs: tuple = ()
    #: perf_counter() when the host saw it end before reading it (a join went ahead of
    #: its read: the prompt pass after it is not its time); None: at its read
    ended: float | None = None


def default_buckets(num_slots: int) -> tuple[int, ...]:
    """Batch buckets 1, 2, 4, 8, 16, then four to an octave (20, 24, 28, 32, 40, 48,
    ...) below ``num_slots``, and ``num_slots`` itself.

    A step runs the smallest bucket that holds its live requests, so a bucket's spare
    rows are work for nothing. Speculative steps emit a varying number of tokens, so
    the requests of a batch that started together finish over several steps, and at
    powers of two a batch of 129 live requests pays for 256 rows: with forced
    acceptance 0.8, 256 requests of 128 tokens drain over the last ~10 of their ~51
    steps. Quarter octaves keep the spare rows under a fifth of a step above 16 rows
    (vLLM's capture sizes are multiples of 8 and 16, finer still); each bucket costs a
    captured graph, whose activations share one memory pool."""
    out = [b for b in (1, 2, 4, 8, 16) if b < num_slots]
    b = 16
    while b < num_slots:
        out += [x for x in range(b + b // 4, 2 * b + 1, b // 4) if x < num_slots]
        b *= 2
    return tuple(out) + (num_slots,)


@dataclass
class PrefillPass:
    """One prompt-prefill forward of a :class:`StepGenerator` run.

    Attributes:
        after_step: decode steps the run had taken before this pass (the pass ran
            between step ``after_step - 1`` and step ``after_step``).
        requests: request indices whose prompt tokens the pass covered, in pass order.
        tokens: prompt tokens of each of them in the pass.
        completed: the requests whose prompt the pass completed (their first token was
            emitted by it).
        seconds: wall time of the pass (the device's work included).
    """

    after_step: int
    requests: list[int]
    tokens: list[int]
    completed: list[int]
    seconds: float


@dataclass
class StepStats:
    """Per-step figures of a :class:`StepGenerator` run, and every prompt-prefill pass
    (:class:`PrefillPass`), placed among the steps.

    Attributes:
        seconds: per decode step, wall time from its launch (graph replay, or the eager
            body) to the host holding its outputs. A step launched ahead (``ahead``)
            ran on the device while the host did the previous step's bookkeeping, so
            its time is the longer of the two plus the read: with the device the
            slower, the device's step time. A step that a join went ahead of ends when
            the host waits for it, before the joiners' prompt pass.
        ahead: per decode step, whether it was launched before the host's bookkeeping
            of the step before it (see :class:`StepGenerator`, "Overlap").
        rows: live rows of each step.
        emitted: tokens emitted by each step (budgets and stops not applied).
        prefills: the prompt-prefill passes.
    """

    seconds: list[float] = field(default_factory=list)
    ahead: list[bool] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    prefills: list[PrefillPass] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        return percentile(self.seconds, q)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` (``0 <= q <= 1``) as the value of rank
    ``round(q (n - 1))`` in sorted order, ``nan`` when there are none (or any is)."""
    xs = sorted(values)
    if not xs or any(x != x for x in xs):
        return float("nan")
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class StepGenerator:
    """Continuous batching over static-shape steps, CUDA-graphed on a GPU.

    Each step runs one :class:`~replayssm.engine.graph_step.StaticStep` of the smallest
    bucket that holds the live requests (padding rows take slot -1): the forward,
    acceptance, commit and the next window's drafts all happen on the device, and the
    host reads the emitted tokens once per step (the only synchronisation; the prompt
    prefill of joining requests runs eagerly between steps). Requests join as slots free
    up (at most the engine's slots at once) and leave on an end-of-sequence token or
    their token budget. Plain decoding when ``drafter`` is ``None``.

    Prompt prefill: the joining requests' prompts go through one packed forward
    (:meth:`HybridEngine.extend`, ``cu_seqlens`` over the prompts), not one per request.
    With ``prefill_chunk = n``, a prefill pass takes at most ``n`` prompt tokens (the
    joiners in arrival order, the last one cut where the budget ends; a prompt longer
    than ``n`` spans several passes), and while requests are decoding, passes and decode
    steps alternate: one pass, then one step of the running requests, so a long prompt
    joining does not stall them for its whole prefill (vLLM's chunked prefill, with the
    chunk run beside the step instead of inside it). A request decodes from the step
    after the pass that completes its prompt. Greedy outputs do not depend on the
    chunking (up to the rounding of matmuls over other row counts).

    Overlap: every step reads its inputs from device buffers (windows, KV lengths,
    drafts), so while the rows stay the same the next step needs nothing from the host.
    After reading a step's outputs, the host checks at once (vectorised, over the
    output rows) whether any request stops at it (its budget reached, or an
    end-of-sequence token among its emitted tokens); when none does, no prompt is being
    prefilled and no queued request could take a slot, the loop would run the next step
    on the same rows anyway, so it launches it right away and does this step's
    per-request bookkeeping (tokens, statistics, ``on_tokens``, host KV lengths) while
    the device runs it. When some requests stop but none is queued (the end of a run),
    the next step would run on the rows of the others, so it is launched on those
    (maybe in a smaller bucket) before the bookkeeping and the stopped requests'
    retirement. With ``join_ahead`` (the default) the same happens when requests are
    queued: the step runs on the rows left while the host does the bookkeeping, frees
    the stopped requests' slots and gives them to queued requests; the host then waits
    for that step, runs the joiners' prompt pass, and the joiners decode from the next
    step. Otherwise (a prompt half prefilled, or ``join_ahead=False`` and a stop that
    frees a slot for a queued request) the bookkeeping, retirement, joins and prefill
    passes come first, as without overlap. Without joins ahead, the tokens, stops,
    callbacks and their order are the same with or without overlap; only when the host
    does its work changes (``StepStats.ahead`` says which steps were launched ahead).
    Joins ahead move a joiner's first decode step one step later, so the steps, the
    callbacks' order across requests and sampled draws change; each request's greedy
    tokens and stop do not. The time stamps keep their meaning: a
    request's first and last tokens are stamped when the host books them, after the
    read of their step (with overlap, the next step may be running by then), and
    ``StepStats.seconds`` counts from a step's launch to its outputs on the host.

    Run ahead (``run_ahead``, on by default with overlap): even launched ahead of the
    bookkeeping, the next step waits for the host's read of the current one, and the
    device idles from a step's end to the next one's launch (the read's wake-up and the
    graph launch: tens of microseconds, a tenth of a small batch's step). So when the
    next step would be launched ahead on the same rows anyway and no row can reach its
    budget at the current step, it is launched before the read (its output copied
    first); the device runs the two back to back. Only an end-of-sequence token can
    then stop a request at the current step; its row in the step run ahead is dead: that
    step's work on it is dropped (its slot is freed, or reset for a joiner, after it in
    stream order), the step after it runs on the others' rows, and a request queued for
    a slot joins as it would have. Each request's greedy tokens are the same; a step
    with a dead row keeps the bucket of the step before, so with sampling the draws may
    differ, and the engine timeline holds that one step more. A step run ahead counts
    its ``StepStats.seconds`` from the read of the step before it (about when the device
    started it), not from its launch.

    Args:
        engine: the target engine (window ``>= num_draft + 1``; slots = concurrency).
        drafter: a :class:`~replayssm.engine.device_drafters.DeviceDrafter` or ``None``.
        num_draft: draft tokens per step ``k`` (window ``k + 1``).
        sampling: greedy, or warped sampling with rejection of the drafts.
        eos_token_ids: tokens that end a request.
        graphs: capture CUDA graphs (default: on a CUDA engine).
        buckets: batch buckets (default: :func:`default_buckets` of the engine's slots).
        prefill_chunk: prompt tokens per prefill pass, or ``None`` (default): every
            joiner's whole prompt in one pass before the next step.
        tree: a :class:`~replayssm.engine.trees.StaticTree`: every step verifies a
            draft tree of this shape (``num_draft`` is then its ``N - 1`` drafted nodes;
            the drafter must have been built with the same tree); a chain-shaped one
            is the plain window of its length. ``None``: chains of ``num_draft``.
        overlap: launch the next step before the current one's bookkeeping whenever
            its rows are known from the outputs alone: the same rows, or those left
            when requests stop and none is queued (default); ``False``: every step
            after the host's work on the one before.
        join_ahead: with ``overlap`` and whole-prompt passes (no ``prefill_chunk``; it
            has no effect otherwise), requests also join without holding up the others
            (default): when some stop and others are queued, the next step is launched
            on the rows left, the queued requests take the freed slots while it runs,
            then the host waits for it and runs their prompt pass, and they decode from
            the step after. The host's work at a join (freeing and resetting slots, the
            bookkeeping) so hides behind a step, at the price of the joiners' rows
            sitting out one step. Each request's greedy tokens are the same; with
            sampling the draws differ (a step's rows do). ``False``: a join runs between
            two steps, as without overlap.
        run_ahead: with ``overlap``, launch the next step on the same rows before
            reading the current one's outputs, whenever the current one could be
            launched ahead on them and no row can reach its budget at the current one
            (default): the device then goes from step to step without waiting for the
            host's read (see above). ``False``: the next step after the read.
        plain_from: with a drafter, the batch buckets of at least this many rows take
            plain steps (one token a request; through the strategy's ring where it has
            one) instead of speculative ones: the engine's choice per bucket, where
            speculation does not pay. A request moves between the two kinds as the
            batch grows and shrinks, with no conversion. Its drafter observes the plain
            steps' tokens but proposes nothing during them, so the first speculative
            step after plain ones verifies older drafts (probably rejected). ``None``
            (default): every step speculates.
        chain_from: with ``tree``, the batch buckets of at least this many rows verify
            the tree's spine as a chain (:attr:`~replayssm.engine.trees.StaticTree.spine`:
            the drafter's best draft at each depth, ``depth`` drafts) instead of the
            whole tree: the engine's choice per bucket, where a tree's wider verify
            stops paying (:data:`~replayssm.engine.trees.MEASURED_CHAIN_FROM` holds the
            measured buckets). A spine step proposes the next spine alone where the
            drafter can (:attr:`~replayssm.engine.device_drafters.DeviceDrafter.drafts_spines`),
            else a whole tree, so a request moves between the two kinds as the batch
            grows and shrinks. ``None`` (default): every speculative step verifies the
            tree.
    """

    def __init__(self, engine: HybridEngine, drafter=None, *, num_draft: int = 3,
                 sampling: SamplingParams = SamplingParams(), eos_token_ids: Sequence[int] = (),
                 graphs: bool | None = None, buckets: Sequence[int] | None = None,
                 prefill_chunk: int | None = None, tree=None, overlap: bool = True, plain_from: int | None = None,
                 join_ahead: bool = True, chain_from: int | None = None, run_ahead: bool = True):
        from .device_drafters import DeviceDrafter

        if tree is not None:
            if drafter is None or getattr(drafter, "tree", None) is not tree:
                raise ValueError("tree needs a drafter built with the same tree "
                                 "(e.g. DeviceMTPDrafter(..., tree=tree))")
            num_draft = tree.num_nodes - 1
            tree = None if tree.is_chain else tree
        if chain_from is not None:
            if isinstance(chain_from, bool) or not isinstance(chain_from, int) or chain_from < 1:
                raise ValueError(f"chain_from must be a positive int or None, got {chain_from!r}")
            if tree is None:
                raise ValueError("chain_from chooses between a draft tree and its spine: it needs a tree that is "
                                 "not a chain")
        check_generator_args(engine, drafter, DeviceDrafter, sampling, num_draft)
        if drafter is not None:
            drafter.check_sampling(sampling)
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
        if plain_from is not None:
            if isinstance(plain_from, bool) or not isinstance(plain_from, int) or plain_from < 1:
                raise ValueError(f"plain_from must be a positive int or None, got {plain_from!r}")
            if drafter is None:
                raise ValueError("plain_from chooses between plain and speculative steps: it needs a drafter")
            if tree is not None:
                raise ValueError("plain_from takes chains of drafts, not a draft tree")
            if engine.strategy.ring_decode and not engine.ring_decoding:
                # the recurrence's plain step needs an empty ring, which a verify leaves full
                raise ValueError(f"plain_from on {engine.strategy.name!r} needs plain decoding through its ring "
                                 f"(a ring longer than 2 x the window: ring_len > {2 * engine.window})")
        graphs = engine.device.type == "cuda" if graphs is None else bool(graphs)
        if graphs and engine.device.type != "cuda":
            raise ValueError("graphs=True needs a CUDA engine")
        slots = engine.pool.num_slots
        buckets = tuple(sorted(set(buckets))) if buckets else default_buckets(slots)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) or buckets[-1] < slots:
            raise ValueError(f"buckets must be positive ints whose largest is >= the engine's {slots} slots, "
                             f"got {list(buckets)}")
        self.engine = engine
        self.drafter = drafter
        self.num_draft = num_draft if drafter is not None else 0
        self.sampling = sampling
        self.eos = {int(t) for t in eos_token_ids}
        self._eos_ids = np.array(sorted(self.eos), dtype=np.int64)  # for the vectorised stop check
        self.overlap = bool(overlap)
        if not isinstance(join_ahead, bool):
            raise TypeError(f"join_ahead must be a bool, got {type(join_ahead).__name__}")
        # whole prompts only: a chunked prompt's passes alternate with the steps by design
        self.join_ahead = self.overlap and join_ahead and prefill_chunk is None
        if not isinstance(run_ahead, bool):
            raise TypeError(f"run_ahead must be a bool, got {type(run_ahead).__name__}")
        self.run_ahead = self.overlap and run_ahead
        self.graphs = graphs
        self.buckets = buckets
        self.prefill_chunk = prefill_chunk
        self.tree = tree
        self.plain_from = plain_from
        self.chain_from = chain_from
        self._steps: dict[int, object] = {}
        self._host_out: dict[int, torch.Tensor] = {}  # pinned output copies of the steps run ahead, per bucket
        self._read_done = None  # a CUDA event: the copy into one of them is done
        self._pool = None
        self._joins_captured = False
        # the next window of every slot (last token, then drafts); the last row is the sink
        self.windows = torch.zeros((slots + 1, self.num_draft + 1), dtype=torch.int64, device=engine.device)
        if drafter is not None:
            drafter.bind(slots, self.num_draft, engine.max_len + engine.window, engine.device)
        # the drafter's share of a join inside the prompt passes (prompt shapes are
        # built per head: set before any is built or prepared)
        self._prompt_head = None if drafter is None else drafter.prompt_head
        engine.set_prompt_head(self._prompt_head)

    def takes_plain_steps(self, live: int) -> bool:
        """Whether a step of ``live`` requests is a plain one (its bucket is at least
        ``plain_from`` rows) rather than speculative."""
        return self.plain_from is not None and self._bucket(live) >= self.plain_from

    def verifies_tree(self, live: int) -> bool:
        """Whether a step of ``live`` requests verifies the whole draft tree (its bucket is
        below ``chain_from``), rather than the tree's spine or plain decoding."""
        return (self.tree is not None and not self.takes_plain_steps(live)
                and (self.chain_from is None or self._bucket(live) < self.chain_from))

    def _bucket(self, live: int) -> int:
        return next(b for b in self.buckets if b >= live)

    def _step(self, live: int):
        from .graph_step import StaticStep

        rows = self._bucket(live)
        if rows not in self._steps:
            if self.graphs and self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            plain = self.takes_plain_steps(rows)
            tree = self.verifies_tree(rows)
            windows = self.windows[:, :1] if plain else self.windows  # a plain step's window: the last token
            self._steps[rows] = StaticStep(self.engine, windows, rows, drafter=self.drafter, sampling=self.sampling,
                                           graph=self.graphs, pool=self._pool, tree=self.tree if tree else None,
                                           spine=self.tree is not None and not plain and not tree)
        return self._steps[rows]

    def capture(self, rows: Sequence[int] | None = None) -> None:
        """Build (and on CUDA capture) the steps of these buckets now (default: all), and
        the drafter's join graphs of every bucket (:meth:`DeviceDrafter.capture_join`)."""
        for b in rows or self.buckets:
            self._step(b)
        self._capture_joins()

    def _capture_joins(self) -> None:
        if self.graphs and self.drafter is not None and not self._joins_captured:
            self.drafter.capture_join(self.buckets)
            self._joins_captured = True

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Generate for any number of prompts (token ids: lists of ints, or 1-D integer
        arrays or CPU tensors, :func:`check_requests`); at most the engine's slots run at
        once.

        Returns a :class:`GenerationResult` whose ``stats`` attribute holds the
        :class:`StepStats`. ``prefill_s`` is the wall time of every prefill pass,
        ``decode_s`` the rest of the call; ``ttft_s`` and ``latency_s`` count from the
        call's start (a request waiting for a slot waits from there).

        ``on_tokens(request_index, new_tokens)`` is called as for
        :meth:`SpeculativeGenerator.generate`, in the same order with or without
        overlap (with ``join_ahead``, in the same order for each request); the host KV
        lengths (:meth:`HybridEngine.length`) are those after the
        step that emitted the tokens. With overlap, though, the next step may have run
        or be running on the device by then: a callback that reads the device state of
        the engine (committed GDN state, KV cache, drafter buffers) needs
        ``overlap=False``.
        """
        eng = self.engine
        prompts, budgets, ids = check_requests(eng, prompts, max_new_tokens)
        if eng.pool.num_free < eng.pool.num_slots:
            raise ValueError("the engine has live slots; a StepGenerator needs all of them free")
        eng.set_prompt_head(self._prompt_head)  # another generator on this engine may have set its own
        with torch.inference_mode():
            return self._generate(prompts, budgets, ids, on_tokens)

    def _generate(self, prompts, budgets, ids, on_tokens) -> GenerationResult:
        eng = self.engine
        t_start = time.perf_counter()
        queue = [_Request(i, -1, p, m, ids=x, arrival=t_start)
                 for i, (p, m, x) in enumerate(zip(prompts, budgets, ids))]
        reqs = list(queue)
        queue.reverse()  # pop() takes the next request
        result = GenerationResult(tokens=[], finish_reasons=[])
        stats = StepStats()
        active: list[_Request] = []  # decoding
        filling: list[_Request] = []  # holding a slot, prompt not yet fully prefilled
        running = None  # a step of ``active`` launched ahead (a _Running), not yet read
        pending: list[_Request] = []  # prefilled while ``running`` ran: they join the step after it
        try:
            while queue or active or filling or pending or running is not None:
                if running is None:
                    active += pending
                    pending = []
                    filling += self._admit(queue, eng.pool.num_slots - len(active) - len(filling))
                    if filling:
                        done = self._prefill_pass(filling, stats, on_tokens)
                        result.prefill_s += stats.prefills[-1].seconds
                        filling = [r for r in filling if r.filled < len(r.prompt)]
                        self._release([r for r in done if r.finish])
                        active += [r for r in done if r.finish is None]
                    if not active:
                        continue
                    running = self._launch(active)
                elif self.join_ahead and queue:
                    # a step is in flight: queued requests take the slots the last step
                    # freed, then get their prompt pass after it (``pending`` is empty
                    # here: the last decode step took its joiners into ``active``)
                    joining = self._admit(queue, eng.pool.num_slots - len(active))
                    if joining:
                        _sync(eng.device)  # the step in flight first: the pass's time is its own
                        running = running._replace(ended=time.perf_counter())
                        done = self._prefill_pass(joining, stats, on_tokens, in_flight=True)
                        result.prefill_s += stats.prefills[-1].seconds
                        self._release([r for r in done if r.finish])
                        pending += [r for r in done if r.finish is None]
                # steady: unless a request stops at this step, the next iteration would
                # only run the next step on the same rows (no prompt half prefilled, no
                # queued request that a free slot could take, unless joins go ahead);
                # with no request queued at all (or joins going ahead), it would run the
                # next step on the rows that do not stop, and the joiners'
                steady = self.overlap and not filling and (
                    self.join_ahead or not (queue and len(active) < eng.pool.num_slots))
                running = self._decode_step(running, active, steady, steady and (self.join_ahead or not queue),
                                            result, stats, on_tokens, joiners=pending)
                active = _retire(self, active)
                if running is not None and pending:  # the step launched ahead holds them
                    active += pending
                    pending = []
            result.decode_s = _elapsed(eng.device, t_start) - result.prefill_s
            eng.pool.check_errors()  # what the graphed steps' device-side index checks found (one read)
        finally:
            _close(self, result, reqs)
        result.stats = stats
        return result

    def _admit(self, queue: list[_Request], room: int) -> list[_Request]:
        """The next requests of ``queue`` (at most ``room``), each given a slot (one
        reset for all of them)."""
        joining = [queue.pop() for _ in range(min(len(queue), room))]
        for r, slot in zip(joining, self.engine.alloc_many(len(joining))):
            r.slot, r.generation = slot, self.engine.pool.generation(slot)
        return joining

    def _launch(self, active: list[_Request], left: np.ndarray | None = None, ahead: bool = False) -> _Running:
        """Start a step of the decoding requests ``active`` (the smallest bucket that
        holds them, padding rows after them). ``left``: their budgets, if known (a step
        launched ``ahead`` of the bookkeeping that would count them)."""
        step = self._step(len(active))
        pad = [-1] * (step.rows - len(active))
        step.set_rows([r.slot for r in active] + pad, [r.generation for r in active] + pad)
        t0 = time.perf_counter()
        step.run()
        if left is None:  # the rows' budgets, built while the device runs the step
            left = np.fromiter((r.max_new - len(r.generated) for r in active), np.int64, len(active))
        return _Running(step, t0, ahead, left, tuple(active))

    def _stops(self, out: np.ndarray, left: np.ndarray) -> np.ndarray:
        """``[R]`` bool: whether each row's request stops at a step whose host output is
        ``out [R, 1 + T]`` (what :meth:`_emit` will find, in one vectorised pass): its
        emitted tokens reach its budget ``left``, or one of them ends the sequence."""
        n = out[:, 0]
        stops = n >= left
        if self._eos_ids.size:
            tokens = out[:, 1:]
            emitted = np.arange(tokens.shape[1]) < n[:, None]
            stops |= ((tokens[:, :, None] == self._eos_ids).any(2) & emitted).any(1)
        return stops

    def _read(self, step, n: int, run_next: bool) -> np.ndarray:
        """The first ``n`` rows of ``step``'s output buffer on the host: the step's one
        host synchronisation, a copy (the next run rewrites the buffer). With
        ``run_next``, ``step`` runs again (same rows) after the copy is queued and before
        the host waits for it, so the device goes on to it without waiting for the host;
        on a GPU the copy then goes through a pinned buffer of the step's shape."""
        if not run_next:
            return step.out[:n].to("cpu", copy=True).numpy()
        if not step.out.is_cuda:
            out = step.out[:n].clone()
            step.run()
            return out.numpy()
        host = self._host_out.get(step.rows)
        if host is None:
            host = self._host_out[step.rows] = torch.empty(step.out.shape, dtype=step.out.dtype, pin_memory=True)
        if self._read_done is None:
            self._read_done = torch.cuda.Event()
        host.copy_(step.out, non_blocking=True)
        self._read_done.record()
        step.run()
        self._read_done.synchronize()
        return host[:n].numpy().copy()

    def _decode_step(self, running: _Running, active: list[_Request], steady: bool, shrink: bool,
                     result: GenerationResult, stats: StepStats, on_tokens,
                     joiners: Sequence[_Request] = ()) -> _Running | None:
        """Read the outputs of the step ``running`` (whose rows' live requests are
        ``active``); if ``steady`` and no request stops at it (and none joins), launch
        the next step on the same rows at once, or if ``shrink`` and some stop, some rows
        are dead or ``joiners`` wait (requests prefilled while this step ran), on the rows
        of the others (in order: the rows that retiring the stopped requests leaves),
        then the joiners'; then this step's bookkeeping. With ``run_ahead``, the next
        step on the same rows may go before the read instead (see the class docstring).
        Returns the step launched ahead, or ``None``."""
        step, reqs = running.step, running.reqs
        slots = step.batch.host_slots  # this step's rows (a launch ahead may rewrite them)
        keep = None  # [R] bool, the rows of live requests, when some row is dead
        if len(active) != len(reqs):  # requests that stopped at the step before: ran ahead of its read
            keep = np.fromiter((r.finish is None for r in reqs), bool, len(reqs))
        # Run ahead: when no row can reach its budget at this step (only an end-of-sequence
        # token could stop one), the next step on the same rows goes before this one's read.
        run_ahead = (self.run_ahead and shrink and keep is None and not joiners
                     and int(running.left.min()) > step.out.shape[1] - 1)
        out = self._read(step, len(reqs), run_ahead)
        t_read = time.perf_counter()
        stats.seconds.append((t_read if running.ended is None else running.ended) - running.t0)
        stats.ahead.append(running.ahead)
        left = running.left
        if keep is not None:
            out, left = out[keep], left[keep]
            slots = tuple(s for s, k in zip(slots, keep.tolist()) if k)
        live = len(active)
        stops = self._stops(out, left)
        left = left - out[:, 0]
        ahead = None
        if run_ahead:  # its device time starts about when this step's output reached the host
            ahead = _Running(step, t_read, True, left, reqs)
        elif steady and keep is None and not stops.any() and not joiners:
            ahead = _Running(step, time.perf_counter(), True, left, reqs)
            step.run()  # its rows hold ``active`` still
        elif shrink and (joiners or not stops.all()):
            going = ~stops
            staying = [r for r, g in zip(active, going.tolist()) if g]
            budgets = np.fromiter((r.max_new - len(r.generated) for r in joiners), np.int64, len(joiners))
            ahead = self._launch(staying + list(joiners), np.concatenate([left[going], budgets]), ahead=True)
        counts = out[:, 0].tolist()
        rows = out.tolist()
        self.engine.kv.advance_host(slots, counts)  # the live rows come first: zip stops at them
        for r, row, n, stop in zip(active, rows, counts, stops.tolist()):
            if stop:
                kept = self._emit(r, row[1 : 1 + n])
            else:  # all n tokens kept, no stop, the first token's time long taken: what _emit would do
                kept = row[1 : 1 + n]
                r.generated += kept
            if on_tokens:
                on_tokens(r.index, kept)
        emitted = sum(counts)
        stats.rows.append(live)
        stats.emitted.append(emitted)
        result.accept_lengths += counts
        result.drafted += (step.window - 1) * live  # none in a plain step
        result.accepted += emitted - live
        result.steps += 1
        return ahead

    def _prefill_pass(self, filling: list[_Request], stats: StepStats, on_tokens,
                      in_flight: bool = False) -> list[_Request]:
        """One packed prefill forward over the next prompt tokens of ``filling`` (in
        order, at most ``prefill_chunk`` tokens); the requests whose prompt it completed
        get their first token and first drafts. Returns those requests. ``in_flight``:
        a step launched before it is not yet read (the pass comes after that step)."""
        eng = self.engine
        t0 = time.perf_counter()
        left = self.prefill_chunk or sum(len(r.prompt) - r.filled for r in filling)
        picked = []  # (request, first prompt position of the pass, tokens)
        for r in filling:
            if left == 0:
                break
            n = min(len(r.prompt) - r.filled, left)
            picked.append((r, r.filled, n))
            left -= n
        out = eng.extend([r.slot for r, _, _ in picked], [r.ids[s : s + n] for r, s, n in picked], prompt=True)
        keep_hidden = self.drafter is not None and self.drafter.needs_hidden
        done = []
        for i, (r, s, n) in enumerate(picked):
            r.filled += n
            if keep_hidden and r.filled < len(r.prompt):  # a prompt over several passes: kept for the join
                r.hidden.append(out.hidden[out.offsets[i] : out.offsets[i + 1]])
            if r.filled == len(r.prompt):
                done.append(i)
        if done:
            self._join([picked[i][0] for i in done], out, done, on_tokens)
        _sync(eng.device)
        stats.prefills.append(PrefillPass(
            after_step=len(stats.seconds) + in_flight, requests=[r.index for r, _, _ in picked], tokens=[n for _, _, n in picked],
            completed=[picked[i][0].index for i in done], seconds=time.perf_counter() - t0))
        return [picked[i][0] for i in done]

    def _join(self, joiners: list[_Request], out, rows: list[int], on_tokens) -> None:
        """First tokens of ``joiners`` from rows ``rows`` of the pass's last-token
        logits, into their windows; the drafter's first drafts; the tokens emitted."""
        eng = self.engine
        logits = out.logits if len(rows) == len(out.lengths) else out.logits[rows]
        if self.sampling.greedy:
            firsts = eng.static_argmax(logits)
        else:
            from .sampling import sample_categorical

            firsts = sample_categorical(warp_probs(logits, self.sampling))
        slots = to_device([r.slot for r in joiners], eng.device)
        self.windows[slots, 0] = firsts
        first_ids, firsts = firsts, firsts.tolist()
        if self.drafter is not None:
            self._capture_joins()  # once, before the first join (capture() does it ahead)
            if self._prompt_head is not None and out.prompt_head is self._prompt_head:
                # the pass ran the drafter's prompt head: it held each joiner's whole prompt
                # (a static pass's requests are fresh), whose pairs are in place
                ends = to_device([out.offsets[i + 1] - 1 for i in rows], eng.device)
                self.windows[slots, 1:] = self.drafter.join_cached(
                    [r.slot for r in joiners], [len(r.prompt) for r in joiners], first_ids, out.hidden[ends])
            else:
                hidden, offsets = None, None
                if self.drafter.needs_hidden:
                    hidden, offsets = self._prompt_hidden(joiners, out, rows)
                self.windows[slots, 1:] = self.drafter.join(
                    [r.slot for r in joiners], [r.prompt for r in joiners], firsts, [r.index for r in joiners],
                    hidden=hidden, offsets=offsets)
        for r, tok in zip(joiners, firsts):
            kept = self._emit(r, [tok])
            if on_tokens:
                on_tokens(r.index, kept)

    @staticmethod
    def _prompt_hidden(joiners: list[_Request], out, rows: list[int]):
        """``(hidden [sum P, H], offsets)`` of the joiners' whole prompts: the pass's own
        outputs when it held every prompt whole, else each prompt's earlier chunks and
        this pass's part, concatenated."""
        if len(rows) == len(out.lengths) and not any(r.hidden for r in joiners):
            return out.hidden, out.offsets
        parts, offsets = [], [0]
        for r, i in zip(joiners, rows):
            r.hidden.append(out.hidden[out.offsets[i] : out.offsets[i + 1]])
            parts += r.hidden
            r.hidden = []
            offsets.append(offsets[-1] + len(r.prompt))
        return torch.cat(parts), offsets

    def _prefill(self, joiners: list[_Request], on_tokens) -> None:
        """Prefill the whole prompts of ``joiners`` (slots allocated), in passes under
        the token budget, and emit their first tokens (no decode steps between)."""
        stats = StepStats()
        filling = list(joiners)
        while filling:
            self._prefill_pass(filling, stats, on_tokens)
            filling = [r for r in filling if r.filled < len(r.prompt)]

    _emit = SpeculativeGenerator._emit

    def _release(self, reqs) -> None:
        _free_slots(self.engine, reqs)
