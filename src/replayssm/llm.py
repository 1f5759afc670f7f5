"""Text in, text out: :class:`LLM`, in the manner of vLLM's ``LLM`` class.

    from replayssm import LLM, SamplingParams

    llm = LLM("embedded", strategy="circular", drafter="mtp")
    outputs = llm.generate(["def fibonacci(n):\\n"], SamplingParams(max_tokens=64))
    print(outputs[0].text, outputs[0].finish_reason, outputs[0].stats.tokens_per_step)

It runs on the engine the command line uses (``replayssm generate``): a
:class:`~replayssm.engine.adapter.HybridEngine` whose GDN state lives in a
:class:`~replayssm.state.StatePool` of the chosen strategy, decoded by
:class:`~replayssm.engine.generator.StepGenerator` (continuous batching over
static-shape steps, one CUDA graph replay per step on a GPU) or, for a draft model, by
:class:`~replayssm.engine.generator.SpeculativeGenerator`. Any number of prompts may be
given; at most ``max_num_seqs`` decode at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from .engine.sampling import SamplingParams

#: How a request ended: ``"stop"`` (it emitted an end-of-sequence token) or ``"length"``
#: (it reached ``max_tokens``).
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class OutputStats:
    """Speculative decoding figures of one request.

    Attributes:
        steps: decode steps the request took part in (its prompt prefill, which emits
            the first token, not counted).
        tokens_per_step: tokens the request emitted per decode step (accepted drafts +
            1; 1.0 for plain decoding; ``nan`` when it finished at the prefill).
        acceptance_rate: accepted over drafted tokens, counted by the decoding loop
            over the requests decoded together with this one (``None`` without a
            drafter).
        prefill_s, decode_s: wall time of that batch's prompt prefill passes and of the
            rest of its generation.
    """

    steps: int
    tokens_per_step: float
    acceptance_rate: float | None
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class Output:
    """One request's result.

    Attributes:
        prompt: the prompt text (``None`` when token ids were given).
        prompt_token_ids: the prompt's token ids.
        text: the generated text (special tokens left out).
        token_ids: the generated token ids (an end-of-sequence token included).
        finish_reason: ``"stop"`` or ``"length"`` (:data:`FINISH_REASONS`).
        stats: :class:`OutputStats`.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: OutputStats


#: ``state_dtype`` names of :class:`LLM` and ``replayssm generate --state-dtype``.
STATE_DTYPES = ("float32", "bfloat16")


