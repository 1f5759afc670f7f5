"""``fold``: fold-every-commit.

Verify runs the recurrence from the checkpoint without writing any state; as a side
channel it stores the window's raw records (pre-norm ``k`` per key head, ``v``, fp32
``g`` and ``beta``) in a ``T``-record ring. Commit replays the first ``n`` records of
every layer through the exact recurrence into the checkpoint, in one call. State traffic
per layer-step: 1 read at verify, 1 read + 1 write at commit. Exact. Abort has nothing
to undo: the ring is scratch between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.fold import gdn_fold
from ..ops.records import RawRecords
from ..ops.recurrent import gdn_recurrence
from ..ops.tree_ops import compact_path, gdn_tree_recurrence
from ..state.layout import BufferSpec
from .base import Strategy, StrategyBuffers


def gate_dtype(pool) -> torch.dtype:
    """dtype of the ring's gates (and ``circular``'s ``u``): float32, or float64 in a
    float64 pool, whose gates are float64 when its activations are (a float32 ring
    would round them and the pool would no longer be exact)."""
    return torch.float64 if pool.state_dtype == torch.float64 else torch.float32


def record_specs(pool, ring_len: int, *, committed: bool, slot_packed: str = "") -> dict[str, BufferSpec]:
    """Buffers of a raw-record ring of ``ring_len`` entries per request and layer.

    Layout: any strides on the layer, slot, position and head axes, ``k`` and ``v``
    contiguous along their last axis (SGLang's ``[layers, slots, heads, R, dim]`` rings
    fit as ``.transpose(2, 3)`` views). With ``slot_packed`` (the reason) everything
    below the layer axis must be packed instead.
    """
    s = pool.shape
    gd = gate_dtype(pool)

    def spec(shape, dtype, inner_packed, alt_dtype=None):
        packed = len(shape) + 1 if slot_packed else inner_packed
        return BufferSpec(shape, dtype, committed=committed, packed=packed, why=slot_packed, alt_dtype=alt_dtype)

    # Keys normalised in the gates' dtype; a caller's ring may hold them raw in 16 bits
    # (SGLang's layout), which every kernel reads as raw (ops.records.keys_normalized).
    raw_keys = pool.act_dtype if pool.act_dtype in (torch.bfloat16, torch.float16) else None
    return {
        "ring_k": spec((ring_len, s.num_heads, s.head_k_dim), gd, 1, raw_keys),
        "ring_v": spec((ring_len, s.num_value_heads, s.head_v_dim), pool.act_dtype, 1),
        "ring_g": spec((ring_len, s.num_value_heads), gd, 0),
        "ring_beta": spec((ring_len, s.num_value_heads), gd, 0),
    }


@dataclass(frozen=True)
class RecordBuffers(StrategyBuffers):
    """A raw-record ring per layer: ``ring_k [layers, slots, R, H, K]`` (each key
    normalised, :func:`~replayssm.ops.records.keys_normalized`), ``ring_v [layers, slots,
    R, HV, V]`` (activation dtype), ``ring_g``, ``ring_beta`` ``[layers, slots, R, HV]``;
    keys and gates float32 (float64 in a float64 pool)."""

    ring_k: torch.Tensor
    ring_v: torch.Tensor
    ring_g: torch.Tensor
    ring_beta: torch.Tensor

    def layer(self, layer: int) -> RawRecords:
        """The ring of one layer, as the ops take it."""
        return RawRecords(self.ring_k[layer], self.ring_v[layer], self.ring_g[layer], self.ring_beta[layer])

    def all_layers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ring_k, self.ring_v, self.ring_g, self.ring_beta


class FoldStrategy(Strategy):
    """Fold every commit: verify runs the exact recurrence without writing any state
    and records the window's raw inputs (pre-norm ``k``, ``v``, fp32 ``g``, ``beta``)
    as a side channel; commit replays the first ``n`` records through the same
    recurrence into the checkpoint, every layer in one launch.

    Exact: committed states and verify outputs are the recurrence's, bit for bit (the
    side channel changes no output). Scratch per request and layer: a ring of ``T``
    raw records (:class:`RecordBuffers`), a small fraction of one state. Select it with
    ``StatePool(..., strategy="fold")``.
    """

    name = "fold"
    Buffers = RecordBuffers
    buf: RecordBuffers

    def __init__(self, pool):
        super().__init__(pool)
        self._zeros: dict[tuple, torch.Tensor] = {}  # commit's first ring positions, per row count

    @classmethod
    def buffer_specs(cls, pool):
        return record_specs(pool, pool.window, committed=False)

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        return gdn_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], batch.slots, batch.cu_seqlens,
            records=self.buf.layer(layer), max_len=batch.max_len or None, backend=self.pool.backend,
        )

    def _commit_states(self, batch, accepted):
        gdn_fold(
            self.pool.checkpoints, *self.buf.all_layers(),
            batch.slots, self._first_positions(accepted), accepted, backend=self.pool.backend,
        )

    def _first_positions(self, accepted: torch.Tensor) -> torch.Tensor:
        """Zeros like ``accepted``: every row's records start at ring position 0. Kept
        per row count once made outside a CUDA graph capture (a captured step's eager
        warm-up makes them), so a captured commit has no fill kernel."""
        key = (accepted.shape, accepted.dtype, accepted.device)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = torch.zeros_like(accepted)
            if not (accepted.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._zeros[key] = zeros
        return zeros

    def _verify_tree(self, layer, q, k, v, a, b, A_log, dt_bias, batch, trees):
        """Each node by the exact step from its parent's state (:func:`~replayssm.ops.
        tree_ops.gdn_tree_recurrence`), no state written; node ``i``'s raw record at ring
        position ``i``."""
        return gdn_tree_recurrence(
            q, k, v, a, b, A_log, dt_bias, self.pool.checkpoints[layer], batch.slots, trees,
            records=self.buf.layer(layer), backend=self.pool.backend,
        )

    def _commit_tree_states(self, batch, trees, accepted, path, count):
        """Gather the accepted path's records to positions ``0..depth`` and replay them:
        the chain commit of the path, bit for bit the path recurrence."""
        compact_path(list(self.buf.all_layers()), batch.slots, path, count, backend=self.pool.backend)
        self._commit_states(batch, count)
