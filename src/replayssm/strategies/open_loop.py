"""The open-loop control: ``circular`` with the seed's inexact flush, for drift checks.

Not a strategy to use (it is not registered): it exists so that the drift tools can
show what DESIGN.md section 3 forbids. Its flush folds the ring's *corrected deltas*
``u`` (kept in the activation dtype, rounded right after the verify that wrote them)
into the checkpoint through the closed form, instead of replaying the raw records
through the exact recurrence, so rounding accumulates in the committed state.

One GDN layer only: the flush of a row and its cursor move happen together before the
layer's verify.
"""

from __future__ import annotations

import torch

from ..ops import advance_cursors_reference
from ..ops.chunked import apply_history
from ..ops.gates import expand_heads, l2_normalize
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
    k_hat = expand_heads(l2_normalize(k, dtype=dtype), hv)  # [c, HV, K]
    basis = torch.eye(kd, dtype=dtype, device=S.device)[:, None, :].expand(kd, hv, kd)  # [K, HV, K]
    columns = apply_history(S.to(dtype), u.to(dtype), k_hat, g.to(dtype), basis)  # [K, HV, V]: S e_k
    return columns.permute(1, 2, 0).to(S.dtype)


class OpenLoopControlStrategy(CircularStrategy):
    """``circular`` whose flush is :func:`open_loop_fold` (see the module docstring).

    Before a verify, each live row due to flush gets its history folded open-loop into
    its checkpoint, and its cursors moved by the library's cursor op as a commit of zero
    tokens on a flush row (``cache_base += write_pos``, ``write_pos = 0``): the verify
    then sees an empty history and writes the window's records where the exact flush
    would have. After the verify, the new records' ``u`` are rounded to the activation
    dtype.
    """

    name = "open-loop-control"
    exact_outputs = False

    def __init__(self, pool):
        if pool.num_layers != 1:
            raise ValueError(f"the open-loop control keeps one GDN layer, the pool has {pool.num_layers}")
        super().__init__(pool)

    def _history(self, slot: int, layer: int = 0):
        buf, L = self.buf, self.pool.ring_len
        wp, base = int(buf.write_pos[slot]), int(buf.cache_base[slot])
        pos = [(base + c) & (L - 1) for c in range(wp)]
        return buf.ring_u[layer, slot, pos], buf.ring_k[layer, slot, pos], buf.ring_g[layer, slot, pos]

    def _verify(self, layer, q, k, v, a, b, A_log, dt_bias, batch):
        buf, ckpt = self.buf, self.pool.checkpoints
        live = batch.live_slots
        flush = [s for s, f in zip(live, buf.is_flush[live].tolist()) if f]
        for s in flush:
            ckpt[layer, s] = open_loop_fold(ckpt[layer, s], *self._history(s, layer))
        if flush:
            rows = torch.tensor(flush, dtype=torch.int32, device=self.pool.device)
            advance_cursors_reference(buf.write_pos, buf.cache_base, buf.is_flush, rows, torch.zeros_like(rows),
                                      self.pool.window, self.pool.ring_len)
        o = super()._verify(layer, q, k, v, a, b, A_log, dt_bias, batch)
        buf.ring_u.copy_(buf.ring_u.to(self.pool.act_dtype).to(buf.ring_u.dtype))
        return o

    def committed_state(self, layer, slots):
        self.pool.check_layer(layer)
        ckpt = self.pool.checkpoints
        return torch.stack([open_loop_fold(ckpt[layer, s].clone(), *self._history(s, layer)) for s in slots])
