"""``circular``: the ReplaySSM ring with a closed-loop exact fold.

Per request a frozen checkpoint plus a ring of ``L`` records and three cursors
(``write_pos``, ``cache_base``, ``is_flush``; see :mod:`replayssm.ops.cursors`).
Verify computes the window's outputs in closed form from checkpoint + committed history
+ window (DESIGN.md section 2) and writes the window's records after the history.
Commit only moves cursors. A row flagged ``is_flush`` folds its history into the
checkpoint at its next verify by replaying the raw records through the exact
recurrence, so the committed state equals the recurrence's bit for bit; the outputs
come from the closed form and agree with the recurrence to rounding.
"""

from __future__ import annotations

import torch

from ..ops import _checks
from ..ops.chunked import gdn_chunked_window
from ..ops.cursors import advance_cursors
from ..ops.fold import gdn_fold
from .base import Strategy, StepProtocolError
from .fold import layer_records, record_specs


class CircularStrategy(Strategy):
    name = "circular"
    exact_outputs = False

    @classmethod
    def check_config(cls, *, window, ring_len):
        if not isinstance(ring_len, int) or isinstance(ring_len, bool):
            raise ValueError(f"ring_len must be an int, got {ring_len!r}")
        _checks.power_of_two("ring_len", ring_len)
        if ring_len < 2 * window:
            raise ValueError(f"ring_len must be at least 2 * window = {2 * window}, got {ring_len}")

    @classmethod
    def buffer_specs(cls, pool):
        from ..state.pool import BufferSpec

        s = pool.shape
        specs = record_specs(pool, pool.ring_len)
        specs["ring_u"] = BufferSpec((pool.ring_len, s.num_value_heads, s.head_v_dim), torch.float32)
        for name in ("write_pos", "cache_base", "is_flush"):
            specs[name] = BufferSpec((), torch.int32, per_layer=False, fill=0)
        return specs

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        buf = self.buffers
        return gdn_chunked_window(
            q, k, v, a, b, A_log, dt_bias, buf["checkpoints"][layer], layer_records(buf, layer), buf["ring_u"][layer],
            batch.slots, batch.cu_seqlens, buf["write_pos"], buf["cache_base"], buf["is_flush"],
            max_len=self.pool.window, backend=self.pool.backend,
        )

    def _commit_states(self, batch, accepted):
        buf = self.buffers
        advance_cursors(
            buf["write_pos"], buf["cache_base"], buf["is_flush"], batch.slots, accepted,
            self.pool.window, self.pool.ring_len, backend=self.pool.backend,
        )

    def _check_prefill_rows(self, batch):
        wp = self.buffers["write_pos"][batch.slots[batch.slots >= 0].long()]
        if bool((wp != 0).any()):
            raise StepProtocolError("prefill needs requests with an empty ring (fresh from alloc or reset)")

    def committed_state(self, layer, slots):
        """Checkpoint + committed history, folded exactly into a copy."""
        state = super().committed_state(layer, slots)
        buf = self.buffers
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.pool.device)
        local = torch.arange(len(idx), dtype=torch.int32, device=self.pool.device)
        gdn_fold(
            state[None], buf["ring_k"][layer, idx][None], buf["ring_v"][layer, idx][None],
            buf["ring_g"][layer, idx][None], buf["ring_beta"][layer, idx][None],
            local, buf["cache_base"][idx], buf["write_pos"][idx], backend=self.pool.backend,
        )
        return state
