"""``snapshot``: the baseline that engines ship.

Verify runs the recurrence from the checkpoint and writes the state after every window
position to a per-request scratch ``[T, HV, V, K]``; commit copies ``S_n`` into the
checkpoint. State traffic per layer-step: 1 read + T writes at verify, 1 read + 1 write
at commit. Exact: the committed state is the recurrence's own. Abort has nothing to
undo: verify writes scratch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.recurrent import gdn_recurrence
from ..ops.snapshot import snapshot_commit
from ..ops.tree_ops import gdn_tree_recurrence
from ..state.layout import BufferSpec
from .base import Strategy, StrategyBuffers


@dataclass(frozen=True)
class SnapshotBuffers(StrategyBuffers):
    """``snapshots [layers, slots, T, HV, V, K]``: the state after each window position."""

    snapshots: torch.Tensor


class SnapshotStrategy(Strategy):
    """The baseline that engines ship: verify runs the exact recurrence over the window
    and writes the state after every position to a scratch buffer; commit copies the
    snapshot after the ``n``-th accepted token into the checkpoint.

    Exact: committed states and verify outputs are the recurrence's, bit for bit.
    Scratch per request and layer: ``T`` states (:class:`SnapshotBuffers`), which is
    what makes it costly at large batch: ``T`` state writes per layer-step.
    Select it with ``StatePool(..., strategy="snapshot")``.
    """

    name = "snapshot"
    Buffers = SnapshotBuffers
    buf: SnapshotBuffers

    @classmethod
    def buffer_specs(cls, pool):
        s = pool.shape
        shape = (pool.window, s.num_value_heads, s.head_v_dim, s.head_k_dim)
        return {"snapshots": BufferSpec(shape, pool.state_dtype, committed=False, packed=4,
                                        why="each slot's T states are written as one packed block")}

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], batch.slots, batch.cu_seqlens,
            snapshots=self.buf.snapshots[layer], max_len=batch.max_len or None, backend=self.pool.backend,
        )

    def _commit_states(self, batch, accepted):
        snapshot_commit(self.pool.checkpoints, self.buf.snapshots, batch.slots, accepted, backend=self.pool.backend)

    def _verify_tree(self, layer, q, k, v, a, b, A_log, dt_bias, batch, trees):
        """Per-node states (the peer engines' tree verify): node ``i``'s state, its
        parent's advanced by its token, goes to scratch position ``i``."""
        return gdn_tree_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], batch.slots, trees,
            snapshots=self.buf.snapshots[layer], backend=self.pool.backend,
        )

    def _commit_tree_states(self, batch, trees, accepted, path, count):
        """Copy the accepted node's state (scratch position ``accepted``)."""
        self._commit_states(batch, accepted + 1)
