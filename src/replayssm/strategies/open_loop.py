"""The open-loop control: ``circular`` with the seed's inexact flush, for drift checks.

Not a strategy to use (it is not registered): it exists so that the drift tools can
show what DESIGN.md section 3 forbids. Its flush folds the ring's *corrected deltas*
``u`` (kept in the activation dtype, rounded right after the verify that wrote them)
into the checkpoint through the closed form, instead of replaying the raw records
through the exact recurrence, so rounding accumulates in the committed state.

Used by ``replayssm drift`` (one layer, teacher-forced) and ``replayssm closed-loop``
(a whole model, free-running greedy decoding).
"""

from __future__ import annotations

import torch

from ..ops import advance_cursors_reference
from ..ops.chunked import apply_history
from ..ops.gates import expand_heads
from ..ops.records import unit_keys
from .circular import CircularStrategy


def open_loop_fold(S: torch.Tensor, u: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The open-loop fold of ``c`` history records into a state ``S`` (``[HV, V, K]``):

        S <- exp(G_tot) S + sum_c exp(G_tot - G_c) u_c k^_c^T

    This is the closed form's own way of applying checkpoint + history to a vector
    (:func:`replayssm.ops.chunked.apply_history`), applied to the basis vectors, so the
    control folds exactly what ``circular``'s verify reads, with no fold of its own.
    ``u`` are the ring's corrected deltas, ``k`` the raw keys (``[c, H, K]``), ``g`` the
    log decays (``[c, HV]``). Computed in float32 (float64 for a float64 ``S``).
    """
    if u.shape[0] == 0:
        return S
    dtype = torch.float64 if S.dtype == torch.float64 else torch.float32
    hv, _, kd = S.shape
    k_hat = expand_heads(unit_keys(k, dtype), hv)  # [c, HV, K]
    basis = torch.eye(kd, dtype=dtype, device=S.device)[:, None, :].expand(kd, hv, kd)  # [K, HV, K]
    columns = apply_history(S.to(dtype), u.to(dtype), k_hat, g.to(dtype), basis)  # [K, HV, V]: S e_k
    return columns.permute(1, 2, 0).to(S.dtype)


class OpenLoopControlStrategy(CircularStrategy):
    """``circular`` whose flush is :func:`open_loop_fold` (see the module docstring).

    At a step's first GDN verify, each live row flagged ``is_flush`` gets the history
    of every layer folded open-loop into its checkpoints, and its cursors moved past
    that history by the library's cursor op as a commit of zero tokens on a flush row
    (``cache_base += write_pos``, ``write_pos = 0``): the verifies then see an empty
    history and write the window where the exact flush would have. After each layer's
    verify its ring ``u`` is rounded to the activation dtype, so history reads and the
    fold use rounded deltas (a no-op in float32).
    """

    name = "open-loop"
    exact_outputs = False
    small_batch_path = False  # the seed's schedule: closed-form reads of u, flushes when the ring fills

    def _history(self, layer: int, slot: int):
        buf, L = self.buf, self.pool.ring_len
        wp, base = int(buf.write_pos[slot]), int(buf.cache_base[slot])
        pos = [(base + c) & (L - 1) for c in range(wp)]
        return buf.ring_u[layer, slot, pos], buf.ring_k[layer, slot, pos], buf.ring_g[layer, slot, pos]

    def _open_loop_flush(self, batch) -> None:
        buf, ckpt = self.buf, self.pool.checkpoints
        live = batch.live_slots
        flush = [s for s, f in zip(live, buf.is_flush[live].tolist()) if f]
        if not flush:
            return
        for layer in range(self.pool.num_layers):
            for s in flush:
                ckpt[layer, s] = open_loop_fold(ckpt[layer, s], *self._history(layer, s))
        rows = torch.tensor(flush, dtype=torch.int32, device=self.pool.device)
        advance_cursors_reference(buf.write_pos, buf.cache_base, buf.is_flush, rows, torch.zeros_like(rows),
                                  self.pool.window, self.pool.ring_len)

    def verify(self, layer, q, k, v, a, b, batch):
        if not self._verified:  # the step's first GDN layer: every layer's history is complete
            self._open_loop_flush(batch)
        o = super().verify(layer, q, k, v, a, b, batch)
        ring_u = self.buf.ring_u[layer]
        ring_u.copy_(ring_u.to(self.pool.act_dtype).to(ring_u.dtype))
        return o

    def committed_state(self, layer, slots):
        """Checkpoint + history folded the open-loop way (between steps only)."""
        if self.step_open:
            raise RuntimeError("the control's committed state is read between steps only")
        self.pool.check_layer(layer)
        ckpt = self.pool.checkpoints[layer]
        return torch.stack([open_loop_fold(ckpt[s].clone(), *self._history(layer, s)) for s in slots])

    @classmethod
    def install(cls, engine) -> "OpenLoopControlStrategy":
        """Replace the strategy of a fresh ``circular`` engine's pool with the control."""
        if engine.strategy_name != "circular":
            raise ValueError(f"the control needs a circular engine, got {engine.strategy_name!r}")
        if engine.pool.live_slots:
            raise ValueError("install the control before any slot is allocated")
        engine.pool.strategy = cls(engine.pool)
        return engine.pool.strategy
