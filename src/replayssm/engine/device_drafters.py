"""Drafters that run on the device, inside a static (CUDA-graph) step.

A static step ends by drafting the next window of every row, so the host never sits
between two steps' GPU work: it only reads the tokens a step emitted. Each drafter keeps
per-slot buffers ``[slots + 1, ...]`` (the last slot is the KV cache's sink, which
padding rows write to) and offers:

* ``start(slot, tokens, request)`` (eager, host): a request joins with its prompt plus
  its first generated token.
* ``observe(slot_idx, emitted, accepted)`` (graph-safe): the tokens a step emitted,
  ``emitted [B, T]`` (``-1`` past ``accepted [B]``).
* ``propose(slot_idx) -> [B, k]`` (graph-safe): ``k = window - 1`` draft tokens per row.

Two drafters: :class:`DeviceNgramDrafter` (prompt lookup as tensor ops, the same
proposals as :class:`replayssm.engine.drafters.NgramDrafter` whenever that finds a
match) and :class:`OracleDrafter` (a set acceptance rate on any model, for benchmarks).
Draft tokens are always ``k`` per row: where a drafter has nothing to propose it repeats
the last token, which greedy acceptance treats like any other guess.
"""

from __future__ import annotations

from typing import Sequence

import torch


class DeviceDrafter:
    """Base class (see the module docstring for the protocol)."""

    name = ""

    def bind(self, num_slots: int, num_draft: int, capacity: int, device: torch.device) -> None:
        """Allocate per-slot buffers: ``num_slots`` requests (plus the sink), ``num_draft``
        tokens per proposal, ``capacity`` tokens per request (prompt + generated)."""
        raise NotImplementedError

    def start(self, slot: int, tokens: Sequence[int], request: int) -> None:
        raise NotImplementedError

    def observe(self, slot_idx: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor) -> None:
        raise NotImplementedError

    def propose(self, slot_idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DeviceNgramDrafter(DeviceDrafter):
    """Prompt lookup on the device: the latest earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``), and what followed it,
    continued periodically where it runs into the proposal itself.

    History: ``[slots + 1, capacity]`` token ids and lengths. A lookup compares every
    length-``n`` window of the history with the suffix (``B x capacity x n`` compares
    per ``n``), which a GPU does in microseconds for thousands of tokens.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or min_ngram < 1:
            raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def bind(self, num_slots, num_draft, capacity, device):
        self.k = num_draft
        self.capacity = capacity
        self.history = torch.full((num_slots + 1, capacity), -1, dtype=torch.int64, device=device)
        self.length = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._steps = torch.arange(max(num_draft, 1), device=device)

    def start(self, slot, tokens, request):
        tokens = list(tokens)[-self.capacity:]
        self.history[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=self.history.device)
        self.length[slot] = len(tokens)

    def observe(self, slot_idx, emitted, accepted):
        t = emitted.shape[1]
        start = self.length[slot_idx]
        pos = (start[:, None] + torch.arange(t, device=emitted.device)).clamp(max=self.capacity - 1)
        # Entries past ``accepted`` land beyond the new length, where no lookup reads.
        self.history[slot_idx[:, None].expand_as(pos), pos] = emitted
        self.length[slot_idx] = (start + accepted).clamp(max=self.capacity)

    def propose(self, slot_idx):
        seq = self.history[slot_idx]  # [B, C]
        length = self.length[slot_idx]  # [B]
        b, cap = seq.shape
        best_i = torch.full((b,), -1, dtype=torch.int64, device=seq.device)
        best_n = torch.zeros_like(best_i)
        for n in range(min(self.max_ngram, cap - 1), self.min_ngram - 1, -1):
            pat_pos = (length[:, None] - n + torch.arange(n, device=seq.device)).clamp(min=0)
            pattern = seq.gather(1, pat_pos)  # [B, n]: the last n tokens
            hit = (seq.unfold(1, n, 1) == pattern[:, None, :]).all(-1)  # [B, C - n + 1]
            i = torch.arange(cap - n + 1, device=seq.device)
            # an earlier occurrence with at least one token after it; needs length > n
            hit &= (i[None] + n < length[:, None]) & (length[:, None] > n)
            latest = torch.where(hit, i[None], -1).amax(1)
            take = (best_i < 0) & (latest >= 0)
            best_i = torch.where(take, latest, best_i)
            best_n = torch.where(take, n, best_n)
        found = best_i >= 0
        period = (length - best_i - best_n).clamp(min=1)  # the continuation repeats itself after it
        src = best_i[:, None] + best_n[:, None] + self._steps[None, : self.k] % period[:, None]
        last = (length - 1).clamp(min=0)[:, None].expand(b, self.k)
        src = torch.where(found[:, None], src, last).clamp(0, cap - 1)
        return seq.gather(1, src)


class OracleDrafter(DeviceDrafter):
    """Drafts with a set acceptance rate: each draft token is the reference greedy
    continuation's token with probability ``acceptance``, else a token that differs from
    it. On a model that reproduces the reference (greedy decoding of the same model),
    the accepted length then follows the geometric law of ``acceptance``, whatever the
    weights: speed-up against acceptance becomes measurable on random-weight models.

    Args:
        references: per request index, the reference continuation (the tokens plain
            greedy decoding generated, first token included).
        acceptance: probability ``P`` of keeping each draft token, in ``[0, 1]``.
        vocab_size: the target's vocabulary (wrong tokens are drawn from it).
        seed: seed of the drafter's coin flips (CPU runs; on CUDA the default
            generator serves graph replays).
    """

    name = "oracle"

    def __init__(self, references: dict[int, Sequence[int]] | Sequence[Sequence[int]], acceptance: float,
                 vocab_size: int, seed: int = 0):
        if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance must be a number in [0, 1], got {acceptance!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        self.acceptance = float(acceptance)
        self.vocab_size = vocab_size
        self.seed = seed
        self.set_references(references)

    def set_references(self, references: dict[int, Sequence[int]] | Sequence[Sequence[int]]) -> None:
        """Replace the reference continuations (per request index) for later requests."""
        refs = dict(references) if isinstance(references, dict) else dict(enumerate(references))
        for i, r in refs.items():
            if not r or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in r):
                raise ValueError(f"references[{i}] must be a non-empty list of token ids in [0, {self.vocab_size})")
        self.references = {i: list(r) for i, r in refs.items()}

    def bind(self, num_slots, num_draft, capacity, device):
        self.k = num_draft
        self.reference = torch.zeros((num_slots + 1, capacity), dtype=torch.int64, device=device)
        self.generated = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._steps = torch.arange(max(num_draft, 1), device=device)
        self.generator = None if device.type == "cuda" else torch.Generator(device=device).manual_seed(self.seed)

    def start(self, slot, tokens, request):
        ref = self.references.get(request)
        if ref is None:
            if self.acceptance > 0:
                raise ValueError(f"the oracle drafter has no reference for request {request}")
            ref = [tokens[-1]]  # P = 0 never proposes a reference token
        ref = ref[: self.reference.shape[1]]
        self.reference[slot, : len(ref)] = torch.tensor(ref, dtype=torch.int64, device=self.reference.device)
        self.reference[slot, len(ref):] = ref[-1]
        self.generated[slot] = 1  # the prefill emitted the first token

    def observe(self, slot_idx, emitted, accepted):
        self.generated[slot_idx] = self.generated[slot_idx] + accepted

    def propose(self, slot_idx):
        b = slot_idx.shape[0]
        pos = (self.generated[slot_idx][:, None] + self._steps[None, : self.k]).clamp(max=self.reference.shape[1] - 1)
        right = self.reference[slot_idx].gather(1, pos)  # [B, k]
        dev = right.device
        keep = torch.rand((b, self.k), device=dev, generator=self.generator) < self.acceptance
        shift = torch.randint(1, self.vocab_size, (b, self.k), device=dev, generator=self.generator)
        return torch.where(keep, right, (right + shift) % self.vocab_size)
