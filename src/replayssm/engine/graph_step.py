"""A whole decode step at one static shape, captured once in a CUDA graph.

A :class:`StaticStep` covers ``rows`` requests (a batch bucket; padding rows have slot
-1) with windows of ``T`` tokens: ``T = 1`` for plain decoding, ``T = k + 1`` for
speculative decoding with ``k`` drafts. Its body does, on the device and without the
host:

1. gather each row's window from the per-slot window buffer and its committed length
   from the KV cache's device lengths;
2. the model forward (:meth:`HybridEngine.forward_static`: embeddings, every layer with
   GDN through the pool's strategy, attention over the slot cache, MLP or MoE, final
   norm, LM head);
3. acceptance (greedy, or rejection sampling of deterministic drafts; a benchmark
   drafter may impose the accepted counts instead, :meth:`DeviceDrafter.forced_accepts`),
   and what it emits: the accepted counts and emitted tokens into one output buffer
   ``[rows, 1 + T]``, the KV lengths advanced by the counts (greedy acceptance
   included, one kernel where the engine's kernels are fused:
   :func:`~replayssm.engine.emit.emit_step`);
4. the strategy's commit (GDN state, conv state) with the accepted counts (plain
   decoding advanced the state in step 2, or, through the ring when the engine's
   ``ring_decoding``, commits its one token here);
5. the drafter's update and its proposal of the next window, written back per slot.

With a draft tree (``tree``, a :class:`~replayssm.engine.trees.StaticTree` that is not
a chain) the window is the tree's ``N`` nodes: step 2 verifies the tree (GDN layers
through :meth:`Strategy.verify_tree`, attention under the ancestor mask, rotary
positions ``start + depth``), step 3 is the tree acceptance (greedy:
:func:`accept_greedy_tree`; sampling: :func:`accept_sampled_tree` with the drafts'
top-k tokens as deterministic candidates), step 4 :meth:`Strategy.commit_tree` of the
accepted node and the KV compaction of its path
(:func:`~replayssm.engine.kv_cache.compact_kv_path`), and the drafter observes the path
(``depth + 1`` tokens) and proposes the next tree. A spine step (``spine``) takes a
tree drafter's proposals as a chain: its window is the tree's spine (the root, then the
best draft at each depth), verified and committed as any chain. The drafter's next
proposal is a whole tree again, or, where it can draft a spine alone
(:attr:`DeviceDrafter.drafts_spines`: the MTP head), only the next spine, the tree's
other nodes keeping older tokens (a tree step verifies them as any candidates: a node is
accepted only where the target agrees). So a request may take tree and spine steps in
any order (the driver's choice per batch bucket).

Per-slot buffers (windows, KV lengths, drafter history) are indexed by slot, not by
row, so requests may finish or join between steps (the driver rewrites the rows' slots)
and another bucket's graph may take the next step, with no new capture. The driver's
one host synchronisation per step is the read of the output buffer; a replay rewrites
that buffer, so a driver that launches the next step before it is done with one step's
outputs reads them into a copy first.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable

import numpy as np
import torch

from ..ops.guards import copy_to_device, host_ints
from ..ops.triton_common import chained_launches
from .adapter import HybridEngine
from .device_drafters import DeviceDrafter
from .kv_cache import compact_kv_path
from .emit import emit_step
from .sampling import SamplingParams, accept_greedy_tree, accept_sampled_static, accept_sampled_tree, warp_probs


class StaticStep:
    """One step shape ``(rows, T)`` of an engine; see the module docstring.

    Args:
        engine: the target engine (``T = 1`` uses plain decoding through the strategy's
            ``prefill``, or its ``decode`` and a commit when ``engine.ring_decoding`` at
            construction; ``T > 1`` verifies and commits).
        windows: ``[slots + 1, T]`` int64, the next window of every slot (its last
            emitted token, then the drafts; the last row is the padding sink), shared by
            the engine's step shapes.
        rows: the batch bucket.
        drafter: a bound :class:`DeviceDrafter` for ``T > 1``. For ``T = 1``: ``None``,
            or the drafter of the engine's speculative steps, which then observes each
            plain step's token (its history, cache and counters stay current, so a
            request may take speculative steps after plain ones) but proposes nothing:
            the first speculative step after plain ones verifies the drafts proposed
            before them, which are probably rejected.
        sampling: greedy (default) or warped sampling with rejection of the drafts.
        graph: capture a CUDA graph (CUDA only); else every :meth:`run` runs the body
            eagerly (the CPU path, and the reference a graph is tested against).
        pool: a CUDA graph memory pool shared by the engine's step graphs.
        tree: a :class:`~replayssm.engine.trees.StaticTree` of ``T`` nodes (not a chain:
            a chain is the plain window) whose nodes the drafter proposes; ``None``.
        spine: a chain step for a drafter that proposes trees (``windows`` holds its
            trees' ``N`` nodes): the step verifies the tree's spine
            (:attr:`~replayssm.engine.trees.StaticTree.spine`, ``S`` columns: the root,
            then the best draft at each depth) as its window of ``S`` tokens, and stores
            the drafter's next whole tree in ``windows``, so that tree steps and spine
            steps of one request can follow each other. ``False`` (default): the window
            is every column.
    """

    def __init__(self, engine: HybridEngine, windows: torch.Tensor, rows: int, *, drafter: DeviceDrafter | None,
                 sampling: SamplingParams = SamplingParams(), graph: bool = False, pool=None, tree=None,
                 spine: bool = False):
        if not isinstance(spine, bool):
            raise TypeError(f"spine must be a bool, got {type(spine).__name__}")
        if spine:
            _check_spine(windows, drafter, tree)
        t = windows.shape[1] if not spine else drafter.tree.spine.shape[0]
        if t > 1 and drafter is None:
            raise ValueError(f"a window of {t} tokens needs a drafter")
        if t > engine.window:
            raise ValueError(f"window {t} exceeds the engine's window {engine.window}")
        if drafter is not None and t > 1:
            drafter.check_sampling(sampling)
        if tree is not None:
            if tree.is_chain or tree.num_nodes != t:
                raise ValueError(f"tree must be a {t}-node tree that is not a chain (a chain is the plain window)")
            if drafter.forces_acceptance:
                raise ValueError(f"the {drafter.name!r} drafter sets accepted counts of chains; trees need a drafter "
                                 "whose tokens the target verifies")
        self.tree = tree
        self.trees = None if tree is None else tree.draft_trees(rows)  # one object for every layer of every step
        self.spine = drafter.tree.spine.to(engine.device) if spine else None
        # the spine's drafts among the tree's (for their draft probabilities, if sampled)
        self._spine_drafts = self.spine[1:] - 1 if spine else None
        if graph and engine.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA engine")
        self.engine, self.windows, self.drafter, self.sampling = engine, windows, drafter, sampling
        self.rows, self.window = rows, t
        #: plain steps through the strategy's ring (fixed here: a captured graph keeps its path)
        self.ring = t == 1 and engine.ring_decoding
        dev = engine.device
        self.batch = engine.static_batch(rows, t)
        self.slot_idx = torch.full((rows,), engine.kv.sink, dtype=torch.int64, device=dev)
        self.out = torch.zeros((rows, 1 + t), dtype=torch.int64, device=dev)
        self._steps = torch.arange(t, device=dev)
        self.graph = None
        if graph:
            self._capture(pool)

    def set_rows(self, slots: list[int], generations: list[int] | None = None) -> None:
        """The pool slot of every row (``-1`` for padding); copied to the device only
        when it changed since the last step.

        ``generations``: per row, the pool's allocation generation of the slot when its
        request took it (``0`` for padding), which a driver that keeps them passes so
        that a step on a slot that changed hands since is refused; default: the pool's
        current ones (one look-up per row). The batch's host view (slots and
        generations) follows, so the pool's host-side step checks see the rows the
        device sees. Each list is converted once."""
        host = host_ints(slots)  # the one conversion of the slots: they go on as this array
        if host.size != self.rows:
            raise ValueError(f"need {self.rows} row slots, got {host.size}")
        if generations is None:
            pool = self.engine.pool
            generations = [pool.generation(s) if s >= 0 else 0 for s in host.tolist()]
        generations = tuple(map(int, generations))
        if len(generations) != self.rows:
            raise ValueError(f"need {self.rows} row generations, got {len(generations)}")
        rows = host.tolist()
        if self.drafter is not None:  # a drafter's own static batches (a draft model's) follow the rows
            self.drafter.set_rows(rows)
        # a slot freed and taken by a joining request keeps its row: a new generation
        self.batch.generations = generations
        if tuple(rows) == self.batch.host_slots:
            return
        self.batch.set_slots(host)
        copy_to_device(self.slot_idx, np.where(host < 0, self.engine.kv.sink, host))

    def run(self) -> torch.Tensor:
        """Take one step; returns the output buffer ``[rows, 1 + T]`` (column 0: tokens
        emitted per row, then the emitted tokens, ``-1`` past them), on the device."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        return self.out

    # ------------------------------------------------------------------ body
    def _body(self) -> None:
        if self.tree is not None:
            return self._tree_body()
        eng, t = self.engine, self.window
        kv_len = eng.kv.device_lengths
        embedded = None
        if self.spine is None:  # the windows, lengths, positions, embedding and rotary rows (one kernel where fused)
            ids, starts, positions, embedded = eng.static_step_inputs(self.windows, self.slot_idx, self._steps)
            rows = ids
        else:
            rows = self.windows[self.slot_idx]  # a tree's [B, N]
            ids = rows[:, self.spine]
            starts = kv_len[self.slot_idx]
            positions = starts[:, None] + self._steps
        verify = t > 1
        # the probabilities this window's drafts were sampled from (None: deterministic)
        q = self.drafter.draft_probs(self.slot_idx) if verify and not self.sampling.greedy else None
        if q is not None and self.spine is not None:
            q = q[:, self._spine_drafts]
        logits, hidden = eng.forward_static(ids, positions, self.slot_idx, self.batch, verify=verify, ring=self.ring,
                                            embedded=embedded)
        logits = logits.view(self.rows, t, -1)
        forced = self.drafter.forced_accepts(self.slot_idx) if verify else None
        if forced is not None:  # a benchmark drafter sets the count; the target gives the next token
            choice = dict(n=forced, nxt=eng.static_argmax(logits).gather(1, forced[:, None])[:, 0])
        elif self.sampling.greedy:
            choice = dict(argmax=eng.static_argmax(logits))
        else:
            n, nxt = accept_sampled_static(logits, ids, self.sampling, q=q)
            choice = dict(n=n, nxt=nxt)
        # the accepted counts, emitted tokens, output buffer and KV lengths (padding rows
        # start at position 0: no host value in a graph), in one kernel where fused
        # (and a chain's next token, at the start of its slot's next window)
        chain = self.spine is None
        accepted, nxt, emitted = emit_step(ids, starts, self.slot_idx, kv_len, eng.kv.sink, self.out,
                                           next_windows=self.windows if chain else None,
                                           backend="triton" if eng.fused_norms else "reference", **choice)
        with chained_launches(eng.device, eng.chain_state_kernels):  # its first kernel after emit's end
            if verify:
                eng.strategy.commit(self.batch, accepted)  # int64, a column of the output: the guard reads it as it is
            elif self.ring:
                eng.strategy.commit(self.batch)  # the one token of every row
        if self.drafter is not None:
            self.drafter.observe(self.slot_idx, emitted, accepted, hidden=hidden, positions=positions)
        if chain:  # the drafts after it (a plain step proposes nothing: its window is the token)
            if verify:
                self.windows[self.slot_idx, 1:] = self.drafter.propose(self.slot_idx)
            return
        if self.drafter.drafts_spines:  # the next spine; the other nodes keep theirs
            nxt_window = rows
            nxt_window[:, self.spine] = torch.cat([nxt[:, None], self.drafter.propose_spine(self.slot_idx)], 1)
        else:
            nxt_window = torch.cat([nxt[:, None], self.drafter.propose(self.slot_idx)], 1)
        self.windows[self.slot_idx] = nxt_window

    def _tree_body(self) -> None:
        """:meth:`_body` for a draft tree (see the module docstring)."""
        eng, tree = self.engine, self.tree
        kv_len = eng.kv.device_lengths
        # [B, N]: the root, then the drafted nodes, each at its depth past the row's length
        ids, starts, positions, embedded = eng.static_step_inputs(self.windows, self.slot_idx, tree.depth)
        logits, hidden = eng.forward_static(ids, positions, self.slot_idx, self.batch, verify=True,
                                            tree=(tree, self.trees, starts), embedded=embedded)
        logits = logits.view(self.rows, tree.num_nodes, -1)
        if self.sampling.greedy:
            node, nxt = accept_greedy_tree(eng.static_argmax(logits), ids, tree)
        else:
            node, nxt = accept_sampled_tree(warp_probs(logits, self.sampling), ids, tree)
        accepted = tree.depth[node] + 1
        eng.strategy.commit_tree(self.batch, self.trees, node)
        path = tree.path[node]  # [B, D + 1]
        compact_kv_path(eng.kv, self.slot_idx, starts, path)
        kv_len[self.slot_idx] = starts + accepted
        kv_len[eng.kv.sink:].zero_()
        span = torch.arange(tree.max_depth + 1, device=ids.device)
        drafts = tree.path_tokens(ids, node)[:, 1:]
        emitted = torch.where(span[None] < accepted[:, None] - 1, torch.cat([drafts, drafts[:, :1]], 1),
                              torch.where(span[None] == accepted[:, None] - 1, nxt[:, None], -1))
        h = hidden.view(self.rows, tree.num_nodes, -1)
        h = h.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, h.shape[-1])).reshape(-1, h.shape[-1])
        self.drafter.observe(self.slot_idx, emitted, accepted, hidden=h, positions=starts[:, None] + span)
        self.windows[self.slot_idx] = torch.cat([nxt[:, None], self.drafter.propose(self.slot_idx)], 1)
        self.out.fill_(-1)
        self.out[:, 0] = accepted
        self.out[:, 1 : 2 + tree.max_depth] = emitted

    def _capture(self, pool) -> None:
        # every row is padding while it warms up, so no request's state moves
        self.graph = capture_graph(self._body, self.engine.device, pool=pool)


