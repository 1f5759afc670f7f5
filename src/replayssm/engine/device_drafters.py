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

Drafters: :class:`DeviceNgramDrafter` (prompt lookup as tensor ops, the same proposals
as :class:`replayssm.engine.drafters.NgramDrafter` whenever that finds a match),
:class:`DeviceMTPDrafter` (the checkpoint's MTP head), and two for benchmarks:
:class:`OracleDrafter` (a set acceptance rate on any model whose greedy tokens
reproduce a reference run) and :class:`ForcedDrafter` (a set acceptance on any model
and any numerics: the step accepts a seeded random number of drafts instead of
comparing them with the target's tokens, see :meth:`DeviceDrafter.forced_accepts`).
Draft tokens are always ``k`` per row: where a drafter has nothing to propose it repeats
the last token, which greedy acceptance treats like any other guess.
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import torch

from ..ops.counter_hash import hash_accept_counts, hash_tokens
from ..ops.guards import to_device
from ..ops.triton_common import chained_launches
from .activations import dense_silu_mlp
from .fused_linear import fuse_linears, fused_weight
from .normed_linear import NORMED_LINEAR_DTYPES, normed_linear
from .norms import norm_eps, norm_kind, rms_norm_pair
from .rotary import rope_at
from .step_inputs import draft_inputs


def _check_tree(tree) -> None:
    """A drafter's ``tree`` argument: a :class:`~replayssm.engine.trees.StaticTree` or ``None``."""
    from .trees import StaticTree

    if tree is not None and not isinstance(tree, StaticTree):
        raise TypeError(f"tree must be a StaticTree or None, got {type(tree).__name__}")


def _draft_sampling(sampling, tree):
    """A model drafter's checked ``sampling`` and ``tree``; returns the sampling its
    drafts follow: ``None`` (argmax drafts) when absent or greedy, and with a tree, whose
    top-k expansion is deterministic."""
    from .sampling import SamplingParams

    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    _check_tree(tree)
    return None if sampling is None or sampling.greedy or tree is not None else sampling


def _check_tree_device(tree, device) -> None:
    """A drafter's static tree expands on the engine's device (its index tensors meet the
    drafts there): refuse one built elsewhere, before any buffer is allocated."""
    if tree is None:
        return
    want, have = torch.device(device), tree.device
    if have.type != want.type or (want.index is not None and have.index is not None and have.index != want.index):
        raise ValueError(f"tree is on {have}, the engine on {want}: build it with "
                         f"StaticTree.from_branching(..., device={str(want)!r})")


class DeviceDrafter:
    """Base class (see the module docstring for the protocol)."""

    name = ""

    def bind(self, num_slots: int, num_draft: int, capacity: int, device: torch.device) -> None:
        """Allocate per-slot buffers: ``num_slots`` requests (plus the sink), ``num_draft``
        tokens per proposal, ``capacity`` tokens per request (prompt + generated)."""
        raise NotImplementedError

    #: whether :meth:`join` and :meth:`observe` need the target's hidden states
    needs_hidden = False

    #: work of :meth:`join` that can run inside a static prompt pass
    #: (:meth:`~replayssm.engine.adapter.HybridEngine.set_prompt_head`, set by the step
    #: driver after :meth:`bind`), or ``None``. A drafter that has one takes
    #: ``join_cached`` for the requests of a pass that ran it.
    prompt_head = None

    def start(self, slot: int, tokens: Sequence[int], request: int) -> None:
        raise NotImplementedError

    def join(self, slots: list[int], prompts: list[list[int]], firsts: list[int], requests: list[int],
             hidden: torch.Tensor | None = None, offsets: list[int] | None = None) -> torch.Tensor:
        """Requests join after their prompt prefill (eager): returns their first drafts
        ``[J, k]``. ``hidden [sum P, H]`` / ``offsets`` are the prompts' target hidden
        states when :attr:`needs_hidden`."""
        for s, p, f, r in zip(slots, prompts, firsts, requests):
            self.start(s, list(p) + [f], r)
        return self.propose(torch.tensor(slots, dtype=torch.long, device=self._device))

    def set_rows(self, slots: Sequence[int]) -> None:
        """The pool slots (``-1`` padding) of the rows of the next steps of
        ``len(slots)`` rows, on the host before each launch (a drafter with static
        batches of its own sets them here; the others need nothing)."""

    def capture_join(self, buckets: Sequence[int]) -> None:
        """Capture the first drafts of :meth:`join` in CUDA graphs, one per bucket of
        ``buckets`` rows (a step driver calls this beside capturing its steps). A drafter
        whose first drafts are cheap captures nothing."""

    def observe(self, slot_idx: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor, *,
                hidden: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def propose(self, slot_idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    #: whether :meth:`propose_spine` drafts a tree's spine alone: a spine step then
    #: proposes only the chain it will verify, and the tree's other nodes keep older
    #: tokens, which a later tree step verifies as any other candidates (an accepted
    #: node is the target's token whatever proposed it). Otherwise spine steps
    #: propose whole trees.
    drafts_spines = False

    def propose_spine(self, slot_idx: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` drafts of the next tree's spine (its best candidate at each of the
        tree's ``D`` depths), what :meth:`propose` would put on the spine, for drafters
        with :attr:`drafts_spines`."""
        raise NotImplementedError(f"the {self.name!r} drafter proposes whole trees only")

    def draft_probs(self, slot_idx: torch.Tensor) -> torch.Tensor | None:
        """``[B, k, V]`` probabilities the current drafts were sampled from, or ``None``
        when they are deterministic (rejection sampling then takes ``q = onehot``)."""
        return None

    #: whether :meth:`forced_accepts` overrides the step's acceptance (greedy steps only)
    forces_acceptance = False

    def forced_accepts(self, slot_idx: torch.Tensor) -> torch.Tensor | None:
        """``[B]`` int64 drafts the step must accept for the current windows (graph-safe),
        or ``None``: the target's tokens decide (every real drafter). Called before
        :meth:`observe` of the same step."""
        return None

    def check_sampling(self, sampling) -> None:
        """``ValueError`` when this drafter cannot serve steps that decode with
        ``sampling`` (a :class:`~replayssm.engine.sampling.SamplingParams`)."""
        if self.forces_acceptance and not sampling.greedy:
            raise ValueError(f"the {self.name!r} drafter sets the accepted counts of greedy steps; sampling needs "
                             "a drafter whose tokens the target verifies")


class _SetAcceptance:
    """A benchmark drafter's acceptance ``P``, kept on the device as well (``_p``, once
    bound) so that steps captured in CUDA graphs follow a change."""

    _p: torch.Tensor | None = None

    def set_acceptance(self, acceptance: float) -> None:
        """Change ``P``; steps already captured in CUDA graphs follow (they read it on the
        device), so one set of graphs serves every acceptance."""
        if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance must be a number in [0, 1], got {acceptance!r}")
        self.acceptance = float(acceptance)
        if self._p is not None:
            self._p.fill_(self.acceptance)


class DeviceNgramDrafter(DeviceDrafter):
    """Prompt lookup on the device: the latest earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``), and what followed it,
    continued periodically where it runs into the proposal itself.

    History: ``[slots + 1, capacity]`` token ids and lengths. A lookup compares every
    length-``n`` window of the history with the suffix (``B x capacity x n`` compares
    per ``n``), which a GPU does in microseconds for thousands of tokens.

    With ``tree`` (a :class:`~replayssm.engine.trees.StaticTree`), :meth:`propose`
    returns the tree's nodes ``1..N-1`` from several continuations: the
    ``candidates`` best matches (longer n-grams first, then later ones), each continued
    to the tree's depth; a node's children are the distinct next tokens of the
    continuations that run through the node, in match order. A node no continuation
    reaches repeats its parent's first child (or, at the root, the last token): a guess
    like any other, and duplicate siblings cost nothing but a node.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, tree=None, candidates: int = 16):
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or min_ngram < 1:
            raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
        _check_tree(tree)
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be a positive int, got {candidates!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tree = tree
        self.candidates = candidates

    def bind(self, num_slots, num_draft, capacity, device):
        _check_tree_device(self.tree, device)
        self.k = num_draft
        self.capacity = capacity
        self._device = device
        self.history = torch.full((num_slots + 1, capacity), -1, dtype=torch.int64, device=device)
        self.length = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._steps = torch.arange(max(num_draft, 1), device=device)

    def start(self, slot, tokens, request):
        tokens = list(tokens)[-self.capacity:]
        self.history[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=self.history.device)
        self.length[slot] = len(tokens)

    def observe(self, slot_idx, emitted, accepted, *, hidden=None, positions=None):
        t = emitted.shape[1]
        start = self.length[slot_idx]
        pos = (start[:, None] + torch.arange(t, device=emitted.device)).clamp(max=self.capacity - 1)
        # Entries past ``accepted`` land beyond the new length, where no lookup reads.
        self.history[slot_idx[:, None].expand_as(pos), pos] = emitted
        self.length[slot_idx] = (start + accepted).clamp(max=self.capacity)

    def _hits(self, seq: torch.Tensor, length: torch.Tensor):
        """Per n-gram length ``n`` (longest first): ``(n, hit [B, C - n + 1])``, the
        earlier occurrences of the last ``n`` tokens with at least one token after them."""
        cap = seq.shape[1]
        for n in range(min(self.max_ngram, cap - 1), self.min_ngram - 1, -1):
            pat_pos = (length[:, None] - n + torch.arange(n, device=seq.device)).clamp(min=0)
            pattern = seq.gather(1, pat_pos)  # [B, n]: the last n tokens
            hit = (seq.unfold(1, n, 1) == pattern[:, None, :]).all(-1)  # [B, C - n + 1]
            i = torch.arange(cap - n + 1, device=seq.device)
            # an earlier occurrence with at least one token after it; needs length > n
            yield n, hit & (i[None] + n < length[:, None]) & (length[:, None] > n)

    def _continue(self, seq, length, at, n, found, count):
        """``[B, M, count]`` continuations of the matches at ``at [B, M]`` of ``n [B, M]``
        tokens (periodic where they run into the proposal itself); the last token where
        not ``found``."""
        period = (length[:, None] - at - n).clamp(min=1)
        steps = torch.arange(count, device=seq.device)
        src = at[..., None] + n[..., None] + steps % period[..., None]
        last = (length - 1).clamp(min=0)[:, None, None].expand_as(src)
        src = torch.where(found[..., None], src, last).clamp(0, seq.shape[1] - 1)
        return seq.gather(1, src.flatten(1)).view(src.shape)

    def propose(self, slot_idx):
        seq = self.history[slot_idx]  # [B, C]
        length = self.length[slot_idx]  # [B]
        if self.tree is not None:
            return self._propose_tree(seq, length)
        b = seq.shape[0]
        best_i = torch.full((b,), -1, dtype=torch.int64, device=seq.device)
        best_n = torch.zeros_like(best_i)
        for n, hit in self._hits(seq, length):
            i = torch.arange(hit.shape[1], device=seq.device)
            latest = torch.where(hit, i[None], -1).amax(1)
            take = (best_i < 0) & (latest >= 0)
            best_i = torch.where(take, latest, best_i)
            best_n = torch.where(take, n, best_n)
        return self._continue(seq, length, best_i[:, None], best_n[:, None], (best_i >= 0)[:, None], self.k)[:, 0]

    def _propose_tree(self, seq, length):
        """The tree's nodes ``1..N-1`` ``[B, N - 1]`` from the best ``candidates`` matches."""
        tree, cap = self.tree, seq.shape[1]
        b, dev = seq.shape[0], seq.device
        # every (n, i) match scored longer n first, then later i; -1 for no match
        scores = torch.cat([torch.where(hit, n * cap + torch.arange(hit.shape[1], device=dev)[None], -1)
                            for n, hit in self._hits(seq, length)], 1)
        m = min(self.candidates, scores.shape[1])
        best = scores.topk(m, dim=1).values  # [B, M], best first
        found = best >= 0
        n, at = best.clamp(min=0) // cap, best.clamp(min=0) % cap
        cont = self._continue(seq, length, at, n, found, tree.max_depth)  # [B, M, D]
        tokens = torch.zeros((b, tree.num_nodes), dtype=torch.int64, device=dev)
        tokens[:, 0] = seq.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
        through = torch.zeros((b, tree.num_nodes, m), dtype=torch.bool, device=dev)  # continuations via each node
        through[:, 0] = found
        earlier = torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1)  # [m, m']: m' comes before m
        for depth, (level, width, children, source) in enumerate(tree.expansion):
            via = through[:, level]  # [B, L, M]
            nxt = cont[:, :, depth]  # [B, M]: each continuation's token after this depth
            same = nxt[:, :, None] == nxt[:, None, :]  # [B, M, M']
            repeat = (via[:, :, None, :] & (same & earlier)[:, None]).any(-1)  # an earlier one has its token
            first = via & ~repeat  # [B, L, M]: the first continuation of each distinct next token
            rank = first.long().cumsum(-1) - 1
            picks = []
            for r in range(width):
                pick = first & (rank == r)  # at most one continuation per node
                tok = (pick.long() * nxt[:, None]).sum(-1)  # [B, L]
                picks.append((pick.any(-1), tok))
            fallback = torch.where(picks[0][0], picks[0][1], tokens[:, level])  # repeat the first child, or the node
            chosen = torch.stack([torch.where(ok, tok, fallback) for ok, tok in picks], -1)  # [B, L, width]
            tokens[:, children] = chosen.reshape(b, -1)[:, source]
            # the continuations that run through each new child: its parent's, with the child's token
            parent_of = tree.parents[children]
            pos_in_level = (level[None, :] == parent_of[:, None]).long().argmax(1)  # children -> index in level
            through[:, children] = via[:, pos_in_level] & (nxt[:, None, :] == tokens[:, children, None])
        return tokens[:, 1:]


class OracleDrafter(_SetAcceptance, DeviceDrafter):
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
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
        self.set_acceptance(acceptance)
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
        self._device = device
        self.reference = torch.zeros((num_slots + 1, capacity), dtype=torch.int64, device=device)
        self.generated = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._p = torch.full((), self.acceptance, dtype=torch.float32, device=device)
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

    def observe(self, slot_idx, emitted, accepted, *, hidden=None, positions=None):
        self.generated[slot_idx] = self.generated[slot_idx] + accepted

    def propose(self, slot_idx):
        b = slot_idx.shape[0]
        pos = (self.generated[slot_idx][:, None] + self._steps[None, : self.k]).clamp(max=self.reference.shape[1] - 1)
        right = self.reference[slot_idx].gather(1, pos)  # [B, k]
        dev = right.device
        keep = torch.rand((b, self.k), device=dev, generator=self.generator) < self._p
        shift = torch.randint(1, self.vocab_size, (b, self.k), device=dev, generator=self.generator)
        return torch.where(keep, right, (right + shift) % self.vocab_size)


class ForcedDrafter(_SetAcceptance, DeviceDrafter):
    """A benchmark drafter whose acceptance does not depend on the model: the step
    accepts a seeded random number of its drafts (:meth:`forced_accepts`) instead of
    comparing them with the target's greedy tokens, so every strategy, whatever its
    numerics, runs the same accepted counts and commits them through the same path.

    Per step, draft ``i`` (0-based) is accepted when drafts ``0..i-1`` were and an
    independent coin with probability ``P`` comes up: accepted drafts ``n`` follow the
    truncated geometric law ``P(n = j) = P^j (1 - P)`` for ``j < k``, ``P(n = k) = P^k``.
    The coins are :func:`~replayssm.ops.counter_hash.counter_hash` of ``(seed, request,
    the request's step, i)``: the same for a request whatever its slot, batch or
    strategy, on the CPU and on CUDA (no generator state, nothing read on the host; on
    CUDA three launches a step, :func:`~replayssm.ops.counter_hash.hash_accept_counts`,
    the step counters' increment and :func:`~replayssm.ops.counter_hash.hash_tokens`,
    so that the drafter adds microseconds to the step whose cost it is there to
    measure: as tensor ops around the hash they were 17). The drafts themselves are
    pseudo-random tokens from the same hash (varied tokens, as real text routes to
    varied MoE experts); the step emits the accepted drafts and then the target's
    greedy token at the first rejected position (or after the last draft), so the text
    is the drafts' and the target's, not the model's own greedy continuation.

    Greedy steps only; requests should not stop on end-of-sequence tokens (a drafted
    one would end a request early, and differently per strategy where the target's
    tokens differ).

    Args:
        acceptance: ``P``, the probability of accepting each draft after an accepted one.
        vocab_size: the target's vocabulary (drafts are drawn from it).
        seed: seed of the draws (and of the drafts).
    """

    name = "forced"
    forces_acceptance = True
    #: the draws' backend (:mod:`replayssm.ops.dispatch`): ``"auto"``, Triton on CUDA
    backend = "auto"

    def __init__(self, acceptance: float, vocab_size: int, seed: int = 0):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.set_acceptance(acceptance)
        self.vocab_size = vocab_size
        self.seed = seed

    def bind(self, num_slots, num_draft, capacity, device):
        self.k = num_draft
        self._device = device
        self.request = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # request index per slot
        self.step = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # the request's steps so far
        self._p = torch.full((), self.acceptance, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)  # observe's increment, a row each

    def start(self, slot, tokens, request):
        if isinstance(request, bool) or not isinstance(request, int) or request < 0:
            raise ValueError(f"request must be a non-negative int, got {request!r}")
        self.request[slot] = request
        self.step[slot] = 0

    def observe(self, slot_idx, emitted, accepted, *, hidden=None, positions=None):
        # one launch; padding rows all name the sink slot, whose count nothing reads
        self.step.index_add_(0, slot_idx, self._one.expand(slot_idx.shape[0]))

    def propose(self, slot_idx):
        # draws k..2k-1 of the row's (request, step): the drafts
        return hash_tokens(self.seed, self.request, self.step, slot_idx, self.k, self.k, self.vocab_size,
                           backend=self.backend)

    def forced_accepts(self, slot_idx):
        # draws 0..k-1: the coins, 24 uniform bits each as a float32 in [0, 1), u < P
        return hash_accept_counts(self.seed, self.request, self.step, slot_idx, self.k, self._p, backend=self.backend)


class _JoinGraph:
    """:meth:`DeviceMTPDrafter._join_drafts` captured on ``rows`` padded rows: static
    inputs (slot, first token, the target's hidden state at the last prompt token, next
    position per row) and the drafts it writes."""

    def __init__(self, drafter: "DeviceMTPDrafter", rows: int, pool=None):
        from .graph_step import capture_graph

        dev, self.sink = drafter._device, drafter.cache.sink
        self.slot_idx = torch.full((rows,), self.sink, dtype=torch.long, device=dev)
        self.first = torch.zeros((rows,), dtype=torch.long, device=dev)
        self.h = torch.zeros((rows, drafter.engine.embed.weight.shape[1]), dtype=drafter.engine.dtype, device=dev)
        # padding rows pair at the sink's position 0 and draft at positions 1..k-1;
        # later joins leave their own (valid) positions there
        self.next_pos = torch.ones((rows,), dtype=torch.long, device=dev)
        self.drafts = None

        def body():
            self.drafts = drafter._join_drafts(self.slot_idx, self.first, self.h, self.next_pos)

        self.graph = capture_graph(body, dev, pool=pool)

    def run(self, slot_idx: torch.Tensor, first: torch.Tensor, h: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
        """Drafts ``[n, k]`` of ``n <= rows`` joining rows (a copy: the next replay
        overwrites the graph's buffer)."""
        n = slot_idx.shape[0]
        self.slot_idx[:n] = slot_idx
        self.slot_idx[n:] = self.sink
        self.first[:n] = first
        self.h[:n] = h
        self.next_pos[:n] = next_pos
        self.graph.replay()
        return self.drafts[:n].clone()


class DeviceMTPDrafter(DeviceDrafter):
    """The model's MTP head (:class:`replayssm.engine.drafters.MTPHead`) drafting inside
    the static step, greedily (drafts are deterministic, so sampling's rejection rule
    applies as for n-gram drafts).

    The head's attention keeps its own KV cache, indexed like the target's: the pair
    ``(h_t, x_{t+1})`` (target hidden state at position ``t``, next token) sits at
    position ``t``, so after every step the head holds exactly the target's committed
    positions. A step's update runs the head over all ``T`` window positions with the
    emitted tokens as ``x_{t+1}`` (the accepted drafts, then the correction or bonus
    token): entries past the accepted ones are written but lie beyond the committed
    length, where the next step overwrites them. Drafts ``2..k`` apply the head to its
    own output, one row per request, at the positions after it (tentative entries, same
    rule).

    Args:
        engine: the target engine (embedding, rotary embedding and LM head are shared).
        head: the loaded head (:func:`replayssm.engine.drafters.load_mtp_head`).
        sampling: ``None`` or greedy: argmax drafts. Otherwise drafts are sampled from
            the head's warped probabilities, which are kept per slot for the rejection
            rule (:meth:`draft_probs`).
        tree: ``None`` (a chain of drafts), or a :class:`~replayssm.engine.trees.StaticTree`:
            :meth:`propose` then returns the tree's nodes ``1..N-1`` (``k = N - 1``), each
            node's children the head's top tokens after it, best first (top-k
            expansion, deterministic whatever ``sampling``). The head runs once per
            depth below the leaves, on that depth's nodes, each seeing the committed
            pairs and its ancestors' tentative pairs (:func:`tree_attention`).
    """

    name = "mtp"
    needs_hidden = True
    #: Greedy chains on the fused kernels run each head pass as normed linears
    #: (:meth:`_greedy_pass`: each norm, activation and residual add inside a matmul's
    #: launch, the LM head's argmax too) where the head's modules allow; ``False`` keeps
    #: the modules' matmuls (the bits of the generic layers), for comparison.
    normed_linears = True
    #: Most rows a pass takes through the normed linears; a wider pass (the update of 64
    #: requests' windows) runs the modules' matmuls, which cuBLAS tiles better there (an
    #: H100, 2026-12-05: the 256-row update made a step at batch 64 3% slower).
    normed_linear_rows = 64
    #: Keys a part of the greedy passes' attention over the head's cache (its keys
    #: split at fixed positions, the parts merged in the launch:
    #: :func:`~replayssm.engine.attention.slot_attention`), in passes of at most
    #: :attr:`attention_key_split_rows` requests; ``0`` walks each row's keys in one
    #: program. A few rows over a long prompt are otherwise a few programs, each walking
    #: every key (an H100, 512-768 keys: the batch-1 step 7-9 µs shorter, batch 16's
    #: 3 µs). The split changes the head's outputs to rounding, which changes which
    #: drafts are proposed, never which are accepted.
    attention_key_split = 256
    #: Most requests a pass splits its attention's keys for: at batch 64 the unsplit
    #: grid already fills the SMs, and the merge made the step 3 µs longer.
    attention_key_split_rows = 16
    #: The normed linears' passes launch their kernels as a chain
    #: (:func:`~replayssm.ops.triton_common.chained_launches`: each kernel's start and its
    #: weights' load overlap the kernel before, on GPUs that allow it); ``False``: in
    #: stream order, for comparison. The numbers are the same either way. The chain's
    #: first kernel too overlaps the kernel before it (``ordered_start=False``): before
    #: its wait it reads weights only.
    chain_passes = True

    def __init__(self, engine, head, sampling=None, tree=None):
        self.sampling = _draft_sampling(sampling, tree)
        self.engine = engine
        self.head = head
        self.tree = tree
        # The pair's input norms and the token's embedding in one kernel (norms.rms_norm_pair)
        # where the norms are fused, both are offset norms and the embedding is a plain lookup.
        self._fused_pre_fc = (engine.fused_norms and engine.plain_embedding
                              and norm_kind(head.pre_fc_norm_embedding) == norm_kind(head.pre_fc_norm_hidden) == "offset"
                              and engine.embed.weight.dtype == engine.dtype)

    def bind(self, num_slots, num_draft, capacity, device):
        from .kv_cache import KVCache

        _check_tree_device(self.tree, device)
        self.k = num_draft
        self._device = device
        attn = self.head.layers[0].self_attn
        self.cache = KVCache(1, num_slots, attn.k_proj.out_features // attn.head_dim, attn.head_dim, capacity,
                             dtype=self.engine.dtype, device=device)
        self._last_hidden = None
        self.q = None
        if self.sampling is not None:
            self.q = torch.zeros((num_slots + 1, num_draft, self.engine.vocab_size), dtype=torch.float32, device=device)
        self._steps = torch.arange(max(num_draft - 1, 1), device=device)[:, None]  # [k - 1, 1]: draft j at j - 1
        # every head-cache position's rotary rows: each step gathers its rows (one kernel)
        # instead of evaluating the embedding (HybridEngine.rope_table)
        self._rotary = self.engine.rope_table(capacity, device)
        self._join_graphs: dict[int, _JoinGraph] = {}
        self._join_pool = None
        # a new callable per bind: the prompt passes captured with it hold this bind's cache
        self.prompt_head = functools.partial(DeviceMTPDrafter._prompt_pairs, self)
        mlp = self.head.layers[0].mlp
        if dense_silu_mlp(mlp):  # gate and up in one matmul (HybridEngine.static_mlp)
            fuse_linears((mlp.gate_proj, mlp.up_proj))
        fuse_linears((attn.q_proj, attn.k_proj, attn.v_proj))  # one matmul (adapter.attention_projections)
        self._greedy_weights = self._normed_linear_weights() if self.normed_linears else None
        self._first_draft = self._depths = None

    def _normed_linear_weights(self) -> dict | None:
        """The weights :meth:`_greedy_pass` multiplies, or ``None`` where that pass does not
        apply: sampled or tree drafts (they read the logits), unfused kernels, a norm
        other than an offset RMS norm, a MoE or non-SiLU MLP, a projection with a bias
        or apart from its fused partners (:func:`fuse_linears`), an LM head that is not a
        plain linear."""
        eng, head = self.engine, self.head
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        if self.sampling is not None or self.tree is not None or not self._fused_pre_fc \
                or eng.dtype not in NORMED_LINEAR_DTYPES:
            return None
        if any(norm_kind(m) != "offset" for m in (layer.input_layernorm, layer.post_attention_layernorm, head.norm)):
            return None
        if not dense_silu_mlp(mlp):
            return None
        plain = [head.fc, attn.o_proj, mlp.down_proj, eng.lm_head]
        if not all(isinstance(m, torch.nn.Linear) and m.bias is None and m.weight.is_contiguous()
                   and m.weight.dtype == eng.dtype for m in plain):
            return None
        qkv, gate_up = fused_weight((attn.q_proj, attn.k_proj, attn.v_proj)), fused_weight((mlp.gate_proj, mlp.up_proj))
        if qkv is None or gate_up is None:
            return None
        return dict(fc=head.fc.weight, qkv=qkv, o=attn.o_proj.weight, gate_up=gate_up, down=mlp.down_proj.weight,
                    lm_head=eng.lm_head.weight)

    def _greedy_pass(self, tokens: torch.Tensor, hidden: torch.Tensor, slot_idx: torch.Tensor | None,
                     positions: torch.Tensor, rope: torch.Tensor, pick: torch.Tensor | None = None):
        """The head on ``B x T`` pairs (:meth:`_layer`'s arguments), then the LM head and
        its argmax on one row a request (``pick [B]``: row ``pick[b]`` of request ``b``'s
        ``T``; ``None`` with ``T = 1``): ``(h [B, H], tokens [B])``, the head's normed
        outputs there and the greedy drafts after them.

        The same arithmetic as :meth:`_layer` and the LM head, to rounding (the matmuls
        are :func:`~replayssm.engine.normed_linear.normed_linear`'s, not cuBLAS's), in
        nine launches: ``fc`` with the embedding lookup and both input norms;
        ``q|gate|k|v`` with the input norm; the query and key norms, the rotary with
        the cache writes, the attention with its gate (as the static step, its keys split at
        a few rows: :attr:`attention_key_split`); ``o_proj``
        with the residual add; ``gate|up`` with the post-attention norm and SiLU's
        product; ``down`` with the residual add; the LM head with the final norm and
        each column block's argmax, the blocks merged by the last block to finish (the
        engine's :attr:`~replayssm.engine.adapter.HybridEngine.arrivals`; a second
        launch where they outnumber one merge's read, as a large vocabulary's do). They
        launch as a chain (:attr:`chain_passes`)."""
        with chained_launches(hidden.device, self.chain_passes, ordered_start=False):
            return self._greedy_launches(tokens, hidden, slot_idx, positions, rope, pick)

    def _greedy_launches(self, tokens, hidden, slot_idx, positions, rope, pick):
        """:meth:`_greedy_pass`'s launches."""
        from .adapter import split_projections, static_attention_forward

        eng, head, w = self.engine, self.head, self._greedy_weights
        layer = head.layers[0]
        attn = layer.self_attn
        b, t = positions.shape

        def norm(module):
            return module.weight, norm_eps(module)

        split = self.attention_key_split if b <= self.attention_key_split_rows else 0
        x = normed_linear(eng.embed.weight, w["fc"], norm=norm(head.pre_fc_norm_embedding), rows=tokens.reshape(-1),
                          pair=(hidden.to(eng.dtype), *norm(head.pre_fc_norm_hidden)))
        qkv = normed_linear(x, w["qkv"], norm=norm(layer.input_layernorm))
        o = static_attention_forward(attn, None, rope, self.cache, 0, slot_idx, positions, backend=eng.backend,
                                     norm=eng.static_norm, fused=True, projections=split_projections(attn, qkv),
                                     output_projection=False, key_split=split, arrivals=eng.arrivals)
        x = normed_linear(o, w["o"], output="residual", residual=x)
        y = normed_linear(x, w["gate_up"], norm=norm(layer.post_attention_layernorm), output="glu")
        x = normed_linear(y, w["down"], output="residual", residual=x)
        h = torch.empty((b, x.shape[1]), dtype=x.dtype, device=x.device)
        tok = normed_linear(x, w["lm_head"], norm=norm(head.norm), rows=pick, row_group=t if pick is not None else 0,
                            output="argmax", normed_out=h, arrivals=eng.arrivals)
        return h, tok

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor, slot_idx: torch.Tensor | None,
               positions: torch.Tensor, rope: torch.Tensor, tree=None) -> torch.Tensor:
        """The head on ``B x T`` pairs: ``tokens [B, T]``, ``hidden [B * T, H]``, cache
        positions ``[B, T]``, rotary rows ``rope [B, T or 1, 2, R]`` (:meth:`_rope_at`);
        returns the normed outputs ``[B * T, H]`` (graph-safe). ``tree``: as
        :func:`~replayssm.engine.adapter.static_attention_forward`'s.

        The arithmetic of :meth:`MTPHead.pair_input` and the layer's modules (the same
        values, bit for bit), in fewer kernels: the two input norms write the halves of
        ``fc``'s input (:meth:`_fc_input`), the attention is the engine's static step's
        (:func:`~replayssm.engine.adapter.static_attention_forward` on the head's cache),
        each residual add runs in its norm's kernel."""
        from .adapter import static_attention_forward

        eng, layer = self.engine, self.head.layers[0]
        x = self._fc_input(tokens, hidden)
        o = static_attention_forward(layer.self_attn, eng.static_norm(layer.input_layernorm, x), rope, self.cache, 0,
                                     slot_idx, positions, backend=eng.backend, norm=eng.static_norm, tree=tree,
                                     fused=eng.fused_norms)
        x, y = eng.static_add_norm(layer.post_attention_layernorm, x, o)
        return eng.static_add_norm(self.head.norm, x, eng.static_mlp(layer.mlp, y))[1]

    def _fc_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The head layer's input ``x [B * T, H]``: ``fc`` of the two normed halves of each
        pair, for ``tokens [B, T]`` and ``hidden [B * T, H]`` (where the norms are fused,
        the embedding lookup and both norms in one launch: the bits of the three)."""
        eng, head = self.engine, self.head
        n, hid = hidden.shape
        pair = torch.empty((n, 2 * hid), dtype=eng.dtype, device=hidden.device)
        ids = tokens.reshape(-1)
        if self._fused_pre_fc:
            rms_norm_pair(eng.embed.weight, head.pre_fc_norm_embedding.weight, norm_eps(head.pre_fc_norm_embedding),
                          pair[:, :hid], hidden.to(eng.dtype), head.pre_fc_norm_hidden.weight,
                          norm_eps(head.pre_fc_norm_hidden), pair[:, hid:], rows=ids)
        else:
            eng.static_norm(head.pre_fc_norm_embedding, eng.static_embed(ids), out=pair[:, :hid])
            eng.static_norm(head.pre_fc_norm_hidden, hidden.to(eng.dtype), out=pair[:, hid:])
        return head.fc(pair)

    def _attention_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor, rope: torch.Tensor):
        """The head layer up to its attention, for ``tokens [B, T]``, ``hidden [B * T,
        H]``, rotary rows ``rope [B, T or 1, 2, R]``: ``(qk, gate, v)``, queries and keys
        normed and rotated ``qk [B, T, heads + kv_heads, D]``
        (:func:`~replayssm.engine.adapter.rotated_qk`), the output gate ``[B * T, heads,
        D]`` and values ``[B * T, kv_heads, D]`` (the prompt pass's pairs, whose keys and
        values go to the cache without attending)."""
        from .adapter import attention_projections, rotated_qk

        eng, layer = self.engine, self.head.layers[0]
        attn = layer.self_attn
        xn = eng.static_norm(layer.input_layernorm, self._fc_input(tokens, hidden))
        q, gate, k, v = attention_projections(attn, xn)
        return rotated_qk(attn, q, k, rope, eng.static_norm, fused=eng.fused_norms), gate, v

    def _rope_at(self, positions: torch.Tensor) -> torch.Tensor:
        """``[*positions.shape, 2, R]`` rows of the rotary table at ``positions``."""
        return rope_at(self._rotary, positions)

    def _greedy(self, rows: int) -> bool:
        """Whether a pass of ``rows`` rows runs :meth:`_greedy_pass`."""
        return self._greedy_weights is not None and rows <= self.normed_linear_rows

    def _draft(self, slot_idx, h: torch.Tensor, next_pos: torch.Tensor, k: int | None = None,
               first: torch.Tensor | None = None, depths: tuple | None = None) -> torch.Tensor:
        """``k`` (default :attr:`k`) drafts from the head outputs ``h [B, H]`` of each
        request's last committed pair; later pairs go at ``next_pos [B]`` onwards.
        Sampled drafts keep their probabilities in :attr:`q`. ``first``: the first
        drafts ``[B]``, already taken with ``h`` (by :meth:`_greedy_pass`); ``depths``:
        the ``k - 1`` later depths' positions and rotary rows, already gathered
        (:func:`~replayssm.engine.step_inputs.draft_inputs`)."""
        k = self.k if k is None else k
        greedy = self._greedy(h.shape[0])
        tok, q = (first, None) if first is not None else self._choose(self.engine.lm_head(h))
        drafts, probs = [tok], [q]
        if k > 1:
            # every depth's positions and rotary rows at once: [k - 1, B] and [k - 1, B, 2, R]
            if depths is not None:
                pos, rope = depths
            else:
                pos = self._steps[: k - 1] + next_pos[None]
                rope = self._rope_at(pos)
        for j in range(1, k):
            if greedy:
                h, tok = self._greedy_pass(tok[:, None], h, slot_idx, pos[j - 1][:, None], rope[j - 1][:, None])
            else:
                h = self._layer(tok[:, None], h, slot_idx, pos[j - 1][:, None], rope[j - 1][:, None])
                tok, q = self._choose(self.engine.lm_head(h))
                probs.append(q)
            drafts.append(tok)
        if self.q is not None:
            self.q[slot_idx] = torch.stack(probs, 1)
        return torch.stack(drafts, 1)

    def _draft_tree(self, slot_idx, h: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
        """The tree's nodes ``1..N-1`` ``[B, N - 1]`` by top-k expansion from the head
        outputs ``h [B, H]`` of each request's last committed pair (at position
        ``next_pos - 1``, the window's entry 0): depth by depth, the best tokens after
        each node become its children, and below the leaves' depth the head runs on the
        new nodes (pair ``(head output of the parent, node token)`` at rotary position
        ``next_pos - 1 + depth``, cache position ``next_pos - 1 + node``)."""
        tree, b = self.tree, h.shape[0]
        start = next_pos - 1
        tokens = torch.zeros((b, tree.num_nodes), dtype=torch.int64, device=h.device)
        outs = h.new_zeros((b, tree.num_nodes, h.shape[-1]))
        outs[:, 0] = h
        for depth, (level, width, children, source) in enumerate(tree.expansion):
            if depth > 0:  # the head on this depth's nodes (the root's output came from observe)
                m = level.shape[0]
                rotary = start + depth  # [B]: every node of this depth rotates at one position
                hp = outs[:, tree.parents[level]].reshape(b * m, -1)
                out = self._layer(tokens[:, level], hp, slot_idx, rotary[:, None].expand(b, m),
                                  self._rope_at(rotary[:, None]),
                                  tree=(start, level, tree.level_ancestors[depth], tree.level_bits[depth]))
                outs[:, level] = out.view(b, m, -1)
            best = self.engine.lm_head(outs[:, level]).topk(width, dim=-1).indices  # [B, M, width]
            tokens[:, children] = best.reshape(b, -1)[:, source]
        return tokens[:, 1:]

    def _choose(self, logits: torch.Tensor):
        """A draft per row of the head's logits ``[B, V]`` (model dtype): greedy drafts
        take the argmax as it is (widening to fp32 is exact, so it changes no argmax,
        and would copy ``B x V`` logits per draft); sampled ones warp fp32 logits."""
        from .sampling import sample_categorical, warp_probs

        if self.sampling is None:
            return self.engine.static_argmax(logits), None
        q = warp_probs(logits.float(), self.sampling)
        return sample_categorical(q), q

    def draft_probs(self, slot_idx):
        return None if self.q is None else self.q[slot_idx]

    def observe(self, slot_idx, emitted, accepted, *, hidden=None, positions=None):
        if hidden is None or positions is None:
            raise ValueError("the MTP drafter needs the step's hidden states and positions")
        self._first_draft = self._depths = None
        b, t = emitted.shape
        if self._greedy(b * t):
            # the pass's inputs and the later depths' positions and rotary rows in one
            # launch, then the first drafts with the head's outputs
            with chained_launches(hidden.device, self.chain_passes, ordered_start=False):
                tokens, n, self._next_pos, rope, *self._depths = draft_inputs(emitted, accepted, positions,
                                                                              self._rotary, max(self.k - 1, 0))
            self._last_hidden, self._first_draft = self._greedy_pass(tokens, hidden, slot_idx, positions, rope,
                                                                     pick=n)
            return
        n = (accepted - 1).clamp(min=0)
        self._next_pos = positions[:, 0] + accepted
        out = self._layer(emitted.clamp(min=0), hidden, slot_idx, positions, self._rope_at(positions)).view(b, t, -1)
        self._last_hidden = out.gather(1, n[:, None, None].expand(b, 1, out.shape[-1]))[:, 0]

    def propose(self, slot_idx):
        if self.tree is None:
            return self._draft(slot_idx, self._last_hidden, self._next_pos, first=self._first_draft,
                               depths=self._depths)
        return self._draft_tree(slot_idx, self._last_hidden, self._next_pos)

    #: a tree's spine is the argmax at each depth along the argmaxes: the greedy chain,
    #: one head pass a depth on one row a request (the tree's expansion runs its passes
    #: on every node of a depth)
    drafts_spines = True

    def propose_spine(self, slot_idx):
        return self._draft(slot_idx, self._last_hidden, self._next_pos, k=self.tree.max_depth)

    def join(self, slots, prompts, firsts, requests, hidden=None, offsets=None):
        """Prompt pairs ``(h_t, x_{t+1})`` of joining requests into the head's cache
        (eagerly, variable lengths: :meth:`_prompt_kv`), then their first drafts
        (:meth:`_join_drafts`, from a captured graph where one is wide enough).

        A static prompt pass runs :attr:`prompt_head` instead, and its requests take
        :meth:`join_cached`."""
        from .kv_cache import WindowLayout

        if hidden is None or offsets is None:
            raise ValueError("the MTP drafter needs the prompts' hidden states")
        self.cache.reset_many(slots)  # one device write for all of them
        lengths = [len(p) for p in prompts]  # pairs (h_t, x_{t+1}): the prompt shifted by one, then the first token
        layout = WindowLayout(slots, [0] * len(slots), lengths, self.engine.device)
        ids = itertools.chain.from_iterable(itertools.chain(p[1:], (f,)) for p, f in zip(prompts, firsts))
        j, n = len(slots), sum(lengths)
        # one upload: the pairs' next tokens, then each request's first token, slot, length and last prompt row
        up = to_device(itertools.chain(ids, firsts, slots, lengths, (o - 1 for o in offsets[1:])), self.engine.device)
        self._prompt_kv(layout, up[:n], hidden)
        self.cache.advance(slots, lengths)
        first, idx, nxt, ends = up[n:].view(4, j)
        return self._run_join(idx, first, hidden[ends], nxt)

    def join_cached(self, slots: list[int], lengths: list[int], firsts: torch.Tensor,
                    last_hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`join` for requests whose whole prompts a static prompt pass held,
        having run :attr:`prompt_head`: the keys and values of every pair but each
        prompt's last are in the head's cache already, and the device lengths set.
        ``lengths`` the prompts' lengths, ``firsts [J]`` the first generated tokens and
        ``last_hidden [J, H]`` the target's hidden states at each prompt's last token
        (device tensors). Returns the first drafts ``[J, k]``."""
        self.cache.set_host_lengths(slots, lengths)
        j = len(slots)
        idx, nxt = to_device(itertools.chain(slots, lengths), self.engine.device).view(2, j)
        return self._run_join(idx, firsts, last_hidden, nxt)

    def _run_join(self, idx, first, last_hidden, nxt):
        """:meth:`_join_drafts` of ``J`` joining rows: the smallest captured graph of at
        least ``J`` rows replays it, or, without one, it runs eagerly."""
        rows = min((b for b in self._join_graphs if b >= idx.shape[0]), default=None)
        if rows is None:
            return self._join_drafts(idx, first, last_hidden, nxt)
        return self._join_graphs[rows].run(idx, first, last_hidden, nxt)

    def _prompt_pairs(self, layout, ids: torch.Tensor, hidden: torch.Tensor, kv_rows: torch.Tensor,
                      kv_lengths: torch.Tensor) -> None:
        """:attr:`prompt_head`: inside a static prompt pass (graph-safe), the head's keys
        and values of the pass's tokens (:meth:`_prompt_kv`) and its cache's device
        lengths. The pair at a token takes the next packed token, its prompt's next one,
        except at each prompt's last token, whose pair takes the first generated token:
        that entry is written again by :meth:`join_cached`, and padding tokens write
        the sink's."""
        self._prompt_kv(layout, torch.roll(ids, -1), hidden)
        self.cache.device_lengths[kv_rows] = kv_lengths

    def _prompt_kv(self, layout, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """The head's keys and values of prompt pairs ``(hidden [N, H], ids [N])`` (the
        target's hidden states, each with the next token), packed as ``layout`` (fresh
        requests), into its cache at each token's slot and position: the step's head
        pass (:meth:`_layer`) up to its attention. Nothing reads these pairs' outputs
        (the drafts start from each prompt's last pair, :meth:`_join_drafts`), so the
        attention, the MLP and the norms after it do not run."""
        from .kv_cache import write_window_kv

        pos = layout.positions[None]
        qk, gate, v = self._attention_inputs(ids[None], hidden, self._rope_at(pos))
        write_window_kv(self.cache, 0, layout, qk[0, :, gate.shape[1]:], v)

    def _join_drafts(self, slot_idx, first, hidden, next_pos):
        """Joining rows' first drafts (graph-safe): the head on each prompt's last pair
        ``(hidden [J, H], first [J])`` at position ``next_pos - 1`` (the step's head
        pass, attending to the prompt's pairs in the cache), then its drafts."""
        pos = (next_pos - 1)[:, None]
        if self._greedy(first.shape[0]):
            h, tok = self._greedy_pass(first[:, None], hidden, slot_idx, pos, self._rope_at(pos))
            return self._draft(slot_idx, h, next_pos, first=tok)
        h = self._layer(first[:, None], hidden, slot_idx, pos, self._rope_at(pos))
        return (self._draft if self.tree is None else self._draft_tree)(slot_idx, h, next_pos)

    def capture_join(self, buckets):
        """The first drafts of a join (:meth:`_join_drafts`: the head on each request's
        last prompt pair, then :meth:`_draft`) in a CUDA graph per bucket: eagerly they
        are three head passes and three LM heads, whose launches would cost a joining
        request milliseconds of time to first token. A join of ``n`` requests replays
        the smallest graph of at least ``n`` rows, padding rows drafting into the
        cache's sink slot. Off CUDA, or for a
        join wider than every bucket, the drafts run eagerly.

        The join graphs share one memory pool of their own, not the steps': each copies
        its drafts out before another replays, and no step's buffers can lie in memory a
        join graph overwrites."""
        if self._device.type != "cuda":
            return
        if self._join_pool is None:
            self._join_pool = torch.cuda.graph_pool_handle()
        for rows in sorted(set(buckets)):
            if rows not in self._join_graphs:
                self._join_graphs[rows] = _JoinGraph(self, rows, self._join_pool)
