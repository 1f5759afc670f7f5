"""A draft model drafting inside the static step: chains, and trees of its top-k tokens.

:class:`DeviceModelDrafter` runs a second :class:`~replayssm.engine.adapter.HybridEngine`
(a small model sharing the target's tokenizer) through static-shape forwards, so that a
:class:`~replayssm.engine.generator.StepGenerator` step, draft model included, is one
CUDA graph. Per target slot the draft engine holds one slot whose committed tokens are
the target's committed tokens but the last one, ``x0`` (the next window's first token):

* ``observe``: the step's emitted tokens verified on the draft engine as the window
  ``[x0, emitted...]`` and committed by the step's accepted count, exactly as the
  target committed them; the last emitted token becomes the new ``x0``;
* ``propose`` (chain of ``k``): ``k`` verifies of the growing windows ``[x0]``,
  ``[x0, d1]``, ... from the committed state, nothing committed; draft ``j`` is the
  draft model's choice after window ``j``;
* ``propose`` (tree): one tree verify per depth on the tree's first levels (node ``i``
  at cache position ``start + i``), each level's children the draft model's best tokens
  after it, best first, as the MTP head's top-k expansion does.

The repeated verifies need a strategy whose verify writes only scratch (``snapshot``,
``fold``): circular's folds flush rows into their checkpoints, which a second verify
would fold again.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops.trees import DraftTrees
from .device_drafters import DeviceDrafter, _check_tree_device, _draft_sampling
from .drafters import _fit_vocab

#: draft-engine strategies whose verify writes only scratch (see the module notes)
SCRATCH_STRATEGIES = ("snapshot", "fold")


class DeviceModelDrafter(DeviceDrafter):
    """A draft model's drafts inside the static step (see the module notes).

    Args:
        engine: the draft model's engine: as many slots as the target's, strategy
            ``snapshot`` or ``fold``, a window of at least the verifies it runs (a chain
            of ``k``: ``k + 1``; a tree: its depth + 1 and its nodes above the leaves'
            depth), and a ``max_len`` of the target's plus its window.
        vocab_size: the target's vocabulary (draft logits are cut or padded to it).
        sampling: ``None`` or greedy: argmax drafts; otherwise chain drafts are sampled
            from the draft model's warped probabilities, kept per slot for the rejection
            rule (:meth:`draft_probs`). Tree drafts are deterministic (top-k).
        tree: ``None`` (chains), or a :class:`~replayssm.engine.trees.StaticTree` whose
            levels are contiguous in node order (as ``from_branching`` builds them).
    """

    name = "model"

    def __init__(self, engine, vocab_size: int, sampling=None, tree=None):
        from .adapter import HybridEngine

        if not isinstance(engine, HybridEngine):
            raise TypeError(f"engine must be a HybridEngine, got {type(engine).__name__}")
        if engine.strategy.name not in SCRATCH_STRATEGIES:
            raise ValueError(f"the draft engine's strategy must be one of {SCRATCH_STRATEGIES} (its verify is repeated "
                             f"before a commit), got {engine.strategy.name!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.sampling = _draft_sampling(sampling, tree)
        if tree is not None:
            first = 0
            for d, level in enumerate(tree.levels):
                if level.tolist() != list(range(first, first + level.shape[0])):
                    raise ValueError(f"the tree's depth-{d} nodes must follow the shallower ones in node order")
                first += level.shape[0]
        self.engine = engine
        self.vocab_size = vocab_size
        self.tree = tree

    # ------------------------------------------------------------------ set-up
    def bind(self, num_slots, num_draft, capacity, device):
        from .trees import StaticTree

        _check_tree_device(self.tree, device)
        eng = self.engine
        if eng.pool.num_slots != num_slots:
            raise ValueError(f"the draft engine needs the target's {num_slots} slots, has {eng.pool.num_slots}")
        if eng.device != torch.device(device):
            raise ValueError(f"the draft engine is on {eng.device}, the target on {device}")
        self.k = num_draft
        self._device = device
        # the trees of the first levels (depth < D), each a verify of the expansion
        # and their node counts, on the host: a decode step reads no device value
        self._prefix, self._prefix_nodes = [], []
        if self.tree is not None:
            parents = self.tree.host_parents
            for d in range(self.tree.max_depth):
                n = sum(1 for x in self.tree.host_depth if x <= d)
                self._prefix_nodes.append(n)
                self._prefix.append(StaticTree(DraftTrees.from_parents([parents[:n]]), device) if n > 1 else None)
            needed = max(self.tree.max_depth + 1, max(self._prefix_nodes))
        else:
            needed = num_draft + 1
        if eng.window < needed:
            raise ValueError(f"the draft engine's window {eng.window} is shorter than the {needed} tokens its "
                             "verifies take")
        if eng.max_len < capacity:  # a finished request's last proposal reaches past its budget
            raise ValueError(f"the draft engine's max_len {eng.max_len} holds fewer than the {capacity} tokens a "
                             "request's drafts may reach (the target's max_len + window)")
        self.last = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # x0 per target slot
        # draft slot per target slot (the target's sink row: the draft engine's sink)
        self._map = torch.full((num_slots + 1,), eng.kv.sink, dtype=torch.int64, device=device)
        self._slots: dict[int, int] = {}  # target slot -> draft slot (host)
        self._batches: dict[tuple, object] = {}  # (rows, window, tag) -> the draft engine's static batch
        self._rows: dict[tuple, tuple] = {}  # (rows, tag) -> the rows' draft slots and generations
        self._trees: dict[tuple, object] = {}  # (prefix nodes, rows) -> its DraftTrees (one object a shape)
        self._steps = torch.arange(max(eng.window, 1), device=device)
        self.q = None
        if self.sampling is not None:
            self.q = torch.zeros((num_slots + 1, num_draft, self.vocab_size), dtype=torch.float32, device=device)

    def start(self, slot, tokens, request):
        """A request takes target ``slot``: its prompt and first token ``tokens`` into a
        fresh draft slot (the prompt prefilled eagerly; the first token is ``x0``)."""
        self._admit([slot], [list(tokens)])

    def join(self, slots, prompts, firsts, requests, hidden=None, offsets=None):
        """Joining requests' prompts into fresh draft slots (one prompt pass for all of
        them), then their first drafts."""
        self._admit(list(slots), [list(p) + [f] for p, f in zip(prompts, firsts)])
        self.set_rows(slots, tag="join")
        return self._propose(torch.tensor(slots, dtype=torch.long, device=self._device), tag="join")

    def _admit(self, slots: list[int], tokens: list[list[int]]) -> None:
        eng = self.engine
        old = [self._slots.pop(s) for s in slots if s in self._slots]
        if old:
            eng.free_many(old)
        drafts = eng.alloc_many(len(slots))
        self._slots.update(zip(slots, drafts))
        fill = [(d, t[:-1]) for d, t in zip(drafts, tokens) if len(t) > 1]
        if fill:
            eng.extend([d for d, _ in fill], [t for _, t in fill], prompt=True)
        idx = torch.tensor(slots, dtype=torch.long, device=self._device)
        self._map[idx] = torch.tensor(drafts, dtype=torch.long, device=self._device)
        self.last[idx] = torch.tensor([t[-1] for t in tokens], dtype=torch.long, device=self._device)

    def set_rows(self, slots: Sequence[int], *, tag: str = "step") -> None:
        """The target rows' slots (``-1`` padding) of the next steps of ``len(slots)``
        rows: their draft slots, with the draft pool's generations, into the draft
        engine's batches of that many rows (host and device, as a step's own batch)."""
        pool = self.engine.pool
        draft = tuple(self._slots.get(int(s), -1) if int(s) >= 0 else -1 for s in slots)
        rows = (draft, tuple(pool.generation(s) if s >= 0 else 0 for s in draft))
        self._rows[(len(draft), tag)] = rows
        for (n, _, t), batch in self._batches.items():
            if n == len(draft) and t == tag:
                _set_batch(batch, rows)

    def _batch(self, rows: int, window: int, tag: str):
        key = (rows, window, tag)
        if key not in self._batches:
            batch = self._batches[key] = self.engine.static_batch(rows, window)
            if (rows, tag) in self._rows:
                _set_batch(batch, self._rows[(rows, tag)])
        return self._batches[key]

    # ------------------------------------------------------------------ steps
    def _verify(self, ids: torch.Tensor, didx: torch.Tensor, starts: torch.Tensor, tag: str, tree=None,
                commit: torch.Tensor | None = None):
        """Logits ``[B, T, V]`` of the draft engine's verify of ``ids [B, T]`` (a chain
        from each row's committed length, or ``tree``'s nodes), then its commit of
        ``commit [B]`` tokens a row, or with ``None`` its abort (nothing committed; for
        the scratch strategies no device work)."""
        eng = self.engine
        b, t = ids.shape
        batch = self._batch(b, t, tag)
        if tree is None:
            positions = starts[:, None] + self._steps[:t]
            logits, _ = eng.forward_static(ids, positions, didx, batch, verify=True)
        else:
            key = (tree.num_nodes, b)
            if key not in self._trees:
                self._trees[key] = tree.draft_trees(b)
            logits, _ = eng.forward_static(ids, starts[:, None] + tree.depth[None], didx, batch, verify=True,
                                           tree=(tree, self._trees[key], starts))
        if commit is None:
            eng.strategy.abort(batch)
        else:
            eng.strategy.commit(batch, commit.to(torch.int32))
        # widened as the drafter's eager verify gives them (its tree's top-k ties alike)
        return _fit_vocab(logits.float(), self.vocab_size).view(b, t, -1)

    def observe(self, slot_idx, emitted, accepted, *, hidden=None, positions=None):
        kv = self.engine.kv
        t = emitted.shape[1]
        didx = self._map[slot_idx]
        starts = kv.device_lengths[didx]
        ids = torch.cat([self.last[slot_idx][:, None], emitted[:, : t - 1].clamp(min=0)], 1)  # [x0, emitted...]
        self._verify(ids, didx, starts, "step", commit=accepted)
        kv.device_lengths[didx] = starts + accepted
        kv.device_lengths[kv.sink:].zero_()
        self.last[slot_idx] = emitted.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]

    def propose(self, slot_idx):
        return self._propose(slot_idx, "step")

    def _propose(self, slot_idx, tag: str):
        didx = self._map[slot_idx]
        starts = self.engine.kv.device_lengths[didx]
        if self.tree is None:
            return self._chain(slot_idx, didx, starts, tag)
        return self._top_k_tree(slot_idx, didx, starts, tag)

    def _chain(self, slot_idx, didx, starts, tag):
        from .sampling import sample_categorical, warp_probs

        ids = self.last[slot_idx][:, None]
        probs = []
        for j in range(1, self.k + 1):
            logits = self._verify(ids, didx, starts, tag)[:, -1]
            if self.sampling is None:
                tok = self.engine.static_argmax(logits)
            else:
                q = warp_probs(logits.float(), self.sampling)
                tok = sample_categorical(q)
                probs.append(q)
            ids = torch.cat([ids, tok[:, None]], 1)
        if self.q is not None:
            self.q[slot_idx] = torch.stack(probs, 1)
        return ids[:, 1:]

    def _top_k_tree(self, slot_idx, didx, starts, tag):
        tree, b = self.tree, slot_idx.shape[0]
        tokens = torch.zeros((b, tree.num_nodes), dtype=torch.int64, device=slot_idx.device)
        tokens[:, 0] = self.last[slot_idx]
        for depth, (level, width, children, source) in enumerate(tree.expansion):
            prefix, n = self._prefix[depth], self._prefix_nodes[depth]
            if prefix is None:  # the root alone: a chain of one token
                logits = self._verify(tokens[:, :1], didx, starts, tag)
            else:
                logits = self._verify(tokens[:, :n], didx, starts, tag, tree=prefix)
            best = logits[:, level].topk(width, dim=-1).indices  # [B, M, width]
            tokens[:, children] = best.reshape(b, -1)[:, source]
        return tokens[:, 1:]

    def draft_probs(self, slot_idx):
        return None if self.q is None else self.q[slot_idx]


def _set_batch(batch, rows: tuple) -> None:
    slots, generations = rows
    batch.generations = generations
    if slots != batch.host_slots:
        batch.set_slots(list(slots))
