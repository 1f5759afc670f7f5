"""``fold``: fold-every-commit.

Verify runs the recurrence from the checkpoint without writing any state; as a side
channel it stores the window's raw records (pre-norm ``k`` per key head, ``v``, fp32
``g`` and ``beta``) in a ``T``-record ring. Commit replays the first ``n`` records of
every layer through the exact recurrence into the checkpoint, in one call. State traffic
per layer-step: 1 read at verify, 1 read + 1 write at commit. Exact.
"""

from __future__ import annotations

import torch

from ..ops.fold import gdn_fold
from ..ops.records import RawRecords
from ..ops.recurrent import gdn_recurrence
from .base import Strategy


def record_specs(pool, ring_len: int) -> dict:
    """Buffers of a raw-record ring of ``ring_len`` entries per request and layer."""
    from ..state.pool import BufferSpec

    s = pool.shape
    return {
        "ring_k": BufferSpec((ring_len, s.num_heads, s.head_k_dim), pool.act_dtype),
        "ring_v": BufferSpec((ring_len, s.num_value_heads, s.head_v_dim), pool.act_dtype),
        "ring_g": BufferSpec((ring_len, s.num_value_heads), torch.float32),
        "ring_beta": BufferSpec((ring_len, s.num_value_heads), torch.float32),
    }


def layer_records(buffers: dict, layer: int) -> RawRecords:
    return RawRecords(buffers["ring_k"][layer], buffers["ring_v"][layer], buffers["ring_g"][layer], buffers["ring_beta"][layer])


class FoldStrategy(Strategy):
    name = "fold"

    @classmethod
    def buffer_specs(cls, pool):
        return record_specs(pool, pool.window)

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.buffers["checkpoints"][layer], batch.slots, batch.cu_seqlens,
            records=layer_records(self.buffers, layer), backend=self.pool.backend,
        )

    def _commit_states(self, batch, accepted):
        buf = self.buffers
        gdn_fold(
            buf["checkpoints"], buf["ring_k"], buf["ring_v"], buf["ring_g"], buf["ring_beta"],
            batch.slots, torch.zeros_like(accepted), accepted, backend=self.pool.backend,
        )
