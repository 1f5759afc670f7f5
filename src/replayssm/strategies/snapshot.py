"""``snapshot``: the baseline that engines ship.

Verify runs the recurrence from the checkpoint and writes the state after every window
position to a per-request scratch ``[T, HV, V, K]``; commit copies ``S_n`` into the
checkpoint. State traffic per layer-step: 1 read + T writes at verify, 1 read + 1 write
at commit. Exact: the committed state is the recurrence's own.
"""

from __future__ import annotations

from ..ops.recurrent import gdn_recurrence
from ..ops.snapshot import snapshot_commit
from .base import Strategy


class SnapshotStrategy(Strategy):
    name = "snapshot"

    @classmethod
    def buffer_specs(cls, pool):
        from ..state.pool import BufferSpec

        s = pool.shape
        return {"snapshots": BufferSpec((pool.window, s.num_value_heads, s.head_v_dim, s.head_k_dim), pool.state_dtype)}

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.buffers["checkpoints"][layer], batch.slots, batch.cu_seqlens,
            snapshots=self.buffers["snapshots"][layer], backend=self.pool.backend,
        )

    def _commit_states(self, batch, accepted):
        snapshot_commit(self.buffers["checkpoints"], self.buffers["snapshots"], batch.slots, accepted, backend=self.pool.backend)
