"""``circular``: the ReplaySSM ring with a closed-loop exact fold.

Per request a frozen checkpoint plus a ring of ``L`` records and three cursors
(``write_pos``, ``cache_base``, ``is_flush``; see :mod:`replayssm.ops.cursors`).
Verify computes the window's outputs in closed form from checkpoint + committed history
+ window (DESIGN.md section 2) and writes the window's records after the history.
Commit only moves cursors. A row flagged ``is_flush`` folds its history into the
checkpoint at its next verify by replaying the raw records through the exact
recurrence, so the committed state equals the recurrence's bit for bit; the outputs
come from the closed form and agree with the recurrence to rounding.

Small batches (the shape table's ``circular.replay_max_batch``, by the step's row
count): verify runs as one launch that replays each row's history and then its window
through the exact recurrence (a flush row's fold included, the same bits), and commit
flags every row for a flush, so the next history is one step's accepted tokens. Draft
trees do the same while their requests times leaf paths are few
(``circular.tree_replay_max_paths``): the flush rows' fold, then every leaf's root path
replayed side by side. The cursors, records and committed states follow the same rules
either way.

Open steps. A flush row's verify folds its history into layer ``l``'s checkpoint at
layer ``l``'s verify, while the cursors still count that history until commit. The
logical committed state of a layer is therefore

    checkpoint + history          (layer not yet verified this step, or row not flushing)
    checkpoint                    (layer verified this step and the row is a flush row)

and :meth:`CircularStrategy.committed_state` reads it that way, so it is right at any
time. This keeps verify as it is (one fold launch per layer, cursors untouched, nothing
to undo in the fast path); the price is paid only by :meth:`~Strategy.abort`, which
finishes the flush for the layers the step did not reach (the same exact fold) and then
moves the flush rows' cursors past their folded history (``cache_base += write_pos``,
``write_pos = 0``, ``is_flush = 0``). The committed state is unchanged by that: it is
the same replay of the same records, only done early.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import _checks, guards
from ..ops.chunked import MAX_WINDOW_TRITON, gdn_chunked_window, gdn_tree_verify, replays_tree, replays_window
from ..ops.cursors import advance_cursors
from ..ops.fold import gdn_fold
from ..ops.ring_decode import gdn_ring_decode
from ..ops.tree_ops import compact_path
from ..ops.trees import DeviceTrees
from ..state.layout import BufferSpec, StepProtocolError
from .base import Strategy
from .fold import RecordBuffers, gate_dtype, record_specs


@dataclass(frozen=True)
class CircularBuffers(RecordBuffers):
    """The raw-record ring of ``L`` entries plus ``ring_u [layers, slots, L, HV, V]``
    (the records' corrected deltas, for the closed form), the per-request cursors
    ``write_pos``, ``cache_base``, ``is_flush`` and ``first_cycle`` (``[slots]`` int32;
    the last staggers the requests' first flushes, :mod:`~replayssm.ops.cursors`)."""

    ring_u: torch.Tensor
    write_pos: torch.Tensor
    cache_base: torch.Tensor
    is_flush: torch.Tensor
    first_cycle: torch.Tensor


class CircularStrategy(Strategy):
    """The ReplaySSM ring: a frozen checkpoint plus a ring of ``L`` records per request
    (``L`` a power of two, at least ``2 T``; the pool's ``ring_len``). Verify computes
    the window's outputs in closed form from the checkpoint, the committed history and
    the window, and writes the window's records after the history; commit only moves
    cursors; when the ring would overflow, a flush folds the committed raw records into
    the checkpoint through the exact recurrence at the next verify (DESIGN.md
    section 3). At small batches (the shape table's ``circular.replay_max_batch``) the
    verify replays history and window through the recurrence in one launch and commit
    flushes at every step. Plain decoding runs through the same ring
    (:meth:`~Strategy.decode`: a window of one token, DESIGN.md section 9).

    Committed states are exact (the fold replays raw records, bit for bit the
    recurrence's); verify outputs agree with the recurrence to rounding
    (``exact_outputs = False``), so a greedy near-tie can flip a token. Scratch per
    request and layer: ``L`` raw records plus their corrected deltas ``u``
    (:class:`CircularBuffers`). Select it with ``StatePool(..., strategy="circular",
    ring_len=L)``.
    """

    name = "circular"
    exact_outputs = False
    ring_decode = True
    Buffers = CircularBuffers
    buf: CircularBuffers

    #: the chunked verify kernels (ops/chunked.py) address checkpoints and ring entries
    #: by slot with packed strides
    checkpoint_packed = 4
    packed_reason = (
        "circular's chunked verify kernels (ops/chunked.py) address states and ring entries by slot with packed "
        "strides: hand in slot-packed tensors (any layer stride) or let the pool allocate them"
    )

    @classmethod
    def check_config(cls, *, window, ring_len, backend="reference"):
        if not isinstance(ring_len, int) or isinstance(ring_len, bool):
            raise ValueError(f"ring_len must be an int, got {ring_len!r}")
        _checks.power_of_two("ring_len", ring_len)
        if ring_len < 2 * window:
            raise ValueError(f"ring_len must be at least 2 * window = {2 * window}, got {ring_len}")
        if backend == "triton" and window > MAX_WINDOW_TRITON:
            raise ValueError(
                f"window must be at most {MAX_WINDOW_TRITON} for circular on the triton backend (the chunked "
                f"verify kernels hold a window block of 2 * max(8, T) rows), got {window}"
            )

    @classmethod
    def buffer_specs(cls, pool):
        s = pool.shape
        specs = record_specs(pool, pool.ring_len, committed=True, slot_packed=cls.packed_reason)
        specs["ring_u"] = BufferSpec((pool.ring_len, s.num_value_heads, s.head_v_dim), gate_dtype(pool), packed=4,
                                     why=cls.packed_reason)
        for name in ("write_pos", "cache_base", "is_flush"):
            specs[name] = BufferSpec((), torch.int32, per_layer=False, fill=0, packed=1,
                                     why="the cursor kernels index [slots] contiguously")
        specs["first_cycle"] = BufferSpec((), torch.int32, per_layer=False, fill=1, packed=1,
                                          why="the cursor kernels index [slots] contiguously")
        return specs

    def __init__(self, pool):
        super().__init__(pool)
        # Reset by the pool, advanced by the cursor kernels with clamped counts: the
        # chunked verify's guard need not read them back (ops/guards.py).
        guards.mark_maintained(self.buf.write_pos, self.buf.cache_base)

    #: Whether requests' first flushes are staggered by slot (ops/cursors.py), so that
    #: requests admitted together do not all flush at the same plain step.
    stagger_flushes = True

    #: Whether small batches take the one-launch path (ops/chunked.py ``"replay"``, with a
    #: flush at every commit); the open-loop control keeps the closed form and its flushes.
    small_batch_path = True

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        buf = self.buf
        args = (q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], buf.layer(layer), buf.ring_u[layer],
                batch.slots, batch.cu_seqlens, buf.write_pos, buf.cache_base, buf.is_flush)
        if batch.max_len == 1:
            # Every window one token (plain decoding through the ring, :meth:`~Strategy.decode`):
            # the window-1 closed form, one launch and no window system. Its flushes are the
            # same fold (bit for bit), its outputs and records the window op's to rounding
            # (tests/strategies/test_ring_decode_triton.py).
            return gdn_ring_decode(*args, backend=self.pool.backend)
        return gdn_chunked_window(*args, max_len=batch.max_len or self.pool.window,
                                  method=None if self.small_batch_path else "closed_form", backend=self.pool.backend)

    def _commit_states(self, batch, accepted, *, flush_every: bool | None = None):
        buf = self.buf
        advance_cursors(
            buf.write_pos, buf.cache_base, buf.is_flush, batch.slots, accepted,
            self.pool.window, self.pool.ring_len,
            flush_every=self._small_batch(batch) if flush_every is None else flush_every,
            first_cycle=buf.first_cycle if self.stagger_flushes else None, backend=self.pool.backend,
        )

    def _verify_tree(self, layer, q, k, v, a, b, A_log, dt_bias, batch, trees):
        """The closed form with the trees' ancestor mask (ops/chunked.py
        :func:`~replayssm.ops.chunked.gdn_tree_verify`): flush rows fold first, as for a
        chain; node ``i``'s record goes where a window's token ``i`` would."""
        buf = self.buf
        return gdn_tree_verify(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], buf.layer(layer), buf.ring_u[layer],
            batch.slots, buf.write_pos, buf.cache_base, buf.is_flush, trees, max_len=self.pool.window,
            method=None if self.small_batch_path else "closed_form", backend=self.pool.backend,
        )

    def _commit_tree_states(self, batch, trees, accepted, path, count):
        """Gather the accepted path's records (every layer, raw records and ``u``) from
        their window positions into consecutive ring positions after the history, then
        move the cursors by the path's length: the ring then holds what a chain step of
        those tokens would have left (the same records, so the same committed state)."""
        buf = self.buf
        # The window starts at cache_base + write_pos, for flush rows too (their verify
        # folded the history but left the cursors to the commit).
        start = (buf.cache_base + buf.write_pos) & (self.pool.ring_len - 1)
        compact_path([buf.ring_k, buf.ring_v, buf.ring_g, buf.ring_beta, buf.ring_u], batch.slots, path, count, start,
                     backend=self.pool.backend)
        self._commit_states(batch, count, flush_every=self._small_batch(batch) or self._small_tree(trees))

    def _small_batch(self, batch) -> bool:
        """Whether a step of this many rows runs the small-batch path: verify replays the
        exact recurrence in one launch (ops/chunked.py), so commit flushes every row at
        every step, keeping each history to one step's tokens. Decided by the shape
        table from the batch's row count, a host value, as the verify's choice is."""
        if not self.small_batch_path:
            return False
        s = self.pool.shape
        return replays_window(
            int(batch.slots.shape[0]), kd=s.head_k_dim, vd=s.head_v_dim,
            state_dtype=self.pool.checkpoints.dtype, device=self.pool.device,
        )

    def _small_tree(self, trees: DeviceTrees) -> bool:
        """Whether a tree step of these trees ran the trees' small-batch path (each leaf
        path replayed, history included, so the commit flushes every row as the chain's
        small-batch path does); the shape table decides from the requests' leaf paths."""
        if not self.small_batch_path:
            return False
        s = self.pool.shape
        batch, paths = trees.leaf_paths.shape[:2]
        return replays_tree(batch, paths, kd=s.head_k_dim, vd=s.head_v_dim,
                            state_dtype=self.pool.checkpoints.dtype, device=self.pool.device)

    def _abort_states(self, batch):
        if not self._verified:
            return  # no layer folded anything: the cursors still describe every checkpoint
        live = batch.live_slots
        if not live:
            return
        idx = torch.tensor(live, dtype=torch.long, device=self.pool.device)
        # Finish the flush for the layers the step did not reach: the same exact fold
        # the verify of those layers would have run.
        unverified = [layer for layer in range(self.pool.num_layers) if layer not in self._verified]
        self._fold_rows(live, self.buf.is_flush[idx] != 0, unverified)

    def _fold_history(self, slots):
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.pool.device)
        has_history = self.buf.write_pos[idx] > 0
        if bool(has_history.any()):  # one host read; fresh requests (the usual case) launch nothing
            self._fold_rows(slots, has_history, range(self.pool.num_layers))

    def _fold_rows(self, live, rows, layers) -> None:
        """Fold the committed history of the ``live`` slots where ``rows`` (a bool mask)
        into the checkpoints of ``layers`` (the other layers' already hold it) with the
        exact fold, and move their cursors past it: every checkpoint is then the
        committed state and the history is empty. The committed state does not change."""
        buf, dev = self.buf, self.pool.device
        idx = torch.tensor(live, dtype=torch.long, device=dev)
        wp, base = buf.write_pos[idx], buf.cache_base[idx]
        count = torch.where(rows, wp, torch.zeros_like(wp))
        at = guards.host_index(live, dev)
        layers = list(layers)
        # one launch for every layer, else one per layer
        parts = [slice(None)] if len(layers) == self.pool.num_layers else [slice(j, j + 1) for j in layers]
        for one in parts:
            gdn_fold(self.pool.checkpoints[one], *(x[one] for x in buf.all_layers()), at, base, count,
                     backend=self.pool.backend)
        L = self.pool.ring_len
        buf.cache_base[idx] = torch.where(rows, (base + wp) & (L - 1), base)
        buf.write_pos[idx] = torch.where(rows, torch.zeros_like(wp), wp)
        buf.is_flush[idx] = torch.where(rows, torch.zeros_like(wp), buf.is_flush[idx])

    def _check_fresh(self, slots):
        if not slots:
            return
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.pool.device)
        wp = self.buf.write_pos[idx].tolist()
        stale = [s for s, n in zip(slots, wp) if n != 0]
        if stale:
            raise StepProtocolError(
                f"slots {stale} have committed history in their ring; prefill and load_states need fresh "
                "requests (from alloc or reset)"
            )

    def committed_state(self, layer, slots):
        """Checkpoint + committed history, folded exactly into a copy (see the module
        notes for a flush row between its verify and its commit)."""
        slots = [self.pool.check_live(s) for s in slots]
        state = super().committed_state(layer, slots)
        buf, dev = self.buf, self.pool.device
        idx = torch.tensor(list(slots), dtype=torch.long, device=dev)
        local = guards.host_index(range(len(idx)), dev)
        count = buf.write_pos[idx]
        if layer in self._verified:
            # This layer's verify already folded the history of the step's flush rows.
            in_step = torch.tensor([s in self.pool.step_slots for s in slots], dtype=torch.bool, device=dev)
            count = torch.where(in_step & (buf.is_flush[idx] != 0), torch.zeros_like(count), count)
        gdn_fold(
            state[None], buf.ring_k[layer, idx][None], buf.ring_v[layer, idx][None],
            buf.ring_g[layer, idx][None], buf.ring_beta[layer, idx][None],
            local, buf.cache_base[idx], count, backend=self.pool.backend,
        )
        return state
