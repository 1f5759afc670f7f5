"""Greedy plain decoding through ``circular``'s ring against the recurrence, in lockstep.

:func:`compare_plain_decoding` decodes one prompt greedily with two engines on the same
model: one whose plain steps go through the ring (``circular``, ``plain_via_ring``,
DESIGN.md section 9) and one whose plain steps run the exact recurrence (``fold``).
Both take every step on the same token, so their logits can be compared position by
position; the run stops at the first position where their greedy tokens differ and
reports it with its logit margins (how close to a tie the recurrence's choice was).

The suite runs it briefly on the embedded model (tests/engine/test_ring_decode_engine.py);
``scripts/ring_decode_check.py`` runs it over 8192 tokens.
"""

from __future__ import annotations

from typing import Callable

import torch


def top2_margin(logits: torch.Tensor) -> float:
    """Top logit minus the runner-up's, of ``logits [V]``."""
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def compare_plain_decoding(model, prompt: list[int], tokens: int, *, window: int = 4, ring_len: int = 16,
                           backend: str = "reference", on_step: Callable[[int], None] | None = None) -> dict:
    """Greedy plain decoding of ``prompt`` for ``tokens`` tokens, through the ring and
    through the recurrence, in lockstep.

    Args:
        model: a Qwen3.5 / Qwen3-Next ``*ForCausalLM`` (fp32 for an exactness check).
        prompt: token ids.
        tokens: tokens to generate (the first comes from the prompt's prefill, which is
            the recurrence for both engines).
        window, ring_len: the ring engine's pool (``T``: the cursor rule keeps room for
            a speculative window of ``T``; ``L``: a flush every ``L - 2T + 1`` tokens).
        backend: op backend of both engines.
        on_step: called with the number of tokens generated so far (progress).

    Returns:
        A JSON-ready dict: ``tokens`` (generated and compared), ``equal`` (no
        difference), ``first_difference`` (``None``, or ``index``, ``ring_token``,
        ``recurrence_token``, ``recurrence_margin``: the recurrence's top-2 logit gap
        there, ``ring_margin``: the ring's logit of its own token minus that of the
        recurrence's), ``max_logit_error`` (largest ``|logit_ring - logit_rec|`` up to the
        first difference), ``logit_scale`` (largest ``|logit_rec|`` over the same
        positions), ``flushes`` (ring flushes of the request), the configuration.
    """
    from ..engine.adapter import HybridEngine

    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    max_len = len(prompt) + tokens + window + 1
    ring = HybridEngine(model, strategy="circular", window=window, ring_len=ring_len, max_len=max_len,
                        backend=backend, prefill="recurrence", plain_via_ring=True)
    rec = HybridEngine(model, strategy="fold", window=1, max_len=max_len, backend=backend, prefill="recurrence")
    slots = [ring.alloc(), rec.alloc()]
    out = {"tokens": 0, "equal": True, "first_difference": None, "max_logit_error": 0.0, "logit_scale": 0.0,
           "flushes": 0, "window": window, "ring_len": ring_len, "backend": backend, "prompt_tokens": len(prompt)}
    flags = ring.pool.buffers["is_flush"]
    with torch.inference_mode():
        logits = [e.extend([s], [prompt], prompt=True).logits[0] for e, s in zip((ring, rec), slots)]
        for i in range(tokens):
            a, b = logits
            out["max_logit_error"] = max(out["max_logit_error"], float((a - b).abs().max()))
            out["logit_scale"] = max(out["logit_scale"], float(b.abs().max()))
            t_ring, t_rec = int(a.argmax()), int(b.argmax())
            out["tokens"] = i + 1
            if t_ring != t_rec:
                out["equal"] = False
                out["first_difference"] = {
                    "index": i, "ring_token": t_ring, "recurrence_token": t_rec,
                    "recurrence_margin": top2_margin(b), "ring_margin": float(a[t_ring] - a[t_rec]),
                }
                break
            if on_step is not None:
                on_step(i + 1)
            if i + 1 == tokens:
                break
            out["flushes"] += int(flags[slots[0]])  # this step folds the ring into the checkpoint
            logits = [e.extend([s], [[t_rec]]).logits[0] for e, s in zip((ring, rec), slots)]
    return out