class LLM:
    """A model, a GDN strategy and a drafter, ready to generate.

    Args:
        model: a local Hugging Face checkpoint directory of a Qwen3.5 / Qwen3-Next model
            (config, weights, tokenizer), or ``"embedded"``: the small trained model
            shipped in the package.
        strategy: how the GDN layers verify drafts and roll back: ``"snapshot"``,
            ``"fold"`` or ``"circular"`` (DESIGN.md section 3).
        drafter: ``"ngram"`` (prompt lookup), ``"mtp"`` (the checkpoint's MTP head),
            ``"model"`` (a draft model, see ``draft_model``) or ``"none"`` / ``None``
            (plain decoding).
        num_draft: draft tokens per step ``k`` (the verify window is ``k + 1``, at most
            :data:`replayssm.engine.factory.MAX_WINDOW`); default 3, or with ``tree``
            the tree's ``N - 1`` drafted nodes (any other value is refused).
        tree: a draft tree as children per depth (``(3, 2, 1)`` or ``"3,2,1"``; the
            ``"ngram"``, ``"mtp"`` or ``"model"`` drafter, the last inside the static
            step): every step verifies a tree of this shape,
            its ``N`` nodes at most ``MAX_WINDOW`` (DESIGN.md section 2, "Trees").
        chain_from: with ``tree``, batches of at least this many requests (by bucket)
            verify the tree's best chain, its spine, instead of the whole tree
            (:class:`~replayssm.engine.generator.StepGenerator`'s ``chain_from``);
            ``"measured"``: the bucket measured for this model, drafter and tree
            (:data:`replayssm.engine.trees.MEASURED_CHAIN_FROM`; ``ValueError`` where
            none was measured).
        draft_model: the draft model's directory (or ``"embedded-draft"``) with
            ``drafter="model"``; it must share the target's tokenizer.
        max_num_seqs: requests decoded at once (the engine's slots).
        max_model_len: most tokens per request, prompt and generated together (default
            the model's ``max_position_embeddings``, at most 8192); the KV cache holds
            this many per slot.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on the CPU), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``.
        state_dtype: the GDN checkpoints' dtype, ``"float32"`` (default) or
            ``"bfloat16"`` (half the state memory and bytes a step; the state is rounded
            to 16 bits at every store, so tokens can differ from fp32 states and
            between strategies).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        seed: seeds torch's random generators once, here (sampling draws from them).

    Raises:
        ValueError: a bad argument, a checkpoint directory that lacks something (each
            named), or a KV cache larger than the device's free memory; raised before
            any weight is loaded where it can be.
    """

    def __init__(self, model: str | os.PathLike = "embedded", *, strategy: str = "fold", drafter: str | None = "ngram",
                 num_draft: int | None = None, draft_model: str | os.PathLike | None = None, max_num_seqs: int = 8,
                 max_model_len: int | None = None, dtype: str = "auto", state_dtype: str = "float32",
                 device: str = "auto", seed: int | None = 0, tree: str | Sequence[int] | None = None,
                 chain_from: int | str | None = None):
        import torch

        from .engine.adapter import HybridEngine
        from .engine.factory import DRAFT_CHOICES, MAX_WINDOW, engine_max_len, make_drafter
        from .engine.kv_cache import check_kv_cache_fits
        from .engine.loading import (attention_geometry, check_device, check_model_dir, check_tokenizer,
                                     eos_token_ids, has_mtp_weights, load_model, read_config, resolve_device,
                                     resolve_dtype, resolve_model_path, shipped_model_name, text_config)
        from .strategies import STRATEGY_NAMES

        drafter = "none" if drafter is None else drafter
        if drafter not in DRAFT_CHOICES:
            raise ValueError(f"drafter must be one of {DRAFT_CHOICES} or None, got {drafter!r}")
        if strategy not in STRATEGY_NAMES:
            raise ValueError(f"strategy must be one of {STRATEGY_NAMES}, got {strategy!r}")
        branching = _branching(tree, drafter, chain_from)
        if branching is not None:
            from .engine.trees import StaticTree

            nodes = StaticTree.from_branching(branching).num_nodes
            if nodes > MAX_WINDOW:
                raise ValueError(f"tree {','.join(map(str, branching))} has {nodes} nodes; a window holds at most "
                                 f"{MAX_WINDOW}")
            if num_draft is not None and num_draft != nodes - 1:
                raise ValueError(f"num_draft {num_draft} disagrees with the tree's {nodes - 1} drafted nodes "
                                 "(leave num_draft unset with a tree)")
            num_draft = nodes - 1
        num_draft = 3 if num_draft is None else num_draft
        _positive("num_draft", num_draft)
        if num_draft + 1 > MAX_WINDOW:
            raise ValueError(f"num_draft must be at most {MAX_WINDOW - 1} (window num_draft + 1 <= {MAX_WINDOW}), "
                             f"got {num_draft}")
        _positive("max_num_seqs", max_num_seqs)
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        if device != "auto":
            check_device(device)
        if drafter != "model" and draft_model is not None:
            raise ValueError(f"draft_model is only used with drafter='model', not {drafter!r}")
        path = check_model_dir(resolve_model_path(model), tokenizer=False)
        if chain_from == "measured":
            from .engine.trees import measured_chain_from

            chain_from = measured_chain_from(shipped_model_name(path), drafter, branching)
        config = read_config(path)
        self.tokenizer = check_tokenizer(path, config)
        if drafter == "mtp" and not has_mtp_weights(path):
            raise ValueError(f"drafter='mtp': {path!r} has no mtp.* weights (this checkpoint carries no MTP head)")
        draft_path = None
        if drafter == "model":
            if draft_model is None:
                raise ValueError("drafter='model' needs draft_model (a directory, or 'embedded-draft')")
            draft_path = check_model_dir(resolve_model_path(draft_model), tokenizer=False)
            if check_tokenizer(draft_path).get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"draft_model {draft_path!r} does not share the model's tokenizer")
        limit = text_config(config).get("max_position_embeddings")
        if max_model_len is None:
            max_model_len = min(limit, 8192) if isinstance(limit, int) else 8192
        _positive("max_model_len", max_model_len)
        if isinstance(limit, int) and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")

        if seed is not None:
            torch.manual_seed(seed)
        self.model_dir = path
        self.strategy = strategy
        self.drafter = drafter
        self.num_draft = num_draft
        #: the draft tree's children per depth, or ``None`` (chains of ``num_draft``)
        self.tree = branching
        self.chain_from = chain_from
        self.max_model_len = max_model_len
        self.device = resolve_device(device)
        self._eos = eos_token_ids(path, self.tokenizer)
        window = 1 if drafter == "none" else num_draft + 1
        max_len = engine_max_len(max_model_len, 0, num_draft)
        layers, kv_heads, head_dim = attention_geometry(config)  # the KV cache's size, before any weight is read
        check_kv_cache_fits(layers, max_num_seqs, kv_heads, head_dim, max_len, resolve_dtype(dtype, self.device),
                            self.device)
        self.hf_model = load_model(path, dtype=dtype, device=str(self.device))
        #: the engine (its ``pool`` holds the GDN state, ``kv`` the attention layers' cache)
        self.engine = HybridEngine(self.hf_model, strategy=strategy, num_slots=max_num_seqs, window=window,
                                   max_len=max_len, state_dtype=getattr(torch, state_dtype))
        self._draft_dir = draft_path
        self._make_drafter = make_drafter
        self._generators: dict[tuple, object] = {}

    # ------------------------------------------------------------------ generation
    def _generator(self, params: SamplingParams):
        """The decoding loop for one kind of sampling (built once, then reused: on a GPU
        its CUDA graphs are captured on first use)."""
        key = (params.temperature, params.top_p, params.top_k, params.ignore_eos)
        if key not in self._generators:
            from .engine.generator import SpeculativeGenerator, StepGenerator

            warp = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            eos = () if params.ignore_eos else self._eos
            e = self.engine
            tree = None
            if self.tree is not None:
                from .engine.trees import StaticTree

                tree = StaticTree.from_branching(self.tree, e.device)
            d = self._make_drafter(self.drafter, e, model_dir=self.model_dir, draft_model_dir=self._draft_dir,
                                   sampling=warp, batch=e.pool.num_slots, max_len=e.max_len, tree=tree)
            if self.drafter == "model" and tree is None:  # the draft model decodes on the host between steps
                gen = SpeculativeGenerator(e, d, num_draft=self.num_draft, sampling=warp, eos_token_ids=eos)
            else:
                gen = StepGenerator(e, d, num_draft=self.num_draft, sampling=warp, eos_token_ids=eos, tree=tree,
                                    chain_from=self.chain_from)
            self._generators[key] = gen
        return self._generators[key]

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Generate for each prompt.

        Args:
            prompts: a text, a list of texts, or a list of token-id prompts (each a
                list of ints, or a 1-D integer array or CPU tensor).
            sampling_params: one :class:`SamplingParams` for all prompts (default
                greedy, 16 tokens), or one per prompt; per-prompt parameters may
                differ in ``max_tokens``, and requests that share temperature, top-p,
                top-k and ``ignore_eos`` decode in one batch.

        Returns:
            One :class:`Output` per prompt, in order.

        Raises:
            ValueError: before any decoding, for a prompt that is not UTF-8 text or
                encodes to nothing, token ids outside the vocabulary, or a prompt plus
                ``max_tokens`` longer than ``max_model_len``.
            TypeError: prompts or sampling parameters of the wrong type.
        """
        texts, ids = self._encode(prompts)
        params = self._params(sampling_params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, params)):
            if len(p) + sp.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceed max_model_len "
                                 f"{self.max_model_len}")
        groups: dict[tuple, list[int]] = {}
        for i, sp in enumerate(params):
            groups.setdefault((sp.temperature, sp.top_p, sp.top_k, sp.ignore_eos), []).append(i)
        outputs: list[Output | None] = [None] * len(ids)
        for members in groups.values():
            for i, out in zip(members, self._run(self._generator(params[members[0]]), [ids[i] for i in members],
                                                  [params[i].max_tokens for i in members])):
                outputs[i] = Output(prompt=texts[i], prompt_token_ids=[int(t) for t in ids[i]],
                                    text=self.tokenizer.decode(out[0], skip_special_tokens=True),
                                    token_ids=out[0], finish_reason=out[1], stats=out[2])
        return outputs

    def _run(self, gen, prompts: list, budgets: list[int]):
        """``(tokens, finish reason, stats)`` per prompt through ``gen`` (a
        ``SpeculativeGenerator`` takes at most the engine's slots per call)."""
        from .engine.generator import SpeculativeGenerator

        chunk = self.engine.pool.num_slots if isinstance(gen, SpeculativeGenerator) else len(prompts)
        out = []
        for start in range(0, len(prompts), chunk):
            calls = [0] * len(prompts[start:start + chunk])

            def count(i, _tokens):
                calls[i] += 1  # once at the prefill, then once per decode step

            r = gen.generate(prompts[start:start + chunk], budgets[start:start + chunk], on_tokens=count)
            for i, (toks, reason) in enumerate(zip(r.tokens, r.finish_reasons)):
                steps = max(0, calls[i] - 1)
                after = len(toks) - 1  # tokens emitted by decode steps
                stats = OutputStats(steps=steps, tokens_per_step=after / steps if steps else float("nan"),
                                    acceptance_rate=None if self.drafter == "none" else r.acceptance_rate,
                                    prefill_s=r.prefill_s, decode_s=r.decode_s)
                out.append((toks, "stop" if reason == "eos" else "length", stats))
        return out

    def _encode(self, prompts) -> tuple[list[str | None], list]:
        """``(texts, ids)``: the prompts' texts (``None`` for token-id prompts) and their
        token ids (the tokenizer's lists, or checked int64 arrays)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(f"prompts must be a non-empty list of texts or of token-id lists, "
                            f"got {type(prompts).__name__}")
        if all(isinstance(p, str) for p in prompts):
            ids = []
            for i, p in enumerate(prompts):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"prompts[{i}] is not UTF-8 text (position {e.start})") from None
                ids.append(self.tokenizer.encode(p, add_special_tokens=False))
                if not ids[-1]:
                    raise ValueError(f"prompts[{i}] encodes to no tokens")
            return list(prompts), ids
        from .engine.adapter import token_ids

        ids = []  # int64 arrays, which the generators take without a second pass over the ids
        hint = "(give every prompt as token ids, or every prompt as text)"
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                raise ValueError(f"prompts[{i}] is text among token-id prompts {hint}")
            try:
                ids.append(token_ids(p, f"prompts[{i}]", self.engine.vocab_size))
            except ValueError as e:
                raise ValueError(f"{e} {hint}") from None
        return [None] * len(prompts), ids

    @staticmethod
    def _params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(sp, SamplingParams) for sp in params):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of {n} of them")
        return params

    def __repr__(self) -> str:
        tree = "" if self.tree is None else f", tree={','.join(map(str, self.tree))!r}"
        chain = "" if self.chain_from is None else f", chain_from={self.chain_from}"
        return (f"LLM(model={self.model_dir!r}, strategy={self.strategy!r}, drafter={self.drafter!r}, "
                f"num_draft={self.num_draft}{tree}{chain}, max_num_seqs={self.engine.pool.num_slots}, "
                f"max_model_len={self.max_model_len}, device={str(self.device)!r})")


def _branching(tree, drafter: str, chain_from) -> tuple[int, ...] | None:
    """``tree`` as children per depth (``None`` without one), checked with the drafter
    and ``chain_from`` it needs."""
    if chain_from is not None:
        if chain_from != "measured":
            _positive("chain_from", chain_from)
        if tree is None:
            raise ValueError("chain_from chooses between a draft tree and its spine: it needs a tree")
    if tree is None:
        return None
    if drafter not in ("ngram", "mtp", "model"):
        raise ValueError(f"tree needs the ngram, mtp or model drafter, not {drafter!r}")
    if isinstance(tree, str):
        from .engine.trees import parse_branching

        return parse_branching(tree)
    if (not isinstance(tree, Sequence) or not tree
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in tree)):
        raise ValueError(f"tree must be children per depth, positive ints such as (3, 2, 1) or '3,2,1', got {tree!r}")
    return tuple(tree)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