def _check_spine(windows: torch.Tensor, drafter, tree) -> None:
    """A spine step's arguments (see :class:`StaticStep`): a drafter that proposes trees of
    ``windows``' width, and no tree for the step itself."""
    if tree is not None:
        raise ValueError("a step verifies a tree or its spine, not both")
    own = getattr(drafter, "tree", None)
    if own is None or own.is_chain:
        raise ValueError("spine needs a drafter that proposes trees (built with a tree that is not a chain)")
    if own.num_nodes != windows.shape[1]:
        raise ValueError(f"windows must hold the drafter's {own.num_nodes}-node trees, got {windows.shape[1]} columns")


def capture_graph(body: Callable[[], object], device=None, *, pool=None, warmup_steps: int = 2) -> torch.cuda.CUDAGraph:
    """Capture one call of ``body`` in a CUDA graph (in the memory ``pool``, if given).

    ``body`` first runs ``warmup_steps`` times eagerly on a side stream (Triton compiles
    and autotunes there, cuBLAS picks its kernels, PyTorch's allocator settles), as
    PyTorch's graph notes ask. Those calls really execute: a caller whose body moves
    state runs it on padding rows until the capture.
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"warmup_steps must be a positive int, got {warmup_steps!r}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), _no_garbage_collection():  # torch collects garbage on entry
        body()
    torch.cuda.synchronize(device)
    return graph


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic garbage collector off for the block. During a capture a collection
    may destroy an unreachable graph of an earlier step (a CUDA graph reset), which CUDA
    refuses while a stream captures ("operation not permitted when stream is
    capturing"), and the capture fails."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
