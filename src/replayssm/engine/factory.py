"""Drafters by name: what the command line, the benchmarks and :class:`replayssm.LLM`
share when they turn ``"ngram"`` / ``"mtp"`` / ``"model"`` into a drafter."""

from __future__ import annotations

from ..ops.chunked import MAX_WINDOW_TRITON

#: The drafter names: n-gram prompt lookup, the checkpoint's MTP head, a draft model,
#: or none (plain decoding).
DRAFT_CHOICES = ("ngram", "mtp", "model", "none")
#: The longest verify window ``T = k + 1`` the command line and :class:`replayssm.LLM`
#: accept: the Triton window kernel's bound, applied on every backend so that what runs
#: on the CPU runs on a GPU too.
MAX_WINDOW = MAX_WINDOW_TRITON


def engine_max_len(longest_prompt: int, max_new_tokens: int, num_draft: int) -> int:
    """The ``max_len`` an engine needs for requests of at most ``longest_prompt`` +
    ``max_new_tokens`` tokens verified in windows of ``num_draft + 1``: the last
    window may reach past the budget, by up to a window."""
    return longest_prompt + max_new_tokens + num_draft + 2


def make_drafter(kind: str, engine, *, model_dir=None, draft_model_dir=None, sampling=None, batch: int = 1,
                 max_len: int = 0, tree=None):
    """A drafter of ``kind`` (one of :data:`DRAFT_CHOICES`; ``"none"`` gives ``None``)
    for ``engine``: n-gram lookup and the MTP head of ``model_dir`` run on the device
    inside the static step (:class:`~replayssm.engine.generator.StepGenerator`); the
    draft model of ``draft_model_dir`` (same tokenizer as ``model_dir``) runs eagerly
    with its own engine of ``batch`` slots and ``max_len`` tokens
    (:class:`~replayssm.engine.generator.SpeculativeGenerator`). ``tree``: a
    :class:`~replayssm.engine.trees.StaticTree` the drafter proposes (pass the same one
    to the ``StepGenerator``); the draft model's trees come from
    :class:`~replayssm.engine.model_drafter.DeviceModelDrafter`, inside the static step
    (``batch`` must then be the target's slots)."""
    from .device_drafters import DeviceMTPDrafter, DeviceNgramDrafter
    from .drafters import ModelDrafter, load_mtp_head

    if kind not in DRAFT_CHOICES:
        raise ValueError(f"kind must be one of {DRAFT_CHOICES}, got {kind!r}")
    if tree is not None and kind not in ("ngram", "mtp", "model"):
        raise ValueError(f"draft trees come from the ngram, mtp or model drafter, not {kind!r}")
    if kind == "none":
        return None
    if kind == "ngram":
        return DeviceNgramDrafter(tree=tree)
    if kind == "mtp":
        return DeviceMTPDrafter(engine, load_mtp_head(engine, model_dir), sampling=sampling, tree=tree)
    from .adapter import HybridEngine
    from .loading import load_model, load_tokenizer

    if not draft_model_dir:
        raise ValueError("a draft-model drafter needs draft_model_dir")
    target_vocab = load_tokenizer(model_dir).get_vocab()
    if load_tokenizer(draft_model_dir).get_vocab() != target_vocab:
        raise ValueError(f"{draft_model_dir!r} does not share the target's tokenizer")
    draft = load_model(draft_model_dir, dtype=engine.dtype, device=str(engine.device))
    # The draft model's GDN checkpoints take the target's dtype (16-bit states halve both).
    if tree is not None:  # the draft model inside the static step: its top-k trees
        from .model_drafter import DeviceModelDrafter

        draft_engine = HybridEngine(draft, strategy="fold", num_slots=batch, window=tree.num_nodes,
                                    max_len=max_len + engine.window, state_dtype=engine.pool.state_dtype)
        return DeviceModelDrafter(draft_engine, engine.vocab_size, sampling=sampling, tree=tree)
    draft_engine = HybridEngine(draft, strategy="fold", num_slots=batch, window=1, max_len=max_len,
                                state_dtype=engine.pool.state_dtype)
    return ModelDrafter(draft_engine, engine.vocab_size)
